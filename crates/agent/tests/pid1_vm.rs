//! The agent's PID 1 path in a real tine-vmm guest, through the test bed:
//! `examples/pid1_smoke.rs`, built static, boots as init from an initramfs
//! and checks mounts, the hostname from the command line, the reaper,
//! userdata and the kernel-level fork fix-ups (sethostname, RNDADDENTROPY +
//! RNDRESEEDCRNG, clock_settime); a SIGTERM to PID 1 must then stop the VM
//! through the debug-exit port with value 0.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use tine_proto::vmm::StopReason;
use tine_testbed::cpio::{busybox_initramfs, Entry};
use tine_testbed::{guest_kernel, placement, repo_root, run_tests, Failed, Trial};
use tine_vmm::vmm::{BootConfig, ConsoleConfig, Vmm, DEFAULT_CMDLINE};

const SMOKE_ENV: &str = "TINE_PID1_SMOKE";
const TARGET: &str = "x86_64-unknown-linux-gnu";

const INIT: &str = "#!/bin/sh\nexec /sbin/pid1_smoke\n";
const USERDATA: &str = "#!/bin/sh\necho userdata says hello\nexit 3\n";

/// Builds the smoke binary static (the initramfs has no libc) and returns
/// its path. Runs on the host, before the test bed.
fn build_smoke() -> Result<PathBuf, String> {
    let root = repo_root();
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(&root)
        .env("RUSTFLAGS", "-C target-feature=+crt-static")
        .args(["build", "--release", "-q", "-p", "tine-agent"])
        .args(["--example", "pid1_smoke", "--target", TARGET])
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !status.success() {
        return Err(format!("building examples/pid1_smoke failed: {status}"));
    }
    // <target>/debug/deps/pid1_vm-HASH -> <target>
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let target_dir = exe
        .ancestors()
        .nth(3)
        .ok_or("cannot find the target directory")?;
    let path = target_dir.join(TARGET).join("release/examples/pid1_smoke");
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!("{} was not built", path.display()))
    }
}

fn pid1_boots_checks_and_powers_off() -> Result<(), Failed> {
    let smoke = PathBuf::from(std::env::var(SMOKE_ENV).map_err(|_| "smoke binary not built")?);
    let dir = std::env::temp_dir().join(format!("tine-agent-pid1-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let initramfs = dir.join("initramfs.cpio");
    let dirs = ["sbin", "etc", "etc/tine"].map(|d| Entry::Dir {
        path: d.into(),
        mode: 0o755,
    });
    let mut extra: Vec<Entry> = dirs.into_iter().collect();
    extra.push(Entry::File {
        path: "sbin/pid1_smoke".into(),
        mode: 0o755,
        data: std::fs::read(&smoke)?,
    });
    extra.push(Entry::File {
        path: "etc/tine/userdata".into(),
        mode: 0o755,
        data: USERDATA.as_bytes().to_vec(),
    });
    std::fs::write(&initramfs, busybox_initramfs(INIT, extra)?)?;

    let log = dir.join("console.log");
    let config = BootConfig {
        kernel: guest_kernel()?.vmlinux,
        initramfs: Some(initramfs),
        cmdline: format!("{DEFAULT_CMDLINE} tine.hostname=pid1-test"),
        mem_mib: 256,
        vcpus: 1,
        raw: None,
        devices: Default::default(),
    };
    let console = ConsoleConfig {
        log_path: Some(log.clone()),
        log_limit: None,
        echo_stdout: false,
    };
    let start = Instant::now();
    let mut vmm = Vmm::boot(&config, &console)?;
    let limit = Duration::from_secs(240);
    let reason = loop {
        if let Some(r) = vmm.stop_signal().reason() {
            break r;
        }
        if start.elapsed() > limit {
            vmm.kill();
            break StopReason::Killed;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = std::fs::read_to_string(&log)?;
    let smoke_lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("smoke:") || l.contains("tine-agent:"))
        .collect();
    let report = smoke_lines.join("\n");
    println!("{report}");
    if !text.contains("smoke: all checks passed") {
        return Err(format!("checks failed in the guest:\n{text}").into());
    }
    if reason != StopReason::GuestPoweroff(0) {
        return Err(format!("expected a poweroff with 0, got {reason:?}:\n{report}").into());
    }
    if text.contains("sending SIGKILL")
        || text.contains("did not power off")
        || text.contains("debug-exit")
        || text.contains("no ACPI")
    {
        return Err(format!("shutdown was not orderly:\n{report}").into());
    }
    println!(
        "pid1: booted, checked and powered off in {:.1}s",
        start.elapsed().as_secs_f64()
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn main() {
    let listing = std::env::args().any(|a| a == "--list");
    if placement().is_none() && !listing && std::env::var_os(SMOKE_ENV).is_none() {
        match build_smoke() {
            // Single-threaded here; the test bed inherits the variable.
            Ok(p) => std::env::set_var(SMOKE_ENV, p),
            Err(e) => {
                eprintln!("pid1_vm: {e}");
                std::process::exit(101);
            }
        }
    }
    run_tests(vec![Trial::test(
        "agent_pid1_boots_checks_and_powers_off",
        pid1_boots_checks_and_powers_off,
    )]);
}
