//! The agent in a real VM: the min image (the agent as `/sbin/init`) booted
//! on tine-vmm, reached over vsock with Firecracker's `CONNECT` convention,
//! then snapshotted and restored into two forks that the fix-ups make
//! unique. Runs through the test bed (directly or nested); the image is
//! built on the host first, since the nested bed sees the host read-only.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tine_client::proto::{ExecRequest, FileAttrs, FixupRequest, AGENT_VSOCK_PORT};
use tine_client::AgentClient;
use tine_testbed::{guest_kernel, min_image, placement, run_tests, Failed, Trial};
use tine_vmm::device_manager::{DeviceConfigs, DriveConfig, RestoreOverrides, VsockConfig};
use tine_vmm::vmm::{BootConfig, ConsoleConfig, Vmm, DEFAULT_CMDLINE};

/// The environment variable that carries the min image's directory from the
/// host into the test bed.
const IMAGE_ENV: &str = "TINE_TEST_MIN_IMAGE_DIR";

/// How long the agent may take to answer after a boot or restore (the
/// nested bed is slow under load).
const READY_LIMIT: Duration = Duration::from_secs(180);

fn scratch(name: &str) -> Result<PathBuf, Failed> {
    let dir = std::env::temp_dir().join(format!("tine-agent-vm-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn console(log: &Path) -> ConsoleConfig {
    ConsoleConfig {
        log_path: Some(log.to_path_buf()),
        log_limit: None,
        echo_stdout: false,
    }
}

fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// Connects to the agent through the vsock device's socket: `CONNECT`,
/// `OK <port>`, then the agent protocol's handshake. Retries until the
/// agent listens or `limit` passes.
async fn connect_agent(uds: &Path, log: &Path, limit: Duration) -> Result<AgentClient, Failed> {
    let start = Instant::now();
    let mut last_err = String::new();
    while start.elapsed() < limit {
        match vsock_connect(uds, AGENT_VSOCK_PORT) {
            Ok(stream) => {
                let stream = tokio::net::UnixStream::from_std(stream)?;
                match tokio::time::timeout(Duration::from_secs(30), AgentClient::handshake(stream))
                    .await
                {
                    Ok(Ok(client)) => return Ok(client),
                    Ok(Err(e)) => last_err = format!("handshake: {e}"),
                    Err(_) => last_err = "handshake timed out".to_owned(),
                }
            }
            Err(e) => last_err = e,
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Err(format!(
        "agent not reachable on {} within {limit:?}: {last_err}\nconsole:\n{}",
        uds.display(),
        log_tail(log)
    )
    .into())
}

/// The host side of Firecracker's vsock convention. Reads the `OK` line a
/// byte at a time so nothing of the protocol that follows is consumed.
fn vsock_connect(uds: &Path, port: u32) -> Result<UnixStream, String> {
    let mut stream =
        UnixStream::connect(uds).map_err(|e| format!("connect {}: {e}", uds.display()))?;
    let io = |e: std::io::Error| format!("vsock handshake: {e}");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(io)?;
    stream
        .write_all(format!("CONNECT {port}\n").as_bytes())
        .map_err(io)?;
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < 64 {
        match stream.read(&mut byte) {
            Ok(0) => return Err("vsock connection closed before OK".to_owned()),
            Ok(_) if byte[0] == b'\n' => break,
            Ok(_) => line.push(byte[0]),
            Err(e) => return Err(io(e)),
        }
    }
    if !line.starts_with(b"OK ") {
        return Err(format!(
            "vsock handshake answered {:?}",
            String::from_utf8_lossy(&line)
        ));
    }
    stream.set_read_timeout(None).map_err(io)?;
    stream.set_nonblocking(true).map_err(io)?;
    Ok(stream)
}

/// How long one step with the agent may take before the test fails naming
/// it (instead of running into the bed's limit with no word on where).
const STEP_LIMIT: Duration = Duration::from_secs(150);

async fn step<T>(
    what: &str,
    log: &Path,
    call: impl std::future::Future<Output = Result<T, Failed>>,
) -> Result<T, Failed> {
    match tokio::time::timeout(STEP_LIMIT, call).await {
        Ok(done) => done.map_err(|e| format!("{what}: {}", e.message().unwrap_or("failed")).into()),
        Err(_) => Err(format!(
            "{what}: no answer within {STEP_LIMIT:?}; the guest console's last lines:\n{}",
            log_tail(log)
        )
        .into()),
    }
}

async fn sh(client: &AgentClient, script: &str) -> Result<String, Failed> {
    let out = client
        .exec_output(ExecRequest::shell(script))
        .await
        .map_err(|e| format!("exec {script:?}: {e}"))?;
    if out.status.code != Some(0) {
        return Err(format!(
            "{script:?} ended with {:?}: {}",
            out.status,
            out.stderr_lossy()
        )
        .into());
    }
    Ok(out.stdout_lossy())
}

fn agent_in_vm() -> Result<(), Failed> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(agent_in_vm_async())
}

async fn agent_in_vm_async() -> Result<(), Failed> {
    let image_dir = std::env::var(IMAGE_ENV).map_err(|_| format!("{IMAGE_ENV} is not set"))?;
    let dir = scratch("main")?;
    let disk = dir.join("rootfs.ext4");
    std::fs::copy(Path::new(&image_dir).join("rootfs.ext4"), &disk)?;
    let uds = dir.join("vsock.sock");
    let log = dir.join("serial.log");
    let config = BootConfig {
        kernel: guest_kernel()?.vmlinux,
        initramfs: None,
        cmdline: format!("{DEFAULT_CMDLINE} root=/dev/vda rw init=/sbin/init"),
        mem_mib: 256,
        vcpus: 1,
        raw: None,
        devices: DeviceConfigs {
            drives: vec![DriveConfig {
                path: disk.clone(),
                read_only: false,
            }],
            nets: Vec::new(),
            vsock: Some(VsockConfig {
                guest_cid: 3,
                uds_path: uds.clone(),
            }),
            rng: true,
        },
    };
    let started = Instant::now();
    let mut vmm = Vmm::boot(&config, &console(&log))?;
    let client = connect_agent(&uds, &log, READY_LIMIT).await?;
    let health = step("health", &log, async { Ok(client.health().await?) }).await?;
    println!(
        "boot: agent {} ready over vsock in {} ms (system uptime {} ms)",
        health.agent_version,
        started.elapsed().as_millis(),
        health.system_uptime_ms
    );

    let uname = step("uname", &log, sh(&client, "uname -a")).await?;
    if !uname.starts_with("Linux") {
        return Err(format!("uname -a printed {uname:?}").into());
    }

    let blob: Vec<u8> = (0..300_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    step("write a 300 KB file", &log, async {
        Ok(client
            .write_file("/tmp/blob", &blob, FileAttrs::default())
            .await?)
    })
    .await?;
    let back = step("read it back", &log, async {
        Ok(client.read_file("/tmp/blob").await?)
    })
    .await?;
    if back != blob {
        return Err("the uploaded file came back different".into());
    }

    let old_id = step(
        "read the machine-id",
        &log,
        sh(&client, "cat /etc/machine-id 2>/dev/null || true"),
    )
    .await?;
    let report = step("fix-ups", &log, async {
        Ok(client
            .fixups(FixupRequest {
                hostname: Some("tine-agent-vm".into()),
                machine_id: true,
                ..FixupRequest::default()
            })
            .await?)
    })
    .await?;
    let host = step("hostname", &log, sh(&client, "hostname")).await?;
    let new_id = step("new machine-id", &log, sh(&client, "cat /etc/machine-id")).await?;
    if host.trim() != "tine-agent-vm" {
        return Err(format!("hostname is {host:?} after the fix-up ({report:?})").into());
    }
    if new_id.trim().len() != 32 || new_id == old_id {
        return Err(format!("machine-id {old_id:?} became {new_id:?} ({report:?})").into());
    }

    let mut times = Vec::new();
    for _ in 0..20 {
        let t = Instant::now();
        let out = step("exec true", &log, async {
            Ok(client.exec_output(ExecRequest::argv(["true"])).await?)
        })
        .await?;
        times.push(t.elapsed());
        if out.status.code != Some(0) {
            return Err(format!("true ended with {:?}", out.status).into());
        }
    }
    times.sort();
    println!(
        "bench: exec `true` round trip over vsock p50 {:?} (min {:?}, max {:?}, n=20)",
        times[times.len() / 2],
        times[0],
        times[times.len() - 1]
    );

    drop(client);
    vmm.pause()?;
    let state = dir.join("vm.state");
    let mem = dir.join("vm.mem");
    vmm.snapshot(&state, &mem)?;
    vmm.kill();

    let mut forks = Vec::new();
    for i in 0..2 {
        let fork_disk = dir.join(format!("fork{i}.ext4"));
        std::fs::copy(&disk, &fork_disk)?;
        let fork_uds = dir.join(format!("fork{i}.sock"));
        let fork_log = dir.join(format!("fork{i}.log"));
        let overrides = RestoreOverrides {
            vsock_uds: Some(fork_uds.clone()),
            drives: HashMap::from([("drive0".to_owned(), fork_disk)]),
            ..Default::default()
        };
        let fork = Vmm::restore(&state, &mem, None, &console(&fork_log), &overrides, false)?;
        forks.push((fork, fork_uds, fork_log));
    }
    let mut randoms = Vec::new();
    for (i, (_, fork_uds, fork_log)) in forks.iter().enumerate() {
        let t = Instant::now();
        let client = connect_agent(fork_uds, fork_log, READY_LIMIT).await?;
        let connect_ms = t.elapsed().as_millis();
        let mut entropy = vec![0u8; 64];
        getrandom::fill(&mut entropy).map_err(|e| format!("host randomness: {e}"))?;
        let report = step("a fork's fix-ups", fork_log, async {
            Ok(client
                .fixups(FixupRequest {
                    entropy: Some(entropy),
                    ..FixupRequest::default()
                })
                .await?)
        })
        .await?;
        if !report.reseeded {
            return Err(format!("fork {i} did not reseed: {report:?}").into());
        }
        let out = step("a fork's urandom", fork_log, async {
            Ok(client
                .exec_output(ExecRequest::shell("head -c 32 /dev/urandom"))
                .await?)
        })
        .await?;
        if out.stdout.len() != 32 {
            return Err(format!("fork {i} read {} random bytes", out.stdout.len()).into());
        }
        println!("fork {i}: agent answered {connect_ms} ms after restore, reseeded");
        randoms.push(out.stdout);
    }
    if randoms[0] == randoms[1] {
        return Err("both forks read the same /dev/urandom bytes after reseeding".into());
    }
    println!("forks: /dev/urandom differs after the entropy fix-up");
    for (mut fork, _, _) in forks {
        fork.kill();
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Builds the min image (and the static agent in it) on the host and
/// passes its directory to the test bed through the environment.
fn build_min_image() -> Result<(), String> {
    let image = min_image().map_err(|e| e.to_string())?;
    let dir = image
        .parent()
        .ok_or_else(|| format!("{} has no folder", image.display()))?;
    // Before any thread: the test bed inherits this environment.
    std::env::set_var(IMAGE_ENV, dir);
    Ok(())
}

fn main() {
    let listing = std::env::args().any(|a| a == "--list");
    if placement().is_none() && !listing && std::env::var_os(IMAGE_ENV).is_none() {
        if let Err(e) = build_min_image() {
            eprintln!("agent vm test: {e}");
            std::process::exit(101);
        }
    }
    run_tests(vec![Trial::test(
        "agent_in_vm_exec_files_fixups_and_forks",
        agent_in_vm,
    )]);
}
