//! Shared test harness: an in-process agent on a Unix socket in a temporary
//! directory, and clients for it.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tine_agent::{Agent, AgentConfig};
use tine_client::AgentClient;

/// An agent serving on a Unix socket for the life of the test.
pub struct TestAgent {
    pub dir: tempfile::TempDir,
    pub root: tempfile::TempDir,
    pub socket: PathBuf,
    pub agent: Arc<Agent>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TestAgent {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TestAgent {
    /// Starts an agent with the default limits.
    pub async fn start() -> Self {
        Self::start_with(AgentConfig::default()).await
    }

    /// Starts an agent with `config` (its `system_root` is replaced by a
    /// temporary directory).
    pub async fn start_with(mut config: AgentConfig) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("agent.sock");
        let listener = tokio::net::UnixListener::bind(&socket).expect("bind");
        config.system_root = root.path().to_path_buf();
        let agent = Agent::new(config);
        let task = tokio::spawn(agent.clone().serve(listener));
        Self {
            dir,
            root,
            socket,
            agent,
            task,
        }
    }

    /// A new connection.
    pub async fn client(&self) -> AgentClient {
        AgentClient::connect_unix(&self.socket)
            .await
            .expect("connect to the test agent")
    }

    /// A fresh directory for file tests.
    pub fn scratch(&self, name: &str) -> PathBuf {
        let path = self.dir.path().join(name);
        std::fs::create_dir_all(&path).expect("mkdir scratch");
        path
    }
}

/// Whether the tests run as root (ownership tests need it).
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Polls `check` every 20 ms until it is true or `timeout` passes.
pub async fn wait_until(timeout: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    check()
}

/// Path as the `&str` the client API takes.
pub fn s(path: &Path) -> &str {
    path.to_str().expect("test paths are UTF-8")
}
