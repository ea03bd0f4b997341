//! `tine secret create|list|update|remove`: host secrets, granted to VMs
//! with `tine vm add --secret` and `tine vm fork --secret`.

use std::path::Path;
use std::time::SystemTime;

use anyhow::Context;
use base64::Engine as _;
use tine_client::TineClient;
use tine_proto::api::{CreateSecretRequest, UpdateSecretRequest};

use crate::cli::{GlobalArgs, SecretCommand, SecretValueArgs};
use crate::exit;
use crate::output::{self, print_json};

/// Largest file `--from-file` reads (the daemon's limit per secret).
const MAX_FILE_BYTES: u64 = 256 * 1024;

fn read_value(path: &Path) -> anyhow::Result<Vec<u8>> {
    let meta = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    if meta.len() > MAX_FILE_BYTES {
        anyhow::bail!(
            "{} holds {} bytes; a secret holds at most {MAX_FILE_BYTES}",
            path.display(),
            meta.len()
        );
    }
    std::fs::read(path).with_context(|| format!("reading {}", path.display()))
}

/// The value the flags give, base64 as the API takes it.
fn value_of(args: &SecretValueArgs) -> anyhow::Result<Option<String>> {
    let bytes = match (&args.from_literal, &args.from_file) {
        (Some(text), _) => text.as_bytes().to_vec(),
        (None, Some(path)) => read_value(path)?,
        (None, None) => return Ok(None),
    };
    Ok(Some(
        base64::engine::general_purpose::STANDARD.encode(bytes),
    ))
}

/// Runs a `tine secret` command.
pub async fn run(g: &GlobalArgs, c: &TineClient, command: SecretCommand) -> anyhow::Result<i32> {
    match command {
        SecretCommand::Create(args) => {
            let data = value_of(&args)?.ok_or_else(|| {
                anyhow::anyhow!("give the value with --from-literal or --from-file")
            })?;
            let info = c
                .create_secret(&CreateSecretRequest {
                    name: args.name.clone(),
                    data,
                    permissions: args.permissions,
                    uid: args.uid,
                    gid: args.gid,
                })
                .await
                .with_context(|| format!("creating the secret {}", args.name))?;
            if g.json {
                print_json(&info)?;
            } else if !g.quiet {
                println!(
                    "created secret {} ({} bytes, {})",
                    info.name, info.size, info.permissions
                );
            }
        }
        SecretCommand::Update(args) => {
            let data = value_of(&args)?;
            if data.is_none()
                && args.permissions.is_none()
                && args.uid.is_none()
                && args.gid.is_none()
            {
                anyhow::bail!(
                    "nothing to change: give --from-literal, --from-file, --permissions, --uid or --gid"
                );
            }
            let info = c
                .update_secret(
                    &args.name,
                    &UpdateSecretRequest {
                        data,
                        permissions: args.permissions,
                        uid: args.uid,
                        gid: args.gid,
                    },
                )
                .await
                .with_context(|| format!("updating the secret {}", args.name))?;
            if g.json {
                print_json(&info)?;
            } else if !g.quiet {
                println!(
                    "updated secret {} ({} bytes, {})",
                    info.name, info.size, info.permissions
                );
            }
        }
        SecretCommand::List => {
            let list = c.list_secrets().await.context("listing secrets")?;
            if g.json {
                print_json(&list)?;
            } else if g.quiet {
                for s in &list {
                    println!("{}", s.name);
                }
            } else {
                let now = SystemTime::now();
                let rows: Vec<Vec<String>> = list
                    .iter()
                    .map(|s| {
                        vec![
                            s.name.clone(),
                            output::size(s.size),
                            s.permissions.clone(),
                            format!("{}:{}", s.uid, s.gid),
                            output::age_since(&s.modified_at, now),
                        ]
                    })
                    .collect();
                print!(
                    "{}",
                    output::table(&["NAME", "SIZE", "MODE", "OWNER", "CHANGED"], &rows)
                );
            }
        }
        SecretCommand::Remove { name } => {
            let r = c
                .delete_secret(&name)
                .await
                .with_context(|| format!("removing the secret {name}"))?;
            if g.json {
                print_json(&r)?;
            } else if !g.quiet {
                println!("removed secret {name}");
            }
        }
    }
    Ok(exit::OK)
}
