//! Density: many hot forks of one snapshot running at once on this host,
//! each its own `tine-vmm` process. Prints figures, p50/p99 and ratios to
//! the targets; asserts nothing.
//!
//!   cargo bench -p tine-vmm --bench density
//!   TINE_DENSITY_FORKS=200 TINE_DENSITY_MIB=128 cargo bench -p tine-vmm --bench density
//!
//! As a warm pool does, it first pre-starts `TINE_DENSITY_FORKS` (default
//! 1000) `tine-vmm --prestart` processes (KVM VM, vCPU and guest RAM
//! registered), not timed against the target. Then every one gets a
//! restore request of the same snapshot (a synthetic guest of
//! `TINE_DENSITY_MIB` MiB, default 64, that increments a counter) at once,
//! restoring with its vCPU parked, and then a resume at once; "all running"
//! is the time until the last restore answered plus the time until the
//! last resume answered (each answers once its vCPU was told to run). Then
//! it pauses them all (a ring-3 synthetic guest cannot halt, so a running
//! one spins its vCPU; paused or not, its memory is the same) and reads
//! each process's `smaps_rollup` and `smaps`: USS, PSS and the guest pages
//! it copied. Host memory used is `MemAvailable` of `/proc/meminfo` before
//! the first process and with all of them running.
//!
//! Targets (issue 13): all running within 500 ms, at most 1 MiB USS each.
//!
//! Where fewer fit this host it stops at the largest number that does and
//! says why (a process that could not be spawned or pre-started, or host
//! memory down to what is kept for others). Every process it started is
//! killed at the end, on an error or panic as well (and by the kernel
//! should the bench itself be killed: parent-death signal).

mod common;

use common::{percentile, vmm_binary, COUNTER_LOOP};

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tine_proto::smaps;
use tine_vmm::vmm::{BootConfig, ConsoleConfig, Vmm};

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
/// come: (seconds from the first send to each answer, microseconds inside
/// tine-vmm) per fork, and the wall time until the last answer.
fn all_at_once(fleet: &mut Fleet, request: &str) -> Result<(Vec<f64>, Vec<f64>, f64), String> {
    let start = Instant::now();
    for (i, f) in fleet.forks.iter_mut().enumerate() {
        f.control
            .get_mut()
            .write_all(request.as_bytes())
            .map_err(|e| format!("send to fork {i}: {e}"))?;
    }
    let mut pending: Vec<usize> = (0..fleet.forks.len()).collect();
    let mut client_ms = Vec::with_capacity(pending.len());
    let mut server_ms = Vec::with_capacity(pending.len());
    let deadline = start + ANSWER_TIMEOUT;
    while !pending.is_empty() {
        if Instant::now() > deadline {
            return Err(format!("{} forks did not answer in time", pending.len()));
        }
        let mut fds: Vec<libc::pollfd> = pending
            .iter()
            .map(|&i| libc::pollfd {
                fd: fleet.forks[i].control.get_ref().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        // SAFETY: `fds` is a valid array of pollfd of that length.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 1000) };
        if n < 0 {
            return Err(format!("poll: {}", std::io::Error::last_os_error()));
        }
        let now = start.elapsed().as_secs_f64() * 1e3;
        let mut still = Vec::with_capacity(pending.len());
        for (pfd, &i) in fds.iter().zip(&pending) {
            if pfd.revents == 0 {
                still.push(i);
                continue;
            }
            let mut answer = String::new();
            fleet.forks[i]
                .control
                .read_line(&mut answer)
                .map_err(|e| format!("answer of fork {i}: {e}"))?;
            if !answer.contains("\"ok\"") {
                return Err(format!("fork {i} answered {}", answer.trim()));
            }
            let us = serde_json::from_str::<serde_json::Value>(&answer)
                .ok()
                .and_then(|v| v.get("duration_us")?.as_f64())
                .unwrap_or(f64::NAN);
            client_ms.push(now);
            server_ms.push(us / 1e3);
        }
        pending = still;
    }
    Ok((client_ms, server_ms, start.elapsed().as_secs_f64() * 1e3))
}

fn main() {
    let wanted = env_number("TINE_DENSITY_FORKS", 1000) as usize;
    let mib = env_number("TINE_DENSITY_MIB", 64);
    let fd_limit = raise_fd_limit();
    let binary = vmm_binary();
    let dir = tempfile::tempdir().expect("tmp");
    let state = dir.path().join("vm.state");
    let mem = dir.path().join("vm.mem");
    let mut parent = Vmm::boot(
        &BootConfig::raw_image(COUNTER_LOOP, 0x10_0000, mib),
        &ConsoleConfig::default(),
    )
    .expect("boot synthetic guest");
    std::thread::sleep(Duration::from_millis(20));
    parent.pause().expect("pause");
    parent.snapshot(&state, &mem).expect("snapshot");
    parent.kill();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());

    let mut fleet = Fleet::default();
    let available_before = mem_available_kib();
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
        match prestart(&binary, &dir.path().join(format!("ctl{i}.sock")), mib) {
            Ok(f) => fleet.forks.push(f),
            Err(why) => {
                stopped_why = Some(why);
                break;
            }
        }
        prestart_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let prestart_total = prestart_start.elapsed().as_secs_f64();
    let n = fleet.forks.len();
    println!(
        "density: {n} hot forks of one {mib} MiB synthetic snapshot, one tine-vmm each \
         (asked for {wanted}; {cores} cores, MemAvailable {} MiB at start)",
        available_before >> 10
    );
    if let Some(why) = &stopped_why {
        println!("  stopped at {n}: {why}");
    }
    if n == 0 {
        return;
    }
    let (p50, p99) = p50_p99(prestart_ms);
    println!(
        "pre-start (a warm pool, before any fork): {prestart_total:.2} s for {n}, \
         per process p50 {p50:.2} ms p99 {p99:.2} ms"
    );
    // A pool's processes are started well before they are claimed.
    std::thread::sleep(Duration::from_millis(200));

    // Restored parked first, then all resumed: a synthetic guest spins its
    // vCPU (ring 3 cannot halt), so once running the forks restored first
    // take the cores from the restores still to do; the two steps show the
    // VMM's own restore work apart from that contention.
    let restore = serde_json::json!({
        "op": "restore", "state_path": state, "mem_path": mem, "paused": true
    })
    .to_string()
        + "\n";
    let (_, server_ms, restore_ms) = match all_at_once(&mut fleet, &restore) {
        Ok(r) => r,
        Err(why) => {
            println!("restore of {n} forks failed: {why}");
            return;
        }
    };
    let (resumed_ms, _, resume_ms) = match all_at_once(&mut fleet, "{\"op\":\"resume\"}\n") {
        Ok(r) => r,
        Err(why) => {
            println!("resume of {n} forks failed: {why}");
            return;
        }
    };
    let available_running = mem_available_kib();
    let total_ms = restore_ms + resume_ms;
    let (s50, s99) = p50_p99(server_ms);
    let (r50, r99) = p50_p99(resumed_ms);
    println!(
        "all {n} running: {total_ms:.1} ms (target <= {TARGET_TOTAL_MS} ms; ratio {:.2})",
        total_ms / TARGET_TOTAL_MS
    );
    println!(
        "  restored, vCPUs parked: {restore_ms:.1} ms for all ({:.3} ms each on {cores} cores); \
         inside tine-vmm per fork p50 {s50:.3} ms p99 {s99:.3} ms",
        restore_ms / n as f64
    );
    println!(
        "  then all resumed:       {resume_ms:.1} ms; request to answer p50 {r50:.3} ms p99 {r99:.3} ms \
         (spinning guests compete with the resumes still to do)"
    );

    std::thread::sleep(Duration::from_millis(200));
    let pause = "{\"op\":\"pause\"}\n";
    if let Err(why) = all_at_once(&mut fleet, pause) {
        println!("pause failed: {why}");
    }
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
        "per fork: USS p50 {u50:.0} KiB p99 {u99:.0} KiB (target <= {TARGET_USS_KIB:.0} KiB; \
         ratio p50 {:.2}, p99 {:.2})",
        u50 / TARGET_USS_KIB,
        u99 / TARGET_USS_KIB
    );
    println!("          PSS p50 {p50:.0} KiB p99 {p99:.0} KiB; guest pages copied p50 {k50:.0} p99 {k99:.0}");
    let used = available_before.saturating_sub(available_running);
    println!(
        "host memory used by the {n} forks: {:.1} MiB (MemAvailable down; {:.0} KiB per fork, \
         kernel's KVM state included); sum of their PSS {:.1} MiB",
        used as f64 / 1024.0,
        used as f64 / n as f64,
        pss_sum / 1024.0
    );
    drop(fleet);
}
