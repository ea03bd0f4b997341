//! The tine daemon (`tine up`): host groups, one supervised `tine-vmm`
//! process per VM, the REST API and the SQLite state. Lands with the daemon
//! issue.

pub mod network;
