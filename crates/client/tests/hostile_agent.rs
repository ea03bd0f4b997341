//! `AgentClient` against an agent the guest replaced: it hangs, cuts
//! downloads short, streams without end. The host must end every call.

use std::time::{Duration, Instant};

use tine_client::agent::{ClientError, Limits};
use tine_client::proto::{Channel, ErrorCode, ExecRequest, Request, Response, UploadRequest};
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

/// An agent answering every download with `steps`.
fn downloads(steps: Vec<Step>) -> HostileAgent {
    HostileAgent::new(move |request| match request {
        Request::Download(_) | Request::DownloadTar(_) => steps.clone(),
        _ => vec![Step::Hang],
    })
}

#[tokio::test]
async fn a_download_shorter_than_announced_is_an_error() {
    let agent = downloads(vec![
        Step::file_info(1_000_000),
        Step::Data(Channel::Data, b"8 bytes!".to_vec()),
        Step::Eof(Channel::Data),
        Step::Reply(Response::Ok),
    ]);
    let client = connect(&agent, Limits::default()).await;
    let mut sink = Vec::new();
    let err = client.download("/f", &mut sink).await.expect_err("short");
    assert!(
        matches!(
            err,
            ClientError::Truncated {
                expected: 1_000_000,
                received: 8
            }
        ),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_download_cut_by_an_agent_error_is_an_error() {
    let agent = downloads(vec![
        Step::file_info(1_000_000),
        Step::Data(Channel::Data, b"8 bytes!".to_vec()),
        Step::Reply(Response::error(ErrorCode::Io, "read failed")),
    ]);
    let client = connect(&agent, Limits::default()).await;
    let err = client.read_file("/f").await.expect_err("cut");
    assert_eq!(err.code(), Some(ErrorCode::Io), "{err:?}");
}

#[tokio::test]
async fn a_download_that_grows_or_announces_zero_is_fine() {
    // A file appended to while read, or a /proc file (size 0).
    for announced in [3, 0] {
        let agent = downloads(vec![
            Step::file_info(announced),
            Step::Data(Channel::Data, b"hello".to_vec()),
            Step::Eof(Channel::Data),
            Step::Reply(Response::Ok),
        ]);
        let client = connect(&agent, Limits::default()).await;
        assert_eq!(client.read_file("/f").await.expect("read"), b"hello");
    }
}

#[tokio::test]
async fn an_endless_download_stops_at_the_cap() {
    let limits = Limits {
        download_bytes: 1 << 20,
        ..Limits::default()
    };
    for tar in [false, true] {
        let mut steps = vec![Step::Endless(Channel::Data, 64 << 10)];
        if !tar {
            steps.insert(0, Step::file_info(0));
        }
        let agent = downloads(steps);
        let client = connect(&agent, limits).await;
        let mut sink = Vec::new();
        let result = tokio::time::timeout(HANG, async {
            if tar {
                client.download_tar("/", &mut sink).await.map(|_| ())
            } else {
                client.download("/dev/zero", &mut sink).await.map(|_| ())
            }
        })
        .await
        .expect("the cap ends it");
        let err = result.expect_err("over the cap");
        assert!(
            matches!(err, ClientError::TooLarge { limit } if limit == 1 << 20),
            "{err:?}"
        );
        assert!(sink.len() <= 1 << 20, "{} bytes written", sink.len());
    }
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
        Step::file_info(100),
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
