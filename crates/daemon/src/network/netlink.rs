//! A netlink socket that sends one request at a time and waits for the
//! kernel's whole answer (shared by rtnetlink and ctnetlink).

use std::fmt::Debug;
use std::io;

use netlink_packet_core::{
    NetlinkDeserializable, NetlinkHeader, NetlinkMessage, NetlinkPayload, NetlinkSerializable,
    NLM_F_ACK, NLM_F_REQUEST,
};
use netlink_sys::{Socket, SocketAddr};

use super::error::NetworkError;

/// Receive buffer: larger than any datagram the kernel sends in a dump.
const RECV_BUFFER: usize = 64 * 1024;

fn netlink_err(operation: &str) -> impl FnOnce(io::Error) -> NetworkError {
    let operation = operation.to_owned();
    move |source| NetworkError::Netlink { operation, source }
}

/// One netlink socket of a protocol (`NETLINK_ROUTE`, `NETLINK_NETFILTER`).
pub(crate) struct NetlinkSocket {
    socket: Socket,
    sequence: u32,
    buffer: Vec<u8>,
}

impl Debug for NetlinkSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetlinkSocket")
            .field("sequence", &self.sequence)
            .finish_non_exhaustive()
    }
}

impl NetlinkSocket {
    /// Opens a socket of `protocol` (`what` names it in errors) in the
    /// caller's network namespace.
    pub(crate) fn open(protocol: isize, what: &str) -> Result<Self, NetworkError> {
        let operation = format!("open a {what} netlink socket");
        let mut socket = Socket::new(protocol).map_err(netlink_err(&operation))?;
        socket.bind_auto().map_err(netlink_err(&operation))?;
        socket
            .connect(&SocketAddr::new(0, 0))
            .map_err(netlink_err(&operation))?;
        Ok(Self {
            socket,
            sequence: 0,
            buffer: vec![0; RECV_BUFFER],
        })
    }

    /// Sends one request (`flags` on top of `NLM_F_REQUEST | NLM_F_ACK`) and
    /// collects the messages of its answer: a dump's parts up to its end, or
    /// what comes before the acknowledgement. An error the kernel answers
    /// is returned as [`NetworkError::Netlink`] with its errno.
    pub(crate) fn request<M>(
        &mut self,
        operation: &str,
        message: M,
        flags: u16,
    ) -> Result<Vec<M>, NetworkError>
    where
        M: NetlinkSerializable + NetlinkDeserializable + Debug,
    {
        self.sequence = self.sequence.wrapping_add(1);
        let sequence = self.sequence;
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_ACK | flags;
        header.sequence_number = sequence;
        let mut packet = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(message));
        packet.finalize();
        let mut out = vec![0; packet.buffer_len()];
        packet.serialize(&mut out);
        self.socket.send(&out, 0).map_err(netlink_err(operation))?;

        let mut answer = Vec::new();
        loop {
            let size = self
                .socket
                .recv(&mut &mut self.buffer[..], 0)
                .map_err(netlink_err(operation))?;
            let mut offset = 0;
            while offset < size {
                let reply =
                    NetlinkMessage::<M>::deserialize(&self.buffer[offset..size]).map_err(|e| {
                        NetworkError::NetlinkReply {
                            operation: operation.to_owned(),
                            reason: e.to_string(),
                        }
                    })?;
                let length = reply.header.length as usize;
                if length == 0 {
                    break;
                }
                offset += (length + 3) & !3;
                if reply.header.sequence_number != sequence {
                    // Left over from an earlier request that failed half-way.
                    continue;
                }
                match reply.payload {
                    NetlinkPayload::InnerMessage(inner) => answer.push(inner),
                    NetlinkPayload::Error(error) => {
                        return match error.code {
                            None => Ok(answer),
                            Some(_) => Err(NetworkError::Netlink {
                                operation: operation.to_owned(),
                                source: error.to_io(),
                            }),
                        };
                    }
                    NetlinkPayload::Done(done) => {
                        return if done.code == 0 {
                            Ok(answer)
                        } else {
                            Err(NetworkError::Netlink {
                                operation: operation.to_owned(),
                                source: io::Error::from_raw_os_error(-done.code),
                            })
                        };
                    }
                    _ => {}
                }
            }
        }
    }
}
