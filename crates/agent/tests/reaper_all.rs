//! The reaper in `ReapMode::All`, as PID 1 runs it. `waitpid(-1)` collects
//! every child of the process, so this file holds a single test: a test
//! binary of its own, with no other test's children to steal. The process
//! makes itself a child subreaper so orphans come to it as they would to
//! PID 1.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use tine_agent::system::reaper::{self, ReapMode, Reaper};

fn sh(script: &str) -> Command {
    let mut c = Command::new("/bin/sh");
    c.arg("-c").arg(script);
    c
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
// The strays are left unwaited on purpose: the reaper must collect them.
#[allow(clippy::zombie_processes)]
fn test_reap_all_delivers_registered_statuses_and_collects_the_rest() {
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) takes an integer argument only.
    let r = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    assert_eq!(r, 0, "PR_SET_CHILD_SUBREAPER failed");
    let reaper = Reaper::install_global(ReapMode::All).expect("install");
    assert!(matches!(
        Reaper::install_global(ReapMode::RegisteredOnly),
        Err(reaper::ReaperError::ModeMismatch(ReapMode::All))
    ));

    // Unregistered children interleaved with registered ones: each
    // registered waiter gets its own status, the others are discarded.
    let mut watches = Vec::new();
    let mut strays = Vec::new();
    for code in 0..8 {
        let stray = sh(&format!("exit {}", 100 + code)).spawn().expect("spawn");
        strays.push(stray.id());
        let (_child, w) = reaper
            .spawn(&mut sh(&format!("sleep 0.0{code}; exit {code}")))
            .expect("spawn");
        watches.push((code, w));
    }
    for (code, w) in &watches {
        let st = w
            .wait_timeout(Duration::from_secs(10))
            .expect("status")
            .expect("exited in time");
        assert_eq!(st.code(), Some(*code));
    }
    for pid in strays {
        wait_until(&format!("stray {pid} is reaped"), || {
            !Path::new(&format!("/proc/{pid}")).exists()
        });
    }
    assert!(reaper.unknown_reaped() >= 8, "{}", reaper.unknown_reaped());

    // An orphaned grandchild is reparented to us (as to PID 1) and reaped
    // when it exits; its zombie would otherwise stay in /proc.
    let out = reaper::output(&mut sh("sleep 0.2 & echo $!")).expect("output");
    assert!(out.status.success());
    let grandchild: u32 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("pid");
    let status = std::fs::read_to_string(format!("/proc/{grandchild}/status")).unwrap_or_default();
    let ppid = status
        .lines()
        .find_map(|l| l.strip_prefix("PPid:"))
        .map(|p| p.trim().to_string());
    if let Some(ppid) = ppid {
        assert_eq!(
            ppid,
            std::process::id().to_string(),
            "orphan not reparented"
        );
    }
    wait_until("the orphan is reaped", || {
        !Path::new(&format!("/proc/{grandchild}")).exists()
    });

    // Helpers that agent code uses instead of Command::output/status.
    let out = reaper::output(&mut sh("echo hi; exit 3")).expect("output");
    assert_eq!(out.stdout, b"hi\n");
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(
        reaper::status(&mut sh("exit 4")).expect("status").code(),
        Some(4)
    );
    assert_eq!(reaper.pending(), 0);
}
