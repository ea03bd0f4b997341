//! `tine-agent`: the guest agent binary. `tine-agent serve --unix PATH`
//! serves the agent protocol (docs/agent-protocol.md) on a Unix socket;
//! `--vsock-port N` serves it on vsock in a VM. Run as PID 1 without a
//! `serve` command line (the min image's `/sbin/init`), it serves on vsock
//! port [`AGENT_VSOCK_PORT`]. `tine-agent power-off` stops the VM at once
//! through tine-vmm's debug-exit port: the last step of a systemd guest's
//! shutdown (guest/systemd/tine-poweroff), after its file systems are synced
//! and read-only.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use tine_agent::{system, Agent, AgentConfig};
use tine_proto::agent::AGENT_VSOCK_PORT;

#[derive(Parser)]
#[command(name = "tine-agent", version, about = "The tine guest agent")]
struct Cli {
    #[command(subcommand)]
    command: Commands,
}

#[derive(Subcommand)]
enum Commands {
    /// Serve the agent protocol.
    Serve {
        /// Listen on this Unix socket path (replaced if it exists).
        #[arg(long, conflicts_with = "vsock_port")]
        unix: Option<PathBuf>,
        /// Listen on this vsock port (52 in the tine images).
        #[arg(long)]
        vsock_port: Option<u32>,
        /// Root for fix-ups and userdata state.
        #[arg(long, default_value = "/")]
        root: PathBuf,
    },
    /// Stop the VM now (tine-vmm's debug-exit port). Syncs nothing: run it
    /// only once the file systems are synced and read-only.
    PowerOff,
}

/// The command line: as PID 1 the kernel passes init whatever parameters it
/// did not recognise, so anything that is not a valid `serve` command line
/// means the default, `serve --vsock-port 52`.
fn parse_cli() -> Cli {
    if !system::init::is_pid1() {
        return Cli::parse();
    }
    match Cli::try_parse() {
        Ok(cli) => cli,
        Err(_) => Cli {
            command: Commands::Serve {
                unix: None,
                vsock_port: Some(AGENT_VSOCK_PORT),
                root: PathBuf::from("/"),
            },
        },
    }
}

fn main() -> anyhow::Result<()> {
    let cli = parse_cli();
    if let Commands::PowerOff = cli.command {
        system::init::debug_exit(0).context("write tine-vmm's debug-exit port")?;
        // The VMM stops the vCPUs asynchronously; a few more instructions
        // may run. Still running after that: not under tine-vmm.
        std::thread::sleep(std::time::Duration::from_secs(2));
        bail!("the VM is still running: not a tine-vmm guest?");
    }
    // Before the runtime or any thread: PID 1 duties, the reaper every
    // spawn goes through, userdata.
    let started = system::start().context("start the guest system")?;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TINE_AGENT_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let Commands::Serve {
        unix,
        vsock_port,
        root,
    } = cli.command
    else {
        bail!("only `serve` runs the agent");
    };
    let config = AgentConfig {
        system_root: root,
        ..AgentConfig::default()
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?;
    runtime.block_on(async move {
        let agent = Agent::new(config);
        match (unix, vsock_port) {
            (Some(path), _) => {
                match std::fs::remove_file(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(e).context(format!("remove {}", path.display())),
                }
                let listener = tokio::net::UnixListener::bind(&path)
                    .with_context(|| format!("listen on {}", path.display()))?;
                tracing::info!("serving on {}", path.display());
                agent.serve(listener).await;
                Ok(())
            }
            (None, Some(port)) => {
                // In a VM: a disk larger than the image gets used.
                match system::rootfs::grow_root() {
                    Ok(system::rootfs::Growth::Grown { from, to }) => {
                        tracing::info!(from, to, "grew the root file system to its disk")
                    }
                    Ok(_) => {}
                    Err(e) => tracing::warn!("cannot grow the root file system: {e}"),
                }
                let listener = system::vsock::listen(port)?;
                tracing::info!(pid1 = started.pid1, "serving on vsock port {port}");
                agent.serve(listener).await;
                Ok(())
            }
            (None, None) => bail!("give --unix PATH or --vsock-port N"),
        }
    })
}
