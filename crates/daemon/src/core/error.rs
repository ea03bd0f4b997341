//! The core's error: what went wrong, with its cause. `crate::error` maps it
//! to an HTTP status and `{error, code}` body in one place.

use crate::artifacts::ArtifactError;
use crate::db::DbError;
use crate::launcher::LaunchError;
use crate::network::NetworkError;
use crate::secrets::SecretError;
use crate::ssh_keys::KeyError;
use crate::storage::DiskError;

/// An error of a core operation.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request asks for something invalid.
    #[error("{0}")]
    BadRequest(String),
    /// No such host group, VM or commit.
    #[error("{0}")]
    NotFound(String),
    /// The resource's state forbids the request.
    #[error("{0}")]
    Conflict(String),
    /// A wait ran past its timeout.
    #[error("{0}")]
    Timeout(String),
    /// The guest's agent cannot be reached.
    #[error("{0}")]
    AgentUnavailable(String),
    /// A call to the guest's agent failed.
    #[error("{what}")]
    Agent {
        /// The call.
        what: String,
        /// Why.
        #[source]
        source: tine_client::ClientError,
    },
    /// A VM failed to come up; the reason is the guest's or the VMM's.
    #[error("{0}")]
    Failed(String),
    /// The state database failed.
    #[error("state database")]
    Store(#[from] DbError),
    /// A disk operation failed.
    #[error("{what}")]
    Disk {
        /// The operation.
        what: String,
        /// Why.
        #[source]
        source: DiskError,
    },
    /// Setting up a VM's network failed.
    #[error("network of {vm}")]
    Network {
        /// The VM.
        vm: String,
        /// Why.
        #[source]
        source: NetworkError,
    },
    /// Running the VM failed.
    #[error("{what}")]
    Launch {
        /// What was being done.
        what: String,
        /// Why.
        #[source]
        source: LaunchError,
    },
    /// A file operation failed.
    #[error("{what}")]
    Io {
        /// The operation.
        what: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The configuration cannot be used (a group's userdata file, say).
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// Finding or importing a kernel or image failed.
    #[error(transparent)]
    Artifact(#[from] ArtifactError),
    /// A background task of the request panicked or was cancelled.
    #[error("{what}")]
    Task {
        /// The task.
        what: &'static str,
        /// Why.
        #[source]
        source: tokio::task::JoinError,
    },
    /// Importing an image.
    #[error(transparent)]
    Image(#[from] crate::image::ImageError),
    /// A host secret or a VM's grants.
    #[error(transparent)]
    Secret(#[from] SecretError),
    /// A VM's SSH keys.
    #[error(transparent)]
    Keys(#[from] KeyError),
    /// The daemon stops.
    #[error("the daemon is shutting down")]
    ShuttingDown,
}

impl Error {
    /// A file operation failed.
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            what: what.into(),
            source,
        }
    }

    /// A disk operation failed.
    pub fn disk(what: impl Into<String>, source: DiskError) -> Self {
        Error::Disk {
            what: what.into(),
            source,
        }
    }

    /// Whether this is a timeout of a wait (the work goes on).
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout(_))
    }
}

/// Result of core operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub use tine_proto::error_chain as chain;
