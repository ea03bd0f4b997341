//! The daemon's real launcher driving this crate's `tine-vmm` binary with a
//! synthetic guest: restore into a pre-started process, pause, snapshot,
//! resume, adoption by a second launcher (a restarted daemon), and the
//! typed stop at the end; then the same through the warm pool, and a VM
//! primed ahead of its fork. Runs on this host's KVM (ring-3 guest code).

use std::path::{Path, PathBuf};
use std::time::Duration;

use tine_daemon::launcher::pool::{Shape, POOL_DIR};
use tine_daemon::launcher::vmm::VmmLauncher;
use tine_daemon::launcher::{
    GuestStep, Launcher, LauncherExt, PrimeSpec, RestoreSpec, Stop, WarmUp, WriteSetCopy,
};
use tine_daemon::process::{find_processes, Owner};
use tine_proto::vmm::{RunState, StopReason};
use tine_vmm::snapshot::write_set::WriteSet;
use tine_vmm::vmm::{BootConfig, ConsoleConfig, Vmm};

const COUNTER_LOOP: &[u8] = &[0x48, 0xff, 0x04, 0x25, 0x00, 0x00, 0x20, 0x00, 0xeb, 0xf6];

/// Where [`COUNTER_LOOP`] keeps its counter (guest-physical, and its
/// offset in the memory file).
const COUNTER: u64 = 0x20_0000;

/// A snapshot of a synthetic 32 MiB guest in `dir`: its state and memory.
fn synthetic_snapshot(dir: &Path) -> (PathBuf, PathBuf) {
    let state = dir.join("vm.state");
    let memory = dir.join("vm.mem");
    let config = BootConfig::raw_image(COUNTER_LOOP, 0x10_0000, 32);
    let mut vmm = Vmm::boot(&config, &ConsoleConfig::default()).expect("boot");
    std::thread::sleep(Duration::from_millis(10));
    vmm.pause().expect("pause");
    vmm.snapshot(&state, &memory).expect("snapshot");
    vmm.kill();
    (state, memory)
}

/// The pids of the pool's untaken processes under `data_dir`.
fn pool_pids(data_dir: &Path) -> Vec<u32> {
    find_processes(data_dir)
        .into_iter()
        .filter(|(_, owner)| matches!(owner, Owner::Pool(_)))
        .map(|(pid, _)| pid)
        .collect()
}

/// Waits (bounded) until `data_dir` has `n` untaken pool processes.
async fn wait_pool(data_dir: &Path, n: usize) -> Vec<u32> {
    for _ in 0..1000 {
        let pids = pool_pids(data_dir);
        if pids.len() == n {
            return pids;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "the pool never had {n} processes: {:?}",
        pool_pids(data_dir)
    );
}

#[tokio::test]
async fn the_vmm_launcher_restores_pauses_snapshots_adopts_and_stops() {
    let dir = tempfile::tempdir().expect("tmp");
    let (state, memory) = synthetic_snapshot(dir.path());
    let data_dir = dir.path().join("data");
    let launcher = VmmLauncher::new(env!("CARGO_BIN_EXE_tine-vmm").into(), data_dir.clone());
    let spec = RestoreSpec {
        hostname: "t-1".into(),
        cpus: 1,
        ram_mib: 32,
        state,
        memory,
        paused: false,
        disk: None,
        tap: None,
    };
    let running = launcher.restore(&spec).await.expect("restore");
    // What describe reports of it: the process's memory, and its guest's
    // copy of the counter page (the rest of its RAM is the memory file's).
    let instance = running.instance;
    let mut figures = None;
    for _ in 0..200 {
        figures = tine_daemon::host_stats::vm_memory(instance.pid, instance.pid_start, 32 << 20);
        if figures.is_some_and(|m| m.copied_bytes.unwrap_or(0) > 0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let figures = figures.expect("the VMM's smaps");
    let copied = figures.copied_bytes.expect("a restored VM copies pages") / 4096;
    assert!((1..64).contains(&copied), "{figures:?}");
    assert!(figures.process.uss > 0 && figures.process.pss >= figures.process.uss);
    launcher.pause("t-1").await.expect("pause");
    let snap = launcher
        .snapshot("t-1", dir.path().join("s2"), dir.path().join("m2"))
        .await
        .expect("snapshot");
    assert!(snap.is_some(), "a snapshot reports what it wrote");
    assert!(dir.path().join("s2").is_file() && dir.path().join("m2").is_file());
    launcher.resume("t-1").await.expect("resume");

    // A second launcher over the same data directory (a restarted daemon)
    // recognises the run, and does not count it as a stray when recorded.
    let again = VmmLauncher::new(env!("CARGO_BIN_EXE_tine-vmm").into(), data_dir);
    let strays = again.strays();
    assert_eq!(strays.len(), 1, "{strays:?}");
    assert_eq!(strays[0].pid, running.instance.pid);
    assert_eq!(strays[0].hostname, "t-1");
    let adopted = again.adopt("t-1", running.instance).expect("adopted");
    let mut wrong = running.instance;
    wrong.pid_start += 1;
    assert!(
        again.adopt("t-1", wrong).is_none(),
        "a reused pid is not ours"
    );

    launcher.stop_now("t-1").await.expect("kill");
    assert_eq!(running.exit.await, Stop::Reported(StopReason::Killed));
    assert_eq!(adopted.exit.await, Stop::Reported(StopReason::Killed));
    assert!(
        launcher.pause("t-1").await.is_err(),
        "nothing answers any more"
    );
}

#[tokio::test]
async fn a_restore_takes_a_pooled_process_which_a_restarted_daemon_knows_as_the_vms() {
    let dir = tempfile::tempdir().expect("tmp");
    let (state, memory) = synthetic_snapshot(dir.path());
    let data_dir = dir.path().join("data");
    let vmm: PathBuf = env!("CARGO_BIN_EXE_tine-vmm").into();
    let launcher = VmmLauncher::new(vmm.clone(), data_dir.clone());
    let shape = Shape {
        cpus: 1,
        ram_mib: 32,
    };
    launcher.keep_warm(&[(shape, 2)]).await;
    let before = pool_pids(&data_dir);
    assert_eq!(before.len(), 2, "two pre-started processes");

    let disk = dir.path().join("disk.raw");
    std::fs::write(&disk, vec![0u8; 1 << 20]).expect("disk");
    let spec = RestoreSpec {
        hostname: "t-1".into(),
        cpus: 1,
        ram_mib: 32,
        state,
        memory,
        paused: false,
        disk: Some(disk),
        tap: None,
    };
    let running = launcher.restore(&spec).await.expect("restore");
    assert!(
        before.contains(&running.instance.pid),
        "the fork runs in a pooled process: {} not in {before:?}",
        running.instance.pid
    );
    let vm_dir = data_dir.join("vms").join("t-1");
    for file in ["control.sock", "vmm.log", "serial.log"] {
        assert!(vm_dir.join(file).exists(), "{file} is in the VM's folder");
    }
    launcher
        .pause("t-1")
        .await
        .expect("pause through the moved socket");
    launcher.resume("t-1").await.expect("resume");
    // The pool fills up again in the background.
    let refilled = wait_pool(&data_dir, 2).await;
    assert!(!refilled.contains(&running.instance.pid));

    // A restarted daemon: the taken process is t-1's, the untaken ones are
    // strays (no launcher holds them), and it adopts t-1.
    let again = VmmLauncher::new(vmm.clone(), data_dir.clone());
    let mut strays = again.strays();
    strays.sort_by(|a, b| a.hostname.cmp(&b.hostname));
    assert_eq!(strays.len(), 3, "{strays:?}");
    assert!(strays[0].hostname.starts_with(&format!("{POOL_DIR}/")));
    assert!(strays[1].hostname.starts_with(&format!("{POOL_DIR}/")));
    assert_eq!(strays[2].hostname, "t-1");
    assert_eq!(strays[2].pid, running.instance.pid);
    let adopted = again.adopt("t-1", running.instance).expect("adopted");
    assert!(
        again.adopt("t-2", running.instance).is_none(),
        "it is not another VM's"
    );
    // The first launcher's own pool is not a stray to it.
    assert_eq!(launcher.strays().len(), 1, "{:?}", launcher.strays());

    launcher.stop_now("t-1").await.expect("kill");
    assert_eq!(running.exit.await, Stop::Reported(StopReason::Killed));
    assert_eq!(adopted.exit.await, Stop::Reported(StopReason::Killed));

    // With the pool emptied, a restore starts its own process.
    let other = RestoreSpec {
        hostname: "t-2".into(),
        ..spec
    };
    launcher.keep_warm(&[]).await;
    wait_pool(&data_dir, 0).await;
    let pool_dir = data_dir.join(POOL_DIR);
    let left: Vec<_> = std::fs::read_dir(&pool_dir)
        .expect("pool folder")
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "an emptied pool leaves nothing: {left:?}");
    let own = launcher
        .restore(&other)
        .await
        .expect("restore without a pool");
    launcher.stop_now("t-2").await.expect("kill");
    assert_eq!(own.exit.await, Stop::Reported(StopReason::Killed));
}

/// A spare's folder `name` under `dir`, with its disk (a VM takes the
/// folder by rename), and the spec that primes the snapshot `state` +
/// `memory` into it: no TAP, no write set, no warm-up.
fn spare_spec(dir: &Path, name: &str, state: &Path, memory: &Path) -> PrimeSpec {
    let folder = dir.join(name);
    std::fs::create_dir(&folder).expect("spare folder");
    let disk = folder.join("disk.raw");
    std::fs::write(&disk, vec![0u8; 1 << 20]).expect("disk");
    PrimeSpec {
        cpus: 1,
        ram_mib: 32,
        state: state.to_path_buf(),
        memory: memory.to_path_buf(),
        disk,
        folder,
        tap: None,
        write_set: None,
        warm_agent: false,
        guest_network: None,
        guest_identity: None,
        guest_secrets: None,
    }
}

/// Guest pages the run `instance` has copied from its memory file.
fn copied_pages(instance: tine_daemon::launcher::Instance) -> u64 {
    tine_daemon::host_stats::vm_memory(instance.pid, instance.pid_start, 32 << 20)
        .and_then(|m| m.copied_bytes)
        .expect("the VMM's smaps")
        / 4096
}

/// Asked to warm its agent, a primed VM runs until its agent answers (a
/// synthetic guest has no vsock device: the launcher says so at once, and
/// the nested bed's hot fork test shows a guest's agent answering; the
/// network and identity it was to set are not set), then waits paused
/// again, and a VM takes it over as any primed one.
#[tokio::test]
async fn a_primed_vm_warmed_ahead_waits_paused_again() {
    let dir = tempfile::tempdir().expect("tmp");
    let (state, memory) = synthetic_snapshot(dir.path());
    let data_dir = dir.path().join("data");
    let vmm: PathBuf = env!("CARGO_BIN_EXE_tine-vmm").into();
    let launcher = VmmLauncher::new(vmm, data_dir.clone());
    let spec = PrimeSpec {
        warm_agent: true,
        guest_network: Some(tine_proto::agent::NetworkRequest {
            iface: "eth0".into(),
            address: "198.51.100.7".parse().expect("address"),
            prefix: 24,
            gateway: Some("198.51.100.1".parse().expect("gateway")),
            dns: Vec::new(),
            mac: Some("02:00:00:00:00:07".into()),
        }),
        guest_identity: Some(tine_proto::agent::FixupRequest {
            machine_id: true,
            ..Default::default()
        }),
        guest_secrets: Some(Vec::new()),
        ..spare_spec(dir.path(), "spare-1", &state, &memory)
    };
    let folder = spec.folder.clone();
    let began = std::time::Instant::now();
    let primed = launcher.prime(&spec).await.expect("prime");
    match &primed.warm_up {
        WarmUp::NoAnswer(why) => assert!(why.contains("socket"), "{why}"),
        other => panic!("a guest without vsock: {other:?}"),
    }
    assert_eq!(primed.guest_network, GuestStep::NotAsked);
    assert_eq!(primed.guest_identity, GuestStep::NotAsked);
    assert_eq!(primed.guest_secrets, GuestStep::NotAsked);
    assert!(
        began.elapsed() < Duration::from_secs(10),
        "a guest without vsock was waited for"
    );
    let pid = pool_pids(&data_dir)[0];
    let instance = tine_daemon::launcher::Instance {
        pid,
        pid_start: tine_daemon::process::start_time(pid).expect("start time"),
    };
    let status = tine_daemon::process::control(
        &tine_daemon::process::VmPaths::in_dir(folder.clone()),
        &tine_proto::vmm::Request::Status,
        Duration::from_secs(5),
    )
    .await
    .expect("status");
    assert!(
        matches!(
            status,
            tine_proto::vmm::Response::Ok {
                state: Some(RunState::Paused),
                ..
            }
        ),
        "{status:?}"
    );
    std::fs::create_dir_all(data_dir.join("vms")).expect("vms folder");
    std::fs::rename(&folder, data_dir.join("vms").join("t-1")).expect("take the folder");
    let running = launcher
        .resume_primed(&primed.name, "t-1")
        .await
        .expect("resume")
        .expect("its process runs");
    assert_eq!(running.instance, instance);
    launcher.stop_now("t-1").await.expect("kill");
    assert_eq!(running.exit.await, Stop::Reported(StopReason::Killed));
}

#[tokio::test]
async fn a_primed_vm_waits_paused_until_a_vm_takes_it_over() {
    let dir = tempfile::tempdir().expect("tmp");
    let (state, memory) = synthetic_snapshot(dir.path());
    let data_dir = dir.path().join("data");
    let vmm: PathBuf = env!("CARGO_BIN_EXE_tine-vmm").into();
    let launcher = VmmLauncher::new(vmm.clone(), data_dir.clone());
    let spec = spare_spec(dir.path(), "spare-1", &state, &memory);
    let folder = spec.folder.clone();
    let primed = launcher.prime(&spec).await.expect("prime");
    assert_eq!(primed.warm_up, WarmUp::NotAsked);
    let name = primed.name;
    let primed = pool_pids(&data_dir);
    assert_eq!(primed.len(), 1, "its process waits in the pool's folder");
    // Its files moved into the spare's folder, and the slot's folder went.
    for file in ["control.sock", "vmm.log", "serial.log"] {
        assert!(
            folder.join(file).exists(),
            "{file} is in the spare's folder"
        );
    }
    let slot = data_dir.join(POOL_DIR).join(&name);
    assert!(
        std::fs::symlink_metadata(&slot).is_err(),
        "the slot's folder stays"
    );
    let instance = tine_daemon::launcher::Instance {
        pid: primed[0],
        pid_start: tine_daemon::process::start_time(primed[0]).expect("start time"),
    };
    // Paused: its guest has not run, so it copied nothing.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(copied_pages(instance), 0);
    // Ours, not a stray; a restarted daemon's stray.
    assert!(launcher.strays().is_empty(), "{:?}", launcher.strays());
    let again = VmmLauncher::new(vmm.clone(), data_dir.clone());
    let strays = again.strays();
    assert_eq!(strays.len(), 1, "{strays:?}");
    assert_eq!(strays[0].hostname, format!("{POOL_DIR}/{name}"));

    // Taken over: the VM's folder is the spare's, renamed, and its guest
    // runs.
    let vm_dir = data_dir.join("vms").join("t-1");
    std::fs::create_dir_all(data_dir.join("vms")).expect("vms folder");
    std::fs::rename(&folder, &vm_dir).expect("take the spare's folder");
    // A daemon restarted before the launch finds it in the VM's folder
    // (its log moved with the folder), and a stray still: no record names
    // its process, the fork is unborn and is restored again from its
    // commit.
    let strays = again.strays();
    assert_eq!(strays.len(), 1, "{strays:?}");
    assert_eq!(strays[0].hostname, "t-1");
    let running = launcher
        .resume_primed(&name, "t-1")
        .await
        .expect("resume")
        .expect("its process runs");
    assert_eq!(running.instance, instance, "the primed process");
    assert!(
        std::fs::symlink_metadata(&slot).is_err(),
        "a resume leaves nothing in the pool's folder"
    );
    let mut copied = 0;
    for _ in 0..200 {
        copied = copied_pages(instance);
        if copied > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(copied > 0, "its guest writes once resumed");
    launcher
        .pause("t-1")
        .await
        .expect("pause through the moved socket");
    let adopted = again.adopt("t-1", instance).expect("a restarted daemon's");
    assert!(
        launcher.resume_primed(&name, "t-2").await.is_err(),
        "taken once"
    );

    // One nobody takes is stopped, and its folder removed.
    let other = launcher
        .prime(&spare_spec(dir.path(), "spare-2", &state, &memory))
        .await
        .expect("prime")
        .name;
    assert_eq!(pool_pids(&data_dir).len(), 1);
    launcher.discard_primed(&other);
    wait_pool(&data_dir, 0).await;
    assert!(!data_dir.join(POOL_DIR).join(&other).exists());

    // One whose process ended meanwhile is none: the VM restores instead.
    let dead = launcher
        .prime(&spare_spec(dir.path(), "spare-3", &state, &memory))
        .await
        .expect("prime")
        .name;
    let pid = wait_pool(&data_dir, 1).await[0];
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(killed.success());
    tokio::time::sleep(Duration::from_millis(100)).await;
    let none = launcher
        .resume_primed(&dead, "t-3")
        .await
        .expect("no error");
    assert!(none.is_none(), "its process had ended");
    assert!(!data_dir.join(POOL_DIR).join(&dead).exists());

    launcher.stop_now("t-1").await.expect("kill");
    assert_eq!(running.exit.await, Stop::Reported(StopReason::Killed));
    assert_eq!(adopted.exit.await, Stop::Reported(StopReason::Killed));
}

/// The pages of the synthetic guest's run (its counter page, and the page
/// tables its CPU marks) saved as a write set, then copied into VMs primed
/// from the same snapshot before their guests run: at priming, or later to
/// one that waits. A write set that is not one leaves a VM primed without
/// it, and is refused by name.
#[tokio::test]
async fn a_write_set_saved_from_one_run_is_copied_into_the_vms_primed_after_it() {
    let dir = tempfile::tempdir().expect("tmp");
    let (state, memory) = synthetic_snapshot(dir.path());
    let data_dir = dir.path().join("data");
    let launcher = VmmLauncher::new(env!("CARGO_BIN_EXE_tine-vmm").into(), data_dir.clone());
    let running = launcher
        .restore(&RestoreSpec {
            hostname: "t-1".into(),
            cpus: 1,
            ram_mib: 32,
            state: state.clone(),
            memory: memory.clone(),
            paused: false,
            disk: None,
            tap: None,
        })
        .await
        .expect("restore");
    let mut copied = 0;
    for _ in 0..200 {
        copied = copied_pages(running.instance);
        if copied > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(copied > 0, "its guest writes its counter");
    launcher.pause("t-1").await.expect("pause");
    let copied = copied_pages(running.instance);
    let write_set = dir.path().join("write-set");
    let bytes = launcher
        .save_write_set("t-1", write_set.clone())
        .await
        .expect("save");
    assert_eq!(bytes, copied * 4096, "the pages it copied");
    let saved = WriteSet::load(&write_set, 32 << 20).expect("a write set");
    assert_eq!(saved.bytes(), bytes);
    assert!(
        saved
            .ranges
            .iter()
            .any(|&(start, end)| start <= COUNTER && COUNTER < end),
        "the counter's page: {saved:?}"
    );

    let primed = |name: &str, write_set: Option<PathBuf>| PrimeSpec {
        write_set,
        ..spare_spec(dir.path(), name, &state, &memory)
    };
    let instance_of = |pid: u32| tine_daemon::launcher::Instance {
        pid,
        pid_start: tine_daemon::process::start_time(pid).expect("start time"),
    };
    // Primed with it: its guest has not run, and the pages are its own.
    let with = launcher
        .prime(&primed("spare-1", Some(write_set.clone())))
        .await
        .expect("prime");
    assert_eq!(with.write_set, WriteSetCopy::Copied(bytes));
    let with = with.name;
    let with_pid = wait_pool(&data_dir, 1).await[0];
    assert_eq!(copied_pages(instance_of(with_pid)), copied);

    // Primed without: nothing copied, until it is asked to.
    let later = launcher
        .prime(&primed("spare-2", None))
        .await
        .expect("prime");
    assert_eq!(later.write_set, WriteSetCopy::NotAsked);
    let later = later.name;
    let later_pid = *wait_pool(&data_dir, 2)
        .await
        .iter()
        .find(|&&p| p != with_pid)
        .expect("the second");
    assert_eq!(copied_pages(instance_of(later_pid)), 0);
    let populated = launcher.populate_primed(&later, &write_set).await;
    assert_eq!(populated, Some(WriteSetCopy::Copied(bytes)));
    assert_eq!(copied_pages(instance_of(later_pid)), copied);

    // Not a write set: primed without it; refused by name.
    let bad = dir.path().join("bad-write-set");
    std::fs::write(&bad, b"{}").expect("write");
    let without = launcher
        .prime(&primed("spare-3", Some(bad.clone())))
        .await
        .expect("primed all the same");
    assert!(
        matches!(&without.write_set, WriteSetCopy::Refused(why) if why.contains("cannot be decoded")),
        "{:?}",
        without.write_set
    );
    let without = without.name;
    let without_pid = *wait_pool(&data_dir, 3)
        .await
        .iter()
        .find(|&&p| p != with_pid && p != later_pid)
        .expect("the third");
    assert_eq!(copied_pages(instance_of(without_pid)), 0);
    let refused = launcher.populate_primed(&without, &bad).await;
    assert!(
        matches!(&refused, Some(WriteSetCopy::Refused(why)) if why.contains("cannot be decoded")),
        "{refused:?}"
    );
    // One taken (or gone) is left alone.
    launcher.discard_primed(&with);
    assert_eq!(launcher.populate_primed(&with, &write_set).await, None);

    // The resumed guest runs on from the copied pages.
    std::fs::create_dir_all(data_dir.join("vms")).expect("vms folder");
    std::fs::rename(dir.path().join("spare-2"), data_dir.join("vms").join("t-2"))
        .expect("take the spare's folder");
    let resumed = launcher
        .resume_primed(&later, "t-2")
        .await
        .expect("resume")
        .expect("its process runs");
    launcher.stop_now("t-2").await.expect("kill");
    assert_eq!(resumed.exit.await, Stop::Reported(StopReason::Killed));
    launcher.discard_primed(&without);

    // Into a running VM, as a fork restored without a primed VM gets it.
    launcher.resume("t-1").await.expect("resume");
    assert_eq!(
        launcher.copy_write_set("t-1", write_set.clone()).await,
        WriteSetCopy::Copied(bytes)
    );
    assert!(matches!(
        launcher.copy_write_set("t-1", bad.clone()).await,
        WriteSetCopy::Refused(_)
    ));
    launcher.stop_now("t-1").await.expect("kill");
    assert_eq!(running.exit.await, Stop::Reported(StopReason::Killed));
}
