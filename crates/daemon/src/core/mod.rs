//! The daemon's core, independent of HTTP: host groups, VM life cycles,
//! their supervision, commits and forks, start-up reconciliation, each VM's
//! network. It runs VMs through a [`crate::launcher::Launcher`], so every
//! part of it runs in plain unit tests on the fake launcher.
//!
//! Modules, each on top of the ones before it: `error`, `dir_sync` (one
//! directory `fsync` shared by a burst of callers), `plan` (requests
//! checked against their group), `signals` (change signals per VM), `spare_book` (what is made ahead of hot
//! forks), `daemon` (the state and what every part shares), `netattach`,
//! `secrets` (host secrets and their sync into guests), `supervise`
//! (launch, boot set-up, exit policy), `snapshot` (a VM's state and memory
//! to files and back), `suspend`, `lifecycle`, `commit_record` (what disk
//! and memory commits share), `memory_commit`, `spares` (networks and
//! disks made ahead of hot forks), `hot_fork`, `commits`, `reconcile`.

mod commit_record;
mod commits;
mod daemon;
mod dir_sync;
mod error;
mod hot_fork;
mod images;
mod lifecycle;
mod memory_commit;
mod netattach;
mod plan;
mod reconcile;
mod secrets;
mod signals;
mod snapshot;
mod spare_book;
mod spares;
mod supervise;
mod suspend;

#[cfg(test)]
mod tests;

pub use commit_record::{info as commit_info, MAX_CACHE_KEY};
pub use daemon::{capped, Daemon, Deadlines, Parts, MAX_REASON, STATE_CHECKPOINT_QUIET};
pub use error::{chain, Error, Result};
pub use images::{image_info, ImportSlot};
pub use lifecycle::DEFAULT_SHUTDOWN_TIMEOUT;
pub use plan::{validate_name, validate_tag, MAX_USERDATA};
pub use reconcile::ReconcileReport;
pub use snapshot::{Captured, SnapshotFiles};
pub use spares::SPARES_DIR;
pub use supervise::{after_exit, stop_mode, AfterExit, SetUp, BASE_CMDLINE};
