//! Linux boot time: `tine-vmm` process start to the guest's init printing
//! its first line, with the guest's CLOCK_BOOTTIME at that point beside it.
//! Runs through the test bed (nested where the host's KVM cannot run Linux,
//! where absolute times are meaningless: compare the ratio). Prints p50/p99;
//! asserts nothing beyond the guest booting.
//!
//!   cargo bench -p tine-vmm --bench boot [-- --runs N]

mod common;

use common::percentile;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tine_testbed::cpio::busybox_initramfs;
use tine_testbed::{guest_kernel, placement, run_tests, Failed, Trial};

const INIT: &str = r#"#!/bin/sh
/bin/busybox mount -t proc proc /proc
echo "tine-bench: init boottime $(/bin/busybox cut -d' ' -f1 /proc/uptime)"
/bin/busybox reboot -f
"#;

/// Returns the p50 wall time (process start to init) of the vmlinux boots.
fn boot_benchmark() -> Result<f64, Failed> {
    let runs: usize = std::env::var("TINE_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let dir = std::env::temp_dir().join(format!("tine-boot-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let init = dir.join("initramfs.cpio");
    std::fs::write(&init, busybox_initramfs(INIT, Vec::new())?)?;
    let kernel = guest_kernel()?;
    let mut vmlinux_p50 = 0.0;
    for (name, image) in [("vmlinux", &kernel.vmlinux), ("bzImage", &kernel.bzimage)] {
        let mut wall = Vec::new();
        let mut guest = Vec::new();
        for i in 0..runs {
            let log = dir.join(format!("{name}-{i}.log"));
            let start = Instant::now();
            let mut child = Command::new(env!("CARGO_BIN_EXE_tine-vmm"))
                .arg("--kernel")
                .arg(image)
                .arg("--initramfs")
                .arg(&init)
                .arg("--serial-log")
                .arg(&log)
                .stdout(Stdio::null())
                .spawn()?;
            let boottime = loop {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                if let Some(value) = text
                    .lines()
                    .find_map(|l| l.trim().strip_prefix("tine-bench: init boottime "))
                    .and_then(|v| v.trim().parse::<f64>().ok())
                {
                    break value;
                }
                if start.elapsed() > Duration::from_secs(300) {
                    let _ = child.kill();
                    return Err(format!("{name} run {i} never reached init").into());
                }
                std::thread::sleep(Duration::from_millis(5));
            };
            wall.push(start.elapsed().as_secs_f64());
            guest.push(boottime);
            let _ = child.wait();
        }
        wall.sort_by(|a, b| a.total_cmp(b));
        guest.sort_by(|a, b| a.total_cmp(b));
        if name == "vmlinux" {
            vmlinux_p50 = percentile(&wall, 0.5);
        }
        println!(
            "{name:<8} {:?} n={runs} process start -> init: p50 {:.2}s p99 {:.2}s | guest CLOCK_BOOTTIME at init: p50 {:.2}s p99 {:.2}s | wall/guest {:.2}",
            placement(),
            percentile(&wall, 0.5),
            percentile(&wall, 0.99),
            percentile(&guest, 0.5),
            percentile(&guest, 0.99),
            percentile(&wall, 0.5) / percentile(&guest, 0.5)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(vmlinux_p50)
}

fn main() {
    run_tests(vec![Trial::bench("linux_boot_time", |_test_mode| {
        let p50 = boot_benchmark()?;
        Ok(Some(tine_testbed::Measurement {
            avg: (p50 * 1e9) as u64,
            variance: 0,
        }))
    })]);
}
