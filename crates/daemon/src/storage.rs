//! VM disks: copy-on-write children of an image or a commit.

use std::path::Path;

/// Creates `dest` as a disk whose contents start as `base`'s, of
/// `size` bytes (default: the base's size).
pub fn create_disk(base: &Path, dest: &Path, size: Option<u64>) -> std::io::Result<()> {
    // TEMP(qcow2): a sparse copy until the qcow2 overlays land.
    let tmp = dest.with_extension("tmp");
    std::fs::copy(base, &tmp)?;
    if let Some(size) = size {
        let f = std::fs::OpenOptions::new().write(true).open(&tmp)?;
        if size > f.metadata()?.len() {
            f.set_len(size)?;
        }
    }
    let mut perms = std::fs::metadata(&tmp)?.permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o600);
    std::fs::set_permissions(&tmp, perms)?;
    std::fs::rename(&tmp, dest)
}

/// Virtual size, bytes allocated on the host, and format of a disk.
pub fn describe(path: &Path) -> (u64, u64, String) {
    use std::os::unix::fs::MetadataExt;
    match std::fs::metadata(path) {
        Ok(m) => (m.len(), m.blocks() * 512, "raw".into()),
        Err(_) => (0, 0, "missing".into()),
    }
}
