//! `tine-kvm-probe`: says whether this host's KVM runs Linux guests at
//! hardware speed. Exit status 0 = usable, 1 = not usable, 2 = usage error.
//! `--json` prints the report as JSON.

use tine_vmm::probe::probe_kvm;

fn main() {
    let json = match std::env::args().nth(1).as_deref() {
        None => false,
        Some("--json") => true,
        Some(other) => {
            eprintln!(
                "tine-kvm-probe: unknown argument '{other}' (usage: tine-kvm-probe [--json])"
            );
            std::process::exit(2);
        }
    };
    let report = probe_kvm();
    if json {
        match serde_json::to_string(&report) {
            Ok(text) => println!("{text}"),
            Err(e) => {
                eprintln!("tine-kvm-probe: cannot encode report: {e}");
                std::process::exit(2);
            }
        }
    } else {
        let verdict = if report.usable { "usable" } else { "unusable" };
        println!("kvm: {verdict}: {}", report.reason);
    }
    std::process::exit(if report.usable { 0 } else { 1 });
}
