//! The min image builds (guest/rootfs/min/build) and holds what a boot
//! needs: /sbin/init pointing at a static tine-agent, busybox and its
//! applets, and the minimal /etc, all owned by root. Needs e2fsprogs,
//! binutils and busybox-static (scripts/setup installs them).

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn debugfs(img: &Path, request: &str) -> String {
    let out = Command::new("debugfs")
        .arg("-R")
        .arg(request)
        .arg(img)
        .output()
        .expect("run debugfs (apt-get install e2fsprogs)");
    assert!(out.status.success(), "debugfs -R {request:?} failed");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `debugfs ls -l` lines as (mode, uid, name).
fn listing(img: &Path, dir: &str) -> Vec<(String, String, String)> {
    debugfs(img, &format!("ls -l {dir}"))
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some((
                f.get(1)?.to_string(),
                f.get(3)?.to_string(),
                f.last()?.to_string(),
            ))
        })
        .collect()
}

fn build(cache: &Path) -> (PathBuf, String) {
    let out = Command::new(repo().join("guest/rootfs/min/build"))
        .env("XDG_CACHE_HOME", cache)
        .output()
        .expect("run guest/rootfs/min/build");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "the image build failed:\n{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let dir = stdout.lines().last().expect("output directory line");
    (PathBuf::from(dir.trim()), stderr)
}

#[test]
fn test_min_image_builds_and_is_cached() {
    let cache = tempfile::tempdir().expect("tempdir");
    let (dir, _) = build(cache.path());
    assert!(dir.starts_with(cache.path().join("tine/images/min")));
    let img = dir.join("rootfs.ext4");
    let len = std::fs::metadata(&img).expect("rootfs.ext4").len();
    assert_eq!(len, 256 << 20, "default size is 256 MiB");

    let fsck = Command::new("e2fsck")
        .args(["-fn"])
        .arg(&img)
        .output()
        .expect("run e2fsck");
    assert!(
        fsck.status.success(),
        "e2fsck: {}",
        String::from_utf8_lossy(&fsck.stdout)
    );

    let root = listing(&img, "/");
    for d in [
        "bin", "sbin", "etc", "proc", "sys", "dev", "run", "tmp", "usr", "var",
    ] {
        assert!(
            root.iter().any(|(_, _, n)| n == d),
            "/{d} missing: {root:?}"
        );
    }
    assert!(
        root.iter().all(|(_, uid, _)| uid == "0"),
        "not all root's: {root:?}"
    );
    let tmp = root.iter().find(|(_, _, n)| n == "tmp").expect("tmp");
    assert_eq!(tmp.0, "41777");

    let init = debugfs(&img, "stat /sbin/init");
    assert!(init.contains("Type: symlink"), "{init}");
    assert!(init.contains("\"/usr/bin/tine-agent\""), "{init}");
    let agent = debugfs(&img, "stat /usr/bin/tine-agent");
    assert!(
        agent.contains("Type: regular") && agent.contains("Mode:  0755"),
        "{agent}"
    );

    let bin = listing(&img, "/bin");
    let busybox = bin
        .iter()
        .find(|(_, _, n)| n == "busybox")
        .expect("busybox");
    assert_eq!(busybox.0, "100755");
    let sh = debugfs(&img, "stat /bin/sh");
    assert!(sh.contains("\"/bin/busybox\""), "{sh}");
    let sbin = listing(&img, "/sbin");
    assert!(sbin.iter().any(|(_, _, n)| n == "poweroff"));

    let passwd = debugfs(&img, "cat /etc/passwd");
    assert!(passwd.starts_with("root:x:0:0:"), "{passwd}");
    let etc = listing(&img, "/etc");
    for f in [
        "group",
        "hosts",
        "hostname",
        "resolv.conf",
        "shadow",
        "tine",
    ] {
        assert!(etc.iter().any(|(_, _, n)| n == f), "/etc/{f} missing");
    }
    let shadow = etc.iter().find(|(_, _, n)| n == "shadow").expect("shadow");
    assert_eq!(shadow.0, "100640");

    // The agent in the image is the static one that was built.
    let manifest = std::fs::read_to_string(dir.join("manifest")).expect("manifest");
    assert!(manifest.contains("tine-agent "), "{manifest}");

    // Same inputs: the cached image, at once.
    let (again, stderr) = build(cache.path());
    assert_eq!(again, dir);
    assert!(stderr.contains("cached"), "{stderr}");
}
