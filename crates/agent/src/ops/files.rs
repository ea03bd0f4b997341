//! Single files and filesystem operations.
//!
//! Uploads are atomic: bytes go to a temporary file in the target's
//! directory, which gets its owner and mode, is fsynced, and is renamed over
//! the target (then the directory is fsynced). A transfer that fails or is
//! abandoned removes the temporary file, so no half-written file is left.

use std::fs::{self, Metadata};
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tine_proto::agent::mux::{Inbound, StreamReceiver, StreamSender};
use tine_proto::agent::{
    Channel, DirEntry, ErrorCode, FileAttrs, FileKind, FileStat, MkdirRequest, PathRequest,
    RemoveRequest, Response, StatRequest, UploadRequest,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::error::OpError;

/// Bytes read from a file per data frame.
const FILE_CHUNK: usize = 128 << 10;
/// Entries per [`Response::Entries`] batch.
const LIST_BATCH: usize = 512;

/// Checks that a request path is absolute and usable.
pub(crate) fn absolute(path: &str) -> Result<PathBuf, OpError> {
    if path.is_empty() || path.contains('\0') || !path.starts_with('/') {
        return Err(OpError::new(
            ErrorCode::InvalidPath,
            format!("path {path:?} is not absolute"),
        ));
    }
    Ok(PathBuf::from(path))
}

/// Runs blocking filesystem work off the async threads.
pub(crate) async fn blocking<T, F>(f: F) -> Result<T, OpError>
where
    F: FnOnce() -> Result<T, OpError> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| OpError::new(ErrorCode::Io, format!("worker failed: {e}")))?
}

/// Protocol form of file metadata.
pub(crate) fn file_stat(meta: &Metadata, path: &Path) -> FileStat {
    let file_type = meta.file_type();
    let kind = if file_type.is_symlink() {
        FileKind::Symlink
    } else if file_type.is_dir() {
        FileKind::Dir
    } else if file_type.is_file() {
        FileKind::File
    } else {
        FileKind::Other
    };
    let symlink_target = if kind == FileKind::Symlink {
        fs::read_link(path)
            .ok()
            .map(|t| t.to_string_lossy().into_owned())
    } else {
        None
    };
    FileStat {
        kind,
        size: meta.len(),
        mode: meta.mode() & 0o7777,
        uid: meta.uid(),
        gid: meta.gid(),
        mtime_secs: meta.mtime(),
        mtime_nanos: meta.mtime_nsec().clamp(0, 999_999_999) as u32,
        symlink_target,
    }
}

/// Gives an open file (or directory) its owner, then its mode (chown clears
/// set-id bits, so the mode comes last).
pub(crate) fn apply_attrs(file: &fs::File, attrs: &FileAttrs, default_mode: u32) -> io::Result<()> {
    if attrs.uid.is_some() || attrs.gid.is_some() {
        std::os::unix::fs::fchown(file, attrs.uid, attrs.gid)?;
    }
    let mode = attrs.mode.unwrap_or(default_mode) & 0o7777;
    file.set_permissions(fs::Permissions::from_mode(mode))
}

/// Fsyncs a directory so that a rename in it is durable.
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    fs::File::open(dir)?.sync_all()
}

/// Receives a file on the data channel and commits it atomically.
pub(crate) async fn upload(
    req: UploadRequest,
    mut rx: StreamReceiver,
) -> Result<Response, OpError> {
    let path = absolute(&req.path)?;
    let (Some(parent), Some(_)) = (path.parent(), path.file_name()) else {
        return Err(OpError::new(
            ErrorCode::InvalidPath,
            format!("{} names no file", path.display()),
        ));
    };
    let parent = parent.to_path_buf();
    let (attrs, mkdirs, target) = (req.attrs.clone(), req.mkdirs, path.clone());
    let (file, temp_path) = blocking(move || {
        if mkdirs {
            fs::create_dir_all(&parent).map_err(|e| OpError::path("create", &parent, &e))?;
        }
        if let Ok(meta) = fs::metadata(&target) {
            if meta.is_dir() {
                return Err(OpError::new(
                    ErrorCode::AlreadyExists,
                    format!("{} is a directory", target.display()),
                ));
            }
        }
        let temp = tempfile::Builder::new()
            .prefix(".tine-upload-")
            .tempfile_in(&parent)
            .map_err(|e| OpError::path("create a temporary file in", &parent, &e))?;
        apply_attrs(temp.as_file(), &attrs, 0o644)
            .map_err(|e| OpError::path("set owner and mode of", temp.path(), &e))?;
        Ok(temp.into_parts())
    })
    .await?;
    // From here on `temp_path` deletes the file when dropped, on every
    // error path and when this task is cancelled.
    let mut file = tokio::fs::File::from_std(file);
    let mut bytes: u64 = 0;
    loop {
        match rx.recv().await {
            Some(Inbound::Data(Channel::Data, chunk)) => {
                bytes += chunk.len() as u64;
                if let Some(size) = req.size {
                    if bytes > size {
                        return Err(OpError::bad_request(format!(
                            "upload is longer than the announced {size} bytes"
                        )));
                    }
                }
                file.write_all(&chunk)
                    .await
                    .map_err(|e| OpError::path("write", &temp_path, &e))?;
            }
            Some(Inbound::Eof(Channel::Data)) => break,
            Some(_) => {}
            None => return Err(OpError::cancelled()),
        }
    }
    if let Some(size) = req.size {
        if bytes != size {
            return Err(OpError::bad_request(format!(
                "upload ended after {bytes} of the announced {size} bytes"
            )));
        }
    }
    file.flush()
        .await
        .map_err(|e| OpError::path("write", &temp_path, &e))?;
    file.sync_all()
        .await
        .map_err(|e| OpError::path("fsync", &temp_path, &e))?;
    drop(file);
    blocking(move || {
        temp_path
            .persist(&path)
            .map_err(|e| OpError::path("rename onto", &path, &e.error))?;
        if let Some(parent) = path.parent() {
            sync_dir(parent).map_err(|e| OpError::path("fsync", parent, &e))?;
        }
        Ok(())
    })
    .await?;
    Ok(Response::Written { bytes })
}

/// Sends a regular file: [`Response::FileInfo`], data frames, EOF, then
/// [`Response::Ok`].
pub(crate) async fn download(req: PathRequest, tx: StreamSender) -> Result<Response, OpError> {
    let path = absolute(&req.path)?;
    let mut file = tokio::fs::File::open(&path)
        .await
        .map_err(|e| OpError::path("open", &path, &e))?;
    let meta = file
        .metadata()
        .await
        .map_err(|e| OpError::path("stat", &path, &e))?;
    if !meta.is_file() {
        return Err(OpError::bad_request(format!(
            "{} is not a regular file",
            path.display()
        )));
    }
    tx.send_msg(&Response::FileInfo(file_stat(&meta, &path)))
        .await
        .map_err(|_| OpError::cancelled())?;
    loop {
        let mut buf = vec![0u8; FILE_CHUNK];
        let n = file
            .read(&mut buf)
            .await
            .map_err(|e| OpError::path("read", &path, &e))?;
        if n == 0 {
            break;
        }
        buf.truncate(n);
        tx.send_data_vec(Channel::Data, buf)
            .await
            .map_err(|_| OpError::cancelled())?;
    }
    tx.send_eof(Channel::Data)
        .await
        .map_err(|_| OpError::cancelled())?;
    Ok(Response::Ok)
}

/// Stats one path.
pub(crate) async fn stat(req: StatRequest) -> Result<Response, OpError> {
    let path = absolute(&req.path)?;
    blocking(move || {
        let meta = if req.follow {
            fs::metadata(&path)
        } else {
            fs::symlink_metadata(&path)
        }
        .map_err(|e| OpError::path("stat", &path, &e))?;
        Ok(Response::Stat(file_stat(&meta, &path)))
    })
    .await
}

/// Lists a directory in batches of [`Response::Entries`], sorted by name.
pub(crate) async fn list(req: PathRequest, tx: StreamSender) -> Result<Response, OpError> {
    let path = absolute(&req.path)?;
    let entries = blocking(move || {
        let mut entries = Vec::new();
        for entry in fs::read_dir(&path).map_err(|e| OpError::path("list", &path, &e))? {
            let entry = entry.map_err(|e| OpError::path("list", &path, &e))?;
            let full = entry.path();
            // An entry removed while listing is skipped.
            let Ok(meta) = fs::symlink_metadata(&full) else {
                continue;
            };
            entries.push(DirEntry {
                name: entry.file_name().to_string_lossy().into_owned(),
                stat: file_stat(&meta, &full),
            });
        }
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(entries)
    })
    .await?;
    for batch in entries.chunks(LIST_BATCH) {
        tx.send_msg(&Response::Entries {
            entries: batch.to_vec(),
        })
        .await
        .map_err(|_| OpError::cancelled())?;
    }
    Ok(Response::Ok)
}

/// Creates a directory (with `parents`, like `mkdir -p`).
pub(crate) async fn mkdir(req: MkdirRequest) -> Result<Response, OpError> {
    let path = absolute(&req.path)?;
    blocking(move || {
        let result = if req.parents {
            fs::create_dir_all(&path)
        } else {
            fs::create_dir(&path)
        };
        result.map_err(|e| OpError::path("create directory", &path, &e))?;
        let attrs = &req.attrs;
        if attrs.mode.is_some() || attrs.uid.is_some() || attrs.gid.is_some() {
            let dir = fs::File::open(&path).map_err(|e| OpError::path("open", &path, &e))?;
            apply_attrs(&dir, attrs, 0o755)
                .map_err(|e| OpError::path("set owner and mode of", &path, &e))?;
        }
        Ok(Response::Ok)
    })
    .await
}

/// Removes a file, symlink or (empty, or with `recursive` any) directory.
pub(crate) async fn remove(req: RemoveRequest) -> Result<Response, OpError> {
    let path = absolute(&req.path)?;
    if path.parent().is_none() {
        return Err(OpError::new(ErrorCode::InvalidPath, "refusing to remove /"));
    }
    blocking(move || {
        let meta = fs::symlink_metadata(&path).map_err(|e| OpError::path("remove", &path, &e))?;
        let result = if !meta.is_dir() {
            fs::remove_file(&path)
        } else if req.recursive {
            fs::remove_dir_all(&path)
        } else {
            fs::remove_dir(&path)
        };
        result.map_err(|e| OpError::path("remove", &path, &e))?;
        Ok(Response::Ok)
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_negative_absolute_relative_path_is_invalid() {
        let err = absolute("etc/passwd").expect_err("relative");
        assert_eq!(err.code, ErrorCode::InvalidPath);
        assert!(absolute("").is_err());
        assert!(absolute("/a\0b").is_err());
        assert!(absolute("/etc").is_ok());
    }
}
