//! The tine daemon (`tine up`): host groups, one supervised `tine-vmm`
//! process per VM, the REST API and the SQLite state. Lands with the daemon
//! issue.

// TEMP(cli): replaced by the daemon
/// Runs the daemon as `tine up` does (placeholder until the daemon lands).
pub fn run_from_cli(
    config_path: Option<std::path::PathBuf>,
    data_dir: Option<std::path::PathBuf>,
) -> anyhow::Result<()> {
    let _ = (config_path, data_dir);
    Err(anyhow::anyhow!("not built yet"))
}
