//! `tine-guest-util`: small guest-side helpers for tests, run inside test
//! VMs (packed into their initramfs with the libraries it needs).
//!
//! ```text
//! tine-guest-util vsock-echo PORT     serve: each line is answered with
//!                                     "pong <hostname>: <line>"
//! tine-guest-util vsock-send PORT MSG connect to the host (CID 2) and
//!                                     send MSG and a newline
//! ```

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};

const VMADDR_CID_ANY: u32 = u32::MAX;
const VMADDR_CID_HOST: u32 = 2;

fn sockaddr(cid: u32, port: u32) -> libc::sockaddr_vm {
    // SAFETY: sockaddr_vm is plain old data; all-zero is a valid value.
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    addr.svm_cid = cid;
    addr.svm_port = port;
    addr
}

fn vsock_socket() -> std::io::Result<OwnedFd> {
    // SAFETY: socket() has no memory effects; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn check(ret: libc::c_int) -> std::io::Result<()> {
    if ret < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn echo(port: u32) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let listener = vsock_socket()?;
    let addr = sockaddr(VMADDR_CID_ANY, port);
    // SAFETY: `addr` is a valid sockaddr_vm of the size passed.
    check(unsafe {
        libc::bind(
            listener.as_raw_fd(),
            &addr as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
        )
    })?;
    // SAFETY: listen() on a bound socket we own.
    check(unsafe { libc::listen(listener.as_raw_fd(), 16) })?;
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let host = host.trim().to_string();
    println!("tine-guest-util: vsock echo listening on port {port}");
    loop {
        // SAFETY: accept() on our listening socket; peer address not wanted.
        let fd = unsafe {
            libc::accept4(
                listener.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        };
        if fd < 0 {
            continue;
        }
        // SAFETY: `fd` is a freshly accepted descriptor we own.
        let stream = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        let host = host.clone();
        std::thread::spawn(move || {
            let mut writer = match stream.try_clone() {
                Ok(w) => w,
                Err(_) => return,
            };
            for line in BufReader::new(stream).lines() {
                let Ok(line) = line else { break };
                if writeln!(writer, "pong {host}: {line}").is_err() {
                    break;
                }
            }
        });
    }
}

fn send(port: u32, message: &str) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let socket = vsock_socket()?;
    let addr = sockaddr(VMADDR_CID_HOST, port);
    // SAFETY: `addr` is a valid sockaddr_vm of the size passed.
    check(unsafe {
        libc::connect(
            socket.as_raw_fd(),
            &addr as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
        )
    })?;
    let mut stream = std::fs::File::from(socket);
    writeln!(stream, "{message}")?;
    let mut reply = String::new();
    let _ = stream.read_to_string(&mut reply);
    print!("{reply}");
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let port = |s: Option<&String>| s.and_then(|p| p.parse::<u32>().ok());
    let result = match args.first().map(String::as_str) {
        Some("vsock-echo") => match port(args.get(1)) {
            Some(p) => echo(p),
            None => Err(std::io::Error::other("usage: vsock-echo PORT")),
        },
        Some("vsock-send") => match (port(args.get(1)), args.get(2)) {
            (Some(p), Some(m)) => send(p, m),
            _ => Err(std::io::Error::other("usage: vsock-send PORT MSG")),
        },
        _ => Err(std::io::Error::other(
            "usage: tine-guest-util vsock-echo PORT | vsock-send PORT MSG",
        )),
    };
    if let Err(e) = result {
        eprintln!("tine-guest-util: {e}");
        std::process::exit(1);
    }
}
