//! A writer for the `newc` cpio format the Linux kernel unpacks as an
//! initramfs, so tests can make one without external tools or root.

use std::io::{self, Write};

/// One entry to put in the archive.
#[derive(Debug, Clone)]
pub enum Entry {
    /// A directory with permission bits.
    Dir {
        /// Path inside the archive, without a leading slash.
        path: String,
        /// Permission bits (e.g. 0o755).
        mode: u32,
    },
    /// A regular file.
    File {
        /// Path inside the archive.
        path: String,
        /// Permission bits.
        mode: u32,
        /// Contents.
        data: Vec<u8>,
    },
    /// A symbolic link.
    Symlink {
        /// Path inside the archive.
        path: String,
        /// Link target.
        target: String,
    },
}

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;

fn pad4(out: &mut impl Write, len: usize) -> io::Result<()> {
    let pad = (4 - len % 4) % 4;
    out.write_all(&[0u8; 3][..pad])
}

fn write_record(
    out: &mut impl Write,
    ino: u32,
    mode: u32,
    name: &str,
    data: &[u8],
) -> io::Result<()> {
    let name_len = name.len() + 1;
    let header = format!(
        "070701{ino:08x}{mode:08x}{uid:08x}{gid:08x}{nlink:08x}{mtime:08x}{size:08x}\
         {devmajor:08x}{devminor:08x}{rdevmajor:08x}{rdevminor:08x}{namesize:08x}{check:08x}",
        uid = 0,
        gid = 0,
        nlink = if mode & S_IFDIR != 0 { 2 } else { 1 },
        mtime = 0,
        size = data.len(),
        devmajor = 0,
        devminor = 0,
        rdevmajor = 0,
        rdevminor = 0,
        namesize = name_len,
        check = 0,
    );
    out.write_all(header.as_bytes())?;
    out.write_all(name.as_bytes())?;
    out.write_all(&[0])?;
    pad4(out, header.len() + name_len)?;
    out.write_all(data)?;
    pad4(out, data.len())
}

/// Writes `entries` as a complete newc archive (with its trailer) to `out`.
pub fn write_archive(out: &mut impl Write, entries: &[Entry]) -> io::Result<()> {
    for (i, entry) in entries.iter().enumerate() {
        let ino = i as u32 + 1;
        match entry {
            Entry::Dir { path, mode } => write_record(out, ino, S_IFDIR | mode, path, &[])?,
            Entry::File { path, mode, data } => write_record(out, ino, S_IFREG | mode, path, data)?,
            Entry::Symlink { path, target } => {
                write_record(out, ino, S_IFLNK | 0o777, path, target.as_bytes())?
            }
        }
    }
    write_record(out, 0, 0, "TRAILER!!!", &[])
}

/// A minimal busybox initramfs: `/bin/busybox` from the host's
/// busybox-static, `/bin/sh` linked to it, and `init` as `/init`.
pub fn busybox_initramfs(init: &str, extra: Vec<Entry>) -> io::Result<Vec<u8>> {
    let busybox = std::fs::read("/bin/busybox").map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("cannot read /bin/busybox (install busybox-static): {e}"),
        )
    })?;
    let mut entries = vec![
        Entry::Dir {
            path: "bin".into(),
            mode: 0o755,
        },
        Entry::Dir {
            path: "dev".into(),
            mode: 0o755,
        },
        Entry::Dir {
            path: "proc".into(),
            mode: 0o755,
        },
        Entry::Dir {
            path: "sys".into(),
            mode: 0o755,
        },
        Entry::File {
            path: "bin/busybox".into(),
            mode: 0o755,
            data: busybox,
        },
        Entry::Symlink {
            path: "bin/sh".into(),
            target: "busybox".into(),
        },
        Entry::File {
            path: "init".into(),
            mode: 0o755,
            data: init.as_bytes().to_vec(),
        },
    ];
    entries.extend(extra);
    let mut out = Vec::new();
    write_archive(&mut out, &entries)?;
    Ok(out)
}

/// Entries for the host executable `path` at `/bin/<name>` plus the shared
/// libraries `ldd` lists for it, at their host paths, so a dynamically
/// linked host binary runs inside a busybox initramfs.
pub fn host_binary_entries(path: &std::path::Path) -> io::Result<Vec<Entry>> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| io::Error::other(format!("{} has no file name", path.display())))?;
    let mut entries = vec![Entry::File {
        path: format!("bin/{name}"),
        mode: 0o755,
        data: std::fs::read(path)?,
    }];
    let output = std::process::Command::new("ldd").arg(path).output()?;
    let listing = String::from_utf8_lossy(&output.stdout);
    let mut dirs = std::collections::BTreeSet::new();
    for line in listing.lines() {
        // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or
        // "/lib64/ld-linux-x86-64.so.2 (0x...)"
        let lib = line
            .split("=>")
            .nth(1)
            .unwrap_or(line)
            .split_whitespace()
            .next()
            .unwrap_or_default();
        if !lib.starts_with('/') {
            continue;
        }
        let lib_path = std::path::Path::new(lib);
        let data = std::fs::read(lib_path)?;
        let inside = lib.trim_start_matches('/').to_string();
        let mut parent = lib_path.parent();
        while let Some(dir) = parent {
            let text = dir.to_string_lossy().trim_start_matches('/').to_string();
            if text.is_empty() {
                break;
            }
            dirs.insert(text);
            parent = dir.parent();
        }
        entries.push(Entry::File {
            path: inside,
            mode: 0o755,
            data,
        });
    }
    let mut out: Vec<Entry> = dirs
        .into_iter()
        .map(|path| Entry::Dir { path, mode: 0o755 })
        .collect();
    out.extend(entries);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_write_archive_records_are_aligned_and_terminated() {
        let mut out = Vec::new();
        write_archive(
            &mut out,
            &[Entry::File {
                path: "a".into(),
                mode: 0o644,
                data: b"hello".to_vec(),
            }],
        )
        .expect("write");
        assert_eq!(out.len() % 4, 0);
        assert!(out.starts_with(b"070701"));
        let text = String::from_utf8_lossy(&out);
        assert!(text.contains("hello"));
        assert!(text.contains("TRAILER!!!"));
    }

    #[test]
    fn test_write_archive_is_readable_by_cpio() {
        let dir = std::env::temp_dir().join(format!("tine-cpio-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let mut out = Vec::new();
        write_archive(
            &mut out,
            &[
                Entry::Dir {
                    path: "d".into(),
                    mode: 0o755,
                },
                Entry::File {
                    path: "d/f".into(),
                    mode: 0o600,
                    data: b"abc".to_vec(),
                },
                Entry::Symlink {
                    path: "d/l".into(),
                    target: "f".into(),
                },
            ],
        )
        .expect("write");
        let mut child = std::process::Command::new("cpio")
            .args(["-i", "--quiet", "-d"])
            .current_dir(&dir)
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("cpio must be installed (scripts/setup installs it)");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(&out)
            .expect("pipe");
        assert!(child.wait().expect("wait").success());
        assert_eq!(std::fs::read(dir.join("d/f")).expect("file"), b"abc");
        assert_eq!(
            std::fs::read_link(dir.join("d/l")).expect("link"),
            std::path::PathBuf::from("f")
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
