//! Contract tests of background exec logs by frame id (Go
//! `ExecLogs(LogOptions{FromID})` and `ExecInfo`'s `next_id`, TS
//! `vm.bg.logs(id, {fromId})` and `bg.info()`'s `nextId`), against a real
//! agent on this host: its rings number every chunk of output and the exit.

use axum::http::{Method, StatusCode};

use super::{Sdk, SdkBgInfo};

/// The background exec operations, answered by the real agent.
const BG_OPS: &[&str] = &[
    "exec",
    "bg_list",
    "bg_logs",
    "bg_wait",
    "bg_kill",
    "bg_remove",
];

/// One NDJSON frame of `ExecLogs`, as Go's `SlicerExecWriteResult` reads
/// it: `(id, type, data decoded, dropped_frames)`.
fn frames(body: &str) -> Vec<(u64, String, Vec<u8>, u64)> {
    use base64::Engine;
    body.lines()
        .map(|line| {
            let f: serde_json::Value = serde_json::from_str(line).expect("an NDJSON frame");
            let data = f["data"].as_str().unwrap_or_default();
            (
                f["id"].as_u64().expect("every frame has an id"),
                f["type"].as_str().unwrap_or_default().to_owned(),
                base64::engine::general_purpose::STANDARD
                    .decode(data)
                    .expect("base64 data"),
                f["dropped_frames"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_logs_resume_from_a_frame_id() {
    let (sdk, _root) = Sdk::with_real_agent(BG_OPS);
    let h = sdk.create(serde_json::json!({})).await.hostname;
    let q = "cmd=printf%20a%3B%20sleep%200.2%3B%20printf%20b%20%3E%262%3B%20sleep%200.2%3B%20printf%20c&shell=%2Fbin%2Fsh";
    let id = sdk.bg_exec(&h, q).await.exec_id;
    let a = sdk
        .get(&format!("/vm/{h}/exec/{id}/wait-exit?timeout=10"))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());

    // Go ExecLogs(FromID: 0): every frame, numbered by the agent.
    let all = frames(&sdk.get(&format!("/vm/{h}/exec/{id}/logs")).await.text());
    let shape: Vec<(u64, &str, &[u8])> = all
        .iter()
        .map(|(i, t, d, _)| (*i, t.as_str(), d.as_slice()))
        .collect();
    assert_eq!(
        shape,
        [
            (1, "stdout", &b"a"[..]),
            (2, "stderr", b"b"),
            (3, "stdout", b"c"),
            (4, "exit", b""),
        ]
    );
    // ExecInfo's next_id: after the exit's frame.
    let info: SdkBgInfo = sdk.get(&format!("/vm/{h}/exec/{id}")).await.decode();
    assert_eq!(info.next_id, 5);

    // FromID resumes: the same ids, only from there on.
    let from2 = frames(
        &sdk.get(&format!("/vm/{h}/exec/{id}/logs?from_id=2"))
            .await
            .text(),
    );
    assert_eq!(from2.iter().map(|f| f.0).collect::<Vec<_>>(), [2, 3, 4]);
    let from4 = frames(
        &sdk.get(&format!("/vm/{h}/exec/{id}/logs?from_id=4&follow=true"))
            .await
            .text(),
    );
    assert_eq!(
        from4.iter().map(|f| f.1.as_str()).collect::<Vec<_>>(),
        ["exit"]
    );

    // Frames the ring no longer holds: a gap frame first, then the rest.
    let q = "cmd=head%20-c%203000%20%2Fdev%2Fzero%3B%20sleep%200.2%3B%20head%20-c%203000%20%2Fdev%2Fzero%3B%20sleep%200.2%3B%20head%20-c%203000%20%2Fdev%2Fzero&shell=%2Fbin%2Fsh&ring_bytes=4096";
    let id = sdk.bg_exec(&h, q).await.exec_id;
    sdk.get(&format!("/vm/{h}/exec/{id}/wait-exit?timeout=10"))
        .await;
    let got = frames(
        &sdk.get(&format!("/vm/{h}/exec/{id}/logs?from_id=1"))
            .await
            .text(),
    );
    assert_eq!(
        (got[0].0, got[0].1.as_str(), got[0].3),
        (1, "gap", 1),
        "{got:?}"
    );
    assert_eq!(
        got[1..]
            .iter()
            .map(|f| (f.0, f.1.as_str()))
            .collect::<Vec<_>>(),
        [(2, "stdout"), (3, "stdout"), (4, "exit")]
    );
    let a = sdk
        .send(Method::DELETE, &format!("/vm/{h}/exec/{id}"), None)
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
}
