//! Linux guests on tine-vmm, run through the test bed (directly where the
//! host's KVM runs Linux, nested otherwise).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tine_proto::vmm::{RunState, StopReason};
use tine_testbed::cpio::{busybox_initramfs, host_binary_entries};
use tine_testbed::{guest_kernel, guest_util, run_tests, Failed, Trial};
use tine_vmm::device_manager::{DeviceConfigs, DriveConfig, RestoreOverrides, VsockConfig};
use tine_vmm::vmm::{BootConfig, ConsoleConfig, Vmm, DEFAULT_CMDLINE};

const TICKER_INIT: &str = r#"#!/bin/sh
/bin/busybox mount -t proc proc /proc
echo "tine-test: init reached"
i=0
while [ $i -lt 100000 ]; do
  /bin/busybox dmesg | /bin/busybox grep -q 'crng reseeded due to virtual machine fork' \
    && echo "tine-test: kernel log has the VM fork reseed"
  echo "tick $i"
  i=$((i + 1))
  /bin/busybox sleep 0.3
done
"#;

/// Ticks like `TICKER_INIT`, each tick followed by the guest's uptime,
/// while a second loop keeps RCU busy (each process that exits frees its
/// task through RCU), so that a grace period is nearly always under way
/// when the VM is paused.
const CHURN_INIT: &str = r#"#!/bin/sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mkdir -p /dev
/bin/busybox mount -t devtmpfs devtmpfs /dev
echo "tine-test: init reached"
( while :; do /bin/busybox true; done ) &
i=0
while [ $i -lt 100000 ]; do
  echo "tick $i"
  echo "up $(/bin/busybox cut -d' ' -f1 /proc/uptime)"
  i=$((i + 1))
  /bin/busybox sleep 0.3
done
"#;

const REBOOT_INIT: &str = r#"#!/bin/sh
/bin/busybox mount -t proc proc /proc
echo "tine-test: init reached, boottime $(/bin/busybox cut -d' ' -f1 /proc/uptime)"
/bin/busybox reboot -f
"#;

/// A scratch directory that is readable by the VMM wherever the test runs.
fn scratch(name: &str) -> Result<PathBuf, Failed> {
    let dir = std::env::temp_dir().join(format!("tine-linux-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn initramfs(dir: &Path, init: &str) -> Result<PathBuf, Failed> {
    let path = dir.join("initramfs.cpio");
    std::fs::write(&path, busybox_initramfs(init, Vec::new())?)?;
    Ok(path)
}

fn console(log: &Path) -> ConsoleConfig {
    ConsoleConfig {
        log_path: Some(log.to_path_buf()),
        log_limit: None,
        echo_stdout: false,
    }
}

/// Waits until `log` contains `needle`; returns the log text.
fn wait_for(log: &Path, needle: &str, limit: Duration) -> Result<String, Failed> {
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.contains(needle) {
            return Ok(text);
        }
        if start.elapsed() > limit {
            let tail: String = text.lines().rev().take(15).collect::<Vec<_>>().join("\n");
            return Err(format!(
                "'{needle}' not seen within {limit:?}; last lines (newest first):\n{tail}"
            )
            .into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn last_tick(text: &str) -> Option<u64> {
    text.lines()
        .rev()
        .filter_map(|l| l.trim().strip_prefix("tick "))
        .find_map(|n| n.trim().parse().ok())
}

fn boot_config(init: &Path) -> Result<BootConfig, Failed> {
    Ok(BootConfig {
        kernel: guest_kernel()?.vmlinux,
        initramfs: Some(init.to_path_buf()),
        // `quiet`: every console character is a port exit, which is slow in
        // the nested bed; init's own output still reaches the console.
        cmdline: format!("{DEFAULT_CMDLINE} quiet"),
        mem_mib: 256,
        vcpus: 1,
        raw: None,
        devices: Default::default(),
    })
}

fn boots_to_init_and_reboots() -> Result<(), Failed> {
    let dir = scratch("boot")?;
    let init = initramfs(&dir, REBOOT_INIT)?;
    let log = dir.join("serial.log");
    let start = Instant::now();
    let mut vmm = Vmm::boot(&boot_config(&init)?, &console(&log))?;
    let reason = vmm.wait();
    let text = std::fs::read_to_string(&log)?;
    let line = text
        .lines()
        .find(|l| l.contains("tine-test: init reached"))
        .ok_or_else(|| format!("guest never reached init; console:\n{text}"))?;
    if reason != StopReason::GuestReboot {
        return Err(format!("expected a guest reboot, got {reason:?}").into());
    }
    println!(
        "linux boot: {:.2}s wall from boot() to reboot; guest says: {}",
        start.elapsed().as_secs_f64(),
        line.trim()
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn bzimage_boots_too() -> Result<(), Failed> {
    let dir = scratch("bzimage")?;
    let init = initramfs(&dir, REBOOT_INIT)?;
    let log = dir.join("serial.log");
    let mut config = boot_config(&init)?;
    config.kernel = guest_kernel()?.bzimage;
    config.vcpus = 2;
    // This test reads a kernel message, so the console stays verbose.
    config.cmdline = DEFAULT_CMDLINE.to_string();
    let mut vmm = Vmm::boot(&config, &console(&log))?;
    let reason = vmm.wait();
    let text = std::fs::read_to_string(&log)?;
    if !text.contains("tine-test: init reached") || reason != StopReason::GuestReboot {
        return Err(format!("bzImage with 2 vCPUs: {reason:?}; console:\n{text}").into());
    }
    if !text.contains("Brought up 1 node, 2 CPUs") {
        return Err(format!("second vCPU did not come up; console:\n{text}").into());
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// What `TICKER_INIT` prints once its kernel's log says the vmgenid driver
/// reseeded the CRNG for a changed VM generation ID (the line itself goes
/// to the kernel log, not always to the console).
const VMFORK_RESEED: &str = "tine-test: kernel log has the VM fork reseed";

fn snapshot_restores_into_two_running_vms() -> Result<(), Failed> {
    let dir = scratch("snap")?;
    let init = initramfs(&dir, TICKER_INIT)?;
    let log = dir.join("parent.log");
    let mut parent = Vmm::boot(&boot_config(&init)?, &console(&log))?;
    wait_for(&log, "tick 3", Duration::from_secs(180))?;
    parent.pause()?;
    let state = dir.join("vm.state");
    let mem = dir.join("vm.mem");
    let info = parent.snapshot(&state, &mem)?;
    let at_snapshot =
        last_tick(&std::fs::read_to_string(&log)?).ok_or("no tick before snapshot")?;
    parent.kill();
    println!(
        "snapshot: {} KiB of 256 MiB written in {} ms (tick {at_snapshot})",
        info.mem_bytes_written / 1024,
        info.duration_us / 1000
    );

    let mut children = Vec::new();
    for i in 0..2 {
        let child_log = dir.join(format!("child{i}.log"));
        let start = Instant::now();
        let vmm = Vmm::restore(
            &state,
            &mem,
            None,
            &console(&child_log),
            &RestoreOverrides::default(),
            false,
        )?;
        println!("restore {i}: {} us to running", start.elapsed().as_micros());
        children.push((vmm, child_log));
    }
    for (vmm, child_log) in &children {
        let want = format!("tick {}", at_snapshot + 3);
        let text = wait_for(child_log, &want, Duration::from_secs(120))?;
        let first = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("tick "))
            .and_then(|n| n.trim().parse::<u64>().ok())
            .ok_or("child printed no tick")?;
        if first != at_snapshot + 1 {
            return Err(format!(
                "child resumed at tick {first}, expected {} (right after the snapshot)",
                at_snapshot + 1
            )
            .into());
        }
        if vmm.run_state() != RunState::Running {
            return Err(format!("child is {:?}", vmm.run_state()).into());
        }
        // The restore wrote a new VM generation ID and raised the GED: the
        // child's own kernel reseeded its CRNG.
        if let Err(e) = wait_for(child_log, VMFORK_RESEED, Duration::from_secs(20)) {
            let text = std::fs::read_to_string(child_log)?;
            let head: Vec<&str> = text
                .lines()
                .filter(|l| !l.starts_with("tick"))
                .take(40)
                .collect();
            eprintln!("DEBUG child head:\n{}", head.join("\n"));
            return Err(e);
        }
    }
    if std::fs::read_to_string(&log)?.contains(VMFORK_RESEED) {
        return Err("the parent, never restored, logged a VM fork reseed".into());
    }
    for (mut vmm, _) in children {
        vmm.kill();
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

const DEVICES_INIT: &str = r#"#!/bin/sh
export PATH=/bin
busybox mount -t proc proc /proc
busybox mount -t sysfs sys /sys
busybox mount -t devtmpfs dev /dev
busybox hostname tine-devtest
/bin/tine-guest-util vsock-echo 5000 &
echo "disk-md5 $(busybox md5sum /dev/vda | busybox cut -d' ' -f1)"
echo "tine-write-marker" | busybox dd of=/dev/vda bs=512 seek=200 conv=notrunc 2>/dev/null
busybox sync
echo "rng $(busybox cat /sys/class/misc/hw_random/rng_current) $(busybox dd if=/dev/hwrng bs=32 count=1 2>/dev/null | busybox md5sum | busybox cut -d' ' -f1)"
echo "guest-send $(/bin/tine-guest-util vsock-send 6000 hello-from-guest)"
echo "tine-test: devices ready"
while true; do busybox sleep 1; done
"#;

fn host_md5(path: &Path) -> Result<String, Failed> {
    let out = std::process::Command::new("md5sum").arg(path).output()?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string())
}

/// Host side of Firecracker's vsock convention: CONNECT, then one line.
fn vsock_ping(uds: &Path, port: u32, line: &str) -> Result<String, Failed> {
    let start = Instant::now();
    let stream = loop {
        match UnixStream::connect(uds) {
            Ok(s) => break s,
            Err(e) if start.elapsed() < Duration::from_secs(10) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(format!("cannot connect to {}: {e}", uds.display()).into()),
        }
    };
    stream.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut writer = stream.try_clone()?;
    writer.write_all(format!("CONNECT {port}\n").as_bytes())?;
    let mut reader = BufReader::new(stream);
    let mut ok = String::new();
    reader.read_line(&mut ok)?;
    if !ok.starts_with("OK ") {
        return Err(format!("vsock handshake answered '{}'", ok.trim()).into());
    }
    writer.write_all(format!("{line}\n").as_bytes())?;
    let mut reply = String::new();
    reader.read_line(&mut reply)?;
    Ok(reply.trim().to_string())
}

fn devices_work_and_survive_snapshot() -> Result<(), Failed> {
    let dir = scratch("devices")?;
    let mut extra = host_binary_entries(&guest_util()?)?;
    extra.push(tine_testbed::cpio::Entry::Dir {
        path: "tmp".into(),
        mode: 0o1777,
    });
    let init = dir.join("initramfs.cpio");
    std::fs::write(&init, busybox_initramfs(DEVICES_INIT, extra)?)?;
    let disk = dir.join("disk.raw");
    let pattern: Vec<u8> = (0..16u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    std::fs::write(&disk, &pattern)?;
    let disk_md5 = host_md5(&disk)?;
    let uds = dir.join("vsock.sock");

    // Guest-initiated connections to port 6000 land on <uds>_6000.
    let listener = UnixListener::bind(dir.join("vsock.sock_6000"))?;
    let received = std::thread::spawn(move || -> String {
        let Ok((mut stream, _)) = listener.accept() else {
            return String::new();
        };
        let mut line = String::new();
        let _ = BufReader::new(stream.try_clone().expect("clone")).read_line(&mut line);
        let _ = stream.write_all(b"ack\n");
        line
    });

    let log = dir.join("serial.log");
    let mut config = boot_config(&init)?;
    config.devices = DeviceConfigs {
        drives: vec![DriveConfig {
            path: disk.clone(),
            read_only: false,
        }],
        nets: Vec::new(),
        vsock: Some(VsockConfig {
            guest_cid: 3,
            uds_path: uds.clone(),
        }),
        rng: true,
    };
    let mut vmm = Vmm::boot(&config, &console(&log))?;
    let text = wait_for(&log, "tine-test: devices ready", Duration::from_secs(240))?;

    let field = |name: &str| -> String {
        text.lines()
            .find_map(|l| l.trim().strip_prefix(name))
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    if field("disk-md5 ") != disk_md5 {
        return Err(format!(
            "guest read md5 '{}', host has {disk_md5}",
            field("disk-md5 ")
        )
        .into());
    }
    let rng = field("rng ");
    if !rng.starts_with("virtio_rng") || rng.ends_with("70bc8f4b72a86921468bf8e8441dce51") {
        return Err(format!("virtio-rng not serving entropy: '{rng}'").into());
    }
    if field("guest-send ") != "ack" {
        return Err(format!("guest-to-host vsock reply was '{}'", field("guest-send ")).into());
    }
    let got = received.join().map_err(|_| "listener thread panicked")?;
    if got.trim() != "hello-from-guest" {
        return Err(format!("host received '{}' over vsock", got.trim()).into());
    }
    let reply = vsock_ping(&uds, 5000, "ping")?;
    if reply != "pong tine-devtest: ping" {
        return Err(format!("host-to-guest vsock reply was '{reply}'").into());
    }
    let mut written = vec![0u8; 17];
    let mut file = std::fs::File::open(&disk)?;
    std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(200 * 512))?;
    file.read_exact(&mut written)?;
    if written != b"tine-write-marker" {
        return Err(format!(
            "guest write not on disk: {:?}",
            String::from_utf8_lossy(&written)
        )
        .into());
    }
    println!("devices: blk read+write, rng '{rng}', vsock both ways: ok");

    vmm.pause()?;
    let state = dir.join("vm.state");
    let mem = dir.join("vm.mem");
    vmm.snapshot(&state, &mem)?;
    vmm.kill();
    let mut children = Vec::new();
    for i in 0..2 {
        let child_uds = dir.join(format!("child{i}.sock"));
        let overrides = RestoreOverrides {
            vsock_uds: Some(child_uds.clone()),
            ..Default::default()
        };
        let child_log = dir.join(format!("child{i}.log"));
        let child = Vmm::restore(&state, &mem, None, &console(&child_log), &overrides, false)?;
        children.push((child, child_uds));
    }
    for (i, (_, child_uds)) in children.iter().enumerate() {
        let reply = vsock_ping(child_uds, 5000, &format!("child{i}"))?;
        if reply != format!("pong tine-devtest: child{i}") {
            return Err(format!("restored VM {i} answered '{reply}' over vsock").into());
        }
    }
    println!("snapshot: both restored VMs answer over their own vsock socket");
    for (mut child, _) in children {
        child.kill();
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

const SHUTDOWN_INIT: &str = r#"#!/bin/sh
/bin/busybox mount -t proc proc /proc
echo 0 > /proc/sys/kernel/ctrl-alt-del
trap 'echo "tine-test: got ctrl-alt-del"; /bin/busybox sync; /bin/busybox reboot -f' INT
echo "tine-test: init reached"
while true; do /bin/busybox sleep 1; done
"#;

/// Longer than the guest kernel's RCU stall timeout
/// (`CONFIG_RCU_CPU_STALL_TIMEOUT`, 21 s).
const LONG_PAUSE: Duration = Duration::from_secs(30);

/// A guest paused for longer than its kernel's stall timeouts runs on
/// without reporting a stall: its clock jumps when it resumes, and the
/// paused flag of its kvmclock (`KVM_KVMCLOCK_CTRL`, set by the pause)
/// tells the kernel's RCU stall detector (and soft-lockup watchdog) the
/// time went to the host, not to a stuck CPU.
fn long_pause_reports_no_stall() -> Result<(), Failed> {
    let dir = scratch("pause")?;
    let init = initramfs(&dir, CHURN_INIT)?;
    let log = dir.join("serial.log");
    let mut vmm = Vmm::boot(&boot_config(&init)?, &console(&log))?;
    wait_for(&log, "tick 3", Duration::from_secs(180))?;
    vmm.pause()?;
    let before = std::fs::read_to_string(&log)?;
    let paused_at = last_tick(&before).ok_or("no tick before the pause")?;
    std::thread::sleep(LONG_PAUSE);
    let during = std::fs::read_to_string(&log)?;
    if last_tick(&during) != Some(paused_at) {
        return Err(format!(
            "the guest ticked while paused (tick {paused_at} then {:?})",
            last_tick(&during)
        )
        .into());
    }
    vmm.resume()?;
    // The stall check runs at the scheduler tick, the first after resume.
    let goal = format!("tick {}", paused_at + 10);
    let text = wait_for(&log, &goal, Duration::from_secs(180))?;
    vmm.kill();
    let uptimes: Vec<f64> = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("up ")?.trim().parse().ok())
        .collect();
    let jump = uptimes.windows(2).map(|w| w[1] - w[0]).fold(0.0, f64::max);
    println!("long pause: the guest's uptime jumped {jump:.1} s over a {LONG_PAUSE:?} pause");
    let stalls: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("detected stall") || l.contains("soft lockup"))
        .collect();
    if !stalls.is_empty() {
        return Err(format!(
            "the guest reported a stall after a {LONG_PAUSE:?} pause:\n{}",
            stalls.join("\n")
        )
        .into());
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn graceful_shutdown_reaches_init() -> Result<(), Failed> {
    let dir = scratch("shutdown")?;
    let init = initramfs(&dir, SHUTDOWN_INIT)?;
    let log = dir.join("serial.log");
    let mut vmm = Vmm::boot(&boot_config(&init)?, &console(&log))?;
    wait_for(&log, "tine-test: init reached", Duration::from_secs(180))?;
    // The keyboard driver may still be settling right after init starts;
    // press again until the guest reacts.
    let start = Instant::now();
    while !std::fs::read_to_string(&log)?.contains("got ctrl-alt-del") {
        if start.elapsed() > Duration::from_secs(60) {
            return Err("guest init never saw Ctrl-Alt-Del".into());
        }
        if vmm.run_state() == RunState::Running {
            vmm.request_shutdown()?;
        }
        std::thread::sleep(Duration::from_secs(2));
    }
    let reason = vmm.wait();
    if reason != StopReason::GuestReboot {
        return Err(
            format!("expected the guest to reboot after Ctrl-Alt-Del, got {reason:?}").into(),
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn main() {
    run_tests(vec![
        Trial::test(
            "linux_graceful_shutdown_via_ctrl_alt_del",
            graceful_shutdown_reaches_init,
        ),
        Trial::test(
            "linux_virtio_blk_rng_vsock_and_snapshot",
            devices_work_and_survive_snapshot,
        ),
        Trial::test(
            "linux_long_pause_reports_no_stall",
            long_pause_reports_no_stall,
        ),
        Trial::test("linux_boots_to_init_and_reboots", boots_to_init_and_reboots),
        Trial::test("linux_bzimage_two_vcpus_boots", bzimage_boots_too),
        Trial::test(
            "linux_snapshot_restores_into_two_running_vms",
            snapshot_restores_into_two_running_vms,
        ),
    ]);
}
