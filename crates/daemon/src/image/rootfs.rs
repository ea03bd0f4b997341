//! Turning an image's unpacked root into a bootable ext4 base: the static
//! agent installed as `/sbin/init`, the directories PID 1 needs, the exec
//! defaults where the agent reads them, and `mkfs.ext4 -d`.

use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use tine_proto::api::ImageExecDefaults;

use super::layers::resolve_in_root;

/// Where the agent is installed in a converted image.
pub const AGENT_PATH: &str = "usr/bin/tine-agent";
/// The exec defaults file the agent reads (from the guest's `/`).
pub const DEFAULTS_PATH: &str = "etc/tine/image.json";
/// Free space a converted image gets beyond its content.
const HEADROOM_BYTES: u64 = 256 << 20;
/// Sizes are rounded up to this.
const SIZE_STEP: u64 = 64 << 20;

/// Errors making the root bootable or the file system.
#[derive(Debug, thiserror::Error)]
pub enum RootfsError {
    /// The image has no shell.
    #[error(
        "the image has no /bin/sh (tine's exec runs commands with it); add a shell to the image"
    )]
    NoShell,
    /// Writing into the root failed.
    #[error("cannot {what}")]
    Io {
        /// What was being done.
        what: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A tool is missing.
    #[error("{tool} not found (looked in $PATH, /sbin, /usr/sbin); install e2fsprogs")]
    MissingTool {
        /// The tool.
        tool: &'static str,
    },
    /// A tool failed.
    #[error("{tool} failed ({status}): {stderr}")]
    Tool {
        /// The tool.
        tool: &'static str,
        /// Its exit status.
        status: String,
        /// The end of what it printed.
        stderr: String,
    },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> RootfsError {
    let what = what.into();
    move |source| RootfsError::Io { what, source }
}

/// Installs `agent` as `/usr/bin/tine-agent` and `/sbin/init` (whatever
/// was there is replaced), makes `/proc /sys /dev /run /tmp`, and writes
/// `defaults` to `/etc/tine/image.json`.
pub fn install_agent(
    root: &Path,
    agent: &Path,
    defaults: &ImageExecDefaults,
) -> Result<(), RootfsError> {
    let dest = resolve_in_root(root, Path::new(AGENT_PATH), false)
        .map_err(io_err(format!("resolve /{AGENT_PATH} in the image")))?;
    replace_with(&dest, |p| {
        std::fs::copy(agent, p)?;
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755))
    })
    .map_err(io_err(format!(
        "install the agent {} as /{AGENT_PATH}",
        agent.display()
    )))?;
    let init = resolve_in_root(root, Path::new("sbin/init"), false)
        .map_err(io_err("resolve /sbin/init in the image"))?;
    replace_with(&init, |p| {
        std::os::unix::fs::symlink(format!("/{AGENT_PATH}"), p)
    })
    .map_err(io_err("link /sbin/init to the agent"))?;
    for (dir, mode) in [
        ("proc", 0o555),
        ("sys", 0o555),
        ("dev", 0o755),
        ("run", 0o755),
        ("tmp", 0o1777),
    ] {
        let path = resolve_in_root(root, Path::new(dir), true)
            .map_err(io_err(format!("resolve /{dir} in the image")))?;
        if !path.is_dir() {
            replace_with(&path, |p| {
                std::fs::create_dir(p)?;
                std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
            })
            .map_err(io_err(format!("make /{dir}")))?;
        }
    }
    let json = serde_json::to_vec_pretty(defaults)
        .map_err(|e| io_err("encode the exec defaults")(io::Error::other(e)))?;
    let path = resolve_in_root(root, Path::new(DEFAULTS_PATH), false)
        .map_err(io_err(format!("resolve /{DEFAULTS_PATH}")))?;
    replace_with(&path, |p| std::fs::write(p, &json))
        .map_err(io_err(format!("write /{DEFAULTS_PATH}")))?;
    Ok(())
}

/// Removes what is at `path` (its parents made), then `make`s it.
fn replace_with(path: &Path, make: impl FnOnce(&Path) -> io::Result<()>) -> io::Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path)?,
        Ok(_) => std::fs::remove_file(path)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    make(path)
}

/// Checks that `/bin/sh` resolves to a file inside the root.
pub fn check_shell(root: &Path) -> Result<(), RootfsError> {
    match resolve_in_root(root, Path::new("bin/sh"), true) {
        Ok(p) if p.is_file() => Ok(()),
        _ => Err(RootfsError::NoShell),
    }
}

/// Bytes the tree at `root` needs on ext4: 4 KiB per block of content plus
/// an inode's worth per entry.
pub fn content_bytes(root: &Path) -> io::Result<u64> {
    const BLOCK: u64 = 4096;
    let mut total = 0u64;
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let entry = entry?;
            let meta = entry.metadata()?;
            total += BLOCK + meta.len().div_ceil(BLOCK) * BLOCK;
            if meta.is_dir() {
                stack.push(entry.path());
            }
        }
    }
    Ok(total)
}

/// The size of the file system for `content` bytes: the content, a
/// quarter more, 256 MiB of headroom, rounded up to 64 MiB.
pub fn fs_size(content: u64) -> u64 {
    let want = content + content / 4 + HEADROOM_BYTES;
    want.div_ceil(SIZE_STEP) * SIZE_STEP
}

/// A tool from e2fsprogs, on `$PATH` or in the sbin directories.
pub fn find_tool(tool: &'static str) -> Result<PathBuf, RootfsError> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    dirs.extend(["/usr/sbin", "/sbin"].map(PathBuf::from));
    dirs.into_iter()
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
        .ok_or(RootfsError::MissingTool { tool })
}

fn run(tool: &'static str, cmd: &mut Command) -> Result<(), RootfsError> {
    let out = cmd.output().map_err(io_err(format!("run {tool}")))?;
    if out.status.success() {
        return Ok(());
    }
    let text = String::from_utf8_lossy(&out.stderr);
    let tail: String = text
        .chars()
        .rev()
        .take(2000)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    Err(RootfsError::Tool {
        tool,
        status: out.status.to_string(),
        stderr: tail.trim().to_owned(),
    })
}

/// Writes the ext4 file system `out` of `size` bytes holding `root`, as the
/// min image's builder does, and checks it with `e2fsck`.
pub fn make_ext4(root: &Path, out: &Path, size: u64) -> Result<(), RootfsError> {
    let mkfs = find_tool("mkfs.ext4")?;
    let fsck = find_tool("e2fsck")?;
    let file = std::fs::File::create(out).map_err(io_err(format!("create {}", out.display())))?;
    file.set_len(size)
        .map_err(io_err(format!("size {}", out.display())))?;
    drop(file);
    // -T default: 4 KiB blocks even when small; -m 0: no blocks reserved
    // for root on a single-user guest.
    run(
        "mkfs.ext4",
        Command::new(mkfs)
            .args(["-q", "-F", "-T", "default", "-b", "4096", "-m", "0"])
            .args(["-L", "tine-image", "-E", "root_owner=0:0", "-d"])
            .arg(root)
            .arg(out),
    )?;
    run("e2fsck", Command::new(fsck).arg("-fn").arg(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agent_becomes_init_and_pid1_dirs_exist() {
        let dir = tempfile::tempdir().expect("tmp");
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("usr/sbin")).expect("usr/sbin");
        // Merged /usr: /sbin is a link, /sbin/init an old init.
        std::os::unix::fs::symlink("usr/sbin", root.join("sbin")).expect("sbin");
        std::fs::write(root.join("usr/sbin/init"), "old init").expect("init");
        let agent = dir.path().join("agent");
        std::fs::write(&agent, "agent bytes").expect("agent");
        let defaults = ImageExecDefaults {
            env: vec!["A=1".into()],
            workdir: Some("/srv".into()),
            ..Default::default()
        };
        install_agent(&root, &agent, &defaults).expect("install");
        assert_eq!(
            std::fs::read_link(root.join("usr/sbin/init")).expect("link"),
            Path::new("/usr/bin/tine-agent")
        );
        assert_eq!(
            std::fs::read(root.join(AGENT_PATH)).expect("agent"),
            b"agent bytes"
        );
        for d in ["proc", "sys", "dev", "run", "tmp"] {
            assert!(root.join(d).is_dir(), "{d}");
        }
        let back: ImageExecDefaults =
            serde_json::from_slice(&std::fs::read(root.join(DEFAULTS_PATH)).expect("json"))
                .expect("parse");
        assert_eq!(back, defaults);
    }

    #[test]
    fn a_root_without_a_shell_is_refused() {
        let dir = tempfile::tempdir().expect("tmp");
        let err = check_shell(dir.path()).expect_err("no shell");
        assert!(err.to_string().contains("no /bin/sh"), "{err}");
        std::fs::create_dir_all(dir.path().join("bin")).expect("bin");
        std::fs::write(dir.path().join("bin/busybox"), "bb").expect("bb");
        std::os::unix::fs::symlink("/bin/busybox", dir.path().join("bin/sh")).expect("sh");
        check_shell(dir.path()).expect("a link inside the root counts");
    }

    #[test]
    fn sizes_have_headroom_and_round_up() {
        assert_eq!(fs_size(0), 256 << 20);
        assert_eq!(fs_size(100 << 20), 384 << 20);
    }
}
