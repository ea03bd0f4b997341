//! Wire types that cross process boundaries in tine: REST bodies between the
//! daemon and its clients, frames between the host and the guest agent, and
//! the control protocol and events of a `tine-vmm` process.
//!
//! [`agent`] holds the guest-agent protocol: framing, messages, handshake and
//! the stream multiplexer shared by the agent and its client
//! (docs/agent-protocol.md). [`api`] holds the daemon's REST bodies
//! (docs/api.md). [`vmm`] holds the VMM's control requests and responses
//! and the events it prints (docs/vmm-control.md). [`smaps`] parses what
//! the kernel reports of a process's memory (a VMM's USS, PSS and the guest
//! pages it copied), for the daemon and the VMM's benches alike.

pub mod agent;
pub mod api;
pub mod smaps;
pub mod vmm;

/// `e` and its sources, joined with `: `, for messages that leave the
/// process (API errors, protocol errors, log lines); a source whose text the
/// message already contains is left out.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let m = cause.to_string();
        if !text.contains(&m) {
            text.push_str(": ");
            text.push_str(&m);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    #[test]
    fn error_chains_join_sources_once() {
        let inner = std::io::Error::other("disk full");
        let outer = std::io::Error::other(ChainErr(inner));
        assert_eq!(super::error_chain(&outer), "write failed: disk full");
    }

    #[derive(Debug)]
    struct ChainErr(std::io::Error);
    impl std::fmt::Display for ChainErr {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("write failed")
        }
    }
    impl std::error::Error for ChainErr {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }
}
