//! `tine`: the command-line interface. It talks to the daemon through
//! `tine-client`; the commands land with the daemon issue.

fn main() {
    println!("tine {}", env!("CARGO_PKG_VERSION"));
}
