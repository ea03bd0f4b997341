//! One module per operation family. Each operation takes its request and
//! the stream halves it needs, and returns the stream's final message (or an
//! [`OpError`](crate::error::OpError), sent instead).

pub(crate) mod archive;
pub(crate) mod background;
pub(crate) mod exec;
pub(crate) mod files;
pub(crate) mod forward;
pub(crate) mod image_defaults;
pub(crate) mod process;
pub(crate) mod shell;
pub(crate) mod system;
pub(crate) mod watch;
