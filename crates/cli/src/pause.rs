//! `tine vm pause VM` and `tine vm resume VM`: park a running VM's vCPUs
//! and run them again.

use tine_client::TineClient;

use crate::cli::{GlobalArgs, VmArg};
use crate::exit;
use crate::output::print_json;

/// Runs `tine vm pause` (`resume: false`) or `tine vm resume`.
pub async fn run(g: &GlobalArgs, c: &TineClient, a: &VmArg, resume: bool) -> anyhow::Result<i32> {
    let v = if resume {
        c.resume(&a.vm).await?
    } else {
        c.pause(&a.vm).await?
    };
    if g.json {
        print_json(&v)?;
    } else if g.quiet {
        println!("{}", v.hostname);
    } else {
        println!(
            "{} {}",
            v.hostname,
            if resume { "resumed" } else { "paused" }
        );
    }
    Ok(exit::OK)
}
