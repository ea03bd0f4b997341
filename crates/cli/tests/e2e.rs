//! The built `tine` binary against the client's fake daemon: output modes,
//! exit codes, stdin piping and streaming, as a script would see them.

#[path = "../../client/tests/support/fake_daemon.rs"]
mod fake_daemon;

use std::process::Stdio;
use std::time::Duration;

use fake_daemon::FakeDaemon;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

/// What a run of `tine` left behind.
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn tine() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tine"));
    cmd.env_remove("TINE_URL")
        .env_remove("TINE_TOKEN")
        .env_remove("TINE_TOKEN_FILE")
        .kill_on_drop(true);
    cmd
}

async fn run_with(url: &str, args: &[&str], stdin: Option<&[u8]>) -> Run {
    let mut cmd = tine();
    cmd.arg("--url")
        .arg(url)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        });
    let mut child = cmd.spawn().expect("spawn tine");
    if let Some(input) = stdin {
        let mut pipe = child.stdin.take().expect("stdin");
        pipe.write_all(input).await.expect("write stdin");
        drop(pipe);
    }
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("tine finished in time")
        .expect("wait");
    Run {
        code: out.status.code().expect("exit code"),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

async fn run(fake: &FakeDaemon, args: &[&str]) -> Run {
    run_with(&fake.url(), args, None).await
}

#[tokio::test]
async fn vm_list_json_is_the_api_answer() {
    let fake = FakeDaemon::start(None).await;
    let r = run(&fake, &["vm", "list", "--json"]).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let vms: serde_json::Value = serde_json::from_str(&r.stdout).expect("one JSON document");
    let vms = vms.as_array().expect("array");
    assert_eq!(vms.len(), 2);
    assert_eq!(vms[0]["hostname"], "dev-1");
    assert_eq!(vms[0]["state"], "running");
    assert_eq!(fake.last("/nodes").uri, "/nodes");

    let r = run(&fake, &["ls", "--group", "dev", "--tag", "env=ci"]).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert!(
        lines[0].starts_with("HOSTNAME   GROUP   STATE"),
        "{}",
        r.stdout
    );
    assert!(
        lines[1].starts_with("dev-1      dev     running"),
        "{}",
        r.stdout
    );
    assert_eq!(lines.len(), 2);
    assert_eq!(
        fake.last("/hostgroup").uri,
        "/hostgroup/dev/nodes?tag=env%3Dci"
    );

    let r = run(&fake, &["v", "ls", "-q"]).await;
    assert_eq!(r.stdout, "dev-1\ndev-2\n");
}

#[tokio::test]
async fn exec_streams_output_and_propagates_exit_codes() {
    let fake = FakeDaemon::start(None).await;
    let r = run(
        &fake,
        &["vm", "exec", "dev-1", "--", "echo", "hello", "world"],
    )
    .await;
    assert_eq!(
        (r.code, r.stdout.as_str()),
        (0, "hello world\n"),
        "{}",
        r.stderr
    );

    let r = run(&fake, &["vm", "exec", "web", "--", "exit", "7"]).await;
    assert_eq!(r.code, 7);
    // Stdin is /dev/null here, not a terminal: it is sent (and ends at once).
    assert_eq!(
        fake.last("/vm/web/exec").uri,
        "/vm/web/exec?cmd=exit&args=7&stdio=base64&stdin=true"
    );

    let r = run(&fake, &["vm", "exec", "dev-1", "--", "kill", "9"]).await;
    assert_eq!(r.code, 137, "{}", r.stderr);

    let r = run(&fake, &["vm", "exec", "dev-1", "--", "err"]).await;
    assert_eq!(
        (r.code, r.stdout.as_str(), r.stderr.as_str()),
        (2, "", "oops\n")
    );

    let r = run(&fake, &["vm", "exec", "dev-1", "--", "split"]).await;
    assert_eq!((r.code, r.stdout.as_str()), (5, "one\ntwo\n"));

    let r = run(&fake, &["vm", "exec", "dev-1", "--", "nope"]).await;
    assert_eq!(r.code, 1);
    assert_eq!(
        r.stderr,
        "tine: Agent error (not_found): cannot start \"nope\": \
         No such file or directory (os error 2) (bad_request)\n"
    );

    let r = run(&fake, &["vm", "exec", "dev-1", "--", "lost"]).await;
    assert_eq!(r.code, 1);
    assert_eq!(
        r.stderr,
        "tine: the agent closed the stream before the process ended (agent_unavailable)\n"
    );

    let r = run(&fake, &["vm", "exec", "dev-1", "--json", "--", "exit", "3"]).await;
    assert_eq!(r.code, 3);
    let frames: Vec<serde_json::Value> = r
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("NDJSON line"))
        .collect();
    assert_eq!(frames.len(), 2);
    assert_eq!(frames[0]["type"], "started");
    assert_eq!(frames[1]["type"], "exit");
    assert_eq!(frames[1]["exit_code"], 3);

    let r = run(
        &fake,
        &[
            "vm", "exec", "dev-1", "--shell", "--env", "A=1", "--uid", "0", "--", "echo", "$A",
        ],
    )
    .await;
    // The fake knows no shell; what matters is the query.
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains("cannot start \"echo $A\""),
        "{}",
        r.stderr
    );
    assert_eq!(
        fake.last("/vm/dev-1/exec").uri,
        "/vm/dev-1/exec?cmd=echo+%24A&env=A%3D1&uid=0&shell=%2Fbin%2Fsh&stdio=base64&stdin=true"
    );
}

#[tokio::test]
async fn exec_pipes_stdin_when_it_is_not_a_terminal() {
    let fake = FakeDaemon::start(None).await;
    let input = b"line one\nline two\n".repeat(1000);
    let r = run_with(
        &fake.url(),
        &["vm", "exec", "dev-1", "--", "cat"],
        Some(&input),
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.stdout.as_bytes(), input.as_slice());
    assert!(fake.last("/vm/dev-1/exec").uri.ends_with("&stdin=true"));

    let r = run_with(
        &fake.url(),
        &["vm", "exec", "dev-1", "--no-stdin", "--", "cat"],
        Some(b"ignored"),
    )
    .await;
    assert_eq!((r.code, r.stdout.as_str()), (0, ""));
    assert_eq!(
        fake.last("/vm/dev-1/exec").uri,
        "/vm/dev-1/exec?cmd=cat&stdio=base64"
    );
}

#[tokio::test]
async fn quiet_prints_only_the_name() {
    let fake = FakeDaemon::start(None).await;
    let r = run(&fake, &["vm", "add", "--quiet"]).await;
    assert_eq!(
        (r.code, r.stdout.as_str(), r.stderr.as_str()),
        (0, "dev-3\n", "")
    );
    // The only host group was picked, and the agent waited for.
    assert_eq!(
        fake.last("/hostgroup/dev/nodes").uri,
        "/hostgroup/dev/nodes?wait=agent"
    );

    let r = run(&fake, &["vm", "commit", "dev-2", "-q", "--tag", "base"]).await;
    assert_eq!(
        (r.code, r.stdout.as_str()),
        (0, "cmt-dev-0123456789abcdef\n")
    );

    let r = run(
        &fake,
        &[
            "vm",
            "fork",
            "cmt-dev-0123456789abcdef",
            "-q",
            "--no-wait",
            "--rm",
        ],
    )
    .await;
    assert_eq!((r.code, r.stdout.as_str()), (0, "dev-4\n"));
    let seen = fake.last("/vm/commits/");
    assert_eq!(
        seen.uri,
        "/vm/commits/cmt-dev-0123456789abcdef/fork?wait=none"
    );
    assert_eq!(seen.body.as_deref(), Some(r#"{"persistent":false}"#));
}

#[tokio::test]
async fn a_memory_commits_warm_pool_is_set_at_commit_and_changed_later() {
    let fake = FakeDaemon::start(None).await;
    let r = run(
        &fake,
        &["vm", "commit", "dev-1", "--memory", "--pool", "4", "-q"],
    )
    .await;
    assert_eq!((r.code, r.stderr.as_str()), (0, ""));
    let seen = fake.last("/vm/dev-1/commit");
    assert_eq!(
        seen.body.as_deref(),
        Some(r#"{"tags":[],"labels":{},"mode":"memory","hot_fork_pool":4}"#)
    );

    let r = run(&fake, &["vm", "commit", "pool", COMMIT_ID, "2"]).await;
    assert_eq!(
        (r.code, r.stdout.as_str()),
        (0, "cmt-dev-0123456789abcdef: warm pool of 2\n")
    );
    let seen = fake.last("/vm/commits/");
    assert_eq!(
        (
            seen.method.as_str(),
            seen.uri.as_str(),
            seen.body.as_deref()
        ),
        (
            "PUT",
            "/vm/commits/cmt-dev-0123456789abcdef/pool",
            Some(r#"{"hot_fork_pool":2}"#)
        )
    );

    let r = run(&fake, &["vm", "commit", "pool", COMMIT_ID, "--group"]).await;
    assert_eq!(
        (r.code, r.stdout.as_str()),
        (0, "cmt-dev-0123456789abcdef: the host group's warm pool\n")
    );
    let seen = fake.last("/vm/commits/");
    assert_eq!(
        (seen.method.as_str(), seen.uri.as_str()),
        ("DELETE", "/vm/commits/cmt-dev-0123456789abcdef/pool")
    );

    let r = run(&fake, &["vm", "commit", "pool", "cmt-dev-nope", "2"]).await;
    assert_ne!(r.code, 0);
    assert!(r.stderr.contains("cmt-dev-nope"), "{}", r.stderr);
}

/// The commit the fake daemon knows.
const COMMIT_ID: &str = "cmt-dev-0123456789abcdef";

#[tokio::test]
async fn human_output_confirms_briefly() {
    let fake = FakeDaemon::start(None).await;
    let r = run(
        &fake,
        &[
            "vm", "add", "dev", "--cpus", "2", "--ram-mb", "1024", "--tag", "a=b", "--name", "w",
        ],
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.stdout, "dev-3 running (agent ready in 812 ms)\n");
    let body: serde_json::Value =
        serde_json::from_str(fake.last("/hostgroup").body.as_deref().expect("body")).expect("json");
    assert_eq!(
        body,
        serde_json::json!({"cpus": 2, "ram_bytes": 1073741824u64, "tags": ["a=b"], "name": "w"})
    );

    let r = run(&fake, &["vm", "delete", "dev-1", "dev-2"]).await;
    assert_eq!(
        (r.code, r.stdout.as_str()),
        (0, "dev-1 deleted\ndev-2 deleted\n")
    );

    let r = run(&fake, &["vm", "tag", "add", "dev-1", "x=1"]).await;
    assert_eq!(r.stdout, "name=web\nenv=ci\nx=1\n");

    let r = run(&fake, &["vm", "logs", "dev-1", "--lines", "1"]).await;
    assert_eq!(r.stdout, "console line 3\n");

    let r = run(&fake, &["group", "list"]).await;
    assert!(
        r.stdout.starts_with("NAME   COUNT   VMS   CPUS"),
        "{}",
        r.stdout
    );

    let r = run(&fake, &["vm", "shutdown", "dev-1", "--poweroff"]).await;
    assert_eq!(
        r.stdout,
        "dev-1 stopped (in 5 ms, forced (killed: writes the guest had not synced may be lost))\n"
    );
    assert_eq!(
        fake.last("/vm/dev-1/shutdown").uri,
        "/vm/dev-1/shutdown?action=poweroff"
    );
}

#[tokio::test]
async fn describe_shows_the_memory_of_a_running_vm() {
    let fake = FakeDaemon::start(None).await;
    let r = run(&fake, &["vm", "describe", "dev-1"]).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout.contains("memory:      USS 1.5M, PSS 2M, RSS 3M\n"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout
            .contains("copied:      300 guest pages (1.1M) since the restore\n"),
        "{}",
        r.stdout
    );
    let r = run(&fake, &["vm", "describe", "dev-1", "--json"]).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).expect("json");
    assert_eq!(v["memory"]["guest_pages_copied"], 300, "{v}");
    assert_eq!(v["memory"]["uss_bytes"], 1536 << 10, "{v}");
    let r = run(&fake, &["vm", "describe", "dev-2"]).await;
    assert!(!r.stdout.contains("memory:"), "{}", r.stdout);
}

#[tokio::test]
async fn exit_codes_tell_failures_apart() {
    let fake = FakeDaemon::start(None).await;
    let r = run(&fake, &["vm", "describe", "dev-9"]).await;
    assert_eq!(r.code, 1);
    assert_eq!(r.stderr, "tine: no VM called `dev-9` (not_found)\n");

    let r = run(&fake, &["vm", "add", "--name", "slow", "--timeout", "1s"]).await;
    assert_eq!(r.code, 4, "{}", r.stderr);
    assert!(r.stderr.ends_with("(timeout)\n"), "{}", r.stderr);

    let r = run(&fake, &["vm", "commit", "dev-1"]).await;
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains(
            "only a stopped VM's disk can be committed (a running one's with --memory) (conflict)"
        ),
        "{}",
        r.stderr
    );

    let r = run(&fake, &["vm", "ready", "dev-2", "--timeout", "1s"]).await;
    assert_eq!(r.code, 1, "{}", r.stderr);
    let r = run(&fake, &["vm", "ready", "dev-1"]).await;
    assert_eq!((r.code, r.stdout.as_str()), (0, "dev-1 ready\n"));

    let r = run(&fake, &["vm", "add", "--rm", "--persistent"]).await;
    assert_eq!(r.code, 2);

    let dir = tempfile::tempdir().expect("tempdir");
    let nowhere = format!("unix://{}", dir.path().join("no.sock").display());
    let r = run_with(&nowhere, &["vm", "list"], None).await;
    assert_eq!(r.code, 3);
    assert!(r.stderr.contains("tine up"), "{}", r.stderr);

    let r = run_with("ftp://x", &["info"], None).await;
    assert_eq!(r.code, 2, "{}", r.stderr);
}

#[tokio::test]
async fn tcp_uses_the_token_file() {
    let fake = FakeDaemon::start(Some("t0ken")).await;
    let url = fake.tcp_url.clone().expect("tcp");
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("token");
    std::fs::write(&file, "t0ken\n").expect("write");
    let file = file.to_string_lossy().into_owned();
    let r = run_with(&url, &["info", "--token-file", &file, "--json"], None).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(
        fake.last("/info").authorization.as_deref(),
        Some("Bearer t0ken")
    );

    let r = run_with(&url, &["info", "--token", "wrong"], None).await;
    assert_eq!(r.code, 1);
    assert_eq!(r.stderr, "tine: wrong bearer token (unauthorized)\n");

    let mut cmd = tine();
    let out = cmd
        .args(["info", "-q"])
        .env("TINE_URL", &url)
        .env("TINE_TOKEN_FILE", &file)
        .output()
        .await
        .expect("run");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "0.1.0\n");
}

#[tokio::test]
async fn cp_streams_files_and_trees() {
    let fake = FakeDaemon::start(None).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let local = dir.path().join("a.txt");
    std::fs::write(&local, b"payload").expect("write");
    let local_s = local.to_string_lossy().into_owned();

    let r = run(
        &fake,
        &["vm", "cp", &local_s, "dev-1:/tmp/", "--mode", "0600"],
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.stdout, "copied 7 bytes to dev-1:/tmp/\n");
    let (data, _) = fake.upload("/tmp/a.txt").expect("uploaded under its name");
    assert_eq!(data, b"payload");
    assert_eq!(
        fake.last("/vm/dev-1/cp").uri,
        "/vm/dev-1/cp?path=%2Ftmp%2Fa.txt&mode=binary&permissions=0600"
    );

    let out = dir.path().join("hosts");
    let r = run(
        &fake,
        &["vm", "cp", "dev-1:/etc/hosts", &out.to_string_lossy()],
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(
        std::fs::read_to_string(&out).expect("read"),
        "hello from /etc/hosts\n"
    );
    let r = run(&fake, &["vm", "cp", "dev-1:/etc/motd", "-"]).await;
    assert_eq!(r.stdout, "hello from /etc/motd\n");

    let r = run(
        &fake,
        &["vm", "cp", "dev-1:/missing", &out.to_string_lossy()],
    )
    .await;
    assert_eq!(r.code, 1);
    assert_eq!(r.stderr, "tine: /missing: no such file (not_found)\n");

    let tree = dir.path().join("tree");
    std::fs::create_dir_all(tree.join("sub")).expect("mkdir");
    std::fs::write(tree.join("sub/b.txt"), b"bee").expect("write");
    let r = run(
        &fake,
        &["vm", "cp", "-r", &tree.to_string_lossy(), "dev-1:/srv/tree"],
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(fake.last("/vm/dev-1/cp").uri.ends_with("mode=tar"));
    let (tar_bytes, _) = fake.upload("/srv/tree").expect("tar uploaded");
    let mut archive = tar::Archive::new(tar_bytes.as_slice());
    let mut found = false;
    for entry in archive.entries().expect("entries") {
        let mut entry = entry.expect("entry");
        if entry.path().expect("path").ends_with("sub/b.txt") {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut entry, &mut s).expect("read");
            assert_eq!(s, "bee");
            found = true;
        }
    }
    assert!(found, "sub/b.txt not in the tar");

    let r = run(&fake, &["vm", "cp", &local_s, "/tmp/elsewhere"]).await;
    assert_eq!(r.code, 2);
    let r = run(&fake, &["vm", "cp", &tree.to_string_lossy(), "dev-1:/srv/"]).await;
    assert_eq!(r.code, 2, "a directory without -r");
}

#[tokio::test]
async fn cp_of_an_aborted_download_fails_and_leaves_no_file() {
    let fake = FakeDaemon::start(None).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("f");
    let r = run(
        &fake,
        &["vm", "cp", "dev-1:/cut-short", &out.to_string_lossy()],
    )
    .await;
    assert_eq!(r.code, 1, "{}", r.stdout);
    assert!(!r.stdout.contains("copied"), "{}", r.stdout);
    assert!(!out.exists(), "a partial file was left");
}

#[tokio::test]
async fn cp_from_a_vm_keeps_no_special_modes_and_no_devices() {
    use std::os::unix::fs::PermissionsExt;
    let fake = FakeDaemon::start(None).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("out");
    let r = run(
        &fake,
        &[
            "vm",
            "cp",
            "-r",
            "dev-1:/hostile-tree",
            &out.to_string_lossy(),
        ],
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    // `tine` inherited this process's umask.
    let umask = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    nix::sys::stat::umask(umask);
    let expected = 0o755 & !umask.bits();
    let mode = |p: &str| {
        std::fs::symlink_metadata(out.join(p))
            .expect("stat")
            .permissions()
            .mode()
            & 0o7777
    };
    assert_eq!(mode("suid"), expected, "setuid kept");
    assert_eq!(mode("drop"), expected, "sticky or world-writable kept");
    let left: Vec<_> = std::fs::read_dir(out.join("drop")).expect("list").collect();
    assert!(left.is_empty(), "the device became {left:?}");
    assert!(r.stderr.contains("skipped"), "{}", r.stderr);
    assert!(!r.stderr.contains('\u{1b}'), "{:?}", r.stderr);
}

/// Whether `text` holds a byte or character a terminal acts on (ESC, BEL,
/// a C1 control).
fn has_terminal_controls(text: &str) -> bool {
    text.chars()
        .any(|c| c.is_control() && c != '\n' && c != '\t')
}

#[tokio::test]
async fn guest_text_reaches_the_terminal_escaped() {
    use fake_daemon::{EVIL_C1, EVIL_CLEAR, EVIL_OSC0, EVIL_OSC52};
    let fake = FakeDaemon::start(None).await;
    let escaped = |s: &str| {
        s.replace('\u{1b}', "\\x1b")
            .replace('\u{7}', "\\x07")
            .replace('\u{9b}', "\\u{9b}")
    };

    let r = run(&fake, &["vm", "logs", "evil"]).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(!has_terminal_controls(&r.stdout), "{:?}", r.stdout);
    assert!(
        r.stdout.contains(&format!(
            "{}{}\tboot done\n",
            escaped(EVIL_CLEAR),
            escaped(EVIL_OSC52)
        )),
        "{:?}",
        r.stdout
    );

    let r = run(&fake, &["vm", "health", "evil"]).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(!has_terminal_controls(&r.stdout), "{:?}", r.stdout);
    assert!(
        r.stdout.contains(&format!(
            "agent 0.1.0{}{} ready",
            escaped(EVIL_OSC0),
            escaped(EVIL_C1)
        )),
        "{:?}",
        r.stdout
    );

    let r = run(&fake, &["vm", "describe", "evil"]).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(!has_terminal_controls(&r.stdout), "{:?}", r.stdout);
    assert!(
        r.stdout
            .contains(&format!("agent said {}", escaped(EVIL_OSC52))),
        "{:?}",
        r.stdout
    );

    // An error answer carries the agent's words.
    let cmd = format!("{EVIL_CLEAR}x");
    let r = run(&fake, &["vm", "exec", "dev-1", "--", &cmd]).await;
    assert_ne!(r.code, 0);
    assert!(!has_terminal_controls(&r.stderr), "{:?}", r.stderr);
    assert!(r.stderr.contains("[2Jx"), "{:?}", r.stderr);
    let dir = tempfile::tempdir().expect("tempdir");
    let src = format!("evil{EVIL_OSC0}:/etc/hosts");
    let r = run(
        &fake,
        &["vm", "cp", &src, &dir.path().join("h").to_string_lossy()],
    )
    .await;
    assert_eq!(r.code, 1);
    assert!(!has_terminal_controls(&r.stderr), "{:?}", r.stderr);
    assert!(r.stderr.contains(&escaped(EVIL_OSC0)), "{:?}", r.stderr);

    // Exec output stays raw, as ssh's does.
    let r = run(&fake, &["vm", "exec", "dev-1", "--", "echo", EVIL_CLEAR]).await;
    assert_eq!(r.stdout, format!("{EVIL_CLEAR}\n"));
}

#[tokio::test]
async fn forward_bridges_local_connections() {
    let fake = FakeDaemon::start(None).await;
    let mut child = tine()
        .args([
            "--url",
            &fake.url(),
            "vm",
            "forward",
            "dev-1",
            "-L",
            "0:80",
            "--quiet",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let addr = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("listening in time")
        .expect("read")
        .expect("the local address");
    for round in 0..2 {
        let mut conn = tokio::net::TcpStream::connect(&addr)
            .await
            .expect("connect");
        conn.write_all(b"ping").await.expect("write");
        let mut buf = vec![0u8; 64];
        let mut got = Vec::new();
        while got.len() < b"[tcp:80]ping".len() {
            let n = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut buf))
                .await
                .expect("echo in time")
                .expect("read");
            assert!(n > 0, "closed early in round {round}");
            got.extend_from_slice(&buf[..n]);
        }
        assert_eq!(got, b"[tcp:80]ping");
    }
    assert_eq!(
        fake.last("/vm/dev-1/forward").uri,
        "/vm/dev-1/forward?target=tcp%3A80"
    );
    child.kill().await.expect("kill");
}

#[tokio::test]
async fn exec_exits_while_stdin_stays_open() {
    // `sleep 100 | tine vm exec VM -- true`: the command ends, so does tine,
    // though its stdin never does.
    let fake = FakeDaemon::start(None).await;
    let mut child = tine()
        .args([
            "--url",
            &fake.url(),
            "vm",
            "exec",
            "dev-1",
            "--",
            "exit",
            "6",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let _open_stdin = child.stdin.take().expect("stdin");
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("tine exited with stdin still open")
        .expect("wait");
    assert_eq!(status.code(), Some(6));
}

#[tokio::test]
async fn stats_show_guest_and_host_figures_and_say_why_some_are_missing() {
    let fake = FakeDaemon::start(None).await;
    let r = run(&fake, &["vm", "stats"]).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(fake.last("/nodes").uri, "/nodes/stats");
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert!(lines[0].starts_with("HOSTNAME"), "{}", r.stdout);
    assert!(
        lines[1].starts_with("dev-1 ") && lines[1].contains("128M/512M (25%)"),
        "{}",
        r.stdout
    );
    assert!(
        lines[1].contains("200M") && lines[1].contains("80M"),
        "{}",
        r.stdout
    );
    assert!(lines[2].ends_with("dev-2 is stopped"), "{}", r.stdout);

    let r = run(&fake, &["vm", "stats", "web", "--json"]).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(fake.last("/node/").uri, "/node/web/stats");
    let v: serde_json::Value = serde_json::from_str(&r.stdout).expect("one JSON document");
    assert_eq!(v[0]["snapshot"]["totalCpus"], 1);
    assert_eq!(v[0]["host"]["uss_bytes"], 80 << 20);

    let r = run(&fake, &["vm", "stats", "dev-9"]).await;
    assert_eq!(r.code, 1, "{}", r.stdout);
    assert!(r.stderr.contains("not_found"), "{}", r.stderr);
}

#[tokio::test]
async fn pause_and_resume_name_the_vm() {
    let fake = FakeDaemon::start(None).await;
    let r = run(&fake, &["vm", "pause", "dev-1"]).await;
    assert_eq!(
        (r.code, r.stdout.as_str()),
        (0, "dev-1 paused\n"),
        "{}",
        r.stderr
    );
    assert_eq!(fake.last("/vm/dev-1/pause").method, "POST");
    let r = run(&fake, &["vm", "resume", "dev-1", "-q"]).await;
    assert_eq!((r.code, r.stdout.as_str()), (0, "dev-1\n"), "{}", r.stderr);
    assert_eq!(fake.last("/vm/dev-1/resume").method, "POST");
    let r = run(&fake, &["vm", "pause", "dev-2"]).await;
    assert_eq!(r.code, 1);
    assert!(r.stderr.contains("dev-2 is stopped"), "{}", r.stderr);
}

#[tokio::test]
async fn image_commands_list_import_inspect_and_remove() {
    let fake = FakeDaemon::start(None).await;
    let r = run(&fake, &["image", "list"]).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert!(
        lines[0].starts_with("NAME   FORMAT   ORIGIN"),
        "{}",
        r.stdout
    );
    assert!(
        lines[1].starts_with("app    oci      imported   256M   sha256:0a0a0a"),
        "{}",
        r.stdout
    );
    assert_eq!(lines.len(), 3);

    let r = run(&fake, &["image", "inspect", "app"]).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains("workdir:    /srv\n"), "{}", r.stdout);

    // A file is streamed as the body; a directory must be an OCI layout.
    let dir = tempfile::tempdir().expect("tmp");
    let file = dir.path().join("image.tar");
    std::fs::write(&file, vec![7u8; 100_000]).expect("write");
    let file_arg = file.to_str().expect("utf8");
    let r = run(&fake, &["image", "import", "new", file_arg]).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(
        r.stdout,
        format!(
            "imported image new (oci, 97.6K, sha256:{})\n",
            "0a".repeat(32)
        )
    );
    assert_eq!(fake.last("/images").uri, "/images?name=new&format=auto");
    let r = run(
        &fake,
        &[
            "image", "import", "new2", file_arg, "--json", "--format", "oci",
        ],
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let info: serde_json::Value = serde_json::from_str(&r.stdout).expect("one JSON document");
    assert_eq!(
        (info["name"].as_str(), info["size"].as_u64()),
        (Some("new2"), Some(100_000))
    );
    let r = run(
        &fake,
        &["image", "import", "new3", file_arg, "--format", "zip"],
    )
    .await;
    assert_eq!(r.code, 2, "a bad --format is a usage error: {}", r.stderr);

    let bad = dir.path().join("bad.tar");
    std::fs::write(&bad, b"bad bytes").expect("write");
    let r = run(
        &fake,
        &["image", "import", "broken", bad.to_str().expect("utf8")],
    )
    .await;
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains("the upload is not a valid tar archive"),
        "{}",
        r.stderr
    );
    let r = run(
        &fake,
        &["image", "import", "d", dir.path().to_str().expect("utf8")],
    )
    .await;
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains("without an oci-layout file"),
        "{}",
        r.stderr
    );

    // An OCI layout directory goes as a tar made while it is sent.
    let layout = dir.path().join("layout");
    std::fs::create_dir_all(layout.join("blobs/sha256")).expect("layout");
    std::fs::write(
        layout.join("oci-layout"),
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )
    .expect("w");
    std::fs::write(
        layout.join("index.json"),
        br#"{"schemaVersion":2,"manifests":[]}"#,
    )
    .expect("w");
    let r = run(
        &fake,
        &[
            "image",
            "import",
            "fromdir",
            layout.to_str().expect("utf8"),
            "--json",
        ],
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let info: serde_json::Value = serde_json::from_str(&r.stdout).expect("one JSON document");
    let sent = info["size"].as_u64().expect("size");
    assert!(
        sent >= 3 * 512 && sent.is_multiple_of(512),
        "a tar of the directory: {sent} bytes"
    );

    let r = run(&fake, &["image", "rm", "min"]).await;
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains("image `min` is used by VM dev-1"),
        "{}",
        r.stderr
    );
    let r = run(&fake, &["image", "rm", "app"]).await;
    assert_eq!(
        (r.code, r.stdout.as_str()),
        (0, "removed image app\n"),
        "{}",
        r.stderr
    );
}
