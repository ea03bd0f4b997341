//! `tine up` without the CLI: `cargo run -p tine-daemon --example up -- [tine.yaml] [data_dir]`.

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args_os().skip(1);
    let config = args.next().filter(|a| !a.is_empty()).map(Into::into);
    let data = args.next().map(Into::into);
    tine_daemon::run_from_cli(config, data)
}
