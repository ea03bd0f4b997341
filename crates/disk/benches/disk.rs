//! Disk images: qcow2 overlay creation time against the parent's size, and
//! sequential write/read throughput of a raw file against a qcow2 overlay
//! (through the `BlockBackend` that virtio-blk uses). Prints p50/p99 and
//! ratios; asserts nothing. Run where the target filesystem is the one
//! that matters (the temporary directory, or TINE_BENCH_DIR).
//!
//!   cargo bench -p tine-disk --bench disk [-- RUNS]

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Instant;

use tine_disk::{create_empty, create_overlay, BlockBackend, Format, Qcow2, RawFile};

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn p50_p99(mut samples: Vec<f64>) -> (f64, f64) {
    samples.sort_by(|a, b| a.total_cmp(b));
    (percentile(&samples, 0.5), percentile(&samples, 0.99))
}

fn sparse(path: &Path, size: u64) {
    File::create(path)
        .and_then(|f| f.set_len(size))
        .expect("sparse file");
}

/// Times `runs` creations of an overlay of `parent`, in ms.
fn overlay_times(dir: &Path, parent: &Path, format: Format, runs: usize) -> Vec<f64> {
    (0..runs)
        .map(|i| {
            let path = dir.join(format!("overlay-{i}.qcow2"));
            let start = Instant::now();
            create_overlay(&path, parent, format, None).expect("create_overlay");
            let ms = start.elapsed().as_secs_f64() * 1e3;
            std::fs::remove_file(&path).expect("remove");
            ms
        })
        .collect()
}

/// Writes then reads `total` bytes sequentially in `block`-byte requests;
/// returns (write MiB/s including the final flush, read MiB/s).
fn throughput(disk: &mut dyn BlockBackend, block: usize, total: u64) -> (f64, f64) {
    let mut buf = vec![0u8; block];
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i % 251) as u8 + 1;
    }
    let mib = total as f64 / (1 << 20) as f64;
    let start = Instant::now();
    let mut offset = 0;
    while offset < total {
        disk.write_at(&buf, offset).expect("write");
        offset += block as u64;
    }
    disk.flush().expect("flush");
    let write = mib / start.elapsed().as_secs_f64();
    let start = Instant::now();
    offset = 0;
    while offset < total {
        disk.read_at(&mut buf, offset).expect("read");
        offset += block as u64;
    }
    let read = mib / start.elapsed().as_secs_f64();
    (write, read)
}

fn main() {
    let runs: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(200);
    let base_dir = std::env::var_os("TINE_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = tempfile::tempdir_in(base_dir).expect("tempdir");
    let dir = dir.path();

    println!("create_overlay, {runs} runs each (ms):");
    let mut results = Vec::new();
    for (name, size, format) in [
        ("raw 1 GiB", 1u64 << 30, Format::Raw),
        ("raw 20 GiB", 20 << 30, Format::Raw),
        ("qcow2 1 GiB", 1 << 30, Format::Qcow2),
        ("qcow2 20 GiB", 20 << 30, Format::Qcow2),
    ] {
        let parent = dir.join(format!("parent-{}-{size}", format.as_str()));
        match format {
            Format::Raw => sparse(&parent, size),
            Format::Qcow2 => create_empty(&parent, size).expect("qcow2 parent"),
        }
        let (p50, p99) = p50_p99(overlay_times(dir, &parent, format, runs));
        println!("  parent {name:<13} p50={p50:>7.3}  p99={p99:>7.3}");
        results.push((p50, p99));
    }
    for (small, big, what) in [(0, 1, "raw"), (2, 3, "qcow2")] {
        println!(
            "  {what:<5} 20 GiB / 1 GiB: p50 x{:.2}  p99 x{:.2}",
            results[big].0 / results[small].0,
            results[big].1 / results[small].1
        );
    }

    let total = 256u64 << 20;
    println!(
        "sequential {} MiB, write (+flush) then read (MiB/s):",
        total >> 20
    );
    for block in [4096usize, 65536] {
        let raw_path = dir.join(format!("raw-{block}.img"));
        sparse(&raw_path, total);
        let mut raw = RawFile::open(&raw_path, false).expect("raw");
        let (raw_w, raw_r) = throughput(&mut raw, block, total);

        // Overlays on an all-zero (sparse) base and on one full of data,
        // where a write of part of a new cluster copies the rest from it.
        let mut rows = Vec::new();
        for filled in [false, true] {
            let base = dir.join(format!("base-{block}-{filled}.img"));
            if filled {
                std::fs::write(&base, vec![0x5au8; total as usize]).expect("base");
            } else {
                sparse(&base, total);
            }
            let overlay = dir.join(format!("overlay-{block}-{filled}.qcow2"));
            create_overlay(&overlay, &base, Format::Raw, None).expect("overlay");
            let mut image = Qcow2::open(&overlay, false).expect("open overlay");
            rows.push(throughput(&mut image, block, total));
        }
        let [(zw, zr), (dw, dr)] = [rows[0], rows[1]];
        println!(
            "  {:>2} KiB  raw write {raw_w:>6.0} read {raw_r:>6.0} | qcow2 on zero base write {zw:>6.0} ({:.2}x) read {zr:>6.0} ({:.2}x) | on data base write {dw:>6.0} ({:.2}x) read {dr:>6.0} ({:.2}x)",
            block >> 10,
            zw / raw_w,
            zr / raw_r,
            dw / raw_w,
            dr / raw_r,
        );
    }
}
