//! Unpacks a tar that came out of a VM (`vm cp -r VM:/dir DIR`).
//!
//! The archive is the guest's word: code in the VM has root there and can
//! replace the agent. So only regular files, directories and symlinks come
//! out; devices, FIFOs and other special entries are left out (never made
//! into files), hard links are refused, modes lose their setuid, setgid and
//! sticky bits and get the umask, owners are not kept, and nothing is
//! written outside the target directory (no `..`, no writing through a
//! symlink the archive made).

use std::io::{self, Read};
use std::path::Path;

use tar::EntryType;

/// What [`unpack`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Unpacked {
    /// Files, directories and symlinks written.
    pub entries: u64,
    /// Names of the entries left out: devices, FIFOs and other special
    /// files. Guest text: sanitise before printing.
    pub skipped: Vec<String>,
}

fn refused(name: &str, why: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("refused tar entry {name:?}: {why}"),
    )
}

/// Unpacks the tar read from `reader` into the directory `dir`, which must
/// exist, masking modes with `umask` (see the module documentation).
pub fn unpack<R: Read>(reader: R, dir: &Path, umask: u32) -> io::Result<Unpacked> {
    let dir = dir.canonicalize()?;
    let mut archive = tar::Archive::new(reader);
    // Without preserved permissions the tar crate keeps `mode & 0o777`.
    archive.set_preserve_permissions(false);
    archive.set_preserve_ownerships(false);
    archive.set_unpack_xattrs(false);
    archive.set_mask(umask);
    archive.set_overwrite(true);
    let mut done = Unpacked::default();
    // Directories last, deepest first, as `Archive::unpack` does: a
    // directory without write permission must not stop its children.
    let mut directories = Vec::new();
    for entry in archive.entries()? {
        let mut entry = entry?;
        let name = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        match entry.header().entry_type() {
            EntryType::Regular
            | EntryType::Continuous
            | EntryType::GNUSparse
            | EntryType::Symlink => {}
            EntryType::Directory => {
                directories.push((name, entry));
                continue;
            }
            EntryType::Link => return Err(refused(&name, "hard links are not unpacked")),
            // The tar crate writes an entry of a type it does not know as a
            // file with the entry's mode: a device must never become one.
            _ => {
                done.skipped.push(name);
                continue;
            }
        }
        if !entry.unpack_in(&dir)? {
            return Err(refused(&name, "it leaves the target directory"));
        }
        done.entries += 1;
    }
    directories.sort_by(|(a, _), (b, _)| b.cmp(a));
    for (name, mut entry) in directories {
        if !entry.unpack_in(&dir)? {
            return Err(refused(&name, "it leaves the target directory"));
        }
        done.entries += 1;
    }
    Ok(done)
}

/// The process's umask. Reading it means setting it: it is 077 for that
/// instant, which can only make a file created meanwhile more private.
pub fn current_umask() -> u32 {
    use nix::sys::stat::{umask, Mode};
    let old = umask(Mode::from_bits_truncate(0o077));
    umask(old);
    old.bits()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn header(kind: EntryType, mode: u32, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_size(size);
        h.set_uid(0);
        h.set_gid(0);
        h
    }

    fn file(b: &mut tar::Builder<Vec<u8>>, path: &str, mode: u32, data: &[u8]) {
        let mut h = header(EntryType::Regular, mode, data.len() as u64);
        b.append_data(&mut h, path, data).expect("append file");
    }

    fn mode_of(path: &Path) -> u32 {
        std::fs::symlink_metadata(path)
            .expect("stat")
            .permissions()
            .mode()
            & 0o7777
    }

    /// What a guest that replaced its agent could send.
    fn hostile_tar() -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        file(&mut b, "suid", 0o4755, b"#!/bin/sh\n");
        file(&mut b, "both", 0o6777, b"x");
        let mut h = header(EntryType::Directory, 0o1777, 0);
        b.append_data(&mut h, "tmp/", io::empty()).expect("dir");
        file(&mut b, "tmp/inner", 0o666, b"in");
        // A device that carries bytes: as a file it would keep them.
        let mut h = header(EntryType::Char, 0o4777, 5);
        h.set_device_major(1).expect("major");
        h.set_device_minor(3).expect("minor");
        b.append_data(&mut h, "dev/null", &b"BOOM!"[..])
            .expect("char");
        let mut h = header(EntryType::Block, 0o666, 0);
        b.append_data(&mut h, "sda", io::empty()).expect("block");
        let mut h = header(EntryType::Fifo, 0o666, 0);
        b.append_data(&mut h, "pipe", io::empty()).expect("fifo");
        let mut h = header(EntryType::Symlink, 0o777, 0);
        b.append_link(&mut h, "link", "suid").expect("symlink");
        b.into_inner().expect("tar")
    }

    #[test]
    fn special_bits_go_and_the_umask_applies() {
        let dir = tempfile::tempdir().expect("tmp");
        let done = unpack(hostile_tar().as_slice(), dir.path(), 0o022).expect("unpack");
        let p = dir.path();
        assert_eq!(mode_of(&p.join("suid")), 0o755);
        assert_eq!(mode_of(&p.join("both")), 0o755);
        assert_eq!(mode_of(&p.join("tmp")), 0o755);
        assert_eq!(mode_of(&p.join("tmp/inner")), 0o644);
        assert_eq!(std::fs::read(p.join("suid")).expect("read"), b"#!/bin/sh\n");
        assert_eq!(
            std::fs::read_link(p.join("link")).expect("link"),
            Path::new("suid")
        );
        for special in ["dev/null", "sda", "pipe"] {
            assert!(
                std::fs::symlink_metadata(p.join(special)).is_err(),
                "{special} was written"
            );
        }
        assert_eq!(done.skipped, vec!["dev/null", "sda", "pipe"]);
        assert_eq!(done.entries, 5);

        let strict = tempfile::tempdir().expect("tmp");
        unpack(hostile_tar().as_slice(), strict.path(), 0o077).expect("unpack");
        assert_eq!(mode_of(&strict.path().join("suid")), 0o700);
        assert_eq!(mode_of(&strict.path().join("tmp")), 0o700);
    }

    #[test]
    fn a_read_only_directory_still_gets_its_children() {
        let mut b = tar::Builder::new(Vec::new());
        let mut h = header(EntryType::Directory, 0o555, 0);
        b.append_data(&mut h, "ro/", io::empty()).expect("dir");
        file(&mut b, "ro/f", 0o644, b"f");
        let dir = tempfile::tempdir().expect("tmp");
        unpack(b.into_inner().expect("tar").as_slice(), dir.path(), 0o022).expect("unpack");
        let ro = dir.path().join("ro");
        assert_eq!(mode_of(&ro), 0o555);
        assert_eq!(std::fs::read(ro.join("f")).expect("read"), b"f");
        // So the temporary directory can be removed.
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }

    #[test]
    fn negative_escapes_and_hard_links_are_refused() {
        let outside = tempfile::tempdir().expect("tmp");
        // The tar crate's builder refuses `..`: write the name raw.
        let mut b = tar::Builder::new(Vec::new());
        let mut h = header(EntryType::Regular, 0o644, 1);
        h.as_gnu_mut().expect("gnu").name[..9].copy_from_slice(b"../escape");
        h.set_cksum();
        b.append(&h, &b"x"[..]).expect("append");
        let dir = tempfile::tempdir().expect("tmp");
        let target = dir.path().join("in");
        std::fs::create_dir(&target).expect("mkdir");
        let err =
            unpack(b.into_inner().expect("tar").as_slice(), &target, 0o022).expect_err("dot-dot");
        assert!(err.to_string().contains("leaves the target"), "{err}");
        assert!(!dir.path().join("escape").exists());

        let mut b = tar::Builder::new(Vec::new());
        let mut h = header(EntryType::Symlink, 0o777, 0);
        b.append_link(&mut h, "out", outside.path())
            .expect("symlink");
        file(&mut b, "out/planted", 0o644, b"x");
        let dir = tempfile::tempdir().expect("tmp");
        unpack(b.into_inner().expect("tar").as_slice(), dir.path(), 0o022)
            .expect_err("through the symlink");
        assert!(!outside.path().join("planted").exists());

        let mut b = tar::Builder::new(Vec::new());
        file(&mut b, "a", 0o644, b"a");
        let mut h = header(EntryType::Link, 0o644, 0);
        b.append_link(&mut h, "b", "a").expect("hard link");
        let dir = tempfile::tempdir().expect("tmp");
        let err = unpack(b.into_inner().expect("tar").as_slice(), dir.path(), 0o022)
            .expect_err("hard link");
        assert!(err.to_string().contains("hard links"), "{err}");
    }
}
