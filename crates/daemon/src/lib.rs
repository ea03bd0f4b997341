//! The tine daemon (`tine up`): host groups, one supervised `tine-vmm`
//! process per VM, the REST API and the SQLite state.
//!
//! Modules: `config` (`tine.yaml`), `db` (the SQLite store with
//! migrations), `daemon` (VM life cycles, supervision, start-up
//! reconciliation), `process` (launching and recognising tine-vmm
//! processes), `api` (the REST routes, docs/api.md), `server` (listeners,
//! the data-directory lock, the token), `failpoint` (crash points for the
//! fault-injection tests), `storage` (VM disk chains).
//!
//! The daemon does not link the VMM: it runs `tine-vmm` as a process,
//! speaks to it with the types of `tine_proto::vmm` and handles disks
//! with `tine-disk`.

pub mod api;
pub mod artifacts;
pub mod commits;
pub mod config;
pub mod daemon;
pub mod db;
pub mod error;
pub mod failpoint;
pub mod network;
pub mod process;
pub mod server;
pub mod storage;
pub mod vmnet;

pub use server::run_from_cli;
