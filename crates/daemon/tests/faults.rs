//! Fault injection: the daemon is killed with SIGKILL at every crash point
//! of create, fork, commit and delete (`TINE_FAILPOINT`, see
//! `tine_daemon::failpoint`), restarted, and every invariant is checked:
//!
//! - nothing is lost: every VM and commit the API answered 2xx for still
//!   exists, and in the end every VM boots and answers, every commit forks;
//! - nothing is half-made: no record without its folder or disk, no folder,
//!   disk or commit file without its record, no `creating` leftover, no VM
//!   failed by the crash, no tine-vmm process that no live record names,
//!   and every qcow2 file passes `qemu-img check` (the VMs have no network,
//!   so there are no TAPs; tests/network.rs covers their clean-up).
//!
//! It prints the figure: kills (points x repetitions), objects lost,
//! objects half-made; the target is 0 and 0. Runs in the test bed.

mod support;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use support::*;
use tine_client::api::{CommitQuery, ShutdownAction, TineClient, Wait};
use tine_daemon::failpoint::Failpoint;
use tine_proto::api::{CommitRequest, ForkRequest, ListQuery, VmState};
use tine_testbed::{Failed, Trial};

/// How many times each (operation, point) pair runs; `TINE_FAULT_REPEATS`
/// overrides it.
const REPEATS: usize = 1;

/// The operation a crash interrupts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Create,
    Fork,
    Commit,
    Delete,
}

/// Every crash point, with the operations that reach it.
const SCENARIOS: &[(Op, Failpoint)] = &[
    (Op::Create, Failpoint::ProvisionDiskMade),
    (Op::Create, Failpoint::ProvisionRecorded),
    (Op::Create, Failpoint::BootDiskSynced),
    (Op::Create, Failpoint::BootSpawned),
    (Op::Create, Failpoint::BootRecorded),
    (Op::Create, Failpoint::BootSetUp),
    (Op::Fork, Failpoint::ProvisionDiskMade),
    (Op::Fork, Failpoint::ProvisionRecorded),
    (Op::Fork, Failpoint::BootDiskSynced),
    (Op::Fork, Failpoint::BootSpawned),
    (Op::Fork, Failpoint::BootSetUp),
    (Op::Commit, Failpoint::CommitLinked),
    (Op::Commit, Failpoint::CommitOverlayMade),
    (Op::Commit, Failpoint::CommitRecorded),
    (Op::Delete, Failpoint::DeleteStopped),
    (Op::Delete, Failpoint::DeleteRecordRemoved),
];

/// What the API promised so far: these must survive every crash.
#[derive(Default)]
struct Promised {
    vms: BTreeSet<String>,
    commits: BTreeSet<String>,
}

/// What went wrong, counted for the figure.
#[derive(Default)]
struct Tally {
    kills: usize,
    lost: Vec<String>,
    half_made: Vec<String>,
}

fn small_vm() -> tine_proto::api::CreateVmRequest {
    let mut req = create_req(true);
    req.ram_bytes = Some(128 << 20);
    req
}

/// Waits until no VM is `creating` or `starting` (reconcile's relaunches
/// have booted), up to `limit`.
async fn settle(c: &TineClient, limit: Duration) -> R {
    let start = Instant::now();
    loop {
        let vms = c.list_vms(None, &ListQuery::default()).await.or_fail()?;
        let busy: Vec<String> = vms
            .iter()
            .filter(|v| {
                matches!(
                    v.state,
                    VmState::Creating | VmState::Starting | VmState::Stopping
                )
            })
            .map(|v| format!("{} {}", v.hostname, v.state))
            .collect();
        if busy.is_empty() {
            return Ok(());
        }
        if start.elapsed() > limit {
            return Err(fail(format!("still busy after {limit:?}: {busy:?}")));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Every invariant of the module docs; violations go into the tally.
async fn check(d: &Daemon, promised: &Promised, tally: &mut Tally, when: &str) -> R {
    let c = &d.client;
    settle(c, BOOT).await?;
    let vms = c.list_vms(None, &ListQuery::default()).await.or_fail()?;
    let commits = c.list_commits(&CommitQuery::default()).await.or_fail()?;
    let names: BTreeSet<String> = vms.iter().map(|v| v.hostname.clone()).collect();
    let ids: BTreeSet<String> = commits.iter().map(|c| c.commit_id.clone()).collect();
    for vm in promised.vms.difference(&names) {
        tally.lost.push(format!("{when}: VM {vm}"));
    }
    for id in promised.commits.difference(&ids) {
        tally.lost.push(format!("{when}: commit {id}"));
    }
    let mut half = Vec::new();
    let data = d.data();
    for vm in &vms {
        if vm.state == VmState::Failed {
            half.push(format!(
                "VM {} failed: {}",
                vm.hostname,
                vm.reason.clone().unwrap_or_default()
            ));
        }
        if !data.join("vms").join(&vm.hostname).is_dir() {
            half.push(format!("VM {} has no folder", vm.hostname));
        }
        if !Path::new(&vm.disk.path).is_file() {
            half.push(format!("VM {} has no disk {}", vm.hostname, vm.disk.path));
        }
    }
    for e in std::fs::read_dir(data.join("vms"))? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if !names.contains(&name) {
            half.push(format!("folder vms/{name} has no record"));
        }
        for f in std::fs::read_dir(e.path())? {
            let f = f?.path();
            let is_disk = f.extension().is_some_and(|x| x == "qcow2");
            if is_disk && !vms.iter().any(|v| Path::new(&v.disk.path) == f) {
                half.push(format!("disk {} has no record", f.display()));
            }
        }
    }
    let commit_dir = data.join("commits");
    if commit_dir.is_dir() {
        for e in std::fs::read_dir(&commit_dir)? {
            let p = e?.path();
            let stem = p
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            if !ids.contains(&stem) {
                half.push(format!("commit file {} has no record", p.display()));
            }
        }
    }
    for id in &ids {
        if !commit_dir.join(format!("{id}.qcow2")).is_file() {
            half.push(format!("commit {id} has no file"));
        }
    }
    let live: BTreeSet<u32> = vms
        .iter()
        .filter(|v| v.state.is_live())
        .filter_map(|v| v.pid)
        .collect();
    for (pid, host) in tine_daemon::process::find_vmm_processes(&data) {
        if !live.contains(&pid) {
            half.push(format!("tine-vmm {pid} of {host} has no live record"));
        }
    }
    // Disks: every qcow2 file in the data directory, each at rest: a
    // running VM's is checked with its vCPUs parked. qemu-img reads an
    // image's refcounts and its L2 tables at different moments, so a
    // cluster a live guest allocates in between looks referenced but
    // unallocated (an "error" no crash made).
    let running: Vec<&str> = vms
        .iter()
        .filter(|v| v.state == VmState::Running)
        .map(|v| v.hostname.as_str())
        .collect();
    for h in &running {
        c.pause(h).await.or_fail()?;
    }
    // A request the guest sent just before is done by then.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut disks: Vec<std::path::PathBuf> =
        vms.iter().map(|v| v.disk.path.clone().into()).collect();
    disks.extend(ids.iter().map(|id| commit_dir.join(format!("{id}.qcow2"))));
    for disk in disks.iter().filter(|p| p.is_file()) {
        if let Err(e) = qemu_img_check(disk) {
            half.push(format!("{e:?}"));
        }
    }
    for h in &running {
        c.resume(h).await.or_fail()?;
    }
    for h in half {
        tally.half_made.push(format!("{when}: {h}"));
    }
    Ok(())
}

/// Runs `op` against a daemon armed at `point`; returns what the API
/// answered 2xx for (VMs, commits), once the daemon has died.
async fn interrupted(
    c: &TineClient,
    op: Op,
    base_commit: &str,
    target: Option<&str>,
) -> (Option<String>, Option<String>) {
    match op {
        Op::Create => match c.create_vm("t", &small_vm(), Wait::None, None).await {
            Ok(r) => (Some(r.hostname), None),
            Err(e) => {
                println!("  create: {e}");
                (None, None)
            }
        },
        Op::Fork => {
            match c
                .fork(base_commit, &ForkRequest::default(), Wait::None, None)
                .await
            {
                Ok(r) => (Some(r.hostname), None),
                Err(e) => {
                    println!("  fork: {e}");
                    (None, None)
                }
            }
        }
        Op::Commit => {
            let vm = target.unwrap_or_default();
            match c.commit(vm, &CommitRequest::default()).await {
                Ok(r) => (None, Some(r.commit_id)),
                Err(e) => {
                    println!("  commit: {e}");
                    (None, None)
                }
            }
        }
        Op::Delete => {
            let vm = target.unwrap_or_default();
            if let Err(e) = c.delete(vm).await {
                println!("  delete: {e}");
            }
            (None, None)
        }
    }
}

fn kill_nine_everywhere() -> R {
    let repeats = std::env::var("TINE_FAULT_REPEATS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(REPEATS);
    let mut d = Daemon::start("faults", "", None)?;
    let r = rt();
    let mut promised = Promised::default();
    let mut tally = Tally::default();
    // The commit every fork starts from, and its source.
    let (base_vm, base_commit) = r.block_on(async {
        let c = &d.client;
        let b = c
            .create_vm("t", &small_vm(), Wait::Agent, Some(BOOT))
            .await
            .or_fail()?
            .hostname;
        sh_ok(c, &b, "echo base > /root/base").await?;
        c.shutdown(&b, ShutdownAction::Shutdown, None)
            .await
            .or_fail()?;
        let commit = c
            .commit(&b, &CommitRequest::default())
            .await
            .or_fail()?
            .commit_id;
        promised.vms.insert(b.clone());
        promised.commits.insert(commit.clone());
        Ok::<_, Failed>((b, commit))
    })?;
    let points: BTreeSet<&str> = SCENARIOS.iter().map(|(_, p)| p.name()).collect();
    for round in 1..=repeats {
        for &(op, point) in SCENARIOS {
            let when = format!("{op:?} at {} (round {round})", point.name());
            println!("{when}");
            // What the operation needs, made by a normal daemon.
            let target = r.block_on(async {
                let c = &d.client;
                match op {
                    Op::Commit | Op::Delete => {
                        let h = c
                            .create_vm("t", &small_vm(), Wait::Agent, Some(BOOT))
                            .await
                            .or_fail()?
                            .hostname;
                        if op == Op::Commit {
                            sh_ok(c, &h, "echo committed > /root/mine").await?;
                            c.shutdown(&h, ShutdownAction::Shutdown, None)
                                .await
                                .or_fail()?;
                        }
                        Ok::<_, Failed>(Some(h))
                    }
                    Op::Create | Op::Fork => Ok(None),
                }
            })?;
            d.kill9()?;
            d.spawn_armed(point)?;
            let (vm, commit) =
                r.block_on(interrupted(&d.client, op, &base_commit, target.as_deref()));
            let status = d
                .wait_exit(BOOT)
                .map_err(|e| fail(format!("{when}: the crash point was never reached: {e:?}")))?;
            tally.kills += 1;
            println!("  daemon ended with {status}; answered vm {vm:?} commit {commit:?}");
            promised.vms.extend(vm.clone());
            promised.commits.extend(commit.clone());
            if op == Op::Commit {
                // The source stays whatever the commit did.
                promised.vms.extend(target.clone());
            }
            d.spawn()?;
            r.block_on(check(&d, &promised, &mut tally, &when))?;
            // Whatever survived must work; then it goes, to keep the bed's
            // memory for the next scenario.
            r.block_on(async {
                let c = &d.client;
                let survivors: Vec<String> = c
                    .list_vms(None, &ListQuery::default())
                    .await
                    .or_fail()?
                    .into_iter()
                    .filter(|v| v.state == VmState::Running)
                    .map(|v| v.hostname)
                    .collect();
                for h in &survivors {
                    if let Err(e) = sh_ok(c, h, "true").await {
                        tally
                            .lost
                            .push(format!("{when}: {h} does not answer: {e:?}"));
                    }
                }
                if let (Op::Commit, Some(source)) = (op, &target) {
                    // The source's disk is whole, committed or not.
                    c.relaunch(source, Wait::Agent, Some(BOOT))
                        .await
                        .or_fail()?;
                    let got = sh_ok(c, source, "cat /root/mine").await?;
                    if got != "committed\n" {
                        tally
                            .lost
                            .push(format!("{when}: source {source} reads {got:?}"));
                    }
                }
                // Every commit there is forks, answered or not (a crash after
                // the record keeps a commit nobody was told of).
                let made: Vec<String> = c
                    .list_commits(&CommitQuery::default())
                    .await
                    .or_fail()?
                    .into_iter()
                    .map(|cm| cm.commit_id)
                    .filter(|id| *id != base_commit)
                    .collect();
                for id in &made {
                    match c
                        .fork(id, &ForkRequest::default(), Wait::Agent, Some(BOOT))
                        .await
                    {
                        Ok(f) => {
                            let got = sh_ok(c, &f.hostname, "cat /root/mine").await?;
                            if got != "committed\n" {
                                tally
                                    .lost
                                    .push(format!("{when}: fork of {id} reads {got:?}"));
                            }
                            c.delete(&f.hostname).await.or_fail()?;
                        }
                        Err(e) => tally
                            .lost
                            .push(format!("{when}: commit {id} does not fork: {e}")),
                    }
                }
                // Clean up this scenario's objects (the base stays).
                for v in c.list_vms(None, &ListQuery::default()).await.or_fail()? {
                    if v.hostname != base_vm {
                        c.delete(&v.hostname).await.or_fail()?;
                        promised.vms.remove(&v.hostname);
                    }
                }
                for cm in c.list_commits(&CommitQuery::default()).await.or_fail()? {
                    if cm.commit_id != base_commit {
                        c.delete_commit(&cm.commit_id)
                            .await
                            .map_err(|e| fail(format!("{when}: delete {}: {e}", cm.commit_id)))?;
                        promised.commits.remove(&cm.commit_id);
                    }
                }
                Ok::<_, Failed>(())
            })?;
        }
    }
    // The base commit still forks after every crash.
    r.block_on(async {
        let c = &d.client;
        let f = c
            .fork(
                &base_commit,
                &ForkRequest::default(),
                Wait::Agent,
                Some(BOOT),
            )
            .await
            .or_fail()?;
        assert_eq!(sh_ok(c, &f.hostname, "cat /root/base").await?, "base\n");
        c.delete(&f.hostname).await.or_fail()?;
        Ok::<_, Failed>(())
    })?;
    println!(
        "fault injection: {} kills ({} crash points in {} operation steps x {repeats} repetitions): \
         {} objects lost, {} half-made",
        tally.kills,
        points.len(),
        SCENARIOS.len(),
        tally.lost.len(),
        tally.half_made.len()
    );
    if !tally.lost.is_empty() || !tally.half_made.is_empty() {
        return Err(fail(format!(
            "lost: {:#?}\nhalf-made: {:#?}",
            tally.lost, tally.half_made
        )));
    }
    Ok(())
}

fn main() {
    bed_main(
        "daemon fault-injection test",
        vec![Trial::test("kill_nine_everywhere", kill_nine_everywhere)],
    );
}
