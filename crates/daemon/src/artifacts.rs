//! Guest kernel, images and the `tine-vmm` binary: where the daemon finds
//! them, and how images become immutable bases for VM disks.
//!
//! An image named in a host group (`min`) is looked up in, in order:
//! `$TINE_IMAGE_<NAME>` (a file), `<data_dir>/images/<name>.img`, and the
//! project's build cache (`$XDG_CACHE_HOME/tine/images/<name>/*/rootfs.ext4`,
//! newest first). The first use copies it to
//! `<data_dir>/images/<name>-<key>.base` (read-only), so a later rebuild of
//! the cache never changes the base under existing VM disks.

use std::path::{Path, PathBuf};

use tine_proto::api::{ImageFormat, ImageOrigin};

use crate::db::{ImageRecord, Store};

/// Errors finding or importing artifacts.
#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    /// Nothing found; the message says where the daemon looked.
    #[error("{what} not found; looked in: {looked}. {hint}")]
    NotFound {
        /// What was looked for.
        what: String,
        /// Where.
        looked: String,
        /// How to get one.
        hint: &'static str,
    },
    /// Copying an image failed.
    #[error("cannot import image {}: {source}", path.display())]
    Import {
        /// The source.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The state database failed.
    #[error(transparent)]
    Db(#[from] crate::db::DbError),
}

fn cache_root() -> PathBuf {
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(x).join("tine");
    }
    std::env::var_os("HOME")
        .map(|h| PathBuf::from(h).join(".cache/tine"))
        .unwrap_or_else(|| PathBuf::from("/root/.cache/tine"))
}

/// The newest `<dir>/*/<file>` by modification time.
fn newest_in(dir: &Path, file: &str) -> Option<PathBuf> {
    let mut best: Option<(std::time::SystemTime, PathBuf)> = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let candidate = entry.path().join(file);
        if let Ok(meta) = std::fs::metadata(&candidate) {
            let mtime = meta.modified().unwrap_or(std::time::UNIX_EPOCH);
            if best.as_ref().is_none_or(|(t, _)| mtime > *t) {
                best = Some((mtime, candidate));
            }
        }
    }
    best.map(|(_, p)| p)
}

/// The guest kernel: `configured`, else `$TINE_KERNEL`, else
/// `<data_dir>/kernel/vmlinux`, else the newest build in the cache.
pub fn find_kernel(configured: Option<&Path>, data_dir: &Path) -> Result<PathBuf, ArtifactError> {
    let mut looked = Vec::new();
    if let Some(p) = configured {
        if p.is_file() {
            return Ok(p.to_owned());
        }
        looked.push(p.display().to_string());
    } else {
        if let Some(p) = std::env::var_os("TINE_KERNEL").map(PathBuf::from) {
            if p.is_file() {
                return Ok(p);
            }
            looked.push(format!("$TINE_KERNEL={}", p.display()));
        }
        let local = data_dir.join("kernel/vmlinux");
        if local.is_file() {
            return Ok(local);
        }
        looked.push(local.display().to_string());
        let cache = cache_root().join("kernel");
        if let Some(p) = newest_in(&cache, "vmlinux") {
            return Ok(p);
        }
        looked.push(format!("{}/*/vmlinux", cache.display()));
    }
    Err(ArtifactError::NotFound {
        what: "guest kernel".into(),
        looked: looked.join(", "),
        hint: "Build it with scripts/build-kernel (or set `kernel:` in tine.yaml).",
    })
}

/// The `tine-vmm` binary: `configured`, else next to the running binary,
/// else on PATH.
pub fn find_vmm(configured: Option<&Path>) -> Result<PathBuf, ArtifactError> {
    if let Some(p) = configured {
        if p.is_file() {
            return Ok(p.to_owned());
        }
        return Err(ArtifactError::NotFound {
            what: "tine-vmm".into(),
            looked: p.display().to_string(),
            hint: "Fix `vmm:` in tine.yaml.",
        });
    }
    let mut looked = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        // Next to us, or one level up (test binaries live in target/*/deps).
        for dir in exe.ancestors().skip(1).take(2) {
            let p = dir.join("tine-vmm");
            if p.is_file() {
                return Ok(p);
            }
            looked.push(p.display().to_string());
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("tine-vmm");
            if p.is_file() {
                return Ok(p);
            }
        }
        looked.push("$PATH".into());
    }
    Err(ArtifactError::NotFound {
        what: "tine-vmm".into(),
        looked: looked.join(", "),
        hint: "Build it with `cargo build -p tine-vmm` (or set `vmm:` in tine.yaml).",
    })
}

/// Where the file for image `name` (a built-in name or a path) is.
pub fn image_source(name: &str, data_dir: &Path) -> Result<PathBuf, ArtifactError> {
    if name.contains('/') {
        let p = PathBuf::from(name);
        if p.is_file() {
            return Ok(p);
        }
        return Err(ArtifactError::NotFound {
            what: format!("image {name}"),
            looked: name.into(),
            hint: "Fix `image:` in tine.yaml.",
        });
    }
    let mut looked = Vec::new();
    let env = format!("TINE_IMAGE_{}", name.to_ascii_uppercase().replace('-', "_"));
    if let Some(p) = std::env::var_os(&env).map(PathBuf::from) {
        if p.is_file() {
            return Ok(p);
        }
        looked.push(format!("${env}={}", p.display()));
    }
    let local = data_dir.join("images").join(format!("{name}.img"));
    if local.is_file() {
        return Ok(local);
    }
    looked.push(local.display().to_string());
    let cache = cache_root().join("images").join(name);
    if let Some(p) = newest_in(&cache, "rootfs.ext4") {
        return Ok(p);
    }
    looked.push(format!("{}/*/rootfs.ext4", cache.display()));
    Err(ArtifactError::NotFound {
        what: format!("image `{name}`"),
        looked: looked.join(", "),
        hint: "Import it with `tine image import NAME FILE`, or build a built-in image with \
               guest/rootfs/<name>/build (scripts/setup builds min).",
    })
}

/// The immutable base file for image `name`, importing it on first use.
pub fn image_base(
    store: &Store,
    name: &str,
    data_dir: &Path,
) -> Result<ImageRecord, ArtifactError> {
    if let Some(img) = store.get_image(name)? {
        if Path::new(&img.path).is_file() {
            return Ok(img);
        }
    }
    let source = image_source(name, data_dir)?;
    let import = |source_err: std::io::Error| ArtifactError::Import {
        path: source.clone(),
        source: source_err,
    };
    let meta = std::fs::metadata(&source).map_err(import)?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let key = fnv1a(format!("{}:{}:{mtime}", source.display(), meta.len()).as_bytes());
    let dir = data_dir.join("images");
    std::fs::create_dir_all(&dir).map_err(import)?;
    let safe: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let dest = dir.join(format!("{safe}-{key:016x}.base"));
    if !dest.is_file() {
        let tmp = dir.join(format!(".{safe}-{key:016x}.tmp"));
        copy_sparse(&source, &tmp).map_err(import)?;
        let f = std::fs::File::open(&tmp).map_err(import)?;
        f.sync_all().map_err(import)?;
        let mut perms = f.metadata().map_err(import)?.permissions();
        perms.set_readonly(true);
        std::fs::set_permissions(&tmp, perms).map_err(import)?;
        std::fs::rename(&tmp, &dest).map_err(import)?;
    }
    let digest = match built_digest(&source, &meta) {
        Some(d) => d,
        None => crate::image::oci::sha256_file(&dest).map_err(import)?,
    };
    let format = disk_format(&dest);
    let img = ImageRecord {
        name: name.to_owned(),
        source: source.display().to_string(),
        path: dest.display().to_string(),
        size_bytes: meta.len(),
        digest: Some(digest),
        format,
        origin: if name.contains('/') {
            ImageOrigin::File
        } else {
            ImageOrigin::BuiltIn
        },
        exec_defaults: None,
        created_ms: crate::db::now_ms(),
    };
    store.put_image(&img)?;
    Ok(img)
}

/// How a base file is stored: qcow2, or raw (anything qcow2's header does
/// not name, an unreadable file included).
fn disk_format(path: &Path) -> ImageFormat {
    match tine_disk::detect_format(path) {
        Ok(tine_disk::Format::Qcow2) => ImageFormat::Qcow2,
        _ => ImageFormat::Raw,
    }
}

/// A built-in image (`min`, `debian`) that is built but not yet copied into
/// the data directory, as `GET /images` shows it: its source stands in for
/// the base. `None` when it is not built.
pub fn built_in_preview(name: &str, data_dir: &Path) -> Option<ImageRecord> {
    let source = image_source(name, data_dir).ok()?;
    let meta = std::fs::metadata(&source).ok()?;
    let created_ms = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0);
    let format = disk_format(&source);
    Some(ImageRecord {
        name: name.to_owned(),
        source: source.display().to_string(),
        path: source.display().to_string(),
        size_bytes: meta.len(),
        digest: built_digest(&source, &meta),
        format,
        origin: ImageOrigin::BuiltIn,
        exec_defaults: None,
        created_ms,
    })
}

/// The digest the project's image builders write beside an image
/// (`rootfs.ext4.sha256`, hex), when it is there and no older than the
/// image: hashing a 2 GiB image again at every first use costs a minute on
/// a slow machine. `sha256:<hex>`, or `None` to hash the copy instead.
fn built_digest(source: &Path, meta: &std::fs::Metadata) -> Option<String> {
    let mut sidecar = source.as_os_str().to_owned();
    sidecar.push(".sha256");
    let sidecar = PathBuf::from(sidecar);
    let written = std::fs::metadata(&sidecar).ok()?.modified().ok()?;
    if written < meta.modified().ok()? {
        return None;
    }
    let text = std::fs::read_to_string(&sidecar).ok()?;
    let hex = text.split_whitespace().next()?;
    (hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| format!("sha256:{}", hex.to_ascii_lowercase()))
}

/// Bytes per read while copying an image, and the size of the zero runs
/// that become holes.
const COPY_CHUNK: usize = 1 << 20;
const HOLE_BLOCK: usize = 64 << 10;
static ZERO_BLOCK: [u8; HOLE_BLOCK] = [0; HOLE_BLOCK];

/// Copies `source` to a new file `dest`, leaving holes where `source` has
/// holes or runs of zeros: an image file is mostly empty (a 2 GiB debian
/// image holds about 400 MiB), and a plain copy would write every zero. Holes
/// are found with `SEEK_DATA`/`SEEK_HOLE` where the file system reports them,
/// and zero blocks are skipped on any file system (9p, for one, reports none).
fn copy_sparse(source: &Path, dest: &Path) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom, Write};
    use std::os::unix::fs::FileExt;

    let mut input = std::fs::File::open(source)?;
    let len = input.metadata()?.len();
    let output = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(dest)?;
    let mut buf = vec![0u8; COPY_CHUNK];
    let mut offset = 0u64;
    while offset < len {
        let Some((data, hole)) = data_extent(&input, offset, len)? else {
            break;
        };
        input.seek(SeekFrom::Start(data))?;
        let mut at = data;
        while at < hole {
            let want = usize::try_from((hole - at).min(COPY_CHUNK as u64)).unwrap_or(COPY_CHUNK);
            input.read_exact(&mut buf[..want])?;
            for (i, block) in buf[..want].chunks(HOLE_BLOCK).enumerate() {
                // A slice comparison is one memcmp: fast even in a debug
                // build, where a byte loop made a 2 GiB copy CPU-bound.
                if block != &ZERO_BLOCK[..block.len()] {
                    output.write_all_at(block, at + (i * HOLE_BLOCK) as u64)?;
                }
            }
            at += want as u64;
        }
        offset = hole;
    }
    output.set_len(len)?;
    (&output).flush()?;
    Ok(())
}

/// The next data extent of `file` at or after `offset`: `(start, end)`, or
/// `None` when only a hole is left. A file system without hole reporting
/// gives the whole rest of the file as data.
fn data_extent(file: &std::fs::File, offset: u64, len: u64) -> std::io::Result<Option<(u64, u64)>> {
    use nix::unistd::{lseek, Whence};
    let to_offset = |o: i64| u64::try_from(o).unwrap_or(len).min(len);
    let start = i64::try_from(offset).map_err(std::io::Error::other)?;
    let data = match lseek(file, start, Whence::SeekData) {
        Ok(d) => to_offset(d),
        // ENXIO: no data after `offset`.
        Err(nix::errno::Errno::ENXIO) => return Ok(None),
        Err(nix::errno::Errno::EINVAL) => return Ok(Some((offset, len))),
        Err(e) => return Err(e.into()),
    };
    let from = i64::try_from(data).map_err(std::io::Error::other)?;
    let hole = match lseek(file, from, Whence::SeekHole) {
        Ok(h) => to_offset(h),
        Err(e) => return Err(e.into()),
    };
    Ok(Some((data, hole.max(data))))
}

/// 64-bit FNV-1a.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_are_imported_once_and_read_only() {
        let dir = tempfile::tempdir().expect("tmp");
        let src = dir.path().join("root.ext4");
        std::fs::write(&src, b"image bytes").expect("write");
        let store = Store::in_memory().expect("db");
        let data = dir.path().join("data");
        let a = image_base(&store, src.to_str().expect("utf8"), &data).expect("import");
        assert_eq!(std::fs::read(&a.path).expect("read"), b"image bytes");
        assert!(std::fs::metadata(&a.path)
            .expect("meta")
            .permissions()
            .readonly());
        let b = image_base(&store, src.to_str().expect("utf8"), &data).expect("again");
        assert_eq!(a, b);
    }

    #[test]
    fn a_builders_digest_is_used_only_when_well_formed_and_fresh() {
        let dir = tempfile::tempdir().expect("tmp");
        let src = dir.path().join("rootfs.ext4");
        std::fs::write(&src, b"image").expect("write");
        let meta = std::fs::metadata(&src).expect("meta");
        assert_eq!(built_digest(&src, &meta), None, "no sidecar: hash the copy");
        let sidecar = dir.path().join("rootfs.ext4.sha256");
        std::fs::write(&sidecar, "not-hex  rootfs.ext4\n").expect("write");
        assert_eq!(built_digest(&src, &meta), None, "malformed");
        let hex = "AB".repeat(32);
        std::fs::write(&sidecar, format!("{hex}  rootfs.ext4\n")).expect("write");
        assert_eq!(
            built_digest(&src, &meta),
            Some(format!("sha256:{}", hex.to_ascii_lowercase()))
        );
        // An image rewritten after its digest: the digest is stale.
        let later = std::time::SystemTime::now() + std::time::Duration::from_secs(60);
        std::fs::File::options()
            .write(true)
            .open(&src)
            .expect("open")
            .set_modified(later)
            .expect("mtime");
        let meta = std::fs::metadata(&src).expect("meta");
        assert_eq!(built_digest(&src, &meta), None);
    }

    #[test]
    fn an_image_copy_keeps_its_bytes_and_leaves_zeros_as_holes() {
        use std::os::unix::fs::{FileExt, MetadataExt};
        let dir = tempfile::tempdir().expect("tmp");
        let src = dir.path().join("sparse.ext4");
        let f = std::fs::File::create(&src).expect("create");
        let len = 64u64 << 20;
        f.set_len(len).expect("size");
        // Data at the start, in the middle (not block-aligned, crossing a
        // chunk boundary) and in the last byte; explicit zeros in between.
        f.write_all_at(b"superblock", 0).expect("write");
        f.write_all_at(&vec![7u8; 3 << 20], (20 << 20) - 5)
            .expect("write");
        f.write_all_at(&vec![0u8; 8 << 20], 40 << 20)
            .expect("write");
        f.write_all_at(b"!", len - 1).expect("write");
        drop(f);
        let dest = dir.path().join("copy");
        copy_sparse(&src, &dest).expect("copy");
        assert_eq!(
            std::fs::read(&src).expect("read source"),
            std::fs::read(&dest).expect("read copy")
        );
        let meta = std::fs::metadata(&dest).expect("meta");
        assert_eq!(meta.len(), len);
        // 3 MiB of sevens plus a few blocks, not 64 MiB or the 8 MiB of
        // written zeros.
        assert!(
            meta.blocks() * 512 < 6 << 20,
            "the copy allocates {} bytes",
            meta.blocks() * 512
        );
        assert!(
            copy_sparse(&src, &dest).is_err(),
            "an existing file is never overwritten"
        );
    }

    #[test]
    fn missing_images_name_where_they_were_looked_for() {
        let dir = tempfile::tempdir().expect("tmp");
        let store = Store::in_memory().expect("db");
        let err = image_base(&store, "no-such-image", dir.path()).expect_err("missing");
        let msg = err.to_string();
        assert!(msg.contains("image `no-such-image` not found"), "{msg}");
        assert!(msg.contains("no-such-image.img"), "{msg}");
        let err = image_base(&store, "/nope/x.img", dir.path()).expect_err("missing");
        assert!(err.to_string().contains("/nope/x.img"));
    }

    #[test]
    fn a_configured_kernel_must_exist() {
        let err =
            find_kernel(Some(Path::new("/nope/vmlinux")), Path::new("/tmp")).expect_err("missing");
        assert!(err.to_string().contains("/nope/vmlinux"));
    }
}
