//! The `shutdown` op under an init other than the agent (a systemd guest):
//! the agent asks the init with `poweroff` / `reboot` and answers `ok`, or
//! says why it could not. Its own test binary: it puts stand-in commands
//! first on `PATH`, which is process-wide.

mod common;

use std::os::unix::fs::PermissionsExt;

use common::TestAgent;
use tine_proto::agent::ShutdownAction;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_shutdown_asks_the_init_to_power_off_or_reboot() {
    let bin = tempfile::tempdir().expect("tempdir");
    let log = bin.path().join("asked");
    for (name, code) in [("poweroff", 0), ("reboot", 1)] {
        let path = bin.path().join(name);
        std::fs::write(
            &path,
            format!(
                "#!/bin/sh\necho {name} \"$@\" >> {}\nexit {code}\n",
                log.display()
            ),
        )
        .expect("write stand-in");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    let path = format!(
        "{}:{}",
        bin.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // SAFETY: this test binary has no other test, and no other thread reads
    // the environment at this point.
    unsafe { std::env::set_var("PATH", path) };

    let agent = TestAgent::start().await;
    let client = agent.client().await;
    client
        .shutdown(ShutdownAction::Poweroff)
        .await
        .expect("poweroff is asked for");
    assert_eq!(
        std::fs::read_to_string(&log).expect("log"),
        "poweroff\n",
        "the init was asked once, with no arguments"
    );
    // A failing `reboot` is an error that says so, not a silent success.
    let err = client
        .shutdown(ShutdownAction::Reboot)
        .await
        .expect_err("reboot fails");
    assert!(err.to_string().contains("reboot exited with"), "{err}");
}
