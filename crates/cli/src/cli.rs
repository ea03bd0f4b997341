//! The command line: every subcommand and flag (clap derive).

use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, Args, Parser, Subcommand, ValueEnum};

/// Shown after `tine --help`: what scripts can rely on.
pub const AFTER_HELP: &str = "\
Exit codes:
  0  success
  1  the daemon answered with an error, printed as `tine: <error> (<code>)`
  2  usage error (bad flags or arguments)
  3  cannot reach the daemon (start it with `tine up`)
  4  a wait timed out (HTTP 408; the VM keeps booting)
  `vm exec` and `vm shell` exit with the remote command's own code
  (128+N when signal N killed it); `vm ready` exits 1 when the agent does
  not answer in time.

The daemon is found through --url, else TINE_URL, else the socket
/var/lib/tine/tine.sock. Over TCP (http://host:port) a bearer token comes
from --token, --token-file, TINE_TOKEN or TINE_TOKEN_FILE.";

/// tine: microVMs you can create, exec into, commit and fork in milliseconds.
#[derive(Debug, Parser)]
#[command(name = "tine", version, after_help = AFTER_HELP, propagate_version = true)]
pub struct Cli {
    /// Flags every command takes.
    #[command(flatten)]
    pub global: GlobalArgs,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Flags every command takes.
#[derive(Debug, Clone, Default, Args)]
pub struct GlobalArgs {
    /// The daemon: unix:///path/to/tine.sock, a socket path, or
    /// http://host:port [env: TINE_URL]
    #[arg(long, global = true, value_name = "URL")]
    pub url: Option<String>,
    /// Bearer token for a TCP daemon [env: TINE_TOKEN]
    #[arg(
        long,
        global = true,
        value_name = "TOKEN",
        conflicts_with = "token_file"
    )]
    pub token: Option<String>,
    /// File holding the bearer token [env: TINE_TOKEN_FILE]
    #[arg(long, global = true, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// Print the API's JSON answer as one document (exec: its NDJSON frames)
    #[arg(long, global = true)]
    pub json: bool,
    /// Print only the hostname or commit id, for scripts
    #[arg(long, short = 'q', global = true, conflicts_with = "json")]
    pub quiet: bool,
}

/// The top-level commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print a tine.yaml with one host group, to edit and pass to `tine up`
    New(NewArgs),
    /// Run the daemon in the foreground
    Up(UpArgs),
    /// Create, inspect, use and remove VMs
    #[command(visible_alias = "v")]
    Vm {
        /// The VM command.
        #[command(subcommand)]
        command: VmCommand,
    },
    /// List VMs (same as `tine vm list`)
    Ls(ListArgs),
    /// Show the daemon's version, data directory and counts
    Info,
    /// Host groups
    Group {
        /// The group command (default: list).
        #[command(subcommand)]
        command: Option<GroupCommand>,
    },
    /// Host secrets, synced into the VMs granted them
    Secret {
        /// The secret command.
        #[command(subcommand)]
        command: SecretCommand,
    },
    /// Images VMs boot from: list, import (ext4, qcow2, OCI, docker save),
    /// inspect, remove
    Image {
        /// The image command.
        #[command(subcommand)]
        command: ImageCommand,
    },
}

/// `tine image ...`
#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// List images (imported ones, and the built-in ones that are built)
    #[command(visible_alias = "ls")]
    List,
    /// Import an image file under a new name
    Import(ImageImportArgs),
    /// Show one image: digest, format, origin, size, exec defaults
    Inspect {
        /// The image.
        name: String,
    },
    /// Remove an image (refused while a VM or commit uses it)
    #[command(visible_alias = "rm")]
    Remove {
        /// The image.
        name: String,
    },
}

/// `tine image import NAME FILE`
#[derive(Debug, Args)]
pub struct ImageImportArgs {
    /// The new image's name (what a host group's `image:` names)
    pub name: String,
    /// A raw ext4 or qcow2 disk image, a `docker save` tar, or an OCI image
    /// layout (a tar of one, or its directory)
    pub file: PathBuf,
    /// What FILE is: auto, raw, qcow2, oci, docker-archive
    #[arg(long, default_value = "auto")]
    pub format: tine_proto::api::ImportFormat,
}

/// `tine secret ...`
#[derive(Debug, Subcommand)]
pub enum SecretCommand {
    /// Create a secret
    Create(SecretValueArgs),
    /// List secrets (names and metadata, never values)
    #[command(visible_alias = "ls")]
    List,
    /// Change a secret's value or metadata
    Update(SecretValueArgs),
    /// Remove a secret (running VMs granted it lose the file)
    #[command(visible_alias = "rm")]
    Remove {
        /// The secret.
        name: String,
    },
}

/// The name, value and guest file metadata of a secret.
#[derive(Debug, Args)]
pub struct SecretValueArgs {
    /// The secret's name (the file name under /run/tine/secrets)
    pub name: String,
    /// The value, given on the command line
    #[arg(long, conflicts_with = "from_file")]
    pub from_literal: Option<String>,
    /// Read the value from a file
    #[arg(long, value_name = "FILE")]
    pub from_file: Option<PathBuf>,
    /// Octal mode of the guest's file (default 0600 at create)
    #[arg(long)]
    pub permissions: Option<String>,
    /// Owner of the guest's file (default 0 at create)
    #[arg(long)]
    pub uid: Option<u32>,
    /// Group of the guest's file (default 0 at create)
    #[arg(long)]
    pub gid: Option<u32>,
}

/// `tine group ...`
#[derive(Debug, Subcommand)]
pub enum GroupCommand {
    /// List the host groups
    #[command(visible_alias = "ls")]
    List,
}

/// Network mode of a host group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum NetMode {
    /// No network device (exec, cp, shell and forward still work over vsock)
    None,
    /// A bridge with NAT: VMs reach each other, the host and the LAN
    Bridge,
    /// One private network namespace per VM, with allow/drop rules
    Isolated,
}

/// `tine new`
#[derive(Debug, Args)]
pub struct NewArgs {
    /// Host group name: VMs are named NAME-1, NAME-2, ...
    pub name: String,
    /// VMs the daemon keeps running (0: only those created through the API)
    #[arg(long, default_value_t = 1)]
    pub count: u32,
    /// vCPUs per VM
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub cpu: u32,
    /// RAM per VM in MiB
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(16..))]
    pub ram_mb: u64,
    /// Most vCPUs a VM may ask for (default: twice --cpu)
    #[arg(long)]
    pub max_cpu: Option<u32>,
    /// Most RAM a VM may ask for, in MiB (default: twice --ram-mb)
    #[arg(long)]
    pub max_ram_mb: Option<u64>,
    /// Virtual disk size per VM: a number with K, M, G or T
    #[arg(long, default_value = "4G")]
    pub storage_size: String,
    /// Keep each VM's disk when it stops
    #[arg(long)]
    pub persistent: bool,
    /// Root filesystem: an image name the daemon knows or a raw/qcow2 path
    #[arg(long, default_value = "min")]
    pub image: String,
    /// Network mode
    #[arg(long, value_enum, default_value = "none")]
    pub net: NetMode,
    /// Address range for the group's VMs (bridge or isolated)
    #[arg(long)]
    pub cidr: Option<String>,
    /// Destinations VMs may reach, CIDR or IP:port (isolated)
    #[arg(long, value_name = "DEST")]
    pub allow: Vec<String>,
    /// Destinations dropped, CIDR or IP:port (isolated)
    #[arg(long, value_name = "DEST")]
    pub drop: Vec<String>,
    /// A script each VM runs once at first boot
    #[arg(long, value_name = "FILE")]
    pub userdata_file: Option<PathBuf>,
    /// Also serve the API on TCP at ADDR (with a bearer token)
    #[arg(long, value_name = "ADDR")]
    pub api_bind: Option<String>,
}

/// `tine up`
#[derive(Debug, Args)]
pub struct UpArgs {
    /// The configuration (see `tine new`)
    pub config: Option<PathBuf>,
    /// Where the daemon keeps its state, disks and socket
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
}

/// Parses a duration: humantime (`30s`, `1m`, `500ms`) or bare seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if let Ok(secs) = s.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    humantime::parse_duration(s).map_err(|e| format!("{e} (try 30s, 1m or 500ms)"))
}

/// Parses `KEY=VALUE` (the value may be empty).
pub fn parse_key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("{s:?} is not KEY=VALUE")),
    }
}

/// Parses a tag: `key=value` or a bare word, no whitespace.
pub fn parse_tag(s: &str) -> Result<String, String> {
    if s.is_empty() || s.starts_with('=') || s.chars().any(char::is_whitespace) {
        return Err(format!(
            "{s:?} is not a tag (key=value or a word, no spaces)"
        ));
    }
    Ok(s.to_string())
}

/// Parses `KEY=VALUE` for `--env`, kept as one string.
pub fn parse_env(s: &str) -> Result<String, String> {
    parse_key_value(s).map(|_| s.to_string())
}

/// `--wait` / `--no-wait` (default: wait for the agent).
#[derive(Debug, Clone, Copy, Default, Args)]
pub struct WaitArgs {
    /// Wait until the VM's agent answers (the default)
    #[arg(long, conflicts_with = "no_wait")]
    pub wait: bool,
    /// Return as soon as the VM is started
    #[arg(long)]
    pub no_wait: bool,
    /// How long to wait for the agent
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub timeout: Option<Duration>,
}

impl WaitArgs {
    /// Whether to wait for the agent.
    pub fn waits(&self) -> bool {
        !self.no_wait
    }
}

/// `tine vm ...`
#[derive(Debug, Subcommand)]
pub enum VmCommand {
    /// Create a VM in a host group
    #[command(visible_alias = "launch")]
    Add(AddArgs),
    /// List VMs
    #[command(visible_alias = "ls")]
    List(ListArgs),
    /// Show a VM: resources, network, storage, lineage
    Describe(VmArg),
    /// Run a command in a VM, streaming its output
    Exec(ExecArgs),
    /// Open an interactive shell in a VM
    Shell(ShellArgs),
    /// Copy files between the host and a VM (one side is VM:/path)
    Cp(CpArgs),
    /// Forward local TCP ports to ports or Unix sockets in a VM
    Forward(ForwardArgs),
    /// Print a VM's serial console
    Logs(LogsArgs),
    /// Check a VM's agent once
    Health(VmArg),
    /// Wait until a VM's agent answers (exit 1 on timeout)
    Ready(ReadyArgs),
    /// Show VMs' figures: the guest's (memory, load, disk, network) and the
    /// host's (the VMM's CPU time and memory, disk file, TAP counters)
    Stats(StatsArgs),
    /// Park a running VM's vCPUs (its memory stays; `resume` continues it)
    Pause(VmArg),
    /// Run a paused VM's vCPUs again
    Resume(VmArg),
    /// Stop a VM (a persistent one keeps its disk)
    Shutdown(ShutdownArgs),
    /// Boot a stopped persistent VM from its disk
    Relaunch(RelaunchArgs),
    /// Save a running VM's state, memory and disk to its folder and stop its process
    Suspend(VmArg),
    /// Resume a suspended VM with its memory (its processes go on)
    Restore(RestoreArgs),
    /// Stop VMs and remove their disks
    #[command(visible_alias = "rm")]
    Delete(DeleteArgs),
    /// Show or change a VM's tags
    Tag {
        /// The tag command.
        #[command(subcommand)]
        command: TagCommand,
    },
    /// Commit a stopped persistent VM's disk (or a running one's memory with
    /// --memory), or list and delete commits
    Commit(CommitArgs),
    /// Boot a new VM from a commit
    Fork(ForkArgs),
    /// Show or change a VM's network policy (live on a running VM)
    Network {
        /// The network command.
        #[command(subcommand)]
        command: NetworkCommand,
    },
    /// List the host groups (same as `tine group list`)
    Group,
}

/// One VM, by hostname or friendly name.
#[derive(Debug, Args)]
pub struct VmArg {
    /// The VM: hostname (GROUP-N) or friendly name
    pub vm: String,
}

/// `tine vm stats`
#[derive(Debug, Args)]
pub struct StatsArgs {
    /// The VM (every VM when left out): hostname (GROUP-N) or friendly name
    pub vm: Option<String>,
}

/// `tine vm add`
#[derive(Debug, Args)]
pub struct AddArgs {
    /// Host group (may be left out when the daemon has one)
    pub group: Option<String>,
    /// vCPUs (default: the group's)
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub cpus: Option<u32>,
    /// RAM in MiB (default: the group's)
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub ram_mb: Option<u64>,
    /// Keep the disk when the VM stops
    #[arg(long, conflicts_with = "rm")]
    pub persistent: bool,
    /// Remove the disk when the VM stops
    #[arg(long)]
    pub rm: bool,
    /// A script run once at first boot
    #[arg(long, conflicts_with = "userdata_file")]
    pub userdata: Option<String>,
    /// Read the first-boot script from a file
    #[arg(long, value_name = "FILE")]
    pub userdata_file: Option<PathBuf>,
    /// Tag, key=value or a word (repeatable)
    #[arg(long, value_parser = parse_tag, value_name = "TAG")]
    pub tag: Vec<String>,
    /// Friendly name, usable in place of the hostname
    #[arg(long)]
    pub name: Option<String>,
    /// Grant a host secret (repeatable, or comma-separated)
    #[arg(
        long = "secret",
        visible_alias = "secrets",
        value_delimiter = ',',
        value_name = "NAME"
    )]
    pub secrets: Vec<String>,
    /// A public SSH key to authorize, the key itself or a .pub file (repeatable)
    #[arg(long = "ssh-key", value_name = "KEY|FILE")]
    pub ssh_keys: Vec<String>,
    /// Authorize the public SSH keys of this GitHub user
    #[arg(long, value_name = "GITHUB_USER")]
    pub import_user: Option<String>,
    /// The VM's network policy override (isolated groups).
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// Waiting for the agent.
    #[command(flatten)]
    pub wait: WaitArgs,
}

/// A per-VM override of the host group's allow/drop lists (isolated mode).
/// A list not named is inherited from the group.
#[derive(Debug, Clone, Default, Args)]
pub struct PolicyArgs {
    /// Allowed destination, CIDR, IP or IP:port (repeatable; replaces the
    /// group's allow list)
    #[arg(long, value_name = "DEST")]
    pub allow: Vec<String>,
    /// Clear the inherited allow list (`--no-allow --drop 0.0.0.0/0`: a
    /// closed VM)
    #[arg(long)]
    pub no_allow: bool,
    /// Dropped destination, CIDR, IP or IP:port (repeatable; replaces the
    /// group's drop list)
    #[arg(long, value_name = "DEST")]
    pub drop: Vec<String>,
    /// Clear the inherited drop list
    #[arg(long)]
    pub no_drop: bool,
}

/// `tine vm network ...`
#[derive(Debug, Subcommand)]
pub enum NetworkCommand {
    /// Show a VM's network: mode, addresses, the group's policy, the
    /// override and the lists in force
    Show(VmArg),
    /// Replace a VM's policy override, live on a running VM (lists not
    /// named are inherited from the group)
    Set(NetworkSetArgs),
    /// Add destinations to the allow list in force, live
    Allow(NetworkEntriesArgs),
    /// Add destinations to the drop list in force, live
    Drop(NetworkEntriesArgs),
}

/// `tine vm network set`
#[derive(Debug, Args)]
pub struct NetworkSetArgs {
    /// The VM: hostname (GROUP-N) or friendly name
    pub vm: String,
    /// The new override.
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// Remove the override: the VM follows its group's lists again
    #[arg(long, conflicts_with_all = ["allow", "no_allow", "drop", "no_drop"])]
    pub inherit: bool,
}

/// `tine vm network allow|drop`
#[derive(Debug, Args)]
pub struct NetworkEntriesArgs {
    /// The VM: hostname (GROUP-N) or friendly name
    pub vm: String,
    /// Destinations, CIDR, IP or IP:port
    #[arg(required = true, value_name = "DEST")]
    pub dest: Vec<String>,
}

/// `tine vm list` / `tine ls`
#[derive(Debug, Args)]
pub struct ListArgs {
    /// Only VMs of this host group
    #[arg(long, short = 'g')]
    pub group: Option<String>,
    /// Only VMs with this exact tag (repeat: all of them)
    #[arg(long)]
    pub tag: Vec<String>,
    /// Only VMs with a tag starting with this
    #[arg(long)]
    pub tag_prefix: Option<String>,
}

/// `tine vm exec`
#[derive(Debug, Args)]
pub struct ExecArgs {
    /// The VM: hostname or friendly name
    pub vm: String,
    /// User id to run as
    #[arg(long)]
    pub uid: Option<u32>,
    /// Group id to run as
    #[arg(long)]
    pub gid: Option<u32>,
    /// Working directory
    #[arg(long)]
    pub cwd: Option<String>,
    /// Environment variable, K=V (repeatable)
    #[arg(long, short = 'e', value_parser = parse_env, value_name = "K=V")]
    pub env: Vec<String>,
    /// Run the command line with /bin/sh -c (its words joined by spaces)
    #[arg(long, conflicts_with = "no_shell")]
    pub shell: bool,
    /// Run the program directly, without a shell
    #[arg(long)]
    pub no_shell: bool,
    /// Kill the command after this long
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub timeout: Option<Duration>,
    /// Send this terminal's stdin to the command (default when stdin is not
    /// a terminal)
    #[arg(long, conflicts_with = "no_stdin")]
    pub stdin: bool,
    /// Never send stdin
    #[arg(long)]
    pub no_stdin: bool,
    /// The command and its arguments (after `--`)
    #[arg(required = true, trailing_var_arg = true, value_name = "CMD")]
    pub command: Vec<String>,
}

impl ExecArgs {
    /// `Some(true)` for `--shell`, `Some(false)` for `--no-shell`, else the
    /// daemon's default.
    pub fn shell_choice(&self) -> Option<bool> {
        if self.shell {
            Some(true)
        } else if self.no_shell {
            Some(false)
        } else {
            None
        }
    }
}

/// `tine vm shell`
#[derive(Debug, Args)]
pub struct ShellArgs {
    /// The VM: hostname or friendly name
    pub vm: String,
    /// User id to log in as
    #[arg(long)]
    pub uid: Option<u32>,
    /// Working directory
    #[arg(long)]
    pub cwd: Option<String>,
    /// Shell program (default: the guest's login shell)
    #[arg(long)]
    pub shell: Option<String>,
}

/// `tine vm cp`
#[derive(Debug, Args)]
pub struct CpArgs {
    /// Copy a directory tree (tar mode)
    #[arg(short = 'r', long = "recursive")]
    pub recursive: bool,
    /// Owner of what is written in the VM
    #[arg(long)]
    pub uid: Option<u32>,
    /// Group of what is written in the VM
    #[arg(long)]
    pub gid: Option<u32>,
    /// Permission bits of a file written in the VM, in octal (0644)
    #[arg(long, value_parser = parse_octal, value_name = "OCTAL")]
    pub mode: Option<u32>,
    /// Source: a local path, `-` (stdin) or VM:/path
    pub src: String,
    /// Destination: a local path, `-` (stdout) or VM:/path
    pub dst: String,
}

/// Parses octal permission bits.
pub fn parse_octal(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o7777)
        .ok_or_else(|| format!("{s:?} is not octal permission bits such as 0644"))
}

/// `tine vm forward`
#[derive(Debug, Args)]
pub struct ForwardArgs {
    /// The VM: hostname or friendly name
    pub vm: String,
    /// `[BIND:]LPORT:TARGET`, `TARGET` being `PORT`, `HOST:PORT` or
    /// `/unix/path` in the VM (repeatable). The help text is given apart,
    /// without the code marks, which clap would print.
    #[arg(
        short = 'L',
        required = true,
        value_name = "SPEC",
        help = "[BIND:]LPORT:TARGET, TARGET being PORT, HOST:PORT or /unix/path in the VM (repeatable)",
        long_help = None
    )]
    pub local: Vec<String>,
}

/// `tine vm logs`
#[derive(Debug, Args)]
pub struct LogsArgs {
    /// The VM: hostname or friendly name
    pub vm: String,
    /// How many of the last lines (default: the daemon's, 200)
    #[arg(long, short = 'n')]
    pub lines: Option<u32>,
}

/// `tine vm ready`
#[derive(Debug, Args)]
pub struct ReadyArgs {
    /// The VM: hostname or friendly name
    pub vm: String,
    /// How long to wait
    #[arg(long, value_parser = parse_duration, default_value = "60s", value_name = "DURATION")]
    pub timeout: Duration,
}

/// `tine vm shutdown`
#[derive(Debug, Args)]
pub struct ShutdownArgs {
    /// The VM: hostname or friendly name
    pub vm: String,
    /// Kill it now instead of asking the guest to shut down
    #[arg(long)]
    pub poweroff: bool,
    /// How long the guest gets before it is killed (default: 20s)
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub timeout: Option<Duration>,
}

/// `tine vm relaunch`
#[derive(Debug, Args)]
pub struct RelaunchArgs {
    /// The VM: hostname or friendly name
    pub vm: String,
    /// Waiting for the agent.
    #[command(flatten)]
    pub wait: WaitArgs,
}

/// What `tine vm restore --wait` waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RestoreWait {
    /// The VM's agent answers (its clock set, fresh entropy)
    Agent,
}

/// `tine vm restore`: `--wait` alone or Slicer's `--wait agent`.
#[derive(Debug, Args)]
pub struct RestoreArgs {
    /// The VM: hostname or friendly name
    pub vm: String,
    /// Wait until the VM's agent answers (the default)
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "agent", value_name = "FOR", conflicts_with = "no_wait")]
    pub wait: Option<RestoreWait>,
    /// Return as soon as its vCPUs run again
    #[arg(long)]
    pub no_wait: bool,
    /// How long to wait for the agent
    #[arg(long, value_parser = parse_duration, value_name = "DURATION")]
    pub timeout: Option<Duration>,
}

/// `tine vm delete`
#[derive(Debug, Args)]
pub struct DeleteArgs {
    /// The VMs: hostnames or friendly names
    #[arg(required = true)]
    pub vms: Vec<String>,
}

/// `tine vm tag ...`
#[derive(Debug, Subcommand)]
pub enum TagCommand {
    /// Print a VM's tags
    #[command(visible_alias = "ls")]
    List(VmArg),
    /// Add tags
    Add(TagChange),
    /// Remove tags (a bare key removes every key=...)
    #[command(visible_alias = "rm")]
    Remove(TagChange),
    /// Replace all tags (none given: clear them)
    Replace(TagReplace),
}

/// `tine vm tag add|remove VM TAGS...`
#[derive(Debug, Args)]
pub struct TagChange {
    /// The VM: hostname or friendly name
    pub vm: String,
    /// Tags, key=value or words
    #[arg(required = true, value_parser = parse_tag)]
    pub tags: Vec<String>,
}

/// `tine vm tag replace VM [TAGS...]`
#[derive(Debug, Args)]
pub struct TagReplace {
    /// The VM: hostname or friendly name
    pub vm: String,
    /// The new tags
    #[arg(value_parser = parse_tag)]
    pub tags: Vec<String>,
}

/// `tine vm commit`: `VM [flags]`, or `list` / `delete`.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct CommitArgs {
    /// `list`, `delete` or `pool`.
    #[command(subcommand)]
    pub command: Option<CommitCommand>,
    /// The VM to commit (persistent; stopped, or running with --memory)
    #[arg(required = true)]
    pub vm: Option<String>,
    /// Commit the running VM's memory, vCPUs and devices with its disk:
    /// forks resume its processes (hot forks)
    #[arg(long)]
    pub memory: bool,
    /// Tag for the commit (repeatable)
    #[arg(long, value_parser = parse_tag, value_name = "TAG")]
    pub tag: Vec<String>,
    /// Label, key=value (repeatable)
    #[arg(long, value_parser = parse_key_value, value_name = "K=V")]
    pub label: Vec<(String, String)>,
    /// A key unique among commits, to find this one again
    #[arg(long)]
    pub cache_key: Option<String>,
    /// tine-vmm processes kept started ahead for this memory commit's
    /// forks (default: the host group's hot_fork_pool; 0: none)
    #[arg(long, value_name = "N", requires = "memory")]
    pub pool: Option<u32>,
}

/// `tine vm commit list|delete|pool`
#[derive(Debug, Subcommand)]
pub enum CommitCommand {
    /// List commits
    #[command(visible_alias = "ls")]
    List(CommitListArgs),
    /// Delete a commit nothing depends on
    #[command(visible_alias = "rm")]
    Delete {
        /// The commit id
        id: String,
    },
    /// Set how many tine-vmm processes are kept started ahead for a memory
    /// commit's forks
    Pool(CommitPoolArgs),
}

/// `tine vm commit pool COMMIT (N | --group)`
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("pool_size").required(true).args(["size", "group"])))]
pub struct CommitPoolArgs {
    /// The memory commit's id
    pub id: String,
    /// Processes to keep started (0: none)
    pub size: Option<u32>,
    /// Use the host group's hot_fork_pool again
    #[arg(long)]
    pub group: bool,
}

/// `tine vm commit list`
#[derive(Debug, Args)]
pub struct CommitListArgs {
    /// Only commits with this tag (repeat: all of them)
    #[arg(long)]
    pub tag: Vec<String>,
    /// Only the commit with this cache key
    #[arg(long)]
    pub cache_key: Option<String>,
    /// Only commits of this source VM
    #[arg(long)]
    pub source: Option<String>,
    /// Only commits of this mode
    #[arg(long, value_enum)]
    pub mode: Option<CommitModeArg>,
}

/// A commit mode on the command line (`tine_proto::api::CommitMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CommitModeArg {
    /// Disk commits (cold forks)
    Disk,
    /// Memory commits (hot forks)
    Memory,
}

impl From<CommitModeArg> for tine_client::rest::CommitMode {
    fn from(m: CommitModeArg) -> Self {
        match m {
            CommitModeArg::Disk => tine_client::rest::CommitMode::Disk,
            CommitModeArg::Memory => tine_client::rest::CommitMode::Memory,
        }
    }
}

/// `--fixup`: one of the API's fix-up names (`tine_proto::api::Fixup`).
fn fixup_parser() -> impl clap::builder::TypedValueParser<Value = tine_client::rest::Fixup> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(
        tine_client::rest::Fixup::ALL.iter().map(|f| f.as_str()),
    )
    .try_map(|s| s.parse::<tine_client::rest::Fixup>())
}

/// A fork's network choice on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ForkNet {
    /// No network device
    None,
}

/// `tine vm fork`
#[derive(Debug, Args)]
pub struct ForkArgs {
    /// The commit id
    pub commit: String,
    /// Waiting for the agent.
    #[command(flatten)]
    pub wait: WaitArgs,
    /// Tag, key=value or a word (repeatable; added to the inherited ones)
    #[arg(long, value_parser = parse_tag, value_name = "TAG")]
    pub tag: Vec<String>,
    /// Replace the inherited tags with --tag's instead of adding to them
    #[arg(long)]
    pub replace_tags: bool,
    /// Friendly name
    #[arg(long)]
    pub name: Option<String>,
    /// Remove the fork's disk when it stops
    #[arg(long)]
    pub rm: bool,
    /// vCPUs (default: the commit's)
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub cpu: Option<u32>,
    /// RAM in MiB (default: the commit's)
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub ram_mb: Option<u64>,
    /// Fix-up to apply (repeatable; default: all)
    #[arg(long, value_parser = fixup_parser(), conflicts_with = "no_fixups", action = ArgAction::Append)]
    pub fixup: Vec<tine_client::rest::Fixup>,
    /// Apply no fix-ups
    #[arg(long)]
    pub no_fixups: bool,
    /// Clear the inherited secret grants (their files are removed)
    #[arg(long, conflicts_with = "secrets")]
    pub no_secrets: bool,
    /// Grant these secrets instead of the inherited ones (repeatable, or
    /// comma-separated)
    #[arg(
        long = "secret",
        visible_alias = "secrets",
        value_delimiter = ',',
        value_name = "NAME"
    )]
    pub secrets: Vec<String>,
    /// `none`: give the fork no network device
    #[arg(long, value_enum, conflicts_with_all = ["allow", "no_allow", "drop", "no_drop"])]
    pub network: Option<ForkNet>,
    /// The fork's network policy override (isolated groups).
    #[command(flatten)]
    pub policy: PolicyArgs,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("tine").chain(args.iter().copied()))
    }

    fn ok(args: &[&str]) -> Cli {
        parse(args).unwrap_or_else(|e| panic!("{args:?} refused: {e}"))
    }

    #[test]
    fn restore_takes_slicers_wait_agent_and_tines_wait_flags() {
        let restore = |args: &[&str]| match ok(args).command {
            Command::Vm {
                command: VmCommand::Restore(a),
            } => (a.wait, a.no_wait, a.timeout),
            other => panic!("{other:?}"),
        };
        let agent = Some(RestoreWait::Agent);
        assert_eq!(
            restore(&["vm", "restore", "dev-1", "--wait", "agent"]),
            (agent, false, None)
        );
        assert_eq!(
            restore(&["vm", "restore", "dev-1", "--wait", "--timeout", "5s"]),
            (agent, false, Some(Duration::from_secs(5)))
        );
        assert_eq!(
            restore(&["vm", "restore", "dev-1", "--no-wait"]),
            (None, true, None)
        );
        assert!(parse(&["vm", "restore", "dev-1", "--wait", "userdata"]).is_err());
        assert!(parse(&["vm", "restore", "dev-1", "--wait", "--no-wait"]).is_err());
    }

    fn refused(args: &[&str]) -> clap::error::ErrorKind {
        match parse(args) {
            Ok(cli) => panic!("{args:?} accepted: {cli:?}"),
            Err(e) => e.kind(),
        }
    }

    #[test]
    fn the_command_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn every_subcommand_parses() {
        let lines: &[&[&str]] = &[
            &["new", "dev"],
            &[
                "new",
                "dev",
                "--count",
                "3",
                "--cpu",
                "2",
                "--ram-mb",
                "1024",
                "--max-cpu",
                "4",
                "--max-ram-mb",
                "4096",
                "--storage-size",
                "10G",
                "--persistent",
                "--image",
                "min",
                "--net",
                "isolated",
                "--cidr",
                "169.254.0.0/22",
                "--allow",
                "10.0.0.0/8",
                "--drop",
                "0.0.0.0/0",
                "--userdata-file",
                "u.sh",
                "--api-bind",
                "127.0.0.1:8080",
            ],
            &["up"],
            &["up", "tine.yaml", "--data-dir", "/tmp/d"],
            &["vm", "add"],
            &[
                "vm",
                "launch",
                "dev",
                "--cpus",
                "2",
                "--ram-mb",
                "1024",
                "--persistent",
            ],
            &[
                "v",
                "add",
                "dev",
                "--rm",
                "--userdata",
                "echo",
                "--tag",
                "a=b",
                "--tag",
                "ci",
                "--name",
                "web",
                "--no-wait",
                "--timeout",
                "90s",
            ],
            &[
                "vm",
                "add",
                "--userdata-file",
                "x.sh",
                "--wait",
                "--timeout",
                "30",
            ],
            &["vm", "list"],
            &[
                "vm",
                "ls",
                "--group",
                "dev",
                "--tag",
                "a=b",
                "--tag-prefix",
                "a=",
            ],
            &["ls"],
            &["ls", "-g", "dev"],
            &["vm", "describe", "dev-1"],
            &["vm", "exec", "dev-1", "--", "uname", "-a"],
            &["vm", "exec", "dev-1", "uname"],
            &[
                "vm",
                "exec",
                "web",
                "--uid",
                "1000",
                "--gid",
                "1000",
                "--cwd",
                "/tmp",
                "--env",
                "A=1",
                "-e",
                "B=",
                "--shell",
                "--timeout",
                "5s",
                "--stdin",
                "--",
                "ls | wc -l",
            ],
            &[
                "vm",
                "exec",
                "dev-1",
                "--no-shell",
                "--no-stdin",
                "--",
                "true",
            ],
            &["vm", "shell", "dev-1"],
            &[
                "vm", "shell", "dev-1", "--uid", "0", "--cwd", "/root", "--shell", "/bin/sh",
            ],
            &["vm", "cp", "a.txt", "dev-1:/tmp/a.txt"],
            &["vm", "cp", "-r", "dev-1:/etc", "./etc"],
            &[
                "vm", "cp", "--mode", "0755", "--uid", "0", "--gid", "0", "x", "dev-1:/x",
            ],
            &["vm", "forward", "dev-1", "-L", "8080:80"],
            &[
                "vm",
                "forward",
                "dev-1",
                "-L",
                "0.0.0.0:8080:db:5432",
                "-L",
                "9000:/run/x.sock",
            ],
            &["vm", "logs", "dev-1"],
            &["vm", "logs", "dev-1", "--lines", "50"],
            &["vm", "health", "dev-1"],
            &["vm", "ready", "dev-1"],
            &["vm", "ready", "dev-1", "--timeout", "2m"],
            &["vm", "shutdown", "dev-1"],
            &["vm", "shutdown", "dev-1", "--poweroff", "--timeout", "10s"],
            &["vm", "relaunch", "dev-1"],
            &["vm", "relaunch", "dev-1", "--wait", "--timeout", "1m"],
            &["vm", "relaunch", "dev-1", "--no-wait"],
            &["vm", "pause", "dev-1"],
            &["vm", "resume", "dev-1"],
            &["vm", "suspend", "dev-1"],
            &["vm", "restore", "dev-1"],
            &["vm", "restore", "dev-1", "--wait", "--timeout", "30s"],
            &["vm", "restore", "dev-1", "--wait", "agent"],
            &["vm", "restore", "dev-1", "--no-wait"],
            &["vm", "delete", "dev-1"],
            &["vm", "delete", "dev-1", "dev-2", "web"],
            &["vm", "tag", "list", "dev-1"],
            &["vm", "tag", "add", "dev-1", "a=b", "c"],
            &["vm", "tag", "remove", "dev-1", "a"],
            &["vm", "tag", "replace", "dev-1", "x=y"],
            &["vm", "tag", "replace", "dev-1"],
            &["vm", "commit", "dev-2"],
            &[
                "vm",
                "commit",
                "dev-2",
                "--tag",
                "base",
                "--label",
                "os=min",
                "--label",
                "k=",
                "--cache-key",
                "abc",
            ],
            &["vm", "commit", "list"],
            &[
                "vm",
                "commit",
                "list",
                "--tag",
                "t",
                "--cache-key",
                "k",
                "--source",
                "dev-2",
            ],
            &["vm", "commit", "delete", "cmt-dev-0123"],
            &["vm", "fork", "cmt-dev-0123"],
            &[
                "vm",
                "fork",
                "cmt-dev-0123",
                "--no-wait",
                "--timeout",
                "30s",
                "--tag",
                "a=b",
                "--replace-tags",
                "--name",
                "f1",
                "--rm",
                "--cpu",
                "2",
                "--ram-mb",
                "1024",
                "--fixup",
                "hostname",
                "--fixup",
                "machine-id",
                "--fixup",
                "ssh-host-keys",
                "--no-secrets",
                "--network",
                "none",
            ],
            &[
                "vm",
                "fork",
                "c",
                "--no-fixups",
                "--allow",
                "10.0.0.1:80",
                "--drop",
                "0.0.0.0/0",
            ],
            &["vm", "group"],
            &["info"],
            &["group"],
            &["group", "list"],
            &["--url", "unix:///tmp/t.sock", "--json", "vm", "list"],
            &["vm", "list", "--url", "http://127.0.0.1:1", "--token", "t"],
            &["vm", "add", "--quiet", "--token-file", "/tmp/token"],
            &["info", "-q"],
        ];
        for line in lines {
            ok(line);
        }
    }

    #[test]
    fn parsed_values_land_where_expected() {
        let cli = ok(&[
            "vm", "exec", "dev-1", "--env", "A=1", "--", "ls", "-la", "/",
        ]);
        let Command::Vm {
            command: VmCommand::Exec(e),
        } = cli.command
        else {
            panic!("not exec");
        };
        assert_eq!(e.vm, "dev-1");
        assert_eq!(e.command, vec!["ls", "-la", "/"]);
        assert_eq!(e.env, vec!["A=1"]);
        assert_eq!(e.shell_choice(), None);

        let cli = ok(&["vm", "commit", "dev-2", "--label", "os=min"]);
        let Command::Vm {
            command: VmCommand::Commit(c),
        } = cli.command
        else {
            panic!("not commit");
        };
        assert!(c.command.is_none());
        assert_eq!(c.vm.as_deref(), Some("dev-2"));
        assert_eq!(c.label, vec![("os".to_string(), "min".to_string())]);

        let cli = ok(&["vm", "commit", "list", "--source", "dev-2"]);
        let Command::Vm {
            command: VmCommand::Commit(c),
        } = cli.command
        else {
            panic!("not commit");
        };
        assert!(matches!(c.command, Some(CommitCommand::List(_))));

        let cli = ok(&["vm", "commit", "dev-2", "--memory", "--pool", "4"]);
        let Command::Vm {
            command: VmCommand::Commit(c),
        } = cli.command
        else {
            panic!("not commit");
        };
        assert_eq!((c.memory, c.pool), (true, Some(4)));
        for (args, size, group) in [
            (&["vm", "commit", "pool", "cmt-a", "3"][..], Some(3), false),
            (
                &["vm", "commit", "pool", "cmt-a", "--group"][..],
                None,
                true,
            ),
        ] {
            let Command::Vm {
                command: VmCommand::Commit(c),
            } = ok(args).command
            else {
                panic!("not commit");
            };
            let Some(CommitCommand::Pool(p)) = c.command else {
                panic!("not pool: {args:?}");
            };
            assert_eq!((p.id.as_str(), p.size, p.group), ("cmt-a", size, group));
        }

        let cli = ok(&["vm", "add", "--no-wait", "--timeout", "1500ms"]);
        let Command::Vm {
            command: VmCommand::Add(a),
        } = cli.command
        else {
            panic!("not add");
        };
        assert!(!a.wait.waits());
        assert_eq!(a.wait.timeout, Some(Duration::from_millis(1500)));
        assert!(a.group.is_none());

        let cli = ok(&["ls", "--json"]);
        assert!(cli.global.json);
        assert!(matches!(cli.command, Command::Ls(_)));
    }

    #[test]
    fn conflicting_flags_are_refused() {
        use clap::error::ErrorKind::{
            ArgumentConflict, InvalidValue, MissingRequiredArgument, UnknownArgument,
            ValueValidation,
        };
        assert_eq!(
            refused(&["vm", "add", "--persistent", "--rm"]),
            ArgumentConflict
        );
        assert_eq!(
            refused(&["vm", "add", "--userdata", "x", "--userdata-file", "f"]),
            ArgumentConflict
        );
        assert_eq!(refused(&["info", "--json", "--quiet"]), ArgumentConflict);
        assert_eq!(
            refused(&["vm", "commit", "dev-1", "--pool", "2"]),
            MissingRequiredArgument
        );
        assert_eq!(
            refused(&["vm", "commit", "pool", "cmt-a", "2", "--group"]),
            ArgumentConflict
        );
        assert_eq!(
            refused(&["vm", "commit", "pool", "cmt-a"]),
            MissingRequiredArgument
        );
        assert_eq!(
            refused(&["vm", "add", "--wait", "--no-wait"]),
            ArgumentConflict
        );
        assert_eq!(
            refused(&["vm", "exec", "x", "--shell", "--no-shell", "--", "true"]),
            ArgumentConflict
        );
        assert_eq!(
            refused(&["info", "--token", "t", "--token-file", "f"]),
            ArgumentConflict
        );
        assert_eq!(
            refused(&["vm", "exec", "x", "--stdin", "--no-stdin", "--", "true"]),
            ArgumentConflict
        );
        assert_eq!(
            refused(&["vm", "fork", "c", "--fixup", "hostname", "--no-fixups"]),
            ArgumentConflict
        );
        assert_eq!(
            refused(&["vm", "fork", "c", "--network", "none", "--allow", "1.2.3.4"]),
            ArgumentConflict
        );
        assert_eq!(
            refused(&["vm", "fork", "c", "--fixup", "kernel"]),
            InvalidValue
        );
        assert_eq!(
            refused(&["vm", "fork", "c", "--network", "bridge"]),
            InvalidValue
        );
        assert_eq!(refused(&["new", "dev", "--net", "macvtap"]), InvalidValue);
        assert_eq!(refused(&["vm", "exec", "dev-1"]), MissingRequiredArgument);
        assert_eq!(refused(&["vm", "delete"]), MissingRequiredArgument);
        assert_eq!(refused(&["vm", "commit"]), MissingRequiredArgument);
        assert_eq!(
            refused(&["vm", "forward", "dev-1"]),
            MissingRequiredArgument
        );
        assert_eq!(
            refused(&["vm", "add", "--timeout", "soon"]),
            ValueValidation
        );
        assert_eq!(refused(&["vm", "add", "--cpus", "0"]), ValueValidation);
        assert_eq!(refused(&["vm", "add", "--tag", "a b"]), ValueValidation);
        assert_eq!(
            refused(&["vm", "exec", "x", "-e", "NOEQ", "--", "true"]),
            ValueValidation
        );
        assert_eq!(
            refused(&["vm", "commit", "x", "--label", "nokv"]),
            ValueValidation
        );
        assert_eq!(
            refused(&["vm", "cp", "--mode", "999", "a", "b"]),
            ValueValidation
        );
        assert_eq!(
            refused(&["vm", "frobnicate"]),
            clap::error::ErrorKind::InvalidSubcommand
        );
        assert_eq!(refused(&["vm", "list", "--bogus"]), UnknownArgument);
    }

    #[test]
    fn help_documents_exit_codes() {
        let help = Cli::command().render_long_help().to_string();
        for needle in [
            "Exit codes:",
            "3  cannot reach the daemon",
            "4  a wait timed out",
        ] {
            assert!(help.contains(needle), "{needle:?} missing from:\n{help}");
        }
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert!(parse_duration("later").is_err());
    }
}
