//! Applying image layers (tar streams) onto a root directory, as an
//! overlay file system would stack them: later layers replace earlier
//! files, `.wh.NAME` deletes `NAME` from the layers below and
//! `.wh..wh..opq` hides everything below in its directory.
//!
//! Nothing is ever written outside the root: entry names with `..` are
//! refused, and every path is resolved inside the root as if it were `/`
//! (a symlink `/etc -> /host/etc` in a layer means `<root>/host/etc`, never
//! the host's). Character and block devices are skipped: the guest's `/dev`
//! is a devtmpfs the agent mounts at boot, so an image's device nodes are
//! never seen, and the daemon makes none on the host.

use std::collections::VecDeque;
use std::ffi::{OsStr, OsString};
use std::io::{self, Read};
use std::path::{Component, Path, PathBuf};

use tar::EntryType;

/// The prefix of a whiteout's file name.
const WHITEOUT_PREFIX: &str = ".wh.";
/// The name of an opaque-directory marker.
const OPAQUE_MARKER: &str = ".wh..wh..opq";
/// Symlinks followed while resolving one path.
const MAX_SYMLINK_HOPS: usize = 40;

/// Errors applying a layer.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    /// The layer is not a readable tar.
    #[error("{layer} is not a valid tar archive")]
    BadTar {
        /// Which layer.
        layer: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// An entry's name would leave the root.
    #[error("{layer}: the entry {path:?} leaves the image's root (`..` or an empty name)")]
    Escape {
        /// Which layer.
        layer: String,
        /// The entry's name.
        path: PathBuf,
    },
    /// Writing the entry failed.
    #[error("{layer}: cannot {what} {path:?}")]
    Io {
        /// Which layer.
        layer: String,
        /// What was being done.
        what: &'static str,
        /// The entry's name in the image.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// What applying one layer did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayerStats {
    /// Entries written (files, directories, links).
    pub written: u64,
    /// Whiteouts applied (deletions and opaque directories).
    pub whiteouts: u64,
    /// Device nodes skipped.
    pub devices_skipped: u64,
}

/// `path` as a relative path of normal components, or `None` when it has
/// `..` (or a Windows prefix). `/`, `.` and an absolute start are dropped.
pub fn clean_relative(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Normal(part) => out.push(part),
            Component::RootDir | Component::CurDir => {}
            Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

/// The host path of `rel` inside `root`, resolving every symlink met on
/// the way as if `root` were `/` (absolute targets restart at `root`, `..`
/// stops at it). The last component is followed only with `follow_last`.
pub fn resolve_in_root(root: &Path, rel: &Path, follow_last: bool) -> io::Result<PathBuf> {
    let mut pending: VecDeque<OsString> = VecDeque::new();
    push_components(&mut pending, rel, false);
    let mut resolved: Vec<OsString> = Vec::new();
    let mut hops = 0;
    while let Some(part) = pending.pop_front() {
        if part == ".." {
            resolved.pop();
            continue;
        }
        let is_last = pending.is_empty();
        let candidate = join_all(root, &resolved).join(&part);
        let is_link = std::fs::symlink_metadata(&candidate)
            .map(|m| m.file_type().is_symlink())
            .unwrap_or(false);
        if is_link && (!is_last || follow_last) {
            hops += 1;
            if hops > MAX_SYMLINK_HOPS {
                return Err(io::Error::other(format!(
                    "too many levels of symbolic links in {}",
                    rel.display()
                )));
            }
            let target = std::fs::read_link(&candidate)?;
            if target.is_absolute() {
                resolved.clear();
            }
            push_components(&mut pending, &target, true);
        } else {
            resolved.push(part);
        }
    }
    Ok(join_all(root, &resolved))
}

/// Puts `path`'s components at the front (`front`) or back of `queue`,
/// `..` kept as `".."`.
fn push_components(queue: &mut VecDeque<OsString>, path: &Path, front: bool) {
    let parts: Vec<OsString> = path
        .components()
        .filter_map(|c| match c {
            Component::Normal(p) => Some(p.to_owned()),
            Component::ParentDir => Some(OsString::from("..")),
            _ => None,
        })
        .collect();
    if front {
        for p in parts.into_iter().rev() {
            queue.push_front(p);
        }
    } else {
        queue.extend(parts);
    }
}

fn join_all(root: &Path, parts: &[OsString]) -> PathBuf {
    let mut p = root.to_path_buf();
    p.extend(parts);
    p
}

/// Removes whatever is at `path` (a tree, a file or a link; nothing is
/// fine).
fn remove_any(path: &Path) -> io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// A tar of the layer, opened afresh for each pass.
pub type OpenLayer<'a> = &'a dyn Fn() -> io::Result<Box<dyn Read>>;

fn archive(reader: Box<dyn Read>) -> tar::Archive<Box<dyn Read>> {
    let mut a = tar::Archive::new(reader);
    a.set_preserve_permissions(true);
    a.set_preserve_mtime(true);
    // Owners are the image's only when the daemon may set them (root).
    a.set_preserve_ownerships(super::running_as_root());
    a.set_unpack_xattrs(false);
    a
}

/// Applies one layer onto `root`: first its whiteouts (which only hide
/// what the layers below made), then its entries.
pub fn apply_layer(
    root: &Path,
    layer: &str,
    open: OpenLayer<'_>,
) -> Result<LayerStats, LayerError> {
    let bad_tar = |source: io::Error| LayerError::BadTar {
        layer: layer.to_owned(),
        source,
    };
    let io_err = |what: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source: io::Error| LayerError::Io {
            layer: layer.to_owned(),
            what,
            path,
            source,
        }
    };
    let mut stats = LayerStats::default();

    // Pass 1: whiteouts.
    let mut a = archive(open().map_err(bad_tar)?);
    for entry in a.entries().map_err(bad_tar)? {
        let entry = entry.map_err(bad_tar)?;
        let raw = entry.path().map_err(bad_tar)?.into_owned();
        let rel = clean_relative(&raw).ok_or_else(|| LayerError::Escape {
            layer: layer.to_owned(),
            path: raw.clone(),
        })?;
        let Some(name) = rel.file_name().and_then(OsStr::to_str) else {
            continue;
        };
        if name == OPAQUE_MARKER {
            let marker = resolve_in_root(root, &rel, false).map_err(io_err("resolve", &raw))?;
            let Some(dir) = marker.parent() else { continue };
            if dir.is_dir() && dir.starts_with(root) {
                for child in std::fs::read_dir(dir).map_err(io_err("read", &raw))? {
                    let child = child.map_err(io_err("read", &raw))?;
                    remove_any(&child.path()).map_err(io_err("remove", &raw))?;
                }
            }
            stats.whiteouts += 1;
        } else if let Some(hidden) = name.strip_prefix(WHITEOUT_PREFIX) {
            if hidden.is_empty() || hidden == "." || hidden == ".." || hidden.contains('/') {
                return Err(LayerError::Escape {
                    layer: layer.to_owned(),
                    path: raw,
                });
            }
            let target = resolve_in_root(root, &rel.with_file_name(hidden), false)
                .map_err(io_err("resolve", &raw))?;
            remove_any(&target).map_err(io_err("remove", &raw))?;
            stats.whiteouts += 1;
        }
    }

    // Pass 2: everything else.
    let mut a = archive(open().map_err(bad_tar)?);
    for entry in a.entries().map_err(bad_tar)? {
        let mut entry = entry.map_err(bad_tar)?;
        let raw = entry.path().map_err(bad_tar)?.into_owned();
        let rel = clean_relative(&raw).ok_or_else(|| LayerError::Escape {
            layer: layer.to_owned(),
            path: raw.clone(),
        })?;
        let kind = entry.header().entry_type();
        let name = rel.file_name().and_then(OsStr::to_str).unwrap_or("");
        if name.starts_with(WHITEOUT_PREFIX) {
            continue;
        }
        match kind {
            EntryType::Char | EntryType::Block => {
                stats.devices_skipped += 1;
                continue;
            }
            EntryType::XGlobalHeader | EntryType::XHeader => continue,
            _ => {}
        }
        if rel.as_os_str().is_empty() {
            // The root itself (`./`): it stays the daemon's directory.
            continue;
        }
        let dest = resolve_in_root(root, &rel, false).map_err(io_err("resolve", &raw))?;
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent).map_err(io_err("create the parent of", &raw))?;
        }
        let existing = std::fs::symlink_metadata(&dest).ok();
        match (kind, existing) {
            (EntryType::Directory, Some(m)) if m.is_dir() => {}
            (_, Some(_)) => remove_any(&dest).map_err(io_err("replace", &raw))?,
            (_, None) => {}
        }
        if kind == EntryType::Link {
            let target = entry
                .link_name()
                .map_err(bad_tar)?
                .map(|t| t.into_owned())
                .and_then(|t| clean_relative(&t))
                .filter(|t| !t.as_os_str().is_empty())
                .ok_or_else(|| LayerError::Escape {
                    layer: layer.to_owned(),
                    path: raw.clone(),
                })?;
            let source = resolve_in_root(root, &target, false).map_err(io_err("resolve", &raw))?;
            std::fs::hard_link(&source, &dest).map_err(io_err("hard-link", &raw))?;
        } else {
            entry.unpack(&dest).map_err(io_err("write", &raw))?;
        }
        stats.written += 1;
    }
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GNU header with owner root and a fixed time (as real tars have).
    pub(crate) fn test_header() -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        h
    }

    /// A tar of `(path, kind)` entries: `Some(text)` a file, `None` a
    /// directory.
    fn tar_of(entries: &[(&str, Option<&str>)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, content) in entries {
            let mut h = test_header();
            match content {
                Some(text) => {
                    h.set_entry_type(EntryType::Regular);
                    h.set_size(text.len() as u64);
                    h.set_mode(0o644);
                    b.append_data(&mut h, path, text.as_bytes())
                        .expect("append");
                }
                None => {
                    h.set_entry_type(EntryType::Directory);
                    h.set_size(0);
                    h.set_mode(0o755);
                    b.append_data(&mut h, path, io::empty()).expect("append");
                }
            }
        }
        b.into_inner().expect("tar")
    }

    fn link_entry(b: &mut tar::Builder<Vec<u8>>, kind: EntryType, path: &str, target: &str) {
        let mut h = test_header();
        h.set_entry_type(kind);
        h.set_size(0);
        h.set_mode(0o777);
        b.append_link(&mut h, path, target).expect("link");
    }

    fn apply(root: &Path, bytes: Vec<u8>) -> Result<LayerStats, LayerError> {
        let open =
            move || -> io::Result<Box<dyn Read>> { Ok(Box::new(io::Cursor::new(bytes.clone()))) };
        apply_layer(root, "layer 1", &open)
    }

    #[test]
    fn later_layers_replace_and_whiteouts_delete() {
        let dir = tempfile::tempdir().expect("tmp");
        let root = dir.path();
        apply(
            root,
            tar_of(&[
                ("etc/", None),
                ("etc/a", Some("one")),
                ("etc/b", Some("two")),
                ("opt/", None),
                ("opt/old", Some("x")),
                ("keep", Some("k")),
            ]),
        )
        .expect("layer 1");
        let stats = apply(
            root,
            tar_of(&[
                ("etc/a", Some("ONE")),
                ("etc/.wh.b", Some("")),
                ("opt/.wh..wh..opq", Some("")),
                ("opt/new", Some("y")),
            ]),
        )
        .expect("layer 2");
        assert_eq!(stats.whiteouts, 2);
        assert_eq!(
            std::fs::read_to_string(root.join("etc/a")).expect("a"),
            "ONE"
        );
        assert!(!root.join("etc/b").exists());
        assert!(!root.join("etc/.wh.b").exists());
        assert!(
            !root.join("opt/old").exists(),
            "opaque dir hides lower files"
        );
        assert_eq!(
            std::fs::read_to_string(root.join("opt/new")).expect("new"),
            "y"
        );
        assert!(!root.join("opt/.wh..wh..opq").exists());
        assert_eq!(
            std::fs::read_to_string(root.join("keep")).expect("keep"),
            "k"
        );
    }

    #[test]
    fn a_file_replaces_a_directory_and_back() {
        let dir = tempfile::tempdir().expect("tmp");
        let root = dir.path();
        apply(root, tar_of(&[("x/", None), ("x/inner", Some("i"))])).expect("1");
        apply(root, tar_of(&[("x", Some("file now"))])).expect("2");
        assert_eq!(
            std::fs::read_to_string(root.join("x")).expect("x"),
            "file now"
        );
        apply(root, tar_of(&[("x/", None)])).expect("3");
        assert!(root.join("x").is_dir());
    }

    #[test]
    fn dot_dot_entries_are_refused() {
        let dir = tempfile::tempdir().expect("tmp");
        let root = dir.path().join("root");
        std::fs::create_dir(&root).expect("root");
        // tar::Builder refuses `..` itself: write the name into the header.
        let mut h = test_header();
        h.set_entry_type(EntryType::Regular);
        h.set_size(1);
        h.set_mode(0o644);
        let name = b"../escaped";
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        h.set_cksum();
        let mut b = tar::Builder::new(Vec::new());
        b.append(&h, &b"x"[..]).expect("append");
        let err = apply(&root, b.into_inner().expect("tar")).expect_err("escape");
        assert!(err.to_string().contains("leaves the image's root"), "{err}");
        assert!(!dir.path().join("escaped").exists());
    }

    #[test]
    fn symlinks_never_lead_out_of_the_root() {
        let dir = tempfile::tempdir().expect("tmp");
        let outside = dir.path().join("outside");
        std::fs::create_dir(&outside).expect("outside");
        let root = dir.path().join("root");
        std::fs::create_dir(&root).expect("root");
        let mut b = tar::Builder::new(Vec::new());
        // An absolute link and a relative one that climbs past the root.
        link_entry(
            &mut b,
            EntryType::Symlink,
            "abs",
            outside.to_str().expect("utf8"),
        );
        link_entry(&mut b, EntryType::Symlink, "rel", "../../../../outside");
        let mut h = test_header();
        h.set_entry_type(EntryType::Regular);
        h.set_size(1);
        h.set_mode(0o644);
        b.append_data(&mut h, "abs/f", &b"a"[..]).expect("f");
        let mut h2 = h.clone();
        b.append_data(&mut h2, "rel/g", &b"b"[..]).expect("g");
        apply(&root, b.into_inner().expect("tar")).expect("apply");
        assert_eq!(
            std::fs::read_dir(&outside).expect("read").count(),
            0,
            "nothing outside"
        );
        // Both landed inside, where the links point when the root is `/`.
        let inside = root.join(outside.strip_prefix("/").expect("abs"));
        assert!(inside.join("f").is_file());
        assert!(root.join("outside/g").is_file());
        // A whiteout through a link deletes inside the root only.
        std::fs::write(outside.join("victim"), "v").expect("victim");
        let mut b = tar::Builder::new(Vec::new());
        let mut h = test_header();
        h.set_entry_type(EntryType::Regular);
        h.set_size(0);
        h.set_mode(0o644);
        b.append_data(&mut h, "abs/.wh.victim", io::empty())
            .expect("wh");
        apply(&root, b.into_inner().expect("tar")).expect("whiteout");
        assert!(outside.join("victim").exists());
    }

    #[test]
    fn hard_links_point_inside_and_devices_are_skipped() {
        let dir = tempfile::tempdir().expect("tmp");
        let root = dir.path();
        let mut b = tar::Builder::new(Vec::new());
        let mut h = test_header();
        h.set_entry_type(EntryType::Regular);
        h.set_size(2);
        h.set_mode(0o644);
        b.append_data(&mut h, "bin/a", &b"hi"[..]).expect("a");
        link_entry(&mut b, EntryType::Link, "bin/b", "bin/a");
        let mut d = test_header();
        d.set_entry_type(EntryType::Char);
        d.set_size(0);
        d.set_mode(0o666);
        d.set_device_major(1).expect("major");
        d.set_device_minor(3).expect("minor");
        b.append_data(&mut d, "dev/null", io::empty()).expect("dev");
        let stats = apply(root, b.into_inner().expect("tar")).expect("apply");
        assert_eq!(stats.devices_skipped, 1);
        assert_eq!(std::fs::read(root.join("bin/b")).expect("b"), b"hi");
        assert!(!root.join("dev/null").exists());
    }

    #[test]
    fn garbage_is_not_a_tar() {
        let dir = tempfile::tempdir().expect("tmp");
        let err = apply(dir.path(), vec![0x55; 1024]).expect_err("garbage");
        assert!(
            err.to_string()
                .contains("layer 1 is not a valid tar archive"),
            "{err}"
        );
    }
}
