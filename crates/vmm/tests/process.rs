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
    assert_eq!(bad["status"], "error");
    assert!(bad["error"]
        .as_str()
        .unwrap_or_default()
        .contains("malformed"));
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
    let mut stream = BufReader::new(UnixStream::connect(&socket).expect("connect"));
    let early = request(&mut stream, r#"{"op":"pause"}"#);
    assert_eq!(early["status"], "error");
    let restored = request(
        &mut stream,
        &serde_json::json!({"op":"restore","state_path":state,"mem_path":mem}).to_string(),
    );
    assert_eq!(restored["state"], "running", "{restored}");
    assert_eq!(request(&mut stream, r#"{"op":"kill"}"#)["status"], "ok");
    assert!(child.wait().expect("wait").success());
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
