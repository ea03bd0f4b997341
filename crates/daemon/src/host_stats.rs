//! What the host measures of a VM for `stats`: its VMM process's CPU time
//! (`/proc/PID/stat`) and memory (`/proc/PID/smaps_rollup`: RSS, PSS and
//! USS, the pages only it maps), and its TAP device's counters
//! (`/sys/class/net/TAP/statistics`).
//!
//! A process is only read after its start time matched the one recorded
//! for the VM, so a recycled pid never reports another process's figures.

use std::path::Path;

use tine_proto::api::TapCounters;

use crate::process::start_time;

/// CPU time of a process, all threads, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuTime {
    /// User mode (a vCPU thread's guest time is counted here).
    pub user_ms: u64,
    /// Kernel mode.
    pub system_ms: u64,
}

pub use tine_proto::smaps::Memory;

/// The figures of the process `pid` if it is still the one that started
/// at `pid_start`: its CPU time and its memory (`None` for what could not
/// be read).
pub fn process(pid: u32, pid_start: u64) -> (Option<CpuTime>, Option<Memory>) {
    if start_time(pid) != Some(pid_start) {
        return (None, None);
    }
    let cpu = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|text| parse_stat_times(&text, clock_ticks()));
    let memory = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .ok()
        .map(|text| parse_smaps_rollup(&text));
    // Read before the pid could be reused: check again.
    if start_time(pid) != Some(pid_start) {
        return (None, None);
    }
    (cpu, memory)
}

/// A VM's memory as its VMM process holds it: the process's figures
/// (`smaps_rollup`) and the guest RAM it copied on write (`smaps`, see
/// [`tine_proto::smaps::copied_guest_bytes`]; `None` for a booted VM).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmMemory {
    /// The process's RSS, PSS and USS.
    pub process: Memory,
    /// Bytes of guest RAM copied since the restore.
    pub copied_bytes: Option<u64>,
}

/// The memory of the VMM process `pid` of a VM with `ram_bytes` of RAM, if
/// it is still the one that started at `pid_start` and its figures can be
/// read.
pub fn vm_memory(pid: u32, pid_start: u64, ram_bytes: u64) -> Option<VmMemory> {
    if start_time(pid) != Some(pid_start) {
        return None;
    }
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    // Read before the pid could be reused: check again.
    if start_time(pid) != Some(pid_start) {
        return None;
    }
    Some(VmMemory {
        process: tine_proto::smaps::parse_rollup(&rollup),
        copied_bytes: tine_proto::smaps::copied_guest_bytes(
            &tine_proto::smaps::parse_smaps(&smaps),
            ram_bytes,
        ),
    })
}

fn clock_ticks() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .and_then(|t| u64::try_from(t).ok())
        .filter(|t| *t > 0)
        .unwrap_or(100)
}

/// `utime` and `stime` (fields 14 and 15) of `/proc/PID/stat`, read after
/// the command name's closing parenthesis (the name may hold spaces).
pub fn parse_stat_times(text: &str, ticks_per_second: u64) -> Option<CpuTime> {
    let (_, rest) = text.rsplit_once(") ")?;
    // `rest` starts at field 3 (the state).
    let mut fields = rest.split_ascii_whitespace().skip(11);
    let ms = |t: u64| t.saturating_mul(1000) / ticks_per_second.max(1);
    let user = fields.next()?.parse().ok()?;
    let system = fields.next()?.parse().ok()?;
    Some(CpuTime {
        user_ms: ms(user),
        system_ms: ms(system),
    })
}

/// `Rss`, `Pss`, `Private_Clean + Private_Dirty` and `Swap` of
/// `/proc/PID/smaps_rollup`.
pub fn parse_smaps_rollup(text: &str) -> Memory {
    tine_proto::smaps::parse_rollup(text)
}

/// The counters of the network device `name` under `sys_class_net`
/// (`/sys/class/net`); `None` when it does not exist.
pub fn tap_counters(sys_class_net: &Path, name: &str) -> Option<TapCounters> {
    if name.is_empty() || name.contains('/') || name.starts_with('.') {
        return None;
    }
    let dir = sys_class_net.join(name).join("statistics");
    let read = |counter: &str| -> Option<u64> {
        std::fs::read_to_string(dir.join(counter))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    Some(TapCounters {
        tap: name.to_owned(),
        rx_bytes: read("rx_bytes")?,
        tx_bytes: read("tx_bytes")?,
        rx_packets: read("rx_packets")?,
        tx_packets: read("tx_packets")?,
        rx_dropped: read("rx_dropped").unwrap_or(0),
        tx_dropped: read("tx_dropped").unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_times_survive_a_command_with_spaces_and_parentheses() {
        let text =
            "4242 (tine vmm (x)) S 1 4242 4242 0 -1 4194560 1 0 0 0 250 125 0 0 20 0 3 0 99 1 2";
        assert_eq!(
            parse_stat_times(text, 100),
            Some(CpuTime {
                user_ms: 2500,
                system_ms: 1250
            })
        );
        assert_eq!(parse_stat_times("4242 (x) S 1 2", 100), None);
        assert_eq!(parse_stat_times("garbage", 100), None);
    }

    #[test]
    fn this_process_reads_as_a_vmm_would() {
        let pid = std::process::id();
        let start = start_time(pid).expect("own start time");
        // Burn a little CPU so user time is not zero.
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let (cpu, memory) = process(pid, start);
        let cpu = cpu.expect("cpu time");
        let memory = memory.expect("smaps_rollup");
        assert!(cpu.user_ms > 0, "{cpu:?}");
        assert!(
            memory.rss > 0 && memory.pss > 0 && memory.uss > 0,
            "{memory:?}"
        );
        assert!(
            memory.pss <= memory.rss && memory.uss <= memory.pss,
            "{memory:?}"
        );
        // Another start time: another process, nothing reported.
        assert_eq!(process(pid, start + 1), (None, None));
        // No file of this process is mapped privately at 1 TiB.
        let vm = vm_memory(pid, start, 1 << 40).expect("smaps");
        assert!(vm.process.uss > 0, "{vm:?}");
        assert_eq!(vm.copied_bytes, None);
        assert_eq!(vm_memory(pid, start + 1, 1 << 40), None);
    }

    #[test]
    fn loopback_counters_read_and_bad_names_do_not() {
        let sys = Path::new("/sys/class/net");
        let lo = tap_counters(sys, "lo").expect("lo has counters");
        assert_eq!(lo.tap, "lo");
        for bad in ["", "../lo", ".", "no-such-device-0"] {
            assert_eq!(tap_counters(sys, bad), None, "{bad}");
        }
        let dir = tempfile::tempdir().expect("tmp");
        let stats = dir.path().join("tt-web-1/statistics");
        std::fs::create_dir_all(&stats).expect("mkdir");
        for (name, v) in [
            ("rx_bytes", "1500\n"),
            ("tx_bytes", "700\n"),
            ("rx_packets", "10\n"),
            ("tx_packets", "7\n"),
            ("rx_dropped", "1\n"),
        ] {
            std::fs::write(stats.join(name), v).expect("write");
        }
        assert_eq!(
            tap_counters(dir.path(), "tt-web-1"),
            Some(TapCounters {
                tap: "tt-web-1".into(),
                rx_bytes: 1500,
                tx_bytes: 700,
                rx_packets: 10,
                tx_packets: 7,
                rx_dropped: 1,
                tx_dropped: 0,
            })
        );
    }
}
