//! Host secrets (Slicer's model): named values kept under
//! `<data_dir>/secrets/`, granted to VMs by name and synced into each
//! granted guest's `/run/tine/secrets` by its agent.
//!
//! One file per secret, `NAME.json` (mode 0600 in a 0700 folder), holding
//! the value and the mode, owner and group the guest's copy gets. Every
//! change writes a temporary file, syncs it and renames it over the old
//! one, so a crash leaves the old secret or the new one. Values never
//! reach a log line, an error message or `describe`.

use std::fs;
use std::io::{self, Write as _};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use tine_proto::agent::SecretFile;
use tine_proto::api::{CreateSecretRequest, SecretInfo, UpdateSecretRequest};

use crate::storage;

/// Most bytes of one secret's value.
pub const MAX_SECRET_BYTES: usize = 256 * 1024;
/// Most bytes of the values granted to one VM together: they travel to the
/// guest in one agent message (frames are at most 1 MiB, base64 adds a
/// third).
pub const MAX_GRANTED_BYTES: usize = 512 * 1024;
/// Most secrets granted to one VM.
pub const MAX_GRANTS: usize = 256;
/// The guest file's mode when the request names none.
pub const DEFAULT_PERMISSIONS: u32 = 0o600;

/// A digest of the files a secrets sync writes (names, values, modes,
/// owners, in order): it tells whether a guest synced ahead (a VM primed
/// for a fork) holds what a sync now would write, without keeping the
/// values. Its `Debug` shows no bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct SecretsDigest([u8; 32]);

impl SecretsDigest {
    /// The digest of a sync of `files`.
    pub fn of(files: &[SecretFile]) -> Self {
        use sha2::{Digest as _, Sha256};
        let mut hasher = Sha256::new();
        hasher.update((files.len() as u64).to_le_bytes());
        for file in files {
            for field in [file.name.as_bytes(), file.data.as_bytes()] {
                hasher.update((field.len() as u64).to_le_bytes());
                hasher.update(field);
            }
            for number in [file.mode, file.uid, file.gid] {
                hasher.update(number.to_le_bytes());
            }
        }
        SecretsDigest(hasher.finalize().into())
    }
}

impl std::fmt::Debug for SecretsDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretsDigest(..)")
    }
}

/// What went wrong with a secret.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// The name cannot be a file name in the guest.
    #[error("secret name {name:?}: {reason}")]
    BadName {
        /// The name given.
        name: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// `data` is not base64.
    #[error("secret {name}: data must be base64 ({source})")]
    BadData {
        /// The secret.
        name: String,
        /// The decoder's complaint.
        #[source]
        source: base64::DecodeError,
    },
    /// The value is over [`MAX_SECRET_BYTES`].
    #[error("secret {name}: {bytes} bytes is more than the limit of {MAX_SECRET_BYTES}")]
    TooLarge {
        /// The secret.
        name: String,
        /// Its size.
        bytes: usize,
    },
    /// `permissions` is not an octal file mode.
    #[error(
        "secret {name}: permissions {given:?} must be an octal mode from 0000 to 0777 (e.g. 0600)"
    )]
    BadPermissions {
        /// The secret.
        name: String,
        /// What was given.
        given: String,
    },
    /// A grant names a secret that does not exist.
    #[error("no secret named {0:?} (create it with POST /secrets or `tine secret create`)")]
    NotFound(String),
    /// `create` of a name that is taken.
    #[error("secret {0:?} already exists (change it with PATCH /secrets/{0})")]
    Exists(String),
    /// A grant list is too long or names a secret twice.
    #[error("secret grants: {0}")]
    BadGrants(String),
    /// The granted values together are too large for one VM.
    #[error("the secrets granted to one VM hold {bytes} bytes, more than the limit of {MAX_GRANTED_BYTES}")]
    GrantsTooLarge {
        /// Their total size.
        bytes: usize,
    },
    /// A stored secret file does not parse.
    #[error("secret file {path}: {detail}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Why.
        detail: String,
    },
    /// Reading or writing the secrets folder failed.
    #[error("{what}")]
    Io {
        /// The operation.
        what: String,
        /// Why.
        #[source]
        source: io::Error,
    },
}

impl SecretError {
    fn io(what: impl Into<String>, source: io::Error) -> Self {
        SecretError::Io {
            what: what.into(),
            source,
        }
    }
}

type Result<T, E = SecretError> = std::result::Result<T, E>;

/// A secret as stored on the host.
#[derive(Serialize, Deserialize)]
struct Stored {
    /// The value, base64.
    data: String,
    /// Bytes of the value.
    size: usize,
    /// Mode of the guest's file.
    mode: u32,
    uid: u32,
    gid: u32,
    /// Last change, Unix ms.
    modified_ms: u64,
}

/// The secrets folder.
#[derive(Debug)]
pub struct SecretStore {
    dir: PathBuf,
    /// One change at a time (create's "does it exist" and its write).
    lock: Mutex<()>,
}

/// Checks that `name` can be a file name in the guest.
pub fn check_name(name: &str) -> Result<()> {
    match SecretFile::name_problem(name) {
        Some(reason) => Err(SecretError::BadName {
            name: name.to_owned(),
            reason,
        }),
        None => Ok(()),
    }
}

/// Parses an octal mode such as `0600`, `600` or `0o600`.
fn parse_mode(name: &str, given: &str) -> Result<u32> {
    let digits = given.strip_prefix("0o").unwrap_or(given);
    match u32::from_str_radix(digits, 8) {
        Ok(mode) if !digits.is_empty() && digits.len() <= 4 && mode <= 0o777 => Ok(mode),
        _ => Err(SecretError::BadPermissions {
            name: name.to_owned(),
            given: given.to_owned(),
        }),
    }
}

fn decode(name: &str, data: &str) -> Result<Vec<u8>> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data)
        .map_err(|source| SecretError::BadData {
            name: name.to_owned(),
            source,
        })?;
    if bytes.len() > MAX_SECRET_BYTES {
        return Err(SecretError::TooLarge {
            name: name.to_owned(),
            bytes: bytes.len(),
        });
    }
    Ok(bytes)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn rfc3339(ms: u64) -> String {
    humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms))
        .to_string()
}

impl SecretStore {
    /// Opens (making it, mode 0700) the secrets folder `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| SecretError::io(format!("create {}", dir.display()), e))?;
        Ok(SecretStore {
            dir: dir.to_owned(),
            lock: Mutex::new(()),
        })
    }

    fn guard(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.json"))
    }

    fn read(&self, name: &str) -> Result<Option<Stored>> {
        let path = self.path(name);
        let text = match fs::read(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(SecretError::io(format!("read {}", path.display()), e)),
        };
        serde_json::from_slice(&text)
            .map(Some)
            .map_err(|e| SecretError::Corrupt {
                path,
                detail: e.to_string(),
            })
    }

    /// Writes `stored` as secret `name`: a synced temporary file renamed
    /// into place, then the folder synced.
    fn write(&self, name: &str, stored: &Stored) -> Result<()> {
        let path = self.path(name);
        let tmp = self.dir.join(format!(".{name}.tmp"));
        let what = || format!("write the secret {name}");
        let text = serde_json::to_vec(stored).map_err(|e| SecretError::Corrupt {
            path: path.clone(),
            detail: e.to_string(),
        })?;
        let write = || -> io::Result<()> {
            let mut f = fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(&text)?;
            f.sync_all()?;
            fs::rename(&tmp, &path)?;
            storage::sync_dir(&self.dir)
        };
        write().map_err(|e| {
            if let Err(rm) = fs::remove_file(&tmp) {
                if rm.kind() != io::ErrorKind::NotFound {
                    tracing::warn!("cannot remove {}: {rm}", tmp.display());
                }
            }
            SecretError::io(what(), e)
        })
    }

    fn info(name: &str, stored: &Stored) -> SecretInfo {
        SecretInfo {
            name: name.to_owned(),
            size: stored.size as u64,
            permissions: format!("{:04o}", stored.mode),
            uid: stored.uid,
            gid: stored.gid,
            modified_at: rfc3339(stored.modified_ms),
        }
    }

    /// Every secret's metadata, by name.
    pub fn list(&self) -> Result<Vec<SecretInfo>> {
        let entries = fs::read_dir(&self.dir)
            .map_err(|e| SecretError::io(format!("list {}", self.dir.display()), e))?;
        let mut out = Vec::new();
        for entry in entries {
            let entry =
                entry.map_err(|e| SecretError::io(format!("list {}", self.dir.display()), e))?;
            let file = entry.file_name();
            let Some(name) = file.to_str().and_then(|f| f.strip_suffix(".json")) else {
                continue;
            };
            if check_name(name).is_err() {
                continue;
            }
            if let Some(stored) = self.read(name)? {
                out.push(Self::info(name, &stored));
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Creates a secret; refused when the name is taken.
    pub fn create(&self, req: &CreateSecretRequest) -> Result<SecretInfo> {
        check_name(&req.name)?;
        let data = decode(&req.name, &req.data)?;
        let mode = match &req.permissions {
            Some(p) => parse_mode(&req.name, p)?,
            None => DEFAULT_PERMISSIONS,
        };
        let _guard = self.guard();
        if self.read(&req.name)?.is_some() {
            return Err(SecretError::Exists(req.name.clone()));
        }
        let stored = Stored {
            size: data.len(),
            data: base64::engine::general_purpose::STANDARD.encode(data),
            mode,
            uid: req.uid.unwrap_or(0),
            gid: req.gid.unwrap_or(0),
            modified_ms: now_ms(),
        };
        self.write(&req.name, &stored)?;
        Ok(Self::info(&req.name, &stored))
    }

    /// Changes what `req` gives of secret `name`.
    pub fn update(&self, name: &str, req: &UpdateSecretRequest) -> Result<SecretInfo> {
        check_name(name)?;
        let data = match req.data.as_deref() {
            None | Some("") => None,
            Some(d) => Some(decode(name, d)?),
        };
        let mode = req
            .permissions
            .as_deref()
            .map(|p| parse_mode(name, p))
            .transpose()?;
        let _guard = self.guard();
        let mut stored = self
            .read(name)?
            .ok_or_else(|| SecretError::NotFound(name.to_owned()))?;
        if let Some(data) = data {
            stored.size = data.len();
            stored.data = base64::engine::general_purpose::STANDARD.encode(data);
        }
        if let Some(mode) = mode {
            stored.mode = mode;
        }
        stored.uid = req.uid.unwrap_or(stored.uid);
        stored.gid = req.gid.unwrap_or(stored.gid);
        stored.modified_ms = now_ms();
        self.write(name, &stored)?;
        Ok(Self::info(name, &stored))
    }

    /// Deletes secret `name`.
    pub fn delete(&self, name: &str) -> Result<()> {
        check_name(name)?;
        let _guard = self.guard();
        let path = self.path(name);
        match fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(SecretError::NotFound(name.to_owned()))
            }
            Err(e) => return Err(SecretError::io(format!("remove the secret {name}"), e)),
        }
        storage::sync_dir(&self.dir)
            .map_err(|e| SecretError::io(format!("sync {}", self.dir.display()), e))
    }

    /// Checks a grant list given at create or fork: names that exist, each
    /// once, within the limits of one VM.
    pub fn check_grants(&self, names: &[String]) -> Result<()> {
        if names.len() > MAX_GRANTS {
            return Err(SecretError::BadGrants(format!(
                "{} secrets is more than the limit of {MAX_GRANTS}",
                names.len()
            )));
        }
        let mut total = 0;
        for (i, name) in names.iter().enumerate() {
            check_name(name)?;
            if names[..i].contains(name) {
                return Err(SecretError::BadGrants(format!("{name:?} is named twice")));
            }
            let stored = self
                .read(name)?
                .ok_or_else(|| SecretError::NotFound(name.clone()))?;
            total += stored.size;
        }
        if total > MAX_GRANTED_BYTES {
            return Err(SecretError::GrantsTooLarge { bytes: total });
        }
        Ok(())
    }

    /// The guest files of the granted secrets that exist now (a grant of a
    /// secret deleted since is skipped, with a log line), within the
    /// limits of one agent message.
    pub fn files(&self, vm: &str, names: &[String]) -> Result<Vec<SecretFile>> {
        let mut out = Vec::new();
        let mut total = 0;
        for name in names.iter().take(MAX_GRANTS) {
            let Some(stored) = self.read(name)? else {
                tracing::warn!(vm, secret = %name, "a granted secret no longer exists; not synced");
                continue;
            };
            total += stored.size;
            if total > MAX_GRANTED_BYTES {
                return Err(SecretError::GrantsTooLarge { bytes: total });
            }
            out.push(SecretFile {
                name: name.clone(),
                data: stored.data,
                mode: stored.mode,
                uid: stored.uid,
                gid: stored.gid,
            });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn a_digest_changes_with_any_field_of_any_file() {
        let file = SecretFile {
            name: "db".into(),
            data: b64("pw"),
            mode: 0o600,
            uid: 0,
            gid: 0,
        };
        let digest = SecretsDigest::of(std::slice::from_ref(&file));
        assert_eq!(digest, SecretsDigest::of(std::slice::from_ref(&file)));
        assert_ne!(digest, SecretsDigest::of(&[]));
        let changed = [
            SecretFile {
                name: "db2".into(),
                ..file.clone()
            },
            SecretFile {
                data: b64("pw2"),
                ..file.clone()
            },
            SecretFile {
                mode: 0o400,
                ..file.clone()
            },
            SecretFile {
                uid: 1,
                ..file.clone()
            },
            SecretFile {
                gid: 1,
                ..file.clone()
            },
        ];
        for other in changed {
            assert_ne!(
                digest,
                SecretsDigest::of(std::slice::from_ref(&other)),
                "{}",
                other.name
            );
        }
        // Field bounds count: a name's end cannot move into the value.
        let a = SecretFile {
            name: "ab".into(),
            data: "c".into(),
            ..file.clone()
        };
        let b = SecretFile {
            name: "a".into(),
            data: "bc".into(),
            ..file.clone()
        };
        assert_ne!(SecretsDigest::of(&[a]), SecretsDigest::of(&[b]));
        assert_eq!(format!("{digest:?}"), "SecretsDigest(..)");
    }

    fn b64(s: &str) -> String {
        base64::engine::general_purpose::STANDARD.encode(s)
    }

    fn create(store: &SecretStore, name: &str, value: &str) -> Result<SecretInfo> {
        store.create(&CreateSecretRequest {
            name: name.into(),
            data: b64(value),
            permissions: None,
            uid: None,
            gid: None,
        })
    }

    #[test]
    fn create_list_update_delete_keep_values_private() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SecretStore::open(&dir.path().join("secrets")).expect("open");
        let info = store
            .create(&CreateSecretRequest {
                name: "db.pass".into(),
                data: b64("hunter2"),
                permissions: Some("0440".into()),
                uid: Some(1000),
                gid: Some(1000),
            })
            .expect("create");
        assert_eq!(
            (info.size, info.permissions.as_str(), info.uid, info.gid),
            (7, "0440", 1000, 1000)
        );
        let file = dir.path().join("secrets/db.pass.json");
        let mode = fs::metadata(&file).expect("file").permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "the host copy is for root only");
        let folder = fs::metadata(dir.path().join("secrets")).expect("dir");
        assert_eq!(folder.permissions().mode() & 0o777, 0o700);

        let err = create(&store, "db.pass", "x").expect_err("taken");
        assert!(matches!(err, SecretError::Exists(_)), "{err}");

        // Go's SDK always sends `data`; "" keeps the value.
        let info = store
            .update(
                "db.pass",
                &UpdateSecretRequest {
                    data: Some(String::new()),
                    permissions: Some("600".into()),
                    uid: None,
                    gid: None,
                },
            )
            .expect("update");
        assert_eq!((info.size, info.permissions.as_str()), (7, "0600"));
        let files = store.files("vm", &["db.pass".into()]).expect("files");
        assert_eq!(files[0].data, b64("hunter2"));
        assert_eq!((files[0].mode, files[0].uid), (0o600, 1000));

        assert_eq!(store.list().expect("list").len(), 1);
        store.delete("db.pass").expect("delete");
        assert!(store.list().expect("list").is_empty());
        let err = store.delete("db.pass").expect_err("gone");
        assert!(matches!(err, SecretError::NotFound(_)), "{err}");
    }

    #[test]
    fn bad_names_data_and_modes_are_refused_by_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SecretStore::open(dir.path()).expect("open");
        for name in ["", ".hidden", "a/b", "..", "sp ace", &"x".repeat(129)] {
            let err = create(&store, name, "v").expect_err(name);
            assert!(matches!(err, SecretError::BadName { .. }), "{name}: {err}");
        }
        let err = store
            .create(&CreateSecretRequest {
                name: "k".into(),
                data: "not base64!".into(),
                ..Default::default()
            })
            .expect_err("bad data");
        assert!(err.to_string().contains("base64"), "{err}");
        for mode in ["0800", "1777", "rw", "", "07777"] {
            let err = store
                .create(&CreateSecretRequest {
                    name: "k".into(),
                    data: b64("v"),
                    permissions: Some(mode.into()),
                    ..Default::default()
                })
                .expect_err(mode);
            assert!(
                matches!(err, SecretError::BadPermissions { .. }),
                "{mode}: {err}"
            );
        }
        let big = "x".repeat(MAX_SECRET_BYTES + 1);
        let err = create(&store, "big", &big).expect_err("too large");
        assert!(matches!(err, SecretError::TooLarge { .. }), "{err}");
        assert!(store.list().expect("list").is_empty(), "nothing was made");
    }

    #[test]
    fn grants_must_name_existing_secrets_once_within_the_limits() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SecretStore::open(dir.path()).expect("open");
        create(&store, "a", "1").expect("a");
        store.check_grants(&["a".into()]).expect("fine");
        let err = store.check_grants(&["b".into()]).expect_err("missing");
        assert!(err.to_string().contains("\"b\""), "{err}");
        let err = store
            .check_grants(&["a".into(), "a".into()])
            .expect_err("twice");
        assert!(matches!(err, SecretError::BadGrants(_)), "{err}");
        let big = "x".repeat(MAX_SECRET_BYTES);
        for n in ["b1", "b2", "b3"] {
            create(&store, n, &big).expect("big");
        }
        let err = store
            .check_grants(&["b1".into(), "b2".into(), "b3".into()])
            .expect_err("too much for one VM");
        assert!(matches!(err, SecretError::GrantsTooLarge { .. }), "{err}");
        // A grant of a secret deleted later is skipped at sync.
        store.delete("a").expect("delete");
        let files = store
            .files("vm", &["a".into(), "b1".into()])
            .expect("files");
        assert_eq!(files.len(), 1);
    }

    #[test]
    fn a_corrupt_file_is_reported_with_its_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SecretStore::open(dir.path()).expect("open");
        fs::write(dir.path().join("bad.json"), "{").expect("write");
        let err = store.list().expect_err("corrupt");
        assert!(err.to_string().contains("bad.json"), "{err}");
    }
}
