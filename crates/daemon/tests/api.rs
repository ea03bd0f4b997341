//! The daemon against real VMs, through the REST API: the whole life
//! cycle, `kill -9` of the daemon and of a VMM, concurrent creates, bad
//! input, commits and cold forks. Runs in the test bed (nested here), one
//! test at a time; each test starts its own daemon (this test binary
//! re-executed as `tine up`) on its own data directory.

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::*;
use tine_client::api::{
    CommitQuery, CpMode, ExecOptions, ShutdownAction, TineClient, UploadOptions, Wait,
};
use tine_proto::api::{
    CommitRequest, CreateVmRequest, ErrorCode, ForkRequest, ListQuery, TagsPatch, VmState,
};
use tine_testbed::{Failed, Trial};

/// Create, exec (codes, stdin, env), files, tags, health, logs, shutdown,
/// relaunch with the disk kept, delete.
fn lifecycle() -> R {
    let d = Daemon::start("life", "", None)?;
    let c = &d.client;
    rt().block_on(async {
        let t = Instant::now();
        let mut req = create_req(true);
        req.tags = vec!["role=web".into()];
        req.name = Some("web".into());
        let vm = c
            .create_vm("t", &req, Wait::Agent, Some(BOOT))
            .await
            .map_err(|e| fail(e.to_string()))?;
        println!(
            "create to agent-ready: {} ms (daemon said {} ms)",
            t.elapsed().as_millis(),
            vm.elapsed_ms
        );
        assert_eq!(vm.hostname, "t-1");
        assert_eq!(vm.state, VmState::Running);
        let h = &vm.hostname;
        assert_eq!(sh_ok(c, h, "hostname").await?.trim(), "t-1");
        assert_eq!(
            sh(c, h, "echo out; echo err >&2; exit 3").await?,
            (3, "out\n".into(), "err\n".into())
        );
        let mut o = ExecOptions::new("sh", ["-c", "echo $FOO; pwd"]);
        o.env = vec!["FOO=bar".into()];
        o.cwd = Some("/tmp".into());
        let out = c
            .exec_output("web", &o)
            .await
            .map_err(|e| fail(e.to_string()))?;
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "bar\n/tmp\n",
            "env, cwd and the friendly name"
        );
        let stdin = std::io::Cursor::new(b"piped input".to_vec());
        let mut stream = c
            .exec(
                h,
                &ExecOptions::new("cat", Vec::<String>::new()),
                Some(stdin),
            )
            .await
            .map_err(|e| fail(e.to_string()))?;
        let mut got = Vec::new();
        while let Some(f) = stream.next_frame().await {
            if let tine_proto::api::ExecFrame::Stdout { data, .. } =
                f.map_err(|e| fail(e.to_string()))?
            {
                got.extend(tine_client::api::decode_data(&data).map_err(|e| fail(e.to_string()))?);
            }
        }
        assert_eq!(got, b"piped input");
        let payload: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        c.cp_upload(
            h,
            "/root/blob",
            CpMode::Binary,
            &UploadOptions::default(),
            std::io::Cursor::new(payload.clone()),
        )
        .await
        .map_err(|e| fail(e.to_string()))?;
        let mut back = Vec::new();
        c.cp_download(h, "/root/blob", CpMode::Binary)
            .await
            .map_err(|e| fail(e.to_string()))?
            .copy_to(&mut back)
            .await
            .map_err(|e| fail(e.to_string()))?;
        assert_eq!(back, payload, "cp round trip");
        let tags = c
            .patch_tags(
                h,
                &TagsPatch {
                    add: vec!["env=ci".into()],
                    remove: vec!["role".into()],
                    replace: None,
                },
            )
            .await
            .map_err(|e| fail(e.to_string()))?;
        assert_eq!(
            tags.tags,
            vec!["env=ci".to_string(), "name=web".to_string()]
        );
        let by_tag = c
            .list_vms(
                None,
                &ListQuery {
                    tags: vec!["env=ci".into()],
                    tag_prefix: None,
                },
            )
            .await
            .map_err(|e| fail(e.to_string()))?;
        assert_eq!(by_tag.len(), 1);
        let health = c
            .health(h, Wait::None, None)
            .await
            .map_err(|e| fail(e.to_string()))?;
        assert!(health.agent_ready && health.system_uptime_ms > 0);
        let logs = c.logs(h, Some(50)).await.map_err(|e| fail(e.to_string()))?;
        assert!(
            logs.content.lines().any(|l| l.contains("vsock port 52")),
            "serial log: {:?}",
            logs.content
        );

        // Stop keeps the disk; relaunch boots it again with the file.
        let s = c
            .shutdown(h, ShutdownAction::Shutdown, None)
            .await
            .map_err(|e| fail(e.to_string()))?;
        assert_eq!(s.state, VmState::Stopped);
        let info = c.describe(h).await.map_err(|e| fail(e.to_string()))?;
        assert_eq!((info.state, info.pid), (VmState::Stopped, None));
        assert!(info.reason.is_some());
        expect_err(
            c.exec_output(h, &ExecOptions::new("true", Vec::<String>::new()))
                .await,
            ErrorCode::Conflict,
            "is stopped",
        )?;
        c.relaunch(h, Wait::Agent, Some(BOOT))
            .await
            .map_err(|e| fail(e.to_string()))?;
        assert_eq!(
            sh_ok(c, h, "md5sum < /root/blob | cut -c1-8").await?.len(),
            9
        );
        assert_eq!(
            c.describe(h)
                .await
                .map_err(|e| fail(e.to_string()))?
                .disk
                .format,
            "qcow2"
        );

        // An ephemeral VM vanishes with its disk when it stops.
        let eph = c
            .create_vm("t", &create_req(false), Wait::Agent, Some(BOOT))
            .await
            .map_err(|e| fail(e.to_string()))?;
        c.shutdown(&eph.hostname, ShutdownAction::Shutdown, None)
            .await
            .map_err(|e| fail(e.to_string()))?;
        expect_err(
            c.describe(&eph.hostname).await,
            ErrorCode::NotFound,
            "no VM",
        )?;
        assert!(
            !d.data().join("vms").join(&eph.hostname).exists(),
            "ephemeral folder removed"
        );

        c.delete(h).await.map_err(|e| fail(e.to_string()))?;
        expect_err(
            c.describe(h).await,
            ErrorCode::NotFound,
            "no VM called `t-1`",
        )?;
        assert!(!d.data().join("vms/t-1").exists(), "VM folder removed");
        Ok(())
    })
}

/// kill -9 of the daemon loses nothing; a VMM killed under it marks its VM
/// failed and the daemon lives on; a persistent VM whose process died
/// while the daemon was down is relaunched.
fn kill_nine() -> R {
    let mut d = Daemon::start("kill9", "", None)?;
    let r = rt();
    let (a, b) = r.block_on(async {
        let c = &d.client;
        let a = c
            .create_vm("t", &create_req(true), Wait::Agent, Some(BOOT))
            .await
            .map_err(|e| fail(e.to_string()))?;
        let b = c
            .create_vm("t", &create_req(false), Wait::Agent, Some(BOOT))
            .await
            .map_err(|e| fail(e.to_string()))?;
        sh_ok(c, &a.hostname, "echo kept > /root/marker; sync").await?;
        Ok::<_, Failed>((a.hostname, b.hostname))
    })?;
    let pid_a = d.vmm_pid(&a)?;
    let pid_b = d.vmm_pid(&b)?;
    d.kill9()?;
    std::thread::sleep(Duration::from_millis(300));
    assert!(alive(pid_a) && alive(pid_b), "VMs outlive the daemon");
    d.spawn()?;
    r.block_on(async {
        let c = &d.client;
        for h in [&a, &b] {
            let info = c.describe(h).await.map_err(|e| fail(e.to_string()))?;
            assert_eq!(info.state, VmState::Running, "{h} adopted");
        }
        assert_eq!(pid_of(c, &a).await?, pid_a, "same process");
        assert_eq!(sh_ok(c, &a, "cat /root/marker").await?, "kept\n");
        Ok::<_, Failed>(())
    })?;
    // A crashing VMM: the VM is failed with the reason, the daemon lives.
    Command::new("kill")
        .arg("-9")
        .arg(pid_b.to_string())
        .status()?;
    r.block_on(async {
        let c = &d.client;
        let start = Instant::now();
        loop {
            let info = c.describe(&b).await.map_err(|e| fail(e.to_string()))?;
            if info.state == VmState::Failed {
                let reason = info.reason.unwrap_or_default();
                assert!(
                    reason.contains("signal 9") || reason.contains("without a stop report"),
                    "reason: {reason}"
                );
                break;
            }
            if start.elapsed() > Duration::from_secs(20) {
                return Err(fail(format!("{b} still {:?}", info.state)));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        c.healthz().await.map_err(|e| fail(e.to_string()))?;
        Ok(())
    })?;
    // The persistent VM's process dies while the daemon is down: the next
    // start relaunches it from its disk.
    d.kill9()?;
    Command::new("kill")
        .arg("-9")
        .arg(pid_a.to_string())
        .status()?;
    std::thread::sleep(Duration::from_millis(300));
    d.spawn()?;
    r.block_on(async {
        let c = &d.client;
        c.health(&a, Wait::Agent, Some(BOOT))
            .await
            .map_err(|e| fail(e.to_string()))?;
        assert_ne!(pid_of(c, &a).await?, pid_a);
        assert_eq!(
            sh_ok(c, &a, "cat /root/marker").await?,
            "kept\n",
            "disk kept across the relaunch"
        );
        Ok(())
    })
}

/// 20 creates at once get 20 distinct VMs; 20 deletes leave nothing.
fn concurrent_creates() -> R {
    let d = Daemon::start("conc", "", None)?;
    rt().block_on(async {
        let c = &d.client;
        let mut tasks = Vec::new();
        for _ in 0..20 {
            let c = c.clone();
            tasks.push(tokio::spawn(async move {
                let req = CreateVmRequest {
                    ram_bytes: Some(128 << 20),
                    persistent: Some(false),
                    ..CreateVmRequest::default()
                };
                c.create_vm("t", &req, Wait::None, None).await
            }));
        }
        let mut names = std::collections::BTreeSet::new();
        for t in tasks {
            let r = t
                .await
                .map_err(|e| fail(e.to_string()))?
                .map_err(|e| fail(e.to_string()))?;
            names.insert(r.hostname);
        }
        assert_eq!(names.len(), 20, "{names:?}");
        let list = c
            .list_vms(Some("t"), &ListQuery::default())
            .await
            .map_err(|e| fail(e.to_string()))?;
        let failed: Vec<_> = list
            .iter()
            .filter(|v| v.state == VmState::Failed)
            .map(|v| format!("{}: {}", v.hostname, v.reason.clone().unwrap_or_default()))
            .collect();
        assert!(failed.is_empty(), "failed to start: {failed:?}");
        assert_eq!(list.len(), 20);
        let mut tasks = Vec::new();
        for h in names {
            let c = c.clone();
            tasks.push(tokio::spawn(async move { c.delete(&h).await }));
        }
        for t in tasks {
            t.await
                .map_err(|e| fail(e.to_string()))?
                .map_err(|e| fail(e.to_string()))?;
        }
        let list = c
            .list_vms(None, &ListQuery::default())
            .await
            .map_err(|e| fail(e.to_string()))?;
        assert!(list.is_empty(), "{list:?}");
        let left: Vec<_> = std::fs::read_dir(d.data().join("vms"))?.collect();
        assert!(left.is_empty(), "VM folders left: {left:?}");
        assert!(tine_daemon::process::find_vmm_processes(&d.data()).is_empty());
        Ok(())
    })
}

/// Bad input gets a 4xx naming the problem and changes nothing.
fn bad_input() -> R {
    let port = 18000 + (std::process::id() % 1000) as u16;
    let bind = format!("127.0.0.1:{port}");
    let d = Daemon::start("bad", "", Some(&bind))?;
    let r = rt();
    r.block_on(async {
        let c = &d.client;
        let before = c
            .list_vms(None, &ListQuery::default())
            .await
            .map_err(|e| fail(e.to_string()))?;
        expect_err(
            c.create_vm("nope", &create_req(true), Wait::None, None)
                .await,
            ErrorCode::NotFound,
            "no host group `nope`",
        )?;
        let big = CreateVmRequest {
            ram_bytes: Some(4 << 30),
            ..CreateVmRequest::default()
        };
        expect_err(
            c.create_vm("t", &big, Wait::None, None).await,
            ErrorCode::BadRequest,
            "ram_bytes",
        )?;
        let cpus = CreateVmRequest {
            cpus: Some(9),
            ..CreateVmRequest::default()
        };
        expect_err(
            c.create_vm("t", &cpus, Wait::None, None).await,
            ErrorCode::BadRequest,
            "cpus 9",
        )?;
        let tag = CreateVmRequest {
            tags: vec!["a b".into()],
            ..CreateVmRequest::default()
        };
        expect_err(
            c.create_vm("t", &tag, Wait::None, None).await,
            ErrorCode::BadRequest,
            "tag `a b`",
        )?;
        expect_err(
            c.describe("t-99").await,
            ErrorCode::NotFound,
            "no VM called `t-99`",
        )?;
        expect_err(
            c.exec_output("t-99", &ExecOptions::new("true", Vec::<String>::new()))
                .await,
            ErrorCode::NotFound,
            "t-99",
        )?;
        expect_err(c.delete("t-99").await, ErrorCode::NotFound, "t-99")?;
        expect_err(
            c.fork(
                "cmt-t-0000000000000000",
                &ForkRequest::default(),
                Wait::None,
                None,
            )
            .await,
            ErrorCode::NotFound,
            "no commit",
        )?;
        let after = c
            .list_vms(None, &ListQuery::default())
            .await
            .map_err(|e| fail(e.to_string()))?;
        assert_eq!(before, after, "no state change");
        Ok::<_, Failed>(())
    })?;
    // Raw HTTP for what a typed client cannot send.
    let sock = d.data().join("tine.sock");
    let curl = |args: &[&str]| -> R<String> {
        let out = Command::new("curl").arg("-sS").args(args).output()?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let s = sock.display().to_string();
    let body = curl(&[
        "--unix-socket",
        &s,
        "-X",
        "POST",
        "http://x/hostgroup/t/nodes",
        "-d",
        "{bad",
    ])?;
    assert!(
        body.contains("malformed JSON body") && body.contains("bad_request"),
        "{body}"
    );
    let body = curl(&[
        "--unix-socket",
        &s,
        "-X",
        "POST",
        "http://x/hostgroup/t/nodes",
        "-d",
        "{\"cpu\":1}",
    ])?;
    assert!(body.contains("unknown field `cpu`"), "{body}");
    let body = curl(&["--unix-socket", &s, "http://x/no/such/route"])?;
    assert!(
        body.contains("not_found") && body.contains("/no/such/route"),
        "{body}"
    );
    // TCP needs the token.
    let url = format!("http://{bind}/info");
    let body = curl(&[&url])?;
    assert!(
        body.contains("missing bearer token") && body.contains("unauthorized"),
        "{body}"
    );
    let body = curl(&["-H", "Authorization: Bearer wrong", &url])?;
    assert!(body.contains("wrong bearer token"), "{body}");
    let token = std::fs::read_to_string(d.data().join("auth/token"))?;
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(d.data().join("auth/token"))?.permissions(),
    );
    assert_eq!(mode & 0o777, 0o600, "token file mode");
    let tcp = TineClient::new(&format!("http://{bind}"), Some(token.trim().to_owned()))
        .map_err(|e| fail(e.to_string()))?;
    let info = r.block_on(tcp.info()).map_err(|e| fail(e.to_string()))?;
    assert_eq!(info.host_groups, vec!["t".to_string()]);
    // A second daemon on the same data directory is refused.
    let out = d.spawn_raw()?.wait_with_output()?;
    assert!(!out.status.success());
    let log = std::fs::read_to_string(d.dir.join("daemon.log"))?;
    assert!(log.contains("another tine daemon (pid"), "{log}");
    r.block_on(d.client.healthz())
        .map_err(|e| fail(format!("first daemon still serves: {e}")))?;
    // Bad config files are refused before anything starts.
    let bad = d.dir.join("bad.yaml");
    std::fs::write(&bad, "host_groups:\n  - name: t\n    ram_mb: 1\n")?;
    let out = Command::new(std::env::current_exe()?)
        .env(DAEMON_CONFIG_ENV, &bad)
        .output()?;
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("host_groups[0].ram_mb"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Build once, commit with a cache key, fork three independent runners.
fn commit_and_fork() -> R {
    let mut d = Daemon::start("fork", "", None)?;
    let r = rt();
    let (builder, commit) = r.block_on(async {
        let c = &d.client;
        let b = c
            .create_vm("t", &create_req(true), Wait::Agent, Some(BOOT))
            .await
            .map_err(|e| fail(e.to_string()))?;
        let h = b.hostname;
        sh_ok(
            c,
            &h,
            // No sync: the graceful shutdown below must keep it.
            "mkdir -p /opt/cache && echo built > /opt/cache/artifact",
        )
        .await?;
        expect_err(
            c.commit(&h, &CommitRequest::default()).await,
            ErrorCode::Conflict,
            "shut it down first",
        )?;
        c.shutdown(&h, ShutdownAction::Shutdown, None)
            .await
            .map_err(|e| fail(e.to_string()))?;
        let t = Instant::now();
        let commit = c
            .commit(
                &h,
                &CommitRequest {
                    tags: vec!["seed".into()],
                    cache_key: Some("deps-v1".into()),
                    ..CommitRequest::default()
                },
            )
            .await
            .map_err(|e| fail(e.to_string()))?;
        println!(
            "commit: {} ms (daemon {} ms)",
            t.elapsed().as_millis(),
            commit.elapsed_ms
        );
        assert!(
            commit.commit_id.starts_with("cmt-t-") && commit.commit_id.len() == "cmt-t-".len() + 16,
            "{}",
            commit.commit_id
        );
        assert_eq!(
            (commit.status.as_str(), commit.mode.as_str()),
            ("committed", "disk")
        );
        expect_err(
            c.commit(&h, &CommitRequest::default()).await,
            ErrorCode::Conflict,
            "already committed",
        )?;
        let found = c
            .list_commits(&CommitQuery {
                cache_key: Some("deps-v1".into()),
                ..CommitQuery::default()
            })
            .await
            .map_err(|e| fail(e.to_string()))?;
        assert_eq!(found.len(), 1);
        assert!(c
            .list_commits(&CommitQuery {
                cache_key: Some("other".into()),
                ..CommitQuery::default()
            })
            .await
            .map_err(|e| fail(e.to_string()))?
            .is_empty());
        let info = c.describe(&h).await.map_err(|e| fail(e.to_string()))?;
        assert_eq!(info.commit_id.as_deref(), Some(commit.commit_id.as_str()));
        Ok::<_, Failed>((h, commit.commit_id))
    })?;
    // A daemon restart between commit and fork changes nothing.
    d.kill9()?;
    d.spawn()?;
    let forks = r.block_on(async {
        let c = &d.client;
        let mut forks = Vec::new();
        for i in 0..3 {
            let t = Instant::now();
            let f = c
                .fork(
                    &commit,
                    &ForkRequest {
                        tags: Some(vec![format!("runner={i}")]),
                        ..ForkRequest::default()
                    },
                    Wait::Agent,
                    Some(BOOT),
                )
                .await
                .map_err(|e| fail(e.to_string()))?;
            println!(
                "fork {} to agent-ready: {} ms",
                f.hostname,
                t.elapsed().as_millis()
            );
            assert_eq!(
                (f.status.as_str(), f.source_hostname.as_str()),
                ("forked", builder.as_str())
            );
            forks.push(f.hostname);
        }
        let mut ids = std::collections::BTreeSet::new();
        for (i, f) in forks.iter().enumerate() {
            assert_eq!(
                sh_ok(c, f, "cat /opt/cache/artifact").await?,
                "built\n",
                "inherited"
            );
            assert_eq!(sh_ok(c, f, "hostname").await?.trim(), f.as_str());
            ids.insert(sh_ok(c, f, "cat /etc/machine-id").await?);
            sh_ok(c, f, &format!("echo fork{i} > /opt/cache/mine; sync")).await?;
            let info = c.describe(f).await.map_err(|e| fail(e.to_string()))?;
            assert_eq!(info.parent_commit_id.as_deref(), Some(commit.as_str()));
        }
        assert_eq!(ids.len(), 3, "machine-ids differ");
        for (i, f) in forks.iter().enumerate() {
            assert_eq!(
                sh_ok(c, f, "cat /opt/cache/mine").await?,
                format!("fork{i}\n"),
                "writes stay in their fork"
            );
        }
        // The delete guard names who depends on the commit.
        expect_err(
            c.delete_commit(&commit).await,
            ErrorCode::Conflict,
            &forks[0],
        )?;
        Ok::<_, Failed>(forks)
    })?;
    // A corrupted commit fails clearly; other commits still fork.
    r.block_on(async {
        let c = &d.client;
        let f0 = &forks[0];
        c.shutdown(f0, ShutdownAction::Shutdown, None)
            .await
            .map_err(|e| fail(e.to_string()))?;
        let second = c
            .commit(f0, &CommitRequest::default())
            .await
            .map_err(|e| fail(e.to_string()))?;
        assert_eq!(
            second.parent_commit_id.as_deref(),
            Some(commit.as_str()),
            "lineage"
        );
        let path = d
            .data()
            .join("commits")
            .join(format!("{}.qcow2", second.commit_id));
        let mut perms = std::fs::metadata(&path)?.permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o644);
        std::fs::set_permissions(&path, perms)?;
        let f = std::fs::OpenOptions::new().write(true).open(&path)?;
        std::os::unix::fs::FileExt::write_at(&f, &[0u8; 64], 0)?;
        drop(f);
        expect_err(
            c.fork(
                &second.commit_id,
                &ForkRequest::default(),
                Wait::Agent,
                Some(BOOT),
            )
            .await,
            ErrorCode::Internal,
            "corrupt",
        )?;
        let n = c
            .list_vms(None, &ListQuery::default())
            .await
            .map_err(|e| fail(e.to_string()))?
            .len();
        assert_eq!(n, 4, "the failed fork left nothing");
        // An --rm fork vanishes with its disk when it stops.
        let rm = c
            .fork(
                &commit,
                &ForkRequest {
                    persistent: Some(false),
                    ..ForkRequest::default()
                },
                Wait::Agent,
                Some(BOOT),
            )
            .await
            .map_err(|e| fail(e.to_string()))?;
        c.shutdown(&rm.hostname, ShutdownAction::Shutdown, None)
            .await
            .map_err(|e| fail(e.to_string()))?;
        expect_err(c.describe(&rm.hostname).await, ErrorCode::NotFound, "no VM")?;
        // Delete everything that depends on the first commit, then it.
        for h in forks.iter().chain([&builder]) {
            c.delete(h).await.map_err(|e| fail(e.to_string()))?;
        }
        expect_err(
            c.delete_commit(&commit).await,
            ErrorCode::Conflict,
            &second.commit_id,
        )?;
        c.delete_commit(&second.commit_id)
            .await
            .map_err(|e| fail(e.to_string()))?;
        c.delete_commit(&commit)
            .await
            .map_err(|e| fail(e.to_string()))?;
        assert!(c
            .list_commits(&CommitQuery::default())
            .await
            .map_err(|e| fail(e.to_string()))?
            .is_empty());
        assert_eq!(
            std::fs::read_dir(d.data().join("commits"))?.count(),
            0,
            "commit files removed"
        );
        Ok(())
    })
}

/// Secrets and SSH keys in a real guest: a VM granted two secrets holds
/// them in `/run/tine/secrets` (a tmpfs) with their modes and owners, a
/// changed secret reaches it while it runs, its keys are in root's
/// `authorized_keys`; its commit holds no secret file, a fork inherits the
/// grants, a fork with `no_secrets` holds none.
fn secrets_and_ssh_keys() -> R {
    use base64::Engine as _;
    use tine_proto::api::{CreateSecretRequest, UpdateSecretRequest};
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let d = Daemon::start("secrets", "", None)?;
    let r = rt();
    r.block_on(async {
        let c = &d.client;
        for (name, value, mode, uid) in [("db", "hunter2", "0400", 1000), ("api", "k1", "0640", 0)]
        {
            c.create_secret(&CreateSecretRequest {
                name: name.into(),
                data: b64(value),
                permissions: Some(mode.into()),
                uid: Some(uid),
                gid: Some(uid),
            })
            .await
            .map_err(|e| fail(e.to_string()))?;
        }
        let key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBedTestKey tester@bed";
        let req = CreateVmRequest {
            secrets: vec!["db".into(), "api".into()],
            ssh_keys: vec![key.into()],
            ..create_req(true)
        };
        let h = c
            .create_vm("t", &req, Wait::Agent, Some(BOOT))
            .await
            .map_err(|e| fail(e.to_string()))?
            .hostname;
        let dir = "/run/tine/secrets";
        assert_eq!(
            sh_ok(
                c,
                &h,
                &format!("cd {dir} && stat -c '%n %a %u %g' * | sort")
            )
            .await?,
            "api 640 0 0\ndb 400 1000 1000\n"
        );
        assert_eq!(sh_ok(c, &h, &format!("cat {dir}/db")).await?, "hunter2");
        assert_eq!(
            sh_ok(c, &h, &format!("stat -f -c %t {dir}")).await?,
            "1021994\n",
            "secrets live on a tmpfs (TMPFS_MAGIC), never on the disk"
        );
        assert_eq!(sh_ok(c, &h, "cat /run/slicer/secrets/api").await?, "k1");
        assert_eq!(
            sh_ok(
                c,
                &h,
                "cat /root/.ssh/authorized_keys; stat -c %a /root/.ssh/authorized_keys"
            )
            .await?,
            format!("{key}\n600\n")
        );
        // A change reaches the running guest.
        c.update_secret(
            "db",
            &UpdateSecretRequest {
                data: Some(b64("swordfish")),
                ..UpdateSecretRequest::default()
            },
        )
        .await
        .map_err(|e| fail(e.to_string()))?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if sh_ok(c, &h, &format!("cat {dir}/db")).await? == "swordfish" {
                break;
            }
            if Instant::now() > deadline {
                return Err(fail("the changed secret never reached the guest"));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        c.shutdown(&h, ShutdownAction::Shutdown, None)
            .await
            .map_err(|e| fail(e.to_string()))?;
        let commit = c
            .commit(&h, &CommitRequest::default())
            .await
            .map_err(|e| fail(e.to_string()))?
            .commit_id;
        let inherit = c
            .fork(&commit, &ForkRequest::default(), Wait::Agent, Some(BOOT))
            .await
            .map_err(|e| fail(e.to_string()))?
            .hostname;
        assert_eq!(
            sh_ok(c, &inherit, &format!("ls {dir}")).await?,
            "api\ndb\n",
            "a fork keeps its source's grants"
        );
        assert_eq!(
            sh_ok(c, &inherit, &format!("cat {dir}/db")).await?,
            "swordfish"
        );
        assert_eq!(
            sh_ok(c, &inherit, "cat /root/.ssh/authorized_keys").await?,
            format!("{key}\n"),
            "the source's keys came with its disk, once"
        );
        let cleared = c
            .fork(
                &commit,
                &ForkRequest {
                    no_secrets: true,
                    ..ForkRequest::default()
                },
                Wait::Agent,
                Some(BOOT),
            )
            .await
            .map_err(|e| fail(e.to_string()))?
            .hostname;
        assert_eq!(
            sh_ok(c, &cleared, &format!("ls -A {dir} | wc -l"))
                .await?
                .trim(),
            "0",
            "no_secrets leaves no secret file"
        );
        // Deleting a secret removes it from the running VMs granted it.
        c.delete_secret("api")
            .await
            .map_err(|e| fail(e.to_string()))?;
        let deadline = Instant::now() + Duration::from_secs(60);
        while sh(c, &inherit, &format!("test -e {dir}/api")).await?.0 == 0 {
            if Instant::now() > deadline {
                return Err(fail("a deleted secret stayed in a running guest"));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        for vm in [&inherit, &cleared, &h] {
            c.delete(vm).await.map_err(|e| fail(e.to_string()))?;
        }
        Ok(())
    })
}

/// One HTTP/1.1 exchange on the daemon's socket, bytes as Slicer's SDKs
/// send them: status, content type and the body (chunked bodies decoded).
async fn wire(
    d: &Daemon,
    method: &str,
    path: &str,
    body: Option<(&str, &[u8])>,
) -> R<(u16, String, Vec<u8>)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut sock = tokio::net::UnixStream::connect(d.data().join("tine.sock")).await?;
    let mut req = format!("{method} {path} HTTP/1.1\r\nhost: tine\r\nconnection: close\r\n");
    if let Some((content_type, bytes)) = body {
        req.push_str(&format!(
            "content-type: {content_type}\r\ncontent-length: {}\r\n",
            bytes.len()
        ));
    }
    req.push_str("\r\n");
    sock.write_all(req.as_bytes()).await?;
    if let Some((_, bytes)) = body {
        sock.write_all(bytes).await?;
    }
    let mut raw = Vec::new();
    sock.read_to_end(&mut raw).await?;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| fail(format!("{method} {path}: no header end")))?;
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let mut rest = &raw[split + 4..];
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| fail(format!("{method} {path}: no status in {head}")))?;
    let header = |name: &str| {
        head.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")).map(str::to_owned))
            .unwrap_or_default()
    };
    let body = if header("transfer-encoding") == "chunked" {
        let mut out = Vec::new();
        loop {
            let eol = rest
                .windows(2)
                .position(|w| w == b"\r\n")
                .ok_or_else(|| fail("chunk size line"))?;
            let size = usize::from_str_radix(String::from_utf8_lossy(&rest[..eol]).trim(), 16)
                .map_err(|e| fail(format!("chunk size: {e}")))?;
            rest = &rest[eol + 2..];
            if size == 0 {
                break;
            }
            out.extend_from_slice(&rest[..size]);
            rest = &rest[size + 2..];
        }
        out
    } else {
        rest.to_vec()
    };
    Ok((status, header("content-type"), body))
}

/// [`wire`] with a JSON body, answering JSON.
async fn wire_json(
    d: &Daemon,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
    want: u16,
) -> R<serde_json::Value> {
    let bytes = body.map(|b| b.to_string().into_bytes());
    let (status, _, answer) = wire(
        d,
        method,
        path,
        bytes.as_deref().map(|b| ("application/json", b)),
    )
    .await?;
    let text = String::from_utf8_lossy(&answer).into_owned();
    if status != want {
        return Err(fail(format!(
            "{method} {path}: {status} (want {want}): {text}"
        )));
    }
    serde_json::from_str(&text).map_err(|e| fail(format!("{method} {path}: {e}: {text}")))
}

/// The build-once-fork-many flow as Slicer's Go and TypeScript SDKs drive
/// it, request by request on the wire, against booted guests: create, exec
/// streamed and buffered, cp in and out, shutdown, commit with tags, labels
/// and a cache key, list by cache key and by two tags, fork with tags,
/// describe, exec in the fork, the refused commit delete, deletes.
fn sdk_flow() -> R {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    let d = Daemon::start("sdkflow", "", None)?;
    let r = rt();
    r.block_on(async {
        // CreateVMWithOptions(..., Wait agent) / TS vms.create.
        let vm = wire_json(
            &d,
            "POST",
            "/hostgroup/t/nodes?wait=agent&timeout=300s",
            Some(serde_json::json!({"persistent": true, "tags": ["role=builder"]})),
            201,
        )
        .await?;
        let h = vm["hostname"].as_str().ok_or_else(|| fail("hostname"))?.to_owned();
        assert!(vm["ip"].is_string(), "{vm}");
        assert!(vm["created_at"].is_string(), "{vm}");
        // Exec (Go: stdio=base64, NDJSON frames, exit_code).
        let (status, kind, body) = wire(
            &d,
            "POST",
            &format!("/vm/{h}/exec?cmd=sh&args=-c&args=echo%20out%3B%20echo%20err%20%3E%262&stdio=base64&uid=0&gid=0"),
            None,
        )
        .await?;
        assert_eq!((status, kind.as_str()), (200, "application/x-ndjson"));
        let (mut out, mut err, mut code) = (Vec::new(), Vec::new(), None);
        for line in String::from_utf8_lossy(&body).lines() {
            let f: serde_json::Value = serde_json::from_str(line)?;
            let data = || {
                assert_eq!(f["encoding"], "base64", "{f}");
                b64.decode(f["data"].as_str().unwrap_or_default())
            };
            match f["type"].as_str() {
                Some("stdout") => out.extend(data()?),
                Some("stderr") => err.extend(data()?),
                Some("exit") => code = f["exit_code"].as_i64(),
                _ => {}
            }
        }
        assert_eq!((out.as_slice(), err.as_slice(), code), (&b"out\n"[..], &b"err\n"[..], Some(0)));
        // ExecBuffered / TS execBuffered.
        let b = wire_json(
            &d,
            "POST",
            &format!("/vm/{h}/exec?cmd=sh&args=-c&args=printf%20done%3B%20exit%204&buffered=true"),
            None,
            200,
        )
        .await?;
        assert_eq!((b["stdout"].as_str(), b["exit_code"].as_i64()), (Some("done"), Some(4)));
        // WriteFile / CpToVM binary, then ReadFile / CpFromVM.
        let payload = b"built by the sdk\n";
        let (status, _, answer) = wire(
            &d,
            "POST",
            &format!("/vm/{h}/cp?path=%2Froot%2Fartifact&mode=binary&uid=0&gid=0&permissions=0640"),
            Some(("application/octet-stream", payload)),
        )
        .await?;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
        let (status, _, back) = wire(&d, "GET", &format!("/vm/{h}/cp?path=%2Froot%2Fartifact"), None).await?;
        assert_eq!((status, back.as_slice()), (200, &payload[..]));
        // Shutdown(ctx, h, nil): action=reboot is the graceful stop.
        wire_json(&d, "POST", &format!("/vm/{h}/shutdown?action=reboot"), None, 200).await?;
        // CommitVMWithOptions: 200.
        let c = wire_json(
            &d,
            "POST",
            &format!("/vm/{h}/commit"),
            Some(serde_json::json!({"tags": ["seed", "v1"], "labels": {"team": "ci"}, "cache_key": "sdk-flow"})),
            200,
        )
        .await?;
        let id = c["commit_id"].as_str().ok_or_else(|| fail("commit_id"))?.to_owned();
        assert_eq!(c["source_hostname"], h.as_str());
        // ListCommits by cache key, and by two tags (both must match).
        let by_key = wire_json(&d, "GET", "/vm/commits?cache_key=sdk-flow", None, 200).await?;
        assert_eq!(by_key.as_array().map(Vec::len), Some(1), "{by_key}");
        let both = wire_json(&d, "GET", "/vm/commits?tag=seed&tag=v1", None, 200).await?;
        assert_eq!(both.as_array().map(Vec::len), Some(1), "{both}");
        let none = wire_json(&d, "GET", "/vm/commits?tag=seed&tag=other", None, 200).await?;
        assert_eq!(none.as_array().map(Vec::len), Some(0), "{none}");
        // ForkCommittedVM(id, WithTags("role=runner")): 200.
        let f = wire_json(
            &d,
            "POST",
            &format!("/vm/commits/{id}/fork?wait=agent&timeout=300s"),
            Some(serde_json::json!({"tags": ["role=runner"]})),
            200,
        )
        .await?;
        let fork = f["hostname"].as_str().ok_or_else(|| fail("fork hostname"))?.to_owned();
        // DescribeVM.
        let v = wire_json(&d, "GET", &format!("/vm/{fork}"), None, 200).await?;
        assert_eq!((v["hostgroup"].as_str(), v["status"].as_str()), (Some("t"), Some("Running")), "{v}");
        let tags: Vec<&str> = v["tags"].as_array().into_iter().flatten().filter_map(|t| t.as_str()).collect();
        assert_eq!(tags, ["role=builder", "role=runner"], "{v}");
        assert_eq!(v["parent_commit_id"], id.as_str());
        // Exec in the fork: the builder's file is there.
        let b = wire_json(&d, "POST", &format!("/vm/{fork}/exec?cmd=cat&args=%2Froot%2Fartifact&buffered=true"), None, 200).await?;
        assert_eq!(b["stdout"].as_str(), Some("built by the sdk\n"));
        // DeleteCommit while the fork depends on it: refused, naming it.
        let (status, _, answer) = wire(&d, "DELETE", &format!("/vm/commits/{id}"), None).await?;
        assert_eq!(status, 409);
        assert!(String::from_utf8_lossy(&answer).contains(&fork));
        // DeleteVM (Go: by group), then the commit.
        wire_json(&d, "DELETE", &format!("/hostgroup/t/nodes/{fork}"), None, 200).await?;
        wire_json(&d, "DELETE", &format!("/vm/{h}"), None, 200).await?;
        wire_json(&d, "DELETE", &format!("/vm/commits/{id}"), None, 200).await?;
        let left = wire_json(&d, "GET", "/nodes", None, 200).await?;
        assert_eq!(left.as_array().map(Vec::len), Some(0), "{left}");
        Ok(())
    })
}

/// A commit that runs out of disk space records nothing; after space is
/// freed the same VM commits.
fn commit_on_a_full_disk() -> R {
    let d = Daemon::start("full", "", None)?;
    let r = rt();
    let h = r.block_on(async {
        let c = &d.client;
        let b = c
            .create_vm("t", &create_req(true), Wait::Agent, Some(BOOT))
            .await
            .map_err(|e| fail(e.to_string()))?;
        c.shutdown(&b.hostname, ShutdownAction::Shutdown, None)
            .await
            .map_err(|e| fail(e.to_string()))?;
        Ok::<_, Failed>(b.hostname)
    })?;
    // Fill the data directory's filesystem (a tmpfs in the bed) completely.
    let filler = d.data().join("filler");
    let _ = Command::new("dd")
        .arg("if=/dev/zero")
        .arg(format!("of={}", filler.display()))
        .arg("bs=1M")
        .stderr(Stdio::null())
        .status()?;
    let _ = Command::new("dd")
        .arg("if=/dev/zero")
        .arg(format!("of={}.2", filler.display()))
        .arg("bs=4k")
        .stderr(Stdio::null())
        .status()?;
    r.block_on(async {
        let c = &d.client;
        let e = c
            .commit(
                &h,
                &CommitRequest {
                    cache_key: Some("k".into()),
                    ..CommitRequest::default()
                },
            )
            .await;
        let _ = std::fs::remove_file(&filler);
        let _ = std::fs::remove_file(filler.with_extension("2"));
        let _ = std::fs::remove_file(format!("{}.2", filler.display()));
        match e {
            Ok(v) => return Err(fail(format!("commit on a full disk succeeded: {v:?}"))),
            Err(e) => {
                println!("full disk: {e}");
                assert!(
                    e.to_string().contains("space") || e.to_string().contains("full"),
                    "{e}"
                );
            }
        }
        assert!(
            c.list_commits(&CommitQuery::default())
                .await
                .map_err(|e| fail(e.to_string()))?
                .is_empty(),
            "no half commit"
        );
        assert_eq!(
            std::fs::read_dir(d.data().join("commits"))
                .map(|r| r.count())
                .unwrap_or(0),
            0
        );
        let ok = c
            .commit(
                &h,
                &CommitRequest {
                    cache_key: Some("k".into()),
                    ..CommitRequest::default()
                },
            )
            .await
            .map_err(|e| fail(e.to_string()))?;
        c.relaunch(&h, Wait::Agent, Some(BOOT))
            .await
            .map_err(|e| fail(e.to_string()))?;
        assert_eq!(
            c.describe(&h)
                .await
                .map_err(|e| fail(e.to_string()))?
                .commit_id,
            Some(ok.commit_id)
        );
        Ok(())
    })
}

/// Stats and the file watch of a booted guest: the figures its agent
/// reads, the host's of its VMM, and inotify events from the guest.
fn observe() -> R {
    use tine_client::api::WatchOptions;
    use tine_proto::api::FsEventType;
    let d = Daemon::start("observe", "", None)?;
    let c = &d.client;
    rt().block_on(async {
        let vm = c
            .create_vm("t", &create_req(true), Wait::Agent, Some(BOOT))
            .await
            .map_err(|e| fail(e.to_string()))?;
        let h = &vm.hostname;
        // Some work, so the counters have something to count.
        sh_ok(c, h, "dd if=/dev/zero of=/root/blob bs=1M count=8 && sync").await?;
        let stats = c.stats(Some(h)).await.map_err(|e| fail(e.to_string()))?;
        let s = &stats[0];
        println!("{}", serde_json::to_string(s).unwrap_or_default());
        let snap = s
            .snapshot
            .as_ref()
            .ok_or_else(|| fail(format!("no snapshot: {}", s.error)))?;
        assert_eq!(snap.total_cpus, 1, "the group's one vCPU");
        assert!(
            snap.total_memory > 128 << 20 && snap.total_memory <= 256 << 20,
            "{snap:?}"
        );
        assert!(snap.memory_used > 0 && snap.memory_used < snap.total_memory);
        assert!(
            snap.disk_space_total > 0 && snap.disk_space_used >= 8 << 20,
            "{snap:?}"
        );
        assert!(snap.disk_write_total >= (8u64 << 20) as f64, "{snap:?}");
        assert!(snap.open_files > 0 && snap.uptime_ms > 0);
        let host = &s.host;
        assert_eq!(host.vmm_pid, Some(pid_of(c, h).await?));
        let (rss, pss, uss) = (
            host.rss_bytes.unwrap_or(0),
            host.pss_bytes.unwrap_or(0),
            host.uss_bytes.unwrap_or(0),
        );
        assert!(
            rss > 0 && pss > 0 && uss > 0 && uss <= pss && pss <= rss,
            "{host:?}"
        );
        assert!(host.cpu_user_ms.unwrap_or(0) + host.cpu_system_ms.unwrap_or(0) > 0);
        assert!(host.disk.allocated_bytes >= 8 << 20, "{host:?}");

        // A recursive watch in the guest sees a directory and a file made
        // by an exec there.
        let options = WatchOptions {
            paths: vec!["/root".into()],
            recursive: true,
            events: vec![FsEventType::Create],
            max_events: Some(2),
            ..WatchOptions::default()
        };
        let mut events = c
            .fs_watch(h, &options)
            .await
            .map_err(|e| fail(e.to_string()))?;
        sh_ok(c, h, "mkdir /root/w && echo hi > /root/w/f").await?;
        let mut paths = Vec::new();
        while let Some(e) = tokio::time::timeout(Duration::from_secs(30), events.next_event())
            .await
            .map_err(|_| fail(format!("no more events after {paths:?}")))?
        {
            paths.push(e.map_err(|e| fail(e.to_string()))?.path);
        }
        assert_eq!(paths, ["/root/w", "/root/w/f"]);
        // Stopped: no snapshot, and why.
        c.shutdown(h, ShutdownAction::Shutdown, None)
            .await
            .map_err(|e| fail(e.to_string()))?;
        let all = c.stats(None).await.map_err(|e| fail(e.to_string()))?;
        let stopped = all
            .iter()
            .find(|s| &s.hostname == h)
            .ok_or_else(|| fail(format!("{h} is not listed: {all:?}")))?;
        assert!(stopped.snapshot.is_none(), "{stopped:?}");
        assert_eq!(stopped.error, format!("{h} is stopped"));
        Ok(())
    })
}

fn main() {
    bed_main(
        "daemon api test",
        vec![
            Trial::test("bad_input", bad_input),
            Trial::test("lifecycle", lifecycle),
            Trial::test("kill_nine", kill_nine),
            Trial::test("concurrent_creates", concurrent_creates),
            Trial::test("commit_and_fork", commit_and_fork),
            Trial::test("commit_on_a_full_disk", commit_on_a_full_disk),
            Trial::test("secrets_and_ssh_keys", secrets_and_ssh_keys),
            Trial::test("observe", observe),
            Trial::test("sdk_flow", sdk_flow),
        ],
    );
}
