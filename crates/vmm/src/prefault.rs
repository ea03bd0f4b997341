//! Pages mapped ahead of a restore. A restore is the first run of most of
//! its code in a pre-started process, on stack its threads have not used
//! yet, and each page it reaches first is a page fault: on a nested host a
//! fault is a VM exit of several microseconds. A pre-started process maps
//! them before any request comes ([`ahead_of_restore`], and
//! [`thread_ahead`] in each spare thread):
//! - every page of its read-only file mappings (the binary's code and
//!   constants, its libraries'): the page cache's, shared by every process
//!   that maps the file, so this costs page-table entries (a few KiB a
//!   process), not memory of its own;
//! - some of each thread's stack ([`CONTROL_STACK_AHEAD`],
//!   [`THREAD_STACK_AHEAD`]);
//! - the clock's data page, and a spare thread's heap arena.

use std::io;

use tine_proto::smaps::{parse_smaps, Mapping};

/// Stack the control thread writes ahead, in bytes, from where the
/// pre-start calls [`ahead_of_restore`]: a restore's deepest call (the
/// state file's decoding) reaches between 32 and 48 KiB below it.
pub const CONTROL_STACK_AHEAD: usize = 48 << 10;

/// Stack a spare thread writes ahead, in bytes: a vCPU thread's run loop
/// and the device event loop take a few KiB. Each written page is the
/// process's own memory for as long as it runs.
pub const THREAD_STACK_AHEAD: usize = 8 << 10;

/// Errors of [`ahead_of_restore`].
#[derive(Debug, thiserror::Error)]
pub enum PrefaultError {
    /// The process's mappings could not be read.
    #[error("cannot read /proc/self/maps: {0}")]
    Maps(#[source] io::Error),
    /// The kernel refused to map a range (`MADV_POPULATE_READ` came in
    /// Linux 5.14).
    #[error("cannot map {start:#x}-{end:#x} ahead (madvise MADV_POPULATE_READ): {source}")]
    Populate {
        /// First byte of the range.
        start: usize,
        /// One past its last byte.
        end: usize,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// Whether `mapping` maps a file and is not writable (code, constants):
/// not anonymous memory, the heap or stacks, writable data or an empty
/// range.
fn is_read_only_file(mapping: &Mapping) -> bool {
    mapping.path.starts_with('/')
        && mapping.perms.starts_with('r')
        && !mapping.perms.contains('w')
        && mapping.size() > 0
}

/// What the control thread (the caller) and the process map ahead of a
/// restore: the caller's stack, the clock's page, then the code (see the
/// module documentation). Returns how many bytes of code that covers. An
/// error leaves a restore slower, not wrong.
pub fn ahead_of_restore() -> Result<usize, PrefaultError> {
    touch_stack::<CONTROL_STACK_AHEAD>();
    std::hint::black_box(std::time::Instant::now());
    map_code()
}

/// What a spare thread maps ahead of its job: its stack, and its heap
/// arena (the C library gives a thread its own on its first allocation).
pub fn thread_ahead() {
    touch_stack::<THREAD_STACK_AHEAD>();
    drop(std::hint::black_box(Box::new(0u64)));
}

/// Writes `BYTES` of the calling thread's stack, below its current depth:
/// the kernel keeps the pages mapped once written.
#[inline(never)]
fn touch_stack<const BYTES: usize>() {
    let mut stack = [0u8; BYTES];
    std::hint::black_box(&mut stack);
}

/// Puts every page of this process's read-only file mappings in its page
/// tables. Returns how many bytes that covers.
fn map_code() -> Result<usize, PrefaultError> {
    let maps = std::fs::read_to_string("/proc/self/maps").map_err(PrefaultError::Maps)?;
    let mut bytes = 0;
    // `maps` lists the mappings as `smaps` heads them, without figures.
    for mapping in parse_smaps(&maps).iter().filter(|m| is_read_only_file(m)) {
        // Addresses of this process: they fit its pointers.
        let (start, end) = (mapping.start as usize, mapping.end as usize);
        // SAFETY: MADV_POPULATE_READ only faults in the pages of a range
        // this process has mapped (as if each were read); it changes no
        // memory and no mapping.
        let rc = unsafe {
            libc::madvise(
                start as *mut libc::c_void,
                end - start,
                libc::MADV_POPULATE_READ,
            )
        };
        if rc != 0 {
            return Err(PrefaultError::Populate {
                start,
                end,
                source: io::Error::last_os_error(),
            });
        }
        bytes += end - start;
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_read_only_file_mappings_are_taken() {
        let maps = [
            // Code and constants of files (a path may hold spaces).
            "55d0a0000000-55d0a0100000 r-xp 00001000 fe:00 7300 /usr/bin/tine-vmm",
            "7f00-8f00 r--p 00000000 fe:00 1 /lib/with space/libc.so.6",
            // Writable data of a file, the heap, anonymous memory, a
            // stack, the vDSO, no access, an inverted range.
            "7f00-8f00 rw-p 00000000 fe:00 1 /lib/libc.so.6",
            "5000-6000 rw-p 00000000 00:00 0 [heap]",
            "5000-6000 rw-p 00000000 00:00 0",
            "7ffc0000-7ffd0000 rw-p 00000000 00:00 0 [stack]",
            "7ffd0000-7ffd2000 r-xp 00000000 00:00 0 [vdso]",
            "7f00-8f00 ---p 00000000 fe:00 1 /lib/libc.so.6",
            "8f00-7f00 r-xp 00000000 fe:00 1 /bin/x",
            // Lines no mapping can be read from.
            "",
            "zz-8f00 r-xp 00000000 fe:00 1 /bin/x",
            "7f00-8f00 r-xp",
        ]
        .join("\n");
        let taken: Vec<(u64, u64)> = parse_smaps(&maps)
            .iter()
            .filter(|m| is_read_only_file(m))
            .map(|m| (m.start, m.end))
            .collect();
        assert_eq!(
            taken,
            [(0x55d0_a000_0000, 0x55d0_a010_0000), (0x7f00, 0x8f00)]
        );
    }

    /// Resident and mapped KiB of this test binary's code mapping.
    fn own_code_resident_kib() -> (u64, u64) {
        let exe = std::env::current_exe().expect("own path");
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        parse_smaps(&smaps)
            .iter()
            .find(|m| m.perms == "r-xp" && std::path::Path::new(&m.path) == exe)
            .map(|m| (m.memory.rss >> 10, m.size() >> 10))
            .unwrap_or_else(|| panic!("no code mapping of {} in /proc/self/smaps", exe.display()))
    }

    /// Minor page faults of the calling thread so far.
    fn thread_minor_faults() -> u64 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").expect("thread stat");
        // After the command name's ')': state is field 3, minflt field 10.
        stat.rsplit(')')
            .next()
            .and_then(|rest| rest.split_whitespace().nth(7))
            .and_then(|v| v.parse().ok())
            .expect("minflt in the thread's stat")
    }

    /// Uses 12 KiB of stack.
    #[inline(never)]
    fn deep() {
        let mut stack = [1u8; 12 << 10];
        std::hint::black_box(&mut stack);
    }

    /// Minor faults of [`deep`] in a new thread, after `before` ran there.
    fn faults_of_deep_after(before: fn()) -> u64 {
        std::thread::spawn(move || {
            before();
            // Its buffer allocated and freed once, so that the reads
            // measured reuse it.
            thread_minor_faults();
            let start = thread_minor_faults();
            deep();
            thread_minor_faults() - start
        })
        .join()
        .expect("thread")
    }

    #[test]
    fn a_thread_ahead_takes_no_fault_on_its_stack() {
        // A new thread may get the stack of one that just ended (the C
        // library keeps them), already faulted in: measured again then.
        let fresh = (0..5)
            .map(|_| faults_of_deep_after(|| {}))
            .find(|&faults| faults >= 2)
            .unwrap_or(0);
        let ahead = faults_of_deep_after(thread_ahead);
        assert!(
            fresh >= 2,
            "12 KiB of a fresh thread's stack took {fresh} faults"
        );
        assert!(ahead <= 1, "after thread_ahead: {ahead} faults");
    }

    #[test]
    fn the_whole_code_is_resident_ahead_of_a_restore() {
        let bytes = ahead_of_restore().expect("map ahead");
        let (rss, size) = own_code_resident_kib();
        assert!(
            bytes as u64 >= size << 10,
            "mapped {bytes} bytes, less than the code's {size} KiB"
        );
        assert_eq!(rss, size, "resident KiB of the test binary's code");
    }
}
