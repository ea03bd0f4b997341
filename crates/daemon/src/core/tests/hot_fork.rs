//! Memory commits and hot forks on the fake launcher: what a memory
//! commit does to its running source, what a hot fork resumes and with
//! which set-up, what both refuse (by name), and a `kill -9` at every step
//! of a memory commit followed by a restart.

use std::sync::mpsc;

use tine_proto::api::CommitMode;
use tine_proto::vmm::Request as VmmRequest;

use super::*;
use crate::db::CommitFilter;
use crate::failpoint::{self, Failpoint};
use crate::launcher::{PrimeSpec, RestoreSpec};

fn memory_commit() -> CommitRequest {
    CommitRequest {
        mode: Some(CommitMode::Memory),
        tags: vec!["warm".into()],
        ..CommitRequest::default()
    }
}

/// How a fork's guest was resumed.
#[derive(Debug)]
enum Resumed {
    /// Restored into a process on its path.
    Restore(RestoreSpec),
    /// A VM primed ahead of it, taken over.
    Primed(Box<PrimeSpec>),
}

fn resumes(b: &Bed, hostname: &str) -> Vec<Resumed> {
    b.fake
        .seen(hostname)
        .into_iter()
        .filter_map(|s| match s {
            Seen::Restore(spec) => Some(Resumed::Restore(spec)),
            Seen::ResumePrimed(spec) => Some(Resumed::Primed(Box::new(spec))),
            _ => None,
        })
        .collect()
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

impl Bed {
    /// A memory commit, with its own warm pool of `pool`, of a running
    /// source; its spares and primed VMs made.
    async fn pooled_commit(&self, pool: u32) -> String {
        let source = self.create(Wait::Agent).await;
        self.pooled_commit_of(&source, pool).await
    }

    /// The same of the running VM `source`.
    async fn pooled_commit_of(&self, source: &str, pool: u32) -> String {
        let id = self
            .daemon
            .commit(
                source,
                CommitRequest {
                    hot_fork_pool: Some(pool),
                    ..memory_commit()
                },
            )
            .await
            .expect("commit")
            .commit_id;
        self.daemon.fill_pools().await;
        id
    }

    /// A fork of `commit` with the defaults, once its agent answers.
    async fn fork_of(&self, commit: &str) -> String {
        self.daemon
            .fork(commit, ForkRequest::default(), Wait::Agent, WAIT)
            .await
            .expect("fork")
            .hostname
    }

    /// A running source and a memory commit of it.
    async fn memory_committed(&self) -> (String, String) {
        let source = self.create(Wait::Agent).await;
        let id = self
            .daemon
            .commit(&source, memory_commit())
            .await
            .expect("commit")
            .commit_id;
        (source, id)
    }
}

fn refusal<T: std::fmt::Debug>(r: super::super::Result<T>, code: ErrorCode) -> String {
    let e: ApiError = r.expect_err("refused").into();
    assert_eq!(e.code, code, "{}", e.message);
    e.message
}

#[tokio::test]
async fn a_memory_commit_freezes_the_disk_and_the_source_runs_on_in_a_fresh_overlay() {
    let b = bed(true);
    let h = b.create(Wait::Agent).await;
    let memory = b.fake.memory_of(&h).expect("runs");
    let old_disk = b.daemon.vm(&h).expect("vm").disk;
    let info = b.daemon.commit(&h, memory_commit()).await.expect("commit");
    assert_eq!(info.mode, CommitMode::Memory);
    assert!(info.pause_us.is_some(), "{info:?}");
    assert!(info.memory_bytes.is_some_and(|b| b > 0), "{info:?}");
    // Pause, snapshot, switch to the overlay, resume: nothing else.
    match controls(&b, &h).as_slice() {
        [VmmRequest::Pause, VmmRequest::Snapshot { .. }, VmmRequest::SwitchDisk { drive, path }, VmmRequest::Resume { vsock_uds: None }] =>
        {
            assert_eq!(drive, "drive0");
            let vm = b.daemon.vm(&h).expect("vm");
            assert_eq!(path.display().to_string(), vm.disk, "the recorded disk");
        }
        other => panic!("unexpected VMM requests: {other:?}"),
    }
    // The source runs on, the same run, unpaused, on its new overlay.
    let vm = b.daemon.vm(&h).expect("vm");
    assert_eq!(vm.state, VmState::Running);
    assert_eq!(b.fake.memory_of(&h), Some(memory));
    assert!(!b.fake.is_paused(&h));
    assert_ne!(vm.disk, old_disk);
    assert!(!Path::new(&old_disk).exists(), "the old name is gone");
    assert_eq!(
        b.fake.switched_disk(&h).map(|p| p.display().to_string()),
        Some(vm.disk.clone())
    );
    // The commit's disk is the old inode, read-only, under the overlay.
    let c = b
        .daemon
        .store
        .get_commit(&info.commit_id)
        .expect("read")
        .expect("recorded");
    let chain = tine_disk::backing_chain(Path::new(&vm.disk)).expect("chain");
    assert_eq!(chain[1].path.display().to_string(), c.disk);
    // Its file is checked in the background, off its first fork's path.
    let checked = || b.daemon.verified_stamp(&c.id).is_some();
    until(checked).await;
    assert!(checked(), "checked after the commit");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&c.disk)
        .expect("commit file")
        .permissions()
        .mode();
    assert_eq!(mode & 0o222, 0, "read-only: {mode:o}");
    assert!(b.daemon.memory_commit_files(&c.id).is_complete());
    assert!(!PendingMemoryCommitFile::of(&b, &h).exists());
    // Listed with its mode, and filtered by it.
    let memory_only = CommitFilter {
        mode: Some(CommitMode::Memory),
        ..CommitFilter::default()
    };
    assert_eq!(b.daemon.commits(&memory_only).expect("list").len(), 1);
    let disk_only = CommitFilter {
        mode: Some(CommitMode::Disk),
        ..CommitFilter::default()
    };
    assert!(b.daemon.commits(&disk_only).expect("list").is_empty());
}

/// The pending-commit file of a VM.
struct PendingMemoryCommitFile;

impl PendingMemoryCommitFile {
    fn of(b: &Bed, hostname: &str) -> std::path::PathBuf {
        super::super::memory_commit::PendingMemoryCommit::path(&b.daemon.paths(hostname).dir)
    }
}

#[tokio::test]
async fn a_hot_fork_resumes_the_commits_memory_on_its_own_disk_with_every_fixup() {
    let b = bed(true);
    let h = b.create(Wait::Agent).await;
    let memory = b.fake.memory_of(&h).expect("runs");
    let id = b
        .daemon
        .commit(&h, memory_commit())
        .await
        .expect("commit")
        .commit_id;
    let files = b.daemon.memory_commit_files(&id);
    // Two forks resume VMs primed ahead (a pool of 2), the third (no pool)
    // is restored on its path.
    b.daemon.set_commit_pool(&id, Some(2)).expect("pool");
    b.daemon.fill_pools().await;
    assert_eq!(b.fake.primed().len(), 2);
    let mut forks = Vec::new();
    for pool in [None, None, Some(0)] {
        if let Some(size) = pool {
            b.daemon.set_commit_pool(&id, Some(size)).expect("pool");
            b.daemon.fill_pools().await;
            assert!(b.fake.primed().is_empty(), "a pool of 0 primes none");
        }
        let r = b
            .daemon
            .fork(&id, ForkRequest::default(), Wait::Agent, WAIT)
            .await
            .expect("hot fork");
        assert_eq!(r.mode, CommitMode::Memory);
        assert_eq!(r.child_status, VmState::Running);
        forks.push(r.hostname);
    }
    for (i, f) in forks.iter().enumerate() {
        // Resumed from the commit's files, on its own disk: never booted.
        let vm = b.daemon.vm(f).expect("fork");
        let resumed = resumes(&b, f);
        assert_eq!(resumed.len(), 1, "{resumed:?}");
        match (&resumed[0], i) {
            (Resumed::Primed(spec), 0 | 1) => {
                assert_eq!(spec.state, files.state());
                assert_eq!(spec.memory, files.memory());
                // Primed on a spare disk, now the fork's.
                assert!(spec.disk.starts_with(b.daemon.spares_dir().join(&id)));
                assert!(!spec.disk.exists(), "renamed into the fork's folder");
                assert!(Path::new(&vm.disk).is_file());
            }
            (Resumed::Restore(spec), 2) => {
                assert_eq!(spec.state, files.state());
                assert_eq!(spec.memory, files.memory());
                assert_eq!(
                    spec.disk.as_ref().map(|d| d.display().to_string()),
                    Some(vm.disk.clone())
                );
            }
            (other, i) => panic!("fork {i} resumed by {other:?}"),
        }
        assert!(!b.fake.seen(f).iter().any(|s| matches!(s, Seen::Boot(_))));
        assert_eq!(b.fake.memory_of(f), Some(memory), "the source's memory");
        let chain = tine_disk::backing_chain(Path::new(&vm.disk)).expect("chain");
        assert!(chain[1]
            .path
            .display()
            .to_string()
            .ends_with(&format!("{id}.qcow2")));
        // Every identity fix-up, fresh entropy and the clock: a primed
        // VM's guest had all but its hostname and clock ahead.
        let fixups = b.fixups_seen(f);
        assert_eq!(fixups.len(), 1, "{fixups:?}");
        assert_eq!(fixups[0].hostname.as_deref(), Some(f.as_str()));
        assert!(fixups[0].clock_unix_nanos.is_some());
        let identity = match &resumed[0] {
            Resumed::Primed(spec) => {
                assert!(!fixups[0].machine_id && !fixups[0].ssh_host_keys);
                assert_eq!(fixups[0].entropy, None);
                let ahead = spec
                    .guest_identity
                    .clone()
                    .expect("primed with its identity");
                assert_eq!(ahead.hostname, None, "not known before the fork");
                ahead
            }
            _ => fixups[0].clone(),
        };
        assert!(identity.machine_id && identity.ssh_host_keys);
        assert!(identity.entropy.as_ref().is_some_and(|e| e.len() == 64));
        assert!(!vm.is_unborn_fork(), "its fix-ups are done");
    }
    // The commit cannot go while its source or forks exist.
    let msg = refusal(b.daemon.delete_commit(&id), ErrorCode::Conflict);
    assert!(msg.contains(&forks[0]), "{msg}");
}

#[tokio::test]
async fn a_fork_gives_its_guest_the_identity_its_primed_vm_failed_to_set() {
    let b = bed(true);
    b.fake.fail_primed_identity(Some("/etc is read-only"));
    let id = b.pooled_commit(1).await;
    let f = b.fork_of(&id).await;
    assert!(
        matches!(&resumes(&b, &f)[..], [Resumed::Primed(p)] if p.guest_identity.is_some()),
        "{:?}",
        resumes(&b, &f)
    );
    let fixups = b.fixups_seen(&f);
    assert_eq!(fixups.len(), 1, "{fixups:?}");
    assert!(fixups[0].machine_id && fixups[0].ssh_host_keys);
    assert!(fixups[0].entropy.as_ref().is_some_and(|e| e.len() == 64));
    assert_eq!(fixups[0].hostname.as_deref(), Some(f.as_str()));
}

#[tokio::test]
async fn a_fork_granted_the_secrets_its_primed_vm_synced_ahead_syncs_none() {
    use base64::Engine as _;
    use tine_proto::api::{CreateSecretRequest, UpdateSecretRequest};
    let b = bed(true);
    let secret = |data: &str| CreateSecretRequest {
        name: "db".into(),
        data: base64::engine::general_purpose::STANDARD.encode(data),
        permissions: None,
        uid: None,
        gid: None,
    };
    b.daemon.create_secret(&secret("pw1")).expect("secret");
    let source = b
        .daemon
        .create_vm(
            "dev",
            CreateVmRequest {
                secrets: vec!["db".into()],
                ..CreateVmRequest::default()
            },
            Wait::Agent,
            WAIT,
            false,
        )
        .await
        .expect("create")
        .hostname;
    let id = b.pooled_commit_of(&source, 1).await;
    let synced = |f: &str| {
        b.fake
            .seen(f)
            .into_iter()
            .filter(|s| matches!(s, Seen::Agent(tine_proto::agent::Request::SecretsSync(_))))
            .count()
    };
    let fork = |req: ForkRequest| async {
        b.daemon
            .fork(&id, req, Wait::Agent, WAIT)
            .await
            .expect("hot fork")
            .hostname
    };
    // The primed VM synced what the commit's forks inherit.
    let primed = b.fake.primed();
    let files = primed[0]
        .guest_secrets
        .clone()
        .expect("primed with secrets");
    assert_eq!(files.len(), 1);
    assert_eq!(files[0].name, "db");
    let same = fork(ForkRequest::default()).await;
    assert!(matches!(&resumes(&b, &same)[..], [Resumed::Primed(_)]));
    assert_eq!(synced(&same), 0, "synced ahead");
    // A changed secret, or other grants: the fork syncs its own.
    b.daemon.fill_pools().await;
    b.daemon
        .update_secret(
            "db",
            &UpdateSecretRequest {
                data: Some(base64::engine::general_purpose::STANDARD.encode("pw2")),
                ..UpdateSecretRequest::default()
            },
        )
        .expect("update");
    let changed = fork(ForkRequest::default()).await;
    assert!(matches!(&resumes(&b, &changed)[..], [Resumed::Primed(_)]));
    assert_eq!(synced(&changed), 1, "the secret changed since");
    b.daemon.fill_pools().await;
    let none = fork(ForkRequest {
        no_secrets: true,
        ..ForkRequest::default()
    })
    .await;
    assert!(matches!(&resumes(&b, &none)[..], [Resumed::Primed(_)]));
    assert_eq!(synced(&none), 1, "other grants");
}

#[tokio::test]
async fn hot_forks_resume_without_waiting_for_a_boot_slot() {
    // One boot slot, taken by a boot whose agent never answers.
    let b = bed_with(true, 1, Deadlines::default());
    let (_source, id) = b.memory_committed().await;
    b.fake.set_guest("dev-2", Guest::Silent);
    let booting = b.create(Wait::None).await;
    assert_eq!(booting, "dev-2");
    b.until("the boot runs", |b| b.fake.is_running(&booting))
        .await;
    // Hot forks resume and finish their set-up meanwhile.
    for _ in 0..2 {
        let r = b
            .daemon
            .fork(&id, ForkRequest::default(), Wait::Agent, WAIT)
            .await
            .expect("hot fork");
        assert_eq!(r.child_status, VmState::Running);
    }
    // A second boot still waits its turn, and takes the slot once free.
    let queued = b.create(Wait::None).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(!b.fake.is_running(&queued), "a boot waits for the slot");
    assert_eq!(b.state(&queued), Some(VmState::Starting));
    b.daemon.delete(&booting).await.expect("delete");
    let vm = b.daemon.wait_running(&queued, WAIT).await.expect("boots");
    assert_eq!(vm.state, VmState::Running);
}

#[tokio::test]
async fn a_hot_fork_refuses_another_shape_partial_fixups_and_a_missing_snapshot() {
    let b = bed(true);
    let (_, id) = b.memory_committed().await;
    let cpus = ForkRequest {
        cpus: Some(2),
        ..ForkRequest::default()
    };
    let msg = refusal(
        b.daemon.fork(&id, cpus, Wait::Agent, WAIT).await,
        ErrorCode::BadRequest,
    );
    assert!(
        msg.contains("1 vCPUs") && msg.contains("cannot have 2"),
        "{msg}"
    );
    let ram = ForkRequest {
        ram_bytes: Some(512 << 20),
        ..ForkRequest::default()
    };
    let msg = refusal(
        b.daemon.fork(&id, ram, Wait::Agent, WAIT).await,
        ErrorCode::BadRequest,
    );
    assert!(msg.contains("256 MiB") && msg.contains("512 MiB"), "{msg}");
    let fixups = ForkRequest {
        fixups: Some(vec![Fixup::Hostname]),
        ..ForkRequest::default()
    };
    let msg = refusal(
        b.daemon.fork(&id, fixups, Wait::Agent, WAIT).await,
        ErrorCode::BadRequest,
    );
    assert!(msg.contains("machine-id, ssh-host-keys"), "{msg}");
    // A damaged commit names what is missing; nothing is left behind.
    let before = b.daemon.store.list_vms(None).expect("list").len();
    std::fs::remove_file(b.daemon.memory_commit_files(&id).memory()).expect("remove");
    let msg = refusal(
        b.daemon
            .fork(&id, ForkRequest::default(), Wait::Agent, WAIT)
            .await,
        ErrorCode::Internal,
    );
    assert!(
        msg.contains("memory snapshot") && msg.contains(&id),
        "{msg}"
    );
    assert_eq!(b.daemon.store.list_vms(None).expect("list").len(), before);
}

#[tokio::test]
async fn a_memory_commit_refuses_what_is_not_running_and_persistent() {
    let b = bed(false);
    let h = b.create(Wait::Agent).await;
    let msg = refusal(
        b.daemon.commit(&h, memory_commit()).await,
        ErrorCode::Conflict,
    );
    assert!(msg.contains("not persistent"), "{msg}");

    let b = bed(true);
    let h = b.stopped().await;
    let msg = refusal(
        b.daemon.commit(&h, memory_commit()).await,
        ErrorCode::Conflict,
    );
    assert!(msg.contains("only a running VM's memory"), "{msg}");
}

#[tokio::test]
async fn a_failed_snapshot_leaves_the_source_running_on_its_disk_and_nothing_recorded() {
    let b = bed(true);
    let h = b.create(Wait::Agent).await;
    let disk = b.daemon.vm(&h).expect("vm").disk;
    b.fake.refuse_snapshots(Some("no space left on device"));
    let e = b
        .daemon
        .commit(&h, memory_commit())
        .await
        .expect_err("refused");
    let why = super::super::chain(&e);
    assert!(why.contains("no space left"), "{why}");
    b.fake.refuse_snapshots(None);
    let vm = b.daemon.vm(&h).expect("vm");
    assert_eq!(
        (vm.state, vm.disk.as_str()),
        (VmState::Running, disk.as_str())
    );
    assert!(vm.commit_id.is_none());
    assert!(!b.fake.is_paused(&h), "resumed");
    assert!(b
        .daemon
        .commits(&CommitFilter::default())
        .expect("list")
        .is_empty());
    let left: Vec<_> = std::fs::read_dir(b.daemon.commits_dir())
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "{left:?}");
    assert!(!PendingMemoryCommitFile::of(&b, &h).exists());
}

/// A first daemon memory-commits a running VM until `point` stops it for
/// good (a `kill -9` there); a second daemon on the same data directory
/// then reconciles. Returns the bed of the second, the VM, the disk it
/// had and its memory.
fn restart_during_memory_commit(point: Failpoint) -> (Bed, String, String, u64) {
    let dir = tempfile::tempdir().expect("tmp");
    let fake = FakeLauncher::new();
    let cfg = config(dir.path(), true, 4);
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
            let disk = first.vm(&h).expect("vm").disk;
            let memory = first_fake.memory_of(&h).expect("runs");
            ready_tx.send((h.clone(), disk, memory)).expect("send");
            failpoint::freeze::arm(point, reached_tx);
            let done = first.commit(&h, memory_commit()).await.map(drop);
            panic!("{} was not reached: {done:?}", point.name());
        });
    });
    let (hostname, disk, memory) = ready.recv_timeout(WAIT).expect("the first daemon's VM");
    assert_eq!(reached.recv_timeout(WAIT), Ok(point), "the crash point");
    let daemon = open(dir.path(), &fake, cfg, Deadlines::default());
    (Bed { dir, fake, daemon }, hostname, disk, memory)
}

#[tokio::test]
async fn a_kill_before_the_record_undoes_the_memory_commit_and_the_source_runs_on() {
    for point in [
        Failpoint::MemoryCommitCaptured,
        Failpoint::MemoryCommitSwitched,
    ] {
        let (b, h, disk, memory) = restart_during_memory_commit(point);
        let report = b.daemon.reconcile().await.expect("reconcile");
        assert!(report.adopted.contains(&h), "{point:?}: {report:?}");
        let vm = b.daemon.vm(&h).expect("vm");
        assert_eq!(vm.disk, disk, "{point:?}: the disk it had");
        assert!(vm.commit_id.is_none());
        assert_eq!(b.fake.memory_of(&h), Some(memory), "the same run");
        assert!(!b.fake.is_paused(&h), "{point:?}: resumed");
        if point == Failpoint::MemoryCommitSwitched {
            assert_eq!(
                b.fake.switched_disk(&h).map(|p| p.display().to_string()),
                Some(disk.clone()),
                "back on its own disk"
            );
        }
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&disk).expect("disk").permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "writable again");
        assert!(b
            .daemon
            .commits(&CommitFilter::default())
            .expect("list")
            .is_empty());
        let left: Vec<_> = std::fs::read_dir(b.daemon.commits_dir())
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "{point:?}: {left:?}");
        assert!(!PendingMemoryCommitFile::of(&b, &h).exists());
        // ... and a memory commit works as ever.
        let info = b.daemon.commit(&h, memory_commit()).await.expect("commit");
        assert_eq!(info.mode, CommitMode::Memory);
    }
}

#[tokio::test]
async fn a_kill_after_the_record_keeps_the_commit_and_resumes_the_source() {
    let (b, h, old_disk, memory) = restart_during_memory_commit(Failpoint::MemoryCommitRecorded);
    let report = b.daemon.reconcile().await.expect("reconcile");
    assert!(report.adopted.contains(&h), "{report:?}");
    let vm = b.daemon.vm(&h).expect("vm");
    let id = vm.commit_id.clone().expect("committed");
    assert_ne!(vm.disk, old_disk);
    assert!(!Path::new(&old_disk).exists(), "the old name is removed");
    assert_eq!(b.fake.memory_of(&h), Some(memory));
    assert!(!b.fake.is_paused(&h), "resumed");
    assert!(!PendingMemoryCommitFile::of(&b, &h).exists());
    let r = b
        .daemon
        .fork(&id, ForkRequest::default(), Wait::Agent, WAIT)
        .await
        .expect("the commit forks");
    assert_eq!(b.fake.memory_of(&r.hostname), Some(memory));
}

#[tokio::test]
async fn a_memory_commits_own_warm_pool_sizes_its_shapes_pool_and_can_be_reset() {
    let b = bed(true);
    let group_size = b.daemon.config().host_groups[0].hot_fork_pool;
    let h = b.create(Wait::Agent).await;
    let shape = crate::launcher::Shape {
        cpus: b.daemon.vm(&h).expect("vm").cpus,
        ram_mib: 256,
    };
    let info = b
        .daemon
        .commit(
            &h,
            CommitRequest {
                hot_fork_pool: Some(group_size + 3),
                ..memory_commit()
            },
        )
        .await
        .expect("commit");
    assert_eq!(info.hot_fork_pool, Some(group_size + 3));
    let id = info.commit_id;
    b.daemon.fill_pools().await;
    assert_eq!(b.fake.warm_pools(), vec![(shape, group_size + 3)]);
    // Listed with it.
    let listed = b.daemon.commits(&CommitFilter::default()).expect("list");
    assert_eq!(listed[0].hot_fork_pool, Some(group_size + 3));

    // None for this commit: its shape needs no pre-started process.
    let changed = b.daemon.set_commit_pool(&id, Some(0)).expect("set");
    assert_eq!(changed.hot_fork_pool, Some(0));
    b.daemon.fill_pools().await;
    assert_eq!(b.fake.warm_pools(), vec![]);

    // Back to the group's size.
    let reset = b.daemon.set_commit_pool(&id, None).expect("reset");
    assert_eq!(reset.hot_fork_pool, None);
    b.daemon.fill_pools().await;
    let expected = if group_size == 0 {
        vec![]
    } else {
        vec![(shape, group_size)]
    };
    assert_eq!(b.fake.warm_pools(), expected);
    let stored = b.daemon.store.get_commit(&id).expect("read").expect("kept");
    assert_eq!(stored.hot_fork_pool, None);
}

#[tokio::test]
async fn a_warm_pool_size_is_refused_by_name_where_it_means_nothing() {
    let b = bed(true);
    let max = crate::launcher::pool::MAX_POOL_SIZE;
    // On a disk commit, at commit time and later.
    let h = b.stopped().await;
    let msg = refusal(
        b.daemon
            .commit(
                &h,
                CommitRequest {
                    hot_fork_pool: Some(2),
                    ..CommitRequest::default()
                },
            )
            .await,
        ErrorCode::BadRequest,
    );
    assert!(msg.contains("memory commits only"), "{msg}");
    let disk = b
        .daemon
        .commit(&h, CommitRequest::default())
        .await
        .expect("disk commit")
        .commit_id;
    let msg = refusal(
        b.daemon.set_commit_pool(&disk, Some(2)),
        ErrorCode::BadRequest,
    );
    assert!(msg.contains("is a disk commit"), "{msg}");
    let msg = refusal(
        b.daemon.set_commit_pool("cmt-dev-0", Some(2)),
        ErrorCode::NotFound,
    );
    assert!(msg.contains("cmt-dev-0"), "{msg}");

    // Too large, at commit time (nothing is made) and later.
    let source = b.create(Wait::Agent).await;
    let too_large = CommitRequest {
        hot_fork_pool: Some(max + 1),
        ..memory_commit()
    };
    let msg = refusal(
        b.daemon.commit(&source, too_large).await,
        ErrorCode::BadRequest,
    );
    assert!(msg.contains(&format!("at most {max}")), "{msg}");
    let memory = CommitFilter {
        mode: Some(CommitMode::Memory),
        ..CommitFilter::default()
    };
    assert!(b.daemon.commits(&memory).expect("list").is_empty());
    let id = b
        .daemon
        .commit(&source, memory_commit())
        .await
        .expect("commit")
        .commit_id;
    let msg = refusal(
        b.daemon.set_commit_pool(&id, Some(max + 1)),
        ErrorCode::BadRequest,
    );
    assert!(msg.contains("too large"), "{msg}");
    let kept = b.daemon.store.get_commit(&id).expect("read").expect("kept");
    assert_eq!(kept.hot_fork_pool, None);
}

/// The spare disks made for memory commit `id` (each in a folder of its
/// own), sorted, with their inodes and their folders' inodes.
fn spare_disks(b: &Bed, id: &str) -> Vec<(std::path::PathBuf, u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(b.daemon.spares_dir().join(id)) else {
        return Vec::new();
    };
    let mut out: Vec<_> = entries
        .flatten()
        .map(|e| {
            let disk = e.path().join(crate::process::DISK_FILE);
            let ino = std::fs::metadata(&disk).expect("a spare's disk").ino();
            (disk, ino, e.metadata().expect("stat").ino())
        })
        .collect();
    out.sort();
    out
}

#[tokio::test]
async fn a_memory_commit_keeps_spare_disks_and_its_hot_forks_take_them() {
    let b = bed(true);
    let id = b.pooled_commit(2).await;
    let made = spare_disks(&b, &id);
    assert_eq!(made.len(), 2, "{made:?}");
    // Each held by a VM primed on it.
    let mut primed: Vec<_> = b.fake.primed().into_iter().map(|p| p.disk).collect();
    primed.sort();
    assert_eq!(
        primed,
        made.iter().map(|(p, _, _)| p.clone()).collect::<Vec<_>>()
    );
    let commit_disk = b.daemon.commit_record(&id).expect("commit").disk;
    for (path, _, _) in &made {
        let chain = tine_disk::backing_chain(path).expect("chain");
        assert!(
            chain.iter().any(|i| i.path == Path::new(&commit_disk)),
            "{chain:?} is not on the commit"
        );
    }

    // A hot fork's folder is one of theirs, renamed (the same folder and
    // disk), and the spares are made up again.
    let fork = b.fork_of(&id).await;
    let disk = b.daemon.vm(&fork).expect("fork").disk;
    let (inode, folder_inode) = {
        use std::os::unix::fs::MetadataExt;
        let folder = Path::new(&disk).parent().expect("a folder");
        (
            std::fs::metadata(&disk).expect("disk").ino(),
            std::fs::metadata(folder).expect("folder").ino(),
        )
    };
    assert!(
        made.iter()
            .any(|(_, i, f)| (*i, *f) == (inode, folder_inode)),
        "not a spare's folder"
    );
    b.daemon.fill_pools().await;
    let refilled = spare_disks(&b, &id);
    assert_eq!(refilled.len(), 2);
    assert_eq!(
        refilled.iter().filter(|s| made.contains(s)).count(),
        1,
        "one old spare left, one new: {made:?} -> {refilled:?}"
    );
    assert!(refilled.iter().all(|(_, i, _)| *i != inode));

    // A disk commit's fork takes none.
    let disk_commit = b.commit().await;
    let cold = b
        .daemon
        .fork(&disk_commit, ForkRequest::default(), Wait::Agent, WAIT)
        .await
        .expect("cold fork")
        .hostname;
    assert!(b.daemon.vm(&cold).is_ok());
    assert_eq!(spare_disks(&b, &id), refilled);

    // No pool, no spares; a restarted daemon removes an earlier one's.
    b.daemon.set_commit_pool(&id, Some(0)).expect("no pool");
    b.daemon.fill_pools().await;
    assert!(spare_disks(&b, &id).is_empty());
    assert!(b.fake.primed().is_empty(), "primed VMs stopped");
    assert!(!b.daemon.spares_dir().join(&id).exists(), "its folder too");
    b.daemon.set_commit_pool(&id, Some(1)).expect("pool of 1");
    b.daemon.fill_pools().await;
    assert_eq!(spare_disks(&b, &id).len(), 1);
    let restarted = open(
        b.dir.path(),
        &b.fake,
        config(b.dir.path(), true, 4),
        Deadlines::default(),
    );
    restarted.reconcile().await.expect("reconcile");
    assert!(!restarted.spares_dir().exists(), "left-overs removed");
    restarted.fill_pools().await;
    assert_eq!(spare_disks(&b, &id).len(), 1, "made again");
    // A graceful exit removes them.
    restarted.drain_pools().await;
    assert!(!restarted.spares_dir().exists());
}

/// Waits until `done` says so, for 10 s at most (the caller checks it
/// again).
async fn until(done: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !done() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Waits (bounded) until `path` is a file.
async fn file_appears(path: &Path) {
    for _ in 0..500 {
        if path.is_file() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{} never appeared", path.display());
}

/// Every VM primed for a commit's hot forks is asked to run until its
/// agent answers, ahead of any fork (the launcher then pauses it again,
/// holding its clock).
#[tokio::test]
async fn primed_vms_run_ahead_until_their_agent_answers() {
    let b = bed(true);
    b.pooled_commit(2).await;
    let primed = b.fake.primed();
    assert_eq!(primed.len(), 2, "{primed:?}");
    assert!(primed.iter().all(|p| p.warm_agent), "{primed:?}");
}

/// A fork that finds no primed VM, while one is being primed for its
/// commit (the refill after the fork before), waits for it and takes it,
/// rather than restoring into another process beside the priming; a
/// priming that takes too long is not waited for.
#[tokio::test]
async fn a_hot_fork_waits_for_the_vm_being_primed_for_it() {
    let deadlines = Deadlines {
        priming_wait: Duration::from_secs(2),
        ..Deadlines::default()
    };
    let b = bed_with(true, 4, deadlines);
    let id = b.pooled_commit(1).await;
    // Primings from now on are slow (the one ahead of the first fork is
    // done).
    b.fake.delay_priming(Duration::from_millis(300));
    let first = b.fork_of(&id).await;
    assert!(matches!(&resumes(&b, &first)[..], [Resumed::Primed(_)]));
    // The refill starts once the first fork's set-up has ended.
    let being_primed = || !b.daemon.spare_book().priming_settled(&id);
    until(being_primed).await;
    assert!(being_primed(), "a refill began");
    // The refill after the second fork takes longer than a fork waits.
    b.fake.delay_priming(Duration::from_secs(4));
    let began = std::time::Instant::now();
    let second = b.fork_of(&id).await;
    assert!(
        matches!(&resumes(&b, &second)[..], [Resumed::Primed(_)]),
        "took the VM primed meanwhile: {:?}",
        resumes(&b, &second)
    );
    assert!(began.elapsed() >= Duration::from_millis(100), "it waited");

    // Longer than a fork waits: it restores.
    until(being_primed).await;
    assert!(being_primed(), "a refill began");
    let third = b.fork_of(&id).await;
    assert!(
        matches!(&resumes(&b, &third)[..], [Resumed::Restore(_)]),
        "{:?}",
        resumes(&b, &third)
    );
}

/// A bed whose launches are held for `bound` at most, with a memory
/// commit primed once, whose first fork (dev-2; the source is dev-1) has
/// an agent that never answers.
async fn hung_fork_bed(bound: Duration) -> (Bed, String) {
    let deadlines = Deadlines {
        launch_set_up: bound,
        ..Deadlines::default()
    };
    let b = bed_with(true, 4, deadlines);
    let id = b.pooled_commit(1).await;
    b.fake.set_guest("dev-2", Guest::Hangs);
    (b, id)
}

/// A hot fork's launch lasts until its set-up ends (the spares are
/// refilled once no launch is under way), but a set-up that hangs (a guest
/// whose agent never answers) counts only for `Deadlines::launch_set_up`.
#[tokio::test]
async fn a_hung_hot_fork_set_up_holds_the_refill_back_only_so_long() {
    let bound = Duration::from_secs(1);
    let (b, id) = hung_fork_bed(bound).await;
    let launching = || b.daemon.hot_launches.load(Ordering::SeqCst);
    let began = std::time::Instant::now();
    let fork = b
        .daemon
        .fork(&id, ForkRequest::default(), Wait::None, WAIT)
        .await
        .expect("fork")
        .hostname;
    assert_eq!(fork, "dev-2");
    assert!(
        matches!(&resumes(&b, &fork)[..], [Resumed::Primed(_)]),
        "took the primed VM: {:?}",
        resumes(&b, &fork)
    );
    assert_eq!(launching(), 1, "its set-up is under way");
    until(|| launching() == 0).await;
    assert_eq!(launching(), 0, "let go while the set-up hangs");
    assert!(
        began.elapsed() >= bound,
        "not before the bound: {:?}",
        began.elapsed()
    );
    assert_eq!(b.daemon.vm(&fork).expect("fork").state, VmState::Starting);
    // And the refill it held back runs.
    let primed = || b.daemon.spare_book().primed_of(&id).len();
    until(|| primed() == 1).await;
    assert_eq!(primed(), 1, "refilled");
}

/// A hot fork's request counts as a launch too until it answers (the
/// refill would slow the answer once the set-up ends), within the same
/// bound.
#[tokio::test]
async fn a_hot_fork_request_holds_the_refill_back_until_it_answers_or_its_bound() {
    let bound = Duration::from_secs(1);
    let (b, id) = hung_fork_bed(bound).await;
    let launching = || b.daemon.hot_launches.load(Ordering::SeqCst);
    let began = std::time::Instant::now();
    let daemon = b.daemon.clone();
    let commit = id.clone();
    let request = tokio::spawn(async move {
        daemon
            .fork(&commit, ForkRequest::default(), Wait::Agent, 3 * bound)
            .await
    });
    until(|| launching() == 2).await;
    assert_eq!(launching(), 2, "the request and the set-up");
    until(|| launching() == 0).await;
    assert_eq!(launching(), 0, "both let go at the bound");
    assert!(began.elapsed() >= bound, "{:?}", began.elapsed());
    assert!(!request.is_finished(), "the request still waits");
    let answer = request.await.expect("the request's task");
    assert!(
        answer.is_err_and(|e| e.is_timeout()),
        "a hung set-up times out"
    );
    // An answered request lets go at once.
    b.daemon.fill_pools().await;
    b.daemon
        .fork(&id, ForkRequest::default(), Wait::Agent, WAIT)
        .await
        .expect("fork");
    until(|| launching() == 0).await;
    assert_eq!(launching(), 0);
}

#[tokio::test]
async fn the_first_hot_forks_writes_are_copied_into_the_next_forks_ahead() {
    let b = bed(true);
    let id = b.pooled_commit(2).await;
    let commit = b.daemon.commit_record(&id).expect("commit");
    let write_set = b
        .daemon
        .memory_snapshot_of(&commit)
        .expect("snapshot")
        .write_set();
    assert!(!write_set.exists(), "no fork has run yet");
    let waiting = b.daemon.spare_book().primed_of(&id);
    assert_eq!(waiting.len(), 2, "{waiting:?}");
    assert!(
        b.fake.primed().iter().all(|p| p.write_set.is_none()),
        "primed without one"
    );

    // The first fork saves its writes as the commit's write set once its
    // set-up is done, and the VM still waiting copies them in.
    let first = b.fork_of(&id).await;
    file_appears(&write_set).await;
    let saved = VmmRequest::SaveWriteSet {
        path: write_set.clone(),
    };
    assert!(
        controls(&b, &first).contains(&saved),
        "{:?}",
        controls(&b, &first)
    );
    let populate = VmmRequest::PopulateWriteSet {
        path: write_set.clone(),
    };
    let populated = |name: &str| {
        controls(&b, &format!("{}/{name}", crate::process::POOL_DIR)).contains(&populate)
    };
    let mut copied = Vec::new();
    for _ in 0..500 {
        copied = waiting.iter().filter(|n| populated(n)).cloned().collect();
        if !copied.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // (The refill may have primed another meanwhile, with the write set
    // or before it.)
    let left = b.daemon.spare_book().primed_of(&id);
    let untaken: Vec<_> = waiting
        .iter()
        .filter(|n| left.contains(n))
        .cloned()
        .collect();
    assert_eq!(untaken.len(), 1, "{waiting:?} -> {left:?}");
    assert_eq!(copied, untaken, "the VM the fork did not take, and only it");

    // VMs primed from now on copy it in as they are primed; a later fork
    // saves no other.
    b.daemon
        .set_commit_pool(&id, Some(3))
        .expect("a larger pool");
    b.daemon.fill_pools().await;
    let with: Vec<_> = b
        .fake
        .primed()
        .into_iter()
        .filter(|p| p.write_set.as_deref() == Some(write_set.as_path()))
        .collect();
    assert!(!with.is_empty(), "{:?}", b.fake.primed());
    let second = b.fork_of(&id).await;
    assert!(
        matches!(resumes(&b, &second)[..], [Resumed::Primed(_)]),
        "{:?}",
        resumes(&b, &second)
    );
    let third = b.fork_of(&id).await;
    // Their set-ups' last step came right after their answers.
    tokio::time::sleep(Duration::from_millis(200)).await;
    for fork in [&second, &third] {
        assert!(
            !controls(&b, fork).contains(&saved),
            "{fork} saved it again"
        );
    }

    // A write set that is not one is removed when a VM is primed with it
    // (the VM is primed all the same), and the next fork saves another.
    std::fs::write(&write_set, "not a write set").expect("spoil it");
    b.daemon
        .set_commit_pool(&id, Some(4))
        .expect("a larger pool");
    b.daemon.fill_pools().await;
    assert!(!write_set.exists(), "the refused write set stays");
    assert_eq!(b.daemon.spare_book().vms_of(&id), 4);
    let fourth = b.fork_of(&id).await;
    file_appears(&write_set).await;
    assert!(controls(&b, &fourth).contains(&saved));

    // A fork that finds no primed VM copies it in once it runs.
    b.daemon.set_commit_pool(&id, Some(0)).expect("no pool");
    b.daemon.fill_pools().await;
    let unprimed = b.fork_of(&id).await;
    assert!(
        matches!(resumes(&b, &unprimed)[..], [Resumed::Restore(_)]),
        "{:?}",
        resumes(&b, &unprimed)
    );
    let mut asked = false;
    for _ in 0..500 {
        asked = controls(&b, &unprimed).contains(&populate);
        if asked {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(asked, "{:?}", controls(&b, &unprimed));
}

#[tokio::test]
async fn a_restarted_daemon_finishes_the_set_up_of_a_hot_fork_it_adopts() {
    // The first daemon stops for good once the fork's process is recorded
    // (as a `kill -9` there would): its set-up and its disk's sync were
    // under way.
    let dir = tempfile::tempdir().expect("tmp");
    let fake = FakeLauncher::new();
    let cfg = config(dir.path(), true, 4);
    let (reached_tx, reached) = mpsc::channel();
    let (path, first_fake, first_cfg) = (dir.path().to_owned(), fake.clone(), cfg.clone());
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async move {
            let first = open(&path, &first_fake, first_cfg, Deadlines::default());
            let source = first
                .create_vm("dev", CreateVmRequest::default(), Wait::Agent, WAIT, false)
                .await
                .expect("create")
                .hostname;
            let id = first
                .commit(&source, memory_commit())
                .await
                .expect("commit")
                .commit_id;
            failpoint::freeze::arm(Failpoint::BootRecorded, reached_tx);
            let done = first
                .fork(&id, ForkRequest::default(), Wait::None, WAIT)
                .await
                .map(drop);
            panic!("the crash point was not reached: {done:?}");
        });
    });
    assert_eq!(
        reached.recv_timeout(WAIT),
        Ok(Failpoint::BootRecorded),
        "the crash point"
    );
    let fork = "dev-2";
    let b = Bed {
        daemon: open(dir.path(), &fake, cfg, Deadlines::default()),
        dir,
        fake,
    };
    assert!(b.fixups_seen(fork).is_empty(), "no set-up yet");
    let report = b.daemon.reconcile().await.expect("reconcile");
    assert!(report.adopted.iter().any(|h| h == fork), "{report:?}");
    // The hot fork's set-up (every identity fix-up) after its disk is
    // synced again; it runs, never booted.
    let vm = b.daemon.wait_running(fork, WAIT).await.expect("running");
    assert!(!vm.is_unborn_fork());
    let fixups = b.fixups_seen(fork);
    assert_eq!(fixups.len(), 1, "{fixups:?}");
    assert_eq!(fixups[0].hostname.as_deref(), Some(fork));
    assert!(fixups[0].machine_id && fixups[0].ssh_host_keys);
    assert!(!b.fake.seen(fork).iter().any(|s| matches!(s, Seen::Boot(_))));
}

#[tokio::test]
async fn a_hot_fork_that_fails_before_its_record_gives_back_the_primed_vm_it_took() {
    let b = bed(true);
    let h = b.create(Wait::Agent).await;
    let id = b
        .daemon
        .commit(
            &h,
            CommitRequest {
                hot_fork_pool: Some(1),
                ..memory_commit()
            },
        )
        .await
        .expect("commit")
        .commit_id;
    b.daemon.fill_pools().await;
    let primed = b.fake.primed();
    assert_eq!(primed.len(), 1);
    let taken_disk = primed[0].disk.clone();
    assert!(taken_disk.is_file());
    // The fork's folder cannot be made: a file stands in its place (the
    // group's next hostname after its source's).
    assert_eq!(h, "dev-1");
    let dir = b.daemon.paths("dev-2").dir;
    std::fs::create_dir_all(dir.parent().expect("vms folder")).expect("vms folder");
    std::fs::write(&dir, "not a folder").expect("file");
    let failed = b
        .daemon
        .fork(&id, ForkRequest::default(), Wait::Agent, WAIT)
        .await;
    assert!(failed.is_err(), "{failed:?}");
    // A refill in the background may prime another one meanwhile.
    assert!(
        !b.fake.primed().iter().any(|p| p.disk == taken_disk),
        "the primed VM taken is stopped"
    );
    assert!(!taken_disk.exists(), "and its disk removed");
}

/// The MACs of the network requests VM `hostname`'s agent was sent.
fn network_requests(b: &Bed, hostname: &str) -> Vec<String> {
    b.fake
        .seen(hostname)
        .into_iter()
        .filter_map(|s| match s {
            Seen::Agent(tine_proto::agent::Request::Network(n)) => Some(n.mac.unwrap_or_default()),
            _ => None,
        })
        .collect()
}

/// Whether the link `name` exists, and is up.
fn link_up(name: &str) -> Option<bool> {
    let out = std::process::Command::new("ip")
        .args(["-j", "link", "show", "dev", name])
        .output()
        .expect("ip (iproute2) runs");
    if !out.status.success() {
        return None;
    }
    let links: serde_json::Value = serde_json::from_slice(&out.stdout).expect("ip -j");
    Some(
        links[0]["flags"]
            .as_array()
            .is_some_and(|f| f.iter().any(|x| x == "UP")),
    )
}

#[tokio::test]
async fn a_hot_fork_takes_the_spare_network_and_no_other_vm_gets_its_address() {
    // Real TAPs and nft rules (needs root, `ip` and `nft`), with their own
    // table and prefix, on a link-local range; nothing is sent.
    let options = crate::network::ManagerOptions {
        table: "tine_test_spares".into(),
        tap_prefix: "cs-".into(),
        bridge_prefix: "cb-".into(),
    };
    let manager = || crate::network::NetworkManager::new(options.clone()).expect("options");
    manager().teardown().expect("left-overs of a killed run");
    let dir = tempfile::tempdir().expect("tmp");
    let fake = FakeLauncher::new();
    let mut cfg = config(dir.path(), true, 4);
    cfg.host_groups[0].network = crate::network::NetworkConfig {
        mode: crate::network::NetMode::Isolated,
        cidr: Some("169.254.212.0/24".parse().expect("cidr")),
        ..Default::default()
    };
    let mut parts = Parts::on_launcher(
        cfg,
        dir.path().join("data"),
        Arc::new(fake.clone()),
        Deadlines::default(),
    )
    .expect("parts");
    parts.network = manager();
    let daemon = Daemon::from_parts(parts);
    let b = Bed { dir, fake, daemon };

    let (source, id) = b.memory_committed().await;
    b.daemon.set_commit_pool(&id, Some(1)).expect("a pool of 1");
    b.daemon.fill_pools().await;
    let spare = {
        let book = b.daemon.spare_book();
        let addresses = book.addresses("dev");
        assert_eq!(addresses.len(), 1, "one spare network");
        addresses[0]
    };
    // Held by the VM primed on it.
    let primed = b.fake.primed();
    assert_eq!(primed.len(), 1, "{primed:?}");
    let primed_tap = primed[0].tap.clone().expect("primed with the spare's TAP");
    assert!(primed_tap.starts_with("cs-spare-"), "{primed_tap}");
    assert_eq!(link_up(&primed_tap), Some(false), "in quarantine");
    let spare_tap = {
        let fork_net = |h: &str| b.daemon.vm(h).expect("vm").network.expect("a network");
        assert_ne!(fork_net(&source).address, spare);
        // A VM created now is not given the spare's address.
        let other = b.create(Wait::Agent).await;
        assert_ne!(fork_net(&other).address, spare, "the spare's address");
        // A hot fork takes the spare: its TAP, rules, address and MAC,
        // which its guest was given while it was primed (its set-up does
        // not set them again); out of quarantine once its set-up is done.
        let fork = b
            .daemon
            .fork(&id, ForkRequest::default(), Wait::Agent, WAIT)
            .await
            .expect("hot fork")
            .hostname;
        let n = fork_net(&fork);
        assert_eq!(n.address, spare);
        assert_eq!(n.tap, primed_tap, "the primed VM's TAP");
        assert!(
            matches!(&resumes(&b, &fork)[..], [Resumed::Primed(p)] if p.tap.as_ref() == Some(&n.tap)),
            "{:?}",
            resumes(&b, &fork)
        );
        assert_eq!(n.hostname, fork);
        let primed_with = primed[0]
            .guest_network
            .as_ref()
            .expect("primed with its network");
        assert_eq!(primed_with.address, spare);
        assert_eq!(primed_with.mac.as_ref(), Some(&n.mac));
        assert_ne!(
            n.mac,
            b.daemon
                .vm(&source)
                .expect("source")
                .network
                .expect("NIC")
                .mac
        );
        assert_eq!(network_requests(&b, &fork), Vec::<String>::new());
        assert_eq!(link_up(&n.tap), Some(true), "out of quarantine");
        // A fork with its own policy takes none: its rules differ.
        let own = b
            .daemon
            .fork(
                &id,
                ForkRequest {
                    network: Some(tine_proto::api::ForkNetwork::Policy(
                        tine_proto::api::NetworkPolicy {
                            allow: None,
                            drop: Some(vec!["203.0.113.0/24".into()]),
                        },
                    )),
                    ..ForkRequest::default()
                },
                Wait::Agent,
                WAIT,
            )
            .await
            .expect("fork with its own policy")
            .hostname;
        assert!(
            matches!(&resumes(&b, &own)[..], [Resumed::Restore(r)] if r.tap.is_some()),
            "restored with a TAP of its own: {:?}",
            resumes(&b, &own)
        );
        let own_macs = network_requests(&b, &own);
        let own = fork_net(&own);
        assert_eq!(
            own_macs,
            [crate::network::vm_mac(&own.hostname)],
            "set by its set-up"
        );
        assert_eq!(own.tap, format!("cs-{}", own.hostname));
        assert_eq!(own.drop, ["203.0.113.0/24"]);
        n.tap
    };
    // A commit whose source had no NIC primes a VM without one and holds
    // no spare network; its forks (which have none) take that VM.
    let disk_commit = b.commit().await;
    let bare = b
        .daemon
        .fork(
            &disk_commit,
            ForkRequest {
                network: Some(tine_proto::api::ForkNetwork::None),
                ..ForkRequest::default()
            },
            Wait::Agent,
            WAIT,
        )
        .await
        .expect("a fork without a NIC")
        .hostname;
    let bare_id = b
        .daemon
        .commit(
            &bare,
            CommitRequest {
                hot_fork_pool: Some(1),
                ..memory_commit()
            },
        )
        .await
        .expect("memory commit")
        .commit_id;
    b.daemon.fill_pools().await;
    let bare_primed: Vec<_> = b
        .fake
        .primed()
        .into_iter()
        .filter(|p| p.tap.is_none())
        .collect();
    assert_eq!(bare_primed.len(), 1, "{:?}", b.fake.primed());
    let bare_fork = b
        .daemon
        .fork(&bare_id, ForkRequest::default(), Wait::Agent, WAIT)
        .await
        .expect("hot fork without a NIC")
        .hostname;
    assert!(
        matches!(&resumes(&b, &bare_fork)[..], [Resumed::Primed(p)] if p.tap.is_none()),
        "{:?}",
        resumes(&b, &bare_fork)
    );
    assert!(b.daemon.vm(&bare_fork).expect("fork").network.is_none());
    // The take is refilled: a new spare, down, with another address (one:
    // the commit without a NIC wants none).
    b.daemon.fill_pools().await;
    let refilled = b.daemon.spare_book().addresses("dev");
    assert_eq!(refilled.len(), 1);
    assert_ne!(refilled[0], spare);
    // A primed VM whose TAP went away behind the daemon's back: the fork's
    // hand-over fails, that VM is stopped, and the fork restores with a
    // TAP of its own, on a disk made again (the primed guest ran on the
    // old one), given every fix-up.
    let (primed_tap, primed_disk) = b
        .fake
        .primed()
        .into_iter()
        .find_map(|p| p.tap.map(|tap| (tap, p.disk)))
        .expect("a primed VM with a TAP");
    let primed_wrote = b"written by the primed guest";
    std::fs::OpenOptions::new()
        .append(true)
        .open(&primed_disk)
        .and_then(|mut f| std::io::Write::write_all(&mut f, primed_wrote))
        .expect("write to the primed disk");
    let deleted = std::process::Command::new("ip")
        .args(["link", "del", "dev", &primed_tap])
        .status()
        .expect("ip runs");
    assert!(deleted.success());
    let after_loss = b
        .daemon
        .fork(&id, ForkRequest::default(), Wait::Agent, WAIT)
        .await
        .expect("a hot fork whose primed VM lost its TAP")
        .hostname;
    let own_tap = b
        .daemon
        .vm(&after_loss)
        .expect("vm")
        .network
        .expect("a network")
        .tap;
    assert_ne!(own_tap, primed_tap);
    assert!(
        matches!(&resumes(&b, &after_loss)[..], [Resumed::Restore(r)] if r.tap.as_ref() == Some(&own_tap)),
        "{:?}",
        resumes(&b, &after_loss)
    );
    let disk = std::fs::read(b.daemon.vm(&after_loss).expect("vm").disk).expect("its disk");
    assert!(
        !disk.windows(primed_wrote.len()).any(|w| w == primed_wrote),
        "the primed guest's writes are gone"
    );
    let fixups = b.fixups_seen(&after_loss);
    assert!(fixups.len() == 1 && fixups[0].machine_id && fixups[0].entropy.is_some());
    assert_eq!(
        network_requests(&b, &after_loss).len(),
        1,
        "its own network"
    );
    assert!(
        !b.fake
            .primed()
            .iter()
            .any(|p| p.tap.as_ref() == Some(&primed_tap)),
        "the primed VM is stopped"
    );
    for vm in b.daemon.list(None, &Default::default()).expect("list") {
        b.daemon.delete(&vm.hostname).await.expect("delete");
    }
    assert_eq!(link_up(&spare_tap), None, "the fork's TAP went with it");
    b.daemon.drain_pools().await;
    assert!(b.daemon.spare_book().addresses("dev").is_empty());
    assert!(b.fake.primed().is_empty(), "primed VMs stopped");
    let left = manager().teardown().expect("teardown");
    assert!(left.is_empty(), "left behind: {left:?}");
}
