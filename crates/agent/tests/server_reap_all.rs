//! The agent server under a reaper in `ReapMode::All`, as PID 1 runs it:
//! `waitpid(-1)` collects every child of the process, so exec statuses
//! reach the client only because every spawn goes through the reaper. A
//! test binary of its own (the reaper takes every child of the process);
//! the process is a child subreaper so orphans come to it as to PID 1.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::TestAgent;
use tine_agent::system::reaper::{ReapMode, Reaper};
use tine_client::proto::ExecRequest;

/// Whether `pid` is gone or not a zombie (`/proc/PID/stat` state field).
fn collected(pid: u32) -> bool {
    match std::fs::read_to_string(Path::new("/proc").join(pid.to_string()).join("stat")) {
        Err(_) => true,
        Ok(stat) => {
            let state = stat
                .rsplit_once(") ")
                .and_then(|(_, rest)| rest.chars().next());
            state != Some('Z')
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_exec_statuses_survive_reap_all_and_orphans_are_collected() {
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) takes an integer argument only.
    let r = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    assert_eq!(r, 0, "PR_SET_CHILD_SUBREAPER failed");
    let reaper = Reaper::install_global(ReapMode::All).expect("install the reaper");
    let agent = TestAgent::start().await;
    let client = agent.client().await;

    // Several execs at once, each with its own exit code.
    let mut set = tokio::task::JoinSet::new();
    for code in 0..8 {
        let client = client.clone();
        set.spawn(async move {
            let script = format!("sleep 0.0{code}; echo {code}; exit {code}");
            let out = client
                .exec_output(ExecRequest::shell(script))
                .await
                .expect("exec");
            (code, out)
        });
    }
    while let Some(joined) = set.join_next().await {
        let (code, out) = joined.expect("exec task");
        assert_eq!(out.status.code, Some(code), "exec {code}");
        assert_eq!(out.stdout_lossy(), format!("{code}\n"));
    }

    // A signal and a timeout are reported as such.
    let out = client
        .exec_output(ExecRequest::shell("kill -KILL $$"))
        .await
        .expect("exec");
    assert_eq!(out.status.signal, Some(libc::SIGKILL));
    let out = client
        .exec_output(ExecRequest::shell("sleep 30").timeout(Duration::from_millis(300)))
        .await
        .expect("exec");
    assert!(out.status.timed_out, "{:?}", out.status);

    // A background exec's status arrives too.
    let (id, _) = client
        .exec_background(ExecRequest::shell("exit 42"), None)
        .await
        .expect("background exec");
    let status = client
        .bg_wait(id, Some(Duration::from_secs(10)))
        .await
        .expect("bg wait");
    assert_eq!(status.code, Some(42));

    // An orphaned grandchild: its parent exits at once, so it comes to this
    // process (the subreaper) and must not stay a zombie when it exits.
    let out = client
        .exec_output(ExecRequest::shell(
            "sleep 0.2 </dev/null >/dev/null 2>&1 & echo $!",
        ))
        .await
        .expect("exec");
    assert_eq!(out.status.code, Some(0));
    let orphan: u32 = out.stdout_lossy().trim().parse().expect("orphan pid");
    // waitpid removes the zombie before the reaper counts it, so wait for
    // both rather than check the count the moment the zombie is gone.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !collected(orphan) || reaper.unknown_reaped() == 0 {
        assert!(
            Instant::now() < deadline,
            "orphan {orphan}: collected={}, reaped as unknown={}",
            collected(orphan),
            reaper.unknown_reaped()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(reaper.pending(), 0, "every registered child was delivered");
}
