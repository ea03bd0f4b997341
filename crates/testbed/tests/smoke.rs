//! Smoke test of the guest kernel and the test bed: QEMU with `-accel kvm`
//! (the reference VMM) boots the project's kernel with a busybox initramfs
//! whose init prints a marker line, then resets the machine (`reboot=t`).

use std::process::Command;
use std::time::{Duration, Instant};

use tine_testbed::cpio::busybox_initramfs;
use tine_testbed::{guest_kernel, placement, run_tests, Failed, Trial};

const MARKER: &str = "tine-smoke: init reached";

const INIT: &str = r#"#!/bin/sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
echo "tine-smoke: init reached"
echo "tine-smoke: kernel $(/bin/busybox uname -r) cpus $(/bin/busybox grep -c ^processor /proc/cpuinfo) boottime $(/bin/busybox cut -d' ' -f1 /proc/uptime)"
# No ACPI in the guest and no i8042 in QEMU's microvm: leave by a
# triple-fault reset (reboot=t); QEMU runs
# with -no-reboot, so a reset ends it.
/bin/busybox reboot -f
"#;

fn boot_guest_kernel_under_qemu_kvm() -> Result<(), Failed> {
    let kernel = guest_kernel()?;
    let dir = std::env::temp_dir().join(format!("tine-smoke-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let initramfs = dir.join("initramfs.cpio");
    std::fs::write(&initramfs, busybox_initramfs(INIT, Vec::new())?)?;

    let start = Instant::now();
    let output = Command::new("timeout")
        .args(["-k", "5", "120", "qemu-system-x86_64"])
        .args([
            "-accel", "kvm", "-cpu", "host", "-M", "microvm", "-m", "256", "-smp", "1",
        ])
        .args([
            "-nodefaults",
            "-no-reboot",
            "-display",
            "none",
            "-serial",
            "stdio",
        ])
        .arg("-kernel")
        .arg(&kernel.bzimage)
        .arg("-initrd")
        .arg(&initramfs)
        .args(["-append", "console=ttyS0 reboot=t panic=-1 rdinit=/init"])
        .output()?;
    let elapsed = start.elapsed();
    let _ = std::fs::remove_dir_all(&dir);
    let console = String::from_utf8_lossy(&output.stdout);
    if !console.contains(MARKER) {
        return Err(format!(
            "guest never printed '{MARKER}' (qemu {}, {:?}); console:\n{}\nstderr:\n{}",
            output.status,
            elapsed,
            console,
            String::from_utf8_lossy(&output.stderr)
        )
        .into());
    }
    let detail = console
        .lines()
        .find(|l| l.contains("tine-smoke: kernel"))
        .unwrap_or_default();
    println!(
        "smoke: {:?} test bed, qemu -accel kvm boot to init and poweroff in {:.1}s wall; {}",
        placement(),
        elapsed.as_secs_f64(),
        detail.trim()
    );
    if elapsed > Duration::from_secs(115) {
        return Err("qemu was killed by its timeout".into());
    }
    Ok(())
}

fn main() {
    run_tests(vec![Trial::test(
        "guest_kernel_boots_to_init_under_qemu_kvm",
        boot_guest_kernel_under_qemu_kvm,
    )]);
}
