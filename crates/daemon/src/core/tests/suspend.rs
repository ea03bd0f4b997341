//! Suspend and restore on the fake launcher: the state machine, what each
//! state refuses (by name), what relaunch, shutdown and delete do with a
//! suspended VM, and a `kill -9` at every step of a suspend and a restore
//! (the crash points of `crate::failpoint`) followed by a restart.

use std::sync::mpsc;

use tine_proto::api::VmStatus;
use tine_proto::vmm::Request as VmmRequest;

use super::*;
use crate::failpoint::{self, Failpoint};
use crate::launcher::{Launcher, RestoreSpec};

fn restores(b: &Bed, hostname: &str) -> Vec<RestoreSpec> {
    b.fake
        .seen(hostname)
        .into_iter()
        .filter_map(|s| match s {
            Seen::Restore(spec) => Some(spec),
            _ => None,
        })
        .collect()
}

fn boots(b: &Bed, hostname: &str) -> usize {
    b.fake
        .seen(hostname)
        .iter()
        .filter(|s| matches!(s, Seen::Boot(_)))
        .count()
}

fn controls(b: &Bed, hostname: &str) -> Vec<VmmRequest> {
    b.fake
        .seen(hostname)
        .into_iter()
        .filter_map(|s| match s {
            Seen::Control(r) => Some(r),
            _ => None,
        })
        .collect()
}

/// The message of a refusal, which must be a 409.
fn conflict<T: std::fmt::Debug>(r: super::super::Result<T>) -> String {
    let e: ApiError = r.expect_err("refused").into();
    assert_eq!(e.code, ErrorCode::Conflict, "{}", e.message);
    e.message
}

async fn agent_answers(d: &Daemon, hostname: &str) {
    let (_, client) = d.agent(hostname).await.expect("agent");
    client.health().await.expect("health");
}

#[tokio::test]
async fn suspend_and_restore_resume_the_same_memory_with_no_process_between() {
    let b = bed(false);
    let h = b.create(Wait::Agent).await;
    let memory = b.fake.memory_of(&h).expect("runs");
    let disk = b.daemon.vm(&h).expect("vm").disk;
    let r = b.daemon.suspend(&h).await.expect("suspend");
    assert_eq!(r.state, VmState::Suspended);
    assert!(r.memory_bytes > 0, "{r:?}");
    // An ephemeral VM is kept while suspended: its disk goes with its stop.
    let vm = b.daemon.vm(&h).expect("kept");
    assert_eq!((vm.state, vm.pid), (VmState::Suspended, None));
    assert!(!b.fake.is_running(&h), "its VMM exited");
    let info = b.daemon.describe(&vm);
    assert_eq!((info.status, info.pid), (VmStatus::Stopped, None));
    let files = b.daemon.suspend_files(&h);
    assert!(files.is_complete(), "{files:?}");
    assert!(!files.partial.exists());
    // Pause, snapshot into the partial folder, then the VMM is asked to exit.
    match controls(&b, &h).as_slice() {
        [VmmRequest::Pause, VmmRequest::Snapshot {
            state_path,
            mem_path,
        }, VmmRequest::Kill] => {
            assert!(state_path.starts_with(&files.partial), "{state_path:?}");
            assert!(mem_path.starts_with(&files.partial), "{mem_path:?}");
        }
        other => panic!("{other:?}"),
    }
    assert!(Path::new(&disk).is_file(), "its disk stays");

    let r = b
        .daemon
        .restore(&h, Wait::Agent, WAIT)
        .await
        .expect("restore");
    assert_eq!(r.state, VmState::Running);
    assert_eq!(b.fake.memory_of(&h), Some(memory), "resumed, not rebooted");
    assert_eq!(boots(&b, &h), 1);
    assert!(!files.exists(), "the snapshot goes once restored");
    let spec = restores(&b, &h).pop().expect("restored");
    assert_eq!(spec.state, files.state());
    assert_eq!(spec.memory, files.memory());
    assert_eq!(spec.disk.as_deref(), Some(Path::new(&disk)));
    assert_eq!((spec.cpus, spec.ram_mib, spec.paused), (1, 256, false));
    // Its identity stays; it gets fresh entropy and the clock.
    let f = b.fixups_seen(&h).pop().expect("set-up");
    assert_eq!(f.hostname, None);
    assert!(!f.machine_id && !f.ssh_host_keys);
    assert!(f.entropy.is_some() && f.clock_unix_nanos.is_some());
    agent_answers(&b.daemon, &h).await;

    // Again: each round resumes the same memory.
    b.daemon.suspend(&h).await.expect("suspend again");
    b.daemon
        .restore(&h, Wait::None, WAIT)
        .await
        .expect("restore again");
    b.daemon.wait_running(&h, WAIT).await.expect("running");
    assert_eq!(b.fake.memory_of(&h), Some(memory));
    assert_eq!(restores(&b, &h).len(), 2);
}

#[tokio::test]
async fn a_paused_vm_suspends_without_a_second_pause_and_comes_back_running() {
    let b = bed(true);
    let h = b.create(Wait::Agent).await;
    b.daemon.pause(&h).await.expect("pause");
    b.daemon
        .pause(&h)
        .await
        .expect("pausing a paused VM is a no-op");
    b.daemon.suspend(&h).await.expect("suspend");
    let pauses = controls(&b, &h)
        .iter()
        .filter(|r| matches!(r, VmmRequest::Pause))
        .count();
    assert_eq!(pauses, 1);
    b.daemon
        .restore(&h, Wait::Agent, WAIT)
        .await
        .expect("restore");
    assert!(!b.fake.is_paused(&h));
    let vm = b.daemon.vm(&h).expect("vm");
    assert_eq!(b.daemon.describe(&vm).status, VmStatus::Running);
    agent_answers(&b.daemon, &h).await;
}

#[tokio::test]
async fn suspend_and_restore_refuse_other_states_by_name() {
    let b = bed(true);
    b.fake.set_guest("dev-1", Guest::Silent);
    let booting = b.create(Wait::None).await;
    b.until("it runs", |b| b.fake.is_running(&booting)).await;
    let m = conflict(b.daemon.suspend(&booting).await);
    assert!(m.contains("dev-1 is starting"), "{m}");

    let h = b.create(Wait::Agent).await;
    b.daemon.delete(&booting).await.expect("delete");
    let m = conflict(b.daemon.restore(&h, Wait::None, WAIT).await);
    assert!(
        m.contains(&format!(
            "{h} is running; only a suspended VM can be restored"
        )),
        "{m}"
    );
    b.daemon
        .shutdown(&h, ShutdownAction::Shutdown, WAIT)
        .await
        .expect("shutdown");
    let m = conflict(b.daemon.suspend(&h).await);
    assert!(
        m.contains(&format!(
            "{h} is stopped; only a running VM can be suspended"
        )),
        "{m}"
    );
    let m = conflict(b.daemon.restore(&h, Wait::None, WAIT).await);
    assert!(m.contains(&format!("{h} is stopped")), "{m}");
    assert!(m.contains(&format!("tine vm relaunch {h}")), "{m}");

    b.daemon
        .relaunch(&h, Wait::Agent, WAIT)
        .await
        .expect("relaunch");
    b.daemon.suspend(&h).await.expect("suspend");
    let m = conflict(b.daemon.suspend(&h).await);
    assert!(m.contains(&format!("{h} is already suspended")), "{m}");
    let m = conflict(b.daemon.agent(&h).await.map(|_| ()));
    assert!(
        m.contains(&format!("{h} is suspended; restore it first")),
        "{m}"
    );
    let m = conflict(b.daemon.pause(&h).await);
    assert!(m.contains(&format!("{h} is suspended")), "{m}");
    let m = conflict(b.daemon.commit(&h, CommitRequest::default()).await);
    assert!(m.contains(&format!("{h} is suspended")), "{m}");
}

#[tokio::test]
async fn a_failed_snapshot_leaves_the_vm_running_as_it_was() {
    let b = bed(true);
    let h = b.create(Wait::Agent).await;
    let memory = b.fake.memory_of(&h);
    b.fake.refuse_snapshots(Some("no space left on device"));
    let e = b.daemon.suspend(&h).await.expect_err("the snapshot fails");
    assert!(
        super::super::chain(&e).contains("no space left on device"),
        "{e}"
    );
    assert_eq!(b.state(&h), Some(VmState::Running));
    assert!(b.fake.is_running(&h) && !b.fake.is_paused(&h), "resumed");
    assert_eq!(b.fake.memory_of(&h), memory);
    assert!(!b.daemon.suspend_files(&h).exists(), "nothing left of it");
    agent_answers(&b.daemon, &h).await;
    // A paused VM stays paused.
    b.daemon.pause(&h).await.expect("pause");
    b.daemon.suspend(&h).await.expect_err("fails again");
    let vm = b.daemon.vm(&h).expect("vm");
    assert_eq!(vm.state, VmState::Running);
    assert!(b.daemon.is_paused(&vm) && b.fake.is_paused(&h));
    b.fake.refuse_snapshots(None);
    b.daemon.suspend(&h).await.expect("suspend");
}

#[tokio::test]
async fn relaunch_shutdown_and_delete_of_a_suspended_vm() {
    let b = bed(true);
    let h = b.create(Wait::Agent).await;
    let first = b.fake.memory_of(&h);
    let files = b.daemon.suspend_files(&h);

    // Relaunch boots it from its disk; its memory is discarded.
    b.daemon.suspend(&h).await.expect("suspend");
    b.daemon
        .relaunch(&h, Wait::Agent, WAIT)
        .await
        .expect("relaunch");
    assert_eq!(boots(&b, &h), 2);
    assert_ne!(b.fake.memory_of(&h), first, "a new boot");
    assert!(!files.exists());

    // A graceful shutdown restores it so its guest can stop cleanly.
    b.daemon.suspend(&h).await.expect("suspend");
    let r = b
        .daemon
        .shutdown(&h, ShutdownAction::Shutdown, WAIT)
        .await
        .expect("shutdown");
    assert_eq!(
        (r.state, r.stop_mode),
        (VmState::Stopped, Some(StopMode::Graceful))
    );
    let seen = b.fake.seen(&h);
    let restored = seen
        .iter()
        .rposition(|s| matches!(s, Seen::Restore(_)))
        .expect("restored");
    let asked = seen
        .iter()
        .rposition(|s| matches!(s, Seen::Agent(AgentRequest::Shutdown(_))))
        .expect("asked");
    assert!(asked > restored, "{seen:?}");
    assert!(!files.exists() && !b.fake.is_running(&h));

    // Poweroff discards its memory: forced, and it says so.
    b.daemon
        .relaunch(&h, Wait::Agent, WAIT)
        .await
        .expect("relaunch");
    b.daemon.suspend(&h).await.expect("suspend");
    let before = restores(&b, &h).len();
    let r = b
        .daemon
        .shutdown(&h, ShutdownAction::Poweroff, WAIT)
        .await
        .expect("poweroff");
    assert_eq!(
        (r.state, r.stop_mode),
        (VmState::Stopped, Some(StopMode::Forced))
    );
    let vm = b.daemon.vm(&h).expect("kept");
    assert_eq!(vm.state, VmState::Stopped);
    let reason = vm.reason.unwrap_or_default();
    assert!(
        reason.contains("suspended memory was discarded"),
        "{reason}"
    );
    assert_eq!(restores(&b, &h).len(), before, "not restored");
    assert!(!files.exists());

    // Delete removes it with its snapshot.
    b.daemon
        .relaunch(&h, Wait::Agent, WAIT)
        .await
        .expect("relaunch");
    b.daemon.suspend(&h).await.expect("suspend");
    b.daemon.delete(&h).await.expect("delete");
    assert_eq!(b.state(&h), None);
    assert!(!b.daemon.paths(&h).dir.exists());

    // An ephemeral VM goes with its stop, suspended or not.
    let e = bed(false);
    for action in [ShutdownAction::Poweroff, ShutdownAction::Shutdown] {
        let h = e.create(Wait::Agent).await;
        e.daemon.suspend(&h).await.expect("suspend");
        e.daemon.shutdown(&h, action, WAIT).await.expect("stop");
        assert_eq!(e.state(&h), None, "{action}");
        assert!(!e.daemon.paths(&h).dir.exists(), "{action}");
    }
}

#[tokio::test]
async fn a_damaged_snapshot_is_a_clear_error_and_the_vm_stays_suspended() {
    let b = bed(true);
    let h = b.create(Wait::Agent).await;
    b.daemon.suspend(&h).await.expect("suspend");
    let files = b.daemon.suspend_files(&h);
    std::fs::write(files.state(), b"garbage").expect("damage");
    let e = b
        .daemon
        .restore(&h, Wait::Agent, WAIT)
        .await
        .expect_err("damaged");
    let text = super::super::chain(&e);
    assert!(text.contains(&format!("restore {h}")), "{text}");
    assert!(text.contains("is not a snapshot"), "{text}");
    assert_eq!(b.state(&h), Some(VmState::Suspended));
    assert!(!b.fake.is_running(&h));
    std::fs::remove_file(files.memory()).expect("remove");
    let m = conflict(b.daemon.restore(&h, Wait::Agent, WAIT).await);
    assert!(m.contains("missing or incomplete"), "{m}");
    assert!(m.contains(&format!("tine vm relaunch {h}")), "{m}");
    b.daemon
        .relaunch(&h, Wait::Agent, WAIT)
        .await
        .expect("relaunch");
    assert!(!files.exists());
}

/// What a first daemon did before it died, and the second one after it.
struct Restarted {
    _dir: tempfile::TempDir,
    fake: FakeLauncher,
    daemon: Arc<Daemon>,
    hostname: String,
    memory: u64,
    report: super::super::ReconcileReport,
    runtime: tokio::runtime::Runtime,
}

/// A first daemon, on a thread of its own, creates a VM; with `point` it
/// then suspends it (restores it too, for a restore's points) until the
/// point stops the thread for good, as a `kill -9` there would; without,
/// it suspends it and ends. A second daemon on the same data directory
/// and VMs then runs its start-up reconciliation.
fn restart_after(point: Option<Failpoint>, persistent: bool) -> Restarted {
    let dir = tempfile::tempdir().expect("tmp");
    let fake = FakeLauncher::new();
    let cfg = config(dir.path(), persistent, 4);
    let (ready_tx, ready) = mpsc::channel();
    let (reached_tx, reached) = mpsc::channel();
    let (path, first_fake, first_cfg) = (dir.path().to_owned(), fake.clone(), cfg.clone());
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async move {
            let first = open(&path, &first_fake, first_cfg, Deadlines::default());
            let h = first
                .create_vm("dev", CreateVmRequest::default(), Wait::Agent, WAIT, false)
                .await
                .expect("create")
                .hostname;
            let memory = first_fake.memory_of(&h).expect("runs");
            let restoring = matches!(
                point,
                Some(Failpoint::RestoreSpawned | Failpoint::RestoreRecorded)
            );
            if restoring || point.is_none() {
                first.suspend(&h).await.expect("suspend");
            }
            ready_tx.send((h.clone(), memory)).expect("send");
            let Some(point) = point else { return };
            failpoint::freeze::arm(point, reached_tx);
            let done = if restoring {
                first.restore(&h, Wait::None, WAIT).await.map(drop)
            } else {
                first.suspend(&h).await.map(drop)
            };
            panic!("{} was not reached: {done:?}", point.name());
        });
    });
    let (hostname, memory) = ready.recv_timeout(WAIT).expect("the first daemon's VM");
    if let Some(point) = point {
        assert_eq!(reached.recv_timeout(WAIT), Ok(point), "the crash point");
    }
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let daemon = open(dir.path(), &fake, cfg, Deadlines::default());
    let report = runtime.block_on(daemon.reconcile()).expect("reconcile");
    Restarted {
        _dir: dir,
        fake,
        daemon,
        hostname,
        memory,
        report,
        runtime,
    }
}

impl Restarted {
    fn state(&self) -> VmState {
        self.daemon.vm(&self.hostname).expect("the VM").state
    }

    /// No run is left that no live record names.
    fn no_unrecorded_run(&self) {
        for s in self.fake.strays() {
            let vm = self.daemon.vm(&s.hostname).expect("a record");
            assert!(
                vm.state.is_live() && vm.pid == Some(s.pid),
                "{s:?} runs for {vm:?}"
            );
        }
    }

    /// Suspended with its snapshot and no process; then it restores to
    /// the memory it had.
    fn suspended_and_restorable(&self) {
        let h = &self.hostname;
        assert_eq!(self.state(), VmState::Suspended, "{:?}", self.report);
        assert!(!self.fake.is_running(h), "no VMM");
        assert!(self.daemon.suspend_files(h).is_complete());
        assert!(!self.daemon.suspend_files(h).partial.exists());
        self.no_unrecorded_run();
        self.runtime.block_on(async {
            self.daemon
                .restore(h, Wait::Agent, WAIT)
                .await
                .expect("restore");
            agent_answers(&self.daemon, h).await;
        });
        assert_eq!(self.fake.memory_of(h), Some(self.memory));
    }

    /// Running on with the memory it had, not paused, no snapshot left.
    fn running_on(&self) {
        let h = &self.hostname;
        self.runtime.block_on(async {
            self.daemon.wait_running(h, WAIT).await.expect("running");
            agent_answers(&self.daemon, h).await;
        });
        assert_eq!(self.fake.memory_of(h), Some(self.memory), "the same run");
        assert!(!self.fake.is_paused(h), "resumed");
        let vm = self.daemon.vm(h).expect("vm");
        assert!(!self.daemon.is_paused(&vm));
        assert!(!self.daemon.suspend_files(h).exists(), "no snapshot left");
        self.no_unrecorded_run();
    }
}

#[test]
fn a_kill_before_the_snapshot_is_in_place_leaves_the_vm_running() {
    for point in [Failpoint::SuspendRecorded, Failpoint::SuspendSnapshotTaken] {
        let r = restart_after(Some(point), true);
        assert!(
            r.report.adopted.contains(&r.hostname),
            "{point:?}: {:?}",
            r.report
        );
        r.running_on();
        // ... and it suspends and restores as ever.
        r.runtime.block_on(async {
            r.daemon.suspend(&r.hostname).await.expect("suspend");
        });
        r.suspended_and_restorable();
    }
}

#[test]
fn a_kill_once_the_snapshot_is_in_place_leaves_the_vm_suspended() {
    for point in [
        Failpoint::SuspendSnapshotSealed,
        Failpoint::SuspendRecordedSuspended,
    ] {
        let r = restart_after(Some(point), false);
        assert!(
            r.report.suspended.contains(&r.hostname),
            "{point:?}: {:?}",
            r.report
        );
        if point == Failpoint::SuspendRecordedSuspended {
            // Its paused VMM outlived the daemon and no record names it.
            assert_eq!(r.report.killed.len(), 1, "{:?}", r.report);
        }
        r.suspended_and_restorable();
    }
}

#[test]
fn a_kill_during_a_restore_leaves_it_suspended_or_running() {
    let r = restart_after(Some(Failpoint::RestoreSpawned), true);
    assert_eq!(
        r.report.killed.len(),
        1,
        "the unrecorded VMM: {:?}",
        r.report
    );
    r.suspended_and_restorable();

    let r = restart_after(Some(Failpoint::RestoreRecorded), true);
    assert!(r.report.adopted.contains(&r.hostname), "{:?}", r.report);
    r.running_on();
}

#[test]
fn a_suspended_vm_waits_through_a_restart_and_one_without_its_snapshot_stops() {
    let r = restart_after(None, true);
    assert!(r.report.suspended.contains(&r.hostname), "{:?}", r.report);
    assert!(
        r.report.relaunched.is_empty(),
        "nothing to run: {:?}",
        r.report
    );
    r.suspended_and_restorable();

    // Its snapshot removed behind the daemon's back: it cannot be
    // restored, so it is stopped (persistent) and boots from its disk.
    let r = restart_after(None, true);
    let files = r.daemon.suspend_files(&r.hostname);
    std::fs::remove_file(files.state()).expect("remove");
    let report = r.runtime.block_on(r.daemon.reconcile()).expect("reconcile");
    assert!(report.stopped.contains(&r.hostname), "{report:?}");
    let vm = r.daemon.vm(&r.hostname).expect("kept");
    assert_eq!(
        (vm.state, vm.stop_mode),
        (VmState::Stopped, Some(StopMode::Forced))
    );
    assert!(!files.exists());
    r.runtime.block_on(async {
        r.daemon
            .relaunch(&r.hostname, Wait::Agent, WAIT)
            .await
            .expect("relaunch");
    });
    // An ephemeral one is removed.
    let r = restart_after(None, false);
    std::fs::remove_file(r.daemon.suspend_files(&r.hostname).memory()).expect("remove");
    let report = r.runtime.block_on(r.daemon.reconcile()).expect("reconcile");
    assert!(report.removed.contains(&r.hostname), "{report:?}");
    assert!(r.daemon.vm(&r.hostname).is_err());
}
