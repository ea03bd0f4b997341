//! `tine.yaml`: the daemon's settings and its host groups.
//!
//! `tine new` prints one; `tine up` reads it. Without a file the daemon runs
//! on [`Config::embedded_default`]. Every problem is reported with the field
//! it concerns before the daemon touches any state.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::network::NetworkConfig;

/// Where the daemon keeps its state unless told otherwise.
pub const DEFAULT_DATA_DIR: &str = "/var/lib/tine";

/// Errors in a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The YAML is malformed or has unknown or mistyped fields.
    #[error("{}: {message}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// serde_yaml's message (it names the field and line).
        message: String,
    },
    /// A value is out of range or inconsistent.
    #[error("{field}: {message}")]
    Invalid {
        /// Which field, e.g. `host_groups[0].ram_mb`.
        field: String,
        /// What is wrong with it.
        message: String,
    },
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}

/// What to do at start with persistent VMs whose process is gone.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reconcile {
    /// Boot them again from their disks.
    #[default]
    Relaunch,
    /// Record them as stopped and leave them.
    Report,
}

/// The API's listeners.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiConfig {
    /// Unix socket (default `<data_dir>/tine.sock`).
    #[serde(default)]
    pub socket: Option<PathBuf>,
    /// TCP address (`127.0.0.1:8080`); requests there need the bearer token.
    #[serde(default)]
    pub bind: Option<String>,
}

/// The whole file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// State directory (default `/var/lib/tine`).
    #[serde(default)]
    pub data_dir: Option<PathBuf>,
    /// Guest kernel (vmlinux or bzImage); default: the project's build.
    #[serde(default)]
    pub kernel: Option<PathBuf>,
    /// The `tine-vmm` binary; default: next to the running binary, then PATH.
    #[serde(default)]
    pub vmm: Option<PathBuf>,
    /// The static `tine-agent` installed into imported OCI images; default:
    /// `$TINE_AGENT_BIN`, else the one in the built-in `min` image.
    #[serde(default)]
    pub agent: Option<PathBuf>,
    /// Extra kernel command line appended for every VM.
    #[serde(default)]
    pub cmdline: Option<String>,
    /// Listeners.
    #[serde(default)]
    pub api: ApiConfig,
    /// Start-up policy for persistent VMs found stopped.
    #[serde(default)]
    pub reconcile: Reconcile,
    /// VMs booting at once (launch to agent-ready); more wait their turn.
    /// Default: the host's CPU count.
    #[serde(default)]
    pub boot_concurrency: Option<u32>,
    /// Where `import_user` keys come from, `{user}` replaced by the name
    /// (default `https://github.com/{user}.keys`).
    #[serde(default)]
    pub import_keys_url: Option<String>,
    /// Host groups (at least one).
    pub host_groups: Vec<HostGroup>,
}

/// One host group: a template and limits for its VMs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostGroup {
    /// Name; VMs are `NAME-1`, `NAME-2`, ...
    pub name: String,
    /// VMs kept running (persistent); 0 = created through the API only.
    #[serde(default)]
    pub count: u32,
    /// Default vCPUs.
    #[serde(default = "default_cpus")]
    pub cpus: u32,
    /// Most vCPUs a VM may ask for (default: `cpus`).
    #[serde(default)]
    pub max_cpus: Option<u32>,
    /// Default RAM in MiB.
    #[serde(default = "default_ram_mb")]
    pub ram_mb: u64,
    /// Most RAM a VM may ask for, in MiB (default: `ram_mb`).
    #[serde(default)]
    pub max_ram_mb: Option<u64>,
    /// Root filesystem: an image name (`min`) or a path to a raw or qcow2
    /// file.
    #[serde(default = "default_image")]
    pub image: String,
    /// Virtual disk size (`4G`, `512M`, bytes); default: the image's size.
    #[serde(default)]
    pub storage_size: Option<String>,
    /// Keep a VM's disk when it stops (default false: removed on stop).
    #[serde(default)]
    pub persistent: bool,
    /// A script run once on a VM's first boot.
    #[serde(default)]
    pub userdata: Option<String>,
    /// The same, from a file.
    #[serde(default)]
    pub userdata_file: Option<PathBuf>,
    /// Kernel override for this group.
    #[serde(default)]
    pub kernel: Option<PathBuf>,
    /// Network.
    #[serde(default)]
    pub network: NetworkConfig,
    /// tine-vmm processes started ahead of time for hot forks of this
    /// group's memory commits, per shape (vCPUs, RAM) of those commits: a
    /// fork takes one and only restores into it (default 1; 0: every hot
    /// fork starts its own process).
    #[serde(default = "default_hot_fork_pool")]
    pub hot_fork_pool: u32,
}

fn default_cpus() -> u32 {
    1
}
fn default_hot_fork_pool() -> u32 {
    1
}
fn default_ram_mb() -> u64 {
    512
}
fn default_image() -> String {
    "min".to_owned()
}

/// Most vCPUs per VM (the VMM's limit).
pub const MAX_VCPUS: u32 = 64;
/// Least RAM per VM, in MiB.
pub const MIN_RAM_MB: u64 = 64;
/// Most RAM per VM, in MiB.
pub const MAX_RAM_MB: u64 = 256 * 1024;
/// Most VMs a group keeps running.
pub const MAX_COUNT: u32 = 1024;

impl HostGroup {
    /// Most vCPUs.
    pub fn max_cpus(&self) -> u32 {
        self.max_cpus.unwrap_or(self.cpus)
    }

    /// Most RAM in MiB.
    pub fn max_ram_mb(&self) -> u64 {
        self.max_ram_mb.unwrap_or(self.ram_mb)
    }

    /// The virtual disk size in bytes, when set.
    pub fn storage_bytes(&self) -> Result<Option<u64>, ConfigError> {
        self.storage_size
            .as_deref()
            .map(|s| parse_size(s).map_err(|m| invalid(format!("{}.storage_size", self.name), m)))
            .transpose()
    }

    /// The userdata script, from `userdata` or `userdata_file`.
    pub fn userdata(&self) -> Result<Option<String>, ConfigError> {
        match (&self.userdata, &self.userdata_file) {
            (Some(_), Some(_)) => Err(invalid(
                format!("{}.userdata_file", self.name),
                "set either userdata or userdata_file, not both",
            )),
            (Some(s), None) => Ok(Some(s.clone())),
            (None, Some(path)) => {
                std::fs::read_to_string(path)
                    .map(Some)
                    .map_err(|source| ConfigError::Read {
                        path: path.clone(),
                        source,
                    })
            }
            (None, None) => Ok(None),
        }
    }
}

/// Parses `4G`, `512M`, `64K`, `1T`, `4GiB`, `4GB` or plain bytes
/// (binary multiples).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size (examples: 4G, 512M, 1073741824)"))?;
    let mult: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KB" | "KIB" => 1 << 10,
        "M" | "MB" | "MIB" => 1 << 20,
        "G" | "GB" | "GIB" => 1 << 30,
        "T" | "TB" | "TIB" => 1 << 40,
        other => return Err(format!("`{s}`: unknown unit `{other}` (use K, M, G or T)")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("`{s}` is too large"))
}

/// Whether `name` is a valid host-group name: lower-case letters, digits and
/// `-`, starting with a letter, at most 20 characters (hostnames are
/// `NAME-N`).
pub fn valid_group_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 20
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.ends_with('-')
}

impl Config {
    /// The configuration used without a file: one API-only group `vm`
    /// (1 vCPU / 512 MiB by default, at most 4 / 4096), the min image, no
    /// network, ephemeral VMs.
    pub fn embedded_default() -> Self {
        Config {
            data_dir: None,
            kernel: None,
            vmm: None,
            agent: None,
            cmdline: None,
            api: ApiConfig::default(),
            reconcile: Reconcile::Relaunch,
            boot_concurrency: None,
            import_keys_url: None,
            host_groups: vec![HostGroup {
                name: "vm".into(),
                count: 0,
                cpus: 1,
                max_cpus: Some(4),
                ram_mb: 512,
                max_ram_mb: Some(4096),
                image: default_image(),
                storage_size: None,
                persistent: false,
                userdata: None,
                userdata_file: None,
                kernel: None,
                network: NetworkConfig::default(),
                hot_fork_pool: default_hot_fork_pool(),
            }],
        }
    }

    /// Reads and validates `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let config = Self::parse(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse {
                path: path.to_owned(),
                message,
            },
            other => other,
        })?;
        Ok(config)
    }

    /// Parses and validates YAML text.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let config: Config = serde_yaml::from_str(text).map_err(|e| ConfigError::Parse {
            path: PathBuf::from("tine.yaml"),
            message: e.to_string(),
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks every value; the first problem is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.host_groups.is_empty() {
            return Err(invalid("host_groups", "at least one host group is needed"));
        }
        if let Some(url) = &self.import_keys_url {
            let scheme_ok = url.starts_with("https://") || url.starts_with("http://");
            if !scheme_ok || !url.contains("{user}") {
                return Err(invalid(
                    "import_keys_url",
                    format!("`{url}` must be an http(s) URL holding `{{user}}`"),
                ));
            }
        }
        let mut seen = HashSet::new();
        for (i, g) in self.host_groups.iter().enumerate() {
            let at = |f: &str| format!("host_groups[{i}].{f}");
            if !valid_group_name(&g.name) {
                return Err(invalid(
                    at("name"),
                    format!(
                        "`{}` is not a valid group name (lower-case letters, digits and '-', \
                         starting with a letter, at most 20 characters)",
                        g.name
                    ),
                ));
            }
            if !seen.insert(g.name.as_str()) {
                return Err(invalid(at("name"), format!("`{}` is used twice", g.name)));
            }
            if g.count > MAX_COUNT {
                return Err(invalid(
                    at("count"),
                    format!("{} is above {MAX_COUNT}", g.count),
                ));
            }
            if g.hot_fork_pool > crate::launcher::pool::MAX_POOL_SIZE {
                return Err(invalid(
                    at("hot_fork_pool"),
                    format!(
                        "{} is above {}",
                        g.hot_fork_pool,
                        crate::launcher::pool::MAX_POOL_SIZE
                    ),
                ));
            }
            if g.cpus == 0 || g.max_cpus() > MAX_VCPUS {
                return Err(invalid(
                    at("cpus"),
                    format!("vCPUs must be 1..={MAX_VCPUS}"),
                ));
            }
            if g.max_cpus() < g.cpus {
                return Err(invalid(
                    at("max_cpus"),
                    format!("{} is below cpus ({})", g.max_cpus(), g.cpus),
                ));
            }
            if g.ram_mb < MIN_RAM_MB || g.max_ram_mb() > MAX_RAM_MB {
                return Err(invalid(
                    at("ram_mb"),
                    format!("RAM must be {MIN_RAM_MB}..={MAX_RAM_MB} MiB"),
                ));
            }
            if g.max_ram_mb() < g.ram_mb {
                return Err(invalid(
                    at("max_ram_mb"),
                    format!("{} is below ram_mb ({})", g.max_ram_mb(), g.ram_mb),
                ));
            }
            if g.image.is_empty() {
                return Err(invalid(at("image"), "must name an image or a file"));
            }
            g.storage_bytes()?;
            if g.userdata.is_some() && g.userdata_file.is_some() {
                return Err(invalid(
                    at("userdata_file"),
                    "set either userdata or userdata_file, not both",
                ));
            }
            crate::network::validate(&g.name, &g.network)
                .map_err(|e| invalid(at("network"), e.to_string()))?;
        }
        crate::network::validate_groups(
            self.host_groups
                .iter()
                .map(|g| (g.name.as_str(), &g.network)),
        )
        .map_err(|e| invalid("host_groups[].network", e.to_string()))?;
        if self.boot_concurrency == Some(0) {
            return Err(invalid("boot_concurrency", "must be at least 1"));
        }
        if let Some(bind) = &self.api.bind {
            bind.parse::<std::net::SocketAddr>().map_err(|_| {
                invalid(
                    "api.bind",
                    format!("`{bind}` is not an address like 127.0.0.1:8080"),
                )
            })?;
        }
        Ok(())
    }

    /// The group called `name`.
    pub fn group(&self, name: &str) -> Option<&HostGroup> {
        self.host_groups.iter().find(|g| g.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("4G"), Ok(4 << 30));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("1024"), Ok(1024));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert!(parse_size("4X")
            .expect_err("invalid")
            .contains("unknown unit"));
        assert!(parse_size("G").expect_err("invalid").contains("not a size"));
        assert!(parse_size("99999999999T")
            .expect_err("invalid")
            .contains("too large"));
    }

    #[test]
    fn the_embedded_default_is_valid() {
        Config::embedded_default().validate().expect("valid");
    }

    #[test]
    fn a_full_file_parses() {
        let c = Config::parse(
            "data_dir: /tmp/x\napi:\n  bind: 127.0.0.1:8080\nreconcile: report\nhost_groups:\n  - name: dev\n    count: 2\n    cpus: 2\n    max_cpus: 4\n    ram_mb: 256\n    max_ram_mb: 1024\n    storage_size: 4G\n    persistent: true\n    userdata: echo hi\n",
        )
        .expect("parse");
        let g = c.group("dev").expect("group");
        assert_eq!(
            (g.count, g.cpus, g.max_cpus(), g.ram_mb, g.max_ram_mb()),
            (2, 2, 4, 256, 1024)
        );
        assert_eq!(g.storage_bytes().expect("size"), Some(4 << 30));
        assert_eq!(c.reconcile, Reconcile::Report);
        assert_eq!(c.api.bind.as_deref(), Some("127.0.0.1:8080"));
    }

    fn error_of(yaml: &str) -> String {
        Config::parse(yaml).expect_err("invalid").to_string()
    }

    #[test]
    fn problems_are_named() {
        assert!(error_of("host_groups: []").contains("at least one host group"));
        assert!(error_of("boot_concurrency: 0\nhost_groups:\n  - name: a\n")
            .contains("boot_concurrency"));
        assert!(error_of("host_groups:\n  - name: Dev\n").contains("host_groups[0].name"));
        assert!(error_of("host_groups:\n  - name: a\n  - name: a\n").contains("used twice"));
        assert!(error_of("host_groups:\n  - name: a\n    ram_mb: 8\n").contains("ram_mb"));
        assert!(
            error_of("host_groups:\n  - name: a\n    cpus: 2\n    max_cpus: 1\n")
                .contains("max_cpus")
        );
        assert!(
            error_of("host_groups:\n  - name: a\n    storage_size: 3Q\n").contains("unknown unit")
        );
        assert!(
            error_of("host_groups:\n  - name: a\n    bogus: 1\n").contains("unknown field `bogus`")
        );
        assert!(
            error_of("api:\n  bind: nowhere\nhost_groups:\n  - name: a\n").contains("api.bind")
        );
    }
}
