//! `AgentClient` against an agent the guest replaced: it hangs, cuts
//! downloads short, streams without end. The host must end every call.

use std::time::{Duration, Instant};

use tine_client::agent::{ClientError, Limits};
use tine_client::proto::{
    Channel, ExecRequest, FileKind, FileStat, Request, Response, UploadRequest,
};
use tine_client::AgentClient;
use tine_testbed::hostile_agent::{HostileAgent, Step};

/// Longer than any deadline a test sets: a call still waiting then hangs.
const HANG: Duration = Duration::from_secs(10);

async fn connect(agent: &HostileAgent, limits: Limits) -> AgentClient {
    let io = agent.connect().expect("socket pair");
    AgentClient::handshake(io)
        .await
        .expect("handshake")
        .with_limits(limits)
}

fn file_info(size: u64) -> Step {
    Step::Reply(Response::FileInfo(FileStat {
        kind: FileKind::File,
        size,
        mode: 0o644,
        uid: 0,
        gid: 0,
        mtime_secs: 0,
        mtime_nanos: 0,
        symlink_target: None,
    }))
}

/// An agent answering every download with `steps`.
fn downloads(steps: Vec<Step>) -> HostileAgent {
    HostileAgent::new(move |request| match request {
        Request::Download(_) | Request::DownloadTar(_) => steps.clone(),
        _ => vec![Step::Hang],
    })
}

#[tokio::test]
async fn hung_answers_end_at_the_reply_deadline() {
    let agent = HostileAgent::new(|_| vec![Step::Hang]);
    let limits = Limits {
        reply: Some(Duration::from_millis(200)),
        ..Limits::default()
    };
    let client = connect(&agent, limits).await;
    let began = Instant::now();
    let err = client.health().await.expect_err("hung");
    assert!(matches!(err, ClientError::Timeout { .. }), "{err:?}");
    let err = client
        .exec(ExecRequest::argv(["true"]))
        .await
        .expect_err("never started");
    assert!(matches!(err, ClientError::Timeout { .. }), "{err:?}");
    let err = client.stat("/", false).await.expect_err("hung");
    assert!(matches!(err, ClientError::Timeout { .. }), "{err:?}");
    assert!(began.elapsed() < HANG, "{:?}", began.elapsed());
    // The host closed each stream it gave up on.
    assert!(
        agent.wait_closed_by_host(3, HANG).await,
        "{:?}",
        agent.seen()
    );
}

#[tokio::test]
async fn a_download_that_stalls_ends_at_the_transfer_deadline() {
    let agent = downloads(vec![
        file_info(100),
        Step::Data(Channel::Data, b"some".to_vec()),
        Step::Hang,
    ]);
    let limits = Limits {
        transfer: Some(Duration::from_millis(200)),
        ..Limits::default()
    };
    let client = connect(&agent, limits).await;
    let err = tokio::time::timeout(HANG, client.read_file("/f"))
        .await
        .expect("the deadline ends it")
        .expect_err("stalled");
    assert!(matches!(err, ClientError::Timeout { .. }), "{err:?}");
}

#[tokio::test]
async fn an_upload_the_agent_stops_taking_ends_at_the_transfer_deadline() {
    // The agent never reads: no flow-control credit comes back after the
    // first window.
    let agent = HostileAgent::new(|_| vec![Step::Sleep(HANG * 2)]);
    let limits = Limits {
        transfer: Some(Duration::from_millis(200)),
        ..Limits::default()
    };
    let client = connect(&agent, limits).await;
    let data = vec![0u8; 8 << 20];
    let req = UploadRequest {
        path: "/f".into(),
        attrs: Default::default(),
        mkdirs: false,
        size: None,
    };
    let err = tokio::time::timeout(HANG, client.upload(req, data.as_slice()))
        .await
        .expect("the deadline ends it")
        .expect_err("stalled");
    assert!(matches!(err, ClientError::Timeout { .. }), "{err:?}");
}
