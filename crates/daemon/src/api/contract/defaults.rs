//! Contract tests of the SDK calls in the forms the other tests leave out:
//! the plain methods without options (Go `CreateVM`, `RelaunchVM`,
//! `DeleteNode`, `CommitVM`, `ForkCommittedVM` with no option; TS
//! `vm.shutdown()`, `vm.relaunch()`), the fork options not used elsewhere
//! (`WithReplaceTags`, `WithWait(none)`, `WithTimeout`, every
//! `WithFixups` name, `WithNetwork`), `Command` as `os/exec` builds it, and
//! the TS file calls `fs.writeFile` / `fs.readFile`.

use axum::http::{Method, StatusCode};
use serde::Deserialize;

use super::{
    decode_output, rfc3339, Sdk, SdkCreateResponse, SdkDescription, SdkError, SdkFork, SdkNode,
};

/// Go `SlicerCommitVMResponse` as `CommitVM` without options gets it:
/// `tags`, `labels` and `cache_key` are `omitempty` there.
#[derive(Debug, Deserialize)]
#[allow(dead_code)]
struct SdkPlainCommit {
    hostname: String,
    commit_id: String,
    status: String,
    mode: String,
    #[serde(default)]
    tags: Option<Vec<String>>,
    #[serde(default)]
    cache_key: Option<String>,
}

#[tokio::test]
async fn create_shutdown_relaunch_and_delete_without_options() {
    let sdk = Sdk::new();
    // Go CreateVM(ctx, "dev", req): no query at all; 200 or 201.
    let a = sdk
        .json(
            Method::POST,
            "/hostgroup/dev/nodes",
            serde_json::json!({"persistent": true, "tags": ["plain"]}),
        )
        .await;
    assert!(
        a.status == StatusCode::OK || a.status == StatusCode::CREATED,
        "{} {}",
        a.status,
        a.text()
    );
    let vm: SdkCreateResponse = a.decode();
    assert_eq!(
        (vm.hostname.as_str(), vm.hostgroup.as_str()),
        ("dev-1", "dev")
    );
    rfc3339(&vm.created_at);
    let h = vm.hostname.as_str();
    // TS `createRaw` sends the same request and reads the same fields.

    // TS vm.shutdown() with no argument: the body is `{}`, so the action
    // is Slicer's default (reboot, the graceful stop).
    let a = sdk
        .json(
            Method::POST,
            &format!("/vm/{h}/shutdown"),
            serde_json::json!({}),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let d: SdkDescription = sdk.get(&format!("/vm/{h}")).await.decode();
    assert_eq!(d.node.status, "Stopped");
    assert!(!sdk.fake.is_running(h));

    // Go RelaunchVM / TS vm.relaunch(): no query, no body; Go decodes a
    // `SlicerCreateNodeResponse` from a 200 or 201.
    let a = sdk
        .send(Method::POST, &format!("/vm/{h}/relaunch"), None)
        .await;
    assert!(
        a.status == StatusCode::OK || a.status == StatusCode::CREATED,
        "{} {}",
        a.status,
        a.text()
    );
    let again: SdkCreateResponse = a.decode();
    assert_eq!(
        (again.hostname.as_str(), again.hostgroup.as_str()),
        (h, "dev")
    );
    rfc3339(&again.created_at);
    // Without `wait` it answers once the boot is queued; the VM comes up.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while sdk.get(&format!("/vm/{h}/health")).await.status != StatusCode::OK {
        assert!(
            std::time::Instant::now() < deadline,
            "no agent after relaunch"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert!(sdk.fake.is_running(h));

    // Go Shutdown(ctx, h, &SlicerShutdownRequest{Action: "shutdown"}):
    // the action in the query, no body.
    let a = sdk
        .send(
            Method::POST,
            &format!("/vm/{h}/shutdown?action=shutdown"),
            None,
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert!(!sdk.fake.is_running(h));
    let a = sdk
        .send(Method::POST, &format!("/vm/{h}/shutdown?action=halt"), None)
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{}", a.text());

    // Go DeleteNode(group, h): the same DELETE as DeleteVM; 200 or 204.
    let a = sdk
        .send(Method::DELETE, &format!("/hostgroup/dev/nodes/{h}"), None)
        .await;
    assert!(
        a.status == StatusCode::OK || a.status == StatusCode::NO_CONTENT,
        "{} {}",
        a.status,
        a.text()
    );
    assert!(sdk.get("/nodes").await.decode::<Vec<SdkNode>>().is_empty());
    // A VM in another group's path is not found there.
    let vm = sdk.create(serde_json::json!({})).await;
    let a = sdk
        .send(
            Method::DELETE,
            &format!("/hostgroup/other/nodes/{}", vm.hostname),
            None,
        )
        .await;
    assert_eq!(a.status, StatusCode::NOT_FOUND, "{}", a.text());
    assert_eq!(a.decode::<SdkError>().code, "not_found");
}

#[tokio::test]
async fn commit_and_fork_without_options_and_with_the_other_fork_options() {
    let sdk = Sdk::new();
    let vm = sdk
        .create(serde_json::json!({"persistent": true, "tags": ["src=1", "base"]}))
        .await;
    let h = vm.hostname;
    sdk.shutdown(&h).await;
    // Go CommitVM(ctx, h): no body and no Content-Type; 200.
    let a = sdk
        .send(Method::POST, &format!("/vm/{h}/commit"), None)
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let c: SdkPlainCommit = a.decode();
    assert_eq!(
        (c.hostname.as_str(), c.status.as_str(), c.mode.as_str()),
        (h.as_str(), "committed", "disk")
    );
    assert!(c.cache_key.unwrap_or_default().is_empty());

    // Go ForkCommittedVM(ctx, id) and commit.Fork(ctx): `wait=agent`, no
    // body; the child keeps its source's tags (append is the default).
    let a = sdk
        .send(
            Method::POST,
            &format!("/vm/commits/{}/fork?wait=agent", c.commit_id),
            None,
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let plain: SdkFork = a.decode();
    assert_eq!(plain.commit_id, c.commit_id);
    assert_eq!(plain.child_status, "running");
    assert!(sdk.fake.is_running(&plain.hostname));
    let d: SdkDescription = sdk.get(&format!("/vm/{}", plain.hostname)).await.decode();
    assert_eq!(d.node.tags, ["src=1", "base"]);

    // WithReplaceTags, WithWait(none), WithTimeout, WithEphemeral and every
    // fix-up by name.
    let uri = format!("/vm/commits/{}/fork?timeout=30s&wait=none", c.commit_id);
    let a = sdk
        .json(
            Method::POST,
            &uri,
            serde_json::json!({
                "tags": ["job=9"],
                "tag_mode": "replace",
                "persistent": false,
                "fixups": ["hostname", "machine-id", "ssh-host-keys"],
            }),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let replaced: SdkFork = a.decode();
    assert!(!replaced.persistent);
    let d: SdkDescription = sdk
        .get(&format!("/vm/{}", replaced.hostname))
        .await
        .decode();
    assert_eq!(d.node.tags, ["job=9"]);
    // WithTags alone appends (Go sends `tags` without `tag_mode`).
    let a = sdk
        .json(
            Method::POST,
            &format!("/vm/commits/{}/fork?wait=agent", c.commit_id),
            serde_json::json!({"tags": ["job=10"], "tag_mode": "append"}),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let appended: SdkFork = a.decode();
    let d: SdkDescription = sdk
        .get(&format!("/vm/{}", appended.hostname))
        .await
        .decode();
    assert_eq!(d.node.tags, ["src=1", "base", "job=10"]);

    // WithNetwork on a host group without isolated networking: refused by
    // name (the booted isolated forks are tested in the bed).
    let a = sdk
        .json(
            Method::POST,
            &format!("/vm/commits/{}/fork?wait=agent", c.commit_id),
            serde_json::json!({"network": {"allow": [], "drop": ["0.0.0.0/0"]}}),
        )
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{}", a.text());
    let e: SdkError = a.decode();
    assert!(e.error.contains("isolated mode"), "{}", e.error);
    // A fix-up name the SDK does not have, and a tag mode it does not
    // have, are refused by name.
    for (body, says) in [
        (serde_json::json!({"fixups": ["entropy"]}), "entropy"),
        (serde_json::json!({"tag_mode": "merge"}), "merge"),
    ] {
        let a = sdk
            .json(
                Method::POST,
                &format!("/vm/commits/{}/fork", c.commit_id),
                body.clone(),
            )
            .await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{body}: {}", a.text());
        assert!(a.decode::<SdkError>().error.contains(says), "{body}");
    }
    // The same on create (Go SlicerCreateNodeRequest.Network).
    let a = sdk
        .json(
            Method::POST,
            "/hostgroup/dev/nodes",
            serde_json::json!({"network": {"drop": ["0.0.0.0/0"]}}),
        )
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{}", a.text());
    assert!(a.decode::<SdkError>().error.contains("isolated mode"));
}

#[tokio::test]
async fn command_runs_as_os_exec_builds_it() {
    let sdk = Sdk::new();
    let h = sdk.create(serde_json::json!({})).await.hostname;
    let dir = tempfile::tempdir().expect("tmp");
    let cwd: String =
        form_urlencoded::byte_serialize(dir.path().display().to_string().as_bytes()).collect();
    // Go Command(ctx, h, "sh", "-c", "pwd; echo $X") with Dir and Env, then
    // Output(): ExecWithReader with `stdio=base64`, uid and gid always,
    // `cwd`, and no stdin.
    let r = sdk
        .exec(
            &h,
            &format!(
                "cmd=sh&stdio=base64&args=-c&args=pwd%3B%20echo%20%24X&env=X%3D1&uid=0&gid=0&cwd={cwd}"
            ),
            None,
        )
        .await;
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    let want = format!("{}\n1\n", dir.path().display());
    assert_eq!(String::from_utf8_lossy(&r.stdout), want);
    // TS exec({command, cwd, uid, gid}) without `stdio`: text frames.
    let r = sdk
        .exec(&h, &format!("cmd=pwd&uid=0&gid=0&cwd={cwd}"), None)
        .await;
    assert_eq!(
        String::from_utf8_lossy(&r.stdout),
        format!("{}\n", dir.path().display())
    );
    // A cwd that does not exist, and a program that does not: the exec
    // does not start, and the answer says why.
    for query in [
        "cmd=pwd&stdio=base64&uid=0&gid=0&cwd=%2Fno%2Fsuch%2Fdir",
        "cmd=no-such-program-here&stdio=base64&uid=0&gid=0",
    ] {
        let a = sdk
            .send(Method::POST, &format!("/vm/{h}/exec?{query}"), None)
            .await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{query}: {}", a.text());
        let e: SdkError = a.decode();
        assert!(!e.error.is_empty());
    }
}

#[tokio::test]
async fn ts_write_file_and_read_file() {
    let (sdk, _root) = Sdk::with_real_agent(&["upload", "download"]);
    let h = sdk.create(serde_json::json!({})).await.hostname;
    let dir = tempfile::tempdir().expect("tmp");
    let file = dir.path().join("note.txt");
    let path: String =
        form_urlencoded::byte_serialize(file.display().to_string().as_bytes()).collect();
    // TS fs.writeFile(path, text, {permissions}): mode=binary, the bytes as
    // an octet stream; no uid or gid unless given.
    let a = sdk
        .send(
            Method::POST,
            &format!("/vm/{h}/cp?path={path}&mode=binary&permissions=0600"),
            Some(("application/octet-stream", b"from ts\n".to_vec())),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&file).expect("meta").permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);
    // TS fs.readFile(path): GET with mode=binary; the raw bytes.
    let a = sdk
        .get(&format!("/vm/{h}/cp?path={path}&mode=binary"))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(
        decode_output(&String::from_utf8_lossy(&a.body), None),
        b"from ts\n"
    );
}

#[tokio::test]
async fn ts_background_calls_without_options() {
    let sdk = Sdk::new();
    let h = sdk.create(serde_json::json!({})).await.hostname;
    // TS vm.bg.exec({command, args}): `background=true`, `stdio=base64`,
    // no ring size (the agent's default).
    let a = sdk
        .send(
            Method::POST,
            &format!("/vm/{h}/exec?background=true&cmd=sleep&args=30&stdio=base64"),
            None,
        )
        .await;
    assert!(
        a.status == StatusCode::OK || a.status == StatusCode::CREATED,
        "{}",
        a.text()
    );
    let started: super::SdkBgStarted = a.decode();
    assert!(started.ring_bytes > 0, "the default ring");
    let id = started.exec_id;
    // TS vm.bg.kill(id) with no options: the body is `{}`, so SIGTERM
    // (with the default grace).
    let a = sdk
        .json(
            Method::POST,
            &format!("/vm/{h}/exec/{id}/kill"),
            serde_json::json!({}),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let k: super::SdkBgKill = a.decode();
    assert_eq!(k.signal_sent, "SIGTERM");
    // TS vm.bg.wait(id) with no timeout: no query (the server's default).
    let a = sdk.get(&format!("/vm/{h}/exec/{id}/wait-exit")).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let w: super::SdkBgWait = a.decode();
    assert!(!w.running && !w.timed_out, "{}", a.text());
    // TS vm.bg.logs(id) with no options: no query; NDJSON up to the exit.
    let a = sdk.get(&format!("/vm/{h}/exec/{id}/logs")).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let last = a
        .text()
        .lines()
        .last()
        .map(str::to_owned)
        .unwrap_or_default();
    let f: super::SdkExecFrame = serde_json::from_str(&last).expect("a frame");
    assert_eq!(f.kind, "exit", "{last}");
    assert_eq!(f.signal.as_deref(), Some("SIGTERM"), "{last}");
}
