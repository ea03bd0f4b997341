//! The tine daemon (`tine up`): host groups, one supervised VM per
//! `tine-vmm` process, the REST API and the SQLite state.
//!
//! Modules: `config` (`tine.yaml`), `db` (the SQLite store with
//! migrations), `core` (VM life cycles, supervision, commits and forks,
//! start-up reconciliation, each VM's network), `launcher` (what runs VMs:
//! tine-vmm processes, or an in-process fake for tests), `process` (starting
//! and recognising tine-vmm processes), `host_stats` (what the host
//! measures of a VM's process and TAP for stats), `storage` (qcow2 disk chains),
//! `network` (TAPs, bridges, nftables), `api` (the REST routes,
//! docs/api.md) and `error` (core errors as HTTP), `server` (listeners, the
//! data-directory lock, the token), `failpoint` (crash points for the
//! fault-injection tests).
//!
//! The daemon does not link the VMM: it runs `tine-vmm` as a process,
//! speaks to it with the types of `tine_proto::vmm` and handles disks
//! with `tine-disk`.

pub mod api;
pub mod artifacts;
pub mod config;
pub mod core;
pub mod db;
pub mod error;
pub mod failpoint;
pub mod host_stats;
pub mod image;
pub mod launcher;
pub mod network;
pub mod process;
pub mod secrets;
pub mod server;
pub mod ssh_keys;
pub mod storage;

pub use server::run_from_cli;
