//! `tine up` in this process, without VMs (so without KVM): what start-up
//! sets for the whole daemon, checked from outside as a client sees it.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

const REQUEST: &[u8] = b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n";

/// A daemon's scratch folder: config, stand-in artifacts, data directory.
struct Up {
    _dir: tempfile::TempDir,
    data: PathBuf,
    socket: PathBuf,
    tcp: String,
}

/// A free TCP port on the loopback (freed again for the daemon to take).
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// Starts `serve` on a fresh data directory with an API-only group and TCP
/// on the loopback; returns once the Unix socket answers.
async fn start() -> Up {
    let dir = tempfile::tempdir().expect("tmp");
    // The daemon only checks that these are files until a VM starts.
    for f in ["tine-vmm", "vmlinux"] {
        std::fs::write(dir.path().join(f), b"").expect("stand-in");
    }
    // As an older daemon left it: readable by everyone.
    let data = dir.path().join("d");
    std::fs::create_dir(&data).expect("mkdir");
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let tcp = format!("127.0.0.1:{}", free_port());
    let yaml = format!(
        "vmm: {}\nkernel: {}\napi:\n  bind: {tcp}\nhost_groups:\n  - name: t\n    count: 0\n",
        dir.path().join("tine-vmm").display(),
        dir.path().join("vmlinux").display(),
    );
    let config = tine_daemon::config::Config::parse(&yaml).expect("config");
    tokio::spawn(tine_daemon::server::serve(config, data.clone()));
    let socket = data.join("tine.sock");
    let began = Instant::now();
    while ask_unix(&socket).await.is_none() {
        assert!(began.elapsed() < Duration::from_secs(30), "no daemon");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Up {
        _dir: dir,
        data,
        socket,
        tcp,
    }
}

/// `GET /healthz` on the Unix socket: the answer, or `None` without one
/// within 2 s.
async fn ask_unix(socket: &Path) -> Option<Vec<u8>> {
    let exchange = async {
        let mut io = tokio::net::UnixStream::connect(socket).await.ok()?;
        io.write_all(REQUEST).await.ok()?;
        let mut answer = Vec::new();
        io.read_to_end(&mut answer).await.ok()?;
        Some(answer)
    };
    tokio::time::timeout(Duration::from_secs(2), exchange)
        .await
        .ok()
        .flatten()
}

#[tokio::test]
async fn idle_tcp_connections_past_the_cap_leave_the_unix_socket_answering() {
    let up = start().await;
    let cap = tine_daemon::server::LISTEN_LIMITS.max_tcp_connections;
    // More idle connections than the cap: a flood that used to take every
    // descriptor of a daemon with the usual limit of 1024.
    let mut idle = Vec::new();
    for _ in 0..cap + 50 {
        idle.push(
            tokio::net::TcpStream::connect(&up.tcp)
                .await
                .expect("connect"),
        );
    }
    let answer = ask_unix(&up.socket)
        .await
        .expect("the Unix socket answers during a TCP flood");
    assert!(answer.starts_with(b"HTTP/1.1 200"), "{answer:?}");
    // The ones over the cap were closed at once.
    let reads = idle.iter_mut().map(|io| async move {
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_millis(500), io.read(&mut byte));
        matches!(read.await, Ok(Ok(0) | Err(_)))
    });
    let closed = futures_util::future::join_all(reads)
        .await
        .into_iter()
        .filter(|closed| *closed)
        .count();
    assert_eq!(closed, 50, "connections over the cap of {cap} kept open");
}

fn mode(path: &Path) -> u32 {
    std::fs::symlink_metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o7777
}

/// Every path below `dir`.
fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("list") {
        let path = entry.expect("entry").path();
        out.push(path.clone());
        if std::fs::symlink_metadata(&path).expect("stat").is_dir() {
            walk(&path, out);
        }
    }
}

#[tokio::test]
async fn the_data_directory_and_what_the_daemon_writes_are_private() {
    let up = start().await;
    assert_eq!(mode(&up.data), 0o700, "data directory");
    assert_eq!(mode(&up.socket), 0o660, "API socket");
    // The database (with userdata in it) was created after start.
    assert_eq!(mode(&up.data.join("tine.db")), 0o600, "tine.db");
    let mut paths = Vec::new();
    walk(&up.data, &mut paths);
    for path in paths.iter().filter(|p| **p != up.socket) {
        assert_eq!(mode(path) & 0o077, 0, "{} is not private", path.display());
    }
    // The VMMs inherit the umask: so does any child.
    let out = std::process::Command::new("sh")
        .args(["-c", "umask"])
        .output()
        .expect("sh");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "0077");
    // A file made by the daemon's process now is private too.
    let later = up.data.join("later");
    std::fs::write(&later, b"x").expect("write");
    assert_eq!(mode(&later), 0o600);
}
