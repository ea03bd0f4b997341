//! `tine new`: the tine.yaml host-group configuration the daemon reads.
//! The field names here are the file's schema; the daemon parses the same
//! keys.

use std::path::Path;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

use crate::cli::{NetMode, NewArgs};

/// The whole tine.yaml.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TineConfig {
    /// Where the daemon keeps state, disks and its socket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_dir: Option<String>,
    /// Guest kernel; default: the project's built kernel.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<String>,
    /// Where the API is served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api: Option<ApiConfig>,
    /// What to do with persistent VMs found stopped at start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reconcile: Option<Reconcile>,
    /// The host groups.
    pub host_groups: Vec<HostGroupConfig>,
}

/// `api:`
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiConfig {
    /// Unix socket path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket: Option<String>,
    /// TCP address, served with a bearer token; none: socket only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bind: Option<String>,
}

/// `reconcile:`
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reconcile {
    /// Boot them again.
    Relaunch,
    /// Only report them.
    Report,
}

/// One entry of `host_groups:`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostGroupConfig {
    /// Name; VMs are NAME-1, NAME-2, ...
    pub name: String,
    /// VMs kept running.
    pub count: u32,
    /// Default vCPUs.
    pub cpus: u32,
    /// Most vCPUs a VM may ask for.
    pub max_cpus: u32,
    /// Default RAM in MiB.
    pub ram_mb: u64,
    /// Most RAM a VM may ask for, in MiB.
    pub max_ram_mb: u64,
    /// Image name or rootfs path.
    pub image: String,
    /// Disk size (`4G`).
    pub storage_size: String,
    /// Keep disks when VMs stop.
    pub persistent: bool,
    /// First-boot script.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub userdata: Option<String>,
    /// Network.
    pub network: NetworkConfig,
}

/// A host group's `network:`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkConfig {
    /// `none`, `bridge` or `isolated`.
    pub mode: String,
    /// Address range.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cidr: Option<String>,
    /// Allowed destinations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow: Option<Vec<String>>,
    /// Dropped destinations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drop: Option<Vec<String>>,
}

/// The allow list `tine new --net isolated` writes when neither `--allow`
/// nor `--drop` is given: every destination.
pub const OPEN_EGRESS: &str = "0.0.0.0/0";

impl NetMode {
    /// The name in tine.yaml.
    pub fn as_str(self) -> &'static str {
        match self {
            NetMode::None => "none",
            NetMode::Bridge => "bridge",
            NetMode::Isolated => "isolated",
        }
    }
}

/// Whether `s` is a size such as `4G`, `512M` or `1073741824`.
pub fn valid_size(s: &str) -> bool {
    let digits = s.trim_end_matches(['K', 'M', 'G', 'T', 'k', 'm', 'g', 't']);
    let suffix_len = s.len() - digits.len();
    suffix_len <= 1 && !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) && {
        digits.parse::<u64>().is_ok_and(|n| n > 0)
    }
}

/// Whether `s` is an IPv4 CIDR such as `169.254.0.0/22`.
pub fn valid_cidr(s: &str) -> bool {
    let Some((addr, len)) = s.split_once('/') else {
        return false;
    };
    addr.parse::<std::net::Ipv4Addr>().is_ok() && len.parse::<u8>().is_ok_and(|l| l <= 32)
}

/// Whether `s` is a hostname prefix: lower-case letters, digits and `-`,
/// starting with a letter.
pub fn valid_group_name(s: &str) -> bool {
    s.len() <= 50
        && s.starts_with(|c: char| c.is_ascii_lowercase())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.ends_with('-')
}

/// Builds the configuration `tine new` prints.
pub fn build(args: &NewArgs, userdata: Option<String>) -> anyhow::Result<TineConfig> {
    if !valid_group_name(&args.name) {
        bail!(
            "{:?} cannot be a host group name: use lower-case letters, digits and '-', starting with a letter",
            args.name
        );
    }
    let max_cpus = args.max_cpu.unwrap_or(args.cpu * 2);
    if max_cpus < args.cpu {
        bail!("--max-cpu {max_cpus} is below --cpu {}", args.cpu);
    }
    let max_ram_mb = args.max_ram_mb.unwrap_or(args.ram_mb * 2);
    if max_ram_mb < args.ram_mb {
        bail!(
            "--max-ram-mb {max_ram_mb} is below --ram-mb {}",
            args.ram_mb
        );
    }
    if !valid_size(&args.storage_size) {
        bail!(
            "--storage-size {:?} is not a size such as 4G or 512M",
            args.storage_size
        );
    }
    if let Some(cidr) = &args.cidr {
        if args.net == NetMode::None {
            bail!("--cidr needs --net bridge or --net isolated");
        }
        if !valid_cidr(cidr) {
            bail!("--cidr {cidr:?} is not an IPv4 range such as 169.254.0.0/22");
        }
    }
    if (!args.allow.is_empty() || !args.drop.is_empty()) && args.net != NetMode::Isolated {
        bail!("--allow and --drop need --net isolated");
    }
    let list = |v: &Vec<String>| (!v.is_empty()).then(|| v.clone());
    // Like Slicer's generated isolated group: egress open unless the flags
    // say otherwise, so a closed VM is `--no-allow --drop 0.0.0.0/0`.
    let (allow, drop) =
        if args.net == NetMode::Isolated && args.allow.is_empty() && args.drop.is_empty() {
            (Some(vec![OPEN_EGRESS.to_owned()]), None)
        } else {
            (list(&args.allow), list(&args.drop))
        };
    Ok(TineConfig {
        data_dir: None,
        kernel: None,
        api: args.api_bind.as_ref().map(|bind| ApiConfig {
            socket: None,
            bind: Some(bind.clone()),
        }),
        reconcile: Some(Reconcile::Relaunch),
        host_groups: vec![HostGroupConfig {
            name: args.name.clone(),
            count: args.count,
            cpus: args.cpu,
            max_cpus,
            ram_mb: args.ram_mb,
            max_ram_mb,
            image: args.image.clone(),
            storage_size: args.storage_size.clone(),
            persistent: args.persistent,
            userdata,
            network: NetworkConfig {
                mode: args.net.as_str().to_string(),
                cidr: args.cidr.clone(),
                allow,
                drop,
            },
        }],
    })
}

/// The text `tine new` prints: a comment, then the YAML.
pub fn render(args: &NewArgs, config: &TineConfig) -> anyhow::Result<String> {
    let yaml = serde_yaml::to_string(config).context("cannot write the YAML")?;
    Ok(format!(
        "# tine.yaml for host group {name}, written by `tine new`.\n\
         # Start the daemon with: tine up tine.yaml\n{yaml}",
        name = args.name
    ))
}

/// `tine new`: reads the userdata file, builds and renders.
pub fn run(args: &NewArgs) -> anyhow::Result<String> {
    let userdata = match &args.userdata_file {
        Some(path) => Some(read_userdata(path)?),
        None => None,
    };
    let config = build(args, userdata)?;
    render(args, &config)
}

/// Reads a userdata script.
pub fn read_userdata(path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the userdata file {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use clap::Parser;

    fn new_args(args: &[&str]) -> NewArgs {
        let cli = Cli::try_parse_from(["tine", "new"].iter().chain(args)).expect("parse");
        match cli.command {
            Command::New(a) => a,
            other => panic!("not new: {other:?}"),
        }
    }

    #[test]
    fn defaults_round_trip_through_yaml() {
        let args = new_args(&["dev"]);
        let text = run(&args).expect("new");
        assert!(text.starts_with("# tine.yaml"), "{text}");
        let back: TineConfig = serde_yaml::from_str(&text).expect("parse back");
        let g = &back.host_groups[0];
        assert_eq!(g.name, "dev");
        assert_eq!((g.count, g.cpus, g.max_cpus), (1, 1, 2));
        assert_eq!((g.ram_mb, g.max_ram_mb), (512, 1024));
        assert_eq!(g.image, "min");
        assert_eq!(g.storage_size, "4G");
        assert!(!g.persistent);
        assert_eq!(g.network.mode, "none");
        assert_eq!(g.network.allow, None);
        assert_eq!(back.api, None);
        assert_eq!(back.reconcile, Some(Reconcile::Relaunch));
        // Exactly the documented keys.
        let raw: serde_yaml::Value = serde_yaml::from_str(&text).expect("value");
        let group = &raw["host_groups"][0];
        let mut keys: Vec<&str> = group
            .as_mapping()
            .expect("mapping")
            .keys()
            .filter_map(|k| k.as_str())
            .collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "count",
                "cpus",
                "image",
                "max_cpus",
                "max_ram_mb",
                "name",
                "network",
                "persistent",
                "ram_mb",
                "storage_size"
            ]
        );
    }

    #[test]
    fn the_daemon_accepts_what_tine_new_writes() {
        for flags in [
            vec!["dev"],
            vec![
                "ci",
                "--count",
                "3",
                "--net",
                "isolated",
                "--allow",
                "169.254.1.1:443",
            ],
            vec![
                "br",
                "--net",
                "bridge",
                "--cidr",
                "169.254.64.0/24",
                "--persistent",
            ],
        ] {
            let text = run(&new_args(&flags)).expect("new");
            tine_daemon::config::Config::parse(&text).unwrap_or_else(|e| {
                panic!("tine new {flags:?} wrote what tine up refuses: {e}\n{text}")
            });
        }
    }

    #[test]
    fn every_flag_lands_in_the_yaml() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ud = dir.path().join("ud.sh");
        std::fs::write(&ud, "#!/bin/sh\necho hi\n").expect("write");
        let ud = ud.to_string_lossy().into_owned();
        let args = new_args(&[
            "ci",
            "--count",
            "3",
            "--cpu",
            "2",
            "--ram-mb",
            "2048",
            "--max-cpu",
            "8",
            "--max-ram-mb",
            "8192",
            "--storage-size",
            "20G",
            "--persistent",
            "--image",
            "/images/rootfs.qcow2",
            "--net",
            "isolated",
            "--cidr",
            "169.254.0.0/22",
            "--allow",
            "10.0.0.0/8",
            "--allow",
            "1.1.1.1:53",
            "--drop",
            "0.0.0.0/0",
            "--userdata-file",
            &ud,
            "--api-bind",
            "127.0.0.1:8080",
        ]);
        let text = run(&args).expect("new");
        let back: TineConfig = serde_yaml::from_str(&text).expect("parse back");
        assert_eq!(
            back.api,
            Some(ApiConfig {
                socket: None,
                bind: Some("127.0.0.1:8080".into())
            })
        );
        let g = &back.host_groups[0];
        assert_eq!(
            g,
            &HostGroupConfig {
                name: "ci".into(),
                count: 3,
                cpus: 2,
                max_cpus: 8,
                ram_mb: 2048,
                max_ram_mb: 8192,
                image: "/images/rootfs.qcow2".into(),
                storage_size: "20G".into(),
                persistent: true,
                userdata: Some("#!/bin/sh\necho hi\n".into()),
                network: NetworkConfig {
                    mode: "isolated".into(),
                    cidr: Some("169.254.0.0/22".into()),
                    allow: Some(vec!["10.0.0.0/8".into(), "1.1.1.1:53".into()]),
                    drop: Some(vec!["0.0.0.0/0".into()]),
                },
            }
        );
    }

    #[test]
    fn the_documented_example_parses() {
        let example = r#"
data_dir: /var/lib/tine
kernel: /path/vmlinux
api:
  socket: /var/lib/tine/tine.sock
  bind: 127.0.0.1:8080
reconcile: relaunch
host_groups:
  - name: dev
    count: 1
    cpus: 1
    max_cpus: 2
    ram_mb: 512
    max_ram_mb: 1024
    image: min
    storage_size: 4G
    persistent: true
    userdata: |
      echo hi
    network:
      mode: none
      cidr: 169.254.0.0/22
      allow: []
      drop: []
"#;
        let c: TineConfig = serde_yaml::from_str(example).expect("example");
        assert_eq!(c.reconcile, Some(Reconcile::Relaunch));
        assert_eq!(c.host_groups[0].userdata.as_deref(), Some("echo hi\n"));
        assert_eq!(c.host_groups[0].network.allow, Some(vec![]));
    }

    #[test]
    fn an_isolated_group_allows_egress_unless_told_otherwise() {
        let net = |args: &[&str]| {
            build(&new_args(args), None).expect("new").host_groups[0]
                .network
                .clone()
        };
        let open = net(&["dev", "--net", "isolated"]);
        assert_eq!(open.allow, Some(vec![OPEN_EGRESS.to_owned()]));
        assert_eq!(open.drop, None);
        let dropped = net(&["dev", "--net", "isolated", "--drop", "10.0.0.0/8"]);
        assert_eq!(
            dropped.allow, None,
            "a drop list alone lets the rest through"
        );
        assert_eq!(
            net(&["dev", "--net", "bridge", "--cidr", "169.254.9.0/24"]).allow,
            None
        );
    }

    #[test]
    fn bad_values_are_refused() {
        let bad: &[&[&str]] = &[
            &["Dev"],
            &["dev_1"],
            &["dev", "--cpu", "4", "--max-cpu", "2"],
            &["dev", "--ram-mb", "1024", "--max-ram-mb", "512"],
            &["dev", "--storage-size", "lots"],
            &["dev", "--storage-size", "4GB"],
            &["dev", "--cidr", "10.0.0.0/8"],
            &["dev", "--net", "bridge", "--cidr", "10.0.0/8"],
            &["dev", "--net", "bridge", "--allow", "1.2.3.4"],
            &["dev", "--userdata-file", "/nonexistent/ud.sh"],
        ];
        for args in bad {
            assert!(run(&new_args(args)).is_err(), "{args:?} accepted");
        }
        assert!(valid_size("512M") && valid_size("1073741824") && !valid_size("0G"));
    }
}
