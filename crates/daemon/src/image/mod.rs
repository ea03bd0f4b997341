//! The image store's conversions: an uploaded file becomes an immutable
//! base (docs/daemon.md, "Images").
//!
//! An upload is a raw ext4 image, a qcow2 image (without a backing file),
//! or a tar of an OCI image layout or a `docker save` archive. Raw and
//! qcow2 uploads are the base as they are; an OCI or docker image is
//! unpacked, its layers checked against their digests and applied in
//! order (whiteouts included, see [`layers`]), the static agent installed
//! as `/sbin/init` with the config's process defaults beside it, and the
//! tree written to an ext4 file with `mkfs.ext4 -d` ([`rootfs`]).
//!
//! Everything is made under a temporary name in `<data_dir>/images`
//! (`.import-*`), synced, made read-only and renamed; the record is written
//! last, so a daemon killed mid-import leaves only temporary files, which
//! [`remove_stray_files`] clears at start-up.

pub mod layers;
pub mod oci;
pub mod rootfs;

use std::io::{self, Read, Seek, SeekFrom};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use tine_proto::api::{ImageExecDefaults, ImageFormat, ImportEvent, ImportFormat, ImportStage};

pub use layers::LayerError;
pub use oci::OciError;
pub use rootfs::RootfsError;

/// Names the daemon resolves from the build cache (`guest/rootfs/<name>`):
/// they cannot be imported over.
pub const BUILT_IN: &[&str] = &["min", "debian"];

/// The prefix of every temporary file or folder of an import.
pub const TEMP_PREFIX: &str = ".import-";

/// Errors importing an image; each names the problem.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The name cannot be used.
    #[error("{0}")]
    BadName(String),
    /// The upload is not something tine can import.
    #[error("{0}")]
    Unrecognized(String),
    /// The upload's tar is broken.
    #[error("the upload is not a valid tar archive")]
    BadTar(#[source] io::Error),
    /// The image's manifest, config or blobs are wrong.
    #[error(transparent)]
    Oci(#[from] OciError),
    /// A layer could not be applied.
    #[error(transparent)]
    Layer(#[from] LayerError),
    /// The root could not be made bootable or written.
    #[error(transparent)]
    Rootfs(#[from] RootfsError),
    /// A qcow2 or raw upload is unusable.
    #[error("{what}: {detail}")]
    BadDisk {
        /// Which check.
        what: &'static str,
        /// Why.
        detail: String,
    },
    /// No static agent to install.
    #[error("no static tine-agent to install in the image: {0}")]
    NoAgent(String),
    /// Converting needs root.
    #[error(
        "converting an OCI or docker image needs the daemon to run as root \
         (the image's file owners are kept)"
    )]
    NotRoot,
    /// A file operation of the daemon failed.
    #[error("cannot {what}")]
    Io {
        /// What was being done.
        what: String,
        /// Why.
        #[source]
        source: io::Error,
    },
}

impl ImageError {
    /// Whether the upload (not the daemon) is at fault.
    pub fn is_bad_input(&self) -> bool {
        match self {
            ImageError::BadName(_)
            | ImageError::Unrecognized(_)
            | ImageError::BadTar(_)
            | ImageError::Oci(_)
            | ImageError::Layer(_)
            | ImageError::BadDisk { .. } => true,
            ImageError::Rootfs(e) => matches!(e, RootfsError::NoShell),
            ImageError::NoAgent(_) | ImageError::NotRoot | ImageError::Io { .. } => false,
        }
    }
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> ImageError {
    let what = what.into();
    move |source| ImageError::Io { what, source }
}

/// Whether the daemon runs as root (and so may keep an image's owners).
pub fn running_as_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Checks an image name: 1-64 of `[a-z0-9._-]`, starting with a letter or
/// digit, not a built-in name.
pub fn check_name(name: &str) -> Result<(), ImageError> {
    let ok_chars = name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
    let ok_start = name
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if name.len() > 64 || !ok_chars || !ok_start {
        return Err(ImageError::BadName(format!(
            "image name `{name}`: use 1-64 of a-z, 0-9, `.`, `_` and `-`, starting with a letter or digit"
        )));
    }
    if BUILT_IN.contains(&name) {
        return Err(ImageError::BadName(format!(
            "`{name}` is a built-in image (built by guest/rootfs/{name}/build); pick another name"
        )));
    }
    Ok(())
}

/// What an upload's first bytes say it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detected {
    /// The qcow2 magic.
    Qcow2,
    /// An ext2/3/4 superblock.
    Ext4,
    /// A tar (an OCI layout or a docker archive: told apart once unpacked).
    Tar,
}

impl Detected {
    fn describe(self) -> &'static str {
        match self {
            Detected::Qcow2 => "a qcow2 image",
            Detected::Ext4 => "a raw ext4 image",
            Detected::Tar => "a tar",
        }
    }
}

/// What an upload is, by its first bytes.
pub fn detect(path: &Path) -> Result<Detected, ImageError> {
    let mut file = std::fs::File::open(path).map_err(io_err("open the upload"))?;
    let mut head = vec![0u8; 2048];
    let mut got = 0;
    while got < head.len() {
        match file
            .read(&mut head[got..])
            .map_err(io_err("read the upload"))?
        {
            0 => break,
            n => got += n,
        }
    }
    head.truncate(got);
    if head.starts_with(b"QFI\xfb") {
        return Ok(Detected::Qcow2);
    }
    if is_ext4(&head) {
        return Ok(Detected::Ext4);
    }
    if head.len() > 262 && &head[257..262] == b"ustar" {
        return Ok(Detected::Tar);
    }
    if head.starts_with(&[0x1f, 0x8b]) {
        return Err(ImageError::Unrecognized(
            "the upload is gzip-compressed; upload the tar itself (gunzip it first)".into(),
        ));
    }
    Err(ImageError::Unrecognized(
        "the upload is neither a qcow2 image, a raw ext4 image, nor a tar (of an OCI image \
         layout or a `docker save` archive)"
            .into(),
    ))
}

/// Whether `head` (the first 2 KiB of a disk) holds an ext2/3/4 superblock.
fn is_ext4(head: &[u8]) -> bool {
    head.len() >= 1082 && head[1080] == 0x53 && head[1081] == 0xef
}

/// What an upload became: the base file to keep, and how it was made.
#[derive(Debug)]
pub struct Converted {
    /// The base (inside the import's temporary folder or the upload).
    pub base: PathBuf,
    /// What it was made from.
    pub format: ImageFormat,
    /// Its size: bytes of a raw file, the virtual size of a qcow2 one.
    pub size_bytes: u64,
    /// An OCI image's process defaults.
    pub exec_defaults: Option<ImageExecDefaults>,
}

/// Reports progress.
pub type Progress<'a> = &'a mut dyn FnMut(ImportEvent);

fn step(
    progress: Progress<'_>,
    stage: ImportStage,
    done: Option<u64>,
    total: Option<u64>,
    message: String,
) {
    progress(ImportEvent::Progress {
        stage,
        done,
        total,
        message,
    });
}

/// Converts the upload at `upload` (said to be `format`) into a base,
/// working in `work` (an empty folder the caller removes); `agent` gives
/// the static agent binary when an OCI image needs one.
pub fn convert(
    upload: &Path,
    format: ImportFormat,
    work: &Path,
    agent: &dyn Fn() -> Result<PathBuf, ImageError>,
    progress: Progress<'_>,
) -> Result<Converted, ImageError> {
    let found = detect(upload)?;
    let fits = matches!(
        (format, found),
        (ImportFormat::Auto, _)
            | (ImportFormat::Raw, Detected::Ext4)
            | (ImportFormat::Qcow2, Detected::Qcow2)
            | (
                ImportFormat::Oci | ImportFormat::DockerArchive,
                Detected::Tar
            )
    );
    if !fits {
        return Err(ImageError::Unrecognized(format!(
            "the upload was said to be {format} but looks like {}",
            found.describe()
        )));
    }
    let format = match (format, found) {
        (ImportFormat::Auto, Detected::Ext4) => ImportFormat::Raw,
        (ImportFormat::Auto, Detected::Qcow2) => ImportFormat::Qcow2,
        // Auto stays auto for a tar: its kind is found once unpacked.
        (asked, _) => asked,
    };
    match format {
        ImportFormat::Raw => {
            let size_bytes = std::fs::metadata(upload)
                .map_err(io_err("stat the upload"))?
                .len();
            Ok(Converted {
                base: upload.to_path_buf(),
                format: ImageFormat::Raw,
                size_bytes,
                exec_defaults: None,
            })
        }
        ImportFormat::Qcow2 => {
            let bad = |what: &'static str| {
                move |e: tine_disk::Error| ImageError::BadDisk {
                    what,
                    detail: tine_proto::error_chain(&e),
                }
            };
            let info = tine_disk::info(upload).map_err(bad("the qcow2 header"))?;
            if let Some(backing) = info.backing {
                return Err(ImageError::BadDisk {
                    what: "the qcow2 image",
                    detail: format!(
                        "it has a backing file ({}); flatten it first (qemu-img convert -O qcow2)",
                        backing.display()
                    ),
                });
            }
            let report = tine_disk::check(upload).map_err(bad("the qcow2 check"))?;
            if !report.is_ok() {
                return Err(ImageError::BadDisk {
                    what: "the qcow2 image is corrupted",
                    detail: report.messages.join("; "),
                });
            }
            Ok(Converted {
                base: upload.to_path_buf(),
                format: ImageFormat::Qcow2,
                size_bytes: info.virtual_size,
                exec_defaults: None,
            })
        }
        ImportFormat::Oci | ImportFormat::DockerArchive | ImportFormat::Auto => {
            convert_archive(upload, format, work, agent, progress)
        }
    }
}

fn convert_archive(
    upload: &Path,
    asked: ImportFormat,
    work: &Path,
    agent: &dyn Fn() -> Result<PathBuf, ImageError>,
    progress: Progress<'_>,
) -> Result<Converted, ImageError> {
    if !running_as_root() {
        return Err(ImageError::NotRoot);
    }
    let agent = agent()?;
    step(
        progress,
        ImportStage::Unpack,
        None,
        None,
        "unpacking the archive".into(),
    );
    let archive_dir = work.join("archive");
    unpack_archive(upload, &archive_dir)?;
    let source = oci::read_image(&archive_dir)?;
    if asked != ImportFormat::Auto && asked.as_str() != source.format.as_str() {
        return Err(ImageError::Unrecognized(format!(
            "the upload was said to be {asked} but is {}",
            source.format
        )));
    }
    let root = work.join("root");
    std::fs::create_dir(&root).map_err(io_err("make the image's root folder"))?;
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755))
        .map_err(io_err("chmod the image's root folder"))?;
    let total = source.layers.len() as u64;
    for (i, layer) in source.layers.iter().enumerate() {
        step(
            progress,
            ImportStage::Layer,
            Some(i as u64 + 1),
            Some(total),
            format!("applying {}", layer.label),
        );
        oci::verify_layer(layer)?;
        let path = layer.path.clone();
        let open = move || oci::open_layer(&path);
        let stats = layers::apply_layer(&root, &layer.label, &open)?;
        if stats.devices_skipped > 0 {
            tracing::info!(
                layer = %layer.label,
                "skipped {} device nodes (the guest's /dev is a devtmpfs)",
                stats.devices_skipped
            );
        }
    }
    // The archive is no longer needed: free its space before mkfs.
    if let Err(e) = std::fs::remove_dir_all(&archive_dir) {
        tracing::warn!(
            "cannot remove the unpacked archive {}: {e}",
            archive_dir.display()
        );
    }
    rootfs::check_shell(&root)?;
    step(
        progress,
        ImportStage::Agent,
        None,
        None,
        "installing the agent as /sbin/init".into(),
    );
    rootfs::install_agent(&root, &agent, &source.defaults)?;
    let content = rootfs::content_bytes(&root).map_err(io_err("measure the image's content"))?;
    let size = rootfs::fs_size(content);
    step(
        progress,
        ImportStage::Filesystem,
        None,
        Some(size),
        format!("writing an ext4 file system of {} MiB", size >> 20),
    );
    let base = work.join("rootfs.ext4");
    rootfs::make_ext4(&root, &base, size)?;
    if let Err(e) = std::fs::remove_dir_all(&root) {
        tracing::warn!("cannot remove the unpacked root {}: {e}", root.display());
    }
    Ok(Converted {
        base,
        format: source.format,
        size_bytes: size,
        exec_defaults: Some(source.defaults),
    })
}

/// Unpacks the upload's tar into `dir`: regular files, directories and
/// symlinks (a docker archive links repeated layers) only, every name kept
/// inside `dir`.
fn unpack_archive(upload: &Path, dir: &Path) -> Result<(), ImageError> {
    std::fs::create_dir_all(dir).map_err(io_err("make the unpack folder"))?;
    let mut file = std::fs::File::open(upload).map_err(io_err("open the upload"))?;
    file.seek(SeekFrom::Start(0))
        .map_err(io_err("read the upload"))?;
    let mut archive = tar::Archive::new(file);
    archive.set_preserve_permissions(false);
    archive.set_unpack_xattrs(false);
    let mut count = 0;
    for entry in archive.entries().map_err(ImageError::BadTar)? {
        let mut entry = entry.map_err(ImageError::BadTar)?;
        match entry.header().entry_type() {
            tar::EntryType::Regular | tar::EntryType::Directory | tar::EntryType::Symlink => {}
            _ => continue,
        }
        let raw = entry.path().map_err(ImageError::BadTar)?.into_owned();
        if layers::clean_relative(&raw).is_none() {
            return Err(ImageError::Unrecognized(format!(
                "the archive's entry {raw:?} leaves the archive (`..`)"
            )));
        }
        entry.unpack_in(dir).map_err(ImageError::BadTar)?;
        count += 1;
    }
    if count == 0 {
        return Err(ImageError::BadTar(io::Error::other("it holds no files")));
    }
    Ok(())
}

/// Makes `path` read-only and syncs it.
pub fn seal(path: &Path) -> Result<(), ImageError> {
    let file = std::fs::File::open(path).map_err(io_err("open the new base"))?;
    file.sync_all().map_err(io_err("sync the new base"))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o444))
        .map_err(io_err("make the new base read-only"))
}

/// Syncs a directory (after a rename into it).
pub fn sync_dir(dir: &Path) -> Result<(), ImageError> {
    crate::storage::sync_dir(dir).map_err(io_err(format!("sync {}", dir.display())))
}

/// Removes the temporary files and folders an interrupted import left in
/// `images_dir`; returns what it removed.
pub fn remove_stray_files(images_dir: &Path) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(images_dir) else {
        return removed;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        // `.import-*` (uploads and conversions) and `.<name>-<key>.tmp`
        // (a built-in image's copy).
        let stray =
            name.starts_with(TEMP_PREFIX) || (name.starts_with('.') && name.ends_with(".tmp"));
        if !stray {
            continue;
        }
        let path = e.path();
        let gone = if e.file_type().is_ok_and(|t| t.is_dir()) {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        match gone {
            Ok(()) => removed.push(path),
            Err(err) => tracing::warn!("remove {}: {err}", path.display()),
        }
    }
    removed
}

/// Whether the ELF file at `path` is statically linked (no `PT_INTERP`).
pub fn is_static_elf(path: &Path) -> io::Result<bool> {
    const PT_INTERP: u32 = 3;
    let bytes = std::fs::read(path)?;
    let not_elf = || io::Error::new(io::ErrorKind::InvalidData, "not a 64-bit ELF file");
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" || bytes[4] != 2 {
        return Err(not_elf());
    }
    let u16_at = |o: usize| {
        bytes
            .get(o..o + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
    };
    let u64_at = |o: usize| {
        bytes
            .get(o..o + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    };
    let phoff = u64_at(0x20).ok_or_else(not_elf)? as usize;
    let phentsize = u16_at(0x36).ok_or_else(not_elf)? as usize;
    let phnum = u16_at(0x38).ok_or_else(not_elf)? as usize;
    for i in 0..phnum {
        let at = phoff + i * phentsize;
        let kind = bytes
            .get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .ok_or_else(not_elf)?;
        if kind == PT_INTERP {
            return Ok(false);
        }
    }
    Ok(true)
}

#[cfg(test)]
pub(crate) mod tests;
