//! Directory trees as tar streams.
//!
//! Unpacking refuses, with [`ErrorCode::InvalidPath`], any entry whose path
//! is absolute or has a `..` component, and any entry that would be written
//! through a symlink resolving outside the target directory (a symlink in
//! the archive may point anywhere; it is never followed out). Regular files
//! are written to a temporary file and renamed into place, so an aborted
//! upload leaves no half-written file, though the entries unpacked before
//! the failure stay.

use std::ffi::OsString;
use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, UNIX_EPOCH};

use tar::EntryType;
use tine_proto::agent::mux::{Chunk, Inbound, StreamReceiver, StreamSender, MAX_DATA_CHUNK};
use tine_proto::agent::{Channel, DownloadTarRequest, ErrorCode, Response, UploadTarRequest};
use tokio::sync::mpsc;

use super::files::absolute;
use crate::error::OpError;

enum Feed {
    Data(Chunk),
    Eof,
}

/// Blocking reader over chunks arriving from the stream.
struct ChannelReader {
    rx: mpsc::Receiver<Feed>,
    current: Option<Chunk>,
    pos: usize,
    done: bool,
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            if let Some(chunk) = &self.current {
                if self.pos < chunk.len() {
                    let n = buf.len().min(chunk.len() - self.pos);
                    buf[..n].copy_from_slice(&chunk[self.pos..self.pos + n]);
                    self.pos += n;
                    return Ok(n);
                }
                self.current = None;
            }
            if self.done {
                return Ok(0);
            }
            match self.rx.blocking_recv() {
                Some(Feed::Data(chunk)) => {
                    self.current = Some(chunk);
                    self.pos = 0;
                }
                Some(Feed::Eof) => self.done = true,
                None => {
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        "the client ended the upload early",
                    ))
                }
            }
        }
    }
}

/// Blocking writer that hands buffers to the async side.
struct ChannelWriter {
    tx: mpsc::Sender<Vec<u8>>,
    buf: Vec<u8>,
}

impl Write for ChannelWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let n = data.len().min(MAX_DATA_CHUNK - self.buf.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() >= MAX_DATA_CHUNK {
            self.flush()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let buf = std::mem::replace(&mut self.buf, Vec::with_capacity(MAX_DATA_CHUNK));
        self.tx.blocking_send(buf).map_err(|_| {
            io::Error::new(io::ErrorKind::BrokenPipe, "the client stopped the download")
        })
    }
}

fn tar_error(what: &str, err: &io::Error) -> OpError {
    OpError::io(format_args!("tar {what}"), err)
}

fn escapes(path: &Path, how: &str) -> OpError {
    OpError::new(
        ErrorCode::InvalidPath,
        format!(
            "tar entry {:?} escapes the target directory ({how})",
            path.display()
        ),
    )
}

/// The normal components of an entry path; absolute paths and `..` are
/// refused.
fn components(path: &Path) -> Result<Vec<OsString>, OpError> {
    let mut out = Vec::new();
    for component in path.components() {
        match component {
            Component::Normal(name) => out.push(name.to_owned()),
            Component::CurDir => {}
            Component::ParentDir => return Err(escapes(path, "\"..\" component")),
            Component::RootDir | Component::Prefix(_) => {
                return Err(escapes(path, "absolute path"))
            }
        }
    }
    Ok(out)
}

/// Walks `parts` below `root`, creating missing directories when `create`,
/// and returns the real directory they name. A symlink on the way must
/// resolve to a directory inside `root`.
fn resolve_dir(
    root: &Path,
    parts: &[OsString],
    create: bool,
    entry: &Path,
) -> Result<PathBuf, OpError> {
    let mut dir = root.to_path_buf();
    for part in parts {
        let next = dir.join(part);
        match fs::symlink_metadata(&next) {
            Ok(meta) if meta.is_dir() => dir = next,
            Ok(meta) if meta.file_type().is_symlink() => {
                let real = fs::canonicalize(&next)
                    .map_err(|e| OpError::path("resolve symlink", &next, &e))?;
                if !real.starts_with(root) {
                    return Err(escapes(entry, "through a symlink pointing outside"));
                }
                if !real.is_dir() {
                    return Err(OpError::bad_request(format!(
                        "{} is not a directory",
                        next.display()
                    )));
                }
                dir = real;
            }
            Ok(_) => {
                return Err(OpError::new(
                    ErrorCode::AlreadyExists,
                    format!("{} exists and is not a directory", next.display()),
                ))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound && create => {
                fs::DirBuilder::new()
                    .mode(0o755)
                    .create(&next)
                    .map_err(|e| OpError::path("create directory", &next, &e))?;
                dir = next;
            }
            Err(e) => return Err(OpError::path("stat", &next, &e)),
        }
    }
    Ok(dir)
}

/// Removes a non-directory at `path` so that a new entry can take its place.
fn clear_target(path: &Path) -> Result<(), OpError> {
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => Err(OpError::new(
            ErrorCode::AlreadyExists,
            format!("{} is a directory", path.display()),
        )),
        Ok(_) => fs::remove_file(path).map_err(|e| OpError::path("replace", path, &e)),
        Err(_) => Ok(()),
    }
}

/// Slicer's cp `exclude` patterns (see [`DownloadTarRequest::exclude`]).
struct Excludes(Vec<ExcludePattern>);

struct ExcludePattern {
    /// The pattern's segments; `None` is `**`.
    segments: Vec<Option<glob::Pattern>>,
    /// A pattern without `/`: it also matches any entry's name.
    name_only: bool,
}

impl Excludes {
    fn new(patterns: &[String]) -> Result<Self, OpError> {
        let mut out = Vec::new();
        for raw in patterns {
            let p = raw.trim();
            let p = p.strip_prefix("./").unwrap_or(p).trim_matches('/');
            if p.is_empty() {
                continue;
            }
            let segments = p
                .split('/')
                .filter(|s| !s.is_empty())
                .map(|s| match s {
                    "**" => Ok(None),
                    s => glob::Pattern::new(s).map(Some).map_err(|e| {
                        OpError::bad_request(format!("exclude {raw:?} is not a glob: {e}"))
                    }),
                })
                .collect::<Result<Vec<_>, _>>()?;
            out.push(ExcludePattern {
                name_only: !p.contains('/'),
                segments,
            });
        }
        Ok(Excludes(out))
    }

    /// Whether `path` (its components below the archive's root) or one of
    /// its parent directories is excluded.
    fn matches(&self, path: &[String]) -> bool {
        if self.0.is_empty() {
            return false;
        }
        (1..=path.len()).any(|n| {
            let prefix = &path[..n];
            self.0.iter().any(|p| {
                segments_match(&p.segments, prefix)
                    || (p.name_only
                        && p.segments
                            .first()
                            .and_then(Option::as_ref)
                            .is_some_and(|g| prefix.last().is_some_and(|name| g.matches(name))))
            })
        })
    }
}

fn segments_match(pattern: &[Option<glob::Pattern>], path: &[String]) -> bool {
    match pattern.split_first() {
        None => path.is_empty(),
        Some((None, rest)) => (0..=path.len()).any(|i| segments_match(rest, &path[i..])),
        Some((Some(g), rest)) => path
            .split_first()
            .is_some_and(|(first, tail)| g.matches(first) && segments_match(rest, tail)),
    }
}

fn lossy(parts: &[OsString]) -> Vec<String> {
    parts
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect()
}

struct Owner {
    uid: Option<u32>,
    gid: Option<u32>,
}

impl Owner {
    fn any(&self) -> bool {
        self.uid.is_some() || self.gid.is_some()
    }
}

fn unpack(reader: ChannelReader, req: &UploadTarRequest) -> Result<Response, OpError> {
    let dest = absolute(&req.path)?;
    if req.mkdirs {
        fs::create_dir_all(&dest).map_err(|e| OpError::path("create", &dest, &e))?;
    }
    let meta = fs::metadata(&dest).map_err(|e| OpError::path("open", &dest, &e))?;
    if !meta.is_dir() {
        return Err(OpError::bad_request(format!(
            "{} is not a directory",
            dest.display()
        )));
    }
    let root = fs::canonicalize(&dest).map_err(|e| OpError::path("resolve", &dest, &e))?;
    let excludes = Excludes::new(&req.exclude)?;
    let preserve_owner = nix::unistd::geteuid().is_root();
    let mut archive = tar::Archive::new(reader);
    let mut dirs: Vec<(PathBuf, u32)> = Vec::new();
    let (mut entries, mut skipped) = (0u64, 0u64);
    for entry in archive.entries().map_err(|e| tar_error("read", &e))? {
        let mut entry = entry.map_err(|e| tar_error("read", &e))?;
        let entry_path = entry
            .path()
            .map_err(|e| tar_error("entry path", &e))?
            .into_owned();
        let parts = components(&entry_path)?;
        if excludes.matches(&lossy(&parts)) {
            skipped += 1;
            continue;
        }
        let header = entry.header();
        let kind = header.entry_type();
        let mode = header.mode().unwrap_or(0o644) & 0o7777;
        let from_header = |v: io::Result<u64>| {
            if preserve_owner {
                v.ok().and_then(|v| u32::try_from(v).ok())
            } else {
                None
            }
        };
        let owner = Owner {
            uid: req.uid.or_else(|| from_header(header.uid())),
            gid: req.gid.or_else(|| from_header(header.gid())),
        };
        let mtime = header.mtime().ok();
        let Some((name, parent_parts)) = parts.split_last() else {
            // The archive's root ("./"): give the target its mode.
            if kind.is_dir() {
                dirs.push((root.clone(), mode));
            }
            continue;
        };
        match kind {
            EntryType::XGlobalHeader
            | EntryType::XHeader
            | EntryType::GNULongName
            | EntryType::GNULongLink => continue,
            EntryType::Directory => {
                let dir = resolve_dir(&root, &parts, true, &entry_path)?;
                if owner.any() {
                    std::os::unix::fs::chown(&dir, owner.uid, owner.gid)
                        .map_err(|e| OpError::path("chown", &dir, &e))?;
                }
                dirs.push((dir, mode));
            }
            EntryType::Regular | EntryType::Continuous => {
                let parent = resolve_dir(&root, parent_parts, true, &entry_path)?;
                write_file(&mut entry, &parent, &parent.join(name), mode, &owner, mtime)?;
            }
            EntryType::Symlink => {
                let parent = resolve_dir(&root, parent_parts, true, &entry_path)?;
                let target = parent.join(name);
                let link = entry
                    .link_name()
                    .map_err(|e| tar_error("link name", &e))?
                    .ok_or_else(|| OpError::bad_request("symlink entry without a target"))?;
                clear_target(&target)?;
                std::os::unix::fs::symlink(&link, &target)
                    .map_err(|e| OpError::path("create symlink", &target, &e))?;
                if owner.any() {
                    std::os::unix::fs::lchown(&target, owner.uid, owner.gid)
                        .map_err(|e| OpError::path("chown", &target, &e))?;
                }
            }
            EntryType::Link => {
                let parent = resolve_dir(&root, parent_parts, true, &entry_path)?;
                let target = parent.join(name);
                let link = entry
                    .link_name()
                    .map_err(|e| tar_error("link name", &e))?
                    .ok_or_else(|| OpError::bad_request("hard link entry without a target"))?;
                let link_parts = components(&link)?;
                let Some((link_name, link_parent)) = link_parts.split_last() else {
                    return Err(OpError::bad_request("hard link to the archive root"));
                };
                let source = resolve_dir(&root, link_parent, false, &link)?.join(link_name);
                let source_meta = fs::symlink_metadata(&source)
                    .map_err(|e| OpError::path("hard link source", &source, &e))?;
                if source_meta.is_dir() {
                    return Err(OpError::bad_request(format!(
                        "hard link to directory {}",
                        source.display()
                    )));
                }
                clear_target(&target)?;
                fs::hard_link(&source, &target)
                    .map_err(|e| OpError::path("create hard link", &target, &e))?;
            }
            _ => {
                skipped += 1;
                continue;
            }
        }
        entries += 1;
    }
    // Directory modes last and deepest first, so that a read-only directory
    // does not block its own contents.
    for (dir, mode) in dirs.iter().rev() {
        fs::set_permissions(dir, fs::Permissions::from_mode(*mode))
            .map_err(|e| OpError::path("chmod", dir, &e))?;
    }
    // Consume any padding after the end-of-archive blocks.
    let mut rest = archive.into_inner();
    io::copy(&mut rest, &mut io::sink()).map_err(|e| tar_error("read", &e))?;
    match fs::File::open(&root) {
        Ok(dir) => {
            if let Err(e) = nix::unistd::syncfs(&dir) {
                tracing::warn!("cannot sync the file system of {}: {e}", root.display());
            }
        }
        Err(e) => tracing::warn!("cannot open {} to sync it: {e}", root.display()),
    }
    Ok(Response::TarDone { entries, skipped })
}

fn write_file(
    entry: &mut tar::Entry<'_, ChannelReader>,
    parent: &Path,
    target: &Path,
    mode: u32,
    owner: &Owner,
    mtime: Option<u64>,
) -> Result<(), OpError> {
    let mut temp = tempfile::Builder::new()
        .prefix(".tine-tar-")
        .tempfile_in(parent)
        .map_err(|e| OpError::path("create a temporary file in", parent, &e))?;
    io::copy(entry, temp.as_file_mut()).map_err(|e| tar_error("read", &e))?;
    let file = temp.as_file();
    if owner.any() {
        std::os::unix::fs::fchown(file, owner.uid, owner.gid)
            .map_err(|e| OpError::path("chown", target, &e))?;
    }
    file.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(|e| OpError::path("chmod", target, &e))?;
    if let Some(mtime) = mtime {
        if let Err(e) = file.set_modified(UNIX_EPOCH + Duration::from_secs(mtime)) {
            tracing::debug!("cannot set the mtime of {}: {e}", target.display());
        }
    }
    temp.persist(target)
        .map_err(|e| OpError::path("rename onto", target, &e.error))?;
    Ok(())
}

/// Receives a tar archive on the data channel and unpacks it.
pub(crate) async fn upload(
    req: UploadTarRequest,
    mut rx: StreamReceiver,
) -> Result<Response, OpError> {
    absolute(&req.path)?;
    let (feed_tx, feed_rx) = mpsc::channel(16);
    let reader = ChannelReader {
        rx: feed_rx,
        current: None,
        pos: 0,
        done: false,
    };
    let worker = tokio::task::spawn_blocking(move || unpack(reader, &req));
    let mut cancelled = false;
    loop {
        match rx.recv().await {
            Some(Inbound::Data(Channel::Data, chunk)) => {
                if feed_tx.send(Feed::Data(chunk)).await.is_err() {
                    // The worker stopped (an error); its result says why.
                    break;
                }
            }
            Some(Inbound::Eof(Channel::Data)) => {
                if feed_tx.send(Feed::Eof).await.is_err() {
                    tracing::trace!("the unpack worker stopped first; its result says why");
                }
                break;
            }
            Some(_) => {}
            None => {
                cancelled = true;
                break;
            }
        }
    }
    drop(feed_tx);
    let result = worker
        .await
        .map_err(|e| OpError::new(ErrorCode::Io, format!("unpack worker failed: {e}")))?;
    if cancelled {
        return Err(OpError::cancelled());
    }
    result
}

fn pack(path: &Path, excludes: &Excludes, writer: ChannelWriter) -> Result<(u64, u64), OpError> {
    let meta = fs::symlink_metadata(path).map_err(|e| OpError::path("stat", path, &e))?;
    let mut builder = tar::Builder::new(writer);
    builder.follow_symlinks(false);
    builder.mode(tar::HeaderMode::Complete);
    let mut counts = (0u64, 0u64);
    if meta.is_dir() {
        walk(&mut builder, path, &[], excludes, &mut counts)?;
    } else {
        let name = path
            .file_name()
            .ok_or_else(|| OpError::bad_request("path names no file"))?;
        builder
            .append_path_with_name(path, name)
            .map_err(|e| tar_error("pack", &e))?;
        counts.0 += 1;
    }
    let mut writer = builder.into_inner().map_err(|e| tar_error("pack", &e))?;
    writer.flush().map_err(|e| tar_error("pack", &e))?;
    Ok(counts)
}

fn walk(
    builder: &mut tar::Builder<ChannelWriter>,
    dir: &Path,
    rel: &[OsString],
    excludes: &Excludes,
    counts: &mut (u64, u64),
) -> Result<(), OpError> {
    let mut names: Vec<OsString> = fs::read_dir(dir)
        .map_err(|e| OpError::path("list", dir, &e))?
        .filter_map(|e| e.ok().map(|e| e.file_name()))
        .collect();
    names.sort();
    for name in names {
        let full = dir.join(&name);
        let mut parts = rel.to_vec();
        parts.push(name);
        if excludes.matches(&lossy(&parts)) {
            counts.1 += 1;
            continue;
        }
        let rel_path: PathBuf = parts.iter().collect();
        // Entries removed while packing are skipped.
        let Ok(meta) = fs::symlink_metadata(&full) else {
            continue;
        };
        let file_type = meta.file_type();
        if !(file_type.is_dir() || file_type.is_file() || file_type.is_symlink()) {
            counts.1 += 1;
            continue;
        }
        builder
            .append_path_with_name(&full, &rel_path)
            .map_err(|e| OpError::io(format_args!("pack {}", full.display()), &e))?;
        counts.0 += 1;
        if file_type.is_dir() {
            walk(builder, &full, &parts, excludes, counts)?;
        }
    }
    Ok(())
}

/// Sends a directory (or one file) as a tar archive on the data channel,
/// then EOF and [`Response::TarDone`]. Symlinks are stored as symlinks;
/// sockets, FIFOs and devices are skipped and counted.
pub(crate) async fn download(
    req: DownloadTarRequest,
    tx: StreamSender,
) -> Result<Response, OpError> {
    let path = absolute(&req.path)?;
    let excludes = Excludes::new(&req.exclude)?;
    let (chunk_tx, mut chunk_rx) = mpsc::channel(4);
    let writer = ChannelWriter {
        tx: chunk_tx,
        buf: Vec::with_capacity(MAX_DATA_CHUNK),
    };
    let worker = tokio::task::spawn_blocking(move || pack(&path, &excludes, writer));
    while let Some(chunk) = chunk_rx.recv().await {
        if tx.send_data_vec(Channel::Data, chunk).await.is_err() {
            drop(chunk_rx);
            // The client has gone, so what the pack came to no longer
            // matters; only a worker that did not finish is worth a line.
            if let Err(e) = worker.await {
                tracing::warn!("pack worker failed: {e}");
            }
            return Err(OpError::cancelled());
        }
    }
    let (entries, skipped) = worker
        .await
        .map_err(|e| OpError::new(ErrorCode::Io, format!("pack worker failed: {e}")))??;
    tx.send_eof(Channel::Data)
        .await
        .map_err(|_| OpError::cancelled())?;
    Ok(Response::TarDone { entries, skipped })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn excludes_match_as_slicers_cp_does() {
        let ex = Excludes::new(&[
            "*.log".into(),
            "./node_modules/".into(),
            "build/**/tmp".into(),
        ])
        .expect("globs");
        let m = |p: &str| ex.matches(&p.split('/').map(str::to_owned).collect::<Vec<_>>());
        assert!(
            m("a.log") && m("src/deep/b.log"),
            "a name pattern, anywhere"
        );
        assert!(
            m("node_modules") && m("node_modules/x/y.js"),
            "with its contents"
        );
        assert!(m("build/tmp") && m("build/a/b/tmp/f"), "`**` is any depth");
        assert!(!m("src/node_modules_not") && !m("build/a/keep") && !m("log"));
        assert!(!Excludes::new(&[]).expect("none").matches(&["a".into()]));
        assert!(
            Excludes::new(&["[".into()]).is_err(),
            "a bad glob is refused"
        );
    }

    #[test]
    fn test_negative_components_parent_and_absolute_refused() {
        assert!(components(Path::new("a/../../b")).is_err());
        assert!(components(Path::new("/etc/passwd")).is_err());
        let ok = components(Path::new("./a/b")).expect("relative path");
        assert_eq!(ok, vec![OsString::from("a"), OsString::from("b")]);
    }

    #[test]
    fn test_negative_resolve_dir_symlink_outside_refused() {
        let outside = tempfile::tempdir().expect("tempdir");
        let root_dir = tempfile::tempdir().expect("tempdir");
        let root = fs::canonicalize(root_dir.path()).expect("canonical");
        std::os::unix::fs::symlink(outside.path(), root.join("link")).expect("symlink");
        let err = resolve_dir(&root, &[OsString::from("link")], true, Path::new("link/x"))
            .expect_err("escape");
        assert_eq!(err.code, ErrorCode::InvalidPath);
    }
}
