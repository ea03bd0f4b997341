//! Threads started before their work is known.
//!
//! Starting a thread costs a stack mapping, a guard page, the clone and
//! the new thread's own set-up (tens of microseconds each on a nested
//! host, more in a process that has not started one before). A
//! pre-started VM (`--prestart`) starts the threads its restore will need
//! ahead, as [`SpareThread`]s, so that the restore only hands each its
//! work: one wake-up instead of a thread start on a fork's path.

use std::sync::mpsc::{channel, sync_channel, Receiver, SyncSender};
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce() + Send>;

/// A started thread, blocked until it is given the one job it will run.
/// Dropped without a job, it ends.
pub struct SpareThread {
    jobs: SyncSender<Job>,
    thread: JoinHandle<()>,
}

impl SpareThread {
    /// Starts a thread named `name` that waits for its job, its first
    /// stack pages and heap arena mapped (`prefault::thread_ahead`).
    pub fn spawn(name: String) -> std::io::Result<Self> {
        let (jobs, waiting) = sync_channel::<Job>(1);
        let thread = std::thread::Builder::new().name(name).spawn(move || {
            crate::prefault::thread_ahead();
            // No job (the sender was dropped): nothing to run.
            if let Ok(job) = waiting.recv() {
                job();
            }
        })?;
        Ok(Self { jobs, thread })
    }

    /// `spare` when given, else a thread started now named `name`.
    pub fn given_or_new(
        spare: Option<Self>,
        name: impl FnOnce() -> String,
    ) -> std::io::Result<Self> {
        match spare {
            Some(thread) => Ok(thread),
            None => Self::spawn(name()),
        }
    }

    /// The thread's pthread handle (for its CPU affinity).
    pub fn as_pthread_t(&self) -> libc::pthread_t {
        std::os::unix::thread::JoinHandleExt::as_pthread_t(&self.thread)
    }

    /// Runs `work` on this thread. The thread ends when `work` returns.
    pub fn run<T: Send + 'static>(
        self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> std::io::Result<Worker<T>> {
        let (result, outcome) = channel();
        let job: Job = Box::new(move || {
            if result.send(work()).is_err() {
                // The worker's owner is gone: nobody wants the result.
            }
        });
        if self.jobs.send(job).is_err() {
            // The waiting thread is gone, which it never is on its own
            // before its job comes: an error rather than a panic.
            return Err(std::io::Error::other("a spare thread ended before its job"));
        }
        Ok(Worker {
            thread: self.thread,
            outcome,
        })
    }
}

/// A thread running its one job: what a [`JoinHandle`] is to a thread
/// spawned with its work.
pub struct Worker<T> {
    thread: JoinHandle<()>,
    outcome: Receiver<T>,
}

impl<T: Send + 'static> Worker<T> {
    /// Whether the job returned (or panicked) and the thread ended.
    pub fn is_finished(&self) -> bool {
        self.thread.is_finished()
    }

    /// The thread's pthread handle (for signals).
    pub fn as_pthread_t(&self) -> libc::pthread_t {
        std::os::unix::thread::JoinHandleExt::as_pthread_t(&self.thread)
    }

    /// Waits for the thread to end; the job's result, `None` if it
    /// panicked.
    pub fn join(self) -> Option<T> {
        if self.thread.join().is_err() {
            return None;
        }
        self.outcome.try_recv().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn test_a_spare_thread_runs_its_job_under_its_own_name() {
        let spare = SpareThread::spawn("spare-7".into()).expect("spawn");
        let worker = spare
            .run(|| std::thread::current().name().map(str::to_owned))
            .expect("run");
        assert_eq!(worker.join(), Some(Some("spare-7".to_owned())));
    }

    #[test]
    fn test_a_given_spare_is_used_rather_than_a_new_thread() {
        let spare = SpareThread::spawn("given".into()).expect("spawn");
        let worker = SpareThread::given_or_new(Some(spare), || "new".into())
            .and_then(|thread| thread.run(|| std::thread::current().name().map(str::to_owned)))
            .expect("run");
        assert_eq!(worker.join(), Some(Some("given".to_owned())));
    }

    #[test]
    fn test_a_worker_reports_when_it_finished() {
        let (release, wait) = channel::<()>();
        let worker = SpareThread::given_or_new(None, || "w".into())
            .and_then(|thread| thread.run(move || wait.recv().is_ok()))
            .expect("start");
        std::thread::sleep(Duration::from_millis(20));
        assert!(!worker.is_finished(), "finished before its job could end");
        release.send(()).expect("release the job");
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !worker.is_finished() {
            assert!(std::time::Instant::now() < deadline, "never finished");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(worker.join(), Some(true));
    }

    #[test]
    fn test_a_panicking_job_joins_as_none() {
        let worker = SpareThread::given_or_new(None, || "p".into())
            .and_then(|thread| thread.run(|| -> u8 { panic!("job failed") }))
            .expect("start");
        assert_eq!(worker.join(), None);
    }

    #[test]
    fn test_a_dropped_spare_thread_ends() {
        let spare = SpareThread::spawn("unused".into()).expect("spawn");
        let thread = spare.thread;
        drop(spare.jobs);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !thread.is_finished() {
            assert!(
                std::time::Instant::now() < deadline,
                "a spare with no job kept running"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
