//! The debian image (guest/rootfs/debian/build: Debian 12, systemd as init,
//! the agent as a service) through the real daemon, in the test bed. Debian
//! boots are slow in the nested bed, so the tests share few of them: one
//! builder boot and one fork boot carry most checks.

mod support;

use std::time::{Duration, Instant};

use support::*;
use tine_client::api::{ShutdownAction, TineClient, Wait};
use tine_proto::api::{
    CommitRequest, CreateSecretRequest, CreateVmRequest, ForkRequest, StopMode, VmState,
};
use tine_testbed::Trial;

/// Where the test finds the image (the daemon's lookup for `debian`).
const DEBIAN_ENV: &str = "TINE_IMAGE_DEBIAN";
/// systemd brings up more than the min image's init: a longer deadline.
const DEBIAN_BOOT: Duration = Duration::from_secs(600);
/// Fresh data written without `sync` right before the shutdown.
const BIG_BYTES: u64 = 64 << 20;
/// The group's disk, larger than the image's 2 GiB: the agent grows `/`.
const DISK: &str = "3G";

/// The debian group: a larger disk, and an isolated network (nothing is
/// reached; the guest's address, route and resolver are what is checked).
fn group() -> String {
    format!(
        "  - name: deb\n    image: debian\n    ram_mb: 768\n    max_ram_mb: 768\n    \
         storage_size: {DISK}\n    persistent: true\n    network:\n      mode: isolated\n      \
         cidr: 169.254.96.0/24\n      dns: [198.51.100.10]\n"
    )
}

/// First-boot userdata, run by the agent under systemd as under the min
/// image's init.
const USERDATA: &str = "#!/bin/sh\nid -u > /var/tmp/userdata-ran\n";

/// A package built in the guest, served from a local apt repository (no
/// network), and installed with apt-get: apt works end to end.
const APT_FROM_LOCAL_REPO: &str = r#"set -e
mkdir -p /srv/pkg/tine-hello/DEBIAN /srv/pkg/tine-hello/usr/bin /srv/repo
cat > /srv/pkg/tine-hello/DEBIAN/control <<EOF
Package: tine-hello
Version: 1.0
Architecture: all
Maintainer: tine tests <tests@example.invalid>
Description: a package from a local repository
EOF
printf '#!/bin/sh\necho hello from apt\n' > /srv/pkg/tine-hello/usr/bin/tine-hello
chmod 755 /srv/pkg/tine-hello/usr/bin/tine-hello
dpkg-deb --root-owner-group --build /srv/pkg/tine-hello /srv/repo/tine-hello_1.0_all.deb >/dev/null
cd /srv/repo
{
  dpkg-deb -f tine-hello_1.0_all.deb
  echo "Filename: ./tine-hello_1.0_all.deb"
  echo "Size: $(stat -c %s tine-hello_1.0_all.deb)"
  echo "SHA256: $(sha256sum tine-hello_1.0_all.deb | cut -d' ' -f1)"
  echo
} > Packages
echo 'deb [trusted=yes] file:/srv/repo ./' > /srv/repo.list
apt="-o Dir::Etc::SourceList=/srv/repo.list -o Dir::Etc::SourceParts=/nonexistent -qq"
apt-get $apt update
DEBIAN_FRONTEND=noninteractive apt-get $apt install -y tine-hello >/dev/null
tine-hello
"#;

/// Creates a VM in `group` and waits for its agent; prints the time to
/// agent-ready and how much of it the guest was up (the rest is host-side
/// work: the image's first import, the disk, the launch). Returns the VM
/// and the seconds to agent-ready.
async fn boot(c: &TineClient, group: &str, req: &CreateVmRequest) -> R<(String, f64)> {
    let t = Instant::now();
    let vm = c
        .create_vm(group, req, Wait::Agent, Some(DEBIAN_BOOT))
        .await
        .or_fail()?
        .hostname;
    let took = t.elapsed().as_secs_f64();
    let uptime = sh_ok(c, &vm, "cut -d' ' -f1 /proc/uptime").await?;
    println!(
        "{vm}: boot to agent-ready in {took:.1} s, guest up {} s of it (bed time)",
        uptime.trim()
    );
    Ok((vm, took))
}

/// Boots, runs Python, apt, git and sudo, uses the larger disk, installs a
/// package with apt and writes files without `sync`, shuts down at once,
/// commits and forks: the fork has everything, bit for bit, and its own
/// identity.
fn debian_builds_commits_and_forks() -> R {
    let d = Daemon::start("debian", &group(), None)?;
    let c = &d.client;
    rt().block_on(async {
        c.create_secret(&CreateSecretRequest {
            name: "token".into(),
            data: "c2VjcmV0LXZhbHVl".into(), // "secret-value"
            permissions: Some("0400".into()),
            uid: Some(1000),
            gid: Some(1000),
        })
        .await
        .or_fail()?;
        let req = CreateVmRequest {
            userdata: Some(USERDATA.into()),
            secrets: vec!["token".into()],
            ..create_req(true)
        };
        let (builder, debian_secs) = boot(c, "deb", &req).await?;
        // The min image in the same bed, for the ratio.
        let (min_vm, min_secs) = boot(c, "t", &create_req(false)).await?;
        println!(
            "boot to agent-ready: debian {debian_secs:.1} s, min {min_secs:.1} s, ratio {:.1}",
            debian_secs / min_secs
        );
        c.delete(&min_vm).await.or_fail()?;

        // Userdata, secrets and the network, set up by the agent as a
        // systemd service.
        let mut ran = String::new();
        for _ in 0..60 {
            ran = sh(c, &builder, "cat /var/tmp/userdata-ran").await?.1;
            if !ran.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        assert_eq!(ran.trim(), "0", "userdata ran once, as root");
        let secret = sh_ok(c, &builder, "stat -c '%a %u' /run/tine/secrets/token; cat /run/tine/secrets/token").await?;
        assert_eq!(secret, "400 1000\nsecret-value");
        let net = sh_ok(
            c,
            &builder,
            "ip -4 -o addr show dev eth0 | awk '{print $4}'; ip -4 route show default | awk '{print $3}'; \
             grep -c 198.51.100.10 /etc/resolv.conf",
        )
        .await?;
        let lines: Vec<&str> = net.lines().collect();
        if lines.len() != 3
            || !lines[0].starts_with("169.254.96.")
            || lines[1] != "169.254.96.1"
            || lines[2] == "0"
        {
            return Err(fail(format!(
                "eth0 under systemd: {net:?}; want an address in 169.254.96.0/24, the \
                 gateway 169.254.96.1 and the resolver 198.51.100.10"
            )));
        }
        let six_times_seven = sh_ok(c, &builder, "python3 -c 'print(6*7)'").await?;
        assert_eq!(six_times_seven.trim(), "42");
        let versions = sh_ok(c, &builder, "apt-get --version | head -1; git --version").await?;
        if !versions.contains("apt 2.") || !versions.contains("git version 2.") {
            return Err(fail(format!("apt and git say: {versions}")));
        }
        // The service is the agent, systemd is PID 1.
        let init = sh_ok(c, &builder, "cat /proc/1/comm; systemctl is-active tine-agent").await?;
        assert_eq!(init.split_whitespace().collect::<Vec<_>>(), ["systemd", "active"]);
        let sudo = sh_ok(c, &builder, "su tine -c 'sudo -n id -u'").await?;
        assert_eq!(sudo.trim(), "0", "the tine user has sudo");
        // 3 GiB disk, 2 GiB image: `/` was grown to the disk.
        let size_kib: u64 = sh_ok(c, &builder, "df -k --output=size / | tail -1")
            .await?
            .trim()
            .parse()
            .map_err(|e| fail(format!("df: {e}")))?;
        if size_kib < (5 << 20) / 2 {
            return Err(fail(format!(
                "/ is {size_kib} KiB on a {DISK} disk: not grown"
            )));
        }
        let hello = sh_ok(c, &builder, APT_FROM_LOCAL_REPO).await?;
        assert_eq!(hello.trim(), "hello from apt");

        let want = sh_ok(
            c,
            &builder,
            &format!(
                "printf '#!/bin/sh\\necho built\\n' > /usr/local/bin/built && \
                 chmod 755 /usr/local/bin/built && \
                 head -c {BIG_BYTES} /dev/urandom > /root/big && \
                 md5sum /usr/local/bin/built /root/big /usr/bin/tine-hello"
            ),
        )
        .await?;
        let identity = "hostname; cat /etc/machine-id";
        let builder_id = sh_ok(c, &builder, identity).await?;

        let t = Instant::now();
        let r = c
            .shutdown(&builder, ShutdownAction::Shutdown, None)
            .await
            .or_fail()?;
        println!(
            "{builder}: systemd shutdown in {:.1} s (bed time)",
            t.elapsed().as_secs_f64()
        );
        if r.stop_mode != Some(StopMode::Graceful) || r.state != VmState::Stopped {
            return Err(fail(format!("{builder}: shutdown answered {r:?}")));
        }
        let info = c.describe(&builder).await.or_fail()?;
        let reason = info.reason.unwrap_or_default();
        if !reason.starts_with("guest_poweroff") {
            return Err(fail(format!(
                "{builder}: stop reason {reason:?}, want guest_poweroff (systemd's own power-off)"
            )));
        }

        let commit = c
            .commit(&builder, &CommitRequest::default())
            .await
            .or_fail()?
            .commit_id;
        let t = Instant::now();
        let fork = c
            .fork(&commit, &ForkRequest::default(), Wait::Agent, Some(DEBIAN_BOOT))
            .await
            .or_fail()?
            .hostname;
        println!(
            "{fork}: debian fork to agent-ready in {:.1} s (bed time)",
            t.elapsed().as_secs_f64()
        );
        let got = sh_ok(
            c,
            &fork,
            "md5sum /usr/local/bin/built /root/big /usr/bin/tine-hello",
        )
        .await?;
        if got != want {
            return Err(fail(format!("the fork has\n{got}\nthe builder wrote\n{want}")));
        }
        assert_eq!(sh_ok(c, &fork, "built; tine-hello").await?, "built\nhello from apt\n");
        let fork_id = sh_ok(c, &fork, identity).await?;
        let (b, f): (Vec<_>, Vec<_>) = (
            builder_id.lines().collect(),
            fork_id.lines().collect(),
        );
        if b.len() != 2 || f.len() != 2 || b[0] == f[0] || b[1] == f[1] || f[1].len() != 32 {
            return Err(fail(format!(
                "identities: builder {builder_id:?}, fork {fork_id:?}; want two different hostnames and machine-ids"
            )));
        }
        // The fork is systemd's too, and shuts down just as cleanly.
        let r = c.shutdown(&fork, ShutdownAction::Shutdown, None).await.or_fail()?;
        if r.stop_mode != Some(StopMode::Graceful) {
            return Err(fail(format!("{fork}: shutdown answered {r:?}")));
        }
        Ok(())
    })
}

fn main() {
    support::run_daemon_if_asked();
    let listing = std::env::args().any(|a| a == "--list");
    if tine_testbed::placement().is_none() && !listing {
        match tine_testbed::debian_image() {
            // Before any thread: the bed inherits the environment.
            Ok(image) => std::env::set_var(DEBIAN_ENV, image),
            Err(e) => {
                eprintln!("debian image test: {e}");
                std::process::exit(101);
            }
        }
    }
    bed_main(
        "debian image test",
        vec![Trial::test(
            "debian_builds_commits_and_forks",
            debian_builds_commits_and_forks,
        )],
    );
}
