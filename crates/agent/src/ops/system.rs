//! Health, stats, fix-ups, userdata, network and shutdown: thin wrappers over
//! [`crate::system`].

use std::path::Path;
use std::time::Duration;

use base64::Engine as _;
use tine_proto::agent::{
    AuthorizedKeysRequest, ErrorCode, FixupReport, FixupRequest, Health, KeysReport,
    NetworkRequest, Response, SecretsReport, SecretsSyncRequest, ShutdownRequest,
    UserdataRunRequest, UserdataStatus, PROTOCOL_VERSION,
};

use super::files::blocking;
use crate::error::{describe_error, OpError};
use crate::system;

/// The agent's build version.
pub const AGENT_VERSION: &str = env!("CARGO_PKG_VERSION");

fn millis(d: Duration) -> u64 {
    d.as_millis().min(u128::from(u64::MAX)) as u64
}

fn userdata_wire(status: system::UserdataStatus) -> UserdataStatus {
    UserdataStatus {
        present: status.present,
        ran: status.ran,
        exit_code: status.exit_code,
    }
}

/// Answers [`Response::Health`] for an agent that has run for
/// `agent_uptime` over the system at `root`.
pub(crate) async fn health(root: &Path, agent_uptime: Duration) -> Result<Response, OpError> {
    let root = root.to_path_buf();
    let (system_uptime, userdata) =
        blocking(move || Ok((system::system_uptime(), system::userdata_status(&root)))).await?;
    Ok(Response::Health(Health {
        agent_version: AGENT_VERSION.to_owned(),
        protocol: PROTOCOL_VERSION,
        agent_uptime_ms: millis(agent_uptime),
        system_uptime_ms: millis(system_uptime),
        userdata: userdata_wire(userdata),
    }))
}

/// Answers [`Response::Stats`] with the guest's figures.
pub(crate) async fn stats() -> Result<Response, OpError> {
    let stats = blocking(|| {
        Ok(system::stats::read_stats(
            &system::stats::StatsSources::default(),
        ))
    })
    .await?;
    Ok(Response::Stats(Box::new(stats)))
}

/// Applies fix-ups to the system at `root` and answers
/// [`Response::Fixups`] with the report.
pub(crate) async fn fixups(root: &Path, req: FixupRequest) -> Result<Response, OpError> {
    if let Some(name) = &req.hostname {
        if !system::valid_hostname(name) {
            return Err(OpError::new(
                ErrorCode::BadRequest,
                format!("invalid hostname {name:?}"),
            ));
        }
    }
    let root = root.to_path_buf();
    let request = system::FixupRequest {
        hostname: req.hostname,
        machine_id: req.machine_id,
        ssh_host_keys: req.ssh_host_keys,
        entropy: req.entropy,
        clock_unix_nanos: req.clock_unix_nanos,
    };
    let report = blocking(move || Ok(system::apply_fixups(&request, &root))).await?;
    Ok(Response::Fixups(Box::new(FixupReport {
        hostname: report.hostname,
        machine_id: report.machine_id,
        ssh_host_keys: report.ssh_host_keys,
        entropy_bytes: report.entropy_bytes,
        reseeded: report.reseeded,
        clock_set: report.clock_set,
        random_seed_removed: report.random_seed_removed,
        errors: report.errors,
        steps: report.steps,
    })))
}

/// Answers [`Response::Userdata`] for the system at `root`.
pub(crate) async fn userdata(root: &Path) -> Result<Response, OpError> {
    let root = root.to_path_buf();
    let status = blocking(move || Ok(system::userdata_status(&root))).await?;
    Ok(Response::Userdata(userdata_wire(status)))
}

/// Installs the userdata script unless userdata already ran here, starts
/// it in the background and answers [`Response::Userdata`] (the state
/// before it runs; poll `userdata_status` for the result).
pub(crate) async fn userdata_run(
    root: &Path,
    req: UserdataRunRequest,
) -> Result<Response, OpError> {
    let root = root.to_path_buf();
    let status = blocking(move || {
        system::userdata::install(&root, &req.script)
            .map_err(|e| OpError::new(ErrorCode::Io, describe_error(&e)))?;
        let status = system::userdata_status(&root);
        if !status.ran {
            system::userdata::spawn_run_once(root);
        }
        Ok(status)
    })
    .await?;
    Ok(Response::Userdata(userdata_wire(status)))
}

/// Applies an interface configuration and answers [`Response::Ok`].
pub(crate) async fn network(req: NetworkRequest) -> Result<Response, OpError> {
    if req.prefix > 32 {
        return Err(OpError::new(
            ErrorCode::BadRequest,
            format!("prefix length {} is over 32", req.prefix),
        ));
    }
    let mac = match &req.mac {
        Some(text) => Some(NetworkRequest::parse_mac(text).ok_or_else(|| {
            OpError::new(
                ErrorCode::BadRequest,
                format!("MAC address `{text}` is not six hex pairs such as 02:00:00:00:00:01"),
            )
        })?),
        None => None,
    };
    let config = system::net::NetConfig {
        mac,
        iface: req.iface,
        addr: req.address,
        prefix: req.prefix,
        gateway: req.gateway,
        dns: req.dns,
    };
    blocking(move || {
        system::net::configure(&config).map_err(|e| OpError::new(ErrorCode::Io, describe_error(&e)))
    })
    .await?;
    Ok(Response::Ok)
}

/// Starts a clean shutdown and answers [`Response::Ok`]: as PID 1 the
/// shutdown runs on its own thread (terminate, sync, remount `/` read-only,
/// power off) while the answer goes out; under another init (systemd) the
/// agent asks it to `poweroff` or `reboot`.
pub(crate) async fn shutdown(req: ShutdownRequest) -> Result<Response, OpError> {
    blocking(move || {
        system::init::request_shutdown(req.action)
            .map_err(|e| OpError::new(ErrorCode::Io, describe_error(&e)))
    })
    .await?;
    Ok(Response::Ok)
}

/// Makes the secrets folder under `root` hold exactly the request's
/// secrets and answers [`Response::Secrets`]. A tmpfs is mounted there
/// first when `root` is the real `/`.
pub(crate) async fn secrets_sync(
    root: &Path,
    req: SecretsSyncRequest,
) -> Result<Response, OpError> {
    let mut secrets = Vec::with_capacity(req.secrets.len());
    for s in req.secrets {
        let data = base64::engine::general_purpose::STANDARD
            .decode(&s.data)
            .map_err(|e| {
                OpError::bad_request(format!("secret {}: data is not base64: {e}", s.name))
            })?;
        secrets.push(system::secrets::Secret {
            name: s.name,
            data,
            mode: s.mode,
            uid: s.uid,
            gid: s.gid,
        });
    }
    let root = root.to_path_buf();
    let report = blocking(move || {
        let mount = root == Path::new("/");
        system::secrets::sync(&root, &secrets, mount).map_err(|e| {
            let code = if e.kind() == std::io::ErrorKind::InvalidInput {
                ErrorCode::BadRequest
            } else {
                ErrorCode::Io
            };
            OpError::new(code, format!("sync secrets: {}", describe_error(&e)))
        })
    })
    .await?;
    Ok(Response::Secrets(SecretsReport {
        dir: system::secrets::SECRETS_DIR.to_owned(),
        written: report.written,
        removed: report.removed,
    }))
}

/// Adds public SSH keys for root and the login user under `root` and
/// answers [`Response::Keys`].
pub(crate) async fn authorized_keys(
    root: &Path,
    req: AuthorizedKeysRequest,
) -> Result<Response, OpError> {
    let root = root.to_path_buf();
    let outcome = blocking(move || {
        system::authorized_keys::install(&root, &req.keys).map_err(|e| {
            let code = if e.kind() == std::io::ErrorKind::InvalidInput {
                ErrorCode::BadRequest
            } else {
                ErrorCode::Io
            };
            OpError::new(code, format!("authorized keys: {}", describe_error(&e)))
        })
    })
    .await?;
    Ok(Response::Keys(KeysReport {
        users: outcome.users,
        added: outcome.added,
    }))
}
