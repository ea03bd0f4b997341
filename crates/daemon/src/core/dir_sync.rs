//! Shared syncs of one directory: when many callers each need a name they
//! made in it on stable storage (a burst of hot forks renaming their
//! folders into `vms/`), one `fsync` of the directory serves every caller
//! whose change came before it began, instead of one each. Each `fsync`
//! of a directory is a flush of the host's disk cache.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use crate::storage;

/// Syncs of one directory, shared by whoever asks while one is pending.
#[derive(Debug)]
pub(super) struct DirSync {
    dir: PathBuf,
    tickets: Mutex<Tickets>,
    /// Held while an `fsync` runs: one at a time, and those who wait for
    /// it find out whether it covered them.
    running: tokio::sync::Mutex<()>,
}

#[derive(Debug, Default)]
struct Tickets {
    /// Handed out: one per call.
    issued: u64,
    /// Every ticket up to this one was issued before an `fsync` that
    /// succeeded began.
    covered: u64,
    /// `fsync`s that succeeded.
    rounds: u64,
}

impl DirSync {
    pub(super) fn new(dir: PathBuf) -> Self {
        DirSync {
            dir,
            tickets: Mutex::new(Tickets::default()),
            running: tokio::sync::Mutex::new(()),
        }
    }

    fn tickets(&self) -> std::sync::MutexGuard<'_, Tickets> {
        self.tickets.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Returns once an `fsync` of the directory that began after this call
    /// has succeeded: every change made in it before the call is then on
    /// stable storage. Callers that arrive while one runs share the next.
    pub(super) async fn sync(self: &Arc<Self>) -> std::io::Result<()> {
        let ticket = {
            let mut t = self.tickets();
            t.issued += 1;
            t.issued
        };
        let _one_at_a_time = self.running.lock().await;
        let upto = {
            let t = self.tickets();
            if t.covered >= ticket {
                return Ok(());
            }
            // Everyone who has a ticket now made their change before this
            // sync begins.
            t.issued
        };
        let dir = self.dir.clone();
        tokio::task::spawn_blocking(move || storage::sync_dir(&dir))
            .await
            .map_err(std::io::Error::other)??;
        let mut t = self.tickets();
        t.covered = t.covered.max(upto);
        t.rounds += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn callers_during_a_sync_share_the_next_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sync = Arc::new(DirSync::new(dir.path().to_path_buf()));
        sync.sync().await.expect("alone");
        assert_eq!(sync.tickets().covered, 1);
        // The first sync runs while the others wait: they share one more.
        let held = sync.running.lock().await;
        let waiting: Vec<_> = (0..8)
            .map(|_| {
                let s = sync.clone();
                tokio::spawn(async move { s.sync().await })
            })
            .collect();
        while sync.tickets().issued < 9 {
            tokio::task::yield_now().await;
        }
        drop(held);
        for w in waiting {
            w.await.expect("task").expect("sync");
        }
        let t = sync.tickets();
        assert_eq!((t.issued, t.covered), (9, 9));
        assert_eq!(t.rounds, 2, "eight callers, one sync between them");
    }

    #[tokio::test]
    async fn a_failed_sync_covers_nobody() {
        let dir = tempfile::tempdir().expect("tempdir");
        let gone = dir.path().join("gone");
        let sync = Arc::new(DirSync::new(gone.clone()));
        let e = sync.sync().await.expect_err("no such directory");
        assert_eq!(e.kind(), std::io::ErrorKind::NotFound);
        assert_eq!(sync.tickets().covered, 0);
        std::fs::create_dir(&gone).expect("mkdir");
        sync.sync().await.expect("now it exists");
        let t = sync.tickets();
        assert_eq!((t.covered, t.rounds), (2, 1));
    }
}
