//! Tests of the qcow2 reader and writer (no qemu needed; interoperability
//! is tested in tests/qcow2.rs).

use std::io::Write;
use std::path::{Path, PathBuf};

use super::*;
use crate::{backing_chain, detect_format, info, open_disk};

/// splitmix64: a small seeded generator for reproducible tests.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    pub(crate) fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

fn new_image(path: &Path, size: u64, cluster_size: u64) {
    create(
        path,
        &CreateOptions {
            virtual_size: Some(size),
            cluster_size,
            backing: None,
            durability: Durability::Synced,
        },
    )
    .expect("create");
}

fn raw_file(path: &Path, contents: &[u8]) {
    let mut file = File::create(path).expect("create raw");
    file.write_all(contents).expect("write raw");
}

fn read_all(disk: &mut dyn BlockBackend) -> Vec<u8> {
    let mut buf = vec![0u8; disk.size() as usize];
    disk.read_at(&mut buf, 0).expect("read all");
    buf
}

fn hash(path: &Path) -> u64 {
    let bytes = std::fs::read(path).expect("read file");
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in bytes {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    h
}

fn assert_clean(path: &Path) {
    let report = check(path).expect("check");
    assert!(report.is_clean(), "{}: {report:?}", path.display());
}

/// Random writes of mixed sizes at unaligned offsets, compared with an
/// in-memory model, reopening the image every `reopen_every` writes.
fn random_io(path: &Path, model: &mut [u8], seed: u64, writes: usize, max_len: u64) {
    let mut rng = Rng::new(seed);
    let size = model.len() as u64;
    let mut image = Qcow2::open(path, false).expect("open");
    for i in 0..writes {
        let len = 1 + rng.below(max_len);
        let offset = rng.below(size - len + 1);
        let mut data = vec![0u8; len as usize];
        rng.fill(&mut data);
        image.write_at(&data, offset).expect("write");
        model[offset as usize..(offset + len) as usize].copy_from_slice(&data);
        // Read back a random range.
        let rlen = 1 + rng.below(max_len);
        let roff = rng.below(size - rlen + 1);
        let mut got = vec![0u8; rlen as usize];
        image.read_at(&mut got, roff).expect("read");
        assert_eq!(
            got,
            model[roff as usize..(roff + rlen) as usize],
            "write {i}"
        );
        if i % 97 == 96 {
            if rng.below(2) == 0 {
                image.flush().expect("flush");
            }
            drop(image);
            image = Qcow2::open(path, false).expect("reopen");
        }
    }
    image.flush().expect("flush");
    drop(image);
    let mut image = Qcow2::open(path, true).expect("reopen read-only");
    assert!(read_all(&mut image) == model, "contents after reopen");
}

#[test]
fn test_random_io_matches_model_across_cluster_sizes() {
    for (cluster_size, size, writes) in [
        (512u64, 1u64 << 20, 600),
        (4096, 4 << 20, 400),
        (65536, 64 << 20, 300),
    ] {
        let dir = tmp();
        let path = dir.path().join("disk.qcow2");
        new_image(&path, size, cluster_size);
        let mut model = vec![0u8; size as usize];
        random_io(&path, &mut model, cluster_size, writes, 3 * cluster_size);
        assert_clean(&path);
    }
}

#[test]
fn test_refcount_table_growth_keeps_data_and_refcounts() {
    // 512-byte clusters: one refcount table cluster covers 64 blocks of 256
    // clusters, 8 MiB of file; write more than that.
    let dir = tmp();
    let path = dir.path().join("grow.qcow2");
    let size = 16u64 << 20;
    new_image(&path, size, 512);
    let before = Qcow2::open(&path, true)
        .expect("open")
        .header()
        .refcount_table_offset;
    let mut image = Qcow2::open(&path, false).expect("open");
    let mut model = vec![0u8; size as usize];
    let mut rng = Rng::new(7);
    let mut offset = 0u64;
    while offset < 12 << 20 {
        let mut data = vec![0u8; 64 * 1024];
        rng.fill(&mut data);
        image.write_at(&data, offset).expect("write");
        model[offset as usize..offset as usize + data.len()].copy_from_slice(&data);
        offset += data.len() as u64 + 512 * 3;
    }
    image.flush().expect("flush");
    drop(image);
    let image = Qcow2::open(&path, true).expect("reopen");
    assert_ne!(image.header().refcount_table_offset, before, "table moved");
    assert!(image.header().refcount_table_clusters > 1);
    drop(image);
    assert_clean(&path);
    // And it keeps working after the growth.
    random_io(&path, &mut model, 8, 200, 4096);
    assert_clean(&path);
}

#[test]
fn test_new_image_reads_zeros_and_is_clean() {
    let dir = tmp();
    let path = dir.path().join("empty.qcow2");
    create_empty(&path, 10 << 20).expect("create");
    assert_clean(&path);
    let mut image = Qcow2::open(&path, true).expect("open");
    assert_eq!(image.size(), 10 << 20);
    assert!(image.is_read_only());
    assert!(read_all(&mut image).iter().all(|&b| b == 0));
    let mut buf = [0u8; 4];
    assert!(image.write_at(&buf, 0).is_err());
    assert!(image.read_at(&mut buf, (10 << 20) - 3).is_err());
}

#[test]
fn test_create_refuses_existing_path_and_bad_arguments() {
    let dir = tmp();
    let path = dir.path().join("x.qcow2");
    create_empty(&path, 1 << 20).expect("create");
    assert!(create_empty(&path, 1 << 20).is_err());
    let other = dir.path().join("y.qcow2");
    for cluster_size in [256, 3000, 4 << 20] {
        let result = create(
            &other,
            &CreateOptions {
                virtual_size: Some(1 << 20),
                cluster_size,
                backing: None,
                durability: Durability::Synced,
            },
        );
        assert!(result.is_err(), "cluster size {cluster_size}");
    }
    assert!(create_empty(&other, 0).is_err());
    assert!(create(&other, &CreateOptions::default()).is_err());
    // No temporary files left behind.
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .expect("readdir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(names, ["x.qcow2"]);
}

#[test]
fn test_chain_raw_overlay_overlay_and_parents_unchanged() {
    let dir = tmp();
    let base = dir.path().join("base.raw");
    let mut model = vec![0u8; 3 << 20];
    Rng::new(1).fill(&mut model);
    raw_file(&base, &model);
    let mid = dir.path().join("mid.qcow2");
    create_overlay(&mid, &base, Format::Raw, None).expect("overlay");
    let base_hash = hash(&base);

    // Writes in the middle layer.
    let mut image = Qcow2::open(&mid, false).expect("open mid");
    assert_eq!(image.size(), 3 << 20);
    assert_eq!(read_all(&mut image), model);
    image.write_at(&[0xaa; 1000], 70_000).expect("write");
    model[70_000..71_000].fill(0xaa);
    image.flush().expect("flush");
    drop(image);
    assert_eq!(hash(&base), base_hash);

    let top = dir.path().join("top.qcow2");
    create_overlay(&top, &mid, Format::Qcow2, Some(4 << 20)).expect("overlay");
    let mid_hash = hash(&mid);
    let mut image = Qcow2::open(&top, false).expect("open top");
    assert_eq!(image.size(), 4 << 20);
    let mut expect = model.clone();
    expect.resize(4 << 20, 0);
    assert_eq!(read_all(&mut image), expect);
    // A write spanning the end of the backing files.
    image
        .write_at(&[0x55; 8192], (3 << 20) - 4096)
        .expect("write");
    expect[(3 << 20) - 4096..(3 << 20) + 4096].fill(0x55);
    image.write_at(&[1, 2, 3], 65_535).expect("write");
    expect[65_535..65_538].copy_from_slice(&[1, 2, 3]);
    assert_eq!(read_all(&mut image), expect);
    image.flush().expect("flush");
    drop(image);
    assert_eq!(hash(&base), base_hash);
    assert_eq!(hash(&mid), mid_hash);
    for path in [&mid, &top] {
        assert_clean(path);
    }

    let chain = backing_chain(&top).expect("chain");
    let formats: Vec<_> = chain.iter().map(|i| i.format).collect();
    assert_eq!(formats, [Format::Qcow2, Format::Qcow2, Format::Raw]);
    assert_eq!(chain[0].backing.as_deref(), Some(mid.as_path()));
    assert_eq!(chain[0].backing_format, Some(Format::Qcow2));
    assert_eq!(chain[1].backing_format, Some(Format::Raw));
    assert_eq!(chain[2].virtual_size, 3 << 20);
}

#[test]
fn test_two_forks_of_one_parent_are_independent() {
    let dir = tmp();
    let parent = dir.path().join("parent.qcow2");
    new_image(&parent, 2 << 20, 65536);
    let mut image = Qcow2::open(&parent, false).expect("open");
    image.write_at(&[7; 100_000], 1000).expect("write");
    drop(image);
    let parent_hash = hash(&parent);
    let a = dir.path().join("a.qcow2");
    let b = dir.path().join("b.qcow2");
    create_overlay(&a, &parent, Format::Qcow2, None).expect("a");
    create_overlay(&b, &parent, Format::Qcow2, None).expect("b");
    let mut fa = Qcow2::open(&a, false).expect("open a");
    let mut fb = Qcow2::open(&b, false).expect("open b");
    fa.write_at(&[0xa; 5000], 2000).expect("write a");
    fb.write_at(&[0xb; 5000], 4000).expect("write b");
    let mut ga = [0u8; 10];
    let mut gb = [0u8; 10];
    fa.read_at(&mut ga, 5995).expect("read a");
    fb.read_at(&mut gb, 1995).expect("read b");
    assert_eq!(ga, [0xa; 10]);
    assert_eq!(gb, [7, 7, 7, 7, 7, 7, 7, 7, 7, 7]);
    drop((fa, fb));
    assert_eq!(hash(&parent), parent_hash);
}

#[test]
fn test_relative_backing_name_resolves_against_image_directory() {
    let dir = tmp();
    std::fs::create_dir(dir.path().join("sub")).expect("mkdir");
    let base = dir.path().join("sub/base.raw");
    raw_file(&base, &[9u8; 8192]);
    let top = dir.path().join("sub/top.qcow2");
    create(
        &top,
        &CreateOptions {
            backing: Some((PathBuf::from("base.raw"), Format::Raw)),
            ..CreateOptions::default()
        },
    )
    .expect("create");
    let mut image = Qcow2::open(&top, true).expect("open");
    assert_eq!(read_all(&mut image), vec![9u8; 8192]);
    let i = info(&top).expect("info");
    assert_eq!(i.backing.as_deref(), Some(Path::new("base.raw")));
    assert_eq!(i.backing_path.as_deref(), Some(base.as_path()));
}

#[test]
fn test_overlay_of_20_gib_sparse_parent_is_tiny() {
    let dir = tmp();
    let base = dir.path().join("big.raw");
    File::create(&base)
        .and_then(|f| f.set_len(20 << 30))
        .expect("sparse parent");
    let top = dir.path().join("top.qcow2");
    create_overlay(&top, &base, Format::Raw, None).expect("overlay");
    let i = info(&top).expect("info");
    assert_eq!(i.virtual_size, 20 << 30);
    assert!(i.allocated_bytes <= 64 << 10, "{i:?}");
    assert!(i.file_size <= 4 * 65536, "{i:?}");
    assert_clean(&top);
    let mut image = Qcow2::open(&top, false).expect("open");
    image
        .write_at(&[1; 4096], (20 << 30) - 4096)
        .expect("write last");
    let mut buf = [0u8; 4097];
    image.read_at(&mut buf, (20 << 30) - 4097).expect("read");
    assert_eq!(buf[0], 0);
    assert!(buf[1..].iter().all(|&b| b == 1));
    drop(image);
    assert_clean(&top);
    // Smaller than the backing file: refused.
    let small = dir.path().join("small.qcow2");
    assert!(create_overlay(&small, &base, Format::Raw, Some(1 << 30)).is_err());
}

#[test]
fn test_flatten_copies_chain_contents_without_backing() {
    let dir = tmp();
    let base = dir.path().join("base.raw");
    let mut model = vec![0u8; 1 << 20];
    Rng::new(3).fill(&mut model[..300_000]);
    raw_file(&base, &model);
    let top = dir.path().join("top.qcow2");
    create_overlay(&top, &base, Format::Raw, Some(2 << 20)).expect("overlay");
    model.resize(2 << 20, 0);
    let mut image = Qcow2::open(&top, false).expect("open");
    image.write_at(&[3; 70_000], 1_500_000).expect("write");
    model[1_500_000..1_570_000].fill(3);
    drop(image);
    let flat = dir.path().join("flat.qcow2");
    flatten(&top, &flat).expect("flatten");
    let i = info(&flat).expect("info");
    assert_eq!(i.backing, None);
    assert_eq!(i.virtual_size, 2 << 20);
    assert_clean(&flat);
    let mut image = Qcow2::open(&flat, true).expect("open flat");
    assert_eq!(read_all(&mut image), model);
    // Only non-zero clusters: 300 000 bytes (5 clusters) + 70 000 across
    // 2 clusters.
    let report = check(&flat).expect("check");
    assert_eq!(report.data_clusters, 7);
    assert!(flatten(&top, &flat).is_err(), "existing destination");
}

#[test]
fn test_zero_clusters_read_zeros_and_can_be_written() {
    let dir = tmp();
    let base = dir.path().join("base.raw");
    raw_file(&base, &[0xee; 256 * 1024]);
    let top = dir.path().join("top.qcow2");
    create_overlay(&top, &base, Format::Raw, None).expect("overlay");
    let mut image = Qcow2::open(&top, false).expect("open");
    // Allocate cluster 1 (and the L2 table), then turn clusters 1 and 2
    // into zero clusters by hand: 1 keeps its host cluster (preallocated).
    image.write_at(&[1; 65536], 65536).expect("write");
    let (mapping, l2) = image.lookup(1).expect("lookup");
    let Mapping::Data { host, .. } = mapping else {
        panic!("not allocated: {mapping:?}");
    };
    let l2 = l2.expect("l2");
    drop(image);
    let file = OpenOptions::new().write(true).open(&top).expect("open");
    file.write_all_at(&(host | OFLAG_COPIED | OFLAG_ZERO).to_be_bytes(), l2 + 8)
        .expect("patch");
    file.write_all_at(&OFLAG_ZERO.to_be_bytes(), l2 + 16)
        .expect("patch");
    drop(file);
    assert_clean(&top);
    let mut image = Qcow2::open(&top, false).expect("reopen");
    let mut buf = vec![0u8; 4 * 65536];
    image.read_at(&mut buf, 0).expect("read");
    assert!(buf[..65536].iter().all(|&b| b == 0xee));
    assert!(buf[65536..3 * 65536].iter().all(|&b| b == 0));
    assert!(buf[3 * 65536..].iter().all(|&b| b == 0xee));
    // A partial write into a zero cluster keeps zeros around it.
    image.write_at(&[5; 10], 65536 + 100).expect("write");
    image.write_at(&[6; 10], 2 * 65536 + 100).expect("write");
    image.read_at(&mut buf, 0).expect("read");
    assert!(buf[65536..65636].iter().all(|&b| b == 0));
    assert_eq!(buf[65636..65646], [5; 10]);
    assert!(buf[65646..2 * 65536 + 100].iter().all(|&b| b == 0));
    assert_eq!(buf[2 * 65536 + 100..2 * 65536 + 110], [6; 10]);
    drop(image);
    // The preallocated cluster was freed (a hole with refcount 0).
    assert_clean(&top);
}

#[test]
fn test_crash_leaves_only_leaks() {
    let dir = tmp();
    let path = dir.path().join("crash.qcow2");
    new_image(&path, 8 << 20, 4096);
    let mut image = Qcow2::open(&path, false).expect("open");
    image.write_at(&[1; 10_000], 12_345).expect("write");
    // No flush, no drop: as if the process died.
    std::mem::forget(image);
    let report = check(&path).expect("check");
    assert!(report.is_ok(), "{report:?}");
    assert!(report.leaked_clusters > 0, "{report:?}");
    let mut image = Qcow2::open(&path, true).expect("reopen");
    let mut buf = [0u8; 10_000];
    image.read_at(&mut buf, 12_345).expect("read");
    assert_eq!(buf, [1; 10_000]);
    // Writable again, and clean after a flush: leaks stay leaks.
    let mut image = Qcow2::open(&path, false).expect("reopen writable");
    image.write_at(&[2; 10], 1 << 20).expect("write");
    image.flush().expect("flush");
    drop(image);
    let report = check(&path).expect("check");
    assert!(report.is_ok(), "{report:?}");
}

#[test]
fn test_drop_without_flush_leaves_no_leaks() {
    let dir = tmp();
    let path = dir.path().join("d.qcow2");
    new_image(&path, 8 << 20, 65536);
    let mut image = Qcow2::open(&path, false).expect("open");
    image.write_at(&[1; 10], 3 << 20).expect("write");
    drop(image);
    assert_clean(&path);
    // The pool was returned: the file ends after the last used cluster.
    let len = std::fs::metadata(&path).expect("stat").len();
    assert!(len <= 7 * 65536, "{len}");
}

// ---- hostile and unsupported files ----

/// A small valid image with some data, returned as bytes.
fn sample_image(dir: &Path) -> (PathBuf, Vec<u8>) {
    let path = dir.join("sample.qcow2");
    new_image(&path, 4 << 20, 4096);
    let mut image = Qcow2::open(&path, false).expect("open");
    image.write_at(&[0x42; 50_000], 100_000).expect("write");
    drop(image);
    let bytes = std::fs::read(&path).expect("read");
    (path, bytes)
}

fn patched(dir: &Path, name: &str, bytes: &[u8], patch: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let mut bytes = bytes.to_vec();
    patch(&mut bytes);
    let path = dir.join(name);
    std::fs::write(&path, &bytes).expect("write");
    path
}

fn put32(bytes: &mut [u8], at: usize, v: u32) {
    bytes[at..at + 4].copy_from_slice(&v.to_be_bytes());
}

fn put64(bytes: &mut [u8], at: usize, v: u64) {
    bytes[at..at + 8].copy_from_slice(&v.to_be_bytes());
}

/// Opening fails in both modes, reading through `open_disk` too, and
/// `check` reports corruption or fails.
fn assert_rejected(path: &Path) {
    assert!(Qcow2::open(path, true).is_err(), "{}", path.display());
    assert!(Qcow2::open(path, false).is_err(), "{}", path.display());
    if let Ok(report) = check(path) {
        assert!(!report.is_ok(), "{}: {report:?}", path.display());
    }
}

/// Opening may succeed, but every read of the whole disk fails or the
/// writable open is refused; nothing panics.
fn assert_reads_fail(path: &Path) {
    if let Ok(mut image) = Qcow2::open(path, true) {
        let mut buf = vec![0u8; image.size() as usize];
        assert!(image.read_at(&mut buf, 0).is_err(), "{}", path.display());
    }
    assert!(Qcow2::open(path, false).is_err(), "{}", path.display());
    let report = check(path).expect("check");
    assert!(!report.is_ok(), "{}: {report:?}", path.display());
}

#[test]
fn test_hostile_headers_rejected() {
    let dir = tmp();
    let (_, good) = sample_image(dir.path());
    let d = dir.path();
    assert_rejected(&patched(d, "magic", &good, |b| b[0] = b'X'));
    assert_rejected(&patched(d, "zeroed", &good, |b| b[..512].fill(0)));
    assert_rejected(&patched(d, "short", &good, |b| b.truncate(50)));
    assert_rejected(&patched(d, "cbits8", &good, |b| put32(b, 20, 8)));
    assert_rejected(&patched(d, "cbits22", &good, |b| put32(b, 20, 22)));
    assert_rejected(&patched(d, "cbits63", &good, |b| put32(b, 20, 63)));
    assert_rejected(&patched(d, "l1huge", &good, |b| put32(b, 36, u32::MAX)));
    assert_rejected(&patched(d, "l1small", &good, |b| put32(b, 36, 0)));
    assert_rejected(&patched(d, "l1past", &good, |b| put64(b, 40, 1 << 40)));
    assert_rejected(&patched(d, "l1unaligned", &good, |b| {
        put64(b, 40, 4096 * 3 + 8)
    }));
    assert_rejected(&patched(d, "size", &good, |b| put64(b, 24, u64::MAX)));
    assert_rejected(&patched(d, "reft0", &good, |b| put32(b, 56, 0)));
    assert_rejected(&patched(d, "refthuge", &good, |b| put32(b, 56, u32::MAX)));
    assert_rejected(&patched(d, "reftpast", &good, |b| put64(b, 48, 1 << 50)));
    assert_rejected(&patched(d, "hdrlen", &good, |b| put32(b, 100, 4097)));
    assert_rejected(&patched(d, "order", &good, |b| put32(b, 96, 7)));
    assert_rejected(&patched(d, "backing", &good, |b| {
        put64(b, 8, 4000);
        put32(b, 16, 200);
    }));
    for (name, patch) in [("version", (4u32, 4usize)), ("crypt", (1, 32))] {
        let path = patched(d, name, &good, |b| put32(b, patch.1, patch.0));
        assert!(Qcow2::open(&path, true).is_err());
        assert!(check(&path).is_err());
    }
}

#[test]
fn test_unknown_incompatible_bits_named_in_error() {
    let dir = tmp();
    let (_, good) = sample_image(dir.path());
    let path = patched(dir.path(), "incompat", &good, |b| {
        put64(b, 72, 1 << 4 | 1 << 40)
    });
    let err = Qcow2::open(&path, true).expect_err("refused").to_string();
    assert!(err.contains("extended L2"), "{err}");
    assert!(err.contains("bit 40"), "{err}");
    assert!(check(&path).is_err());
    assert!(open_disk(&path, true).is_err());
}

#[test]
fn test_dirty_and_corrupt_bits() {
    let dir = tmp();
    let (_, good) = sample_image(dir.path());
    let dirty = patched(dir.path(), "dirty", &good, |b| put64(b, 72, 1));
    let mut image = Qcow2::open(&dirty, true).expect("dirty read-only is fine");
    let mut buf = [0u8; 4];
    image.read_at(&mut buf, 100_000).expect("read");
    assert_eq!(buf, [0x42; 4]);
    assert!(matches!(Qcow2::open(&dirty, false), Err(Error::Dirty(_))));
    let corrupt = patched(dir.path(), "corrupt", &good, |b| put64(b, 72, 2));
    assert!(matches!(
        Qcow2::open(&corrupt, true),
        Err(Error::MarkedCorrupt(_))
    ));
    assert!(!check(&corrupt).expect("check").is_ok());
    assert!(info(&corrupt).expect("info").corrupt);
}

#[test]
fn test_hostile_tables_rejected() {
    let dir = tmp();
    let (path, good) = sample_image(dir.path());
    let h = Qcow2::open(&path, true).expect("open").header().clone();
    let l1 = h.l1_table_offset as usize;
    let first_l1 = u64::from_be_bytes(good[l1..l1 + 8].try_into().expect("8"));
    let l2 = (first_l1 & L1E_OFFSET_MASK) as usize;
    let d = dir.path();
    // L1 entries: past EOF, unaligned, reserved bits, pointing at the header.
    assert_reads_fail(&patched(d, "l1eof", &good, |b| {
        put64(b, l1, OFLAG_COPIED | 1 << 40)
    }));
    assert_reads_fail(&patched(d, "l1unal", &good, |b| {
        put64(b, l1, first_l1 + 512)
    }));
    assert_reads_fail(&patched(d, "l1res", &good, |b| put64(b, l1, first_l1 | 2)));
    let garbage = patched(d, "l1garbage", &good, |b| b[l1..l1 + 64].fill(0xa5));
    assert_reads_fail(&garbage);
    // An L2 table that is the refcount table: reading works (it is data
    // in the file) but check and writable opens refuse it.
    let overlap = patched(d, "l1hdr", &good, |b| put64(b, l1, OFLAG_COPIED | 4096));
    assert!(!check(&overlap).expect("check").is_ok());
    assert!(Qcow2::open(&overlap, false).is_err());
    // L2 entries: past EOF, compressed, reserved bits, pointing at the L1.
    let entry = |v: u64| move |b: &mut Vec<u8>| put64(b, l2 + 24 * 8, v);
    assert_reads_fail(&patched(d, "l2eof", &good, entry(OFLAG_COPIED | 1 << 45)));
    assert_reads_fail(&patched(
        d,
        "l2res",
        &good,
        entry(OFLAG_COPIED | (4096 * 5) | 4),
    ));
    assert_reads_fail(&patched(
        d,
        "l2unal",
        &good,
        entry(OFLAG_COPIED | (4096 * 5 + 512)),
    ));
    let compressed = patched(d, "l2comp", &good, entry(OFLAG_COMPRESSED | (4096 * 5)));
    let mut image = Qcow2::open(&compressed, true).expect("open");
    let mut buf = vec![0u8; 4 << 20];
    let err = image
        .read_at(&mut buf, 0)
        .expect_err("compressed")
        .to_string();
    assert!(err.contains("compressed"), "{err}");
    let at_l1 = patched(d, "l2l1", &good, entry(OFLAG_COPIED | h.l1_table_offset));
    assert!(!check(&at_l1).expect("check").is_ok());
    assert!(
        Qcow2::open(&at_l1, false).is_err(),
        "write would hit the L1 table"
    );
    // Refcount table entry past EOF or unaligned.
    let rt = h.refcount_table_offset as usize;
    assert_rejected_writable(&patched(d, "rteof", &good, |b| put64(b, rt, 1 << 40)));
    assert_rejected_writable(&patched(d, "rtunal", &good, |b| put64(b, rt, 4096 + 512)));
    // Tables named twice.
    let rt_entry = u64::from_be_bytes(good[rt..rt + 8].try_into().expect("8"));
    assert_rejected_writable(&patched(d, "rtdup", &good, |b| put64(b, rt + 8, rt_entry)));
    let l1dup = patched(d, "l1dup", &good, |b| put64(b, l1 + 8, first_l1));
    assert_rejected_writable(&l1dup);
    let report = check(&l1dup).expect("check");
    assert!(
        report.messages.iter().any(|m| m.contains("used twice")),
        "{report:?}"
    );
    // Truncated files.
    for keep in [good.len() - 4096, good.len() / 2, 4096 * 3 + 100] {
        let path = patched(d, &format!("trunc{keep}"), &good, |b| b.truncate(keep));
        if let Ok(mut image) = Qcow2::open(&path, true) {
            let mut buf = vec![0u8; 4 << 20];
            assert!(image.read_at(&mut buf, 0).is_err(), "truncated to {keep}");
        }
        assert!(Qcow2::open(&path, false).is_err());
        if let Ok(report) = check(&path) {
            assert!(!report.is_ok(), "truncated to {keep}: {report:?}");
        }
    }
}

fn assert_rejected_writable(path: &Path) {
    assert!(Qcow2::open(path, false).is_err(), "{}", path.display());
    assert!(!check(path).expect("check").is_ok(), "{}", path.display());
}

#[test]
fn test_refcount_mismatch_and_double_use_reported() {
    let dir = tmp();
    let (path, good) = sample_image(dir.path());
    let h = Qcow2::open(&path, true).expect("open").header().clone();
    let l1 = h.l1_table_offset as usize;
    let l2 =
        (u64::from_be_bytes(good[l1..l1 + 8].try_into().expect("8")) & L1E_OFFSET_MASK) as usize;
    // Two L2 entries naming the same data cluster.
    let e24 = u64::from_be_bytes(good[l2 + 24 * 8..l2 + 25 * 8].try_into().expect("8"));
    assert_ne!(e24, 0);
    let twice = patched(dir.path(), "twice", &good, |b| put64(b, l2 + 100 * 8, e24));
    let report = check(&twice).expect("check");
    assert!(
        report.messages.iter().any(|m| m.contains("used twice")),
        "{report:?}"
    );
    // The refcount block zeroed: every cluster unrefcounted.
    let rt = h.refcount_table_offset as usize;
    let rb = u64::from_be_bytes(good[rt..rt + 8].try_into().expect("8")) as usize;
    let zeroed = patched(dir.path(), "norefs", &good, |b| b[rb..rb + 4096].fill(0));
    let report = check(&zeroed).expect("check");
    assert!(report.corruptions > 10, "{report:?}");
    // A leaked cluster: refcount 1 past everything referenced.
    let leak = patched(dir.path(), "leak", &good, |b| {
        let clusters = b.len() / 4096;
        b.resize(b.len() + 4096, 0);
        b[rb + clusters * 2..rb + clusters * 2 + 2].copy_from_slice(&1u16.to_be_bytes());
    });
    let report = check(&leak).expect("check");
    assert!(report.is_ok() && report.leaked_clusters == 1, "{report:?}");
}

#[test]
fn test_backing_loop_and_depth_rejected() {
    let dir = tmp();
    let a = dir.path().join("a.qcow2");
    let b = dir.path().join("b.qcow2");
    new_image(&a, 1 << 20, 65536);
    create_overlay(&b, &a, Format::Qcow2, None).expect("b");
    // Rewrite a's header to name b as backing: a -> b -> a.
    std::fs::remove_file(&a).expect("rm");
    create_overlay(&a, &b, Format::Qcow2, None).expect("a on b");
    let err = Qcow2::open(&a, true).expect_err("loop");
    assert!(matches!(err, Error::BackingLoop { .. }), "{err}");
    assert!(backing_chain(&a).is_err());
    // An image naming itself.
    let own = dir.path().join("own.qcow2");
    let tmp_base = dir.path().join("tmp.raw");
    raw_file(&tmp_base, &[0; 4096]);
    create_overlay(&own, &tmp_base, Format::Raw, None).expect("own");
    let mut bytes = std::fs::read(&own).expect("read");
    let h = Qcow2::open(&own, true).expect("open").header().clone();
    let name = b"own.qcow2";
    let at = h.backing_file_offset as usize;
    bytes[at..at + name.len()].copy_from_slice(name);
    put32(&mut bytes, 16, name.len() as u32);
    std::fs::write(&own, &bytes).expect("write");
    assert!(Qcow2::open(&own, true).is_err());
    assert!(backing_chain(&own).is_err());

    // A chain deeper than the limit.
    let mut prev = dir.path().join("d0.raw");
    raw_file(&prev, &[1; 512]);
    for i in 1..=MAX_CHAIN_DEPTH {
        let next = dir.path().join(format!("d{i}.qcow2"));
        create_overlay(
            &next,
            &prev,
            if i == 1 { Format::Raw } else { Format::Qcow2 },
            None,
        )
        .expect("overlay");
        prev = next;
    }
    assert!(matches!(
        Qcow2::open(&prev, true),
        Err(Error::ChainTooDeep(_))
    ));
    assert!(backing_chain(&prev).is_err());
    // One less is fine.
    let ok = dir.path().join(format!("d{}.qcow2", MAX_CHAIN_DEPTH - 1));
    let mut image = Qcow2::open(&ok, true).expect("deep chain");
    let mut buf = [0u8; 512];
    image.read_at(&mut buf, 0).expect("read");
    assert_eq!(buf, [1; 512]);
}

#[test]
fn test_missing_backing_file_fails_with_its_name() {
    let dir = tmp();
    let base = dir.path().join("base.raw");
    raw_file(&base, &[0; 4096]);
    let top = dir.path().join("top.qcow2");
    create_overlay(&top, &base, Format::Raw, None).expect("overlay");
    std::fs::remove_file(&base).expect("rm");
    let err = Qcow2::open(&top, true).expect_err("missing").to_string();
    assert!(err.contains("base.raw"), "{err}");
}

#[test]
fn test_probed_backing_format_when_extension_absent() {
    let dir = tmp();
    let base = dir.path().join("base.qcow2");
    new_image(&base, 1 << 20, 65536);
    let mut image = Qcow2::open(&base, false).expect("open");
    image.write_at(&[8; 4], 0).expect("write");
    drop(image);
    let top = dir.path().join("top.qcow2");
    create_overlay(&top, &base, Format::Qcow2, None).expect("overlay");
    // Remove the backing format extension (turn it into an unknown one).
    let mut bytes = std::fs::read(&top).expect("read");
    put32(&mut bytes, V3_LEN, 0x1234_5678);
    std::fs::write(&top, &bytes).expect("write");
    assert_eq!(info(&top).expect("info").backing_format, None);
    let mut image = Qcow2::open(&top, true).expect("open");
    let mut buf = [0u8; 4];
    image.read_at(&mut buf, 0).expect("read");
    assert_eq!(buf, [8; 4]);
}

const V3_LEN: usize = header::V3_HEADER_LEN as usize;

#[test]
fn test_raw_backing_named_raw_is_not_probed() {
    // A raw backing file whose contents look like qcow2 is still raw when
    // the overlay says so.
    let dir = tmp();
    let fake = dir.path().join("fake.raw");
    new_image(&fake, 1 << 20, 65536);
    let fake_bytes = std::fs::read(&fake).expect("read");
    let top = dir.path().join("top.qcow2");
    create_overlay(&top, &fake, Format::Raw, None).expect("overlay");
    let mut image = Qcow2::open(&top, true).expect("open");
    assert_eq!(image.size(), fake_bytes.len() as u64);
    let mut buf = [0u8; 4];
    image.read_at(&mut buf, 0).expect("read");
    assert_eq!(buf, MAGIC);
    let chain = backing_chain(&top).expect("chain");
    assert_eq!(chain[1].format, Format::Raw);
}

#[test]
fn test_detect_format_and_open_disk() {
    let dir = tmp();
    let raw = dir.path().join("disk.raw");
    raw_file(&raw, &[0; 8192]);
    let q = dir.path().join("disk.qcow2");
    new_image(&q, 8192, 65536);
    assert_eq!(detect_format(&raw).expect("raw"), Format::Raw);
    assert_eq!(detect_format(&q).expect("qcow2"), Format::Qcow2);
    let mut disk = open_disk(&q, false).expect("open qcow2");
    assert_eq!(disk.size(), 8192);
    disk.write_at(&[1; 512], 512).expect("write");
    disk.flush().expect("flush");
    let mut disk = open_disk(&raw, false).expect("open raw");
    assert_eq!(disk.size(), 8192);
    // A probed raw disk refuses to become a qcow2 image.
    let err = disk.write_at(&MAGIC, 0).expect_err("refused");
    assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
    assert!(disk.write_at(&[0xfb], 3).is_ok(), "only part of the magic");
    assert!(disk.write_at(b"QFI", 0).is_err(), "completes the magic");
    disk.write_at(&[0; 512], 0).expect("plain write");
    assert_eq!(detect_format(&raw).expect("raw"), Format::Raw);
}

#[test]
fn test_info_reports_images() {
    let dir = tmp();
    let raw = dir.path().join("disk.raw");
    raw_file(&raw, &[0; 10_000]);
    let i = info(&raw).expect("info");
    assert_eq!(
        (i.format, i.virtual_size, i.cluster_size),
        (Format::Raw, 10_000, None)
    );
    let q = dir.path().join("disk.qcow2");
    create_overlay(&q, &raw, Format::Raw, None).expect("overlay");
    let i = info(&q).expect("info");
    assert_eq!(i.format, Format::Qcow2);
    assert_eq!(i.virtual_size, 10_240, "rounded up to 512");
    assert_eq!(i.cluster_size, Some(65536));
    assert_eq!(i.version, Some(3));
    assert_eq!(i.backing_format, Some(Format::Raw));
    assert!(!i.dirty && !i.corrupt);
}

#[test]
fn test_autoclear_bits_cleared_on_writable_open() {
    let dir = tmp();
    let (_, good) = sample_image(dir.path());
    let path = patched(dir.path(), "autoclear", &good, |b| put64(b, 88, 1 << 5));
    drop(Qcow2::open(&path, true).expect("read-only"));
    assert_eq!(
        std::fs::read(&path).expect("read")[88..96],
        (1u64 << 5).to_be_bytes()
    );
    drop(Qcow2::open(&path, false).expect("writable"));
    assert_eq!(std::fs::read(&path).expect("read")[88..96], [0; 8]);
}

#[test]
fn test_random_corruption_never_panics() {
    // Flip bytes in the metadata of a small chain's top image: every
    // operation may fail, none may panic or hang.
    let dir = tmp();
    let base = dir.path().join("base.raw");
    raw_file(&base, &[0x33; 64 * 1024]);
    let (path, good) = sample_image(dir.path());
    drop(path);
    let mut rng = Rng::new(99);
    let victim = dir.path().join("victim.qcow2");
    for round in 0..400 {
        let mut bytes = good.clone();
        let flips = 1 + rng.below(8);
        for _ in 0..flips {
            // Mostly the metadata clusters (header, tables), sometimes anywhere.
            let limit = if rng.below(4) == 0 {
                bytes.len()
            } else {
                6 * 4096
            };
            let at = rng.below(limit as u64) as usize;
            bytes[at] ^= 1 << rng.below(8);
        }
        std::fs::write(&victim, &bytes).expect("write");
        if let Ok(mut image) = Qcow2::open(&victim, true) {
            let size = image.size().min(8 << 20) as usize;
            let mut buf = vec![0u8; size];
            let _ = image.read_at(&mut buf, 0);
        }
        if let Ok(mut image) = Qcow2::open(&victim, false) {
            let size = image.size();
            for _ in 0..8 {
                let offset = rng.below(size.max(1));
                let len = (1 + rng.below(20_000)).min(size - offset) as usize;
                let _ = image.write_at(&vec![0x99; len], offset);
            }
            let _ = image.flush();
            drop(image);
            // A file that opened writable stays consistent through writes.
            if let Ok(report) = check(&victim) {
                let before = {
                    std::fs::write(dir.path().join("orig.qcow2"), &bytes).expect("write");
                    check(&dir.path().join("orig.qcow2")).map(|r| r.corruptions)
                };
                if let Ok(0) = before {
                    assert!(report.is_ok(), "round {round}: {report:?}");
                }
            }
        }
        let _ = check(&victim);
        let _ = info(&victim);
        let _ = backing_chain(&victim);
    }
}

#[test]
fn test_next_data_finds_data_and_the_end_of_the_file() {
    let dir = tmp();
    let path = dir.path().join("sparse.raw");
    let file = std::fs::File::options()
        .create_new(true)
        .read(true)
        .write(true)
        .open(&path)
        .expect("create");
    file.set_len(4 << 20).expect("size");
    file.write_all_at(&[1; 4096], 2 << 20).expect("write");
    // A filesystem without holes reports data everywhere, so only what
    // holds on every filesystem is asserted.
    let first = next_data(&file, 0).expect("seek").expect("data");
    assert!(first <= 2 << 20, "{first}");
    assert_eq!(next_data(&file, 2 << 20).expect("seek"), Some(2 << 20));
    assert_eq!(next_data(&file, 4 << 20).expect("seek"), None);
    assert_eq!(next_data(&file, 8 << 20).expect("seek"), None);
}

#[test]
fn a_deferred_image_is_whole_at_once_and_syncs_later() {
    let dir = tempfile::tempdir().expect("tmp");
    let base = dir.path().join("base.raw");
    std::fs::write(&base, vec![5u8; 1 << 20]).expect("base");
    let top = dir.path().join("top.qcow2");
    create(
        &top,
        &CreateOptions {
            backing: Some((base.clone(), Format::Raw)),
            durability: Durability::Deferred,
            ..CreateOptions::default()
        },
    )
    .expect("create");
    // Readable through its backing file before any sync, and no temporary
    // name is left next to it.
    let mut disk = open_disk(&top, true).expect("open");
    let mut buf = [0u8; 4];
    disk.read_at(&mut buf, 4096).expect("read");
    assert_eq!(buf, [5u8; 4]);
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .expect("list")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    sync_created(&top).expect("sync");
    let missing = dir.path().join("missing.qcow2");
    let err = sync_created(&missing).expect_err("a missing image cannot be synced");
    assert!(err.to_string().contains("missing.qcow2"), "{err}");
}
