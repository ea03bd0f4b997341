//! Shared by the daemon's test-bed tests and benches: a daemon process per
//! test (this binary re-executed as `tine up`), a client, shell helpers,
//! and the host-side build of what the bed needs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tine_client::api::{ExecOptions, TineClient};
use tine_proto::api::{CreateVmRequest, ErrorCode, ListQuery};
use tine_testbed::{guest_kernel, min_image, repo_root, vmm_binary, Failed};

/// Set in a re-executed copy of this binary: run the daemon with the
/// config file this names.
pub const DAEMON_CONFIG_ENV: &str = "TINE_TEST_DAEMON_CONFIG";
/// The min image's directory, from the host into the bed.
pub const IMAGE_ENV: &str = "TINE_IMAGE_MIN";
/// Generous: a nested boot takes 10-60 s under load.
pub const BOOT: Duration = Duration::from_secs(240);

pub type R<T = ()> = Result<T, Failed>;

pub fn fail(msg: impl Into<String>) -> Failed {
    Failed::from(msg.into())
}

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// One daemon process on its own data directory.
pub struct Daemon {
    /// Scratch folder.
    pub dir: PathBuf,
    config: PathBuf,
    child: Option<Child>,
    /// Client on the daemon's socket.
    pub client: TineClient,
    /// Set when the test is done: the stall watchdog then stays quiet.
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// How long one test may run before the watchdog prints what every part
/// is doing (the test goes on; the bed's own limit ends it).
const STALL_REPORT_AFTER: Duration = Duration::from_secs(900);

/// Prints the bed's stall report once if the test is not done after
/// [`STALL_REPORT_AFTER`].
fn watch_for_stalls(dir: PathBuf, done: std::sync::Arc<std::sync::atomic::AtomicBool>) {
    std::thread::spawn(move || {
        let start = Instant::now();
        while start.elapsed() < STALL_REPORT_AFTER {
            if done.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            std::thread::sleep(Duration::from_secs(1));
        }
        if !done.load(std::sync::atomic::Ordering::SeqCst) {
            println!(
                "stall watchdog: the test still runs after {STALL_REPORT_AFTER:?}\n{}",
                tine_testbed::stall_report(&[dir.join("daemon.log")], &dir.join("data/vms"))
            );
        }
    });
}

impl Daemon {
    /// Writes a config with one group `t` and starts the daemon.
    pub fn start(name: &str, extra_group: &str, api_bind: Option<&str>) -> R<Self> {
        let dir = PathBuf::from(format!("/tmp/td-{name}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let vmm = repo_root().join("target/debug/tine-vmm");
        let vmm = std::env::var("TINE_TEST_VMM")
            .map(PathBuf::from)
            .unwrap_or(vmm);
        let mut yaml = format!(
            "data_dir: {}\nvmm: {}\nhost_groups:\n  - name: t\n    cpus: 1\n    max_cpus: 2\n    ram_mb: 256\n    max_ram_mb: 512\n    persistent: true\n{extra_group}",
            dir.join("data").display(),
            vmm.display()
        );
        if let Some(b) = api_bind {
            yaml.push_str(&format!("api:\n  bind: {b}\n"));
        }
        let config = dir.join("tine.yaml");
        std::fs::write(&config, yaml)?;
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        watch_for_stalls(dir.clone(), done.clone());
        let mut d = Daemon {
            client: TineClient::unix(dir.join("data/tine.sock")),
            dir,
            config,
            child: None,
            done,
        };
        d.spawn()?;
        Ok(d)
    }

    pub fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    pub fn spawn_raw(&self) -> R<Child> {
        self.spawn_raw_with(None)
    }

    /// Starts the daemon process with `TINE_FAILPOINT` set to `failpoint`
    /// (none: unset).
    fn spawn_raw_with(&self, failpoint: Option<&str>) -> R<Child> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("daemon.log"))?;
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.env(DAEMON_CONFIG_ENV, &self.config)
            .env_remove(tine_daemon::failpoint::ENV)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        if let Some(point) = failpoint {
            cmd.env(tine_daemon::failpoint::ENV, point);
        }
        Ok(cmd.spawn()?)
    }

    /// Starts the daemon process and waits for its socket to answer.
    pub fn spawn(&mut self) -> R {
        self.spawn_with(None)
    }

    /// Starts the daemon armed to crash (SIGKILL) at `point`.
    pub fn spawn_armed(&mut self, point: tine_daemon::failpoint::Failpoint) -> R {
        self.spawn_with(Some(point.name()))
    }

    /// Waits for the daemon process to end by itself (a crash point), up
    /// to `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> R<std::process::ExitStatus> {
        let Some(child) = self.child.as_mut() else {
            return Err(fail("no daemon process"));
        };
        let start = Instant::now();
        loop {
            if let Some(status) = child.try_wait()? {
                self.child = None;
                return Ok(status);
            }
            if start.elapsed() > limit {
                return Err(fail(format!(
                    "the daemon still runs after {limit:?}: {}",
                    self.log_tail()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn spawn_with(&mut self, failpoint: Option<&str>) -> R {
        let _ = std::fs::remove_file(self.data().join("tine.sock"));
        let mut child = self.spawn_raw_with(failpoint)?;
        let start = Instant::now();
        loop {
            if let Some(status) = child.try_wait()? {
                return Err(fail(format!(
                    "daemon exited with {status}: {}",
                    self.log_tail()
                )));
            }
            if rt().block_on(self.client.healthz()).is_ok() {
                break;
            }
            if start.elapsed() > Duration::from_secs(60) {
                return Err(fail(format!("daemon did not answer: {}", self.log_tail())));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.child = Some(child);
        Ok(())
    }

    /// The lines of the daemon's log that contain `needle`.
    pub fn log_lines(&self, needle: &str) -> Vec<String> {
        std::fs::read_to_string(self.dir.join("daemon.log"))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(needle))
            .map(str::to_owned)
            .collect()
    }

    pub fn log_tail(&self) -> String {
        tine_testbed::tail_lines(&self.dir.join("daemon.log"), 15)
    }

    pub fn kill9(&mut self) -> R {
        if let Some(mut c) = self.child.take() {
            c.kill()?;
            c.wait()?;
        }
        Ok(())
    }

    pub fn vmm_pid(&self, hostname: &str) -> R<u32> {
        let info = rt()
            .block_on(self.client.describe(hostname))
            .map_err(|e| fail(e.to_string()))?;
        info.pid
            .ok_or_else(|| fail(format!("{hostname} has no pid")))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.done.store(true, std::sync::atomic::Ordering::SeqCst);
        // Stop every VM this daemon started, then the daemon.
        if self.child.is_some() {
            let r = rt();
            if let Ok(vms) = r.block_on(self.client.list_vms(None, &ListQuery::default())) {
                for vm in vms {
                    let _ = r.block_on(self.client.delete(&vm.hostname));
                }
            }
        }
        let _ = self.kill9();
        for (pid, _) in tine_daemon::process::find_processes(&self.data()) {
            let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
        }
        // The next test's daemon needs the room: in the bed /tmp is a tmpfs
        // in L1's memory, and each data directory holds an image copy.
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            eprintln!("cannot remove {}: {e}", self.dir.display());
        }
    }
}

pub async fn pid_of(c: &TineClient, hostname: &str) -> R<u32> {
    let info = c
        .describe(hostname)
        .await
        .map_err(|e| fail(e.to_string()))?;
    info.pid
        .ok_or_else(|| fail(format!("{hostname} has no pid")))
}

pub fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z")
}

pub async fn sh(c: &TineClient, vm: &str, script: &str) -> R<(i32, String, String)> {
    let mut o = ExecOptions::new(script, Vec::<String>::new());
    o.shell = Some(true);
    let out = c
        .exec_output(vm, &o)
        .await
        .map_err(|e| fail(format!("exec on {vm}: {e}")))?;
    Ok((
        out.code.unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

pub async fn sh_ok(c: &TineClient, vm: &str, script: &str) -> R<String> {
    let (code, out, err) = sh(c, vm, script).await?;
    if code != 0 {
        return Err(fail(format!("`{script}` on {vm} exited {code}: {err}")));
    }
    Ok(out)
}

pub fn code_of(e: &tine_client::api::ApiError) -> Option<ErrorCode> {
    e.code()
}

pub fn expect_err<T: std::fmt::Debug>(
    r: Result<T, tine_client::api::ApiError>,
    code: ErrorCode,
    needle: &str,
) -> R {
    match r {
        Ok(v) => Err(fail(format!("expected {code:?} ({needle}), got {v:?}"))),
        Err(e) if code_of(&e) == Some(code) && e.to_string().contains(needle) => Ok(()),
        Err(e) => Err(fail(format!(
            "expected {code:?} containing {needle:?}, got {e}"
        ))),
    }
}

pub fn create_req(persistent: bool) -> CreateVmRequest {
    CreateVmRequest {
        persistent: Some(persistent),
        ..CreateVmRequest::default()
    }
}

pub fn build_artifacts() -> Result<(), String> {
    let vmm = vmm_binary().map_err(|e| e.to_string())?;
    let kernel = guest_kernel().map_err(|e| e.to_string())?;
    let image = min_image().map_err(|e| e.to_string())?;
    // Before any thread: the bed inherits the environment.
    std::env::set_var(IMAGE_ENV, image);
    std::env::set_var("TINE_KERNEL", kernel.vmlinux);
    std::env::set_var("TINE_TEST_VMM", vmm);
    if std::env::var_os("TINE_TESTBED_TIMEOUT").is_none() {
        std::env::set_var("TINE_TESTBED_TIMEOUT", "1200");
    }
    Ok(())
}

/// Call first in `main`: in a re-executed copy, runs the daemon and exits.
pub fn run_daemon_if_asked() {
    if let Some(config) = std::env::var_os(DAEMON_CONFIG_ENV) {
        if let Err(e) = tine_daemon::run_from_cli(Some(config.into()), None) {
            eprintln!("tine: {e:#}");
            std::process::exit(1);
        }
        std::process::exit(0);
    }
}

/// Turns a client error into a test failure that names it.
pub trait OrFail<T> {
    fn or_fail(self) -> R<T>;
}

impl<T> OrFail<T> for Result<T, tine_client::api::ApiError> {
    fn or_fail(self) -> R<T> {
        self.map_err(|e| fail(e.to_string()))
    }
}

/// Runs a host tool and returns its stdout; a missing tool or a non-zero
/// exit fails, naming the tool (`what` says which package has it).
pub fn run_tool(cmd: &mut Command, what: &str) -> R<String> {
    let out = cmd.output().map_err(|e| {
        fail(format!(
            "cannot run {what}: {e} (scripts/setup installs it)"
        ))
    })?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        return Err(fail(format!(
            "{cmd:?} exited with {}: {stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(stdout)
}

/// `qemu-img check`: no corruption (leaked clusters, which a crash may
/// leave and which harm nothing, are allowed and printed).
pub fn qemu_img_check(disk: &Path) -> R {
    let out = Command::new("qemu-img")
        .arg("check")
        .arg(disk)
        .output()
        .map_err(|e| fail(format!("cannot run qemu-img (qemu-utils): {e}")))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // 0: clean; 3: leaked clusters only.
    match out.status.code() {
        Some(0) => Ok(()),
        Some(3) if !text.contains("ERROR") => {
            println!(
                "qemu-img check {}: leaks only: {}",
                disk.display(),
                text.trim()
            );
            Ok(())
        }
        _ => Err(fail(format!(
            "qemu-img check {} failed ({}): {text}",
            disk.display(),
            out.status
        ))),
    }
}

/// The `main` of a test-bed target: runs the daemon in a re-executed copy,
/// builds what the bed needs on the host, then runs `tests` in the bed.
pub fn bed_main(what: &str, tests: Vec<tine_testbed::Trial>) -> ! {
    run_daemon_if_asked();
    let listing = std::env::args().any(|a| a == "--list");
    if tine_testbed::placement().is_none() && !listing {
        if let Err(e) = build_artifacts() {
            eprintln!("{what}: {e}");
            std::process::exit(101);
        }
    }
    tine_testbed::run_tests(tests)
}
