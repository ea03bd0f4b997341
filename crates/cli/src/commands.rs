//! The commands that talk to the daemon.

use std::borrow::Cow;
use std::io::IsTerminal;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use tine_client::api::{read_token_file, CommitQuery, ShutdownAction, Wait};
use tine_client::TineClient;
use tine_proto::api::{
    CommitRequest, CreateVmRequest, ForkNetwork, ForkRequest, ListQuery, NetworkPolicy,
    SuspendResponse, TagMode, TagsPatch, VmNetworkInfo, VmState,
};

use crate::cli::{
    AddArgs, Cli, Command, CommitArgs, CommitCommand, DeleteArgs, ForkArgs, GlobalArgs,
    GroupCommand, ListArgs, LogsArgs, NetworkCommand, PolicyArgs, ReadyArgs, RelaunchArgs,
    RestoreArgs, ShutdownArgs, TagCommand, VmCommand, WaitArgs,
};
use crate::exit::{self, UsageError};
use crate::output::{self, print_json};
use crate::stream;

/// A spinner on stderr while something slow runs; nothing when stderr is
/// not a terminal or with `--json`/`--quiet`. Cleared when dropped.
pub struct Progress(Option<ProgressBar>);

impl Progress {
    /// Starts a spinner with `message`.
    pub fn start(g: &GlobalArgs, message: impl Into<Cow<'static, str>>) -> Self {
        if g.json || g.quiet || !std::io::stderr().is_terminal() {
            return Self(None);
        }
        let bar = ProgressBar::new_spinner();
        if let Ok(style) = ProgressStyle::with_template("{spinner} {msg} ({elapsed})") {
            bar.set_style(style);
        }
        bar.set_message(message);
        bar.enable_steady_tick(Duration::from_millis(100));
        Self(Some(bar))
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(bar) = &self.0 {
            bar.finish_and_clear();
        }
    }
}

/// The client the global flags ask for.
pub fn client(g: &GlobalArgs) -> anyhow::Result<TineClient> {
    let token = match (&g.token, &g.token_file) {
        (Some(token), _) => Some(token.clone()),
        (None, Some(file)) => Some(read_token_file(file)?),
        (None, None) => None,
    };
    Ok(TineClient::from_env(g.url.as_deref(), token.as_deref())?)
}

fn wait_of(w: &WaitArgs) -> Wait {
    if w.waits() {
        Wait::Agent
    } else {
        Wait::None
    }
}

fn mib(mb: u64) -> u64 {
    mb.saturating_mul(1 << 20)
}

/// "dev-3 running, ip 10.0.0.3 (agent ready in 812 ms)".
pub fn started_line(hostname: &str, state: VmState, ip: Option<&str>, elapsed_ms: u64) -> String {
    let mut line = format!("{hostname} {state}");
    if let Some(ip) = ip {
        line.push_str(&format!(", ip {ip}"));
    }
    if state == VmState::Running {
        line.push_str(&format!(" (agent ready in {})", output::millis(elapsed_ms)));
    } else {
        line.push_str(&format!(" (in {})", output::millis(elapsed_ms)));
    }
    line
}

/// Runs a parsed command line that needs the daemon; returns the exit code.
pub async fn run(cli: Cli) -> anyhow::Result<i32> {
    let g = &cli.global;
    match cli.command {
        Command::New(_) | Command::Up(_) => Err(anyhow::anyhow!(
            "`tine new` and `tine up` run without the async runtime"
        )),
        Command::Info => info(g).await,
        Command::Group { command } => match command {
            None | Some(GroupCommand::List) => groups(g).await,
        },
        Command::Ls(args) => list(g, &args).await,
        Command::Vm { command } => vm(g, command).await,
        Command::Secret { command } => crate::secret::run(g, &client(g)?, command).await,
        Command::Image { command } => crate::image::run(g, &client(g)?, command).await,
    }
}

async fn vm(g: &GlobalArgs, command: VmCommand) -> anyhow::Result<i32> {
    let c = client(g)?;
    match command {
        VmCommand::Add(args) => add(g, &c, args).await,
        VmCommand::List(args) => list(g, &args).await,
        VmCommand::Describe(a) => {
            let v = c.describe(&a.vm).await?;
            if g.json {
                print_json(&v)?;
            } else if g.quiet {
                println!("{}", v.hostname);
            } else {
                print!("{}", output::describe(&v, SystemTime::now()));
            }
            Ok(exit::OK)
        }
        VmCommand::Exec(args) => stream::exec(g, &c, args).await,
        VmCommand::Shell(args) => stream::shell(&c, args).await,
        VmCommand::Cp(args) => stream::cp(g, &c, args).await,
        VmCommand::Forward(args) => stream::forward(g, &c, args).await,
        VmCommand::Logs(args) => logs(g, &c, &args).await,
        VmCommand::Stats(args) => crate::stats::run(g, &c, &args).await,
        VmCommand::Pause(a) => crate::pause::run(g, &c, &a, false).await,
        VmCommand::Resume(a) => crate::pause::run(g, &c, &a, true).await,
        VmCommand::Health(a) => {
            let h = c.health(&a.vm, Wait::None, None).await?;
            if g.json {
                print_json(&h)?;
            } else if g.quiet {
                println!("{}", h.hostname);
            } else {
                println!(
                    "{}: agent {} ready, up {} (system {}), userdata {}, rtt {:.1} ms",
                    h.hostname,
                    output::sanitize(&h.agent_version, false),
                    output::millis(h.agent_uptime_ms),
                    output::millis(h.system_uptime_ms),
                    if h.userdata_ran { "ran" } else { "pending" },
                    h.rtt_ms
                );
            }
            Ok(exit::OK)
        }
        VmCommand::Ready(args) => ready(g, &c, &args).await,
        VmCommand::Shutdown(args) => shutdown(g, &c, &args).await,
        VmCommand::Relaunch(args) => relaunch(g, &c, &args).await,
        VmCommand::Suspend(a) => suspend(g, &c, &a.vm).await,
        VmCommand::Restore(args) => restore(g, &c, &args).await,
        VmCommand::Delete(args) => delete(g, &c, &args).await,
        VmCommand::Tag { command } => tag(g, &c, command).await,
        VmCommand::Commit(args) => commit(g, &c, args).await,
        VmCommand::Fork(args) => fork(g, &c, args).await,
        VmCommand::Network { command } => network(g, &c, command).await,
        VmCommand::Group => groups(g).await,
    }
}

async fn info(g: &GlobalArgs) -> anyhow::Result<i32> {
    let info = client(g)?.info().await?;
    if g.json {
        print_json(&info)?;
    } else if g.quiet {
        println!("{}", info.version);
    } else {
        print!(
            "{}",
            output::fields(&[
                ("version", info.version.clone()),
                ("data dir", info.data_dir.clone()),
                ("pid", info.pid.to_string()),
                ("started", info.started_at.clone()),
                ("host groups", info.host_groups.join(", ")),
                ("vms", info.vms.to_string()),
            ])
        );
    }
    Ok(exit::OK)
}

async fn groups(g: &GlobalArgs) -> anyhow::Result<i32> {
    let groups = client(g)?.host_groups().await?;
    output::print_list(
        g.json,
        g.quiet,
        &groups,
        |group| &group.name,
        "No host groups.",
        output::group_table,
    )?;
    Ok(exit::OK)
}

async fn list(g: &GlobalArgs, args: &ListArgs) -> anyhow::Result<i32> {
    let query = ListQuery {
        tags: args.tag.clone(),
        tag_prefix: args.tag_prefix.clone(),
    };
    let vms = client(g)?.list_vms(args.group.as_deref(), &query).await?;
    output::print_list(
        g.json,
        g.quiet,
        &vms,
        |v| &v.hostname,
        "No VMs.",
        |vms| output::vm_table(vms, SystemTime::now()),
    )?;
    Ok(exit::OK)
}

/// The group `vm add` means: the one named, else the daemon's only one.
async fn pick_group(c: &TineClient, named: Option<String>) -> anyhow::Result<String> {
    if let Some(group) = named {
        return Ok(group);
    }
    let groups = c.host_groups().await?;
    match groups.as_slice() {
        [only] => Ok(only.name.clone()),
        [] => {
            Err(UsageError("the daemon has no host groups; add one to its tine.yaml".into()).into())
        }
        many => {
            let names: Vec<&str> = many.iter().map(|g| g.name.as_str()).collect();
            Err(UsageError(format!(
                "the daemon has several host groups ({}); name one: tine vm add GROUP",
                names.join(", ")
            ))
            .into())
        }
    }
}

/// `--ssh-key` values: a key line as it is, or a file of key lines (a
/// `.pub` file, an `authorized_keys`).
fn ssh_keys_of(values: &[String]) -> anyhow::Result<Vec<String>> {
    let mut keys = Vec::new();
    for v in values {
        let path = std::path::Path::new(v);
        if v.split_whitespace().count() < 2 && path.is_file() {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the SSH key file {v}"))?;
            keys.extend(
                text.lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(str::to_owned),
            );
        } else {
            keys.push(v.clone());
        }
    }
    Ok(keys)
}

async fn add(g: &GlobalArgs, c: &TineClient, args: AddArgs) -> anyhow::Result<i32> {
    let userdata = match (&args.userdata, &args.userdata_file) {
        (Some(script), _) => Some(script.clone()),
        (None, Some(file)) => Some(crate::config::read_userdata(file)?),
        (None, None) => None,
    };
    let group = pick_group(c, args.group).await?;
    let request = CreateVmRequest {
        cpus: args.cpus,
        ram_bytes: args.ram_mb.map(mib),
        persistent: if args.persistent {
            Some(true)
        } else if args.rm {
            Some(false)
        } else {
            None
        },
        userdata,
        tags: args.tag,
        name: args.name,
        network: policy_of(&args.policy),
        secrets: args.secrets,
        ssh_keys: ssh_keys_of(&args.ssh_keys)?,
        import_user: args.import_user,
        ..CreateVmRequest::default()
    };
    let wait = wait_of(&args.wait);
    let created = {
        let _p = Progress::start(
            g,
            if wait == Wait::Agent {
                format!("starting a VM in {group}, waiting for its agent")
            } else {
                format!("creating a VM in {group}")
            },
        );
        c.create_vm(&group, &request, wait, args.wait.timeout)
            .await
            .with_context(|| format!("creating a VM in {group}"))?
    };
    if g.json {
        print_json(&created)?;
    } else if g.quiet {
        println!("{}", created.hostname);
    } else {
        println!(
            "{}",
            started_line(
                &created.hostname,
                created.state,
                created.ip.as_deref(),
                created.elapsed_ms
            )
        );
    }
    Ok(exit::OK)
}

async fn logs(g: &GlobalArgs, c: &TineClient, args: &LogsArgs) -> anyhow::Result<i32> {
    let logs = c.logs(&args.vm, args.lines).await?;
    if g.json {
        print_json(&logs)?;
    } else {
        // The serial console is the guest's: its escapes must not reach
        // the terminal. A console's line ends are CRLF.
        for line in logs.content.lines() {
            println!("{}", output::sanitize(line.trim_end_matches('\r'), true));
        }
    }
    Ok(exit::OK)
}

async fn ready(g: &GlobalArgs, c: &TineClient, args: &ReadyArgs) -> anyhow::Result<i32> {
    let result = {
        let _p = Progress::start(g, format!("waiting for {}'s agent", args.vm));
        c.health(&args.vm, Wait::Agent, Some(args.timeout)).await
    };
    match result {
        Ok(h) => {
            if g.json {
                print_json(&h)?;
            } else if g.quiet {
                println!("{}", h.hostname);
            } else {
                println!("{} ready", h.hostname);
            }
            Ok(exit::OK)
        }
        Err(e)
            if e.is_timeout() || e.code() == Some(tine_proto::api::ErrorCode::AgentUnavailable) =>
        {
            let code = e.code().map(output::code_name).unwrap_or_default();
            let line = format!("tine: {}: {e} ({code})", args.vm);
            eprintln!("{}", output::sanitize(&line, false));
            Ok(1)
        }
        Err(e) => Err(e.into()),
    }
}

async fn shutdown(g: &GlobalArgs, c: &TineClient, args: &ShutdownArgs) -> anyhow::Result<i32> {
    let action = if args.poweroff {
        ShutdownAction::Poweroff
    } else {
        ShutdownAction::Shutdown
    };
    let r = {
        let _p = Progress::start(g, format!("stopping {}", args.vm));
        c.shutdown(&args.vm, action, args.timeout).await?
    };
    if g.json {
        print_json(&r)?;
    } else if g.quiet {
        println!("{}", r.hostname);
    } else {
        let how = r
            .stop_mode
            .map(|m| format!(", {}", output::stop_mode_text(m)))
            .unwrap_or_default();
        println!(
            "{} {} (in {}{how})",
            r.hostname,
            r.state,
            output::millis(r.elapsed_ms)
        );
    }
    Ok(exit::OK)
}

async fn relaunch(g: &GlobalArgs, c: &TineClient, args: &RelaunchArgs) -> anyhow::Result<i32> {
    let wait = wait_of(&args.wait);
    let r = {
        let _p = Progress::start(g, format!("relaunching {}", args.vm));
        c.relaunch(&args.vm, wait, args.wait.timeout).await?
    };
    if g.json {
        print_json(&r)?;
    } else if g.quiet {
        println!("{}", r.hostname);
    } else {
        println!("{}", started_line(&r.hostname, r.state, None, r.elapsed_ms));
    }
    Ok(exit::OK)
}

/// "dev-3 suspended: 41M of memory written (snapshot 310 ms, in 420 ms)".
pub fn suspended_line(r: &SuspendResponse) -> String {
    format!(
        "{} {}: {} of memory written (snapshot {}, in {})",
        r.hostname,
        r.state,
        output::size(r.memory_bytes),
        output::millis(r.snapshot_ms),
        output::millis(r.elapsed_ms)
    )
}

async fn suspend(g: &GlobalArgs, c: &TineClient, vm: &str) -> anyhow::Result<i32> {
    let r = {
        let _p = Progress::start(g, format!("suspending {vm}"));
        c.suspend(vm).await?
    };
    if g.json {
        print_json(&r)?;
    } else if g.quiet {
        println!("{}", r.hostname);
    } else {
        println!("{}", suspended_line(&r));
    }
    Ok(exit::OK)
}

async fn restore(g: &GlobalArgs, c: &TineClient, args: &RestoreArgs) -> anyhow::Result<i32> {
    let wait = if args.no_wait {
        Wait::None
    } else {
        Wait::Agent
    };
    let r = {
        let _p = Progress::start(g, format!("restoring {}", args.vm));
        c.restore(&args.vm, wait, args.timeout).await?
    };
    if g.json {
        print_json(&r)?;
    } else if g.quiet {
        println!("{}", r.hostname);
    } else {
        println!("{}", started_line(&r.hostname, r.state, None, r.elapsed_ms));
    }
    Ok(exit::OK)
}

async fn delete(g: &GlobalArgs, c: &TineClient, args: &DeleteArgs) -> anyhow::Result<i32> {
    let mut first_error = None;
    let mut answers = Vec::new();
    for vm in &args.vms {
        match c.delete(vm).await {
            Ok(r) => {
                if g.quiet {
                    println!("{}", r.hostname);
                } else if !g.json {
                    println!("{} deleted", r.hostname);
                }
                answers.push(r);
            }
            Err(e) => {
                let e = anyhow::Error::new(e).context(format!("deleting {vm}"));
                if first_error.is_some() || args.vms.len() > 1 {
                    eprintln!("{}", exit::message_for(&e));
                    first_error.get_or_insert(exit::code_for(&e));
                } else {
                    return Err(e);
                }
            }
        }
    }
    if g.json {
        if args.vms.len() == 1 {
            if let Some(r) = answers.first() {
                print_json(r)?;
            }
        } else {
            print_json(&answers)?;
        }
    }
    Ok(first_error.unwrap_or(exit::OK))
}

async fn tag(g: &GlobalArgs, c: &TineClient, command: TagCommand) -> anyhow::Result<i32> {
    let r = match command {
        TagCommand::List(a) => c.tags(&a.vm).await?,
        TagCommand::Add(a) => {
            let patch = TagsPatch {
                add: a.tags,
                ..Default::default()
            };
            c.patch_tags(&a.vm, &patch).await?
        }
        TagCommand::Remove(a) => {
            let patch = TagsPatch {
                remove: a.tags,
                ..Default::default()
            };
            c.patch_tags(&a.vm, &patch).await?
        }
        TagCommand::Replace(a) => {
            let patch = TagsPatch {
                replace: Some(a.tags),
                ..Default::default()
            };
            c.patch_tags(&a.vm, &patch).await?
        }
    };
    if g.json {
        print_json(&r)?;
    } else {
        for t in &r.tags {
            println!("{}", output::sanitize(t, false));
        }
    }
    Ok(exit::OK)
}

async fn commit(g: &GlobalArgs, c: &TineClient, args: CommitArgs) -> anyhow::Result<i32> {
    match args.command {
        Some(CommitCommand::List(l)) => {
            let commits = c
                .list_commits(&CommitQuery {
                    tags: l.tag,
                    cache_key: l.cache_key,
                    source: l.source,
                    mode: l.mode.map(Into::into),
                })
                .await?;
            output::print_list(
                g.json,
                g.quiet,
                &commits,
                |cm| &cm.commit_id,
                "No commits.",
                |commits| output::commit_table(commits, SystemTime::now()),
            )?;
            Ok(exit::OK)
        }
        Some(CommitCommand::Delete { id }) => {
            let r = c.delete_commit(&id).await?;
            if g.json {
                print_json(&r)?;
            } else if g.quiet {
                println!("{}", r.commit_id);
            } else {
                println!("{} {}", r.commit_id, r.status);
            }
            Ok(exit::OK)
        }
        Some(CommitCommand::Pool(p)) => {
            let info = c
                .set_commit_pool(&p.id, if p.group { None } else { p.size })
                .await?;
            if g.json {
                print_json(&info)?;
            } else if g.quiet {
                println!("{}", info.commit_id);
            } else {
                match info.hot_fork_pool {
                    Some(n) => println!("{}: warm pool of {n}", info.commit_id),
                    None => println!("{}: the host group's warm pool", info.commit_id),
                }
            }
            Ok(exit::OK)
        }
        None => {
            let vm = args
                .vm
                .ok_or_else(|| UsageError("name the VM to commit".into()))?;
            let request = CommitRequest {
                tags: args.tag,
                labels: args.label.into_iter().collect(),
                cache_key: args.cache_key,
                mode: args.memory.then_some(tine_client::rest::CommitMode::Memory),
                hot_fork_pool: args.pool,
            };
            let info = {
                let _p = Progress::start(g, format!("committing {vm}"));
                c.commit(&vm, &request)
                    .await
                    .with_context(|| format!("committing {vm}"))?
            };
            if g.json {
                print_json(&info)?;
            } else if g.quiet {
                println!("{}", info.commit_id);
            } else if let Some(pause_us) = info.pause_us {
                println!(
                    "{} committed from {} with its memory (in {}; {} paused for {:.1} ms)",
                    info.commit_id,
                    info.source,
                    output::millis(info.elapsed_ms),
                    info.source,
                    pause_us as f64 / 1000.0
                );
            } else {
                println!(
                    "{} committed from {} (in {})",
                    info.commit_id,
                    info.source,
                    output::millis(info.elapsed_ms)
                );
            }
            Ok(exit::OK)
        }
    }
}

/// The override the policy flags describe: a list named by `--allow` /
/// `--drop` replaces the group's, `--no-allow` / `--no-drop` alone clear it,
/// a list not named is inherited. `None` when no flag is given.
pub fn policy_of(args: &PolicyArgs) -> Option<NetworkPolicy> {
    let list = |given: &[String], clear: bool| {
        if !given.is_empty() {
            Some(given.to_vec())
        } else {
            clear.then(Vec::new)
        }
    };
    let policy = NetworkPolicy {
        allow: list(&args.allow, args.no_allow),
        drop: list(&args.drop, args.no_drop),
    };
    (policy.allow.is_some() || policy.drop.is_some()).then_some(policy)
}

/// `tine vm network ...`.
async fn network(g: &GlobalArgs, c: &TineClient, command: NetworkCommand) -> anyhow::Result<i32> {
    let (vm, info) = match command {
        NetworkCommand::Show(a) => {
            let info = c.network(&a.vm).await?;
            (a.vm, info)
        }
        NetworkCommand::Set(a) => {
            let policy = if a.inherit {
                NetworkPolicy::default()
            } else {
                policy_of(&a.policy).ok_or_else(|| {
                    UsageError(
                        "nothing to set: give --allow, --no-allow, --drop, --no-drop or --inherit"
                            .into(),
                    )
                })?
            };
            let info = c
                .set_network(&a.vm, &policy)
                .await
                .with_context(|| format!("setting the network policy of {}", a.vm))?;
            (a.vm, info)
        }
        NetworkCommand::Allow(a) | NetworkCommand::Drop(a) if a.dest.is_empty() => {
            return Err(UsageError(format!("{}: no destination given", a.vm)).into());
        }
        NetworkCommand::Allow(a) => {
            let info = add_entries(c, &a.vm, &a.dest, true).await?;
            (a.vm, info)
        }
        NetworkCommand::Drop(a) => {
            let info = add_entries(c, &a.vm, &a.dest, false).await?;
            (a.vm, info)
        }
    };
    if g.json {
        print_json(&info)?;
    } else if g.quiet {
        println!("{vm}");
    } else {
        print!("{}", output::fields(&output::network_pairs(&info)));
    }
    Ok(exit::OK)
}

/// Adds `dest` to the VM's allow list in force (`allow`) or its drop list,
/// keeping the other list as it is (inherited or overridden).
async fn add_entries(
    c: &TineClient,
    vm: &str,
    dest: &[String],
    allow: bool,
) -> anyhow::Result<VmNetworkInfo> {
    let now = c.network(vm).await?;
    let current = now.overrides.clone().unwrap_or_default();
    let mut list = if allow {
        now.effective.allow.clone()
    } else {
        now.effective.drop.clone()
    };
    for d in dest {
        if !list.contains(d) {
            list.push(d.clone());
        }
    }
    let policy = if allow {
        NetworkPolicy {
            allow: Some(list),
            drop: current.drop,
        }
    } else {
        NetworkPolicy {
            allow: current.allow,
            drop: Some(list),
        }
    };
    c.set_network(vm, &policy)
        .await
        .with_context(|| format!("changing the network policy of {vm}"))
}

/// The fork request the flags describe.
pub fn fork_request(args: &ForkArgs) -> ForkRequest {
    let network = if args.network.is_some() {
        Some(ForkNetwork::None)
    } else {
        policy_of(&args.policy).map(ForkNetwork::Policy)
    };
    ForkRequest {
        tags: (!args.tag.is_empty() || args.replace_tags).then(|| args.tag.clone()),
        tag_mode: args.replace_tags.then_some(TagMode::Replace),
        name: args.name.clone(),
        persistent: args.rm.then_some(false),
        fixups: if args.no_fixups {
            Some(vec![])
        } else if args.fixup.is_empty() {
            None
        } else {
            Some(args.fixup.clone())
        },
        no_secrets: args.no_secrets,
        secrets: (!args.secrets.is_empty()).then(|| args.secrets.clone()),
        cpus: args.cpu,
        ram_bytes: args.ram_mb.map(mib),
        network,
    }
}

async fn fork(g: &GlobalArgs, c: &TineClient, args: ForkArgs) -> anyhow::Result<i32> {
    let request = fork_request(&args);
    let wait = wait_of(&args.wait);
    let r = {
        let _p = Progress::start(g, format!("forking {}", args.commit));
        c.fork(&args.commit, &request, wait, args.wait.timeout)
            .await
            .with_context(|| format!("forking {}", args.commit))?
    };
    if g.json {
        print_json(&r)?;
    } else if g.quiet {
        println!("{}", r.hostname);
    } else {
        println!(
            "{}, forked from {}",
            started_line(&r.hostname, r.child_status, None, r.elapsed_ms),
            r.commit_id
        );
    }
    Ok(exit::OK)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::Cli;
    use clap::Parser;

    fn fork_args(args: &[&str]) -> ForkArgs {
        let cli =
            Cli::try_parse_from(["tine", "vm", "fork", "cmt-1"].iter().chain(args)).expect("parse");
        match cli.command {
            Command::Vm {
                command: VmCommand::Fork(f),
            } => f,
            other => panic!("not fork: {other:?}"),
        }
    }

    #[test]
    fn fork_flags_become_the_documented_body() {
        let body =
            |args: &[&str]| serde_json::to_value(fork_request(&fork_args(args))).expect("json");
        assert_eq!(body(&[]), serde_json::json!({}));
        assert_eq!(
            body(&["--no-fixups", "--network", "none", "--rm"]),
            serde_json::json!({"fixups": [], "network": "none", "persistent": false})
        );
        assert_eq!(
            body(&[
                "--tag",
                "a=b",
                "--replace-tags",
                "--fixup",
                "hostname",
                "--cpu",
                "2",
                "--ram-mb",
                "1024"
            ]),
            serde_json::json!({
                "tags": ["a=b"], "tag_mode": "replace", "fixups": ["hostname"],
                "cpus": 2, "ram_bytes": 1073741824u64
            })
        );
        assert_eq!(
            body(&["--replace-tags"]),
            serde_json::json!({"tags": [], "tag_mode": "replace"})
        );
        assert_eq!(
            body(&["--drop", "0.0.0.0/0", "--no-secrets", "--name", "f"]),
            serde_json::json!({"network": {"drop": ["0.0.0.0/0"]}, "no_secrets": true, "name": "f"})
        );
        // The seed's closed runner, as typed.
        assert_eq!(
            body(&["--tag", "role=runner", "--no-allow", "--drop", "0.0.0.0/0"]),
            serde_json::json!({
                "tags": ["role=runner"],
                "network": {"allow": [], "drop": ["0.0.0.0/0"]}
            })
        );
        assert_eq!(
            body(&["--no-drop", "--allow", "198.51.100.7:80"]),
            serde_json::json!({"network": {"allow": ["198.51.100.7:80"], "drop": []}})
        );
        assert_eq!(
            body(&["--no-allow", "--allow", "198.51.100.7"]),
            serde_json::json!({"network": {"allow": ["198.51.100.7"]}}),
            "--allow names the list --no-allow would clear"
        );
    }

    #[test]
    fn add_and_network_set_take_the_same_policy_flags() {
        let cli = Cli::try_parse_from([
            "tine",
            "vm",
            "add",
            "g",
            "--no-allow",
            "--drop",
            "0.0.0.0/0",
        ])
        .expect("parse");
        let Command::Vm {
            command: VmCommand::Add(a),
        } = cli.command
        else {
            panic!("not add");
        };
        assert_eq!(
            policy_of(&a.policy),
            Some(NetworkPolicy {
                allow: Some(vec![]),
                drop: Some(vec!["0.0.0.0/0".into()])
            })
        );
        assert_eq!(policy_of(&PolicyArgs::default()), None);
        for line in [
            &[
                "tine",
                "vm",
                "network",
                "set",
                "g-1",
                "--inherit",
                "--no-allow",
            ][..],
            &["tine", "vm", "network", "allow", "g-1"][..],
            &["tine", "vm", "fork", "c", "--network", "none", "--no-allow"][..],
        ] {
            assert!(Cli::try_parse_from(line).is_err(), "{line:?} accepted");
        }
        for line in [
            &["tine", "vm", "network", "show", "g-1"][..],
            &[
                "tine",
                "vm",
                "network",
                "set",
                "g-1",
                "--allow",
                "1.2.3.4:443",
            ][..],
            &[
                "tine",
                "vm",
                "network",
                "drop",
                "g-1",
                "0.0.0.0/0",
                "10.0.0.0/8",
            ][..],
        ] {
            Cli::try_parse_from(line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
        }
    }

    #[test]
    fn confirmations_are_short() {
        assert_eq!(
            started_line("dev-3", VmState::Running, None, 812),
            "dev-3 running (agent ready in 812 ms)"
        );
        assert_eq!(
            started_line("dev-3", VmState::Starting, Some("10.0.0.3"), 40),
            "dev-3 starting, ip 10.0.0.3 (in 40 ms)"
        );
        let r = SuspendResponse {
            hostname: "dev-3".into(),
            state: VmState::Suspended,
            memory_bytes: 41 << 20,
            snapshot_ms: 310,
            elapsed_ms: 420,
        };
        assert_eq!(
            suspended_line(&r),
            "dev-3 suspended: 41M of memory written (snapshot 310 ms, in 420 ms)"
        );
    }
}
