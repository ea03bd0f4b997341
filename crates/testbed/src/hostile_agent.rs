//! A guest agent that lies, for host-side tests.
//!
//! Code in a VM runs as root there and can replace `tine-agent` with its own
//! program. [`HostileAgent`] is such a program: it speaks the real agent
//! protocol (the server side of `tine_proto::agent`: the handshake, then the
//! multiplexer) over any stream, and answers every request with the
//! [`Step`]s a test's script returns for it. It can hang, announce one size
//! and send another, cut a stream short, send terminal escapes or endless
//! data, and drop the connection.
//!
//! Tests connect with `tine_client::AgentClient::handshake` over the stream
//! [`HostileAgent::connect`] returns, or point the daemon at
//! [`HostileAgent::listen`].

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tine_proto::agent::mux::{Mux, MuxConfig, Stream};
use tine_proto::agent::{
    server_handshake, Channel, Control, ErrorCode, Request, Response, Welcome, MAX_FRAME_LEN,
    PROTOCOL_VERSION,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::Notify;

/// One step of the agent's answer to a request.
#[derive(Debug, Clone)]
pub enum Step {
    /// Sends a control message.
    Reply(Response),
    /// Sends any JSON value as a control message (unknown types, fields
    /// of the wrong type, huge numbers).
    Json(serde_json::Value),
    /// Sends bytes on a channel.
    Data(Channel, Vec<u8>),
    /// Sends `n` bytes on a channel again and again until the host stops
    /// taking them (closes the stream or the connection).
    Endless(Channel, usize),
    /// Ends a channel.
    Eof(Channel),
    /// Waits.
    Sleep(Duration),
    /// Sends nothing more and keeps the stream open until the host closes it
    /// (counted in [`Seen::closed_by_host`]).
    Hang,
    /// Drops the whole connection.
    Disconnect,
}

impl Step {
    /// The answer to a `stat` or the start of a download: a regular file of
    /// `size` bytes (which the agent may then fail to send).
    pub fn file_info(size: u64) -> Step {
        Step::Reply(Response::FileInfo(tine_proto::agent::FileStat {
            kind: tine_proto::agent::FileKind::File,
            size,
            mode: 0o644,
            uid: 0,
            gid: 0,
            mtime_secs: 0,
            mtime_nanos: 0,
            symlink_target: None,
        }))
    }
}

/// What the agent answers: the steps for each request.
pub type Script = Arc<dyn Fn(&Request) -> Vec<Step> + Send + Sync>;

/// What the agent saw, for a test's assertions.
#[derive(Debug, Clone, Default)]
pub struct Seen {
    /// Every request, in arrival order.
    pub requests: Vec<Request>,
    /// Control messages (signals, resizes) the host sent on any stream.
    pub controls: Vec<Control>,
    /// Streams the host closed while a [`Step::Hang`] held them.
    pub closed_by_host: usize,
}

/// A scripted agent; clones share the script and the record.
#[derive(Clone)]
pub struct HostileAgent {
    welcome: Welcome,
    script: Script,
    seen: Arc<Mutex<Seen>>,
    closed: Arc<Notify>,
}

impl std::fmt::Debug for HostileAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostileAgent")
            .field("welcome", &self.welcome)
            .finish_non_exhaustive()
    }
}

impl HostileAgent {
    /// An agent answering each request with `script(request)`.
    pub fn new(script: impl Fn(&Request) -> Vec<Step> + Send + Sync + 'static) -> Self {
        Self {
            welcome: Welcome {
                version: PROTOCOL_VERSION,
                agent_version: "hostile".to_owned(),
                max_frame_len: MAX_FRAME_LEN,
                stream_window: tine_proto::agent::mux::STREAM_WINDOW,
            },
            script: Arc::new(script),
            seen: Arc::new(Mutex::new(Seen::default())),
            closed: Arc::new(Notify::new()),
        }
    }

    /// Announces `version` as the agent's build version in the handshake.
    pub fn agent_version(mut self, version: impl Into<String>) -> Self {
        self.welcome.agent_version = version.into();
        self
    }

    fn record(&self) -> MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A copy of what the agent has seen so far.
    pub fn seen(&self) -> Seen {
        self.record().clone()
    }

    /// Waits until the host has closed `n` hung streams in all, or `within`
    /// passes; returns whether it did.
    pub async fn wait_closed_by_host(&self, n: usize, within: Duration) -> bool {
        let wait = async {
            loop {
                let notified = self.closed.notified();
                if self.record().closed_by_host >= n {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(within, wait).await.is_ok()
    }

    /// Serves one connection in a new task and returns the host's end.
    /// Needs a Tokio runtime.
    pub fn connect(&self) -> std::io::Result<tokio::net::UnixStream> {
        let (host, guest) = tokio::net::UnixStream::pair()?;
        tokio::spawn(self.clone().serve(guest));
        Ok(host)
    }

    /// Accepts connections on a Unix socket at `path` in a new task. With
    /// `vsock_connect`, each connection first gets the `CONNECT <port>`
    /// line a VMM's vsock socket expects and answers it with `OK 1`, the
    /// way the daemon reaches a real agent.
    pub fn listen(
        &self,
        path: &Path,
        vsock_connect: bool,
    ) -> std::io::Result<tokio::task::JoinHandle<()>> {
        let listener = tokio::net::UnixListener::bind(path)?;
        let agent = self.clone();
        Ok(tokio::spawn(async move {
            while let Ok((mut io, _)) = listener.accept().await {
                let agent = agent.clone();
                tokio::spawn(async move {
                    if vsock_connect && answer_connect(&mut io).await.is_err() {
                        return;
                    }
                    agent.serve(io).await;
                });
            }
        }))
    }

    /// Runs the handshake and then answers streams until the host goes
    /// away or a script says [`Step::Disconnect`].
    pub async fn serve<S>(self, mut io: S)
    where
        S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        if server_handshake(&mut io, &self.welcome).await.is_err() {
            return;
        }
        let (mux, mut incoming) = Mux::server(io, MuxConfig::default());
        let disconnect = Arc::new(Notify::new());
        let mut streams = tokio::task::JoinSet::new();
        loop {
            tokio::select! {
                stream = incoming.accept() => match stream {
                    Some(stream) => {
                        streams.spawn(self.clone().answer(stream, disconnect.clone()));
                    }
                    None => break,
                },
                () = disconnect.notified() => break,
            }
        }
        // Every stream handle keeps the connection up: drop them all.
        streams.abort_all();
        while streams.join_next().await.is_some() {}
        drop(incoming);
        drop(mux);
    }

    async fn answer(self, stream: Stream, disconnect: Arc<Notify>) {
        let (tx, mut rx) = stream.split();
        let Some(first) = rx.recv().await else {
            return;
        };
        let request = match first.parse::<Request>() {
            Some(Ok(request)) => request,
            _ => {
                let reply = Response::error(ErrorCode::BadRequest, "not a request");
                let _ = tx.send_msg(&reply).await;
                return;
            }
        };
        self.record().requests.push(request.clone());
        for step in (self.script)(&request) {
            let sent = match step {
                Step::Reply(response) => tx.send_msg(&response).await,
                Step::Json(value) => tx.send_msg(&value).await,
                Step::Data(channel, data) => tx.send_data(channel, &data).await,
                Step::Endless(channel, n) => {
                    let chunk = vec![b'x'; n.max(1)];
                    while tx.send_data(channel, &chunk).await.is_ok() {}
                    return;
                }
                Step::Eof(channel) => tx.send_eof(channel).await,
                Step::Sleep(d) => {
                    tokio::time::sleep(d).await;
                    Ok(())
                }
                Step::Hang => {
                    while let Some(item) = rx.recv().await {
                        if let Some(Ok(control)) = item.parse::<Control>() {
                            self.record().controls.push(control);
                        }
                    }
                    self.record().closed_by_host += 1;
                    self.closed.notify_waiters();
                    return;
                }
                Step::Disconnect => {
                    disconnect.notify_one();
                    return;
                }
            };
            if sent.is_err() {
                return;
            }
        }
    }
}

/// Reads a `CONNECT <port>` line byte by byte and answers `OK 1`.
async fn answer_connect<S: AsyncRead + AsyncWrite + Unpin>(io: &mut S) -> std::io::Result<()> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < 64 {
        if io.read(&mut byte).await? == 0 || byte[0] == b'\n' {
            break;
        }
        line.push(byte[0]);
    }
    if !line.starts_with(b"CONNECT ") {
        return Err(std::io::Error::other("expected CONNECT"));
    }
    io.write_all(b"OK 1\n").await
}

#[cfg(test)]
mod tests {
    use super::*;
    use tine_proto::agent::{client_handshake, Hello};

    #[tokio::test]
    async fn scripted_answers_arrive_and_hangs_are_counted() {
        let agent = HostileAgent::new(|request| match request {
            Request::Health => vec![Step::Reply(Response::Ok)],
            _ => vec![Step::Hang],
        })
        .agent_version("evil\u{1b}]0;x\u{7}");
        let mut io = agent.connect().expect("pair");
        let hello = Hello {
            version: PROTOCOL_VERSION,
            client: "test".into(),
        };
        let welcome = client_handshake(&mut io, &hello).await.expect("welcome");
        assert_eq!(welcome.agent_version, "evil\u{1b}]0;x\u{7}");
        let mux = Mux::client(io, MuxConfig::default());
        let (_tx, mut rx) = mux.open_with_msg(&Request::Health).expect("open").split();
        let answer = rx.recv().await.expect("answer");
        assert!(matches!(answer.parse::<Response>(), Some(Ok(Response::Ok))));
        let hung = mux.open_with_msg(&Request::BgList).expect("open");
        hung.send_msg(&Control::Signal { signal: 15 })
            .await
            .expect("signal");
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(hung);
        assert!(agent.wait_closed_by_host(1, Duration::from_secs(5)).await);
        let seen = agent.seen();
        assert_eq!(seen.requests, vec![Request::Health, Request::BgList]);
        assert_eq!(seen.controls, vec![Control::Signal { signal: 15 }]);
    }
}
