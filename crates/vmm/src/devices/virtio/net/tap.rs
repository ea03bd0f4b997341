//! A host TAP interface opened through `/dev/net/tun`.
//!
//! The TAP is opened with `IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`: each read or
//! write on the file descriptor is one Ethernet frame preceded by a
//! `virtio_net_hdr_v1` (the header size is set to [`VNET_HDR_LEN`]). The
//! descriptor is non-blocking. A TAP the VMM created disappears when it is
//! closed; one created beforehand (`ip tuntap add ... mode tap`) persists.

use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

use super::{NetBackend, VNET_HDR_LEN};

const TUN_DEVICE: &str = "/dev/net/tun";

/// Why a TAP interface could not be opened or configured.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    /// The interface name is empty, too long or contains a NUL byte.
    #[error("invalid TAP interface name {0:?}: 1 to {max} bytes, no NUL", max = libc::IFNAMSIZ - 1)]
    InvalidName(String),
    /// `/dev/net/tun` could not be opened.
    #[error("cannot open {TUN_DEVICE}")]
    OpenTun(#[source] io::Error),
    /// `TUNSETIFF` failed (no permission, or the name is taken by a
    /// non-TAP interface).
    #[error("cannot attach to TAP interface {name:?}")]
    SetIff {
        /// The requested interface name.
        name: String,
        /// The ioctl's error.
        #[source]
        source: io::Error,
    },
    /// `TUNSETVNETHDRSZ` failed.
    #[error("cannot set the TAP virtio-net header size")]
    SetVnetHdrSize(#[source] io::Error),
    /// `TUNSETOFFLOAD` failed.
    #[error("cannot set TAP offload flags {flags:#x}")]
    SetOffload {
        /// The requested `TUN_F_*` flags.
        flags: u32,
        /// The ioctl's error.
        #[source]
        source: io::Error,
    },
}

/// An open TAP interface carrying frames with virtio-net headers.
#[derive(Debug)]
pub struct Tap {
    file: File,
    name: String,
}

impl Tap {
    /// Opens the TAP interface `name`, creating it if it does not exist, in
    /// non-blocking mode with a 12-byte virtio-net header on every frame.
    /// A name with `%d` (e.g. `tap%d`) lets the kernel pick the number; see
    /// [`Tap::name`].
    pub fn open(name: &str) -> Result<Self, TapError> {
        let ifr_name = interface_name(name)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(TUN_DEVICE)
            .map_err(TapError::OpenTun)?;

        // SAFETY: `ifreq` is plain old data (a name array and a union of
        // integers and pointers that are never dereferenced here); all-zero
        // bytes are a valid value.
        let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
        ifr.ifr_name = ifr_name;
        ifr.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as i16;
        // SAFETY: `file` is an open tun descriptor and TUNSETIFF reads and
        // writes one `struct ifreq`, which `ifr` is and outlives the call.
        let ret = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut ifr) };
        if ret < 0 {
            return Err(TapError::SetIff {
                name: name.to_owned(),
                source: io::Error::last_os_error(),
            });
        }

        let hdr_len = VNET_HDR_LEN as libc::c_int;
        // SAFETY: `file` is an attached tun descriptor and TUNSETVNETHDRSZ
        // reads one `int` through the pointer, which `hdr_len` outlives.
        let ret = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETVNETHDRSZ, &hdr_len) };
        if ret < 0 {
            return Err(TapError::SetVnetHdrSize(io::Error::last_os_error()));
        }

        // The kernel wrote back the interface's actual name (it differs
        // from `name` when the name had a `%d`).
        let name_bytes: Vec<u8> = ifr
            .ifr_name
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        let name = String::from_utf8_lossy(&name_bytes).into_owned();
        Ok(Self { file, name })
    }

    /// The interface's name on the host.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Sets the TAP's offloads (`TUN_F_*` flags): what it may hand to the
    /// guest with partial checksums or as large segments.
    pub fn set_offload(&self, flags: u32) -> Result<(), TapError> {
        self.ioctl_set_offload(flags)
            .map_err(|source| TapError::SetOffload { flags, source })
    }

    fn ioctl_set_offload(&self, flags: u32) -> io::Result<()> {
        // SAFETY: `file` is an attached tun descriptor and TUNSETOFFLOAD
        // takes its argument by value; no memory is passed.
        let ret = unsafe {
            libc::ioctl(
                self.file.as_raw_fd(),
                libc::TUNSETOFFLOAD,
                libc::c_ulong::from(flags),
            )
        };
        if ret < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

/// Validates `name` and converts it to a NUL-terminated `ifr_name`.
fn interface_name(name: &str) -> Result<[libc::c_char; libc::IFNAMSIZ], TapError> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ || bytes.contains(&0) {
        return Err(TapError::InvalidName(name.to_owned()));
    }
    let mut ifr_name = [0; libc::IFNAMSIZ];
    for (dst, &src) in ifr_name.iter_mut().zip(bytes) {
        *dst = src as libc::c_char;
    }
    Ok(ifr_name)
}

impl NetBackend for Tap {
    fn recv(&mut self, hdr: &mut [u8; VNET_HDR_LEN], frame: &mut [u8]) -> io::Result<usize> {
        let len =
            (&self.file).read_vectored(&mut [IoSliceMut::new(hdr), IoSliceMut::new(frame)])?;
        len.checked_sub(VNET_HDR_LEN).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                "TAP frame shorter than its header",
            )
        })
    }

    fn send(&mut self, hdr: &[u8; VNET_HDR_LEN], frame: &[u8]) -> io::Result<usize> {
        let len = (&self.file).write_vectored(&[IoSlice::new(hdr), IoSlice::new(frame)])?;
        // A TAP write is one frame: it is taken whole or not at all.
        if len != VNET_HDR_LEN + frame.len() {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "TAP accepted part of a frame",
            ));
        }
        Ok(frame.len())
    }

    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    fn set_offload(&mut self, flags: u32) -> io::Result<()> {
        self.ioctl_set_offload(flags)
    }

    fn name(&self) -> &str {
        &self.name
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;
    use crate::devices::virtio::net::test_utils::{
        open_tap_or_fail as open_or_fail, packet_socket, poll_until, set_link_up, test_frame,
        test_tap_name, TEST_ETHERTYPE,
    };

    fn link_exists(name: &str) -> bool {
        Command::new("ip")
            .args(["link", "show", "dev", name])
            .output()
            .expect("run `ip link show` (iproute2)")
            .status
            .success()
    }

    /// Deletes a persistent interface when dropped, even if the test fails.
    struct LinkGuard(String);

    impl Drop for LinkGuard {
        fn drop(&mut self) {
            let _ = Command::new("ip")
                .args(["link", "del", "dev", &self.0])
                .output();
        }
    }

    #[test]
    fn test_tap_open_new_name_interface_exists_while_open() {
        let name = test_tap_name("a");

        let tap = open_or_fail(&name);

        assert_eq!(tap.name(), name);
        assert!(link_exists(&name), "TAP {name} not visible to `ip link`");
    }

    #[test]
    fn test_tap_drop_created_interface_is_removed() {
        let name = test_tap_name("b");
        let tap = open_or_fail(&name);

        drop(tap);

        assert!(!link_exists(&name), "TAP {name} still exists after close");
    }

    #[test]
    fn test_tap_open_existing_persistent_interface_attaches() {
        let name = test_tap_name("c");
        let status = Command::new("ip")
            .args(["tuntap", "add", "dev", &name, "mode", "tap"])
            .status()
            .expect("run `ip tuntap add` (iproute2)");
        assert!(status.success(), "`ip tuntap add dev {name}` failed");
        let _guard = LinkGuard(name.clone());

        let tap = open_or_fail(&name);

        assert_eq!(tap.name(), name);
    }

    #[test]
    fn test_tap_open_pattern_name_kernel_picks_name() {
        let tap = open_or_fail("tntest%d");

        assert!(tap.name().starts_with("tntest"));
        assert!(!tap.name().contains('%'));
        assert!(link_exists(tap.name()));
    }

    #[test]
    fn test_tap_set_offload_csum_tso_succeeds() {
        let tap = open_or_fail(&test_tap_name("d"));

        let result = tap.set_offload(libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6);

        assert!(result.is_ok(), "{result:?}");
    }

    #[test]
    fn test_tap_recv_nothing_queued_would_block() {
        let mut tap = open_or_fail(&test_tap_name("e"));
        let mut hdr = [0; VNET_HDR_LEN];
        let mut frame = [0; 64];

        let err = tap.recv(&mut hdr, &mut frame).expect_err("no frame queued");

        assert_eq!(err.kind(), io::ErrorKind::WouldBlock);
    }

    #[test]
    fn test_tap_send_link_up_frame_written_whole() {
        let name = test_tap_name("f");
        let mut tap = open_or_fail(&name);
        set_link_up(&name);
        let hdr = [0; VNET_HDR_LEN];
        let frame = [0xab; 60];

        let written = tap.send(&hdr, &frame).expect("send to TAP");

        assert_eq!(written, frame.len());
    }

    #[test]
    fn test_tap_recv_frame_from_host_split_from_header() {
        let name = test_tap_name("h");
        let mut tap = open_or_fail(&name);
        set_link_up(&name);
        let host = packet_socket(&name);
        let sent = test_frame(100, 0x5a);
        (&host).write_all(&sent).expect("transmit on the TAP");
        let mut hdr = [0xff; VNET_HDR_LEN];
        let mut frame = vec![0; 2048];

        // The kernel may queue frames of its own (IPv6 ND); skip them.
        let received = poll_until(|| {
            let len = tap.recv(&mut hdr, &mut frame)?;
            Ok((frame[12..14] == TEST_ETHERTYPE.to_be_bytes()).then(|| frame[..len].to_vec()))
        });

        assert_eq!(received, sent);
        assert_eq!(hdr[0], 0, "no checksum flags without offloads");
        assert_eq!(hdr[1], 0, "no GSO without offloads");
    }

    #[test]
    fn test_tap_send_frame_reaches_host_without_header() {
        let name = test_tap_name("i");
        let mut tap = open_or_fail(&name);
        set_link_up(&name);
        let host = packet_socket(&name);
        let sent = test_frame(80, 0xa5);

        tap.send(&[0; VNET_HDR_LEN], &sent).expect("send to TAP");

        let mut buf = vec![0; 2048];
        let received = poll_until(|| {
            let len = (&host).read(&mut buf)?;
            Ok(Some(buf[..len].to_vec()))
        });
        assert_eq!(received, sent);
    }

    #[test]
    fn test_tap_send_link_down_fails() {
        let mut tap = open_or_fail(&test_tap_name("g"));
        let hdr = [0; VNET_HDR_LEN];

        let result = tap.send(&hdr, &[0xab; 60]);

        assert!(result.is_err(), "{result:?}");
    }

    #[test]
    fn test_tap_open_long_name_invalid_name() {
        let result = Tap::open("a-name-longer-than-15");

        assert!(matches!(result, Err(TapError::InvalidName(_))));
    }

    #[test]
    fn test_tap_open_empty_name_invalid_name() {
        assert!(matches!(Tap::open(""), Err(TapError::InvalidName(_))));
    }

    #[test]
    fn test_tap_open_nul_in_name_invalid_name() {
        assert!(matches!(Tap::open("ta\0p"), Err(TapError::InvalidName(_))));
    }
}
