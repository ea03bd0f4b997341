//! The `tine` command against a real `tine up` and a real VM, in the test
//! bed: what a script would do, with the exit codes it relies on.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use tine_testbed::{guest_kernel, min_image, placement, run_tests, vmm_binary, Failed, Trial};

const DATA: &str = "/tmp/tine-cli-e2e";

type R<T = ()> = Result<T, Failed>;

fn fail(m: impl Into<String>) -> Failed {
    Failed::from(m.into())
}

/// Longest any one command may take (a create or fork boots a VM).
const COMMAND_LIMIT: Duration = Duration::from_secs(300);

fn daemon_log() -> String {
    tine_testbed::tail_lines(Path::new("/tmp/tine-cli-e2e.log"), 30)
}

fn stall_report() -> String {
    tine_testbed::stall_report(
        &[PathBuf::from("/tmp/tine-cli-e2e.log")],
        &Path::new(DATA).join("vms"),
    )
}

fn tine(args: &[&str]) -> R<Output> {
    eprintln!("$ tine {}", args.join(" "));
    let mut child = Command::new(env!("CARGO_BIN_EXE_tine"))
        .args(args)
        .env("TINE_URL", format!("unix://{DATA}/tine.sock"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    // Read both pipes on threads so a chatty command cannot block.
    let mut out = child.stdout.take().ok_or_else(|| fail("stdout"))?;
    let mut err = child.stderr.take().ok_or_else(|| fail("stderr"))?;
    let out_t = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = std::io::Read::read_to_end(&mut out, &mut b);
        b
    });
    let err_t = std::thread::spawn(move || {
        let mut b = Vec::new();
        let _ = std::io::Read::read_to_end(&mut err, &mut b);
        b
    });
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if start.elapsed() > COMMAND_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            return Err(fail(format!(
                "tine {} did not finish in {COMMAND_LIMIT:?}; {}",
                args.join(" "),
                stall_report()
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Ok(Output {
        status,
        stdout: out_t.join().unwrap_or_default(),
        stderr: err_t.join().unwrap_or_default(),
    })
}

/// Runs and requires exit 0; returns stdout.
fn ok(args: &[&str]) -> R<String> {
    let out = tine(args)?;
    if !out.status.success() {
        return Err(fail(format!(
            "tine {} exited {:?}: {}\ndaemon log:\n{}",
            args.join(" "),
            out.status.code(),
            String::from_utf8_lossy(&out.stderr),
            daemon_log()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

struct Up(Child);

impl Drop for Up {
    fn drop(&mut self) {
        if let Ok(list) = ok(&["vm", "list", "--quiet"]) {
            for h in list.lines() {
                let _ = tine(&["vm", "delete", h]);
            }
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_daemon() -> R<Up> {
    let _ = std::fs::remove_dir_all(DATA);
    let log = std::fs::File::create("/tmp/tine-cli-e2e.log")?;
    let child = Command::new(env!("CARGO_BIN_EXE_tine"))
        .args(["up", "--data-dir", DATA])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()?;
    let up = Up(child);
    let start = Instant::now();
    while tine(&["info"])?.status.code() != Some(0) {
        if start.elapsed() > Duration::from_secs(60) {
            return Err(fail(format!(
                "daemon did not start: {}",
                std::fs::read_to_string("/tmp/tine-cli-e2e.log").unwrap_or_default()
            )));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(up)
}

fn cli_against_a_real_daemon() -> R {
    // Nothing listens yet: exit code 3, and a hint.
    let none = tine(&["vm", "list"])?;
    assert_eq!(none.status.code(), Some(3), "{none:?}");
    assert!(String::from_utf8_lossy(&none.stderr).contains("tine up"));

    let _up = start_daemon()?;
    ok(&[
        "secret",
        "create",
        "token",
        "--from-literal",
        "s3cret",
        "--permissions",
        "0440",
    ])?;
    let dup = tine(&["secret", "create", "token", "--from-literal", "x"])?;
    assert_eq!(dup.status.code(), Some(1), "{dup:?}");
    assert!(String::from_utf8_lossy(&dup.stderr).contains("already exists"));
    let listed = ok(&["secret", "list"])?;
    assert!(
        listed.contains("token") && listed.contains("0440"),
        "{listed}"
    );
    assert!(!listed.contains("s3cret"), "a value is never listed");
    let h = ok(&[
        "vm",
        "add",
        "--persistent",
        "--secret",
        "token",
        "--tag",
        "role=ci",
        "--timeout",
        "240s",
        "--quiet",
    ])?;
    let h = h.trim().to_owned();
    assert_eq!(h, "vm-1");
    assert_eq!(
        ok(&[
            "vm",
            "exec",
            &h,
            "--",
            "sh",
            "-c",
            "stat -c %a /run/tine/secrets/token; cat /run/tine/secrets/token"
        ])?,
        "440\ns3cret"
    );

    // The command's own exit code, its output on our stdout/stderr.
    let out = tine(&[
        "vm",
        "exec",
        &h,
        "--",
        "sh",
        "-c",
        "echo to-out; echo to-err >&2; exit 7",
    ])?;
    assert_eq!(out.status.code(), Some(7));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "to-out\n");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "to-err\n");
    // stdin is piped through.
    let mut child = Command::new(env!("CARGO_BIN_EXE_tine"))
        .args(["vm", "exec", &h, "--", "tr", "a-z", "A-Z"])
        .env("TINE_URL", format!("unix://{DATA}/tine.sock"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().ok_or_else(|| fail("stdin"))?;
        stdin.write_all(b"shout\n")?;
    }
    let out = child.wait_with_output()?;
    assert_eq!(String::from_utf8_lossy(&out.stdout), "SHOUT\n");

    // Files both ways.
    let local = PathBuf::from("/tmp/tine-cli-e2e-file");
    std::fs::write(&local, b"payload\n")?;
    ok(&[
        "vm",
        "cp",
        local.to_str().unwrap_or_default(),
        &format!("{h}:/root/payload"),
    ])?;
    let back = Path::new("/tmp/tine-cli-e2e-back");
    ok(&[
        "vm",
        "cp",
        &format!("{h}:/root/payload"),
        back.to_str().unwrap_or_default(),
    ])?;
    assert_eq!(std::fs::read(back)?, b"payload\n");
    // A tree, in tar mode (the daemon's answer must decode for it too).
    let tree = Path::new("/tmp/tine-cli-e2e-tree");
    std::fs::create_dir_all(tree.join("sub"))?;
    std::fs::write(tree.join("sub/leaf"), b"leaf\n")?;
    ok(&[
        "vm",
        "cp",
        "-r",
        tree.to_str().unwrap_or_default(),
        &format!("{h}:/root/tree"),
    ])?;
    assert_eq!(
        ok(&["vm", "exec", &h, "--", "cat", "/root/tree/sub/leaf"])?,
        "leaf\n"
    );

    // JSON for scripts.
    let list: serde_json::Value = serde_json::from_str(&ok(&["vm", "list", "--json"])?)?;
    assert_eq!(list[0]["hostname"], h.as_str());
    assert_eq!(list[0]["state"], "running");
    let d: serde_json::Value = serde_json::from_str(&ok(&["vm", "describe", &h, "--json"])?)?;
    assert_eq!(d["tags"][0], "role=ci");
    ok(&["vm", "tag", "add", &h, "env=test"])?;
    assert!(ok(&["vm", "tag", "list", &h])?.contains("env=test"));
    assert!(ok(&["vm", "health", &h])?.contains(&h));
    ok(&["vm", "ready", &h, "--timeout", "10s"])?;
    assert!(ok(&["vm", "logs", &h])?.contains("vsock port 52"));

    // Errors: a message naming the problem, exit 1, nothing changed.
    let bad = tine(&["vm", "describe", "vm-99"])?;
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("no VM called `vm-99`"));
    let big = tine(&["vm", "add", "--ram-mb", "999999", "--no-wait"])?;
    assert_eq!(big.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&big.stderr).contains("ram_bytes"));
    assert_eq!(ok(&["vm", "list", "--quiet"])?.lines().count(), 1);

    // A write is kept by a graceful shutdown, with no sync.
    ok(&[
        "vm",
        "exec",
        &h,
        "--",
        "sh",
        "-c",
        "echo round1 > /root/marker1",
    ])?;
    let stopped = ok(&["vm", "shutdown", &h])?;
    assert!(stopped.contains("graceful"), "{stopped}");
    ok(&["vm", "relaunch", &h, "--wait", "--timeout", "240s"])?;
    assert_eq!(
        ok(&["vm", "exec", &h, "--", "cat", "/root/marker1"])?,
        "round1\n"
    );

    // Stop, commit, fork, clean up.
    ok(&["vm", "shutdown", &h])?;
    let c = ok(&["vm", "commit", &h, "--cache-key", "cli-e2e", "--quiet"])?;
    let c = c.trim().to_owned();
    assert!(c.starts_with("cmt-vm-"), "{c}");
    assert_eq!(
        ok(&["vm", "commit", "list", "--cache-key", "cli-e2e", "--quiet"])?.trim(),
        c
    );
    let f = ok(&[
        "vm",
        "fork",
        &c,
        "--rm",
        "--no-secrets",
        "--timeout",
        "240s",
        "--quiet",
    ])?;
    let f = f.trim().to_owned();
    assert_eq!(
        ok(&["vm", "exec", &f, "--", "cat", "/root/payload"])?,
        "payload\n"
    );
    assert_eq!(
        ok(&[
            "vm",
            "exec",
            &f,
            "--",
            "sh",
            "-c",
            "ls -A /run/tine/secrets | wc -l"
        ])?
        .trim(),
        "0",
        "--no-secrets leaves the fork no secret"
    );
    let guard = tine(&["vm", "commit", "delete", &c])?;
    assert_eq!(guard.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&guard.stderr).contains(&f));
    ok(&["vm", "delete", &f, &h])?;
    ok(&["vm", "commit", "delete", &c])?;
    assert_eq!(ok(&["vm", "list", "--quiet"])?, "");
    ok(&["secret", "remove", "token"])?;
    assert_eq!(ok(&["secret", "list", "--quiet"])?, "");
    Ok(())
}

fn main() {
    let listing = std::env::args().any(|a| a == "--list");
    if placement().is_none() && !listing {
        match (vmm_binary(), guest_kernel(), min_image()) {
            (Ok(_), Ok(k), Ok(image)) => {
                // Before any thread: the bed inherits the environment.
                std::env::set_var("TINE_KERNEL", k.vmlinux);
                std::env::set_var("TINE_IMAGE_MIN", image);
            }
            (vmm, kernel, image) => {
                eprintln!(
                    "cli e2e: cannot build tine-vmm ({:?}), the kernel ({:?}) or the min image ({:?})",
                    vmm.err(),
                    kernel.err(),
                    image.err()
                );
                std::process::exit(101);
            }
        }
    }
    run_tests(vec![Trial::test(
        "cli_against_a_real_daemon",
        cli_against_a_real_daemon,
    )]);
}
