//! Timed hot forks of one memory commit, in batches of requests sent at
//! once: what the daemon's `fork_host` bench (stand-in launcher) and
//! tine-vmm's `hot_fork_api` bench (real launcher) both measure.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tine_daemon::core::Daemon;
use tine_proto::api::{ForkRequest, Wait};

/// Milliseconds of each hot fork (`wait=none`) of `commit`, `concurrent`
/// requests at once, about `runs` in all (at least `min_batches` batches).
/// Every fork is deleted after its batch, and the warm pool is full again
/// before the next one.
pub async fn timed_hot_forks(
    d: &Arc<Daemon>,
    commit: &str,
    concurrent: usize,
    runs: usize,
    min_batches: usize,
    wait: Duration,
) -> anyhow::Result<Vec<f64>> {
    let mut ms = Vec::new();
    for _ in 0..(runs / concurrent).max(min_batches) {
        let mut tasks = Vec::new();
        for _ in 0..concurrent {
            let (d, id) = (d.clone(), commit.to_owned());
            tasks.push(tokio::spawn(async move {
                let t = Instant::now();
                let f = d.fork(&id, ForkRequest::default(), Wait::None, wait).await;
                (t.elapsed().as_secs_f64() * 1e3, f)
            }));
        }
        let mut made = Vec::new();
        for task in tasks {
            let (elapsed, f) = task.await?;
            ms.push(elapsed);
            made.push(f?.hostname);
        }
        for h in made {
            d.delete(&h).await?;
        }
        d.fill_pools().await;
    }
    Ok(ms)
}
