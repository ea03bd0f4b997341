//! The PID 1 path in a real guest (run by `tests/pid1_vm.rs`; also useful
//! by hand). Boot it as init with busybox at /bin/busybox: it runs
//! `system::start`, checks what boot did, runs commands and an orphan
//! through the reaper, waits for userdata, applies the kernel-level fork
//! fix-ups to `/`, then has a child send SIGTERM to PID 1, which must power
//! the VM off through the debug-exit port. Each check prints
//! `smoke: check NAME ok` or `smoke: check NAME FAILED: why`; the last line
//! before shutdown is `smoke: all checks passed` or `smoke: FAILED`.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tine_agent::system::{self, init, reaper, FixupRequest};

/// 2030-01-01T00:00:00Z, far from the build's time and the host's.
const CLOCK: u64 = 1_893_456_000;

fn sh(script: &str) -> Result<String, String> {
    let out = reaper::output(Command::new("/bin/busybox").args(["sh", "-c", script]))
        .map_err(|e| format!("{script}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{script}: {} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    cond()
}

fn main() {
    let started = match system::start() {
        Ok(s) => s,
        Err(e) => {
            println!("smoke: start failed: {e}");
            println!("smoke: FAILED");
            init::shutdown(init::ShutdownAction::Poweroff, Duration::from_secs(1));
        }
    };
    let mut failed = 0;
    let mut check = |name: &str, r: Result<(), String>| match r {
        Ok(()) => println!("smoke: check {name} ok"),
        Err(e) => {
            failed += 1;
            println!("smoke: check {name} FAILED: {e}");
        }
    };

    check(
        "pid1",
        if started.pid1 {
            Ok(())
        } else {
            Err("not PID 1".into())
        },
    );
    let boot = started.boot.clone().unwrap_or_default();
    for w in &boot.warnings {
        println!("smoke: boot warning: {w}");
    }
    let want = ["/proc", "/sys", "/dev/pts", "/dev/shm", "/run", "/tmp"];
    check(
        "mounts",
        match want.iter().find(|m| !boot.mounted.iter().any(|x| x == *m)) {
            None => Ok(()),
            Some(m) => Err(format!("{m} not mounted: {:?}", boot.mounted)),
        },
    );
    check(
        "hostname-from-cmdline",
        match nix::unistd::gethostname() {
            Ok(h) if h == "pid1-test" => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    check(
        "ptmx-link",
        match std::fs::read_link("/dev/ptmx") {
            Ok(p) if p == Path::new("pts/ptmx") => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    check(
        "lo-up",
        match system::net::ipv4_addr("lo") {
            Ok(Some((a, 8))) if a.is_loopback() => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    check(
        "exec-through-reaper",
        sh("echo hi; uname -r").and_then(|o| {
            if o.starts_with("hi\n") {
                Ok(())
            } else {
                Err(o)
            }
        }),
    );
    check(
        "orphan-reaped",
        sh("sleep 0.2 & echo $!").and_then(|o| {
            let pid = o.trim().to_string();
            if until(Duration::from_secs(5), || {
                !Path::new(&format!("/proc/{pid}")).exists()
            }) {
                Ok(())
            } else {
                Err(format!("orphan {pid} still in /proc"))
            }
        }),
    );
    check(
        "userdata-ran",
        if until(Duration::from_secs(10), || {
            system::userdata_status(Path::new("/")).ran
        }) {
            let s = system::userdata_status(Path::new("/"));
            let log = std::fs::read_to_string(system::userdata::LOG).unwrap_or_default();
            if s.exit_code == Some(3) && log.contains("userdata says hello") {
                Ok(())
            } else {
                Err(format!("{s:?}, log {log:?}"))
            }
        } else {
            Err("userdata did not finish".into())
        },
    );

    let rep = system::apply_fixups(
        &FixupRequest {
            hostname: Some("fixed-1".into()),
            machine_id: true,
            ssh_host_keys: true,
            entropy: Some((0u8..64).collect()),
            clock_unix_nanos: Some(u128::from(CLOCK) * 1_000_000_000),
        },
        Path::new("/"),
    );
    println!("smoke: fixups {rep:?}");
    check(
        "fixups-report",
        if rep.errors.is_empty()
            && rep.reseeded
            && rep.entropy_bytes == 64
            && rep.clock_set
            && rep.hostname.as_deref() == Some("fixed-1")
            && rep.machine_id.is_some()
        {
            Ok(())
        } else {
            Err(format!("{rep:?}"))
        },
    );
    check(
        "fixups-kernel-hostname",
        match nix::unistd::gethostname() {
            Ok(h) if h == "fixed-1" => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    check(
        "fixups-clock",
        match SystemTime::now().duration_since(UNIX_EPOCH) {
            Ok(d) if (CLOCK..CLOCK + 60).contains(&d.as_secs()) => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    check(
        "machine-id-file",
        match std::fs::read_to_string("/etc/machine-id") {
            Ok(s) if Some(s.trim()) == rep.machine_id.as_deref() => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );

    // A process that must be terminated by the shutdown, not SIGKILLed.
    let _ = reaper::Reaper::global()
        .map(|r| r.spawn(Command::new("/bin/busybox").args(["sleep", "1000"])));
    if failed == 0 {
        println!("smoke: all checks passed");
    } else {
        println!("smoke: FAILED ({failed} checks)");
    }
    // Shut down the way busybox `poweroff`-like tools and the VMM's users
    // do: a signal to PID 1.
    let _ = sh("kill -TERM 1");
    std::thread::sleep(Duration::from_secs(30));
    println!("smoke: SIGTERM to PID 1 did not power off");
    init::shutdown(init::ShutdownAction::Poweroff, Duration::from_secs(1));
}
