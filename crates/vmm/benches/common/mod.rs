//! What the VMM's benches share: the synthetic guest's code, percentiles
//! and the `tine-vmm` binary they spawn.

// Each bench uses a part of this module.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use tine_vmm::device_manager::RestoreOverrides;
use tine_vmm::vmm::{ConsoleConfig, PreparedVm, Vmm};

/// `inc qword [0x200000]; jmp -10`: a ring-3 guest that counts for as long
/// as it runs.
pub const COUNTER_LOOP: &[u8] = &[0x48, 0xff, 0x04, 0x25, 0x00, 0x00, 0x20, 0x00, 0xeb, 0xf6];

/// `hlt; jmp -3`: a ring-0 guest (`Privilege::Kernel`) that idles, its
/// vCPU halted, holding no host CPU.
pub const HALT_LOOP: &[u8] = &[0xf4, 0xeb, 0xfd];

/// `Vmm::restore` of the snapshot `state` + `mem` in this process, into
/// `prepared` (or a VM it creates), with no console and nothing
/// overridden, its vCPUs running or `paused`.
pub fn restore_here(state: &Path, mem: &Path, prepared: Option<PreparedVm>, paused: bool) -> Vmm {
    Vmm::restore(
        state,
        mem,
        prepared,
        &ConsoleConfig::default(),
        &RestoreOverrides::default(),
        paused,
    )
    .expect("restore")
}

/// A `tine-vmm` control request that restores the snapshot `state` +
/// `mem`, its vCPUs running or `paused`, as one line.
pub fn restore_request(state: &Path, mem: &Path, paused: bool) -> String {
    serde_json::json!({
        "op": "restore", "state_path": state, "mem_path": mem, "paused": paused
    })
    .to_string()
        + "\n"
}

/// The time a `tine-vmm` control answer says its request took, in ms (NaN
/// when the answer has none).
pub fn answer_ms(answer: &str) -> f64 {
    serde_json::from_str::<serde_json::Value>(answer)
        .ok()
        .and_then(|v| v.get("duration_us")?.as_f64())
        .map_or(f64::NAN, |us| us / 1e3)
}

/// The `p` quantile (0..=1) of `sorted`; NaN when it is empty.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[idx]
}

/// The `tine-vmm` beside the bench (`target/<profile>/tine-vmm`), built in
/// release first when it is not there.
pub fn vmm_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("bench path");
    // target/<profile>/deps/<bench>-xxxx -> target/<profile>/tine-vmm
    let profile_dir = exe.parent().and_then(Path::parent).expect("target dir");
    let candidate = profile_dir.join("tine-vmm");
    if !candidate.exists() {
        let status = Command::new(env!("CARGO"))
            .args([
                "build",
                "--release",
                "-q",
                "-p",
                "tine-vmm",
                "--bin",
                "tine-vmm",
            ])
            .status()
            .expect("cargo build");
        assert!(status.success(), "cannot build tine-vmm");
    }
    candidate
}
