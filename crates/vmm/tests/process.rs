//! The `tine-vmm` binary and its control socket, with a synthetic guest.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tine_proto::vmm::{Event, StopReason};
use tine_vmm::device_manager::RestoreOverrides;
use tine_vmm::vmm::{BootConfig, ConsoleConfig, Vmm};

const COUNTER_LOOP: &[u8] = &[0x48, 0xff, 0x04, 0x25, 0x00, 0x00, 0x20, 0x00, 0xeb, 0xf6];

fn binary() -> &'static str {
    env!("CARGO_BIN_EXE_tine-vmm")
}

fn first_line(child: &mut Child) -> String {
    let mut line = String::new();
    let stdout = child.stdout.as_mut().expect("stdout");
    let _ = BufReader::new(stdout).read_line(&mut line);
    line
}

fn request(stream: &mut BufReader<UnixStream>, line: &str) -> serde_json::Value {
    stream
        .get_mut()
        .write_all(format!("{line}\n").as_bytes())
        .expect("send");
    let mut answer = String::new();
    stream.read_line(&mut answer).expect("answer");
    serde_json::from_str(&answer).expect("json answer")
}

/// Asserts `answer` is an error whose message says `because`.
fn assert_refused(answer: &serde_json::Value, because: &str) {
    assert_eq!(answer["status"], "error", "{answer}");
    assert!(
        answer["error"]
            .as_str()
            .is_some_and(|e| e.contains(because)),
        "{answer}"
    );
}

fn snapshot_files(dir: &std::path::Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let state = dir.join("vm.state");
    let mem = dir.join("vm.mem");
    let config = BootConfig::raw_image(COUNTER_LOOP, 0x10_0000, 32);
    let mut vmm = Vmm::boot(&config, &ConsoleConfig::default()).expect("boot");
    std::thread::sleep(Duration::from_millis(10));
    vmm.pause().expect("pause");
    vmm.snapshot(&state, &mem).expect("snapshot");
    vmm.kill();
    let _ = RestoreOverrides::default();
    (state, mem)
}

#[test]
fn test_process_control_socket_lifecycle() {
    let dir = tempfile::tempdir().expect("tmp");
    let (state, mem) = snapshot_files(dir.path());
    let socket = dir.path().join("ctl.sock");
    let mut child = Command::new(binary())
        .arg("--restore")
        .arg(&state)
        .arg("--mem-file")
        .arg(&mem)
        .arg("--control-socket")
        .arg(&socket)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn");
    let ready = Event::from_line(&first_line(&mut child)).expect("a ready event");
    assert_eq!(ready, Event::Ready { pid: child.id() });
    let mut stream = BufReader::new(UnixStream::connect(&socket).expect("connect"));

    let status = request(&mut stream, r#"{"op":"status"}"#);
    assert_eq!(status["state"], "running");
    let bad = request(&mut stream, "this is not json");
    assert_refused(&bad, "malformed");
    let early = request(
        &mut stream,
        &serde_json::json!({"op":"snapshot","state_path":dir.path().join("s2"),"mem_path":dir.path().join("m2")}).to_string(),
    );
    assert_eq!(
        early["status"], "error",
        "snapshot of a running VM must fail"
    );
    assert_eq!(request(&mut stream, r#"{"op":"pause"}"#)["state"], "paused");
    let snap = request(
        &mut stream,
        &serde_json::json!({"op":"snapshot","state_path":dir.path().join("s2"),"mem_path":dir.path().join("m2")}).to_string(),
    );
    assert_eq!(snap["status"], "ok", "{snap}");
    assert!(dir.path().join("s2").is_file() && dir.path().join("m2").is_file());
    assert_eq!(
        request(&mut stream, r#"{"op":"resume"}"#)["state"],
        "running"
    );
    let killed = request(&mut stream, r#"{"op":"kill"}"#);
    assert_eq!(killed["status"], "ok");
    let output = child.wait_with_output().expect("wait");
    assert!(output.status.success());
    let text = String::from_utf8_lossy(&output.stdout);
    let last = text.lines().last().unwrap_or_default();
    assert_eq!(
        Event::from_line(last).expect("a stopped event"),
        Event::Stopped {
            stop: StopReason::Killed
        },
        "stdout: {text}"
    );
    assert!(!socket.exists(), "control socket left behind");
}

/// How often the main thread of process `pid` has gone to sleep.
fn main_thread_sleeps(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("voluntary_ctxt_switches")
}

/// The main thread's sleep count once it has gone back to waiting: after
/// answering, the thread still has to return to its wait, and that sleep
/// belongs to the requests, not to the idle time measured after them.
fn settled_sleeps(pid: u32) -> u64 {
    let mut last = main_thread_sleeps(pid);
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(100));
        let now = main_thread_sleeps(pid);
        if now == last {
            return now;
        }
        last = now;
    }
    panic!("tine-vmm's main thread kept waking for 5 s after its last answer");
}

/// The control loop sleeps until a request comes: requests sent together
/// are each answered, a client that sends nothing does not hold up another
/// one, and an idle pre-started process does not wake.
#[test]
fn test_process_control_loop_serves_every_request_and_idles() {
    let dir = tempfile::tempdir().expect("tmp");
    let socket = dir.path().join("idle.sock");
    let mut child = Command::new(binary())
        .args(["--prestart", "--control-socket"])
        .arg(&socket)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn");
    assert!(first_line(&mut child).contains("\"ready\""));
    let _silent = UnixStream::connect(&socket).expect("connect a client that sends nothing");
    let mut stream = BufReader::new(UnixStream::connect(&socket).expect("connect"));
    stream
        .get_mut()
        .write_all(b"{\"op\":\"status\"}\n{\"op\":\"pause\"}\n{\"op\":\"resume\"}\n")
        .expect("send three requests at once");
    stream
        .get_ref()
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut answers = Vec::new();
    for _ in 0..3 {
        let mut answer = String::new();
        stream
            .read_line(&mut answer)
            .expect("each request answered");
        answers.push(serde_json::from_str::<serde_json::Value>(&answer).expect("json"));
    }
    for answer in &answers {
        assert_refused(answer, "no VM yet");
    }

    let before = settled_sleeps(child.id());
    std::thread::sleep(Duration::from_secs(2));
    let woke = main_thread_sleeps(child.id()) - before;
    assert_eq!(
        woke, 0,
        "an idle pre-started tine-vmm woke {woke} times in 2 s"
    );
    assert_eq!(request(&mut stream, r#"{"op":"kill"}"#)["status"], "ok");
    assert!(child.wait().expect("wait").success());
}

/// The process's vCPU and device threads (`vcpu<N>`, `devices`): id and
/// name, sorted by name.
fn vm_threads(pid: u32) -> Vec<(u32, String)> {
    let mut threads: Vec<(u32, String)> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("list the process's threads")
        .flatten()
        .filter_map(|task| {
            let tid = task.file_name().to_str()?.parse().ok()?;
            let name = std::fs::read_to_string(task.path().join("comm")).ok()?;
            let name = name.trim().to_owned();
            (name.starts_with("vcpu") || name == "devices").then_some((tid, name))
        })
        .collect();
    threads.sort_by(|a, b| a.1.cmp(&b.1));
    threads
}

/// The CPUs thread `tid` of process `pid` may run on, as the kernel lists
/// them (`Cpus_allowed_list`).
fn cpus_allowed(pid: u32, tid: u32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status"))
        .expect("read the thread's status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(|v| v.trim().to_owned())
        .expect("Cpus_allowed_list in the thread's status")
}

/// Waits until thread `tid` may run on `cpus` (it takes them back once it
/// runs); after 5 s, kills process `pid` (which would keep the test's
/// output open) and fails.
fn cpus_become(pid: u32, tid: u32, cpus: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let now = cpus_allowed(pid, tid);
        if now == cpus {
            return;
        }
        if std::time::Instant::now() >= deadline {
            // SAFETY: kill(2) on a process this test started; no memory is
            // involved.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            panic!("the vCPU thread may run on {now}, the process on {cpus}");
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Resident and mapped KiB of process `pid`'s mapping of the tine-vmm
/// binary's code (`/proc/<pid>/smaps`).
fn code_resident_kib(pid: u32) -> (u64, u64) {
    let exe = std::fs::canonicalize(binary()).expect("tine-vmm's path");
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).expect("read smaps");
    tine_proto::smaps::parse_smaps(&smaps)
        .iter()
        .find(|m| m.perms == "r-xp" && std::path::Path::new(&m.path) == exe)
        .map(|m| (m.memory.rss >> 10, m.size() >> 10))
        .unwrap_or_else(|| panic!("no code mapping of {} in process {pid}", exe.display()))
}

#[test]
fn test_process_prestart_then_restore() {
    let dir = tempfile::tempdir().expect("tmp");
    let (state, mem) = snapshot_files(dir.path());
    let socket = dir.path().join("warm.sock");
    let mut child = Command::new(binary())
        .args([
            "--prestart",
            "--vcpus",
            "1",
            "--mem-mib",
            "32",
            "--control-socket",
        ])
        .arg(&socket)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn");
    assert!(first_line(&mut child).contains("\"ready\""));
    // Its code was mapped ahead, whole, before any request.
    let (resident, mapped) = code_resident_kib(child.id());
    if resident != mapped {
        // Killed first: it would keep the test's output open.
        let _ = child.kill();
        panic!("{resident} KiB of tine-vmm's {mapped} KiB of code are resident");
    }
    let mut stream = BufReader::new(UnixStream::connect(&socket).expect("connect"));
    let early = request(&mut stream, r#"{"op":"pause"}"#);
    assert_eq!(early["status"], "error");
    // The VM's threads were started with the process: the restore hands
    // them their work and starts none.
    let prestarted = vm_threads(child.id());
    assert_eq!(
        prestarted
            .iter()
            .map(|(_, name)| name.as_str())
            .collect::<Vec<_>>(),
        ["devices", "vcpu0"],
        "{prestarted:?}"
    );
    let restored = request(
        &mut stream,
        &serde_json::json!({"op":"restore","state_path":state,"mem_path":mem}).to_string(),
    );
    assert_eq!(restored["state"], "running", "{restored}");
    assert_eq!(vm_threads(child.id()), prestarted);
    // The restore kept the vCPU thread off its own CPU while it woke it;
    // once running, the vCPU may run on every CPU the process may.
    let vcpu = prestarted[1].0;
    cpus_become(child.id(), vcpu, &cpus_allowed(child.id(), child.id()));
    // A resume that says where a moved vsock socket is now: refused for a
    // VM without a vsock device, which stays paused; a plain one runs it.
    assert_eq!(request(&mut stream, r#"{"op":"pause"}"#)["state"], "paused");
    let moved = request(
        &mut stream,
        r#"{"op":"resume","vsock_uds":"/nonexistent/vsock.sock"}"#,
    );
    assert_refused(&moved, "no vsock device");
    assert_eq!(
        request(&mut stream, r#"{"op":"status"}"#)["state"],
        "paused"
    );
    assert_eq!(
        request(&mut stream, r#"{"op":"resume"}"#)["state"],
        "running"
    );
    cpus_become(child.id(), vcpu, &cpus_allowed(child.id(), child.id()));
    assert_eq!(request(&mut stream, r#"{"op":"kill"}"#)["status"], "ok");
    assert!(child.wait().expect("wait").success());

    // Its RAM was reserved at the size asked for: another size is refused.
    let socket = dir.path().join("warm64.sock");
    let mut child = Command::new(binary())
        .args(["--prestart", "--mem-mib", "64", "--control-socket"])
        .arg(&socket)
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn");
    assert!(first_line(&mut child).contains("\"ready\""));
    let mut stream = BufReader::new(UnixStream::connect(&socket).expect("connect"));
    let refused = request(
        &mut stream,
        &serde_json::json!({"op":"restore","state_path":state,"mem_path":mem}).to_string(),
    );
    assert_refused(&refused, "reserved 64 MiB, the snapshot needs 32 MiB");
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn test_process_bad_input_fails_before_creating_a_vm() {
    let dir = tempfile::tempdir().expect("tmp");
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec!["--kernel".into(), "/nonexistent/vmlinux".into()],
            "cannot open kernel",
        ),
        (
            vec![
                "--kernel".into(),
                "/etc/hostname".into(),
                "--mem-mib".into(),
                "1".into(),
            ],
            "memory must be",
        ),
        (
            vec![
                "--kernel".into(),
                "/etc/hostname".into(),
                "--vcpus".into(),
                "0".into(),
            ],
            "vcpus must be",
        ),
        (
            vec!["--kernel".into(), "/etc/hostname".into()],
            "neither an x86_64 ELF nor a bzImage",
        ),
        (
            vec![
                "--kernel".into(),
                "/etc/hostname".into(),
                "--net".into(),
                "tap0".into(),
            ],
            "must be TAP,MAC",
        ),
        (
            vec![
                "--kernel".into(),
                "/etc/hostname".into(),
                "--drive".into(),
                dir.path().join("none.raw").display().to_string(),
            ],
            "does not exist",
        ),
        (vec!["--frobnicate".into()], "unexpected argument"),
        (
            vec![
                "--restore".into(),
                "/etc/passwd".into(),
                "--mem-file".into(),
                "/etc/passwd".into(),
            ],
            "not a tine-vmm state file",
        ),
        (
            vec![
                "--restore".into(),
                "/etc/hostname".into(),
                "--mem-file".into(),
                "/etc/hostname".into(),
            ],
            "truncated",
        ),
    ];
    for (args, expected) in cases {
        let output = Command::new(binary()).args(&args).output().expect("run");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(expected), "{args:?}: stderr was {stderr}");
    }
}

/// Writes `PAGES` distinct pages from 0x300000 on (one word each), bumps
/// the counter at 0x200000, and starts over, forever:
/// `start: mov edi, 0x300000; mov ecx, PAGES; fill: mov [rdi], rcx;
/// add rdi, 0x1000; dec ecx; jnz fill; inc qword [0x200000]; jmp start`.
const PAGES: u32 = 1000;
const PAGE_WRITER: &[u8] = &[
    0xbf, 0x00, 0x00, 0x30, 0x00, // mov edi, 0x300000
    0xb9, 0xe8, 0x03, 0x00, 0x00, // mov ecx, 1000
    0x48, 0x89, 0x0f, // mov [rdi], rcx
    0x48, 0x81, 0xc7, 0x00, 0x10, 0x00, 0x00, // add rdi, 0x1000
    0xff, 0xc9, // dec ecx
    0x75, 0xf2, // jnz fill
    0x48, 0xff, 0x04, 0x25, 0x00, 0x00, 0x20, 0x00, // inc qword [0x200000]
    0xeb, 0xde, // jmp start
];

/// The daemon's figure of copied guest pages, read from a real restored
/// `tine-vmm` process: the guest's pages are in the memory file (written
/// before the snapshot), each of its writes after the restore copies one
/// into the process, and nothing else of its 64 MiB is copied.
#[test]
fn test_process_restored_guest_copies_only_the_pages_it_writes() {
    const MIB: u64 = 64;
    let dir = tempfile::tempdir().expect("tmp");
    let state = dir.path().join("vm.state");
    let mem = dir.path().join("vm.mem");
    assert_eq!(u32::from_le_bytes([0xe8, 0x03, 0, 0]), PAGES);
    let config = BootConfig::raw_image(PAGE_WRITER, 0x10_0000, MIB);
    let mut vmm = Vmm::boot(&config, &ConsoleConfig::default()).expect("boot");
    std::thread::sleep(Duration::from_millis(20));
    vmm.pause().expect("pause");
    vmm.snapshot(&state, &mem).expect("snapshot");
    vmm.kill();

    // A cold restore (its own mapping) and a warm one (the memory file
    // mapped over RAM registered at pre-start), as the daemon's forks are.
    for warm in [false, true] {
        let mut command = Command::new(binary());
        let socket = dir.path().join("copies.sock");
        if warm {
            command
                .args(["--prestart", "--mem-mib", &MIB.to_string()])
                .arg("--control-socket")
                .arg(&socket);
        } else {
            command
                .arg("--restore")
                .arg(&state)
                .arg("--mem-file")
                .arg(&mem);
        }
        let mut child = command.stdout(Stdio::piped()).spawn().expect("spawn");
        let line = first_line(&mut child);
        assert!(line.contains("ready"), "{line}");
        if warm {
            let mut stream = BufReader::new(UnixStream::connect(&socket).expect("connect"));
            let restored = request(
                &mut stream,
                &serde_json::json!({"op":"restore","state_path":state,"mem_path":mem}).to_string(),
            );
            assert_eq!(restored["state"], "running", "{restored}");
        }
        let memory = copies_after_a_while(&mut child, MIB << 20);
        let copied = memory.copied_bytes.expect("a restored VM has copied pages") / 4096;
        let all = (MIB << 20) / 4096;
        assert!(
            copied >= u64::from(PAGES),
            "warm {warm}: {copied} pages copied, the guest wrote {PAGES}"
        );
        // Its counter page and a few the CPU writes (page-table bits): far
        // fewer than all of RAM.
        assert!(
            copied < u64::from(PAGES) + 64 && copied < all / 8,
            "warm {warm}: {copied} of {all} pages copied, the guest wrote {PAGES}"
        );
        assert!(
            memory.process.uss >= copied * 4096,
            "warm {warm}: the copies are the process's own: {memory:?}"
        );
    }
}

/// The daemon's reading of a restored `tine-vmm` of a guest of
/// `ram_bytes`, once its guest has had time to go through its pages; the
/// process is killed.
fn copies_after_a_while(child: &mut Child, ram_bytes: u64) -> tine_daemon::host_stats::VmMemory {
    let pid = child.id();
    let start = tine_daemon::process::start_time(pid).expect("start time");
    // The guest goes through its pages in microseconds once its vCPU runs;
    // on a loaded host that may take a while, so wait (bounded) until it
    // has copied the pages it writes, then a little more for any others.
    let read = || tine_daemon::host_stats::vm_memory(pid, start, ram_bytes);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < deadline
        && read().and_then(|m| m.copied_bytes).unwrap_or(0) / 4096 < u64::from(PAGES)
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200));
    let memory = read();
    child.kill().expect("kill the restored tine-vmm");
    child.wait().expect("reap it");
    memory.expect("the process's smaps")
}
