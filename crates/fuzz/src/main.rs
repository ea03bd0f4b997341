//! A fuzz driver that runs on the stable toolchain.
//!
//! Each target takes arbitrary bytes and must neither panic nor hang. The
//! driver mutates a seed corpus with a small deterministic PRNG, runs the
//! target under `catch_unwind`, and on a panic saves the input under
//! `crates/fuzz/crashes/` and exits with status 1.

mod corpus;
mod rng;
mod targets;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use rng::Rng;

/// Largest input the mutator produces.
const MAX_INPUT: usize = 16 * 1024;

const USAGE: &str = "usage: tine-fuzz <target|all> [--cases N] [--seconds S] [--seed S]
       tine-fuzz --write-corpus
       tine-fuzz --replay <target> <file>
targets:";

struct Options {
    target: String,
    cases: u64,
    seconds: Option<f64>,
    seed: u64,
}

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn parse_args() -> Result<Options, String> {
    let mut args = std::env::args().skip(1);
    let mut target = None;
    let mut cases = 100_000;
    let mut seconds = None;
    let mut seed = 0x7469_6e65_u64;
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--cases" => {
                cases = value("--cases")?
                    .parse()
                    .map_err(|e| format!("--cases: {e}"))?
            }
            "--seconds" => {
                seconds = Some(
                    value("--seconds")?
                        .parse()
                        .map_err(|e| format!("--seconds: {e}"))?,
                )
            }
            "--seed" => {
                seed = value("--seed")?
                    .parse()
                    .map_err(|e| format!("--seed: {e}"))?
            }
            s if s.starts_with('-') => return Err(format!("unknown option {s}")),
            s if target.is_none() => target = Some(s.to_owned()),
            s => return Err(format!("unexpected argument {s}")),
        }
    }
    Ok(Options {
        target: target.ok_or("no target given")?,
        cases,
        seconds,
        seed,
    })
}

fn usage() -> String {
    let names: Vec<&str> = targets::ALL.iter().map(|t| t.name).collect();
    format!("{USAGE} {}, all", names.join(", "))
}

fn fnv1a(data: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325_u64;
    for b in data {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn hex(data: &[u8]) -> String {
    data.iter().map(|b| format!("{b:02x}")).collect()
}

fn load_corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = crate_dir().join("corpus").join(target);
    let mut seeds = Vec::new();
    if let Ok(entries) = std::fs::read_dir(&dir) {
        let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
        paths.sort();
        for p in paths {
            if let Ok(bytes) = std::fs::read(&p) {
                seeds.push(bytes);
            }
        }
    }
    if seeds.is_empty() {
        seeds.push(Vec::new());
    }
    seeds
}

fn save_crash(target: &str, input: &[u8]) -> PathBuf {
    let dir = crate_dir().join("crashes");
    let path = dir.join(format!("{target}-{:016x}", fnv1a(input)));
    if let Err(e) = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, input)) {
        eprintln!("cannot save crash to {}: {e}", path.display());
    }
    path
}

/// Runs one target; returns false on a crash.
fn run_target(target: &targets::Target, opts: &Options) -> bool {
    let seeds = load_corpus(target.name);
    let mut rng = Rng::new(opts.seed ^ fnv1a(target.name.as_bytes()));
    let mut state = (target.init)();
    let start = Instant::now();
    let budget = opts.seconds.map(Duration::from_secs_f64);
    let mut case = 0u64;
    let mut input = Vec::new();
    while case < opts.cases {
        if let Some(b) = budget {
            if case & 63 == 0 && start.elapsed() >= b {
                break;
            }
        }
        // Seeds first, unchanged; then mutants of them.
        if (case as usize) < seeds.len() {
            input.clone_from(&seeds[case as usize]);
        } else {
            let base = &seeds[rng.below(seeds.len() as u64) as usize];
            input.clone_from(base);
            rng::mutate(&mut rng, &mut input, &seeds, MAX_INPUT);
        }
        let case_start = Instant::now();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            (target.run)(&mut state, &input)
        }));
        let took = case_start.elapsed();
        let failure = match result {
            Err(_) => Some("panicked".to_owned()),
            Ok(()) if took > target.hang => Some(format!("took {took:?} (a hang)")),
            Ok(()) => None,
        };
        case += 1;
        if let Some(why) = failure {
            let path = save_crash(target.name, &input);
            eprintln!(
                "CRASH target={} case={case} elapsed={:.2}s: {why}\ninput ({} bytes): {}\nsaved to {}",
                target.name,
                start.elapsed().as_secs_f64(),
                input.len(),
                hex(&input),
                path.display()
            );
            return false;
        }
    }
    println!(
        "{:<16} {:>10} cases {:>8.2}s  ok",
        target.name,
        case,
        start.elapsed().as_secs_f64()
    );
    true
}

fn replay(name: &str, file: &Path) -> ExitCode {
    let Some(target) = targets::ALL.iter().find(|t| t.name == name) else {
        eprintln!("unknown target {name}\n{}", usage());
        return ExitCode::from(2);
    };
    let input = match std::fs::read(file) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("cannot read {}: {e}", file.display());
            return ExitCode::from(2);
        }
    };
    let mut state = (target.init)();
    (target.run)(&mut state, &input);
    println!("{name}: no crash");
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    let raw: Vec<String> = std::env::args().collect();
    if raw.get(1).map(String::as_str) == Some("--write-corpus") {
        return match corpus::write_all(&crate_dir().join("corpus")) {
            Ok(n) => {
                println!("wrote {n} seed files");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("cannot write the corpus: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if raw.get(1).map(String::as_str) == Some("--replay") {
        return match (raw.get(2), raw.get(3)) {
            (Some(t), Some(f)) => replay(t, Path::new(f)),
            _ => {
                eprintln!("{}", usage());
                ExitCode::from(2)
            }
        };
    }
    let opts = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}\n{}", usage());
            return ExitCode::from(2);
        }
    };
    // Panics are expected to be caught and reported by the driver; keep
    // the default hook's message but only once per crash.
    let selected: Vec<&targets::Target> = if opts.target == "all" {
        targets::ALL.iter().collect()
    } else {
        match targets::ALL.iter().find(|t| t.name == opts.target) {
            Some(t) => vec![t],
            None => {
                eprintln!("unknown target {}\n{}", opts.target, usage());
                return ExitCode::from(2);
            }
        }
    };
    for t in selected {
        if !run_target(t, &opts) {
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
