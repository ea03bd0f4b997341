//! Agent protocol benchmarks over a Unix socket on the host, with the agent
//! in-process: exec round trip of `true` (p50/p99) and upload/download
//! throughput in MiB/s.
//!
//! `cargo bench -p tine-agent --bench agent`; `TINE_BENCH_EXECS` (default
//! 500) and `TINE_BENCH_MIB` (default 256) size the runs.

use std::time::{Duration, Instant};

use anyhow::Context;
use tine_agent::{Agent, AgentConfig};
use tine_client::proto::{ExecRequest, FileAttrs, UploadRequest};
use tine_client::AgentClient;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

fn mib_per_s(bytes: usize, elapsed: Duration) -> f64 {
    bytes as f64 / (1 << 20) as f64 / elapsed.as_secs_f64()
}

async fn bench_exec(client: &AgentClient, iterations: usize) -> anyhow::Result<()> {
    for _ in 0..20 {
        client.exec_output(ExecRequest::argv(["true"])).await?;
    }
    let mut samples = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        let started = Instant::now();
        let output = client.exec_output(ExecRequest::argv(["true"])).await?;
        samples.push(started.elapsed());
        anyhow::ensure!(output.status.success(), "true failed: {:?}", output.status);
    }
    samples.sort();
    let mean = samples.iter().sum::<Duration>() / samples.len() as u32;
    println!(
        "exec `true` round trip ({iterations} runs): p50 {:.3} ms  p99 {:.3} ms  mean {:.3} ms",
        percentile(&samples, 0.50).as_secs_f64() * 1e3,
        percentile(&samples, 0.99).as_secs_f64() * 1e3,
        mean.as_secs_f64() * 1e3,
    );
    Ok(())
}

async fn bench_files(
    client: &AgentClient,
    dir: &std::path::Path,
    mib: usize,
) -> anyhow::Result<()> {
    let data: Vec<u8> = (0..(mib << 20) as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let path = dir.join("bench.bin");
    let path = path.to_str().context("UTF-8 path")?;
    let (mut up, mut down) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let started = Instant::now();
        let req = UploadRequest {
            path: path.to_owned(),
            attrs: FileAttrs::default(),
            mkdirs: false,
            size: Some(data.len() as u64),
        };
        client.upload(req, data.as_slice()).await?;
        up.push(mib_per_s(data.len(), started.elapsed()));

        let started = Instant::now();
        let stat = client.download(path, tokio::io::sink()).await?;
        down.push(mib_per_s(data.len(), started.elapsed()));
        anyhow::ensure!(stat.size == data.len() as u64, "size mismatch");
    }
    let best = |v: &[f64]| v.iter().cloned().fold(0.0, f64::max);
    println!(
        "upload {mib} MiB (fsynced, atomic rename): best {:.0} MiB/s  runs {:?}",
        best(&up),
        up.iter().map(|v| v.round() as u64).collect::<Vec<_>>()
    );
    println!(
        "download {mib} MiB: best {:.0} MiB/s  runs {:?}",
        best(&down),
        down.iter().map(|v| v.round() as u64).collect::<Vec<_>>()
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let dir = tempfile::tempdir()?;
        let socket = dir.path().join("agent.sock");
        let listener = tokio::net::UnixListener::bind(&socket)?;
        let agent = Agent::new(AgentConfig {
            system_root: dir.path().to_path_buf(),
            ..AgentConfig::default()
        });
        tokio::spawn(agent.serve(listener));
        let client = AgentClient::connect_unix(&socket).await?;
        bench_exec(&client, env_usize("TINE_BENCH_EXECS", 500)).await?;
        bench_files(&client, dir.path(), env_usize("TINE_BENCH_MIB", 256)).await?;
        Ok(())
    })
}
