//! What the kernel says of a process's memory: `/proc/PID/smaps_rollup`
//! (RSS, PSS, USS of the whole process) and `/proc/PID/smaps` (the same
//! per mapping, with `Anonymous`), parsed from their text.
//!
//! It lives here, in the crate every other one already depends on, so
//! that the daemon (describe and stats), the VMM's benches and tests and
//! anything else can read a VMM's memory the same way without depending on
//! one another. Parsing only: the caller reads the files (and checks that
//! the pid is still the process it means).
//!
//! Copied guest pages. A VM restored from a snapshot maps the snapshot's
//! memory file `MAP_PRIVATE`: its guest RAM is shared through the page
//! cache with every VM restored from that file, and a page the guest
//! writes is copied into an anonymous page of its own. The kernel counts
//! those copies as `Anonymous` of that mapping, so
//! [`copied_guest_bytes`] is what the VM has copied since its restore. A
//! VM booted from scratch maps a memfd `MAP_SHARED` instead: nothing is
//! shared with another VM, every page it touched is its own (counted in
//! its USS), and there is no copy to count: `None`.

/// Bytes in a kB figure of smaps (the kernel's "kB" is KiB).
const KIB: u64 = 1024;

/// A process's memory from `smaps_rollup`, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Memory {
    /// Resident.
    pub rss: u64,
    /// Proportional share: each resident page divided by the number of
    /// processes that map it.
    pub pss: u64,
    /// Private pages, clean and dirty: mapped by no other process (USS).
    pub uss: u64,
    /// Swapped out.
    pub swap: u64,
}

/// The `Key:   N kB` lines of one block, folded into `m`.
fn fold_line(m: &mut Memory, anonymous: &mut u64, key: &str, bytes: u64) {
    match key {
        "Rss" => m.rss = bytes,
        "Pss" => m.pss = bytes,
        "Private_Clean" | "Private_Dirty" => m.uss = m.uss.saturating_add(bytes),
        "Swap" => m.swap = bytes,
        "Anonymous" => *anonymous = bytes,
        _ => {}
    }
}

/// A `Key:   N kB` line as `(key, bytes)`; `None` for anything else (a
/// mapping's header, `VmFlags:`, `THPeligible:`).
fn figure(line: &str) -> Option<(&str, u64)> {
    let (key, rest) = line.split_once(':')?;
    let mut words = rest.split_ascii_whitespace();
    let n = words.next()?.parse::<u64>().ok()?;
    if words.next() != Some("kB") {
        return None;
    }
    Some((key, n.saturating_mul(KIB)))
}

/// `Rss`, `Pss`, `Private_Clean + Private_Dirty` and `Swap` of
/// `/proc/PID/smaps_rollup` (or of a whole `smaps`: the last block's
/// figures win, so use [`parse_smaps`] for that).
pub fn parse_rollup(text: &str) -> Memory {
    let mut m = Memory::default();
    let mut anonymous = 0;
    for (key, bytes) in text.lines().filter_map(figure) {
        fold_line(&mut m, &mut anonymous, key, bytes);
    }
    m
}

/// One mapping of `/proc/PID/smaps`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Mapping {
    /// First address.
    pub start: u64,
    /// Address past the end.
    pub end: u64,
    /// `rwxp` / `rw-s`: readable, writable, executable, private or shared.
    pub perms: String,
    /// Offset in the file.
    pub offset: u64,
    /// The file's device, `major:minor` in hex as the kernel writes it.
    pub dev: String,
    /// The file's inode; 0 for an anonymous mapping.
    pub inode: u64,
    /// The path (`" (deleted)"` after it when the name is gone), a
    /// pseudo-path (`[heap]`, `/memfd:NAME`), or empty.
    pub path: String,
    /// Its figures.
    pub memory: Memory,
    /// Anonymous pages in it, in bytes: in a private file mapping, the
    /// pages copied on write.
    pub anonymous: u64,
}

impl Mapping {
    /// Bytes of address space.
    pub fn size(&self) -> u64 {
        self.end.saturating_sub(self.start)
    }

    /// A private (copy-on-write) mapping of a file.
    pub fn is_private_file(&self) -> bool {
        self.inode != 0 && self.perms.as_bytes().get(3) == Some(&b'p')
    }
}

/// A mapping's header line (`START-END PERMS OFFSET DEV INODE [PATH]`),
/// or `None` for any other line.
fn header(line: &str) -> Option<Mapping> {
    let mut rest = line;
    let mut word = || {
        let trimmed = rest.trim_start_matches(' ');
        let end = trimmed.find(' ').unwrap_or(trimmed.len());
        let (w, r) = trimmed.split_at(end);
        rest = r;
        w
    };
    let (start, end) = word().split_once('-')?;
    let start = u64::from_str_radix(start, 16).ok()?;
    let end = u64::from_str_radix(end, 16).ok()?;
    let perms = word();
    if perms.len() != 4 {
        return None;
    }
    let perms = perms.to_owned();
    let offset = u64::from_str_radix(word(), 16).ok()?;
    let dev = word();
    if !dev.contains(':') {
        return None;
    }
    let dev = dev.to_owned();
    let inode = word().parse().ok()?;
    // The path is the rest of the line, spaces and all.
    let path = rest.trim_start_matches(' ').to_owned();
    Some(Mapping {
        start,
        end,
        perms,
        offset,
        dev,
        inode,
        path,
        ..Mapping::default()
    })
}

/// The mappings of `/proc/PID/smaps` with their figures; lines it does
/// not know are skipped.
pub fn parse_smaps(text: &str) -> Vec<Mapping> {
    let mut out: Vec<Mapping> = Vec::new();
    for line in text.lines() {
        if let Some((key, bytes)) = figure(line) {
            if let Some(m) = out.last_mut() {
                fold_line(&mut m.memory, &mut m.anonymous, key, bytes);
            }
        } else if let Some(m) = header(line) {
            out.push(m);
        }
    }
    out
}

/// Bytes of guest RAM a VM of `ram_bytes` has copied on write, from its
/// VMM's mappings: the `Anonymous` pages of the private mappings of the
/// one file that backs all of its guest RAM (the snapshot's memory file:
/// the file whose private mappings add up to `ram_bytes`; guest RAM may be
/// two mappings, around the 32-bit MMIO hole). `None` when no file is
/// mapped that way: a booted VM (its RAM is a shared memfd), or a VMM
/// that has not restored yet.
pub fn copied_guest_bytes(mappings: &[Mapping], ram_bytes: u64) -> Option<u64> {
    if ram_bytes == 0 {
        return None;
    }
    let mut files: Vec<(&str, u64, u64, u64)> = Vec::new();
    for m in mappings.iter().filter(|m| m.is_private_file()) {
        match files.iter_mut().find(|f| f.0 == m.dev && f.1 == m.inode) {
            Some(f) => {
                f.2 = f.2.saturating_add(m.size());
                f.3 = f.3.saturating_add(m.anonymous);
            }
            None => files.push((&m.dev, m.inode, m.size(), m.anonymous)),
        }
    }
    files.into_iter().find(|f| f.2 == ram_bytes).map(|f| f.3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rollup_gives_rss_pss_uss_and_swap() {
        let text = "\
55d0c0000000-7ffd4a3f2000 ---p 00000000 00:00 0                          [rollup]
Rss:              262144 kB
Pss:              131072 kB
Pss_Anon:           1024 kB
Shared_Clean:     131072 kB
Private_Clean:      1024 kB
Private_Dirty:    130048 kB
Swap:                  8 kB
";
        assert_eq!(
            parse_rollup(text),
            Memory {
                rss: 256 << 20,
                pss: 128 << 20,
                uss: 128 << 20,
                swap: 8 << 10,
            }
        );
        assert_eq!(parse_rollup("garbage\nRss: lots kB\n"), Memory::default());
    }

    /// A restored tine-vmm's smaps, cut down: its binary, the heap, a
    /// 64 MiB guest's RAM as a private mapping of the memory file (whose
    /// name has a space and was removed), one anonymous page, a memfd.
    const RESTORED: &str = "\
5581a2e00000-5581a2f00000 r-xp 00000000 fd:01 1311 /usr/bin/tine-vmm
Size:               1024 kB
Rss:                 800 kB
Pss:                 400 kB
Private_Clean:        12 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
VmFlags: rd ex mr mw me sd
5581a2f00000-5581a2f10000 rw-p 00100000 fd:01 1311 /usr/bin/tine-vmm
Size:                 64 kB
Rss:                  64 kB
Pss:                  64 kB
Private_Clean:         0 kB
Private_Dirty:        64 kB
Anonymous:            40 kB
5581a4000000-5581a4100000 rw-p 00000000 00:00 0 [heap]
Size:               1024 kB
Rss:                 200 kB
Pss:                 200 kB
Private_Dirty:       200 kB
Anonymous:           200 kB
7f0000000000-7f0004000000 rw-p 00000000 fd:01 4242 /srv/tine/commits/a b/memory (deleted)
Size:              65536 kB
KernelPageSize:        4 kB
Rss:                 500 kB
Pss:                 130 kB
Shared_Clean:        400 kB
Private_Clean:         0 kB
Private_Dirty:       100 kB
Referenced:          500 kB
Anonymous:           100 kB
THPeligible:    0
VmFlags: rd wr mr mw me nr
7f0010000000-7f0010001000 rw-p 00000000 00:00 0 
Size:                  4 kB
Rss:                   4 kB
Private_Dirty:         4 kB
Anonymous:             4 kB
7f0020000000-7f0024000000 rw-s 00000000 00:01 99 /memfd:tine-guest-ram (deleted)
Size:              65536 kB
Rss:                1024 kB
Private_Dirty:      1024 kB
Anonymous:             0 kB
";

    #[test]
    fn smaps_gives_each_mapping_and_its_figures() {
        let maps = parse_smaps(RESTORED);
        assert_eq!(maps.len(), 6);
        let ram = &maps[3];
        assert_eq!(ram.start, 0x7f00_0000_0000);
        assert_eq!(ram.size(), 64 << 20);
        assert_eq!(ram.perms, "rw-p");
        assert_eq!((ram.dev.as_str(), ram.inode), ("fd:01", 4242));
        assert_eq!(ram.path, "/srv/tine/commits/a b/memory (deleted)");
        assert_eq!(ram.anonymous, 100 << 10);
        assert_eq!(ram.memory.rss, 500 << 10);
        assert_eq!(ram.memory.pss, 130 << 10);
        assert_eq!(ram.memory.uss, 100 << 10);
        assert!(ram.is_private_file());
        assert_eq!(maps[4].path, "");
        assert!(!maps[4].is_private_file(), "anonymous");
        assert!(!maps[5].is_private_file(), "shared memfd");
        assert_eq!(maps[1].offset, 0x10_0000);
    }

    #[test]
    fn copied_pages_are_the_anonymous_pages_of_the_guest_ram_file() {
        let maps = parse_smaps(RESTORED);
        // The binary's relocated data (also anonymous, in a private file
        // mapping) is not guest RAM: its file is not RAM-sized.
        assert_eq!(copied_guest_bytes(&maps, 64 << 20), Some(100 << 10));
        assert_eq!(copied_guest_bytes(&maps, 128 << 20), None);
        assert_eq!(copied_guest_bytes(&maps, 0), None);
    }

    #[test]
    fn guest_ram_in_two_mappings_of_one_file_adds_up() {
        let text = "\
100000000-1c0000000 rw-p 00000000 fd:01 7 /m
Anonymous:          8 kB
200000000-240000000 rw-p c0000000 fd:01 7 /m
Anonymous:          4 kB
";
        assert_eq!(
            copied_guest_bytes(&parse_smaps(text), 0x1_0000_0000),
            Some(12 << 10)
        );
    }

    #[test]
    fn a_booted_vm_has_no_copied_pages() {
        let booted: String = RESTORED
            .lines()
            .filter(|l| !l.contains("commits"))
            .collect::<Vec<_>>()
            .join("\n");
        // Without the memory file's header its lines fold into the heap.
        assert_eq!(copied_guest_bytes(&parse_smaps(&booted), 64 << 20), None);
        assert_eq!(copied_guest_bytes(&[], 64 << 20), None);
    }
}
