//! nft scripts through the `nft` command: one `nft -f -` per change, so
//! each change is one kernel transaction. (In-process libnftables would save
//! the process start, but it is GPL-2.0-only and this project is
//! Apache-2.0: the daemon talks to it only as a separate program.)

use std::io::Write as _;
use std::process::{Command, Stdio};

use super::error::NetworkError;

/// Runs nft scripts and listings.
#[derive(Debug, Default)]
pub(crate) struct Nftables;

impl Nftables {
    /// A runner; `nft` itself is looked up in `PATH` at each run, so a host
    /// without nftables fails only when it needs a rule.
    pub(crate) fn open() -> Result<Self, NetworkError> {
        Ok(Nftables)
    }

    /// Applies `script` atomically (`nft -f -`) and returns what nft printed.
    pub(crate) fn run(&mut self, script: &str) -> Result<String, NetworkError> {
        nft(&["-f", "-"], script)
    }

    /// Runs `command` (words without quoting, such as `list table inet
    /// tine`) with JSON output (`nft -j`) and returns the JSON. (nft prints
    /// no JSON for a listing read with `-f`, so the words are arguments.)
    pub(crate) fn run_json(&mut self, command: &str) -> Result<String, NetworkError> {
        let mut args = vec!["-j"];
        args.extend(command.split_whitespace());
        nft(&args, "")
    }
}

fn nft(args: &[&str], input: &str) -> Result<String, NetworkError> {
    let mut child = Command::new("nft")
        .args(args)
        .stdin(if input.is_empty() {
            Stdio::null()
        } else {
            Stdio::piped()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(NetworkError::NftSpawn)?;
    if let Some(mut pipe) = child.stdin.take() {
        if let Err(e) = pipe.write_all(input.as_bytes()) {
            // nft exited early; its own error below says why.
            tracing::debug!("writing the script to nft: {e}");
        }
    }
    let out = child.wait_with_output().map_err(NetworkError::NftSpawn)?;
    if !out.status.success() {
        let mut error = String::from_utf8_lossy(&out.stderr).trim().to_owned();
        if error.is_empty() {
            error = format!("nft exited with {}", out.status);
        }
        return Err(NetworkError::Nft {
            error,
            input: if input.is_empty() {
                args.join(" ")
            } else {
                input.to_owned()
            },
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_script_reports_nfts_error_and_the_input() {
        // Needs nftables' `nft`; a syntax error is found before any
        // privilege is needed.
        let mut nft = Nftables::open().unwrap_or_else(|e| panic!("{e}"));
        let err = nft
            .run("add tabel inet tine_unit\n")
            .expect_err("syntax error");
        let NetworkError::Nft { error, input } = &err else {
            panic!("wrong error: {err}");
        };
        assert!(error.contains("syntax error"), "{error}");
        assert_eq!(input, "add tabel inet tine_unit\n");
        assert!(err.to_string().contains("--- input ---"), "{err}");
        let err = nft
            .run_json("list tabel inet tine_unit")
            .expect_err("syntax error");
        assert!(err.to_string().contains("tabel"), "{err}");
    }
}
