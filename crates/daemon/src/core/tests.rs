//! The core on the fake launcher: life cycles, the exit policy, forks that
//! fail, boot slots, reconciliation after a `kill -9`, deletes during boot.
//! No KVM, no test bed.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tine_proto::agent::Request as AgentRequest;
use tine_proto::api::{
    CommitRequest, CreateVmRequest, ErrorCode, Fixup, ForkRequest, ShutdownAction, StopMode,
    VmState, Wait,
};
use tine_proto::vmm::StopReason;

use super::{Daemon, Deadlines, Parts};
use crate::config::{Config, HostGroup};
use crate::db::Locking;
use crate::error::ApiError;
use crate::launcher::fake::{FakeLauncher, Guest, Seen};
use crate::launcher::Stop;
use crate::storage;

const WAIT: Duration = Duration::from_secs(10);

mod hot_fork;
mod suspend;

struct Bed {
    dir: tempfile::TempDir,
    fake: FakeLauncher,
    daemon: Arc<Daemon>,
}

fn config(dir: &Path, persistent: bool, slots: u32) -> Config {
    let image = dir.join("base.img");
    if !image.exists() {
        std::fs::write(&image, vec![0u8; 1 << 20]).expect("image");
    }
    let mut c = Config::embedded_default();
    c.boot_concurrency = Some(slots);
    c.host_groups = vec![HostGroup {
        name: "dev".into(),
        image: image.display().to_string(),
        persistent,
        ram_mb: 256,
        ..c.host_groups[0].clone()
    }];
    c
}

/// A daemon on `dir`'s data directory. Its store is shared: the restart
/// tests open a second daemon there while the first, frozen at a crash
/// point, still holds its own.
fn open(dir: &Path, fake: &FakeLauncher, config: Config, deadlines: Deadlines) -> Arc<Daemon> {
    let parts = Parts::on_launcher_with(
        config,
        dir.join("data"),
        Arc::new(fake.clone()),
        deadlines,
        Locking::Shared,
    );
    Daemon::from_parts(parts.expect("daemon parts"))
}

fn bed_with(persistent: bool, slots: u32, deadlines: Deadlines) -> Bed {
    let dir = tempfile::tempdir().expect("tmp");
    let fake = FakeLauncher::new();
    let daemon = open(
        dir.path(),
        &fake,
        config(dir.path(), persistent, slots),
        deadlines,
    );
    Bed { dir, fake, daemon }
}

fn bed(persistent: bool) -> Bed {
    bed_with(persistent, 4, Deadlines::default())
}

impl Bed {
    async fn create(&self, wait: Wait) -> String {
        self.daemon
            .create_vm("dev", CreateVmRequest::default(), wait, WAIT, false)
            .await
            .expect("create")
            .hostname
    }

    fn state(&self, hostname: &str) -> Option<VmState> {
        self.daemon.vm(hostname).ok().map(|v| v.state)
    }

    async fn until(&self, what: &str, f: impl Fn(&Bed) -> bool) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while !f(self) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting until {what}"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    fn fixups_seen(&self, hostname: &str) -> Vec<tine_proto::agent::FixupRequest> {
        self.fake
            .seen(hostname)
            .into_iter()
            .filter_map(|s| match s {
                Seen::Agent(AgentRequest::Fixups(f)) => Some(f),
                _ => None,
            })
            .collect()
    }

    /// A VM booted, then shut down.
    async fn stopped(&self) -> String {
        let h = self.create(Wait::Agent).await;
        self.daemon
            .shutdown(&h, ShutdownAction::Shutdown, WAIT)
            .await
            .expect("shutdown");
        h
    }

    /// A persistent builder, stopped and committed.
    async fn commit(&self) -> String {
        let h = self.stopped().await;
        self.daemon
            .commit(&h, CommitRequest::default())
            .await
            .expect("commit")
            .commit_id
    }
}

#[tokio::test]
async fn a_create_boots_sets_up_and_runs() {
    let b = bed(false);
    let h = b.create(Wait::Agent).await;
    assert_eq!(b.state(&h), Some(VmState::Running));
    assert!(b.fake.is_running(&h));
    let boots: Vec<_> = b
        .fake
        .seen(&h)
        .into_iter()
        .filter_map(|s| match s {
            Seen::Boot(spec) => Some(spec),
            _ => None,
        })
        .collect();
    assert_eq!(boots.len(), 1);
    assert_eq!((boots[0].cpus, boots[0].ram_mib), (1, 256));
    assert!(boots[0].disk.starts_with(b.dir.path()));
    // A first boot gets its identity.
    let f = b.fixups_seen(&h);
    assert_eq!(f.len(), 1);
    assert_eq!(f[0].hostname.as_deref(), Some(h.as_str()));
    assert!(f[0].machine_id && f[0].ssh_host_keys);
}

#[tokio::test]
async fn a_disk_commits_file_is_checked_off_its_first_forks_path() {
    let b = bed(true);
    let commit = b.commit().await;
    // The check waits until the new file's stamp settles, without holding
    // the daemon: one dropped meanwhile (a restart in the same process)
    // releases its store at once.
    assert_eq!(Arc::strong_count(&b.daemon), 1, "only the bed holds it");
    b.until("the commit's file is checked", |b| {
        b.daemon.verified_stamp(&commit).is_some()
    })
    .await;
}

#[tokio::test]
async fn the_set_up_sends_its_steps_at_once() {
    let b = bed(true);
    let commit = b.commit().await;
    // The fork's agent answers its fix-ups only once asked something else:
    // a fork always syncs its secrets, which must not wait for them.
    b.fake.set_guest("dev-2", Guest::SlowFixups);
    let f = b
        .daemon
        .fork(&commit, ForkRequest::default(), Wait::Agent, WAIT)
        .await
        .expect("fork");
    assert_eq!(f.hostname, "dev-2");
    let seen = b.fake.seen(&f.hostname);
    let at = |what: fn(&Seen) -> bool| seen.iter().position(what);
    let secrets = at(|s| matches!(s, Seen::Agent(AgentRequest::SecretsSync(_))));
    let answered = at(|s| matches!(s, Seen::FixupsAnswered));
    assert!(
        matches!((secrets, answered), (Some(s), Some(a)) if s < a),
        "the secrets were asked for after the fix-ups' answer: {seen:?}"
    );
}

#[tokio::test]
async fn the_exit_policy_removes_stopped_ephemeral_vms_and_keeps_persistent_ones() {
    let eph = bed(false);
    let h = eph.create(Wait::Agent).await;
    let r = eph
        .daemon
        .shutdown(&h, ShutdownAction::Shutdown, WAIT)
        .await
        .expect("shutdown");
    assert_eq!(r.stop_mode, Some(StopMode::Graceful));
    assert_eq!(eph.state(&h), None, "an ephemeral VM goes with its stop");
    assert!(!eph.daemon.paths(&h).dir.exists());

    let per = bed(true);
    let h = per.create(Wait::Agent).await;
    per.daemon
        .shutdown(&h, ShutdownAction::Shutdown, WAIT)
        .await
        .expect("shutdown");
    let vm = per.daemon.vm(&h).expect("kept");
    assert_eq!(
        (vm.state, vm.stop_mode),
        (VmState::Stopped, Some(StopMode::Graceful))
    );
    assert!(Path::new(&vm.disk).is_file(), "its disk stays");
    // The agent was asked, so Ctrl-Alt-Del was not needed.
    assert!(per
        .fake
        .seen(&h)
        .iter()
        .any(|s| matches!(s, Seen::Agent(AgentRequest::Shutdown(_)))));
    assert!(!per
        .fake
        .seen(&h)
        .iter()
        .any(|s| matches!(s, Seen::Control(_))));

    // A crash of a running persistent VM: failed, crashed, disk kept.
    per.daemon
        .relaunch(&h, Wait::Agent, WAIT)
        .await
        .expect("relaunch");
    per.fake.stop(&h, Stop::Reported(StopReason::TripleFault));
    per.until("the crash is recorded", |b| {
        b.state(&h) == Some(VmState::Failed)
    })
    .await;
    let vm = per.daemon.vm(&h).expect("kept");
    assert_eq!(vm.stop_mode, Some(StopMode::Crashed));
    assert_eq!(vm.reason.as_deref(), Some("triple_fault"));

    // A crash of an ephemeral VM keeps the record to say why, not the disk.
    let h = eph.create(Wait::Agent).await;
    let disk = eph.daemon.vm(&h).expect("vm").disk;
    eph.fake.stop(&h, Stop::Reported(StopReason::GuestCrash));
    eph.until("the crash is recorded", |b| {
        b.state(&h) == Some(VmState::Failed)
    })
    .await;
    assert!(!Path::new(&disk).exists());
}

#[tokio::test]
async fn a_guest_deaf_to_shutdown_is_killed_after_the_timeout_and_recorded_as_forced() {
    let b = bed(true);
    let h = b.create(Wait::Agent).await;
    // Its next run ignores every stop request.
    b.daemon
        .shutdown(&h, ShutdownAction::Shutdown, WAIT)
        .await
        .expect("shutdown");
    b.fake.set_guest(&h, Guest::Deaf);
    b.daemon
        .relaunch(&h, Wait::Agent, WAIT)
        .await
        .expect("relaunch");
    let r = b
        .daemon
        .shutdown(&h, ShutdownAction::Shutdown, Duration::from_millis(300))
        .await
        .expect("shutdown");
    assert_eq!(r.stop_mode, Some(StopMode::Forced));
    let vm = b.daemon.vm(&h).expect("kept");
    assert!(
        vm.reason
            .as_deref()
            .unwrap_or("")
            .contains("did not power off"),
        "{:?}",
        vm.reason
    );
    // action=poweroff kills at once.
    b.daemon
        .relaunch(&h, Wait::Agent, WAIT)
        .await
        .expect("relaunch");
    let r = b
        .daemon
        .shutdown(&h, ShutdownAction::Poweroff, WAIT)
        .await
        .expect("poweroff");
    assert_eq!(r.stop_mode, Some(StopMode::Forced));
}

#[tokio::test]
async fn a_fork_that_fails_to_start_leaves_nothing() {
    let b = bed(true);
    let commit = b.commit().await;
    // The next VM is dev-2; its guest crashes at once.
    b.fake.set_guest("dev-2", Guest::Crashes);
    let err: ApiError = b
        .daemon
        .fork(&commit, ForkRequest::default(), Wait::Agent, WAIT)
        .await
        .expect_err("the fork crashes")
        .into();
    assert_eq!(err.code, ErrorCode::Internal);
    assert!(err.message.contains("triple_fault"), "{}", err.message);
    assert_eq!(b.state("dev-2"), None, "no record");
    assert!(!b.daemon.paths("dev-2").dir.exists(), "no folder");
    // A fork whose VMM cannot start leaves nothing either.
    b.fake.refuse_boots(Some("no tine-vmm"));
    let err = b
        .daemon
        .fork(&commit, ForkRequest::default(), Wait::Agent, WAIT)
        .await
        .expect_err("no VMM");
    assert!(super::chain(&err).contains("no tine-vmm"), "{err}");
    assert_eq!(
        b.daemon.vm_count(None).expect("count"),
        1,
        "only the builder"
    );
}

#[tokio::test]
async fn a_commit_damaged_after_a_fork_is_refused_by_the_next_fork() {
    use std::os::unix::fs::PermissionsExt;
    let b = bed(true);
    let commit = b.commit().await;
    b.daemon
        .fork(&commit, ForkRequest::default(), Wait::None, WAIT)
        .await
        .expect("first fork");
    let file = b
        .daemon
        .commits(&crate::db::CommitFilter::default())
        .expect("commits")[0]
        .disk
        .clone();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    std::fs::write(&file, b"not a qcow2 image any more").expect("damage");
    let err = b
        .daemon
        .fork(&commit, ForkRequest::default(), Wait::None, WAIT)
        .await
        .expect_err("damaged");
    assert!(super::chain(&err).contains("cannot be forked"), "{err}");
}

#[tokio::test]
async fn no_fixups_applies_none_not_even_the_hostname() {
    let b = bed(true);
    let commit = b.commit().await;
    let none = ForkRequest {
        fixups: Some(vec![]),
        ..ForkRequest::default()
    };
    let f = b
        .daemon
        .fork(&commit, none, Wait::Agent, WAIT)
        .await
        .expect("fork");
    let seen = b.fixups_seen(&f.hostname);
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].hostname, None);
    assert!(!seen[0].machine_id && !seen[0].ssh_host_keys);
    let one = ForkRequest {
        fixups: Some(vec![Fixup::MachineId]),
        ..ForkRequest::default()
    };
    let f = b
        .daemon
        .fork(&commit, one, Wait::Agent, WAIT)
        .await
        .expect("fork");
    let seen = b.fixups_seen(&f.hostname);
    assert_eq!(seen[0].hostname, None);
    assert!(seen[0].machine_id && !seen[0].ssh_host_keys);
    // A fork never runs userdata.
    assert!(!b
        .fake
        .seen(&f.hostname)
        .iter()
        .any(|s| matches!(s, Seen::Agent(AgentRequest::UserdataRun(_)))));
}

#[tokio::test]
async fn a_guest_that_never_answers_its_setup_fails_and_frees_its_boot_slot() {
    let deadlines = Deadlines {
        setup_call: Duration::from_millis(200),
        ..Deadlines::default()
    };
    let b = bed_with(true, 1, deadlines);
    b.fake.set_guest("dev-1", Guest::Hangs);
    let first = b
        .daemon
        .create_vm("dev", CreateVmRequest::default(), Wait::Agent, WAIT, false)
        .await
        .expect_err("its set-up hangs");
    assert!(super::chain(&first).contains("dev-1"), "{first}");
    let vm = b.daemon.vm("dev-1").expect("kept");
    assert_eq!(vm.state, VmState::Failed);
    assert!(
        vm.reason.as_deref().unwrap_or("").contains("fix-ups"),
        "{:?}",
        vm.reason
    );
    assert!(!b.fake.is_running("dev-1"), "the hung guest is killed");
    // The one boot slot is free: the next VMs come up.
    for _ in 0..3 {
        let h = b.create(Wait::Agent).await;
        assert_eq!(b.state(&h), Some(VmState::Running));
    }
}

#[tokio::test]
async fn a_create_storm_boots_through_the_slots() {
    let b = bed_with(false, 2, Deadlines::default());
    let mut jobs = Vec::new();
    for _ in 0..12 {
        let d = b.daemon.clone();
        jobs.push(tokio::spawn(async move {
            d.create_vm("dev", CreateVmRequest::default(), Wait::Agent, WAIT, false)
                .await
        }));
    }
    let mut names = Vec::new();
    for j in jobs {
        names.push(j.await.expect("task").expect("create").hostname);
    }
    names.sort();
    names.dedup();
    assert_eq!(names.len(), 12, "every VM got its own hostname");
    assert!(names.iter().all(|h| b.state(h) == Some(VmState::Running)));
}

#[tokio::test]
async fn delete_during_boot_stops_the_run_and_removes_everything() {
    let b = bed(true);
    b.fake.set_guest("dev-1", Guest::Silent);
    let h = b.create(Wait::None).await;
    b.until("it runs", |b| b.fake.is_running(&h)).await;
    assert_eq!(b.state(&h), Some(VmState::Starting));
    b.daemon.delete(&h).await.expect("delete");
    assert_eq!(b.state(&h), None);
    assert!(!b.fake.is_running(&h));
    assert!(!b.daemon.paths(&h).dir.exists());
}

#[tokio::test]
async fn a_wait_by_friendly_name_wakes_when_that_vm_runs() {
    // One boot slot, held by a guest whose agent never answers: the named
    // VM waits in the queue until that one is deleted.
    let b = bed_with(true, 1, Deadlines::default());
    b.fake.set_guest("dev-1", Guest::Silent);
    let first = b.create(Wait::None).await;
    b.until("the first runs", |b| b.fake.is_running(&first))
        .await;
    let req = CreateVmRequest {
        name: Some("web".into()),
        ..CreateVmRequest::default()
    };
    let web = b
        .daemon
        .create_vm("dev", req, Wait::None, WAIT, false)
        .await
        .expect("create")
        .hostname;
    let waiting = {
        let d = b.daemon.clone();
        tokio::spawn(async move { d.wait_running("web", WAIT).await })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(
        !waiting.is_finished(),
        "web cannot run before the slot frees"
    );
    assert_eq!(b.state(&web), Some(VmState::Starting));
    b.daemon.delete(&first).await.expect("delete");
    let vm = waiting.await.expect("task").expect("web runs");
    assert_eq!((vm.hostname, vm.state), (web, VmState::Running));
}

#[test]
fn reconcile_after_a_kill_adopts_relaunches_and_removes() {
    let dir = tempfile::tempdir().expect("tmp");
    let fake = FakeLauncher::new();
    let cfg = config(dir.path(), true, 4);
    let mk = |persistent: bool| CreateVmRequest {
        persistent: Some(persistent),
        ..CreateVmRequest::default()
    };
    // The first daemon runs on a runtime of its own: dropping the runtime
    // ends every task of it at once, as a `kill -9` would; the runs go on.
    let first_runtime = tokio::runtime::Runtime::new().expect("runtime");
    let (survivor, crashed, ephemeral, creating) = first_runtime.block_on(async {
        let first = open(dir.path(), &fake, cfg.clone(), Deadlines::default());
        let a = first
            .create_vm("dev", mk(true), Wait::Agent, WAIT, false)
            .await
            .expect("a");
        let b = first
            .create_vm("dev", mk(true), Wait::Agent, WAIT, false)
            .await
            .expect("b");
        let c = first
            .create_vm("dev", mk(false), Wait::Agent, WAIT, false)
            .await
            .expect("c");
        let lone = || crate::db::NewVm {
            host_group: "dev".into(),
            cpus: 1,
            ram_bytes: 256 << 20,
            ..crate::db::NewVm::default()
        };
        // A create an older daemon recorded `creating` and never finished.
        let d = first
            .store
            .insert_vm(&lone(), |h| format!("/nowhere/{h}.qcow2"))
            .expect("record");
        first
            .store
            .set_state(&d.hostname, VmState::Creating, None)
            .expect("creating");
        // A queued VM whose disk is gone: it cannot boot.
        let e = first
            .store
            .insert_vm(&lone(), |h| format!("/nowhere/{h}.qcow2"))
            .expect("record");
        (a.hostname, b.hostname, c.hostname, (d.hostname, e.hostname))
    });
    let (creating, diskless) = creating;
    drop(first_runtime);
    let killed = || Stop::Signalled {
        signal: 9,
        output: String::new(),
    };
    fake.stop(&crashed, killed());
    fake.stop(&ephemeral, killed());
    let stray = fake.start_stray("dev-9");
    let second_runtime = tokio::runtime::Runtime::new().expect("runtime");
    second_runtime.block_on(async {
        let second = open(dir.path(), &fake, cfg, Deadlines::default());
        let report = second.reconcile().await.expect("reconcile");
        assert_eq!(report.adopted, vec![survivor.clone()]);
        assert_eq!(report.relaunched, vec![crashed.clone()]);
        assert!(report.removed.contains(&ephemeral), "{report:?}");
        assert!(report.removed.contains(&creating), "{report:?}");
        assert_eq!(report.killed, vec![format!("dev-9 (pid {})", stray.pid)]);
        assert!(!fake.is_running("dev-9"));
        assert!(second.vm(&ephemeral).is_err() && second.vm(&creating).is_err());
        assert_eq!(report.failed, vec![diskless.clone()]);
        let failed = second.vm(&diskless).expect("diskless");
        assert_eq!(failed.state, VmState::Failed);
        let reason = failed.reason.unwrap_or_default();
        assert!(reason.contains("missing or unreadable"), "{reason}");
        // The crashed persistent VM boots again.
        let vm = second
            .wait_running(&crashed, WAIT)
            .await
            .expect("relaunched");
        assert_eq!(vm.state, VmState::Running);
        // The adopted VM is supervised again: its stop is seen.
        fake.stop(&survivor, Stop::Reported(StopReason::GuestPoweroff(0)));
        let deadline = tokio::time::Instant::now() + WAIT;
        while second.vm(&survivor).expect("vm").state != VmState::Stopped {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the adopted VM's stop was not seen"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    });
}

#[tokio::test]
async fn reconcile_remakes_the_disk_a_power_loss_took_from_an_unborn_fork() {
    let b = bed(true);
    let commit = b.commit().await;
    // A fork is answered before its overlay is synced: a power loss then
    // leaves its record (synced by SQLite) without its disk.
    let paths = |h: &str| b.daemon.paths(h).dir.join("disk.qcow2");
    let fork = b
        .daemon
        .store
        .insert_vm(
            &crate::db::NewVm {
                host_group: "dev".into(),
                cpus: 1,
                ram_bytes: 256 << 20,
                parent_commit_id: Some(commit.clone()),
                fixups: Some(Vec::new()),
                booted_once: true,
                ..crate::db::NewVm::default()
            },
            |h| paths(h).display().to_string(),
        )
        .expect("record");
    assert!(!paths(&fork.hostname).exists());
    let report = b.daemon.reconcile().await.expect("reconcile");
    assert!(report.relaunched.contains(&fork.hostname), "{report:?}");
    assert!(report.failed.is_empty(), "{report:?}");
    let vm = b
        .daemon
        .wait_running(&fork.hostname, WAIT)
        .await
        .expect("the fork boots");
    assert!(storage::is_intact(Path::new(&vm.disk)));
    let c = b
        .daemon
        .store
        .get_commit(&commit)
        .expect("get")
        .expect("commit");
    let chain = tine_disk::backing_chain(Path::new(&vm.disk)).expect("chain");
    assert!(
        chain.iter().any(|i| i.path == Path::new(&c.disk)),
        "{chain:?} lacks {}",
        c.disk
    );
}

#[tokio::test]
async fn reconcile_removes_what_an_interrupted_image_import_left() {
    let b = bed(true);
    // A VM makes the group's image a recorded base, which stays.
    b.create(Wait::Agent).await;
    let images = b.daemon.images_dir();
    let recorded: Vec<String> = b.daemon.store.image_paths().expect("paths");
    assert_eq!(recorded.len(), 1);
    // An upload, a conversion folder, and a base renamed in place whose
    // record was never written.
    let upload = images.join(".import-0123456789abcdef.upload");
    let work = images.join(".import-0123456789abcdef.work");
    let orphan = images.join("app-0123456789abcdef.base");
    std::fs::write(&upload, b"half an upload").expect("upload");
    std::fs::create_dir_all(work.join("root/etc")).expect("work");
    std::fs::write(&orphan, b"unrecorded").expect("orphan");
    let report = b.daemon.reconcile().await.expect("reconcile");
    for p in [&upload, &work, &orphan] {
        assert!(!p.exists(), "{} is left", p.display());
        assert!(
            report.removed.contains(&p.display().to_string()),
            "{report:?}"
        );
    }
    assert!(Path::new(&recorded[0]).is_file(), "the recorded base stays");
}

#[tokio::test]
async fn the_periodic_sync_checkpoints_a_grown_wal_when_no_hot_fork_launches() {
    let b = bed(true);
    let store = &b.daemon.store;
    let vm = store
        .insert_vm(
            &crate::db::NewVm {
                host_group: "dev".into(),
                cpus: 1,
                ram_bytes: 256 << 20,
                ..crate::db::NewVm::default()
            },
            |h| format!("/nowhere/{h}.qcow2"),
        )
        .expect("record");
    // State changes, each a WAL frame or more, past the quiet size.
    let mut running = false;
    while store.wal_bytes() <= super::daemon::STATE_CHECKPOINT_QUIET {
        running = !running;
        let state = if running {
            VmState::Running
        } else {
            VmState::Stopped
        };
        store.set_state(&vm.hostname, state, None).expect("state");
    }
    let grown = store.wal_bytes();
    b.daemon.hot_launches.fetch_add(1, Ordering::SeqCst);
    b.daemon.sync_state().await;
    assert_eq!(store.unsynced_changes(), 0, "synced");
    assert!(
        store.wal_bytes() >= grown,
        "checkpointed while a hot fork launched"
    );
    b.daemon.hot_launches.fetch_sub(1, Ordering::SeqCst);
    b.daemon.sync_state().await;
    assert!(
        store.wal_bytes() < grown / 100,
        "not checkpointed when quiet: {} bytes",
        store.wal_bytes()
    );
    assert_eq!(
        store.find_vm(&vm.hostname).expect("find").map(|v| v.state),
        Some(if running {
            VmState::Running
        } else {
            VmState::Stopped
        })
    );
}
