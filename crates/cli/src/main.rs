//! `tine`: the command-line interface. `tine new` writes a configuration,
//! `tine up` runs the daemon, and every other command talks to the daemon
//! through `tine-client` (docs/api.md). Exit codes are listed in
//! `tine --help` ([`cli::AFTER_HELP`]).

mod cli;
mod commands;
mod config;
mod exit;
mod image;
mod output;
mod pause;
mod secret;
mod stats;
mod stream;
mod terminal;
mod untar;

use std::io::Write;

use clap::Parser;

use crate::cli::{Cli, Command};

fn main() {
    let cli = Cli::parse();
    let code = match &cli.command {
        Command::New(args) => report(config::run(args).map(|yaml| {
            print!("{yaml}");
            exit::OK
        })),
        Command::Up(args) => report(
            tine_daemon::run_from_cli(args.config.clone(), args.data_dir.clone())
                .map(|()| exit::OK),
        ),
        _ => match tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
        {
            Ok(runtime) => {
                let code = report(runtime.block_on(commands::run(cli)));
                // A blocking read of stdin (exec, shell) may still be
                // waiting: do not wait for it.
                runtime.shutdown_background();
                code
            }
            Err(e) => report(Err(
                anyhow::Error::new(e).context("cannot start the async runtime")
            )),
        },
    };
    if let Err(e) = std::io::stdout().flush() {
        eprintln!("tine: cannot write to standard output: {e}");
    }
    std::process::exit(code);
}

/// Prints an error as `tine: ...` and turns the result into an exit code.
fn report(result: anyhow::Result<i32>) -> i32 {
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("{}", exit::message_for(&err));
            exit::code_for(&err)
        }
    }
}
