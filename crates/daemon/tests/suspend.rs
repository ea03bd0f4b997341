//! Suspend and restore with a booted guest, in the test bed (nested here):
//! a file in a tmpfs and a background counter started in the guest are
//! still there after a suspend, a `kill -9` of the daemon, a restart and a
//! restore (same boot, same process, the counter going on from where it
//! was, the clock set again), while no VMM ran in between; its NIC works
//! again on its TAP, which is gone while it is suspended (the host answers
//! the guest's ARP for its gateway before and after); a daemon killed
//! at a crash point of a suspend leaves a VM that restores the same way; a
//! relaunch of a suspended VM boots its disk instead (a new boot, the
//! tmpfs gone).
//!
//! It prints the figures: cold boot to agent-ready, suspend, restore to
//! agent-ready, and their ratios (absolute times in a nested bed mean
//! little; the ratios do).

mod support;

use std::os::unix::fs::MetadataExt;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use support::*;
use tine_client::api::{TineClient, Wait};
use tine_daemon::failpoint::Failpoint;
use tine_proto::api::{ListQuery, VmState, VmStatus};
use tine_testbed::{Failed, Trial};

/// Suspend/restore rounds timed after the checks (with the first).
const ROUNDS: usize = 3;

/// An isolated group: the VM has a TAP, its own /30 and the host as its
/// gateway.
const GROUP: &str = "  - name: iso
    cpus: 1
    ram_mb: 256
    persistent: true
    network:
      mode: isolated
      cidr: 169.254.64.0/22
      allow: [0.0.0.0/0]
";

/// The VM's TAP and gateway.
async fn tap_and_gateway(c: &TineClient, vm: &str) -> R<(String, String)> {
    let n = c.describe(vm).await.or_fail()?.network;
    match (n.tap, n.gateway) {
        (Some(tap), Some(gw)) => Ok((tap, gw)),
        other => Err(fail(format!("{vm} has no TAP or gateway: {other:?}"))),
    }
}

/// The guest's NIC reaches the host through its TAP: the host answers its
/// ARP request for the gateway.
async fn nic_answers(c: &TineClient, vm: &str, gateway: &str, when: &str) -> R {
    let (code, out, err) = sh(c, vm, &format!("arping -c 1 -w 5 -I eth0 {gateway}")).await?;
    if code != 0 {
        return Err(fail(format!(
            "{when}: no ARP answer from the gateway {gateway}: {out}{err}"
        )));
    }
    Ok(())
}

fn tap_exists(tap: &str) -> bool {
    Command::new("ip")
        .args(["link", "show", "dev", tap])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// What the guest's state looks like from inside.
#[derive(Debug, PartialEq)]
struct GuestState {
    boot_id: String,
    counter_pid: String,
    count: u64,
}

/// Mounts a tmpfs, writes 1 MiB of random data and its checksum into it,
/// and starts a counter in its own session that writes `count` there five
/// times a second.
async fn prepare_guest(c: &TineClient, vm: &str) -> R<String> {
    sh_ok(
        c,
        vm,
        "mkdir -p /mnt/mem && mount -t tmpfs -o size=16m tmpfs /mnt/mem && \
         head -c 1048576 /dev/urandom > /mnt/mem/blob && md5sum /mnt/mem/blob > /mnt/mem/blob.md5",
    )
    .await?;
    let pid = sh_ok(
        c,
        vm,
        "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /mnt/mem/count.new; mv /mnt/mem/count.new /mnt/mem/count; sleep 0.2; done' \
         </dev/null >/dev/null 2>&1 & echo $!",
    )
    .await?;
    Ok(pid.trim().to_owned())
}

/// The boot, the counter's pid (it must still run) and its count, with the
/// tmpfs file checked against its checksum.
async fn guest_state(c: &TineClient, vm: &str, counter_pid: &str) -> R<GuestState> {
    let out = sh_ok(
        c,
        vm,
        &format!(
            "kill -0 {counter_pid} && md5sum -c /mnt/mem/blob.md5 >/dev/null && \
             cat /proc/sys/kernel/random/boot_id /mnt/mem/count"
        ),
    )
    .await?;
    let mut lines = out.lines();
    let boot_id = lines.next().unwrap_or_default().to_owned();
    let count = lines
        .next()
        .and_then(|l| l.trim().parse().ok())
        .ok_or_else(|| fail(format!("no count in {out:?}")))?;
    Ok(GuestState {
        boot_id,
        counter_pid: counter_pid.to_owned(),
        count,
    })
}

/// The guest clock's distance from the host's, in seconds.
async fn clock_skew(c: &TineClient, vm: &str) -> R<i64> {
    let guest: i64 = sh_ok(c, vm, "date +%s")
        .await?
        .trim()
        .parse()
        .map_err(|e| fail(format!("guest date: {e}")))?;
    let host = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_err(|e| fail(e.to_string()))?
        .as_secs() as i64;
    Ok(guest - host)
}

/// After a restore: the same boot and counter, the count going on, the
/// clock right.
async fn check_resumed(c: &TineClient, vm: &str, before: &GuestState, when: &str) -> R {
    let after = guest_state(c, vm, &before.counter_pid)
        .await
        .map_err(|e| fail(format!("{when}: {e:?}")))?;
    if after.boot_id != before.boot_id {
        return Err(fail(format!(
            "{when}: the guest rebooted ({} -> {})",
            before.boot_id, after.boot_id
        )));
    }
    if after.count < before.count {
        return Err(fail(format!(
            "{when}: the counter went back from {} to {}",
            before.count, after.count
        )));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let later = guest_state(c, vm, &before.counter_pid).await?;
    if later.count <= after.count {
        return Err(fail(format!(
            "{when}: the counter stands still at {}",
            later.count
        )));
    }
    let skew = clock_skew(c, vm).await?;
    if skew.abs() > 5 {
        return Err(fail(format!(
            "{when}: the guest clock is {skew} s off the host's"
        )));
    }
    println!(
        "{when}: same boot, counter {} went on {} -> {} -> {}, clock {skew:+} s",
        before.counter_pid, before.count, after.count, later.count
    );
    Ok(())
}

/// Checks a VM is suspended with its snapshot and no VMM; returns the
/// memory file's allocated bytes.
async fn check_suspended(d: &Daemon, vm: &str, old_pid: u32, when: &str) -> R<u64> {
    let c = &d.client;
    let info = c.describe(vm).await.or_fail()?;
    if info.state != VmState::Suspended || info.status != VmStatus::Stopped || info.pid.is_some() {
        return Err(fail(format!(
            "{when}: state {} status {} pid {:?}",
            info.state, info.status, info.pid
        )));
    }
    if alive(old_pid) {
        return Err(fail(format!("{when}: its VMM {old_pid} still runs")));
    }
    let vmms = tine_daemon::process::find_vmm_processes(&d.data());
    if vmms.iter().any(|(_, h)| h == vm) {
        return Err(fail(format!("{when}: a VMM runs for it: {vmms:?}")));
    }
    let dir = d.data().join("vms").join(vm).join("snapshot");
    let memory = std::fs::metadata(dir.join("memory"))
        .map_err(|e| fail(format!("{when}: memory file: {e}")))?;
    let state = std::fs::metadata(dir.join("state"))
        .map_err(|e| fail(format!("{when}: state file: {e}")))?;
    if state.len() == 0 || memory.len() != info.ram_bytes {
        return Err(fail(format!(
            "{when}: state {} bytes, memory {} bytes for {} of RAM",
            state.len(),
            memory.len(),
            info.ram_bytes
        )));
    }
    Ok(memory.blocks() * 512)
}

fn p50(samples: &mut [u64]) -> u64 {
    samples.sort_unstable();
    samples[samples.len() / 2]
}

fn suspend_restore_keep_the_guest_running() -> R {
    let mut d = Daemon::start("suspend", GROUP, None)?;
    let result = checks(&mut d);
    if result.is_err() {
        println!("daemon log:\n{}", d.log_tail());
        let vms = d.data().join("vms");
        for e in std::fs::read_dir(&vms).into_iter().flatten().flatten() {
            let log = e.path().join("vmm.log");
            println!("{}:\n{}", log.display(), tine_testbed::tail_lines(&log, 10));
        }
    }
    result
}

fn checks(d: &mut Daemon) -> R {
    let r = rt();
    let c = d.client.clone();
    let (vm, boot_ms, before, pid, (tap, gateway)) = r.block_on(async {
        let created = c
            .create_vm("iso", &create_req(true), Wait::Agent, Some(BOOT))
            .await
            .or_fail()?;
        let vm = created.hostname;
        let counter = prepare_guest(&c, &vm).await?;
        let before = guest_state(&c, &vm, &counter).await?;
        let pid = pid_of(&c, &vm).await?;
        let net = tap_and_gateway(&c, &vm).await?;
        nic_answers(&c, &vm, &net.1, "booted").await?;
        Ok::<_, Failed>((vm, created.elapsed_ms, before, pid, net))
    })?;
    println!(
        "{vm}: booted in {boot_ms} ms, counter {} at {}",
        before.counter_pid, before.count
    );

    // Suspend; the daemon dies and comes back; the VM waits, suspended.
    let mut suspend_ms = Vec::new();
    let mut restore_ms = Vec::new();
    let (resp, before) = r.block_on(async {
        let before = guest_state(&c, &vm, &before.counter_pid).await?;
        let resp = c.suspend(&vm).await.or_fail()?;
        Ok::<_, Failed>((resp, before))
    })?;
    if resp.state != VmState::Suspended || resp.memory_bytes == 0 {
        return Err(fail(format!("suspend answered {resp:?}")));
    }
    suspend_ms.push(resp.elapsed_ms);
    let allocated = r.block_on(check_suspended(d, &vm, pid, "suspended"))?;
    if tap_exists(&tap) {
        return Err(fail(format!(
            "{tap} is still there while {vm} is suspended"
        )));
    }
    println!(
        "{vm}: suspended in {} ms (snapshot {} ms): {} MiB of RAM written, memory file {} MiB allocated",
        resp.elapsed_ms,
        resp.snapshot_ms,
        resp.memory_bytes >> 20,
        allocated >> 20
    );
    d.kill9()?;
    d.spawn()?;
    r.block_on(check_suspended(d, &vm, pid, "after a daemon restart"))?;
    // The guest's clock stands still meanwhile; the restore sets it.
    std::thread::sleep(Duration::from_secs(8));
    let restored = r.block_on(async {
        let t = Instant::now();
        let resp = c.restore(&vm, Wait::Agent, Some(BOOT)).await.or_fail()?;
        let wall = t.elapsed();
        if resp.state != VmState::Running {
            return Err(fail(format!("restore answered {resp:?}")));
        }
        check_resumed(&c, &vm, &before, "restored after a daemon restart").await?;
        if tap_and_gateway(&c, &vm).await? != (tap.clone(), gateway.clone()) {
            return Err(fail("the restored VM has another TAP or gateway"));
        }
        nic_answers(&c, &vm, &gateway, "restored").await?;
        Ok::<_, Failed>((resp.elapsed_ms, wall))
    })?;
    restore_ms.push(restored.0);
    println!(
        "{vm}: restored to agent-ready in {} ms ({} ms at the client)",
        restored.0,
        restored.1.as_millis()
    );
    let snapshot = d.data().join("vms").join(&vm).join("snapshot");
    if snapshot.exists() {
        return Err(fail(format!(
            "{} is left after the restore",
            snapshot.display()
        )));
    }

    // A daemon killed once the snapshot is in place, before it recorded
    // the suspend: the next one finishes the suspend.
    let pid = r.block_on(pid_of(&c, &vm))?;
    let before = r.block_on(guest_state(&c, &vm, &before.counter_pid))?;
    d.kill9()?;
    d.spawn_armed(Failpoint::SuspendSnapshotSealed)?;
    let answer = r.block_on(c.suspend(&vm));
    let status = d.wait_exit(BOOT)?;
    println!(
        "suspend at {}: {answer:?}; daemon {status}",
        Failpoint::SuspendSnapshotSealed.name()
    );
    d.spawn()?;
    r.block_on(check_suspended(
        d,
        &vm,
        pid,
        "after a kill at the sealed snapshot",
    ))?;
    r.block_on(async {
        c.restore(&vm, Wait::Agent, Some(BOOT)).await.or_fail()?;
        check_resumed(&c, &vm, &before, "restored after a kill mid-suspend").await
    })?;

    // More rounds for the figures.
    for round in 2..=ROUNDS {
        r.block_on(async {
            let before = guest_state(&c, &vm, &before.counter_pid).await?;
            let s = c.suspend(&vm).await.or_fail()?;
            suspend_ms.push(s.elapsed_ms);
            let t = c.restore(&vm, Wait::Agent, Some(BOOT)).await.or_fail()?;
            restore_ms.push(t.elapsed_ms);
            check_resumed(&c, &vm, &before, &format!("round {round}")).await
        })?;
    }

    // Relaunch of a suspended VM boots its disk: a new boot, no tmpfs.
    r.block_on(async {
        c.suspend(&vm).await.or_fail()?;
        c.relaunch(&vm, Wait::Agent, Some(BOOT)).await.or_fail()?;
        let out = sh_ok(
            &c,
            &vm,
            "cat /proc/sys/kernel/random/boot_id; test -e /mnt/mem/blob && echo kept || echo gone",
        )
        .await?;
        let mut lines = out.lines();
        let boot_id = lines.next().unwrap_or_default();
        if boot_id == before.boot_id || lines.next() != Some("gone") {
            return Err(fail(format!(
                "relaunch of a suspended VM: {out:?} (boot before {})",
                before.boot_id
            )));
        }
        let vms = c.list_vms(None, &ListQuery::default()).await.or_fail()?;
        if vms.iter().any(|v| v.state == VmState::Suspended) {
            return Err(fail(format!("still suspended: {vms:?}")));
        }
        Ok::<_, Failed>(())
    })?;

    let (s50, t50) = (p50(&mut suspend_ms), p50(&mut restore_ms));
    println!(
        "suspend/restore ({} rounds, 256 MiB guest): cold boot to agent-ready {boot_ms} ms; \
         suspend p50 {s50} ms (samples {suspend_ms:?}); restore to agent-ready p50 {t50} ms \
         (samples {restore_ms:?}); restore/boot {:.3}, suspend/boot {:.3}",
        suspend_ms.len(),
        t50 as f64 / boot_ms.max(1) as f64,
        s50 as f64 / boot_ms.max(1) as f64
    );
    Ok(())
}

fn main() {
    bed_main(
        "daemon suspend/restore test",
        vec![Trial::test(
            "suspend_restore_keep_the_guest_running",
            suspend_restore_keep_the_guest_running,
        )],
    );
}
