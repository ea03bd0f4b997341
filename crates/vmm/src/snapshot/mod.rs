//! Snapshot support: the [`Persist`] trait every stateful component
//! implements, (in `format`) the versioned state-file container, and (in
//! `write_set`) the pages a restored VM wrote, for the next one.

use serde::de::DeserializeOwned;
pub mod format;
pub mod write_set;

use serde::Serialize;
use std::path::{Path, PathBuf};

/// A temporary name beside `path`, this process's own (`<path>.tmp-<pid>`):
/// a file is written there and renamed over `path`, so that no reader and
/// no crash ever finds it half written.
pub(crate) fn temp_name(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_os_string();
    name.push(format!(".tmp-{}", std::process::id()));
    PathBuf::from(name)
}

/// Save and restore-by-construction, one implementation per component.
///
/// `save` captures guest-visible state only (never file descriptors or host
/// pointers); `restore` builds a new, live component from that state and the
/// host resources in `ConstructorArgs`.
pub trait Persist: Sized {
    /// The serializable state.
    type State: Serialize + DeserializeOwned;
    /// Host-side resources needed to rebuild the component.
    type ConstructorArgs;
    /// Why a restore failed.
    type Error: std::error::Error;

    /// Captures the component's state.
    fn save(&self) -> Self::State;
    /// Builds a component from `state`.
    fn restore(args: Self::ConstructorArgs, state: &Self::State) -> Result<Self, Self::Error>;
}
