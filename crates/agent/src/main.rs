//! `tine-agent`: the guest agent. It serves the agent protocol over vsock
//! (docs/agent-protocol.md). This binary currently only reports its version;
//! the protocol lands with the agent issue.

fn main() {
    println!("tine-agent {}", env!("CARGO_PKG_VERSION"));
}
