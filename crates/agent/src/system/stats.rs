//! The guest's figures for `stats`: read from `/proc`, `/sys` and
//! `statvfs`. Each reader has a parser of the file's text of its own (unit
//! tested on fixed samples); a figure that cannot be read is left at 0 and
//! named in [`GuestStats::errors`].

use std::path::Path;

use tine_proto::agent::{CpuTimes, FsSpace, GuestStats};

/// Most lines read from one `/proc/net/tcp*` file: a guest with more
/// sockets than this reports this many established at most.
const MAX_SOCKET_LINES: usize = 1 << 20;

/// Most file descriptors counted: past it the count stops.
const MAX_FDS_COUNTED: u64 = 1 << 20;

/// Where the figures come from: `/proc` and `/sys` of the running kernel,
/// and the file system whose space is reported.
#[derive(Debug, Clone)]
pub struct StatsSources<'a> {
    /// `/proc`.
    pub proc: &'a Path,
    /// `/sys`.
    pub sys: &'a Path,
    /// The file system reported as the root one.
    pub root: &'a Path,
}

impl Default for StatsSources<'static> {
    fn default() -> Self {
        Self {
            proc: Path::new("/proc"),
            sys: Path::new("/sys"),
            root: Path::new("/"),
        }
    }
}

/// Reads every figure; what fails is named in `errors`.
pub fn read_stats(src: &StatsSources<'_>) -> GuestStats {
    let mut s = GuestStats {
        uptime_ms: super::system_uptime().as_millis().min(u128::from(u64::MAX)) as u64,
        ..GuestStats::default()
    };
    let mut errors = Vec::new();
    let mut read = |name: &str| read_proc(src.proc, name, &mut errors);
    if let Some(text) = read("stat") {
        let (cpus, cpu) = parse_proc_stat(&text, clock_ticks_per_second());
        s.cpus = cpus;
        s.cpu = cpu;
    }
    if let Some(text) = read("loadavg") {
        if let Some((a, b, c)) = parse_loadavg(&text) {
            (s.load_avg_1, s.load_avg_5, s.load_avg_15) = (a, b, c);
        }
    }
    if let Some(text) = read("meminfo") {
        let m = parse_meminfo(&text);
        s.mem_total_bytes = m.total;
        s.mem_free_bytes = m.free;
        s.mem_available_bytes = m.available;
    }
    if let Some(text) = read("diskstats") {
        let whole = whole_disks(&src.sys.join("block"));
        let d = parse_diskstats(&text, |name| whole.iter().any(|w| w == name));
        s.disk_read_bytes = d.read_bytes;
        s.disk_write_bytes = d.write_bytes;
        s.disk_io_in_flight = d.in_flight;
    }
    if let Some(text) = read("net/dev") {
        (s.net_rx_bytes, s.net_tx_bytes) = parse_net_dev(&text);
    }
    if let Some(text) = read("net/tcp") {
        s.tcp_established = count_established(&text);
    }
    // The kernel's own count (file-nr) is approximate, batched per CPU,
    // and reads 0 in a small guest: the descriptors are counted instead.
    s.open_files = count_fds(src.proc);
    if s.open_files == 0 {
        if let Some(text) = read("sys/fs/file-nr") {
            s.open_files = parse_file_nr(&text);
        }
    }
    if let Some(text) = read("sys/kernel/random/entropy_avail") {
        s.entropy_bits = text.trim().parse().unwrap_or(0);
    }
    // A kernel without IPv6 has no tcp6: not an error.
    if let Ok(text) = std::fs::read_to_string(src.proc.join("net/tcp6")) {
        s.tcp_established = s.tcp_established.saturating_add(count_established(&text));
    }
    match nix::sys::statvfs::statvfs(src.root) {
        Ok(v) => {
            let frag = v.fragment_size();
            s.root_fs = FsSpace {
                total_bytes: v.blocks().saturating_mul(frag),
                free_bytes: v.blocks_free().saturating_mul(frag),
                available_bytes: v.blocks_available().saturating_mul(frag),
            };
        }
        Err(e) => errors.push(format!("statvfs {}: {e}", src.root.display())),
    }
    s.errors = errors;
    s
}

/// `/proc/NAME`'s text, or `None` with the failure added to `errors`.
fn read_proc(proc: &Path, name: &str, errors: &mut Vec<String>) -> Option<String> {
    let path = proc.join(name);
    match std::fs::read_to_string(&path) {
        Ok(text) => Some(text),
        Err(e) => {
            errors.push(format!("read {}: {e}", path.display()));
            None
        }
    }
}

fn clock_ticks_per_second() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .and_then(|t| u64::try_from(t).ok())
        .filter(|t| *t > 0)
        .unwrap_or(100)
}

/// The number of CPUs (`cpuN` lines) and the summed CPU times of the `cpu`
/// line of `/proc/stat`, whose unit is `ticks` per second.
pub fn parse_proc_stat(text: &str, ticks: u64) -> (u32, CpuTimes) {
    let ms = |field: Option<&str>| {
        field
            .and_then(|f| f.parse::<u64>().ok())
            .map(|t| t.saturating_mul(1000) / ticks.max(1))
            .unwrap_or(0)
    };
    let mut cpus = 0u32;
    let mut times = CpuTimes::default();
    for line in text.lines() {
        let mut fields = line.split_ascii_whitespace();
        match fields.next() {
            Some("cpu") => {
                times = CpuTimes {
                    user_ms: ms(fields.next()),
                    nice_ms: ms(fields.next()),
                    system_ms: ms(fields.next()),
                    idle_ms: ms(fields.next()),
                    iowait_ms: ms(fields.next()),
                    irq_ms: ms(fields.next()),
                    softirq_ms: ms(fields.next()),
                    steal_ms: ms(fields.next()),
                };
            }
            Some(name)
                if name.len() > 3
                    && name.starts_with("cpu")
                    && name[3..].bytes().all(|b| b.is_ascii_digit()) =>
            {
                cpus = cpus.saturating_add(1);
            }
            _ => {}
        }
    }
    (cpus, times)
}

/// The three load averages of `/proc/loadavg`.
pub fn parse_loadavg(text: &str) -> Option<(f64, f64, f64)> {
    let mut f = text
        .split_ascii_whitespace()
        .map(|v| v.parse::<f64>().ok().filter(|x| x.is_finite() && *x >= 0.0));
    Some((f.next()??, f.next()??, f.next()??))
}

/// The memory figures `stats` reports, in bytes.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct MemInfo {
    /// `MemTotal`.
    pub total: u64,
    /// `MemFree`.
    pub free: u64,
    /// `MemAvailable` (on a kernel without it: free + buffers + cached).
    pub available: u64,
}

/// Reads `MemTotal`, `MemFree` and `MemAvailable` (kB) from
/// `/proc/meminfo`.
pub fn parse_meminfo(text: &str) -> MemInfo {
    let mut m = MemInfo::default();
    let (mut available, mut buffers, mut cached) = (None, 0, 0);
    for line in text.lines() {
        let Some((key, rest)) = line.split_once(':') else {
            continue;
        };
        let kb: u64 = rest
            .split_ascii_whitespace()
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let bytes = kb.saturating_mul(1024);
        match key {
            "MemTotal" => m.total = bytes,
            "MemFree" => m.free = bytes,
            "MemAvailable" => available = Some(bytes),
            "Buffers" => buffers = bytes,
            "Cached" => cached = bytes,
            _ => {}
        }
    }
    m.available = available
        .unwrap_or_else(|| m.free.saturating_add(buffers).saturating_add(cached))
        .min(m.total);
    m
}

/// Disk counters summed over whole disks.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct DiskCounters {
    /// Bytes read.
    pub read_bytes: u64,
    /// Bytes written.
    pub write_bytes: u64,
    /// Requests in flight.
    pub in_flight: u64,
}

/// The names under `/sys/block` that are disks of their own (partitions
/// are not listed there); loop, RAM and device-mapper devices are left out
/// (their I/O is counted again on the disk below them, or is not disk I/O).
fn whole_disks(sys_block: &Path) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(sys_block) else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| {
            !["loop", "ram", "zram", "dm-", "md"]
                .iter()
                .any(|p| n.starts_with(p))
        })
        .collect()
}

/// Sums `/proc/diskstats` over the devices `counted` accepts (sectors are
/// 512 bytes whatever the device's block size).
pub fn parse_diskstats(text: &str, counted: impl Fn(&str) -> bool) -> DiskCounters {
    let mut d = DiskCounters::default();
    for line in text.lines() {
        let f: Vec<&str> = line.split_ascii_whitespace().collect();
        if f.len() < 12 || !counted(f[2]) {
            continue;
        }
        let n = |i: usize| f[i].parse::<u64>().unwrap_or(0);
        d.read_bytes = d.read_bytes.saturating_add(n(5).saturating_mul(512));
        d.write_bytes = d.write_bytes.saturating_add(n(9).saturating_mul(512));
        d.in_flight = d.in_flight.saturating_add(n(11));
    }
    d
}

/// Bytes received and sent over every interface but `lo`
/// (`/proc/net/dev`).
pub fn parse_net_dev(text: &str) -> (u64, u64) {
    let (mut rx, mut tx) = (0u64, 0u64);
    for line in text.lines().skip(2) {
        let Some((name, counters)) = line.split_once(':') else {
            continue;
        };
        if name.trim() == "lo" {
            continue;
        }
        let f: Vec<u64> = counters
            .split_ascii_whitespace()
            .map(|v| v.parse().unwrap_or(0))
            .collect();
        if f.len() >= 9 {
            rx = rx.saturating_add(f[0]);
            tx = tx.saturating_add(f[8]);
        }
    }
    (rx, tx)
}

/// Sockets in the established state (`st` 01) in a `/proc/net/tcp` or
/// `tcp6` table.
pub fn count_established(text: &str) -> u64 {
    text.lines()
        .skip(1)
        .take(MAX_SOCKET_LINES)
        .filter(|line| line.split_ascii_whitespace().nth(3) == Some("01"))
        .count() as u64
}

/// File descriptors open in every process (`/proc/PID/fd`), up to
/// [`MAX_FDS_COUNTED`]; processes that cannot be read are left out.
fn count_fds(proc: &Path) -> u64 {
    let Ok(dir) = std::fs::read_dir(proc) else {
        return 0;
    };
    let mut n = 0u64;
    for entry in dir.filter_map(|e| e.ok()) {
        let name = entry.file_name();
        if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        if let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) {
            n = n.saturating_add(fds.count() as u64);
            if n >= MAX_FDS_COUNTED {
                return MAX_FDS_COUNTED;
            }
        }
    }
    n
}

/// Open file handles from `/proc/sys/fs/file-nr` (allocated less free).
pub fn parse_file_nr(text: &str) -> u64 {
    let mut f = text
        .split_ascii_whitespace()
        .map(|v| v.parse::<u64>().unwrap_or(0));
    let allocated = f.next().unwrap_or(0);
    let free = f.next().unwrap_or(0);
    allocated.saturating_sub(free)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_proc_stat_counts_cpus_and_converts_ticks() {
        let text = "cpu  100 5 50 1000 20 1 2 3 0 0\n\
                    cpu0 50 2 25 500 10 1 1 1 0 0\n\
                    cpu1 50 3 25 500 10 0 1 2 0 0\n\
                    intr 12345\nctxt 99\ncpufreq 1\n";
        let (cpus, t) = parse_proc_stat(text, 100);
        assert_eq!(cpus, 2);
        assert_eq!(
            t,
            CpuTimes {
                user_ms: 1000,
                nice_ms: 50,
                system_ms: 500,
                idle_ms: 10_000,
                iowait_ms: 200,
                irq_ms: 10,
                softirq_ms: 20,
                steal_ms: 30,
            }
        );
        // A short or garbled line leaves zeros, never a panic.
        let (cpus, t) = parse_proc_stat("cpu x\ncpu", 0);
        assert_eq!((cpus, t), (0, CpuTimes::default()));
    }

    #[test]
    fn test_loadavg_meminfo_and_file_nr_parse() {
        assert_eq!(
            parse_loadavg("0.52 0.58 0.59 1/467 12345\n"),
            Some((0.52, 0.58, 0.59))
        );
        assert_eq!(parse_loadavg("0.5 nan 1"), None);
        assert_eq!(parse_loadavg(""), None);
        let m = parse_meminfo(
            "MemTotal:       2048 kB\nMemFree:         512 kB\nMemAvailable:   1024 kB\nBuffers: 1 kB\n",
        );
        assert_eq!(
            m,
            MemInfo {
                total: 2 << 20,
                free: 512 << 10,
                available: 1 << 20
            }
        );
        // An old kernel without MemAvailable.
        let m = parse_meminfo("MemTotal: 100 kB\nMemFree: 10 kB\nBuffers: 5 kB\nCached: 20 kB\n");
        assert_eq!(m.available, 35 << 10);
        // Available never exceeds the total.
        assert_eq!(
            parse_meminfo("MemTotal: 1 kB\nMemAvailable: 9 kB").available,
            1024
        );
        assert_eq!(parse_file_nr("1184\t0\t9223372036854775807\n"), 1184);
        assert_eq!(parse_file_nr("10 20 30"), 0);
    }

    #[test]
    fn test_diskstats_sum_whole_disks_only() {
        let text = "\
 254       0 vda 1000 0 8000 100 500 0 4000 50 2 140 150 0 0 0 0
 254       1 vda1 900 0 7000 90 450 0 3500 45 0 130 140 0 0 0 0
   7       0 loop0 10 0 80 1 0 0 0 0 0 1 1 0 0 0 0
 254      16 vdb 1 0 2 1 1 0 2 1 1 1 1
";
        let d = parse_diskstats(text, |n| n == "vda" || n == "vdb");
        assert_eq!(
            d,
            DiskCounters {
                read_bytes: 8002 * 512,
                write_bytes: 4002 * 512,
                in_flight: 3,
            }
        );
        assert_eq!(parse_diskstats("1 2\n", |_| true), DiskCounters::default());
    }

    #[test]
    fn test_net_dev_skips_loopback_and_tcp_counts_established() {
        let text = "\
Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:  999999     100    0    0    0     0          0         0   999999     100    0    0    0     0       0          0
  eth0:    1500      10    0    0    0     0          0         0     700       7    0    0    0     0       0          0
  eth1:      10       1    0    0    0     0          0         0       5       1    0    0    0     0       0          0
";
        assert_eq!(parse_net_dev(text), (1510, 705));
        let tcp = "\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1
   1: 0100007F:1F90 0100007F:D2A4 01 00000000:00000000 00:00000000 00000000     0        0 2 1
   2: 0100007F:D2A4 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 3 1
";
        assert_eq!(count_established(tcp), 2);
    }

    #[test]
    fn test_fds_are_counted_per_process_directory() {
        let proc = tempfile::tempdir().expect("tmp");
        for (pid, fds) in [("123", 3), ("456", 1), ("self", 7)] {
            let dir = proc.path().join(pid).join("fd");
            std::fs::create_dir_all(&dir).expect("mkdir");
            for fd in 0..fds {
                std::fs::write(dir.join(fd.to_string()), b"").expect("fd");
            }
        }
        std::fs::create_dir(proc.path().join("789")).expect("no fd dir");
        assert_eq!(count_fds(proc.path()), 4);
        assert_eq!(count_fds(&proc.path().join("absent")), 0);
    }

    #[test]
    fn test_read_stats_on_this_machine_is_consistent() {
        let s = read_stats(&StatsSources::default());
        assert!(s.errors.is_empty(), "{:?}", s.errors);
        let online = nix::unistd::sysconf(nix::unistd::SysconfVar::_NPROCESSORS_ONLN)
            .ok()
            .flatten()
            .unwrap_or(0);
        assert_eq!(i64::from(s.cpus), online);
        assert!(s.mem_total_bytes > 0 && s.mem_available_bytes <= s.mem_total_bytes);
        assert!(s.uptime_ms > 0);
        assert!(s.cpu.user_ms + s.cpu.system_ms + s.cpu.idle_ms > 0);
        assert!(s.open_files > 0);
        let fs = s.root_fs;
        assert!(fs.total_bytes > 0 && fs.available_bytes <= fs.free_bytes);
        assert!(fs.free_bytes <= fs.total_bytes);
        // A missing /proc is reported, not a panic.
        let empty = tempfile::tempdir().expect("tmp");
        let s = read_stats(&StatsSources {
            proc: empty.path(),
            sys: empty.path(),
            root: &empty.path().join("absent"),
        });
        assert!(s.errors.len() >= 8, "{:?}", s.errors);
        assert_eq!(s.mem_total_bytes, 0);
    }
}
