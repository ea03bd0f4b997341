//! Deleting conntrack entries over ctnetlink, in-process (what
//! `conntrack -D -s ADDRESS` does, without starting it).

use std::net::{IpAddr, Ipv4Addr};

use netlink_packet_core::{DefaultNla, Emitable, Nla as _, NLM_F_DUMP};
use netlink_packet_netfilter::conntrack::{
    ConntrackAttribute, ConntrackMessage, ConntrackMessageType, IPTuple, Tuple,
};
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
};
use netlink_sys::protocols::NETLINK_NETFILTER;

use super::error::NetworkError;
use super::netlink::NetlinkSocket;

/// `CTA_TUPLE_ORIG`: the tuple of the direction that opened the connection.
const CTA_TUPLE_ORIG: u16 = 1;
/// `CTA_ID`: the entry's id, so a delete never hits a newer entry that
/// reuses the tuple.
const CTA_ID: u16 = 12;
/// `CTA_ZONE`: the entry's zone, part of its identity.
const CTA_ZONE: u16 = 18;
/// `CTA_FILTER` (Linux 5.8+; older kernels ignore it and dump everything,
/// which the check below then narrows).
const CTA_FILTER: u16 = 25;
/// `CTA_FILTER_ORIG_FLAGS` inside it, and its bit for the source address.
const CTA_FILTER_ORIG_FLAGS: u16 = 1;
const CTA_FILTER_FLAG_CTA_IP_SRC: u32 = 1;
/// `NLA_F_NESTED`.
const NLA_F_NESTED: u16 = 1 << 15;

/// The bytes of one attribute, header included.
fn emitted(nla: &impl Emitable) -> Vec<u8> {
    let mut bytes = vec![0; nla.buffer_len()];
    nla.emit(&mut bytes);
    bytes
}

fn message(inner: ConntrackMessage) -> NetfilterMessage {
    NetfilterMessage::new(
        NetfilterHeader::new(NetfilterProtoFamily::IPv4, 0, 0),
        inner,
    )
}

/// The original tuple of a dumped entry when its source is `address`, with
/// the attributes that identify the entry for a delete.
fn entry_from(address: Ipv4Addr, entry: &NetfilterMessage) -> Option<Vec<ConntrackAttribute>> {
    let NetfilterMessageInner::Conntrack(ConntrackMessage::New(attributes)) = &entry.inner else {
        return None;
    };
    let mut identity = Vec::new();
    let mut from_address = false;
    for attribute in attributes {
        match attribute {
            ConntrackAttribute::CtaTupleOrig(tuples) => {
                from_address = tuples.iter().any(|tuple| {
                    matches!(tuple, Tuple::Ip(ips) if ips.contains(&IPTuple::SourceAddress(IpAddr::V4(address))))
                });
                identity.push(attribute.clone());
            }
            ConntrackAttribute::Other(nla) if nla.kind() == CTA_ID || nla.kind() == CTA_ZONE => {
                identity.push(attribute.clone());
            }
            _ => {}
        }
    }
    from_address.then_some(identity)
}

/// Deletes every IPv4 conntrack entry whose original source is `address`
/// and returns how many were deleted. An entry that expires meanwhile is
/// not an error.
pub(crate) fn delete_from_source(address: Ipv4Addr) -> Result<usize, NetworkError> {
    let mut socket = NetlinkSocket::open(NETLINK_NETFILTER, "netfilter")?;
    let operation = format!("list the conntrack entries from {address}");
    // The dump asks the kernel for this source's entries only. Built from
    // raw attributes: the crate's typed ones would drop the nested flag
    // that CTA_FILTER needs.
    let tuple = Tuple::Ip(vec![IPTuple::SourceAddress(IpAddr::V4(address))]);
    let flags = DefaultNla::new(
        CTA_FILTER_ORIG_FLAGS,
        CTA_FILTER_FLAG_CTA_IP_SRC.to_ne_bytes().to_vec(),
    );
    let dump = socket.request(
        &operation,
        message(ConntrackMessage::Other {
            message_type: ConntrackMessageType::Get.into(),
            attributes: vec![
                DefaultNla::new(CTA_TUPLE_ORIG | NLA_F_NESTED, emitted(&tuple)),
                DefaultNla::new(CTA_FILTER | NLA_F_NESTED, emitted(&flags)),
            ],
        }),
        NLM_F_DUMP,
    )?;
    let mut deleted = 0;
    for identity in dump.iter().filter_map(|entry| entry_from(address, entry)) {
        let operation = format!("delete a conntrack entry from {address}");
        match socket.request(&operation, message(ConntrackMessage::Delete(identity)), 0) {
            Ok(_) => deleted += 1,
            Err(NetworkError::Netlink { source, .. })
                if source.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(source: &str, extra: Vec<ConntrackAttribute>) -> NetfilterMessage {
        let source: Ipv4Addr = source.parse().expect("ip");
        let mut attributes = vec![ConntrackAttribute::CtaTupleOrig(vec![Tuple::Ip(vec![
            IPTuple::SourceAddress(IpAddr::V4(source)),
            IPTuple::DestinationAddress(IpAddr::V4(Ipv4Addr::new(198, 51, 100, 1))),
        ])])];
        attributes.extend(extra);
        message(ConntrackMessage::New(attributes))
    }

    #[test]
    fn picks_the_entries_of_one_source_with_their_identity() {
        let me: Ipv4Addr = "169.254.40.2".parse().expect("ip");
        let id = ConntrackAttribute::Other(DefaultNla::new(CTA_ID, vec![0, 0, 0, 7]));
        let zone = ConntrackAttribute::Other(DefaultNla::new(CTA_ZONE, vec![0, 1]));
        let mark = ConntrackAttribute::CtaMark(3);
        let mine = entry("169.254.40.2", vec![id.clone(), zone.clone(), mark]);
        let identity = entry_from(me, &mine).expect("mine");
        assert_eq!(identity.len(), 3, "tuple, id and zone, not the mark");
        assert!(identity.contains(&id) && identity.contains(&zone));
        assert_eq!(entry_from(me, &entry("169.254.40.6", vec![])), None);
        let not_an_entry = message(ConntrackMessage::Get(vec![]));
        assert_eq!(entry_from(me, &not_an_entry), None);
    }
}
