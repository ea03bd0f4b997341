//! `tine up`: lock the data directory, open the state, reconcile, serve the
//! API on the Unix socket (and TCP with the token) until SIGINT or SIGTERM.
//!
//! Stopping the daemon leaves VMs running: the next `tine up` adopts them.
//!
//! Both listeners are served by [`serve_unix`] and [`serve_tcp`]: a client
//! must send a request's headers within [`ListenLimits::header_read_timeout`],
//! and TCP, where anyone who can reach the port may connect before the
//! token is checked, takes at most [`ListenLimits::max_tcp_connections`] at
//! once, so idle TCP connections cannot use up the daemon's file
//! descriptors and leave the Unix socket unanswered.
//!
//! What the daemon writes (the database with the userdata in it, serial
//! logs, VM sockets) is private: the process runs with umask 077, which
//! the VMMs inherit, and the data directory is 0700. Only the API socket is
//! opened up, to 0660.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use axum::Router;
use nix::fcntl::{Flock, FlockArg};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::{Config, DEFAULT_DATA_DIR};
use crate::core::Daemon;

/// Unix socket paths longer than this do not fit `sockaddr_un` once the
/// VM folder and socket names are appended.
const MAX_DATA_DIR_LEN: usize = 64;

/// Limits of the API listeners.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenLimits {
    /// A connection must send a request's headers within this time (an
    /// idle keep-alive connection too), or it is closed.
    pub header_read_timeout: Duration,
    /// TCP connections served at once; more are closed as they arrive.
    /// The Unix socket has no such limit.
    pub max_tcp_connections: usize,
}

/// The limits `tine up` serves with (docs/daemon.md).
pub const LISTEN_LIMITS: ListenLimits = ListenLimits {
    header_read_timeout: Duration::from_secs(10),
    max_tcp_connections: 256,
};

/// The pause after a failed `accept` (out of file descriptors, say).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Serves one accepted connection in a task: HTTP/1 with upgrades (the
/// shell and forward WebSockets) and the header-read timeout. `permit`
/// is held until the connection ends.
fn serve_connection<IO>(
    io: IO,
    app: Router,
    limits: ListenLimits,
    permit: Option<OwnedSemaphorePermit>,
) where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    tokio::spawn(async move {
        let _permit = permit;
        let service = hyper_util::service::TowerToHyperService::new(app);
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout)
            .serve_connection(hyper_util::rt::TokioIo::new(io), service)
            .with_upgrades();
        if let Err(e) = connection.await {
            tracing::debug!("API connection ended: {e}");
        }
    });
}

/// Serves `app` on a Unix socket for ever (see [`ListenLimits`]).
pub async fn serve_unix(listener: tokio::net::UnixListener, app: Router, limits: ListenLimits) {
    loop {
        match listener.accept().await {
            Ok((io, _)) => serve_connection(io, app.clone(), limits, None),
            Err(e) => {
                tracing::warn!("accept on the Unix socket failed: {e}");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
            }
        }
    }
}

/// Serves `app` on TCP for ever, at most
/// [`ListenLimits::max_tcp_connections`] connections at once: one more is
/// closed as soon as it is accepted.
pub async fn serve_tcp(listener: tokio::net::TcpListener, app: Router, limits: ListenLimits) {
    let slots = Arc::new(Semaphore::new(limits.max_tcp_connections));
    loop {
        match listener.accept().await {
            Ok((io, peer)) => match slots.clone().try_acquire_owned() {
                Ok(permit) => serve_connection(io, app.clone(), limits, Some(permit)),
                Err(_) => {
                    tracing::debug!(
                        "closed a TCP connection from {peer}: {} are open",
                        limits.max_tcp_connections
                    );
                    drop(io);
                }
            },
            Err(e) => {
                tracing::warn!("accept on TCP failed: {e}");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
            }
        }
    }
}

/// Raises the soft limit on open files to the hard limit (VMs, their
/// sockets and API connections all take descriptors); returns the limit.
pub fn raise_open_files_limit() -> std::io::Result<u64> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(std::io::Error::from)?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).map_err(std::io::Error::from)?;
    }
    Ok(hard)
}

/// Holds the data directory's lock while the daemon runs.
#[derive(Debug)]
pub struct DataDirLock {
    _lock: Flock<std::fs::File>,
}

/// The umask of the daemon process, inherited by its VMMs: what they create
/// is for the daemon's user alone.
pub const DAEMON_UMASK: u32 = 0o077;

/// Sets [`DAEMON_UMASK`] for the whole process.
pub fn set_private_umask() {
    use nix::sys::stat::{umask, Mode};
    umask(Mode::from_bits_truncate(DAEMON_UMASK));
}

/// Takes `<data_dir>/tine.lock`, creating the data directory (mode 0700,
/// also when it exists); a second daemon gets an error naming the first
/// one's pid.
pub fn lock_data_dir(data_dir: &Path) -> anyhow::Result<DataDirLock> {
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("create data directory {}", data_dir.display()))?;
    std::fs::set_permissions(data_dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("make {} private (mode 0700)", data_dir.display()))?;
    let path = data_dir.join("tine.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("open {}", path.display()))?;
    let mut lock = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(l) => l,
        Err((_, errno)) => {
            let other = std::fs::read_to_string(&path).unwrap_or_default();
            bail!(
                "another tine daemon (pid {}) is using {}; stop it first ({errno})",
                other.trim(),
                data_dir.display()
            );
        }
    };
    lock.set_len(0).context("truncate lock file")?;
    write!(lock, "{}", std::process::id()).context("write lock file")?;
    Ok(DataDirLock { _lock: lock })
}

/// Reads `<data_dir>/auth/token`, creating it (mode 0600) on first start.
pub fn load_or_create_token(data_dir: &Path) -> anyhow::Result<String> {
    let dir = data_dir.join("auth");
    let path = dir.join("token");
    match std::fs::read_to_string(&path) {
        Ok(t) if !t.trim().is_empty() => return Ok(t.trim().to_owned()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("read {}", path.display())),
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
    let mut raw = [0u8; 32];
    getrandom::fill(&mut raw).map_err(|e| anyhow::anyhow!("random token: {e}"))?;
    let token: String = raw.iter().map(|b| format!("{b:02x}")).collect();
    let tmp = dir.join(".token.tmp");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("create {}", tmp.display()))?;
    f.write_all(token.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, &path).with_context(|| format!("write {}", path.display()))?;
    Ok(token)
}

/// Entry point of `tine up [tine.yaml] [--data-dir D]`.
pub fn run_from_cli(config_path: Option<PathBuf>, data_dir: Option<PathBuf>) -> anyhow::Result<()> {
    let config = match &config_path {
        Some(p) => Config::load(p)?,
        None => Config::embedded_default(),
    };
    let data_dir = data_dir
        .or_else(|| config.data_dir.clone())
        .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR));
    let data_dir = if data_dir.is_absolute() {
        data_dir
    } else {
        std::env::current_dir()?.join(data_dir)
    };
    crate::failpoint::arm_from_env()?;
    if let Err(e) = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TINE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .try_init()
    {
        // A logger set up already (the daemon run in-process) logs instead.
        eprintln!("tine up: keeping the logger already set up: {e}");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?;
    runtime.block_on(serve(config, data_dir))
}

/// Runs the daemon until SIGINT or SIGTERM.
pub async fn serve(config: Config, data_dir: PathBuf) -> anyhow::Result<()> {
    if data_dir.as_os_str().len() > MAX_DATA_DIR_LEN {
        bail!(
            "data directory {} is longer than {MAX_DATA_DIR_LEN} bytes: VM sockets below it would not fit a Unix socket address",
            data_dir.display()
        );
    }
    set_private_umask();
    match raise_open_files_limit() {
        Ok(limit) => tracing::debug!("open files limit {limit}"),
        Err(e) => tracing::warn!("cannot raise the open files limit: {e}"),
    }
    let _lock = lock_data_dir(&data_dir)?;
    let token = load_or_create_token(&data_dir)?;
    let socket = config
        .api
        .socket
        .clone()
        .unwrap_or_else(|| data_dir.join("tine.sock"));
    let bind = config.api.bind.clone();
    let daemon = open_daemon(config, data_dir.clone())?;
    let report = daemon.reconcile().await?;
    tracing::info!(
        adopted = ?report.adopted,
        relaunched = ?report.relaunched,
        removed = ?report.removed,
        killed = ?report.killed,
        created = ?report.created,
        "reconciled"
    );
    // After the strays (an earlier daemon's pool among them) are gone.
    daemon.refresh_pools();
    daemon.sync_state_periodically();
    // We hold the lock, so an existing socket file is stale.
    match std::fs::remove_file(&socket) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("remove stale {}", socket.display()))
        }
        _ => {}
    }
    let unix = tokio::net::UnixListener::bind(&socket)
        .with_context(|| format!("listen on {}", socket.display()))?;
    // Bound under the umask (0600); the socket alone is for the group too.
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o660))?;
    let app = crate::api::app(daemon.clone());
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(serve_unix(unix, app, LISTEN_LIMITS));
    if let Some(bind) = bind {
        let tcp = tokio::net::TcpListener::bind(&bind)
            .await
            .with_context(|| format!("listen on {bind}"))?;
        let app = crate::api::app_with_token(daemon.clone(), token);
        tracing::info!(
            "listening on http://{bind} (bearer token in {}/auth/token)",
            data_dir.display()
        );
        tasks.spawn(serve_tcp(tcp, app, LISTEN_LIMITS));
    }
    tracing::info!(
        "tine daemon {} ready on {} (data in {})",
        env!("CARGO_PKG_VERSION"),
        socket.display(),
        data_dir.display()
    );
    println!(
        "{{\"event\":\"ready\",\"socket\":{:?},\"pid\":{}}}",
        socket.display().to_string(),
        std::process::id()
    );
    if let Err(e) = std::io::stdout().flush() {
        tracing::warn!("cannot write the ready line: {e}");
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => tracing::info!("interrupted; VMs keep running"),
        _ = term.recv() => tracing::info!("terminated; VMs keep running"),
        _ = daemon.stop_requested() => tracing::info!("asked to shut down (POST /daemon/shutdown); VMs keep running"),
        Some(r) = tasks.join_next() => {
            // The listeners run for ever: only a panic ends one.
            r.context("listener task")?;
        }
    }
    if let Err(e) = std::fs::remove_file(&socket) {
        tracing::warn!("cannot remove {}: {e}", socket.display());
    }
    daemon.drain_pools().await;
    daemon.sync_state().await;
    drop(daemon);
    Ok(())
}

/// Keeps the type referenced for docs.
pub type Shared = Arc<Daemon>;

/// The daemon over `data_dir` (which the caller has locked), running VMs as
/// tine-vmm processes.
pub fn open_daemon(
    config: crate::config::Config,
    data_dir: PathBuf,
) -> anyhow::Result<Arc<Daemon>> {
    use anyhow::Context;
    std::fs::create_dir_all(data_dir.join("vms"))
        .with_context(|| format!("create {}", data_dir.display()))?;
    let db = data_dir.join("tine.db");
    let store = crate::db::Store::open(&db).with_context(|| format!("open {}", db.display()))?;
    let vmm = crate::artifacts::find_vmm(config.vmm.as_deref())?;
    let kernel = crate::artifacts::find_kernel(config.kernel.as_deref(), &data_dir)?;
    let launcher = Arc::new(crate::launcher::vmm::VmmLauncher::new(
        vmm,
        data_dir.clone(),
    ));
    let secrets = crate::secrets::SecretStore::open(&data_dir.join("secrets"))?;
    Ok(Daemon::from_parts(crate::core::Parts {
        config,
        data_dir,
        store,
        secrets,
        kernel,
        launcher,
        network: crate::network::NetworkManager::default(),
        deadlines: crate::core::Deadlines::default(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const REQUEST: &[u8] = b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n";

    /// Reads until the peer closes (or `within` passes: `None`).
    async fn read_to_close<S: tokio::io::AsyncRead + Unpin>(
        io: &mut S,
        within: Duration,
    ) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        let read = tokio::time::timeout(within, async {
            let mut buf = [0u8; 1024];
            loop {
                match io.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => out.extend_from_slice(&buf[..n]),
                }
            }
        });
        read.await.ok().map(|()| out)
    }

    #[tokio::test]
    async fn a_tcp_flood_leaves_the_unix_socket_answering() {
        let limits = ListenLimits {
            header_read_timeout: Duration::from_secs(3),
            max_tcp_connections: 8,
        };
        let app = Router::new().route("/healthz", axum::routing::get(|| async { "ok" }));
        let dir = tempfile::tempdir().expect("tmp");
        let socket = dir.path().join("api.sock");
        let unix = tokio::net::UnixListener::bind(&socket).expect("bind unix");
        let tcp = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind tcp");
        let addr = tcp.local_addr().expect("addr");
        tokio::spawn(serve_unix(unix, app.clone(), limits));
        tokio::spawn(serve_tcp(tcp, app, limits));

        // Fill TCP: idle connections, the first with half a request.
        let began = Instant::now();
        let mut held = Vec::new();
        for _ in 0..limits.max_tcp_connections {
            held.push(tokio::net::TcpStream::connect(addr).await.expect("connect"));
        }
        held[0]
            .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")
            .await
            .expect("half a request");
        // One more is closed at once, without an answer.
        let mut extra = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let _ = extra.write_all(REQUEST).await;
        let answer = read_to_close(&mut extra, Duration::from_secs(2)).await;
        assert_eq!(
            answer,
            Some(Vec::new()),
            "the connection over the cap was served"
        );
        // The Unix socket answers at once.
        let mut io = tokio::net::UnixStream::connect(&socket)
            .await
            .expect("connect");
        io.write_all(REQUEST).await.expect("request");
        let answer = read_to_close(&mut io, Duration::from_secs(2))
            .await
            .expect("the Unix socket answers while TCP is full");
        assert!(answer.starts_with(b"HTTP/1.1 200"), "{answer:?}");
        assert!(
            began.elapsed() < limits.header_read_timeout,
            "too slow to tell"
        );

        // The half-sent request is closed at the header-read timeout.
        let closed = read_to_close(&mut held[0], Duration::from_secs(20))
            .await
            .expect("the half-sent request stays open");
        assert!(!closed.starts_with(b"HTTP/1.1 200"), "{closed:?}");
        assert!(began.elapsed() >= limits.header_read_timeout);
        // The idle ones went too: TCP serves again.
        for idle in &mut held[1..] {
            read_to_close(idle, Duration::from_secs(20))
                .await
                .expect("an idle connection stays open");
        }
        let mut io = tokio::net::TcpStream::connect(addr).await.expect("connect");
        io.write_all(REQUEST).await.expect("request");
        let answer = read_to_close(&mut io, Duration::from_secs(5))
            .await
            .expect("answer");
        assert!(answer.starts_with(b"HTTP/1.1 200"), "{answer:?}");
    }

    #[test]
    fn the_open_files_limit_is_raised_to_the_hard_limit() {
        use nix::sys::resource::{getrlimit, setrlimit, Resource};
        let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
        // Start from a low soft limit, as a default 1024 would be.
        setrlimit(Resource::RLIMIT_NOFILE, hard.min(512), hard).expect("lower");
        assert_eq!(raise_open_files_limit().expect("raise"), hard);
        assert_eq!(
            getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit"),
            (hard, hard)
        );
    }
}
