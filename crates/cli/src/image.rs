//! `tine image list|import|inspect|remove`: the images host groups boot
//! from.

use std::io::IsTerminal as _;
use std::path::Path;
use std::pin::Pin;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::Context as _;
use indicatif::{ProgressBar, ProgressStyle};
use tine_client::TineClient;
use tine_proto::api::{ImageInfo, ImportEvent, ImportStage};
use tokio::io::AsyncRead;

use crate::cli::{GlobalArgs, ImageCommand, ImageImportArgs};
use crate::output::{self, print_json};

/// Runs a `tine image` command.
pub async fn run(g: &GlobalArgs, c: &TineClient, command: ImageCommand) -> anyhow::Result<i32> {
    match command {
        ImageCommand::List => {
            let images = c.list_images().await.context("listing images")?;
            if g.json {
                print_json(&images)?;
            } else if g.quiet {
                for i in &images {
                    println!("{}", i.name);
                }
            } else {
                print!("{}", list_table(&images));
            }
        }
        ImageCommand::Inspect { name } => {
            let image = c
                .image(&name)
                .await
                .with_context(|| format!("inspecting the image {name}"))?;
            if g.json {
                print_json(&image)?;
            } else {
                print!("{}", describe(&image));
            }
        }
        ImageCommand::Remove { name } => {
            let answer = c
                .delete_image(&name)
                .await
                .with_context(|| format!("removing the image {name}"))?;
            if g.json {
                print_json(&answer)?;
            } else if !g.quiet {
                println!("removed image {name}");
            }
        }
        ImageCommand::Import(args) => import(g, c, args).await?,
    }
    Ok(0)
}

fn short_digest(image: &ImageInfo) -> String {
    image
        .digest
        .as_deref()
        .map(|d| d.chars().take("sha256:".len() + 12).collect())
        .unwrap_or_else(|| "-".into())
}

fn list_table(images: &[ImageInfo]) -> String {
    let rows: Vec<Vec<String>> = images
        .iter()
        .map(|i| {
            vec![
                i.name.clone(),
                i.format.to_string(),
                i.origin.to_string(),
                output::size(i.size),
                short_digest(i),
                i.created_at.clone(),
            ]
        })
        .collect();
    output::table(
        &["NAME", "FORMAT", "ORIGIN", "SIZE", "DIGEST", "CREATED"],
        &rows,
    )
}

fn describe(i: &ImageInfo) -> String {
    let mut out = String::new();
    let mut line = |k: &str, v: &str| out.push_str(&format!("{k:<11} {v}\n"));
    line("name:", &i.name);
    line("digest:", i.digest.as_deref().unwrap_or("-"));
    line("format:", i.format.as_str());
    line("origin:", i.origin.as_str());
    line("size:", &output::size(i.size));
    line("created:", &i.created_at);
    line("source:", &i.source);
    if let Some(d) = &i.exec_defaults {
        line("user:", d.user.as_deref().unwrap_or("-"));
        line("workdir:", d.workdir.as_deref().unwrap_or("-"));
        line("entrypoint:", &shell_words(&d.entrypoint));
        line("cmd:", &shell_words(&d.cmd));
        for (n, e) in d.env.iter().enumerate() {
            line(if n == 0 { "env:" } else { "" }, e);
        }
    }
    output::sanitize(&out, true).into_owned()
}

fn shell_words(words: &[String]) -> String {
    if words.is_empty() {
        return "-".into();
    }
    serde_json::to_string(words).unwrap_or_default()
}

/// What the upload bar shows: bytes sent, then (a spinner) the daemon's
/// steps. Nothing when stderr is not a terminal or with `--json`/`--quiet`.
struct ImportBar(Option<Mutex<ProgressBar>>);

impl ImportBar {
    fn new(g: &GlobalArgs, total: Option<u64>) -> Self {
        if g.json || g.quiet || !std::io::stderr().is_terminal() {
            return Self(None);
        }
        let (bar, template) = match total {
            Some(len) => (
                ProgressBar::new(len),
                "uploading {bar:30} {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
            ),
            None => (ProgressBar::new_spinner(), "{spinner} uploading {bytes}"),
        };
        if let Ok(style) = ProgressStyle::with_template(template) {
            bar.set_style(style);
        }
        bar.enable_steady_tick(Duration::from_millis(100));
        Self(Some(Mutex::new(bar)))
    }

    fn bar(&self) -> Option<std::sync::MutexGuard<'_, ProgressBar>> {
        self.0
            .as_ref()
            .map(|m| m.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn sent(&self, n: u64) {
        if let Some(bar) = self.bar() {
            bar.inc(n);
        }
    }

    fn event(&self, e: &ImportEvent) {
        let (Some(mut bar), ImportEvent::Progress { stage, message, .. }) = (self.bar(), e) else {
            return;
        };
        if *stage == ImportStage::Received {
            // The upload is done: a spinner for the daemon's steps.
            bar.finish_and_clear();
            let spinner = ProgressBar::new_spinner();
            if let Ok(style) = ProgressStyle::with_template("{spinner} {msg} ({elapsed})") {
                spinner.set_style(style);
            }
            spinner.enable_steady_tick(Duration::from_millis(100));
            *bar = spinner;
        }
        bar.set_message(message.clone());
    }
}

impl Drop for ImportBar {
    fn drop(&mut self) {
        if let Some(bar) = self.bar() {
            bar.finish_and_clear();
        }
    }
}

type Upload = Pin<Box<dyn AsyncRead + Send>>;

/// FILE as a stream: the file itself, or a tar of a directory (an OCI
/// image layout), made while it is sent. Also its length when known.
async fn open_upload(path: &Path) -> anyhow::Result<(Upload, Option<u64>)> {
    let meta = tokio::fs::metadata(path)
        .await
        .with_context(|| format!("reading {}", path.display()))?;
    if !meta.is_dir() {
        let file = tokio::fs::File::open(path)
            .await
            .with_context(|| format!("opening {}", path.display()))?;
        return Ok((Box::pin(file), Some(meta.len())));
    }
    if !path.join("oci-layout").is_file() {
        anyhow::bail!(
            "{} is a directory without an oci-layout file; only an OCI image layout can be \
             imported from a directory",
            path.display()
        );
    }
    let (reader, writer) = tokio::io::duplex(1 << 16);
    let dir = path.to_path_buf();
    tokio::task::spawn_blocking(move || {
        let mut tar = tar::Builder::new(tokio_util::io::SyncIoBridge::new(writer));
        tar.follow_symlinks(false);
        // An error ends the stream early: the daemon then names a bad tar.
        if let Err(e) = tar.append_dir_all(".", &dir).and_then(|()| tar.finish()) {
            eprintln!("tine: taring {}: {e}", dir.display());
        }
    });
    Ok((Box::pin(reader), None))
}

async fn import(g: &GlobalArgs, c: &TineClient, args: ImageImportArgs) -> anyhow::Result<()> {
    let (upload, len) = open_upload(&args.file).await?;
    let bar = std::sync::Arc::new(ImportBar::new(g, len));
    let counter = bar.clone();
    let reader = tokio_util::io::InspectReader::new(upload, move |chunk: &[u8]| {
        counter.sent(chunk.len() as u64);
    });
    let image = c
        .import_image(&args.name, args.format, reader, |e| bar.event(e))
        .await
        .with_context(|| format!("importing {} as {}", args.file.display(), args.name))?;
    drop(bar);
    if g.json {
        print_json(&image)?;
    } else if g.quiet {
        println!("{}", image.name);
    } else {
        println!(
            "imported image {} ({}, {}, {})",
            image.name,
            image.format,
            output::size(image.size),
            image.digest.as_deref().unwrap_or("no digest")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tine_proto::api::{ImageExecDefaults, ImageFormat, ImageOrigin};

    fn sample() -> ImageInfo {
        ImageInfo {
            name: "app".into(),
            digest: Some(format!("sha256:{}", "ab".repeat(32))),
            format: ImageFormat::Oci,
            origin: ImageOrigin::Imported,
            size: 320 << 20,
            created_at: "2026-01-02T03:04:05.000Z".into(),
            source: "upload (auto, 10 bytes)".into(),
            exec_defaults: Some(ImageExecDefaults {
                env: vec!["A=1".into(), "B=2".into()],
                user: None,
                workdir: Some("/srv".into()),
                entrypoint: vec![],
                cmd: vec!["/bin/sh".into()],
            }),
        }
    }

    #[test]
    fn the_list_shows_short_digests() {
        let text = list_table(&[sample()]);
        assert_eq!(
            text,
            "NAME   FORMAT   ORIGIN     SIZE   DIGEST                CREATED\n\
             app    oci      imported   320M   sha256:abababababab   2026-01-02T03:04:05.000Z\n"
        );
    }

    #[test]
    fn inspect_shows_the_exec_defaults() {
        let text = describe(&sample());
        assert!(text.contains("workdir:    /srv\n"), "{text}");
        assert!(
            text.contains("env:        A=1\n            B=2\n"),
            "{text}"
        );
        assert!(text.contains("cmd:        [\"/bin/sh\"]\n"), "{text}");
    }
}
