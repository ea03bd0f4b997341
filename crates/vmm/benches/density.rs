//! Density: many hot forks of one snapshot running at once on this host,
//! each its own `tine-vmm` process. Prints figures, p50/p99 and ratios to
//! the targets; asserts nothing.
//!
//!   cargo bench -p tine-vmm --bench density
//!   TINE_DENSITY_FORKS=200 TINE_DENSITY_MIB=128 cargo bench -p tine-vmm --bench density
//!
//! The guest (`TINE_DENSITY_MIB` MiB, default 64) idles with its vCPU
//! halted, as an idle Linux guest does, so forks running do not take the
//! host's CPUs from the forks still to come. Two ways to fork it, each on
//! `TINE_DENSITY_FORKS` (default 1000) `tine-vmm --prestart` processes
//! (KVM VM, vCPU and guest RAM registered) started first, not timed:
//! - from pre-started processes: every one gets a restore request of the
//!   snapshot at once; "all running" is the time until the last answer
//!   (each answers once its vCPU was told to run). Then each process's
//!   `smaps_rollup` and `smaps` give its USS, PSS and the guest pages it
//!   copied; host memory used is `MemAvailable` of `/proc/meminfo` before
//!   the first process and with all of them running;
//! - from primed VMs, as the daemon's pool of a memory commit holds them:
//!   a second fleet restores the snapshot ahead with its vCPUs parked (not
//!   timed), then every one gets a resume at once; "all running" is the
//!   time until the last answer.
//!
//! Targets (issue 13): all running within 500 ms, at most 1 MiB USS each.
//!
//! Where fewer fit this host it stops at the largest number that does and
//! says why (a process that could not be spawned or pre-started, or host
//! memory down to what is kept for others). Every process it started is
//! killed at the end, on an error or panic as well (and by the kernel
//! should the bench itself be killed: parent-death signal).

mod common;

use common::{answer_ms, percentile, restore_request, vmm_binary, HALT_LOOP};

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tine_proto::smaps;
use tine_vmm::vmm::{BootConfig, ConsoleConfig, Privilege, Vmm};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

const TARGET_TOTAL_MS: f64 = 500.0;
const TARGET_USS_KIB: f64 = 1024.0;
/// Host memory left to everything else: pre-starting stops below it.
const KEEP_AVAILABLE_KIB: u64 = 2 << 20;
/// How long one process has to pre-start or answer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(300);

fn env_number(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            eprintln!("{name}={v} is not a number; using {default}");
            default
        }),
        Err(_) => default,
    }
}

fn p50_p99(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    (percentile(&v, 0.5), percentile(&v, 0.99))
}

fn mem_available_kib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Lets this process hold a descriptor or three per fork.
fn raise_fd_limit() -> u64 {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return 1024;
    }
    limit.rlim_cur = limit.rlim_max;
    // SAFETY: setrlimit reads the struct we own; raising the soft limit
    // to the hard one is always allowed.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
    limit.rlim_cur
}

/// One pre-started `tine-vmm`.
struct Fork {
    child: Child,
    control: BufReader<UnixStream>,
}

/// Every process started; all are killed and reaped when it drops.
#[derive(Default)]
struct Fleet {
    forks: Vec<Fork>,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for f in &mut self.forks {
            let _ = f.child.kill();
        }
        for f in &mut self.forks {
            let _ = f.child.wait();
        }
    }
}

/// Starts one `tine-vmm --prestart` and connects to it; `Err` says why not.
fn prestart(binary: &Path, socket: &Path, mib: u64) -> Result<Fork, String> {
    let mut command = Command::new(binary);
    command
        .args(["--prestart", "--vcpus", "1", "--mem-mib"])
        .arg(mib.to_string())
        .arg("--control-socket")
        .arg(socket)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: prctl is async-signal-safe and touches no memory of the
    // parent; between fork and exec it only sets the child's death signal.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = command.spawn().map_err(|e| format!("spawn: {e}"))?;
    let mut line = String::new();
    if let Some(stdout) = child.stdout.as_mut() {
        let _ = BufReader::new(stdout).read_line(&mut line);
    }
    if !line.contains("ready") {
        let _ = child.kill();
        let _ = child.wait();
        let mut stderr = String::new();
        if let Some(e) = child.stderr.as_mut() {
            let _ = e.read_to_string(&mut stderr);
        }
        return Err(format!("pre-start failed: {}", stderr.trim()));
    }
    match UnixStream::connect(socket) {
        Ok(stream) => {
            let _ = stream.set_read_timeout(Some(ANSWER_TIMEOUT));
            Ok(Fork {
                child,
                control: BufReader::new(stream),
            })
        }
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(format!("connect to the control socket: {e}"))
        }
    }
}

/// Sends `request` to every fork at once, then reads the answers as they
/// come (epoll: the bench's own work per answer stays constant with the
/// number of forks): (ms from the first send to each answer, ms inside
/// tine-vmm) per fork, and the wall time until the last answer.
fn all_at_once(fleet: &mut Fleet, request: &str) -> Result<(Vec<f64>, Vec<f64>, f64), String> {
    let epoll = Epoll::new().map_err(|e| format!("epoll: {e}"))?;
    for (i, f) in fleet.forks.iter().enumerate() {
        epoll
            .ctl(
                ControlOperation::Add,
                f.control.get_ref().as_raw_fd(),
                EpollEvent::new(EventSet::IN, i as u64),
            )
            .map_err(|e| format!("epoll add: {e}"))?;
    }
    let start = Instant::now();
    for (i, f) in fleet.forks.iter_mut().enumerate() {
        f.control
            .get_mut()
            .write_all(request.as_bytes())
            .map_err(|e| format!("send to fork {i}: {e}"))?;
    }
    let mut pending = fleet.forks.len();
    let mut client_ms = Vec::with_capacity(pending);
    let mut server_ms = Vec::with_capacity(pending);
    let deadline = start + ANSWER_TIMEOUT;
    let mut events = vec![EpollEvent::default(); 256];
    while pending > 0 {
        if Instant::now() > deadline {
            return Err(format!("{pending} forks did not answer in time"));
        }
        let ready = epoll
            .wait(1000, &mut events)
            .map_err(|e| format!("epoll wait: {e}"))?;
        let now = start.elapsed().as_secs_f64() * 1e3;
        for event in &events[..ready] {
            let i = event.data() as usize;
            let fork = &mut fleet.forks[i];
            epoll
                .ctl(
                    ControlOperation::Delete,
                    fork.control.get_ref().as_raw_fd(),
                    EpollEvent::default(),
                )
                .map_err(|e| format!("epoll delete: {e}"))?;
            let mut answer = String::new();
            fork.control
                .read_line(&mut answer)
                .map_err(|e| format!("answer of fork {i}: {e}"))?;
            if !answer.contains("\"ok\"") {
                return Err(format!("fork {i} answered {}", answer.trim()));
            }
            client_ms.push(now);
            server_ms.push(answer_ms(&answer));
            pending -= 1;
        }
    }
    Ok((client_ms, server_ms, start.elapsed().as_secs_f64() * 1e3))
}

/// Pre-starts up to `wanted` processes (fewer when this host runs out of
/// descriptors or memory: it says why), not timed against the target: a
/// pool's processes are started well before they are claimed.
fn prestart_fleet(binary: &Path, dir: &Path, wanted: usize, mib: u64) -> Fleet {
    let fd_limit = raise_fd_limit();
    let mut fleet = Fleet::default();
    let mut stopped_why = None;
    // Three descriptors per fork here (stdout, stderr, control socket).
    let fd_room = (fd_limit.saturating_sub(64) / 3) as usize;
    let mut prestart_ms = Vec::new();
    let prestart_start = Instant::now();
    for i in 0..wanted {
        if i >= fd_room {
            stopped_why = Some(format!(
                "this process may open {fd_limit} files, three per fork"
            ));
            break;
        }
        let available = mem_available_kib();
        if available < KEEP_AVAILABLE_KIB {
            stopped_why = Some(format!(
                "host memory: {} MiB available, {} MiB are kept for others",
                available >> 10,
                KEEP_AVAILABLE_KIB >> 10
            ));
            break;
        }
        let t = Instant::now();
        match prestart(binary, &dir.join(format!("ctl{i}.sock")), mib) {
            Ok(f) => fleet.forks.push(f),
            Err(why) => {
                stopped_why = Some(why);
                break;
            }
        }
        prestart_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let n = fleet.forks.len();
    if let Some(why) = &stopped_why {
        println!("  stopped at {n}: {why}");
    }
    if n > 0 {
        let (p50, p99) = p50_p99(prestart_ms);
        println!(
            "  pre-start (a warm pool, before any fork): {:.2} s for {n}, per process p50 {p50:.2} ms p99 {p99:.2} ms",
            prestart_start.elapsed().as_secs_f64()
        );
    }
    std::thread::sleep(Duration::from_millis(200));
    fleet
}

fn met(total_ms: f64) -> &'static str {
    if total_ms <= TARGET_TOTAL_MS {
        "met"
    } else {
        "not met"
    }
}

fn main() {
    let wanted = env_number("TINE_DENSITY_FORKS", 1000) as usize;
    let mib = env_number("TINE_DENSITY_MIB", 64);
    let binary = vmm_binary();
    let dir = tempfile::tempdir().expect("tmp");
    let state = dir.path().join("vm.state");
    let mem = dir.path().join("vm.mem");
    let mut config = BootConfig::raw_image(HALT_LOOP, 0x10_0000, mib);
    if let Some(raw) = config.raw.as_mut() {
        raw.privilege = Privilege::Kernel;
    }
    let mut parent = Vmm::boot(&config, &ConsoleConfig::default()).expect("boot synthetic guest");
    std::thread::sleep(Duration::from_millis(20));
    parent.pause().expect("pause");
    parent.snapshot(&state, &mem).expect("snapshot");
    parent.kill();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());

    let available_before = mem_available_kib();
    println!(
        "density: {wanted} hot forks of one {mib} MiB idle synthetic snapshot, one tine-vmm each \
         ({cores} cores, MemAvailable {} MiB at start)",
        available_before >> 10
    );
    println!("from pre-started processes (restore and run):");
    let mut fleet = prestart_fleet(&binary, dir.path(), wanted, mib);
    let n = fleet.forks.len();
    if n == 0 {
        return;
    }
    let (_, server_ms, restore_ms) =
        match all_at_once(&mut fleet, &restore_request(&state, &mem, false)) {
            Ok(r) => r,
            Err(why) => {
                println!("restore of {n} forks failed: {why}");
                return;
            }
        };
    let available_running = mem_available_kib();
    let (s50, s99) = p50_p99(server_ms);
    println!(
        "  all {n} running: {restore_ms:.1} ms (target <= {TARGET_TOTAL_MS} ms; ratio {:.2}: {}); \
         {:.3} ms each on {cores} cores; inside tine-vmm per fork p50 {s50:.3} ms p99 {s99:.3} ms",
        restore_ms / TARGET_TOTAL_MS,
        met(restore_ms),
        restore_ms / n as f64
    );

    std::thread::sleep(Duration::from_millis(200));
    let mut uss = Vec::with_capacity(n);
    let mut pss = Vec::with_capacity(n);
    let mut copied = Vec::with_capacity(n);
    for f in &fleet.forks {
        let pid = f.child.id();
        let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
            .map(|t| smaps::parse_rollup(&t))
            .unwrap_or_default();
        let maps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))
            .map(|t| smaps::parse_smaps(&t))
            .unwrap_or_default();
        uss.push(rollup.uss as f64 / 1024.0);
        pss.push(rollup.pss as f64 / 1024.0);
        copied.push(
            smaps::copied_guest_bytes(&maps, mib << 20).map_or(f64::NAN, |b| (b / 4096) as f64),
        );
    }
    let pss_sum: f64 = pss.iter().sum();
    let (u50, u99) = p50_p99(uss);
    let (p50, p99) = p50_p99(pss);
    let (k50, k99) = p50_p99(copied);
    println!(
        "  per fork: USS p50 {u50:.0} KiB p99 {u99:.0} KiB (target <= {TARGET_USS_KIB:.0} KiB; \
         ratio p50 {:.2}, p99 {:.2})",
        u50 / TARGET_USS_KIB,
        u99 / TARGET_USS_KIB
    );
    println!("            PSS p50 {p50:.0} KiB p99 {p99:.0} KiB; guest pages copied p50 {k50:.0} p99 {k99:.0}");
    let used = available_before.saturating_sub(available_running);
    println!(
        "  host memory used by the {n} forks: {:.1} MiB (MemAvailable down; {:.0} KiB per fork, \
         kernel's KVM state included); sum of their PSS {:.1} MiB",
        used as f64 / 1024.0,
        used as f64 / n as f64,
        pss_sum / 1024.0
    );
    drop(fleet);

    println!("from primed VMs (the snapshot restored ahead, vCPUs parked; resume):");
    let mut fleet = prestart_fleet(&binary, dir.path(), n, mib);
    let primed_n = fleet.forks.len();
    if primed_n == 0 {
        return;
    }
    if let Err(why) = all_at_once(&mut fleet, &restore_request(&state, &mem, true)) {
        println!("  priming {primed_n} VMs failed: {why}");
        return;
    }
    std::thread::sleep(Duration::from_millis(200));
    let (answered_ms, server_ms, resume_ms) = match all_at_once(&mut fleet, "{\"op\":\"resume\"}\n")
    {
        Ok(r) => r,
        Err(why) => {
            println!("  resume of {primed_n} forks failed: {why}");
            return;
        }
    };
    let (a50, a99) = p50_p99(answered_ms);
    let (s50, s99) = p50_p99(server_ms);
    println!(
        "  all {primed_n} running: {resume_ms:.1} ms (target <= {TARGET_TOTAL_MS} ms; ratio {:.2}: {}); \
         request to answer p50 {a50:.1} ms p99 {a99:.1} ms; inside tine-vmm per fork p50 {s50:.3} ms p99 {s99:.3} ms",
        resume_ms / TARGET_TOTAL_MS,
        met(resume_ms)
    );
    drop(fleet);
}
