//! Errors of the networking module.

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;

use super::config::NetMode;

/// Why a network could not be validated, planned, set up or torn down.
#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    /// The host group has an empty name.
    #[error("host group name is empty")]
    EmptyGroup,
    /// A field was set that the group's mode does not use.
    #[error("group {group:?}: `{field}` is not used in network mode {mode}")]
    FieldNotForMode {
        /// The host group.
        group: String,
        /// The offending field of the `network` block.
        field: &'static str,
        /// The group's mode.
        mode: NetMode,
    },
    /// Bridge mode was configured without a `cidr`.
    #[error("group {group:?}: bridge mode needs a `cidr` (e.g. 169.254.100.0/24)")]
    CidrRequired {
        /// The host group.
        group: String,
    },
    /// The CIDR has bits set past its prefix length.
    #[error("group {group:?}: cidr {cidr} has host bits set; did you mean {}?", cidr.trunc())]
    CidrHostBits {
        /// The host group.
        group: String,
        /// The configured network.
        cidr: Ipv4Net,
    },
    /// The CIDR is too small to hold the gateway and one VM.
    #[error("group {group:?}: cidr {cidr} is too small: the prefix must be /30 or shorter")]
    CidrTooSmall {
        /// The host group.
        group: String,
        /// The configured network.
        cidr: Ipv4Net,
    },
    /// Two groups' address ranges overlap.
    #[error(
        "groups {a:?} ({cidr_a}) and {b:?} ({cidr_b}) have overlapping address ranges; \
         set a distinct `cidr` on one of them"
    )]
    OverlappingGroups {
        /// The first group.
        a: String,
        /// Its range.
        cidr_a: Ipv4Net,
        /// The second group.
        b: String,
        /// Its range.
        cidr_b: Ipv4Net,
    },
    /// Two groups use the same bridge.
    #[error("groups {a:?} and {b:?} both use bridge {bridge:?}")]
    SharedBridge {
        /// The first group.
        a: String,
        /// The second group.
        b: String,
        /// The bridge name.
        bridge: String,
    },
    /// An `allow` or `drop` entry could not be parsed.
    #[error("bad {list} entry {entry:?}: {reason}")]
    BadPolicyEntry {
        /// `allow` or `drop`.
        list: &'static str,
        /// The entry as written.
        entry: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An interface name is not usable.
    #[error("bad interface name {name:?}: {reason}")]
    BadInterfaceName {
        /// The name.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The manager's options are not usable.
    #[error("bad network manager option {option}={value:?}: {reason}")]
    BadOption {
        /// Which option.
        option: &'static str,
        /// Its value.
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The VM's hostname cannot name an interface.
    #[error("bad hostname {hostname:?}: {reason}")]
    BadHostname {
        /// The hostname.
        hostname: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A stored VM network record (`VmNetwork`) is inconsistent.
    #[error("VM network record for TAP {tap:?} is inconsistent: {reason}")]
    BadRecord {
        /// The record's TAP.
        tap: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Every address of the group's range is in use.
    #[error("group {group:?}: no free address left in {cidr} ({capacity} VMs)")]
    PoolExhausted {
        /// The host group.
        group: String,
        /// The range that is full.
        cidr: Ipv4Net,
        /// How many VMs the range holds.
        capacity: u32,
    },
    /// A requested address does not belong to the group's range.
    #[error("group {group:?}: address {address} is not a VM address of {cidr}")]
    AddressOutOfRange {
        /// The host group.
        group: String,
        /// The address.
        address: Ipv4Addr,
        /// The group's range.
        cidr: Ipv4Net,
    },
    /// The TAP name derived from a hostname is already used by another VM.
    #[error("interface {name:?} for VM {hostname:?} already belongs to VM {owner:?}")]
    NameCollision {
        /// The interface name.
        name: String,
        /// The VM being attached.
        hostname: String,
        /// The VM recorded on the interface (its alias).
        owner: String,
    },
    /// An interface with the TAP's or bridge's name exists but is of another
    /// kind.
    #[error("interface {name:?} exists but is a {kind:?} device, not a {expected}")]
    WrongKind {
        /// The interface name.
        name: String,
        /// What it is.
        kind: String,
        /// What it should be.
        expected: &'static str,
    },
    /// A route netlink request (links, addresses) failed.
    #[error("cannot {operation}")]
    Netlink {
        /// What was asked, e.g. `create bridge tbr-g`.
        operation: String,
        /// The kernel's answer.
        #[source]
        source: std::io::Error,
    },
    /// The kernel's answer to a netlink request could not be decoded.
    #[error("unexpected netlink answer to `{operation}`: {reason}")]
    NetlinkReply {
        /// What was asked.
        operation: String,
        /// What was wrong.
        reason: String,
    },
    /// A TAP could not be created through `/dev/net/tun`.
    #[error("cannot create TAP {name:?}: {operation} failed")]
    Tun {
        /// The step that failed (`open /dev/net/tun`, `TUNSETIFF`, ...).
        operation: &'static str,
        /// The TAP.
        name: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The `nft` command could not be run.
    #[error("cannot run `nft` (install nftables)")]
    NftSpawn(#[source] std::io::Error),
    /// An nft script was refused; nothing of it was applied.
    #[error("nft failed: {error}\n--- input ---\n{input}")]
    Nft {
        /// What nft said.
        error: String,
        /// The script.
        input: String,
    },
    /// What nft listed could not be understood.
    #[error("unexpected output from nft `{command}`: {reason}")]
    Output {
        /// The command line.
        command: String,
        /// What was wrong.
        reason: String,
    },
    /// A sysctl could not be read or written.
    #[error("cannot set {path}")]
    Sysctl {
        /// The /proc/sys path.
        path: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}
