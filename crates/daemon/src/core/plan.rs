//! Checking requests against their host group: what a new VM or fork will
//! be, before anything is recorded. Pure functions of the request, the
//! group and the commit.

use tine_proto::agent::MAX_FRAME_LEN;
use tine_proto::api::{self, CreateVmRequest, Fixup, ForkNetwork, ForkRequest, TagMode};

use super::error::{Error, Result};
use crate::config::{HostGroup, MIN_RAM_MB};
use crate::db::{CommitRecord, NewVm};
use crate::network::{NetMode, PolicyEntry};

/// Most bytes of userdata: it travels to the agent in one frame, with its
/// request around it.
pub const MAX_USERDATA: usize = MAX_FRAME_LEN as usize - 4096;

/// Checks a tag: 1..=128 printable characters without spaces or commas.
pub fn validate_tag(tag: &str) -> Result<()> {
    if tag.is_empty()
        || tag.len() > 128
        || tag
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == ',')
    {
        return Err(Error::BadRequest(format!(
            "tag `{tag}` is invalid: use 1-128 characters without spaces or commas, like key=value"
        )));
    }
    Ok(())
}

/// Checks a friendly name: like a hostname label.
pub fn validate_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        && !name.starts_with('-');
    if ok {
        Ok(())
    } else {
        Err(Error::BadRequest(format!(
            "name `{name}` is invalid: use 1-63 letters, digits, '-', '_' or '.'"
        )))
    }
}

/// Checks a per-VM policy override: every entry must be a CIDR, an IP, or
/// either with `:port`.
pub fn validate_policy(policy: &api::NetworkPolicy) -> Result<()> {
    for entry in policy
        .allow
        .iter()
        .flatten()
        .chain(policy.drop.iter().flatten())
    {
        entry
            .parse::<PolicyEntry>()
            .map_err(|e| Error::BadRequest(format!("network policy entry `{entry}`: {e}")))?;
    }
    Ok(())
}

/// Checks a per-VM policy override against the VM's group: only isolated
/// groups have a policy, so an override elsewhere would do nothing.
pub fn validate_group_policy(group: &HostGroup, policy: &api::NetworkPolicy) -> Result<()> {
    if group.network.mode != NetMode::Isolated {
        return Err(Error::BadRequest(format!(
            "network: allow/drop apply only in isolated mode; host group `{}` has network mode {}",
            group.name, group.network.mode
        )));
    }
    validate_policy(policy)
}

/// Checks userdata against what the agent protocol can carry.
pub fn validate_userdata(userdata: &str) -> Result<()> {
    if userdata.len() > MAX_USERDATA {
        return Err(Error::BadRequest(format!(
            "userdata is {} bytes; at most {MAX_USERDATA} fit in one agent message",
            userdata.len()
        )));
    }
    Ok(())
}

/// The shape of a new VM: cpus, RAM, tags and name checked against the
/// group. `name_taken` says whether the friendly name is already used.
pub struct Shape<'a> {
    /// vCPUs asked for (default: the group's).
    pub cpus: Option<u32>,
    /// RAM asked for (default: the group's).
    pub ram_bytes: Option<u64>,
    /// Tags.
    pub tags: Vec<String>,
    /// Friendly name.
    pub name: Option<&'a str>,
    /// Whether that name is used already.
    pub name_taken: bool,
}

/// Checks a [`Shape`] against `group`; returns (cpus, ram, tags).
fn shape(group: &HostGroup, s: Shape<'_>) -> Result<(u32, u64, Vec<String>)> {
    let cpus = s.cpus.unwrap_or(group.cpus);
    if cpus == 0 || cpus > group.max_cpus() {
        return Err(Error::BadRequest(format!(
            "cpus {cpus} is outside 1..={} allowed by host group `{}`",
            group.max_cpus(),
            group.name
        )));
    }
    let ram_bytes = s.ram_bytes.unwrap_or(group.ram_mb << 20);
    let max = group.max_ram_mb() << 20;
    if ram_bytes > max || ram_bytes < (MIN_RAM_MB << 20) || !ram_bytes.is_multiple_of(1 << 20) {
        return Err(Error::BadRequest(format!(
            "ram_bytes {ram_bytes} is outside {}..={max} (whole MiB) allowed by host group `{}`",
            MIN_RAM_MB << 20,
            group.name
        )));
    }
    for t in &s.tags {
        validate_tag(t)?;
    }
    let mut tags = s.tags;
    if let Some(name) = s.name {
        validate_name(name)?;
        if s.name_taken {
            return Err(Error::Conflict(format!(
                "the name `{name}` is already used"
            )));
        }
        tags.retain(|t| !t.starts_with("name="));
        tags.push(format!("name={name}"));
    }
    Ok((cpus, ram_bytes, tags))
}

/// A new VM from a create request; `group_userdata` is the group's script
/// (read only when the request has none).
/// Refuses the Slicer create fields tine cannot honour, naming each.
fn refuse_unsupported(req: &CreateVmRequest) -> Result<()> {
    let refuse = |why: String| Err(Error::BadRequest(why));
    if let Some(n) = req.gpu_count.filter(|n| *n > 0) {
        return refuse(format!(
            "gpu_count {n} is not supported: tine has no GPU passthrough (only 0)"
        ));
    }
    if let Some(image) = &req.disk_image {
        return refuse(format!(
            "disk_image `{image}` is not supported: a VM boots its host group's image; define a host group with that image"
        ));
    }
    if let Some(ip) = &req.ip {
        return refuse(format!(
            "ip `{ip}` is not supported: tine allocates each VM's address from its host group's network"
        ));
    }
    Ok(())
}

pub fn create(
    group: &HostGroup,
    req: &CreateVmRequest,
    name_taken: bool,
    managed: bool,
    group_userdata: impl FnOnce() -> Result<Option<String>>,
) -> Result<NewVm> {
    refuse_unsupported(req)?;
    let (cpus, ram_bytes, tags) = shape(
        group,
        Shape {
            cpus: req.cpus,
            ram_bytes: req.ram_bytes,
            tags: req.tags.clone(),
            name: req.name.as_deref(),
            name_taken,
        },
    )?;
    let userdata = match &req.userdata {
        Some(u) => Some(u.clone()),
        None => group_userdata()?,
    };
    if let Some(u) = &userdata {
        validate_userdata(u)?;
    }
    if let Some(p) = &req.network {
        validate_group_policy(group, p)?;
    }
    crate::ssh_keys::check(&req.ssh_keys)?;
    Ok(NewVm {
        host_group: group.name.clone(),
        cpus,
        ram_bytes,
        persistent: managed || req.persistent.unwrap_or(group.persistent),
        managed,
        tags,
        name: req.name.clone(),
        userdata,
        policy: req.network.clone().map(ForkNetwork::Policy),
        parent_commit_id: None,
        fixups: None,
        booted_once: false,
        secrets: req.secrets.clone(),
        ssh_keys: req.ssh_keys.clone(),
    })
}

/// A hot fork of memory commit `commit`: [`fork`], then what resuming
/// the commit's guest demands. Its shape is the commit's (a changed CPU
/// or RAM size is refused: the guest's memory and vCPUs are restored as
/// they were); it gets every identity fix-up; it has a NIC exactly when
/// the source had one (a guest cannot lose or gain a device it runs with).
pub fn hot_fork(
    group: &HostGroup,
    commit: &CommitRecord,
    req: &ForkRequest,
    name_taken: bool,
) -> Result<NewVm> {
    let id = &commit.id;
    if let Some(cpus) = req.cpus.filter(|&c| c != commit.cpus) {
        return Err(Error::BadRequest(format!(
            "{id} is a memory commit of a VM with {} vCPUs: a hot fork resumes that guest, so it cannot have {cpus} (resizing is not supported; fork a disk commit to choose)",
            commit.cpus
        )));
    }
    if let Some(ram) = req.ram_bytes.filter(|&r| r != commit.ram_bytes) {
        return Err(Error::BadRequest(format!(
            "{id} is a memory commit of a VM with {} MiB of RAM: a hot fork resumes that guest's memory, so it cannot have {} MiB (resizing is not supported)",
            commit.ram_bytes >> 20,
            ram >> 20
        )));
    }
    if let Some(list) = &req.fixups {
        let missing: Vec<&str> = Fixup::ALL
            .iter()
            .filter(|f| !list.contains(f))
            .map(|f| f.as_str())
            .collect();
        if !missing.is_empty() {
            return Err(Error::BadRequest(format!(
                "a hot fork always gets its own hostname, machine-id and SSH host keys (it runs its source's memory); fixups leaves out {}",
                missing.join(", ")
            )));
        }
    }
    let source_nic = commit.has_nic.unwrap_or(false);
    match &req.network {
        Some(ForkNetwork::None) if source_nic => {
            return Err(Error::BadRequest(format!(
                "{id}'s source had a NIC, and a hot fork resumes its guest with it: `network: none` needs a commit of a VM without one"
            )))
        }
        Some(ForkNetwork::Policy(_)) if !source_nic => {
            return Err(Error::BadRequest(format!(
                "{id}'s source had no NIC, so its hot forks have none: a network policy does not apply"
            )))
        }
        _ => {}
    }
    if source_nic && group.network.mode == NetMode::None {
        return Err(Error::BadRequest(format!(
            "{id}'s source had a NIC, but host group {} has no network now: its hot forks cannot resume",
            group.name
        )));
    }
    let mut new = fork(group, commit, req, name_taken)?;
    new.fixups = Some(Fixup::ALL.to_vec());
    if !source_nic {
        new.policy = Some(ForkNetwork::None);
    }
    Ok(new)
}

/// A new VM forked from `commit`. It never runs userdata (the commit's
/// source did), so the group's script is not read.
pub fn fork(
    group: &HostGroup,
    commit: &CommitRecord,
    req: &ForkRequest,
    name_taken: bool,
) -> Result<NewVm> {
    let secrets = match (&req.secrets, req.no_secrets) {
        (Some(list), true) if !list.is_empty() => {
            return Err(Error::BadRequest(format!(
            "no_secrets clears the grants, but secrets {list:?} grants some: give one of the two"
        )))
        }
        (_, true) => Vec::new(),
        (Some(list), false) => list.clone(),
        (None, false) => commit.secrets.clone(),
    };
    let fixups = req.fixups.clone().unwrap_or_else(|| Fixup::ALL.to_vec());
    if let Some(ForkNetwork::Policy(p)) = &req.network {
        validate_group_policy(group, p)?;
    }
    let mut tags = match req.tag_mode.unwrap_or_default() {
        TagMode::Append => commit.source_tags.clone(),
        TagMode::Replace => Vec::new(),
    };
    match &req.tags {
        // An empty list clears.
        Some(list) if list.is_empty() => tags.clear(),
        Some(list) => {
            for t in list {
                if !tags.contains(t) {
                    tags.push(t.clone());
                }
            }
        }
        None => {}
    }
    let (cpus, ram_bytes, tags) = shape(
        group,
        Shape {
            cpus: Some(req.cpus.unwrap_or(commit.cpus)),
            ram_bytes: Some(req.ram_bytes.unwrap_or(commit.ram_bytes)),
            tags,
            name: req.name.as_deref(),
            name_taken,
        },
    )?;
    Ok(NewVm {
        host_group: group.name.clone(),
        cpus,
        ram_bytes,
        persistent: req.persistent.unwrap_or(true),
        managed: false,
        tags,
        name: req.name.clone(),
        userdata: None,
        policy: req.network.clone(),
        parent_commit_id: Some(commit.id.clone()),
        fixups: Some(fixups),
        booted_once: true,
        secrets,
        // The source's keys are on the disk already.
        ssh_keys: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group() -> HostGroup {
        serde_yaml::from_str("name: dev\ncpus: 1\nram_mb: 256\n").expect("group")
    }

    fn commit() -> CommitRecord {
        CommitRecord {
            id: "cmt-dev-1".into(),
            host_group: "dev".into(),
            source: "dev-1".into(),
            disk: "/d".into(),
            tags: vec![],
            labels: Default::default(),
            source_tags: vec!["role=builder".into()],
            cache_key: None,
            parent_commit_id: None,
            cpus: 1,
            ram_bytes: 256 << 20,
            size_bytes: 0,
            created_ms: 0,
            elapsed_ms: 0,
            secrets: vec!["db".into(), "api".into()],
            mode: tine_proto::api::CommitMode::Disk,
            snapshot: None,
            memory_bytes: None,
            has_nic: None,
            hot_fork_pool: None,
        }
    }

    #[test]
    fn a_fork_never_reads_the_groups_userdata_and_gets_every_fixup_by_default() {
        let vm = fork(&group(), &commit(), &ForkRequest::default(), false).expect("fork");
        assert_eq!(vm.userdata, None);
        assert_eq!(vm.fixups, Some(Fixup::ALL.to_vec()));
        assert_eq!(vm.tags, vec!["role=builder".to_string()]);
        let none = ForkRequest {
            fixups: Some(vec![]),
            ..ForkRequest::default()
        };
        assert_eq!(
            fork(&group(), &commit(), &none, false)
                .expect("fork")
                .fixups,
            Some(vec![])
        );
    }

    #[test]
    fn a_policy_is_refused_outside_isolated_groups() {
        let closed = ForkRequest {
            network: Some(ForkNetwork::Policy(api::NetworkPolicy {
                allow: Some(vec![]),
                drop: Some(vec!["0.0.0.0/0".into()]),
            })),
            ..ForkRequest::default()
        };
        let err = fork(&group(), &commit(), &closed, false).expect_err("mode none");
        assert!(
            err.to_string().contains(
                "allow/drop apply only in isolated mode; host group `dev` has network mode none"
            ),
            "{err}"
        );
        let iso: HostGroup = serde_yaml::from_str(
            "name: iso\ncpus: 1\nram_mb: 256\nnetwork:\n  mode: isolated\n  allow: [0.0.0.0/0]\n",
        )
        .expect("group");
        let vm = fork(&iso, &commit(), &closed, false).expect("isolated");
        assert_eq!(vm.policy, closed.network);
        let no_nic = ForkRequest {
            network: Some(ForkNetwork::None),
            ..ForkRequest::default()
        };
        fork(&group(), &commit(), &no_nic, false).expect("network none is fine anywhere");
    }

    #[test]
    fn a_fork_inherits_replaces_or_clears_its_sources_grants() {
        let inherit = fork(&group(), &commit(), &ForkRequest::default(), false).expect("fork");
        assert_eq!(inherit.secrets, ["db", "api"]);
        let replace = ForkRequest {
            secrets: Some(vec!["api".into()]),
            ..ForkRequest::default()
        };
        let vm = fork(&group(), &commit(), &replace, false).expect("fork");
        assert_eq!(vm.secrets, ["api"]);
        for clear in [
            ForkRequest {
                no_secrets: true,
                ..ForkRequest::default()
            },
            ForkRequest {
                secrets: Some(vec![]),
                ..ForkRequest::default()
            },
        ] {
            let vm = fork(&group(), &commit(), &clear, false).expect("fork");
            assert!(vm.secrets.is_empty(), "{clear:?}");
        }
        let both = ForkRequest {
            no_secrets: true,
            secrets: Some(vec!["db".into()]),
            ..ForkRequest::default()
        };
        let err = fork(&group(), &commit(), &both, false).expect_err("contradiction");
        assert!(
            matches!(err, Error::BadRequest(ref m) if m.contains("no_secrets")),
            "{err}"
        );
    }

    #[test]
    fn create_takes_grants_and_checks_ssh_keys() {
        let req = CreateVmRequest {
            secrets: vec!["db".into()],
            ssh_keys: vec!["ssh-ed25519 AAAA me".into()],
            ..CreateVmRequest::default()
        };
        let vm = create(&group(), &req, false, false, || Ok(None)).expect("create");
        assert_eq!((vm.secrets.len(), vm.ssh_keys.len()), (1, 1));
        let bad = CreateVmRequest {
            ssh_keys: vec!["not-a-key".into()],
            ..CreateVmRequest::default()
        };
        let err = create(&group(), &bad, false, false, || Ok(None)).expect_err("bad key");
        assert!(err.to_string().contains("ssh_keys[0]"), "{err}");
    }

    #[test]
    fn tag_modes_append_replace_and_clear() {
        let replace = ForkRequest {
            tags: Some(vec!["role=runner".into()]),
            tag_mode: Some(TagMode::Replace),
            ..ForkRequest::default()
        };
        let vm = fork(&group(), &commit(), &replace, false).expect("fork");
        assert_eq!(vm.tags, vec!["role=runner".to_string()]);
        let append = ForkRequest {
            tags: Some(vec!["role=runner".into()]),
            ..ForkRequest::default()
        };
        let vm = fork(&group(), &commit(), &append, false).expect("fork");
        assert_eq!(
            vm.tags,
            vec!["role=builder".to_string(), "role=runner".into()]
        );
        let clear = ForkRequest {
            tags: Some(vec![]),
            ..ForkRequest::default()
        };
        assert!(fork(&group(), &commit(), &clear, false)
            .expect("fork")
            .tags
            .is_empty());
    }

    #[test]
    fn userdata_larger_than_one_agent_frame_is_refused_at_create() {
        let req = CreateVmRequest {
            userdata: Some("x".repeat(1_500_000)),
            ..CreateVmRequest::default()
        };
        let err = create(&group(), &req, false, false, || Ok(None)).expect_err("too big");
        assert!(
            matches!(err, Error::BadRequest(ref m) if m.contains("userdata")),
            "{err}"
        );
        let ok = CreateVmRequest {
            userdata: Some("echo hi".into()),
            ..CreateVmRequest::default()
        };
        assert!(create(&group(), &ok, false, false, || Ok(None)).is_ok());
    }

    #[test]
    fn the_groups_userdata_is_read_only_when_the_request_has_none() {
        let req = CreateVmRequest {
            userdata: Some("mine".into()),
            ..CreateVmRequest::default()
        };
        let vm = create(&group(), &req, false, false, || {
            Err(Error::Failed("must not be read".into()))
        })
        .expect("create");
        assert_eq!(vm.userdata.as_deref(), Some("mine"));
    }

    #[test]
    fn names_and_limits_are_checked() {
        let req = CreateVmRequest {
            name: Some("web".into()),
            ..CreateVmRequest::default()
        };
        assert!(matches!(
            create(&group(), &req, true, false, || Ok(None)),
            Err(Error::Conflict(_))
        ));
        let req = CreateVmRequest {
            cpus: Some(99),
            ..CreateVmRequest::default()
        };
        assert!(matches!(
            create(&group(), &req, false, false, || Ok(None)),
            Err(Error::BadRequest(_))
        ));
    }
}
