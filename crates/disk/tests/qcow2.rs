//! qcow2 interoperability with qemu: files tine writes pass `qemu-img
//! check` and read back identically through qemu; files qemu writes read
//! back correctly through tine. Needs `qemu-img` (and `qemu-io` for some
//! tests); a test fails, naming the tool, when one is missing. No KVM.

use std::path::{Path, PathBuf};
use std::process::Command;

use tine_disk::qcow2::{create, CreateOptions, Durability};
use tine_disk::{
    backing_chain, check, create_empty, create_overlay, flatten, info, open_disk, BlockBackend,
    Format, Qcow2,
};

/// splitmix64, seeded.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// Fails the test when an interop tool is missing: these tests exist to
/// check our files against QEMU's tools, and must never pass without them.
fn require(tool: &str) {
    if let Err(e) = Command::new(tool).arg("--version").output() {
        panic!("{tool} is needed for the qcow2 interop tests ({e}); scripts/setup installs it (qemu-utils)");
    }
}

fn run(cmd: &mut Command) -> std::process::Output {
    let out = cmd.output().expect("spawn");
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `qemu-img check` exits 0: no corruption, no leak.
fn qemu_check(path: &Path) {
    run(Command::new("qemu-img").args(["check", "-q"]).arg(path));
}

/// The disk's contents as qemu reads them.
fn qemu_contents(path: &Path) -> Vec<u8> {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("out.raw");
    run(Command::new("qemu-img")
        .args(["convert", "-O", "raw"])
        .arg(path)
        .arg(&out));
    std::fs::read(&out).expect("read converted")
}

fn our_contents(path: &Path) -> Vec<u8> {
    let mut disk = open_disk(path, true).expect("open");
    let mut buf = vec![0u8; disk.size() as usize];
    disk.read_at(&mut buf, 0).expect("read");
    buf
}

fn random_writes(path: &Path, model: &mut [u8], seed: u64, writes: usize, max_len: u64) {
    let mut rng = Rng(seed);
    let size = model.len() as u64;
    let mut disk = Qcow2::open(path, false).expect("open");
    for _ in 0..writes {
        let len = 1 + rng.below(max_len);
        let offset = rng.below(size - len + 1);
        let mut data = vec![0u8; len as usize];
        rng.fill(&mut data);
        disk.write_at(&data, offset).expect("write");
        model[offset as usize..(offset + len) as usize].copy_from_slice(&data);
    }
    disk.flush().expect("flush");
}

#[test]
fn test_qemu_accepts_and_reads_our_images() {
    require("qemu-img");
    for (cluster_size, size, writes) in [
        (512u64, 12u64 << 20, 3000),
        (4096, 8 << 20, 500),
        (65536, 32 << 20, 300),
        (2 << 20, 16 << 20, 50),
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("disk.qcow2");
        create(
            &path,
            &CreateOptions {
                virtual_size: Some(size),
                cluster_size,
                backing: None,
                durability: Durability::Synced,
            },
        )
        .expect("create");
        qemu_check(&path);
        let mut model = vec![0u8; size as usize];
        random_writes(
            &path,
            &mut model,
            cluster_size,
            writes,
            4 * cluster_size.min(65536),
        );
        qemu_check(&path);
        assert!(qemu_contents(&path) == model, "cluster size {cluster_size}");
        assert!(check(&path).expect("check").is_clean());
    }
}

#[test]
fn test_qemu_accepts_our_image_after_refcount_table_growth() {
    require("qemu-img");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("grow.qcow2");
    create(
        &path,
        &CreateOptions {
            virtual_size: Some(24 << 20),
            cluster_size: 512,
            backing: None,
            durability: Durability::Synced,
        },
    )
    .expect("create");
    let mut model = vec![0u8; 24 << 20];
    // Sequential 64 KiB writes over 20 MiB: far past one refcount table
    // cluster (8 MiB of file with 512-byte clusters).
    let mut disk = Qcow2::open(&path, false).expect("open");
    let mut rng = Rng(11);
    for i in 0..320u64 {
        let mut data = vec![0u8; 65536];
        rng.fill(&mut data);
        let offset = i * 65536 + (i % 7) * 100;
        disk.write_at(&data, offset).expect("write");
        model[offset as usize..offset as usize + 65536].copy_from_slice(&data);
    }
    disk.flush().expect("flush");
    drop(disk);
    assert!(
        Qcow2::open(&path, true)
            .expect("open")
            .header()
            .refcount_table_clusters
            > 1
    );
    qemu_check(&path);
    assert!(qemu_contents(&path) == model);
}

#[test]
fn test_qemu_reads_our_chain_and_lists_it() {
    require("qemu-img");
    let dir = tempfile::tempdir().expect("tempdir");
    let base = dir.path().join("base.raw");
    let mut model = vec![0u8; 5 << 20];
    Rng(5).fill(&mut model[..(2 << 20)]);
    std::fs::write(&base, &model).expect("base");
    let mid = dir.path().join("mid.qcow2");
    let top = dir.path().join("top.qcow2");
    create_overlay(&mid, &base, Format::Raw, None).expect("mid");
    random_writes(&mid, &mut model, 1, 100, 100_000);
    create_overlay(&top, &mid, Format::Qcow2, Some(6 << 20)).expect("top");
    model.resize(6 << 20, 0);
    random_writes(&top, &mut model, 2, 100, 100_000);
    for path in [&mid, &top] {
        qemu_check(path);
    }
    assert!(qemu_contents(&top) == model);

    let out = run(Command::new("qemu-img")
        .args(["info", "--backing-chain", "--output=json"])
        .arg(&top));
    let chain: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let chain = chain.as_array().expect("array");
    assert_eq!(chain.len(), 3);
    let field = |i: usize, key: &str| chain[i][key].as_str().map(str::to_string);
    assert_eq!(field(0, "format").as_deref(), Some("qcow2"));
    assert_eq!(
        field(0, "backing-filename"),
        Some(mid.display().to_string())
    );
    assert_eq!(
        field(0, "backing-filename-format").as_deref(),
        Some("qcow2")
    );
    assert_eq!(chain[0]["virtual-size"].as_u64(), Some(6 << 20));
    assert_eq!(field(1, "format").as_deref(), Some("qcow2"));
    assert_eq!(field(1, "backing-filename-format").as_deref(), Some("raw"));
    assert_eq!(field(2, "format").as_deref(), Some("raw"));
    assert_eq!(field(2, "filename"), Some(base.display().to_string()));

    let ours = backing_chain(&top).expect("chain");
    let paths: Vec<PathBuf> = ours.iter().map(|i| i.path.clone()).collect();
    assert_eq!(paths, [top.clone(), mid.clone(), base.clone()]);

    // Flattened: same contents as the chain, standalone.
    let flat = dir.path().join("flat.qcow2");
    flatten(&top, &flat).expect("flatten");
    qemu_check(&flat);
    run(Command::new("qemu-img").arg("compare").arg(&flat).arg(&top));
    assert_eq!(info(&flat).expect("info").backing, None);
}

#[test]
fn test_we_read_and_write_qemu_images() {
    require("qemu-img");
    require("qemu-io");
    for opts in [
        "compat=1.1,cluster_size=65536",
        "compat=0.10,cluster_size=65536",
        "compat=1.1,cluster_size=512",
        "compat=1.1,cluster_size=2097152",
        "compat=1.1,refcount_bits=1,cluster_size=4096",
        "compat=1.1,refcount_bits=64,cluster_size=4096",
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = dir.path().join("base.raw");
        let mut model = vec![0u8; 8 << 20];
        Rng(9).fill(&mut model);
        std::fs::write(&base, &model).expect("base");
        let top = dir.path().join("top.qcow2");
        run(Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-o", opts, "-b"])
            .arg(&base)
            .args(["-F", "raw"])
            .arg(&top));
        let mut io = Command::new("qemu-io");
        io.args(["-f", "qcow2"])
            .args(["-c", "write -P 0xab 0 1M"])
            .args(["-c", "write -P 0xcd 3000000 100000"])
            .args(["-c", "write -P 0x11 7340032 512"]);
        let v3 = opts.contains("compat=1.1");
        if v3 {
            io.args(["-c", "write -z 5M 128k"]);
        }
        run(io.arg(&top));
        model[..1 << 20].fill(0xab);
        model[3_000_000..3_100_000].fill(0xcd);
        model[7_340_032..7_340_544].fill(0x11);
        if v3 {
            model[5 << 20..(5 << 20) + (128 << 10)].fill(0);
        }
        assert!(our_contents(&top) == model, "{opts}");
        assert!(check(&top).expect("check").is_clean(), "{opts}");

        // Our writes on qemu's image, checked by qemu.
        let mut extra = model.clone();
        random_writes(&top, &mut extra, 4, 200, 200_000);
        qemu_check(&top);
        assert!(qemu_contents(&top) == extra, "{opts}");
    }
}

#[test]
fn test_overlay_on_qemu_image_without_backing_format() {
    require("qemu-img");
    require("qemu-io");
    let dir = tempfile::tempdir().expect("tempdir");
    let base = dir.path().join("base.qcow2");
    run(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&base)
        .arg("4M"));
    run(Command::new("qemu-io")
        .args(["-c", "write -P 0x77 65536 4096"])
        .arg(&base));
    // A qemu overlay whose header names no backing format: probed.
    let top = dir.path().join("top.qcow2");
    run(Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-b"])
        .arg(&base)
        .args(["-F", "qcow2"])
        .arg(&top));
    let mut bytes = std::fs::read(&top).expect("read");
    // Turn the backing format extension into an unknown one.
    let at = bytes
        .windows(4)
        .position(|w| w == 0xe279_2acau32.to_be_bytes())
        .expect("backing format extension");
    bytes[at..at + 4].copy_from_slice(&0x1234_5678u32.to_be_bytes());
    std::fs::write(&top, &bytes).expect("write");
    assert_eq!(info(&top).expect("info").backing_format, None);
    let contents = our_contents(&top);
    assert!(contents[65536..69632].iter().all(|&b| b == 0x77));
    assert!(contents[..65536].iter().all(|&b| b == 0));
}

#[test]
fn test_compressed_clusters_refused_clearly() {
    require("qemu-img");
    let dir = tempfile::tempdir().expect("tempdir");
    let raw = dir.path().join("data.raw");
    std::fs::write(&raw, vec![0x5au8; 1 << 20]).expect("raw");
    let compressed = dir.path().join("c.qcow2");
    run(Command::new("qemu-img")
        .args(["convert", "-c", "-O", "qcow2"])
        .arg(&raw)
        .arg(&compressed));
    let mut disk = open_disk(&compressed, true).expect("open");
    let mut buf = vec![0u8; 65536];
    let err = disk.read_at(&mut buf, 0).expect_err("compressed");
    assert!(err.to_string().contains("compressed"), "{err}");
    // check understands compressed clusters.
    assert!(check(&compressed).expect("check").is_clean());
}

#[test]
fn test_leaks_after_a_crash_agree_with_qemu() {
    require("qemu-img");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("crash.qcow2");
    create_empty(&path, 8 << 20).expect("create");
    let mut disk = Qcow2::open(&path, false).expect("open");
    disk.write_at(&[1; 100_000], 123_456).expect("write");
    std::mem::forget(disk); // as if the process died
    let report = check(&path).expect("check");
    assert!(report.is_ok() && report.leaked_clusters > 0, "{report:?}");
    // qemu-img check: 3 means leaks only.
    let status = Command::new("qemu-img")
        .args(["check", "-q"])
        .arg(&path)
        .status()
        .expect("qemu-img");
    assert_eq!(status.code(), Some(3));
    run(Command::new("qemu-img")
        .args(["check", "-q", "-r", "leaks"])
        .arg(&path));
    qemu_check(&path);
    assert!(check(&path).expect("check").is_clean());
}

#[test]
fn test_our_check_flags_what_qemu_flags() {
    require("qemu-img");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("img.qcow2");
    create_empty(&path, 4 << 20).expect("create");
    let mut disk = Qcow2::open(&path, false).expect("open");
    disk.write_at(&[1; 300_000], 0).expect("write");
    drop(disk);
    // Zero the refcount block: every cluster is in use with refcount 0.
    let h = Qcow2::open(&path, true).expect("open").header().clone();
    let mut bytes = std::fs::read(&path).expect("read");
    let rt = h.refcount_table_offset as usize;
    let rb = u64::from_be_bytes(bytes[rt..rt + 8].try_into().expect("8")) as usize;
    bytes[rb..rb + 65536].fill(0);
    let broken = dir.path().join("broken.qcow2");
    std::fs::write(&broken, &bytes).expect("write");
    let status = Command::new("qemu-img")
        .args(["check", "-q"])
        .arg(&broken)
        .stderr(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .status()
        .expect("qemu-img");
    assert_eq!(status.code(), Some(2), "qemu sees corruption");
    assert!(!check(&broken).expect("check").is_ok());
}
