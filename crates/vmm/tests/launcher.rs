//! The daemon's real launcher driving this crate's `tine-vmm` binary with a
//! synthetic guest: restore into a pre-started process, pause, snapshot,
//! resume, adoption by a second launcher (a restarted daemon), and the
//! typed stop at the end. Runs on this host's KVM (ring-3 guest code).

use std::time::Duration;

use tine_daemon::launcher::vmm::VmmLauncher;
use tine_daemon::launcher::{Launcher, LauncherExt, RestoreSpec, Stop};
use tine_proto::vmm::StopReason;
use tine_vmm::vmm::{BootConfig, ConsoleConfig, Vmm};

const COUNTER_LOOP: &[u8] = &[0x48, 0xff, 0x04, 0x25, 0x00, 0x00, 0x20, 0x00, 0xeb, 0xf6];

#[tokio::test]
async fn the_vmm_launcher_restores_pauses_snapshots_adopts_and_stops() {
    let dir = tempfile::tempdir().expect("tmp");
    let state = dir.path().join("vm.state");
    let memory = dir.path().join("vm.mem");
    {
        let config = BootConfig::raw_image(COUNTER_LOOP, 0x10_0000, 32);
        let mut vmm = Vmm::boot(&config, &ConsoleConfig::default()).expect("boot");
        std::thread::sleep(Duration::from_millis(10));
        vmm.pause().expect("pause");
        vmm.snapshot(&state, &memory).expect("snapshot");
        vmm.kill();
    }
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
