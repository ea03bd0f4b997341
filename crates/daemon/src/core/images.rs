//! The image store: listing, importing (`POST /images`) and deleting
//! images. The conversions themselves are [`crate::image`]'s.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tine_proto::api::{ImageInfo, ImageOrigin, ImportEvent, ImportFormat, ImportStage};
use tokio::sync::mpsc;

use super::daemon::Daemon;
use super::error::{Error, Result};
use crate::artifacts;
use crate::db::{CommitFilter, ImageRecord};
use crate::image::{self, ImageError};

/// The API's view of an image record.
pub fn image_info(rec: &ImageRecord) -> ImageInfo {
    ImageInfo {
        name: rec.name.clone(),
        digest: rec.digest.clone(),
        format: rec.format,
        origin: rec.origin,
        size: rec.size_bytes,
        created_at: tine_proto::api::rfc3339_millis(rec.created_ms),
        source: rec.source.clone(),
        exec_defaults: rec.exec_defaults.clone(),
    }
}

/// Removes an import's temporary files and folders when dropped, whatever
/// happened.
struct Temporaries(Vec<PathBuf>);

impl Drop for Temporaries {
    fn drop(&mut self) {
        for p in &self.0 {
            let gone = if p.is_dir() {
                std::fs::remove_dir_all(p)
            } else {
                std::fs::remove_file(p)
            };
            if let Err(e) = gone {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!("remove {}: {e}", p.display());
                }
            }
        }
    }
}

/// Holds an image name reserved for one import.
pub struct ImportSlot {
    daemon: Arc<Daemon>,
    name: String,
}

impl Drop for ImportSlot {
    fn drop(&mut self) {
        self.daemon
            .importing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.name);
    }
}

impl Daemon {
    /// The folder of image bases.
    pub fn images_dir(&self) -> PathBuf {
        self.data_dir.join("images")
    }

    /// Every recorded image, and the built-in ones that are built but no
    /// VM has used yet (their build output standing in for the base).
    pub fn images(&self) -> Result<Vec<ImageRecord>> {
        let mut list = self.store.list_images()?;
        for name in image::BUILT_IN {
            if !list.iter().any(|r| r.name == *name) {
                list.extend(artifacts::built_in_preview(name, &self.data_dir));
            }
        }
        Ok(list)
    }

    /// The image called `name` as `GET /images/{name}` shows it: recorded,
    /// or a built-in one that is built but not used yet.
    pub fn image_shown(&self, name: &str) -> Result<ImageRecord> {
        match self.image_named(name) {
            Err(Error::NotFound(_)) if image::BUILT_IN.contains(&name) => {
                artifacts::built_in_preview(name, &self.data_dir).ok_or_else(|| {
                    Error::NotFound(format!(
                        "the built-in image `{name}` is not built; scripts/setup builds it"
                    ))
                })
            }
            other => other,
        }
    }

    /// The image called `name`, or not found.
    pub fn image_named(&self, name: &str) -> Result<ImageRecord> {
        self.store.get_image(name)?.ok_or_else(|| {
            Error::NotFound(format!(
                "no image called `{name}`; `tine image list` shows the images there are"
            ))
        })
    }

    /// Reserves `name` for an import: it must be a valid, unused name no
    /// other import is making.
    pub fn begin_import(self: &Arc<Self>, name: &str) -> Result<ImportSlot> {
        image::check_name(name)?;
        let mut importing = self.importing.lock().unwrap_or_else(|p| p.into_inner());
        if importing.contains(name) || self.store.get_image(name)?.is_some() {
            return Err(Error::Conflict(format!(
                "an image called `{name}` already exists or is being imported; \
                 images are immutable: delete it first or pick another name"
            )));
        }
        importing.insert(name.to_owned());
        Ok(ImportSlot {
            daemon: self.clone(),
            name: name.to_owned(),
        })
    }

    /// A new temporary path in the images folder (`.import-<random>.<kind>`),
    /// which start-up removes if an import is cut short.
    pub fn import_temp(&self, kind: &str) -> Result<PathBuf> {
        let dir = self.images_dir();
        std::fs::create_dir_all(&dir).map_err(|e| Error::io("create the images folder", e))?;
        let mut random = [0u8; 8];
        getrandom::fill(&mut random)
            .map_err(|e| Error::io("pick a temporary name", std::io::Error::other(e)))?;
        let hex: String = random.iter().map(|b| format!("{b:02x}")).collect();
        Ok(dir.join(format!("{}{hex}.{kind}", image::TEMP_PREFIX)))
    }

    /// Converts the received `upload` into the image `slot` reserved and
    /// records it; `progress` gets each step. The upload is removed in any
    /// case; on failure nothing is left behind.
    pub async fn import_image(
        self: &Arc<Self>,
        slot: ImportSlot,
        format: ImportFormat,
        upload: PathBuf,
        source: String,
        progress: mpsc::UnboundedSender<ImportEvent>,
    ) -> Result<ImageRecord> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || {
            let result = this.import_blocking(&slot.name, format, upload, source, &progress);
            drop(slot);
            result
        })
        .await
        .map_err(|source| Error::Task {
            what: "import image",
            source,
        })?
    }

    fn import_blocking(
        &self,
        name: &str,
        format: ImportFormat,
        upload: PathBuf,
        source: String,
        progress: &mpsc::UnboundedSender<ImportEvent>,
    ) -> Result<ImageRecord> {
        let work = self.import_temp("work")?;
        let _cleanup = Temporaries(vec![upload.clone(), work.clone()]);
        std::fs::create_dir(&work).map_err(|e| Error::io("create the import folder", e))?;
        let agent_dir = work.clone();
        let find_agent = move || self.agent_binary(&agent_dir);
        let mut report = |e: ImportEvent| {
            if progress.send(e).is_err() {
                tracing::debug!(image = %name, "the importing client left; the import goes on");
            }
        };
        let converted = image::convert(&upload, format, &work, &find_agent, &mut report)?;
        report(ImportEvent::Progress {
            stage: ImportStage::Verify,
            done: None,
            total: None,
            message: "hashing the base".into(),
        });
        let digest = image::oci::sha256_file(&converted.base)
            .map_err(|e| Error::io("hash the new base", e))?;
        image::seal(&converted.base)?;
        let hex = digest.trim_start_matches("sha256:");
        let dest = self
            .images_dir()
            .join(format!("{name}-{}.base", &hex[..16.min(hex.len())]));
        std::fs::rename(&converted.base, &dest)
            .map_err(|e| Error::io("move the new base in place", e))?;
        image::sync_dir(&self.images_dir())?;
        let record = ImageRecord {
            name: name.to_owned(),
            source,
            path: dest.display().to_string(),
            size_bytes: converted.size_bytes,
            digest: Some(digest),
            format: converted.format,
            origin: ImageOrigin::Imported,
            exec_defaults: converted.exec_defaults,
            created_ms: crate::db::now_ms(),
        };
        if let Err(e) = self.store.insert_image(&record) {
            if let Err(rm) = std::fs::remove_file(&dest) {
                tracing::warn!(
                    "cannot remove {} after a failed record: {rm}",
                    dest.display()
                );
            }
            return Err(e.into());
        }
        tracing::info!(image = %name, digest = ?record.digest, "image imported");
        Ok(record)
    }

    /// The static agent to install in a converted image: `agent:` in the
    /// configuration, else `$TINE_AGENT_BIN`, else `/usr/bin/tine-agent`
    /// of the built-in `min` image (extracted into `work` with debugfs).
    fn agent_binary(&self, work: &Path) -> Result<PathBuf, ImageError> {
        let configured = self
            .config
            .agent
            .clone()
            .map(|p| (p, "`agent:` in tine.yaml"))
            .or_else(|| {
                std::env::var_os("TINE_AGENT_BIN").map(|p| (PathBuf::from(p), "$TINE_AGENT_BIN"))
            });
        let (path, from) = match configured {
            Some(found) => found,
            None => (self.agent_from_min_image(work)?, "the min image"),
        };
        match image::is_static_elf(&path) {
            Ok(true) => Ok(path),
            Ok(false) => Err(ImageError::NoAgent(format!(
                "{} (from {from}) is dynamically linked; build it with \
                 RUSTFLAGS='-C target-feature=+crt-static'",
                path.display()
            ))),
            Err(e) => Err(ImageError::NoAgent(format!(
                "{} (from {from}): {e}",
                path.display()
            ))),
        }
    }

    fn agent_from_min_image(&self, work: &Path) -> Result<PathBuf, ImageError> {
        // The build cache's min image, else the base a VM already uses.
        let recorded = || {
            self.store
                .get_image("min")
                .ok()
                .flatten()
                .map(|r| PathBuf::from(r.path))
                .filter(|p| p.is_file())
        };
        let min = match artifacts::image_source("min", &self.data_dir) {
            Ok(p) => p,
            Err(e) => recorded().ok_or_else(|| {
                ImageError::NoAgent(format!(
                    "set `agent:` in tine.yaml or $TINE_AGENT_BIN, or build the min image ({e})"
                ))
            })?,
        };
        let debugfs = image::rootfs::find_tool("debugfs")?;
        let out = work.join("tine-agent");
        let status = std::process::Command::new(debugfs)
            .arg("-R")
            .arg(format!("dump /usr/bin/tine-agent {}", out.display()))
            .arg(&min)
            .output()
            .map_err(|e| ImageError::NoAgent(format!("run debugfs: {e}")))?;
        if !status.status.success() || !out.is_file() {
            return Err(ImageError::NoAgent(format!(
                "debugfs could not read /usr/bin/tine-agent from {}: {}",
                min.display(),
                String::from_utf8_lossy(&status.stderr).trim()
            )));
        }
        Ok(out)
    }

    /// Deletes the image called `name`; refused while a VM's or commit's
    /// disk is made over it.
    pub fn delete_image(&self, name: &str) -> Result<()> {
        // Creates resolve images under this lock.
        let _one = self.imports.lock().unwrap_or_else(|p| p.into_inner());
        let rec = self.image_named(name)?;
        let users = self.image_users(Path::new(&rec.path))?;
        if !users.is_empty() {
            return Err(Error::Conflict(format!(
                "image `{name}` is used by {}; delete them first",
                users.join(", ")
            )));
        }
        self.store.delete_image(name)?;
        if let Err(e) = std::fs::remove_file(&rec.path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!("remove {}: {e}", rec.path);
            }
        }
        Ok(())
    }

    /// The VMs (`VM name`) and commits (`commit id`) whose disk's backing
    /// chain holds `base`.
    fn image_users(&self, base: &Path) -> Result<Vec<String>> {
        let Ok(base_meta) = std::fs::metadata(base) else {
            return Ok(Vec::new());
        };
        let uses = |disk: &str| -> bool {
            use std::os::unix::fs::MetadataExt;
            // A chain that cannot be read is counted as a use: never delete
            // what might be under a disk.
            match tine_disk::backing_chain(Path::new(disk)) {
                Ok(chain) => chain.iter().any(|i| {
                    std::fs::metadata(&i.path)
                        .is_ok_and(|m| m.dev() == base_meta.dev() && m.ino() == base_meta.ino())
                }),
                Err(_) => Path::new(disk).exists(),
            }
        };
        let mut users = Vec::new();
        for vm in self.store.list_vms(None)? {
            if uses(&vm.disk) {
                users.push(format!("VM {}", vm.hostname));
            }
        }
        for c in self.store.list_commits(&CommitFilter::default())? {
            if uses(&c.disk) {
                users.push(format!("commit {}", c.id));
            }
        }
        Ok(users)
    }
}
