//! Timed hot forks of one memory commit, in batches of requests sent at
//! once: what the daemon's `fork_host` bench (stand-in launcher) and
//! tine-vmm's `hot_fork_api` bench (real launcher) both measure.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tine_daemon::core::Daemon;
use tine_proto::api::{ForkRequest, Wait};

/// What a row of hot forks measured.
pub struct HotForkTimes {
    /// Milliseconds of each fork, from the instant its batch was sent to
    /// its answer.
    pub ms: Vec<f64>,
    /// CPU time (user and system, every thread) the bench's process used
    /// while the batches ran, per fork: the daemon's core runs in it, the
    /// VMM processes do not. With every fork of a batch under way at once,
    /// this is what a host's cores must share.
    pub cpu_ms_per_fork: f64,
}

/// CPU time (user and system) this process has used, in milliseconds.
fn process_cpu_ms() -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one `rusage` into the buffer it is given,
    // which is that size and outlives the call; zeroed is a valid value.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    assert_eq!(rc, 0, "getrusage: {}", std::io::Error::last_os_error());
    // SAFETY: initialised above (zeroed, then written by getrusage).
    let usage = unsafe { usage.assume_init() };
    let ms = |t: libc::timeval| t.tv_sec as f64 * 1e3 + t.tv_usec as f64 / 1e3;
    ms(usage.ru_utime) + ms(usage.ru_stime)
}

/// Each hot fork (`wait=none`) of `commit`, `concurrent` requests at once,
/// about `runs` in all (at least `min_batches` batches). Every fork is
/// deleted after its batch, and the warm pool is full again before the
/// next one.
pub async fn timed_hot_forks(
    d: &Arc<Daemon>,
    commit: &str,
    concurrent: usize,
    runs: usize,
    min_batches: usize,
    wait: Duration,
) -> anyhow::Result<HotForkTimes> {
    let mut ms = Vec::new();
    let mut cpu_ms = 0.0;
    for _ in 0..(runs / concurrent).max(min_batches) {
        let cpu_before = process_cpu_ms();
        // Every request of a batch is in at the same instant, as if they
        // had all arrived at once: each one's clock starts here, not when
        // the runtime first polls its task (a task that waits for the
        // others' CPU has waited all the same).
        let sent = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..concurrent {
            let (d, id) = (d.clone(), commit.to_owned());
            tasks.push(tokio::spawn(async move {
                let f = d.fork(&id, ForkRequest::default(), Wait::None, wait).await;
                (sent.elapsed().as_secs_f64() * 1e3, f)
            }));
        }
        let mut made = Vec::new();
        for task in tasks {
            let (elapsed, f) = task.await?;
            ms.push(elapsed);
            made.push(f?.hostname);
        }
        cpu_ms += process_cpu_ms() - cpu_before;
        for h in made {
            d.delete(&h).await?;
        }
        d.fill_pools().await;
    }
    let cpu_ms_per_fork = cpu_ms / ms.len().max(1) as f64;
    Ok(HotForkTimes {
        ms,
        cpu_ms_per_fork,
    })
}
