//! Memory commits and hot forks with booted guests, in the test bed
//! (nested here). A source runs a counter in a tmpfs; a memory commit
//! pauses it only briefly and it runs on; two hot forks resume the
//! counter (same boot, same pid, the count going on) with their own
//! hostname, machine-id, MAC and address (on the TAP made ahead for them,
//! in quarantine until then), out of quarantine (the host answers their
//! ARP), with private writes, and each fork's own kernel
//! logged one CRNG reseed for its VM generation ID change (the source
//! none); the first fork's clock goes on from the commit although its
//! primed VM waited `PRIMED_WAIT` (it ran until its agent answered, then
//! held its clock); the urandom bytes of `ENTROPY_FORKS` forks differ pairwise (46
//! forks, 1035 pairs), of which 10 (`TINE_DENSITY_FORKS`) run at once for the density figure (USS, PSS
//! and guest pages copied of each after one exec, from describe); a file
//! the source wrote after the commit is in no fork; a changed CPU
//! shape is refused; a `kill -9` in the middle of a memory commit leaves
//! the source running on its own disk and no commit.
//!
//! It prints the figures: the source's cold boot, the memory commit's
//! pause, hot fork to agent-ready, cold fork to agent-ready, and their
//! ratio (absolute times in a nested bed mean little; the ratios do).

mod support;

use std::time::{Duration, Instant};

use support::*;
use tine_client::api::{CommitQuery, TineClient, Wait};
use tine_daemon::failpoint::Failpoint;
use tine_proto::api::{
    CommitMode, CommitRequest, ErrorCode, ForkRequest, ShutdownAction, StopMode, VmState,
};
use tine_testbed::{Failed, Trial};

/// An isolated group: each VM has a TAP, its own /30 and the host as its
/// gateway.
const GROUP: &str = "  - name: hot
    cpus: 1
    ram_mb: 256
    persistent: true
    hot_fork_pool: 1
    network:
      mode: isolated
      cidr: 169.254.72.0/22
      allow: [0.0.0.0/0]
";

/// What identifies a guest from inside.
#[derive(Debug, Clone, PartialEq)]
struct Identity {
    hostname: String,
    machine_id: String,
    mac: String,
    address: String,
}

async fn identity(c: &TineClient, vm: &str) -> R<Identity> {
    let out = sh_ok(
        c,
        vm,
        "hostname; cat /etc/machine-id /sys/class/net/eth0/address; \
         ip -4 addr show dev eth0 | sed -n 's/.*inet \\([0-9.\\/]*\\).*/\\1/p'",
    )
    .await?;
    let lines: Vec<&str> = out.lines().map(str::trim).collect();
    match lines.as_slice() {
        [hostname, machine_id, mac, address] => Ok(Identity {
            hostname: hostname.to_string(),
            machine_id: machine_id.to_string(),
            mac: mac.to_string(),
            address: address.to_string(),
        }),
        _ => Err(fail(format!("{vm}: identity from {out:?}"))),
    }
}

/// The identity the daemon gave `vm`.
async fn assigned(c: &TineClient, vm: &str) -> R<(String, String, String)> {
    let n = c.describe(vm).await.or_fail()?.network;
    match (n.mac, n.address, n.gateway) {
        (Some(mac), Some(address), Some(gateway)) => Ok((mac, address, gateway)),
        other => Err(fail(format!(
            "{vm} has no MAC, address or gateway: {other:?}"
        ))),
    }
}

/// Prints what is left of the counter in a VM: its file, its process
/// (`coun[t]`: this command's own cmdline must not match).
const COUNTER_TRACES: &str = "[ -e /mnt/mem/coun[t] ] && echo 'the counter file'; \
     grep -qs 'mnt/mem/coun[t]' /proc/[0-9]*/cmdline && echo 'a counter process'; true";

/// Starts a counter in a tmpfs, in a session of its own; returns its pid.
/// Each value is written beside the file and renamed over it: a reader
/// never sees the file empty, as it did between `>`'s truncation and the
/// write.
async fn start_counter(c: &TineClient, vm: &str) -> R<String> {
    let pid = sh_ok(
        c,
        vm,
        "mkdir -p /mnt/mem && mount -t tmpfs -o size=8m tmpfs /mnt/mem && \
         setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /mnt/mem/count.new; mv /mnt/mem/count.new /mnt/mem/count; sleep 0.2; done' \
         </dev/null >/dev/null 2>&1 & \
         while [ ! -s /mnt/mem/count ]; do sleep 0.05; done; echo $!",
    )
    .await?;
    Ok(pid.trim().to_owned())
}

/// The boot id and the counter's count (the counter must run).
async fn counter(c: &TineClient, vm: &str, pid: &str) -> R<(String, u64)> {
    let out = sh_ok(
        c,
        vm,
        &format!("kill -0 {pid} && cat /proc/sys/kernel/random/boot_id /mnt/mem/count"),
    )
    .await?;
    let mut lines = out.lines();
    let boot = lines.next().unwrap_or_default().to_owned();
    let count = lines
        .next()
        .and_then(|l| l.trim().parse().ok())
        .ok_or_else(|| fail(format!("{vm}: no count in {out:?}")))?;
    Ok((boot, count))
}

/// The counter started in the source goes on in `vm`: same boot, same
/// pid, from at least `from`, and still counting.
async fn counter_goes_on(c: &TineClient, vm: &str, pid: &str, boot: &str, from: u64) -> R<u64> {
    let (b1, n1) = counter(c, vm, pid).await?;
    if b1 != boot {
        return Err(fail(format!("{vm}: another boot ({boot} -> {b1})")));
    }
    if n1 < from {
        return Err(fail(format!(
            "{vm}: the counter went back from {from} to {n1}"
        )));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (_, n2) = counter(c, vm, pid).await?;
    if n2 <= n1 {
        return Err(fail(format!("{vm}: the counter stands still at {n1}")));
    }
    Ok(n2)
}

/// `vm`'s uptime (its monotonic clock), in seconds.
async fn uptime(c: &TineClient, vm: &str) -> R<f64> {
    let out = sh_ok(c, vm, "cut -d' ' -f1 /proc/uptime").await?;
    out.trim()
        .parse()
        .map_err(|_| fail(format!("{vm}: no uptime in {out:?}")))
}

/// How long the first hot fork's primed VM waits before the fork takes
/// it: its guest's clock must not count it.
const PRIMED_WAIT: Duration = Duration::from_secs(20);

/// The guest kernel's log line when its vmgenid driver saw a new VM
/// generation ID and reseeded the CRNG.
const VMFORK_RESEED: &str = "crng reseeded due to virtual machine fork";

/// How often `vm`'s kernel reseeded on a VM generation ID change; fails
/// unless the vmgenid driver is bound to the VMM's ACPI device.
async fn vmgenid_reseeds(c: &TineClient, vm: &str) -> R<u32> {
    let out = sh_ok(
        c,
        vm,
        &format!(
            "test -e /sys/bus/acpi/drivers/vmgenid/VMGENCTR:00 || echo unbound; \
             dmesg | grep -c '{VMFORK_RESEED}' || true"
        ),
    )
    .await?;
    if out.contains("unbound") {
        return Err(fail(format!(
            "{vm}: no vmgenid driver bound to VMGENCTR:00"
        )));
    }
    out.trim()
        .parse()
        .map_err(|_| fail(format!("{vm}: count of {VMFORK_RESEED:?}: {out:?}")))
}

/// Hot forks whose first urandom bytes are compared, each with each:
/// 46 forks make 1035 pairs.
const ENTROPY_FORKS: usize = 46;

async fn urandom(c: &TineClient, vm: &str) -> R<String> {
    sh_ok(
        c,
        vm,
        "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'",
    )
    .await
}

/// A new hot fork of `commit` and the 32 bytes of urandom it read once
/// its set-up was done (as a user's first exec would).
async fn fork_reading_urandom(c: &TineClient, commit: &str) -> R<(String, String)> {
    let f = c
        .fork(commit, &ForkRequest::default(), Wait::Agent, Some(BOOT))
        .await
        .or_fail()?;
    let bytes = urandom(c, &f.hostname).await?;
    Ok((f.hostname, bytes))
}

/// Makes `n` more hot forks of `commit`, one after the other, each
/// deleted once it read its urandom.
async fn urandom_of_more_forks(c: &TineClient, commit: &str, n: usize) -> R<Vec<(String, String)>> {
    let mut read = Vec::new();
    for _ in 0..n {
        let (vm, bytes) = fork_reading_urandom(c, commit).await?;
        c.delete(&vm).await.or_fail()?;
        read.push((vm, bytes));
    }
    Ok(read)
}

/// Hot forks of one commit running at once for the density figure:
/// `TINE_DENSITY_FORKS` (default 10, at most 40; each one held at once
/// slows the nested bed, so CI runs 10: 20 took 7 minutes there).
fn held_forks() -> R<usize> {
    match std::env::var("TINE_DENSITY_FORKS") {
        Err(_) => Ok(10),
        Ok(v) => match v.parse::<usize>() {
            Ok(n) if (2..=40).contains(&n) => Ok(n),
            _ => Err(fail(format!(
                "TINE_DENSITY_FORKS={v:?}: give a number of forks from 2 to 40"
            ))),
        },
    }
}

/// Makes `n` hot forks of `commit` that run at once, each read 32 bytes of
/// urandom (one exec); then prints what each one's process holds (USS,
/// PSS, guest pages copied, from describe) and deletes them.
async fn urandom_of_forks_at_once(
    c: &TineClient,
    commit: &str,
    n: usize,
) -> R<Vec<(String, String)>> {
    let mut read = Vec::new();
    for _ in 0..n {
        read.push(fork_reading_urandom(c, commit).await?);
    }
    let mut uss = Vec::new();
    let mut pss = Vec::new();
    let mut copied = Vec::new();
    for (vm, _) in &read {
        let memory = c.describe(vm).await.or_fail()?.memory;
        let Some(m) = memory else {
            return Err(fail(format!("{vm}: describe shows no memory figures")));
        };
        let Some(pages) = m.guest_pages_copied else {
            return Err(fail(format!(
                "{vm}: a hot fork without a copied-page count: {m:?}"
            )));
        };
        uss.push(m.uss_bytes);
        pss.push(m.pss_bytes);
        copied.push(pages * tine_proto::api::GUEST_PAGE_BYTES);
    }
    let mib = |v: &mut Vec<u64>| {
        v.sort_unstable();
        let at =
            |q: f64| v[((v.len() - 1) as f64 * q).round() as usize] as f64 / f64::from(1 << 20);
        format!("p50 {:.1} MiB, max {:.1} MiB", at(0.5), at(1.0))
    };
    println!(
        "density: {n} hot forks (256 MiB guests) running at once, after one exec each: USS {}; PSS {}; guest pages copied {}",
        mib(&mut uss),
        mib(&mut pss),
        mib(&mut copied)
    );
    for (vm, _) in &read {
        c.delete(vm).await.or_fail()?;
    }
    Ok(read)
}

/// Fails when two VMs read the same bytes (or one read not 32 of them);
/// returns how many pairs were compared.
fn all_differ(read: &[(String, String)]) -> R<usize> {
    let mut by_bytes = std::collections::HashMap::new();
    for (vm, bytes) in read {
        if bytes.len() != 64 {
            return Err(fail(format!("{vm}: urandom gave {bytes:?}")));
        }
        if let Some(other) = by_bytes.insert(bytes.as_str(), vm.as_str()) {
            return Err(fail(format!(
                "{other} and {vm} read the same urandom bytes {bytes}"
            )));
        }
    }
    Ok(read.len() * (read.len() - 1) / 2)
}

/// The host answers the guest's ARP for its gateway: its TAP is up.
async fn nic_answers(c: &TineClient, vm: &str, gateway: &str) -> R {
    let (code, out, err) = sh(c, vm, &format!("arping -c 1 -w 5 -I eth0 {gateway}")).await?;
    if code != 0 {
        return Err(fail(format!(
            "{vm}: no ARP answer from the gateway {gateway}: {out}{err}"
        )));
    }
    Ok(())
}

fn serial_of(d: &Daemon, vm: &str) -> std::path::PathBuf {
    d.data().join("vms").join(vm).join("serial.log")
}

fn memory_commit(tag: &str) -> CommitRequest {
    CommitRequest {
        mode: Some(CommitMode::Memory),
        tags: vec![tag.to_owned()],
        ..CommitRequest::default()
    }
}

/// The pid of the one VM primed for the next hot fork under `data` (a
/// tine-vmm of the pool that restored the commit, paused, its files moved
/// into a spare's folder), once there is one (the spares fill in the
/// background).
async fn primed_pid(data: &std::path::Path) -> R<u32> {
    let deadline = Instant::now() + BOOT;
    let spares = std::fs::canonicalize(data)
        .map_err(|e| fail(format!("the data folder: {e}")))?
        .join("spares");
    loop {
        let primed: Vec<u32> = tine_daemon::process::find_processes(data)
            .into_iter()
            .filter(|(_, owner)| matches!(owner, tine_daemon::process::Owner::Pool(_)))
            .filter(|(pid, _)| {
                tine_daemon::process::log_folder(*pid).is_some_and(|dir| dir.starts_with(&spares))
            })
            .map(|(pid, _)| pid)
            .collect();
        match primed[..] {
            [pid] => return Ok(pid),
            [] if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(100)).await,
            _ => return Err(fail(format!("primed tine-vmm processes: {primed:?}"))),
        }
    }
}

/// The TAP the daemon made ahead for the next hot fork (its alias a
/// spare's), which must be down: in quarantine.
async fn spare_tap() -> R<String> {
    let deadline = Instant::now() + BOOT;
    loop {
        let out = std::process::Command::new("ip")
            .args(["-j", "-d", "link", "show"])
            .output()
            .map_err(|e| fail(format!("cannot run ip (iproute2): {e}")))?;
        let links: serde_json::Value = serde_json::from_slice(&out.stdout)
            .map_err(|e| fail(format!("ip -j link show: {e}")))?;
        let spares: Vec<(String, bool)> = links
            .as_array()
            .into_iter()
            .flatten()
            .filter(|l| {
                l["ifalias"]
                    .as_str()
                    .is_some_and(|a| a.starts_with("spare-"))
            })
            .map(|l| {
                let up = l["flags"]
                    .as_array()
                    .is_some_and(|f| f.iter().any(|x| x == "UP"));
                (l["ifname"].as_str().unwrap_or_default().to_owned(), up)
            })
            .collect();
        match &spares[..] {
            [(tap, false)] => return Ok(tap.clone()),
            [] if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(100)).await,
            _ => return Err(fail(format!("spare TAPs (name, up): {spares:?}"))),
        }
    }
}

fn hot_forks_resume_the_source() -> R {
    let mut d = Daemon::start("hotfork", GROUP, None)?;
    let result = checks(&mut d);
    if result.is_err() {
        println!("daemon log:\n{}", d.log_tail());
        let vms = d.data().join("vms");
        for e in std::fs::read_dir(&vms).into_iter().flatten().flatten() {
            for (name, lines) in [("vmm.log", 10), ("serial.log", 40)] {
                let log = e.path().join(name);
                println!(
                    "{}:\n{}",
                    log.display(),
                    tine_testbed::tail_lines(&log, lines)
                );
            }
        }
    }
    result
}

fn checks(d: &mut Daemon) -> R {
    let r = rt();
    let c = d.client.clone();
    let (src, boot_ms, pid, boot_id) = r.block_on(async {
        let created = c
            .create_vm("hot", &create_req(true), Wait::Agent, Some(BOOT))
            .await
            .or_fail()?;
        let src = created.hostname;
        let pid = start_counter(&c, &src).await?;
        sh_ok(&c, &src, "echo before > /root/before && sync").await?;
        let (boot, _) = counter(&c, &src, &pid).await?;
        Ok::<_, Failed>((src, created.elapsed_ms, pid, boot))
    })?;
    println!("{src}: booted in {boot_ms} ms, counter {pid}");

    // A kill -9 once the source runs on its fresh overlay, before the
    // record: the next daemon puts it back on its disk and it runs on.
    d.kill9()?;
    d.spawn_armed(Failpoint::MemoryCommitSwitched)?;
    let answer = r.block_on(c.commit(&src, &memory_commit("crashed")));
    let status = d.wait_exit(BOOT)?;
    println!(
        "memory commit at {}: {answer:?}; daemon {status}",
        Failpoint::MemoryCommitSwitched.name()
    );
    d.spawn()?;
    r.block_on(async {
        let state = c.describe(&src).await.or_fail()?.state;
        if state != VmState::Running {
            return Err(fail(format!("{src} is {state} after the restart")));
        }
        counter_goes_on(&c, &src, &pid, &boot_id, 0).await?;
        let commits = c.list_commits(&CommitQuery::default()).await.or_fail()?;
        if !commits.is_empty() {
            return Err(fail(format!("a half commit is listed: {commits:?}")));
        }
        sh_ok(
            &c,
            &src,
            "echo still > /root/still && sync && cat /root/before",
        )
        .await?;
        Ok::<_, Failed>(())
    })?;

    let (id, pause_us, at_commit, uptime_at_commit) = r.block_on(async {
        let (_, at_commit) = counter(&c, &src, &pid).await?;
        let uptime_at_commit = uptime(&c, &src).await?;
        let info = c.commit(&src, &memory_commit("warm")).await.or_fail()?;
        if info.mode != CommitMode::Memory || info.memory_bytes.unwrap_or(0) == 0 {
            return Err(fail(format!("the memory commit answered {info:?}")));
        }
        let pause_us = info
            .pause_us
            .ok_or_else(|| fail(format!("no pause time in {info:?}")))?;
        // The source runs on, on its new disk, and writes after the commit.
        counter_goes_on(&c, &src, &pid, &boot_id, at_commit).await?;
        sh_ok(&c, &src, "echo after > /root/after && sync").await?;
        let listed = c
            .list_commits(&CommitQuery {
                mode: Some(CommitMode::Memory),
                ..CommitQuery::default()
            })
            .await
            .or_fail()?;
        if listed.len() != 1 || listed[0].commit_id != info.commit_id {
            return Err(fail(format!("memory commits listed: {listed:?}")));
        }
        Ok::<_, Failed>((info.commit_id, pause_us, at_commit, uptime_at_commit))
    })?;
    println!(
        "{src}: memory commit {id}, paused {:.1} ms",
        pause_us as f64 / 1000.0
    );

    let data = d.data();
    let (forks, hot_ms) = r.block_on(async {
        let source = identity(&c, &src).await?;
        let source_reseeds = vmgenid_reseeds(&c, &src).await?;
        if source_reseeds != 0 {
            return Err(fail(format!(
                "{src} was never restored but logged {source_reseeds} VM fork reseeds"
            )));
        }
        let mut forks = Vec::new();
        let mut hot_ms = Vec::new();
        for round in 0..2 {
            // The fork runs in the process primed ahead for it.
            let pooled = primed_pid(&data).await?;
            if round == 0 {
                tokio::time::sleep(PRIMED_WAIT).await;
            }
            // And with the network made ahead for it, in quarantine.
            let spare = spare_tap().await?;
            let t = Instant::now();
            let f = c
                .fork(&id, &ForkRequest::default(), Wait::Agent, Some(BOOT))
                .await
                .or_fail()?;
            if f.mode != CommitMode::Memory || f.child_status != VmState::Running {
                return Err(fail(format!("the hot fork answered {f:?}")));
            }
            let described = c.describe(&f.hostname).await.or_fail()?;
            let vmm_pid = described.pid;
            if vmm_pid != Some(pooled) {
                return Err(fail(format!(
                    "{} runs in tine-vmm {vmm_pid:?}, not the primed {pooled}",
                    f.hostname
                )));
            }
            if described.network.tap.as_ref() != Some(&spare) {
                return Err(fail(format!(
                    "{} has TAP {:?}, not the spare {spare}",
                    f.hostname, described.network.tap
                )));
            }
            hot_ms.push(f.elapsed_ms);
            let vm = f.hostname;
            if round == 0 {
                // Its clock went on from the commit: the guest ran until its
                // agent answered, then stood while the primed VM waited.
                let gained = uptime(&c, &vm).await? - uptime_at_commit;
                println!(
                    "{vm}: uptime {gained:.1} s past the source's at the commit, its primed VM having waited {PRIMED_WAIT:?}"
                );
                if gained >= PRIMED_WAIT.as_secs_f64() {
                    return Err(fail(format!(
                        "{vm}: its clock counted its primed VM's wait ({gained:.1} s past the commit)"
                    )));
                }
            }
            // Its exec works at once; the source's processes run on.
            let echo = sh_ok(&c, &vm, "echo ready").await?;
            println!(
                "{vm}: hot fork to agent-ready {} ms ({} ms at the client), exec echo {:?}",
                f.elapsed_ms,
                t.elapsed().as_millis(),
                echo.trim()
            );
            counter_goes_on(&c, &vm, &pid, &boot_id, at_commit).await?;
            // The VMM wrote a new generation ID and raised the GED on
            // restore: the fork's own kernel reseeded its CRNG.
            let reseeds = vmgenid_reseeds(&c, &vm).await?;
            if reseeds != 1 {
                return Err(fail(format!(
                    "{vm}: {reseeds} VM fork reseeds logged, expected 1"
                )));
            }
            println!("{vm}: kernel CRNG reseeded by the VM generation ID change");
            let files = sh_ok(
                &c,
                &vm,
                "cat /root/before /root/still; test -e /root/after && echo after || echo no-after",
            )
            .await?;
            if files.split_whitespace().collect::<Vec<_>>() != ["before", "still", "no-after"] {
                return Err(fail(format!("{vm}: the source's files: {files:?}")));
            }
            let me = identity(&c, &vm).await?;
            let (mac, address, gateway) = assigned(&c, &vm).await?;
            if me.hostname != vm
                || me.machine_id == source.machine_id
                || me.mac != mac
                || me.mac == source.mac
                || me.address != address
                || me.address == source.address
            {
                return Err(fail(format!(
                    "{vm}: identity {me:?} (assigned {mac} {address}), source {source:?}"
                )));
            }
            nic_answers(&c, &vm, &gateway).await?;
            forks.push(vm);
        }
        // Their writes are their own.
        sh_ok(&c, &forks[0], "echo mine > /root/mine && sync").await?;
        for other in [&forks[1], &src] {
            let (code, _, _) = sh(&c, other, "test -e /root/mine").await?;
            if code == 0 {
                return Err(fail(format!("{other} sees {}'s write", forks[0])));
            }
        }
        // The cold fork below must show none of this; a hot fork shows both.
        let traces = sh_ok(&c, &forks[0], COUNTER_TRACES).await?;
        if traces.trim() != "the counter file\na counter process" {
            return Err(fail(format!(
                "{}: the counter's traces: {traces:?}",
                forks[0]
            )));
        }
        let mut read = Vec::new();
        for vm in &forks {
            read.push((vm.clone(), urandom(&c, vm).await?));
        }
        let held = held_forks()?;
        read.extend(urandom_of_forks_at_once(&c, &id, held).await?);
        read.extend(urandom_of_more_forks(&c, &id, ENTROPY_FORKS - held - forks.len()).await?);
        let pairs = all_differ(&read)?;
        println!("urandom: {} hot forks, {pairs} pairs, 0 equal", read.len());
        expect_err(
            c.fork(
                &id,
                &ForkRequest {
                    cpus: Some(2),
                    ..ForkRequest::default()
                },
                Wait::Agent,
                Some(BOOT),
            )
            .await,
            ErrorCode::BadRequest,
            "cannot have 2",
        )?;
        Ok::<_, Failed>((forks, hot_ms))
    })?;

    // The cold fork to compare with: a disk commit of the stopped second
    // fork, forked.
    let cold_ms = r.block_on(async {
        let stopped = c
            .shutdown(&forks[1], ShutdownAction::Shutdown, Some(BOOT))
            .await
            .or_fail()?;
        let reason = c
            .describe(&forks[1])
            .await
            .or_fail()?
            .reason
            .unwrap_or_default();
        println!(
            "{}: shutdown {:?} ({} ms), reason {reason:?}",
            forks[1], stopped.stop_mode, stopped.elapsed_ms,
        );
        // A hot fork's own power-off, like any VM's: its init synced and
        // wrote the debug-exit port (a restored vCPU once faulted there).
        if stopped.stop_mode != Some(StopMode::Graceful) || !reason.starts_with("guest_poweroff") {
            return Err(fail(format!(
                "{}: shutdown answered {stopped:?}, reason {reason:?}; want graceful, \
                 guest_poweroff; its console's last lines:\n{}",
                forks[1],
                tine_testbed::tail_lines(&serial_of(d, &forks[1]), 20)
            )));
        }
        let disk = c
            .commit(&forks[1], &CommitRequest::default())
            .await
            .or_fail()?;
        let cold = c
            .fork(
                &disk.commit_id,
                &ForkRequest::default(),
                Wait::Agent,
                Some(BOOT),
            )
            .await
            .or_fail()?;
        if cold.mode != CommitMode::Disk {
            return Err(fail(format!("the cold fork answered {cold:?}")));
        }
        // Booted, not resumed: a new boot, where no process runs the
        // counter and its tmpfs is gone. (Its pid alone says nothing: in a
        // fresh boot the same pid can be a kernel thread's.)
        let leftovers = sh_ok(&c, &cold.hostname, COUNTER_TRACES).await?;
        let boot = sh_ok(&c, &cold.hostname, "cat /proc/sys/kernel/random/boot_id").await?;
        if !leftovers.trim().is_empty() || boot.trim() == boot_id.trim() {
            return Err(fail(format!(
                "the cold fork runs the source's boot: boot id {} (the source's {}), found: {}",
                boot.trim(),
                boot_id.trim(),
                leftovers.trim()
            )));
        }
        Ok::<_, Failed>(cold.elapsed_ms)
    })?;
    // The first fork's set-up saved the commit's write set, once; the VMs
    // primed after it copy it in.
    let saved = d.log_lines("saved the commit's write set");
    match &saved[..] {
        [line] if line.contains(&format!("\"{}\"", forks[0])) => println!("{line}"),
        _ => return Err(fail(format!("write sets saved: {saved:?}"))),
    }
    let hot = hot_ms.iter().min().copied().unwrap_or(0);
    println!(
        "hot fork (256 MiB guest): source cold boot {boot_ms} ms; memory commit pause {:.1} ms; \
         hot fork to agent-ready {hot_ms:?} ms; cold fork to agent-ready {cold_ms} ms; \
         hot/cold {:.3} (target <= 0.05)",
        pause_us as f64 / 1000.0,
        hot as f64 / cold_ms.max(1) as f64
    );
    // Where each one's set-up time went, as the daemon logged it.
    for line in d.log_lines("agent ready") {
        println!("{line}");
    }
    Ok(())
}

fn main() {
    bed_main(
        "daemon hot fork test",
        vec![Trial::test(
            "hot_forks_resume_the_source",
            hot_forks_resume_the_source,
        )],
    );
}
