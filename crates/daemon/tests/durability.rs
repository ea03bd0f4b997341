//! A graceful shutdown loses no guest write, a forced one says so, and a
//! crashed VMM leaves a disk that checks clean. Real guests through the
//! REST API, in the test bed (nested here), one test at a time.
//!
//! Every write below is left in the guest's page cache (no `sync`) and the
//! shutdown follows at once: only the guest's own shutdown (terminate, sync,
//! remount read-only, power off) can put the data on the disk.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use support::*;
use tine_client::api::{ShutdownAction, TineClient, Wait};
use tine_proto::api::{CommitRequest, ForkRequest, StopMode, VmState};
use tine_testbed::{Failed, Trial};

/// Each scenario runs this many times.
const ROUNDS: usize = 5;
/// Fresh data per round, enough to sit in the page cache past the dirty
/// thresholds of a 256 MiB guest.
const BIG_BYTES: u64 = 64 << 20;

/// Writes `/root/marker{round}` and `/root/big` (fresh random data)
/// without syncing; returns their checksums as the guest computed them.
async fn write_unsynced(c: &TineClient, vm: &str, round: usize) -> R<String> {
    sh_ok(
        c,
        vm,
        &format!(
            "echo round{round} > /root/marker{round} && rm -f /root/big && \
             head -c {BIG_BYTES} /dev/urandom > /root/big && \
             md5sum /root/marker{round} /root/big"
        ),
    )
    .await
}

async fn checksums(c: &TineClient, vm: &str, round: usize) -> R<String> {
    sh_ok(c, vm, &format!("md5sum /root/marker{round} /root/big")).await
}

/// Shuts `vm` down gracefully at once and checks it says so.
async fn shut_down_gracefully(c: &TineClient, vm: &str) -> R {
    let t = Instant::now();
    let r = c
        .shutdown(vm, ShutdownAction::Shutdown, None)
        .await
        .or_fail()?;
    println!("{vm}: shutdown in {} ms", t.elapsed().as_millis());
    if r.stop_mode != Some(StopMode::Graceful) || r.state != VmState::Stopped {
        return Err(fail(format!("{vm}: shutdown answered {r:?}")));
    }
    if let Ok(info) = c.describe(vm).await {
        let reason = info.reason.unwrap_or_default();
        if info.stop_mode != Some(StopMode::Graceful) || !reason.starts_with("guest_poweroff") {
            return Err(fail(format!(
                "{vm}: describe says stop {:?}, reason {reason:?}; want graceful, guest_poweroff",
                info.stop_mode
            )));
        }
    }
    Ok(())
}

/// Write, shut down at once, relaunch: every file is there, bit for bit.
fn shutdown_then_relaunch_keeps_writes() -> R {
    let d = Daemon::start("relaunch", "", None)?;
    let c = &d.client;
    rt().block_on(async {
        let vm = c
            .create_vm("t", &create_req(true), Wait::Agent, Some(BOOT))
            .await
            .or_fail()?
            .hostname;
        for round in 1..=ROUNDS {
            let want = write_unsynced(c, &vm, round).await?;
            shut_down_gracefully(c, &vm).await?;
            c.relaunch(&vm, Wait::Agent, Some(BOOT)).await.or_fail()?;
            let got = checksums(c, &vm, round).await?;
            if got != want {
                return Err(fail(format!(
                    "round {round}: after relaunch\n{got}\nwant\n{want}"
                )));
            }
            // Earlier rounds' small files are all still there.
            let all: String = (1..=round).map(|i| format!("round{i}\n")).collect();
            let listed = (1..=round)
                .map(|i| format!("/root/marker{i}"))
                .collect::<Vec<_>>()
                .join(" ");
            assert_eq!(sh_ok(c, &vm, &format!("cat {listed}")).await?, all);
            println!("round {round}: relaunch kept every write");
        }
        Ok(())
    })
}

/// Write in a builder, shut down at once, commit, fork twice: both forks
/// see every file, bit for bit. Each round's builder is a fork of the
/// round before, so the rounds also commit forks (a chain of commits).
fn shutdown_then_commit_keeps_writes_in_forks() -> R {
    let d = Daemon::start("commit", "", None)?;
    let c = &d.client;
    rt().block_on(async {
        let mut builder = c
            .create_vm("t", &create_req(true), Wait::Agent, Some(BOOT))
            .await
            .or_fail()?
            .hostname;
        for round in 1..=ROUNDS {
            let want = write_unsynced(c, &builder, round).await?;
            shut_down_gracefully(c, &builder).await?;
            let commit = c
                .commit(&builder, &CommitRequest::default())
                .await
                .or_fail()?
                .commit_id;
            let req = ForkRequest::default();
            let fork = || c.fork(&commit, &req, Wait::Agent, Some(BOOT));
            let (a, b) = tokio::join!(fork(), fork());
            let (a, b) = (a.or_fail()?.hostname, b.or_fail()?.hostname);
            for f in [&a, &b] {
                let got = checksums(c, f, round).await?;
                if got != want {
                    return Err(fail(format!(
                        "round {round}: fork {f} has\n{got}\nwant\n{want}"
                    )));
                }
            }
            println!("round {round}: both forks of {commit} have every write");
            // One fork builds on in the next round; the other and the old
            // builder (stopped, its disk now an overlay) go.
            c.delete(&b).await.or_fail()?;
            c.delete(&builder).await.or_fail()?;
            builder = a;
        }
        Ok(())
    })
}

/// An init that ignores every request to stop (it takes Ctrl-Alt-Del as a
/// signal and ignores that signal) and never starts an agent.
const DEAF_INIT: &str = "#!/bin/sh
mount -t proc proc /proc
echo 0 > /proc/sys/kernel/ctrl-alt-del
trap '' INT TERM HUP USR1 USR2 PWR
echo deaf-init: ignoring every stop request
while :; do sleep 1; done
";

/// A copy of the min image whose /sbin/init is [`DEAF_INIT`].
fn deaf_image(dir: &Path) -> R<std::path::PathBuf> {
    let min = std::env::var(IMAGE_ENV).map_err(|_| fail(format!("{IMAGE_ENV} is not set")))?;
    let image = dir.join("deaf.ext4");
    std::fs::copy(&min, &image)?;
    let init = dir.join("deaf-init");
    std::fs::write(&init, DEAF_INIT)?;
    let script = dir.join("debugfs.cmds");
    std::fs::write(
        &script,
        format!(
            "rm /sbin/init\nwrite {} /sbin/init\nsif /sbin/init mode 0100755\n",
            init.display()
        ),
    )?;
    run_tool(
        Command::new("debugfs")
            .arg("-w")
            .arg("-f")
            .arg(&script)
            .arg(&image),
        "debugfs (e2fsprogs)",
    )?;
    Ok(image)
}

/// A guest that ignores the shutdown is killed after the timeout and
/// reported as forced; `action=poweroff` is forced at once; the daemon
/// stays healthy.
fn ignored_shutdown_is_forced() -> R {
    let dir = std::path::PathBuf::from("/tmp/td-deaf-image");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let image = deaf_image(&dir)?;
    let group = format!(
        "  - name: deaf\n    image: {}\n    persistent: true\n",
        image.display()
    );
    let d = Daemon::start("deaf", &group, None)?;
    let c = &d.client;
    rt().block_on(async {
        let vm = c
            .create_vm("deaf", &create_req(true), Wait::None, None)
            .await
            .or_fail()?
            .hostname;
        // Wait for the init to say it ignores everything.
        let start = Instant::now();
        loop {
            let logs = c.logs(&vm, Some(200)).await.or_fail()?;
            if logs
                .content
                .lines()
                .any(|l| l.contains("deaf-init: ignoring"))
            {
                break;
            }
            if start.elapsed() > BOOT {
                return Err(fail(format!(
                    "the deaf init never started: {:?}",
                    logs.content
                )));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let timeout = Duration::from_secs(3);
        let t = Instant::now();
        let r = c
            .shutdown(&vm, ShutdownAction::Shutdown, Some(timeout))
            .await
            .or_fail()?;
        let took = t.elapsed();
        println!(
            "ignored shutdown: answered {r:?} after {} ms",
            took.as_millis()
        );
        assert_eq!(r.stop_mode, Some(StopMode::Forced), "{r:?}");
        assert_eq!(r.state, VmState::Stopped);
        assert!(took >= timeout, "killed before the timeout: {took:?}");
        let info = c.describe(&vm).await.or_fail()?;
        let reason = info.reason.unwrap_or_default();
        assert_eq!(info.stop_mode, Some(StopMode::Forced));
        assert!(
            reason.contains("did not power off within 3s") && reason.contains("may be lost"),
            "{reason}"
        );
        c.healthz().await.or_fail()?;

        // action=poweroff on a guest that would cooperate: forced, at once.
        let vm = c
            .create_vm("t", &create_req(true), Wait::Agent, Some(BOOT))
            .await
            .or_fail()?
            .hostname;
        let r = c
            .shutdown(&vm, ShutdownAction::Poweroff, None)
            .await
            .or_fail()?;
        assert_eq!(r.stop_mode, Some(StopMode::Forced), "{r:?}");
        let info = c.describe(&vm).await.or_fail()?;
        assert!(
            info.reason
                .as_deref()
                .unwrap_or("")
                .contains("action=poweroff"),
            "{info:?}"
        );
        // It relaunches; the daemon is fine.
        c.relaunch(&vm, Wait::Agent, Some(BOOT)).await.or_fail()?;
        assert_eq!(sh_ok(c, &vm, "echo up").await?, "up\n");
        Ok(())
    })
}

/// `kill -9` of a tine-vmm in the middle of heavy guest writes: the disk
/// passes `qemu-img check`, the guest boots again (its journal replays),
/// and after a graceful shutdown the file system checks clean.
fn vmm_killed_during_writes() -> R {
    let d = Daemon::start("vmmkill", "", None)?;
    let c = &d.client;
    let r = rt();
    let (vm, disk) = r.block_on(async {
        let created = c
            .create_vm("t", &create_req(true), Wait::Agent, Some(BOOT))
            .await
            .or_fail()?;
        let vm = created.hostname;
        sh_ok(
            c,
            &vm,
            "setsid sh -c 'i=0; while :; do i=$((i+1)); \
             head -c 4194304 /dev/urandom > /root/w$((i % 8)); done' \
             </dev/null >/dev/null 2>&1 &",
        )
        .await?;
        // Let it write for a while: several files are half-written and the
        // journal holds uncommitted transactions.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let ls = sh_ok(c, &vm, "ls /root").await?;
        assert!(ls.contains('w'), "the writer runs: {ls}");
        let info = c.describe(&vm).await.or_fail()?;
        Ok::<_, Failed>((vm, info.disk.path))
    })?;
    let pid = d.vmm_pid(&vm)?;
    Command::new("kill")
        .arg("-9")
        .arg(pid.to_string())
        .status()?;
    r.block_on(async {
        let start = Instant::now();
        loop {
            let info = c.describe(&vm).await.or_fail()?;
            if info.state == VmState::Failed {
                assert_eq!(info.stop_mode, Some(StopMode::Crashed), "{info:?}");
                break;
            }
            if start.elapsed() > Duration::from_secs(30) {
                return Err(fail(format!("{vm} still {:?}", info.state)));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok::<_, Failed>(())
    })?;
    qemu_img_check(Path::new(&disk))?;
    r.block_on(async {
        c.relaunch(&vm, Wait::Agent, Some(BOOT)).await.or_fail()?;
        let ls = sh_ok(c, &vm, "ls /root").await?;
        println!(
            "after the crash and journal replay: /root has {}",
            ls.replace('\n', " ")
        );
        shut_down_gracefully(c, &vm).await
    })?;
    qemu_img_check(Path::new(&disk))?;
    let flat = d.dir.join("flat.raw");
    run_tool(
        Command::new("qemu-img")
            .args(["convert", "-O", "raw"])
            .arg(&disk)
            .arg(&flat),
        "qemu-img (qemu-utils)",
    )?;
    let out = run_tool(
        Command::new("e2fsck").arg("-fn").arg(&flat),
        "e2fsck (e2fsprogs)",
    )?;
    println!("e2fsck -fn after the journal replay:\n{out}");
    Ok(())
}

fn main() {
    bed_main(
        "daemon durability test",
        vec![
            Trial::test(
                "shutdown_then_relaunch_keeps_writes",
                shutdown_then_relaunch_keeps_writes,
            ),
            Trial::test(
                "shutdown_then_commit_keeps_writes_in_forks",
                shutdown_then_commit_keeps_writes_in_forks,
            ),
            Trial::test("ignored_shutdown_is_forced", ignored_shutdown_is_forced),
            Trial::test("vmm_killed_during_writes", vmm_killed_during_writes),
        ],
    );
}
