//! Links and addresses over rtnetlink, in-process (what `ip link` and
//! `ip addr` do, without a process per change).

use std::net::{IpAddr, Ipv4Addr};

use netlink_packet_core::{Nla as _, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REPLACE};
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use netlink_packet_route::link::{
    InfoData, InfoKind, LinkAttribute, LinkFlags, LinkInfo, LinkMessage,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::protocols::NETLINK_ROUTE;

use super::error::NetworkError;
use super::netlink::NetlinkSocket;

/// `IFLA_TUN_TYPE` inside a tun device's `IFLA_INFO_DATA`.
const IFLA_TUN_TYPE: u16 = 3;
/// Its value for a TAP (`IFF_TAP`); a TUN has `IFF_TUN`.
const TUN_TYPE_TAP: u8 = libc::IFF_TAP as u8;

/// One interface as the kernel describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Link {
    pub index: u32,
    pub name: String,
    /// `tap`, `tun`, `bridge`, `veth`…; `None` for plain devices.
    pub kind: Option<String>,
    /// The interface index of its bridge.
    pub master: Option<u32>,
    pub alias: Option<String>,
    pub up: bool,
}

impl Link {
    fn from_message(message: &LinkMessage) -> Option<Self> {
        let mut link = Link {
            index: message.header.index,
            name: String::new(),
            kind: None,
            master: None,
            alias: None,
            up: message.header.flags.contains(LinkFlags::Up),
        };
        let mut tun_type = None;
        for attribute in &message.attributes {
            match attribute {
                LinkAttribute::IfName(name) => link.name = name.clone(),
                LinkAttribute::IfAlias(alias) => link.alias = Some(alias.clone()),
                LinkAttribute::Controller(index) if *index != 0 => link.master = Some(*index),
                LinkAttribute::LinkInfo(infos) => {
                    for info in infos {
                        match info {
                            LinkInfo::Kind(kind) => link.kind = Some(kind.to_string()),
                            LinkInfo::Data(InfoData::Tun(data)) => {
                                tun_type = data
                                    .iter()
                                    .find(|nla| nla.kind() == IFLA_TUN_TYPE)
                                    .and_then(|nla| {
                                        let mut value = vec![0; nla.value_len()];
                                        nla.emit_value(&mut value);
                                        value.first().copied()
                                    });
                            }
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        // A tun device's data says whether it is a TAP.
        if link.kind.as_deref() == Some("tun") && tun_type == Some(TUN_TYPE_TAP) {
            link.kind = Some("tap".to_owned());
        }
        (!link.name.is_empty()).then_some(link)
    }
}

/// A route netlink socket.
#[derive(Debug)]
pub(crate) struct Rtnl {
    socket: NetlinkSocket,
}

impl Rtnl {
    /// Opens a socket in the caller's network namespace.
    pub(crate) fn open() -> Result<Self, NetworkError> {
        Ok(Self {
            socket: NetlinkSocket::open(NETLINK_ROUTE, "route")?,
        })
    }

    fn request(
        &mut self,
        operation: &str,
        message: RouteNetlinkMessage,
        flags: u16,
    ) -> Result<Vec<RouteNetlinkMessage>, NetworkError> {
        self.socket.request(operation, message, flags)
    }

    /// The interface called `name`, if any.
    pub(crate) fn link(&mut self, name: &str) -> Result<Option<Link>, NetworkError> {
        let mut message = LinkMessage::default();
        message
            .attributes
            .push(LinkAttribute::IfName(name.to_owned()));
        let operation = format!("look up interface {name}");
        match self.request(&operation, RouteNetlinkMessage::GetLink(message), 0) {
            Ok(answer) => Ok(answer.iter().find_map(|m| match m {
                RouteNetlinkMessage::NewLink(link) => {
                    Link::from_message(link).filter(|l| l.name == name)
                }
                _ => None,
            })),
            Err(NetworkError::Netlink { source, .. })
                if source.raw_os_error() == Some(libc::ENODEV) =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Every interface of the host.
    pub(crate) fn links(&mut self) -> Result<Vec<Link>, NetworkError> {
        let answer = self.request(
            "list interfaces",
            RouteNetlinkMessage::GetLink(LinkMessage::default()),
            NLM_F_DUMP,
        )?;
        Ok(answer
            .iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewLink(link) => Link::from_message(link),
                _ => None,
            })
            .collect())
    }

    /// The IPv4 addresses of interface `index`, with their prefix lengths.
    pub(crate) fn ipv4_addrs(&mut self, index: u32) -> Result<Vec<(Ipv4Addr, u8)>, NetworkError> {
        let mut message = AddressMessage::default();
        message.header.family = AddressFamily::Inet;
        let answer = self.request(
            "list IPv4 addresses",
            RouteNetlinkMessage::GetAddress(message),
            NLM_F_DUMP,
        )?;
        Ok(answer
            .iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewAddress(a)
                    if a.header.index == index && a.header.family == AddressFamily::Inet =>
                {
                    let local = a.attributes.iter().find_map(|attr| match attr {
                        AddressAttribute::Local(IpAddr::V4(ip)) => Some(*ip),
                        _ => None,
                    });
                    let address = a.attributes.iter().find_map(|attr| match attr {
                        AddressAttribute::Address(IpAddr::V4(ip)) => Some(*ip),
                        _ => None,
                    });
                    local.or(address).map(|ip| (ip, a.header.prefix_len))
                }
                _ => None,
            })
            .collect())
    }

    fn address_message(index: u32, address: Ipv4Addr, prefix: u8) -> AddressMessage {
        let mut message = AddressMessage::default();
        message.header.family = AddressFamily::Inet;
        message.header.prefix_len = prefix;
        message.header.index = index;
        message.attributes = vec![
            AddressAttribute::Local(IpAddr::V4(address)),
            AddressAttribute::Address(IpAddr::V4(address)),
        ];
        message
    }

    /// Adds `address/prefix` to interface `index` (`ip addr add`), or with
    /// `replace` updates it in place when it is there (`ip addr replace`).
    pub(crate) fn add_addr(
        &mut self,
        index: u32,
        address: Ipv4Addr,
        prefix: u8,
        replace: bool,
    ) -> Result<(), NetworkError> {
        let flags = NLM_F_CREATE | if replace { NLM_F_REPLACE } else { NLM_F_EXCL };
        let operation = format!("add address {address}/{prefix} to interface {index}");
        self.request(
            &operation,
            RouteNetlinkMessage::NewAddress(Self::address_message(index, address, prefix)),
            flags,
        )
        .map(drop)
    }

    /// Removes `address/prefix` from interface `index`.
    pub(crate) fn del_addr(
        &mut self,
        index: u32,
        address: Ipv4Addr,
        prefix: u8,
    ) -> Result<(), NetworkError> {
        let operation = format!("remove address {address}/{prefix} from interface {index}");
        self.request(
            &operation,
            RouteNetlinkMessage::DelAddress(Self::address_message(index, address, prefix)),
            0,
        )
        .map(drop)
    }

    /// Changes interface `index` in one message: its alias, its bridge
    /// (`Some(0)`: none) and whether it is up, each only when given.
    pub(crate) fn set_link(
        &mut self,
        index: u32,
        change: LinkChange<'_>,
    ) -> Result<(), NetworkError> {
        let mut message = LinkMessage::default();
        message.header.index = index;
        if let Some(alias) = change.alias {
            message
                .attributes
                .push(LinkAttribute::IfAlias(alias.to_owned()));
        }
        if let Some(master) = change.master {
            message.attributes.push(LinkAttribute::Controller(master));
        }
        if let Some(up) = change.up {
            if up {
                message.header.flags = LinkFlags::Up;
            }
            message.header.change_mask = LinkFlags::Up;
        }
        let operation = format!("change interface {index} ({change:?})");
        self.request(&operation, RouteNetlinkMessage::SetLink(message), 0)
            .map(drop)
    }

    /// Deletes interface `index`.
    pub(crate) fn del_link(&mut self, index: u32, name: &str) -> Result<(), NetworkError> {
        let mut message = LinkMessage::default();
        message.header.index = index;
        let operation = format!("delete interface {name}");
        self.request(&operation, RouteNetlinkMessage::DelLink(message), 0)
            .map(drop)
    }

    /// Creates bridge `name` with hardware address `mac`, down.
    pub(crate) fn add_bridge(&mut self, name: &str, mac: [u8; 6]) -> Result<(), NetworkError> {
        let mut message = LinkMessage::default();
        message.attributes = vec![
            LinkAttribute::IfName(name.to_owned()),
            LinkAttribute::Address(mac.to_vec()),
            LinkAttribute::LinkInfo(vec![LinkInfo::Kind(InfoKind::Bridge)]),
        ];
        let operation = format!("create bridge {name}");
        self.request(
            &operation,
            RouteNetlinkMessage::NewLink(message),
            NLM_F_CREATE | NLM_F_EXCL,
        )
        .map(drop)
    }
}

/// What [`Rtnl::set_link`] changes.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct LinkChange<'a> {
    pub alias: Option<&'a str>,
    pub master: Option<u32>,
    /// Up (`Some(true)`) or down (`Some(false)`).
    pub up: Option<bool>,
}

#[cfg(test)]
mod tests {
    use netlink_packet_core::DefaultNla;
    use netlink_packet_route::link::InfoTun;

    use super::*;

    fn message(index: u32, attributes: Vec<LinkAttribute>) -> LinkMessage {
        let mut m = LinkMessage::default();
        m.header.index = index;
        m.attributes = attributes;
        m
    }

    fn tun(tun_type: u8) -> LinkAttribute {
        LinkAttribute::LinkInfo(vec![
            LinkInfo::Kind(InfoKind::Tun),
            LinkInfo::Data(InfoData::Tun(vec![InfoTun::Other(DefaultNla::new(
                IFLA_TUN_TYPE,
                vec![tun_type],
            ))])),
        ])
    }

    #[test]
    fn describes_links() {
        let mut tap = message(
            5,
            vec![
                LinkAttribute::IfName("tt-a".into()),
                LinkAttribute::IfAlias("a".into()),
                LinkAttribute::Controller(6),
                tun(TUN_TYPE_TAP),
            ],
        );
        tap.header.flags = LinkFlags::Up;
        assert_eq!(
            Link::from_message(&tap),
            Some(Link {
                index: 5,
                name: "tt-a".into(),
                kind: Some("tap".into()),
                master: Some(6),
                alias: Some("a".into()),
                up: true,
            })
        );
        let tun = message(
            7,
            vec![
                LinkAttribute::IfName("tun0".into()),
                tun(libc::IFF_TUN as u8),
            ],
        );
        let tun = Link::from_message(&tun).expect("named");
        assert_eq!(tun.kind.as_deref(), Some("tun"));
        assert!(!tun.up);
        let bridge = message(
            6,
            vec![
                LinkAttribute::IfName("tbr-g".into()),
                LinkAttribute::Controller(0),
                LinkAttribute::LinkInfo(vec![LinkInfo::Kind(InfoKind::Bridge)]),
            ],
        );
        let bridge = Link::from_message(&bridge).expect("named");
        assert_eq!(bridge.kind.as_deref(), Some("bridge"));
        assert_eq!(bridge.master, None, "index 0 is no master");
        let plain = message(1, vec![LinkAttribute::IfName("lo".into())]);
        assert_eq!(Link::from_message(&plain).expect("named").kind, None);
        assert_eq!(Link::from_message(&message(2, vec![])), None, "no name");
    }
}
