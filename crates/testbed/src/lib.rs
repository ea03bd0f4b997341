//! The test bed seen from Rust tests.
//!
//! Tests that need a KVM able to run Linux guests live in test targets with
//! `harness = false` whose `main` calls [`run_tests`]. Outside a test bed,
//! [`run_tests`] re-executes the same test binary through `scripts/kvm-run`,
//! which runs it directly where the host's KVM is usable and inside the
//! nested L1 otherwise; inside, the tests run under a libtest-compatible
//! harness. Either way `cargo test` runs them: none is skipped.
//!
//! With the `hostile-agent` feature, `hostile_agent` holds a scripted
//! guest agent for host-side tests that need no VM.

pub mod cpio;
#[cfg(feature = "hostile-agent")]
pub mod hostile_agent;

use std::path::{Path, PathBuf};
use std::process::Command;

pub use libtest_mimic::{Failed, Measurement, Trial};

/// Where a test bed runs its command (the `TINE_TESTBED` variable).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// On the host: its KVM passed the functional probe.
    Direct,
    /// Inside the nested L1 under QEMU/TCG.
    Nested,
}

/// Errors from locating or building test-bed artifacts.
#[derive(Debug, thiserror::Error)]
pub enum TestbedError {
    /// A helper script could not be started.
    #[error("cannot run {script}: {source}")]
    Spawn {
        /// The script.
        script: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A helper script failed.
    #[error("{script} failed with {status}")]
    Script {
        /// The script.
        script: PathBuf,
        /// Its exit status.
        status: std::process::ExitStatus,
    },
    /// A built artifact is missing where the script said it would be.
    #[error("expected artifact {0} is missing")]
    MissingArtifact(PathBuf),
}

/// The placement of the current process, if it runs inside a test bed.
pub fn placement() -> Option<Placement> {
    match std::env::var("TINE_TESTBED").ok().as_deref() {
        Some("direct") => Some(Placement::Direct),
        Some("nested") => Some(Placement::Nested),
        _ => None,
    }
}

/// The repository root (two levels above this crate's manifest).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// The guest kernel built by `scripts/build-kernel`.
#[derive(Debug, Clone)]
pub struct GuestKernel {
    /// Uncompressed ELF kernel.
    pub vmlinux: PathBuf,
    /// Compressed bzImage.
    pub bzimage: PathBuf,
}

/// Returns the project's guest kernel, building it if the cache lacks it
/// (instant when cached).
pub fn guest_kernel() -> Result<GuestKernel, TestbedError> {
    let dir = run_script("scripts/build-kernel")?;
    let kernel = GuestKernel {
        vmlinux: dir.join("vmlinux"),
        bzimage: dir.join("bzImage"),
    };
    for path in [&kernel.vmlinux, &kernel.bzimage] {
        if !path.is_file() {
            return Err(TestbedError::MissingArtifact(path.clone()));
        }
    }
    Ok(kernel)
}

/// The min image's root filesystem (`guest/rootfs/min/build`: busybox and
/// a static tine-agent), building it if the cache lacks it.
pub fn min_image() -> Result<PathBuf, TestbedError> {
    let image = run_script("guest/rootfs/min/build")?.join("rootfs.ext4");
    if !image.is_file() {
        return Err(TestbedError::MissingArtifact(image));
    }
    Ok(image)
}

/// The debian image's root filesystem (`guest/rootfs/debian/build`:
/// Debian 12 with systemd and the agent as a service), building it if the
/// cache lacks it (about two minutes; needs root and Debian's apt source).
pub fn debian_image() -> Result<PathBuf, TestbedError> {
    let image = run_script("guest/rootfs/debian/build")?.join("rootfs.ext4");
    if !image.is_file() {
        return Err(TestbedError::MissingArtifact(image));
    }
    Ok(image)
}

/// Builds the `tine-vmm` binary (debug) and returns its path, for tests
/// whose crate does not own it.
pub fn vmm_binary() -> Result<PathBuf, TestbedError> {
    let root = repo_root();
    let status = Command::new("cargo")
        .args(["build", "-q", "-p", "tine-vmm", "--bin", "tine-vmm"])
        .current_dir(&root)
        .status()
        .map_err(|source| TestbedError::Spawn {
            script: PathBuf::from("cargo"),
            source,
        })?;
    if !status.success() {
        return Err(TestbedError::Script {
            script: PathBuf::from("cargo build -p tine-vmm"),
            status,
        });
    }
    // Where cargo put it: `CARGO_TARGET_DIR` (relative to the checkout,
    // where the build ran) or the checkout's `target`.
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(|d| root.join(d))
        .unwrap_or_else(|| root.join("target"));
    let binary = target.join("debug/tine-vmm");
    if !binary.is_file() {
        return Err(TestbedError::MissingArtifact(binary));
    }
    Ok(binary)
}

/// Runs a repository script that prints a directory as its last stdout line.
fn run_script(relative: &str) -> Result<PathBuf, TestbedError> {
    let script = repo_root().join(relative);
    let output = Command::new(&script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|source| TestbedError::Spawn {
            script: script.clone(),
            source,
        })?;
    if !output.status.success() {
        return Err(TestbedError::Script {
            script,
            status: output.status,
        });
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let last = stdout.lines().last().unwrap_or_default().trim().to_string();
    Ok(PathBuf::from(last))
}

/// Path of the `tine-guest-util` helper next to the running test binary
/// (`target/<profile>/tine-guest-util`).
pub fn guest_util() -> Result<PathBuf, TestbedError> {
    let exe = std::env::current_exe().map_err(|source| TestbedError::Spawn {
        script: PathBuf::from("current_exe"),
        source,
    })?;
    let path = exe
        .parent()
        .and_then(Path::parent)
        .map(|dir| dir.join("tine-guest-util"))
        .unwrap_or_default();
    if path.is_file() {
        Ok(path)
    } else {
        Err(TestbedError::MissingArtifact(path))
    }
}

/// Builds `tine-guest-util` with cargo (fast when up to date).
fn build_guest_util() -> Result<(), TestbedError> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut command = Command::new(&cargo);
    command.current_dir(repo_root()).args([
        "build",
        "-q",
        "-p",
        "tine-testbed",
        "--bin",
        "tine-guest-util",
    ]);
    if !cfg!(debug_assertions) {
        command.arg("--release");
    }
    let status = command.status().map_err(|source| TestbedError::Spawn {
        script: PathBuf::from(&cargo),
        source,
    })?;
    if !status.success() {
        return Err(TestbedError::Script {
            script: PathBuf::from("cargo build -p tine-testbed --bin tine-guest-util"),
            status,
        });
    }
    Ok(())
}

/// Default limit for one test binary's run through the test bed.
pub const DEFAULT_TIMEOUT_SECS: u64 = 900;

/// The `main` of a `harness = false` test target whose tests need KVM for
/// Linux guests. Never returns.
pub fn run_tests(tests: Vec<Trial>) -> ! {
    if let Some(place) = placement() {
        let mut args = libtest_mimic::Arguments::from_args();
        // Nested, every guest shares L1's emulated CPU: several Linux
        // guests booting at once starve each other (boots stalled past
        // their deadlines, and L1 itself once died), so run one at a time.
        if place == Placement::Nested && args.test_threads.is_none() {
            args.test_threads = Some(1);
        }
        libtest_mimic::run(&args, tests).exit();
    }
    // The guest-side helper must exist before the test bed starts (the
    // nested bed sees the host's files read-only).
    if let Err(e) = build_guest_util() {
        eprintln!("testbed: {e}");
        std::process::exit(101);
    }
    // List-only invocations (cargo test -- --list) need no KVM.
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--list") {
        let parsed = libtest_mimic::Arguments::from_args();
        libtest_mimic::run(&parsed, tests).exit();
    }
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => {
            eprintln!("testbed: cannot find the running test binary: {e}");
            std::process::exit(101);
        }
    };
    let timeout = std::env::var("TINE_TESTBED_TIMEOUT")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(DEFAULT_TIMEOUT_SECS);
    let kvm_run = repo_root().join("scripts/kvm-run");
    let run = || {
        Command::new(&kvm_run)
            .arg("--timeout")
            .arg(timeout.to_string())
            .arg("--")
            .arg(&exe)
            .args(&args)
            .status()
    };
    // The nested bed (QEMU/TCG with emulated SVM) stops running now and then
    // whatever the command does: its heartbeat stops (the kernel may still
    // print soft-lockup warnings) and QEMU spins, or L1's kernel panics.
    // kvm-run notices either and exits KVM_RUN_L1_STOPPED; that says
    // nothing about the code under test, so such a run is repeated, up to
    // L1_STOPPED_ATTEMPTS in all.
    let mut attempt = 1;
    let mut status = run();
    while matches!(&status, Ok(s) if s.code() == Some(KVM_RUN_L1_STOPPED))
        && attempt < L1_STOPPED_ATTEMPTS
    {
        attempt += 1;
        eprintln!(
            "testbed: the bed's L1 stopped running (console above); running {} again \
             (attempt {attempt} of {L1_STOPPED_ATTEMPTS})",
            exe.display()
        );
        status = run();
    }
    // L2 guests in the nested bed also die now and then at random points
    // of their boot (a triple fault while the kernel unpacks its
    // initramfs, say), in tests that pass on every other run. A binary
    // whose tests failed runs once more, and the first failure stays in
    // the log above, marked; one that fails twice fails. A run past its
    // time limit is never repeated.
    if matches!(&status, Ok(s) if s.code() == Some(TESTS_FAILED)) {
        eprintln!(
            "testbed: FLAKE? {} failed in the bed (output above); running it once more",
            exe.display()
        );
        status = run();
        if matches!(&status, Ok(s) if s.success()) {
            eprintln!(
                "testbed: FLAKE: {} passed on its second run; its first run failed (above)",
                exe.display()
            );
        }
    }
    match status {
        Ok(status) => std::process::exit(status.code().unwrap_or(101)),
        Err(e) => {
            eprintln!("testbed: cannot run {}: {e}", kvm_run.display());
            std::process::exit(101);
        }
    }
}

/// kvm-run's exit status when L1 stopped running (no heartbeat, or its kernel panicked).
const KVM_RUN_L1_STOPPED: i32 = 123;

/// The exit status of a test binary whose tests failed (libtest's).
const TESTS_FAILED: i32 = 101;

/// How many times a test binary runs through the bed when L1 keeps stopping.
/// Three was not enough: a fresh-clone CI run saw L1 stop in three runs of
/// the fault suite in a row (124 s, 204 s and 114 s into each), which kills
/// tine-vmm processes mid-boot more often than any other suite.
const L1_STOPPED_ATTEMPTS: u32 = 5;

/// The last `n` lines of a text file (empty when it cannot be read).
pub fn tail_lines(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// What can say why a test stalled, for its failure message: the tail of
/// each file in `logs`, each VM folder's `vmm.log` and `serial.log` below
/// `vms_dir`, the processes and threads with their wait channels, and the
/// kernel log (the bed's L1 when nested).
pub fn stall_report(logs: &[PathBuf], vms_dir: &Path) -> String {
    let mut out = String::new();
    for log in logs {
        out.push_str(&format!(
            "--- {}:\n{}\n",
            log.display(),
            tail_lines(log, 40)
        ));
    }
    if let Ok(entries) = std::fs::read_dir(vms_dir) {
        for e in entries.flatten() {
            for file in ["vmm.log", "serial.log"] {
                out.push_str(&format!(
                    "--- {}/{file}:\n{}\n",
                    e.file_name().to_string_lossy(),
                    tail_lines(&e.path().join(file), 12)
                ));
            }
        }
    }
    for (what, cmd) in [
        (
            "processes",
            "ps -eLo pid,tid,stat,wchan:24,etime,time,comm | grep -v ' \\[' | grep -v kworker",
        ),
        ("kernel log", "dmesg | tail -30"),
    ] {
        let text = Command::new("sh")
            .args(["-c", cmd])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_else(|e| format!("cannot run `{cmd}`: {e}"));
        out.push_str(&format!("--- {what}:\n{text}\n"));
    }
    out
}
