//! Exec, background execs and the PTY shell over a Unix socket.

mod common;

use std::time::{Duration, Instant};

use common::{wait_until, TestAgent};
use tine_client::agent::{ExecEvent, ShellEvent};
use tine_client::proto::{BgLogsRequest, ErrorCode, ExecRequest, ShellRequest};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_exec_stdout_and_stderr_are_separate_and_ordered() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;

    let script = "i=1; while [ $i -le 300 ]; do echo out$i; echo err$i >&2; i=$((i+1)); done";
    let output = client
        .exec_output(ExecRequest::shell(script))
        .await
        .expect("exec");

    let expect = |prefix: &str| -> String { (1..=300).map(|i| format!("{prefix}{i}\n")).collect() };
    assert_eq!(output.stdout_lossy(), expect("out"));
    assert_eq!(output.stderr_lossy(), expect("err"));
    assert!(output.status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_exec_exit_code_is_reported() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;

    let output = client
        .exec_output(ExecRequest::shell("exit 7"))
        .await
        .expect("exec");

    assert_eq!(output.status.code, Some(7));
    assert_eq!(output.status.signal, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_exec_killed_by_signal_reports_signal() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;

    let output = client
        .exec_output(ExecRequest::shell("kill -TERM $$"))
        .await
        .expect("exec");

    assert_eq!(output.status.signal, Some(libc::SIGTERM));
    assert_eq!(output.status.code, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_exec_client_signal_reaches_process() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let execution = client
        .exec(ExecRequest::argv(["sleep", "30"]))
        .await
        .expect("exec");

    execution.signal(libc::SIGINT).await.expect("signal");
    let output = tokio::time::timeout(Duration::from_secs(10), execution.wait_with_output())
        .await
        .expect("exits after the signal")
        .expect("output");

    assert_eq!(output.status.signal, Some(libc::SIGINT));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_exec_timeout_kills_process_group() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let started = Instant::now();

    let output = client
        .exec_output(
            ExecRequest::shell("sleep 30 & sleep 30; echo never")
                .timeout(Duration::from_millis(300)),
        )
        .await
        .expect("exec");

    assert!(output.status.timed_out);
    assert_eq!(output.status.signal, Some(libc::SIGKILL));
    assert!(output.stdout.is_empty());
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_exec_background_grandchild_does_not_hold_exec_open() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let started = Instant::now();

    let output = client
        .exec_output(ExecRequest::shell("sleep 30 & echo started $!"))
        .await
        .expect("exec");

    let text = output.stdout_lossy();
    assert!(text.starts_with("started "), "{text:?}");
    assert!(output.status.success());
    assert!(started.elapsed() < Duration::from_secs(10));
    if let Ok(pid) = text.trim_start_matches("started ").trim().parse::<i32>() {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_exec_100_mib_of_output_arrives_intact() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    // ~105.9 MB (more than 100 MiB) of distinct lines.
    let expected = std::process::Command::new("seq")
        .args(["1", "13000000"])
        .output()
        .expect("run seq locally");
    let expected_crc = crc32fast::hash(&expected.stdout);
    assert!(expected.stdout.len() > 100 << 20);

    let mut execution = client
        .exec(ExecRequest::argv(["seq", "1", "13000000"]))
        .await
        .expect("exec");
    let mut hasher = crc32fast::Hasher::new();
    let mut len = 0usize;
    let mut status = None;
    while let Some(event) = execution.next_event().await.expect("event") {
        match event {
            ExecEvent::Stdout(data) => {
                len += data.len();
                hasher.update(&data);
            }
            ExecEvent::Stderr(data) => panic!("stderr: {}", String::from_utf8_lossy(&data)),
            ExecEvent::Exit(s) => status = Some(s),
        }
    }

    assert_eq!(len, expected.stdout.len());
    assert_eq!(hasher.finalize(), expected_crc);
    assert!(status.expect("exit").success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_exec_binary_stdin_round_trips_through_cat() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let input: Vec<u8> = (0..(3 << 20) as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();

    let output = client
        .exec_output_with_input(ExecRequest::argv(["cat"]), &input)
        .await
        .expect("exec");

    assert!(output.stdout == input, "cat returned different bytes");
    assert!(output.status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_exec_env_cwd_and_identity_are_applied() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let dir = agent.scratch("cwd");
    assert!(
        common::is_root(),
        "this test runs the command as another user and needs root (as CI runs it)"
    );
    let req = ExecRequest::shell("echo $FOO; pwd; id -u; id -g")
        .env("FOO", "bar baz")
        .cwd(common::s(&dir))
        .uid(4321)
        .gid(8765);

    let output = client.exec_output(req).await.expect("exec");

    let lines: Vec<String> = output.stdout_lossy().lines().map(str::to_owned).collect();
    assert_eq!(lines[0], "bar baz");
    assert_eq!(
        lines[1],
        common::s(&std::fs::canonicalize(&dir).expect("canonical"))
    );
    assert_eq!(lines[2], "4321");
    assert_eq!(lines[3], "8765");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_exec_fifty_concurrent_execs_on_one_connection() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let started = Instant::now();

    let runs = (0..50).map(|i| {
        let client = client.clone();
        async move {
            let output = client
                .exec_output(ExecRequest::shell(format!(
                    "sleep 0.3; echo out{i}; echo err{i} >&2; exit {}",
                    i % 5
                )))
                .await
                .expect("exec");
            (i, output)
        }
    });
    let results = futures_join_all(runs).await;

    for (i, output) in results {
        assert_eq!(output.stdout_lossy(), format!("out{i}\n"));
        assert_eq!(output.stderr_lossy(), format!("err{i}\n"));
        assert_eq!(output.status.code, Some(i % 5));
    }
    // Serially this would take 15 s.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

async fn futures_join_all<F: std::future::Future + Send + 'static>(
    futs: impl Iterator<Item = F>,
) -> Vec<F::Output>
where
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futs.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for handle in handles {
        out.push(handle.await.expect("task"));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_background_exec_reattached_after_client_disconnects() {
    let agent = TestAgent::start().await;
    let first = agent.client().await;
    let (id, pid) = first
        .exec_background(
            ExecRequest::shell("echo one; sleep 0.5; echo two; echo err >&2; exit 3"),
            None,
        )
        .await
        .expect("start");
    drop(first);

    let second = agent.client().await;
    let jobs = second.bg_list().await.expect("list");
    let job = jobs.iter().find(|j| j.id == id).expect("job listed");
    assert_eq!(job.pid, pid);
    let status = second
        .bg_wait(id, Some(Duration::from_secs(10)))
        .await
        .expect("wait");
    let logs = second
        .bg_logs(BgLogsRequest {
            id,
            ..BgLogsRequest::default()
        })
        .await
        .expect("logs")
        .collect()
        .await
        .expect("collect");

    assert_eq!(status.code, Some(3));
    assert_eq!(logs.stdout, b"one\ntwo\n");
    assert_eq!(logs.stderr, b"err\n");
    assert_eq!(logs.end.exit, Some(status));
    assert_eq!(logs.end.stdout_to, 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_background_exec_follow_streams_until_exit() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let (id, _) = client
        .exec_background(
            ExecRequest::shell("for i in 1 2 3 4 5; do echo line$i; sleep 0.1; done"),
            None,
        )
        .await
        .expect("start");

    let logs = client
        .bg_logs(BgLogsRequest {
            id,
            follow: true,
            ..BgLogsRequest::default()
        })
        .await
        .expect("logs")
        .collect()
        .await
        .expect("follow");

    assert_eq!(logs.stdout, b"line1\nline2\nline3\nline4\nline5\n");
    assert!(logs.end.exit.expect("exited").success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_background_ring_keeps_only_the_newest_bytes() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let (id, _) = client
        .exec_background(ExecRequest::argv(["seq", "1", "20000"]), Some(4096))
        .await
        .expect("start");
    client
        .bg_wait(id, Some(Duration::from_secs(10)))
        .await
        .expect("wait");
    let all = String::from_utf8(
        std::process::Command::new("seq")
            .args(["1", "20000"])
            .output()
            .expect("seq")
            .stdout,
    )
    .expect("utf8");

    let logs = client
        .bg_logs(BgLogsRequest {
            id,
            ..BgLogsRequest::default()
        })
        .await
        .expect("logs");
    let from = logs.stdout_from;
    let logs = logs.collect().await.expect("collect");
    let tail = client
        .bg_logs(BgLogsRequest {
            id,
            tail_bytes: Some(6),
            ..BgLogsRequest::default()
        })
        .await
        .expect("tail")
        .collect()
        .await
        .expect("collect");

    assert_eq!(logs.stdout.len(), 4096);
    assert_eq!(from, (all.len() - 4096) as u64);
    assert_eq!(logs.stdout, all.as_bytes()[all.len() - 4096..]);
    assert_eq!(logs.end.stdout_to, all.len() as u64);
    assert_eq!(tail.stdout, b"20000\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_background_exec_kill_then_remove() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let (id, _) = client
        .exec_background(ExecRequest::argv(["sleep", "30"]), None)
        .await
        .expect("start");

    let running = client.bg_remove(id).await.expect_err("still running");
    assert_eq!(running.code(), Some(ErrorCode::BadRequest));
    let waited = client
        .bg_wait(id, Some(Duration::from_millis(50)))
        .await
        .expect_err("times out");
    assert_eq!(waited.code(), Some(ErrorCode::Timeout));
    client.bg_kill(id, libc::SIGKILL).await.expect("kill");
    let status = client
        .bg_wait(id, Some(Duration::from_secs(10)))
        .await
        .expect("wait");
    client.bg_remove(id).await.expect("remove");

    assert_eq!(status.signal, Some(libc::SIGKILL));
    let gone = client.bg_wait(id, None).await.expect_err("removed");
    assert_eq!(gone.code(), Some(ErrorCode::NotFound));
}

async fn read_until(shell: &mut tine_client::agent::ShellSession, seen: &mut String, needle: &str) {
    let found = tokio::time::timeout(Duration::from_secs(10), async {
        while !seen.contains(needle) {
            match shell.next_event().await.expect("shell event") {
                Some(ShellEvent::Output(data)) => seen.push_str(&String::from_utf8_lossy(&data)),
                other => panic!("shell ended early: {other:?}; output {seen:?}"),
            }
        }
    })
    .await;
    assert!(found.is_ok(), "{needle:?} not seen in {seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_shell_pty_reports_size_and_follows_resize() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let mut shell = client
        .shell(ShellRequest {
            argv: Some(vec!["/bin/sh".to_owned()]),
            rows: 24,
            cols: 80,
            ..ShellRequest::default()
        })
        .await
        .expect("shell");
    let mut seen = String::new();

    shell.write(b"stty size; tty\n").await.expect("write");
    read_until(&mut shell, &mut seen, "24 80").await;
    read_until(&mut shell, &mut seen, "/dev/pts/").await;
    shell.resize(40, 120).await.expect("resize");
    shell.write(b"stty size\n").await.expect("write");
    read_until(&mut shell, &mut seen, "40 120").await;
    shell.write(b"exit 3\n").await.expect("write");
    let status = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match shell.next_event().await.expect("event") {
                Some(ShellEvent::Exit(status)) => return status,
                Some(ShellEvent::Output(_)) => {}
                None => panic!("no exit"),
            }
        }
    })
    .await
    .expect("shell exits");

    assert_eq!(status.code, Some(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_shell_session_killed_when_client_disconnects() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let shell = client
        .shell(ShellRequest {
            argv: Some(vec!["sleep".to_owned(), "300".to_owned()]),
            ..ShellRequest::default()
        })
        .await
        .expect("shell");
    let pid = shell.pid();

    drop(shell);
    drop(client);

    assert!(
        wait_until(Duration::from_secs(10), || !process_alive(pid)).await,
        "shell {pid} still running"
    );
}

/// Whether `pid` exists and is not a zombie.
pub fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// The events of a whole logs answer, with their frame ids.
async fn frames(
    client: &tine_client::AgentClient,
    req: BgLogsRequest,
) -> (u64, Vec<(u64, bool, Vec<u8>)>, tine_client::agent::LogsEnd) {
    use tine_client::agent::LogEvent;
    let mut logs = client.bg_logs(req).await.expect("logs");
    let dropped_frames = logs.dropped_frames;
    let mut seen = Vec::new();
    while let Some(event) = logs.next_event().await.expect("event") {
        match event {
            LogEvent::Stdout { id, data } => seen.push((id, false, data)),
            LogEvent::Stderr { id, data } => seen.push((id, true, data)),
            LogEvent::End(end) => return (dropped_frames, seen, end),
        }
    }
    panic!("no end");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_background_logs_resume_by_frame_id() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let (id, _) = client
        .exec_background(
            ExecRequest::shell("printf a; sleep 0.2; printf b >&2; sleep 0.2; printf c"),
            None,
        )
        .await
        .expect("start");
    client
        .bg_wait(id, Some(Duration::from_secs(10)))
        .await
        .expect("wait");
    let all = |from_id| BgLogsRequest {
        id,
        from_id,
        ..BgLogsRequest::default()
    };
    let (gap, seen, end) = frames(&client, all(None)).await;
    assert_eq!(gap, 0);
    assert_eq!(
        seen,
        vec![
            (1, false, b"a".to_vec()),
            (2, true, b"b".to_vec()),
            (3, false, b"c".to_vec())
        ]
    );
    assert_eq!(end.next_id, 4, "the exit is frame 4");
    let job = client.bg_list().await.expect("list");
    assert_eq!(job[0].next_id, 5);
    let (_, seen, _) = frames(&client, all(Some(2))).await;
    assert_eq!(seen.iter().map(|f| f.0).collect::<Vec<_>>(), [2, 3]);
    let (_, seen, end) = frames(&client, all(Some(4))).await;
    assert!(seen.is_empty());
    assert_eq!(end.exit.and_then(|e| e.code), Some(0));
    // A cursor and byte offsets are one or the other.
    let e = client
        .bg_logs(BgLogsRequest {
            stdout_from: Some(0),
            ..all(Some(1))
        })
        .await
        .expect_err("both");
    assert_eq!(e.code(), Some(ErrorCode::BadRequest));

    // Frames the ring dropped are counted; the rest follow.
    let (id, _) = client
        .exec_background(
            ExecRequest::shell(
                "head -c 3000 /dev/zero; sleep 0.2; head -c 3000 /dev/zero; sleep 0.2; head -c 3000 /dev/zero",
            ),
            Some(4096),
        )
        .await
        .expect("start");
    client
        .bg_wait(id, Some(Duration::from_secs(10)))
        .await
        .expect("wait");
    let (gap, seen, _) = frames(
        &client,
        BgLogsRequest {
            id,
            from_id: Some(1),
            ..BgLogsRequest::default()
        },
    )
    .await;
    assert_eq!(gap, 1, "frame 1 left the 4 KiB ring");
    assert_eq!(seen.iter().map(|f| f.0).collect::<Vec<_>>(), [2, 3]);
    assert_eq!(seen[0].2.len() + seen[1].2.len(), 4096);
}
