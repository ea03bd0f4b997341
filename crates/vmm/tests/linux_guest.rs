//! Linux guests on tine-vmm, run through the test bed (directly where the
//! host's KVM runs Linux, nested otherwise).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tine_testbed::cpio::busybox_initramfs;
use tine_testbed::{guest_kernel, run_tests, Failed, Trial};
use tine_vmm::vmm::{BootConfig, ConsoleConfig, RunState, Vmm, DEFAULT_CMDLINE};
use tine_vmm::vstate::vcpu::StopReason;

const TICKER_INIT: &str = r#"#!/bin/sh
/bin/busybox mount -t proc proc /proc
echo "tine-test: init reached"
i=0
while [ $i -lt 100000 ]; do
  echo "tick $i"
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
        cmdline: DEFAULT_CMDLINE.to_string(),
        mem_mib: 256,
        vcpus: 1,
        raw: None,
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
        let vmm = Vmm::restore(&state, &mem, None, &console(&child_log), false)?;
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
    }
    for (mut vmm, _) in children {
        vmm.kill();
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn main() {
    run_tests(vec![
        Trial::test("linux_boots_to_init_and_reboots", boots_to_init_and_reboots),
        Trial::test("linux_bzimage_two_vcpus_boots", bzimage_boots_too),
        Trial::test(
            "linux_snapshot_restores_into_two_running_vms",
            snapshot_restores_into_two_running_vms,
        ),
    ]);
}
