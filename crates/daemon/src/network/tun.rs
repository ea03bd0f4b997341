//! Creating persistent TAP devices through `/dev/net/tun`, in-process (what
//! `ip tuntap add dev NAME mode tap vnet_hdr` does).

use std::fs::OpenOptions;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

use super::error::NetworkError;

const TUN_DEVICE: &str = "/dev/net/tun";

/// Creates the persistent TAP `name` with the flags tine-vmm opens it with
/// (`IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`). It starts down, without an owner
/// (only root may attach to it), and stays when the descriptor is closed.
/// A TAP that already exists and is not in use is taken over as it is; the
/// caller checks for one first.
pub(crate) fn create_tap(name: &str) -> Result<(), NetworkError> {
    let err = |operation: &'static str| {
        let name = name.to_owned();
        move |source| NetworkError::Tun {
            operation,
            name,
            source,
        }
    };
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ || bytes.contains(&0) {
        return Err(NetworkError::BadInterfaceName {
            name: name.to_owned(),
            reason: "not 1 to 15 bytes without NUL",
        });
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(TUN_DEVICE)
        .map_err(err("open /dev/net/tun"))?;

    // SAFETY: `ifreq` is plain old data (a name array and a union of
    // integers and pointers that are never dereferenced here); all-zero
    // bytes are a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, &src) in ifr.ifr_name.iter_mut().zip(bytes) {
        *dst = src as libc::c_char;
    }
    ifr.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as i16;
    // SAFETY: `file` is an open tun descriptor and TUNSETIFF reads and
    // writes one `struct ifreq`, which `ifr` is and outlives the call.
    if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut ifr) } < 0 {
        return Err(err("TUNSETIFF")(io::Error::last_os_error()));
    }
    // SAFETY: `file` is attached to the TAP; TUNSETPERSIST takes its
    // argument by value, no memory is passed.
    if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETPERSIST, 1 as libc::c_ulong) } < 0 {
        // Closing `file` removes the TAP again: nothing is left behind.
        return Err(err("TUNSETPERSIST")(io::Error::last_os_error()));
    }
    Ok(())
}
