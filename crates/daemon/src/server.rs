//! `tine up`: lock the data directory, open the state, reconcile, serve the
//! API on the Unix socket (and TCP with the token) until SIGINT or SIGTERM.
//!
//! Stopping the daemon leaves VMs running: the next `tine up` adopts them.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use nix::fcntl::{Flock, FlockArg};

use crate::config::{Config, DEFAULT_DATA_DIR};
use crate::core::Daemon;

/// Unix socket paths longer than this do not fit `sockaddr_un` once the
/// VM folder and socket names are appended.
const MAX_DATA_DIR_LEN: usize = 64;

/// Holds the data directory's lock while the daemon runs.
#[derive(Debug)]
pub struct DataDirLock {
    _lock: Flock<std::fs::File>,
}

/// Takes `<data_dir>/tine.lock`; a second daemon gets an error naming the
/// first one's pid.
pub fn lock_data_dir(data_dir: &Path) -> anyhow::Result<DataDirLock> {
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("create data directory {}", data_dir.display()))?;
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
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TINE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .try_init();
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
    // We hold the lock, so an existing socket file is stale.
    match std::fs::remove_file(&socket) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("remove stale {}", socket.display()))
        }
        _ => {}
    }
    let unix = tokio::net::UnixListener::bind(&socket)
        .with_context(|| format!("listen on {}", socket.display()))?;
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o660))?;
    let app = crate::api::app(daemon.clone());
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(async move {
        axum::serve(unix, app)
            .await
            .context("serve the Unix socket")
    });
    if let Some(bind) = bind {
        let tcp = tokio::net::TcpListener::bind(&bind)
            .await
            .with_context(|| format!("listen on {bind}"))?;
        let app = crate::api::app_with_token(daemon.clone(), token);
        tracing::info!(
            "listening on http://{bind} (bearer token in {}/auth/token)",
            data_dir.display()
        );
        tasks.spawn(async move { axum::serve(tcp, app).await.context("serve TCP") });
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
    let _ = std::io::stdout().flush();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => tracing::info!("interrupted; VMs keep running"),
        _ = term.recv() => tracing::info!("terminated; VMs keep running"),
        Some(r) = tasks.join_next() => {
            r.context("listener task")??;
        }
    }
    let _ = std::fs::remove_file(&socket);
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
    Ok(Daemon::from_parts(crate::core::Parts {
        config,
        data_dir,
        store,
        kernel,
        launcher,
        network: crate::network::NetworkManager::default(),
        deadlines: crate::core::Deadlines::default(),
    }))
}
