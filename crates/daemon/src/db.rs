//! The daemon's state: an embedded SQLite database with migrations.
//!
//! Every change is one transaction (WAL journal, `synchronous=NORMAL`), so
//! a `kill -9` of the daemon leaves either the state before a change or the
//! state after it: a committed transaction is in the WAL file, which the
//! kernel keeps whatever becomes of the process. Against a power loss, the
//! WAL is synced by [`Store::sync`]: at once for the records whose loss
//! would cost data or bring a deleted object back (commits, images,
//! deletions), and within a second for the others (the daemon's flusher).
//! Syncing each transaction (`synchronous=FULL`) serialised concurrent
//! forks on the disk: 50 hot forks at once took 19.6 ms p50 on the stand-in
//! launcher, 6.7 ms without (docs/daemon.md). The daemon's store has its
//! file to itself ([`Locking::Exclusive`]): a sync is one `fdatasync` of
//! the WAL, and the WAL goes into the main file only when
//! [`Store::checkpoint`] is asked to. A new VM's files are made inside the
//! transaction that records it (`Store::insert_vm_with`); other changes
//! record intent first and change files after. Start-up reconciliation
//! (`core::reconcile`) removes or finishes what an interrupted change left.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use rusqlite::{params, Connection, OptionalExtension, Row, Transaction};
use tine_proto::api::{
    CommitMode, Fixup, ForkNetwork, ImageExecDefaults, ImageFormat, ImageOrigin, StopMode, VmState,
};

use crate::network::VmNetwork;

/// What a VM asked for its network: no NIC, or a policy override.
pub type NetworkChoice = ForkNetwork;

/// Errors from the store.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    /// SQLite failed.
    #[error("state database: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// A stored value does not parse (the file was edited or corrupted).
    #[error("state database: bad value in {what}: {detail}")]
    Corrupt {
        /// Which column.
        what: &'static str,
        /// Why.
        detail: String,
    },
    /// A uniqueness rule: the value is taken.
    #[error("{0}")]
    Conflict(String),
    /// Another store (another daemon) has the file.
    #[error("state database {0} is in use by another process (only one tine daemon may use a data directory)")]
    InUse(PathBuf),
    /// Syncing the WAL failed: recent changes may not survive a power loss.
    #[error("cannot sync the state database's WAL {path}")]
    Sync {
        /// The WAL file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A checkpoint found a reader in its way, though the store has the
    /// file for itself.
    #[error("state database: the WAL checkpoint could not finish (another reader?)")]
    CheckpointBusy,
    /// The database was written by a newer tine.
    #[error("state database schema version {found} is newer than this tine understands ({known})")]
    TooNew {
        /// Version in the file.
        found: i64,
        /// Latest known here.
        known: i64,
    },
}

/// Result alias.
pub type Result<T> = std::result::Result<T, DbError>;

/// How a file store holds its file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Locking {
    /// The file is the store's alone until it is dropped (the daemon's):
    /// no transaction takes or releases a file lock, the WAL's index lives
    /// in the process's memory, a second opener is refused, and a sync is
    /// the WAL's `fdatasync` (a deletion with its sync took 0.22 ms here,
    /// 0.53 ms with a checkpoint on a second connection; docs/daemon.md).
    Exclusive,
    /// Other connections may use the file meanwhile (SQLite's own WAL
    /// locking, with a `-shm` index): for tests that open a second daemon
    /// on a data directory, as a restart would, while the first, frozen at
    /// a crash point, still holds its store.
    Shared,
}

/// Schema migrations, applied in order; `PRAGMA user_version` records how
/// many ran.
const MIGRATIONS: &[&str] = &[
    // 1: VMs, commits, images.
    "CREATE TABLE vms (
        hostname TEXT PRIMARY KEY,
        host_group TEXT NOT NULL,
        idx INTEGER NOT NULL,
        state TEXT NOT NULL,
        cpus INTEGER NOT NULL,
        ram_bytes INTEGER NOT NULL,
        persistent INTEGER NOT NULL,
        managed INTEGER NOT NULL DEFAULT 0,
        tags TEXT NOT NULL DEFAULT '[]',
        name TEXT UNIQUE,
        userdata TEXT,
        disk TEXT NOT NULL,
        network TEXT,
        policy TEXT,
        pid INTEGER,
        pid_start INTEGER,
        reason TEXT,
        created_ms INTEGER NOT NULL,
        started_ms INTEGER,
        boot_ms INTEGER,
        booted_once INTEGER NOT NULL DEFAULT 0,
        commit_id TEXT,
        parent_commit_id TEXT,
        fixups TEXT,
        UNIQUE(host_group, idx)
    );
    CREATE TABLE commits (
        id TEXT PRIMARY KEY,
        host_group TEXT NOT NULL,
        source TEXT NOT NULL,
        disk TEXT NOT NULL,
        tags TEXT NOT NULL,
        labels TEXT NOT NULL,
        source_tags TEXT NOT NULL DEFAULT '[]',
        cache_key TEXT UNIQUE,
        parent_commit_id TEXT,
        cpus INTEGER NOT NULL,
        ram_bytes INTEGER NOT NULL,
        size_bytes INTEGER NOT NULL,
        created_ms INTEGER NOT NULL,
        elapsed_ms INTEGER NOT NULL
    );
    CREATE TABLE images (
        name TEXT PRIMARY KEY,
        source TEXT NOT NULL,
        path TEXT NOT NULL,
        size_bytes INTEGER NOT NULL,
        imported_ms INTEGER NOT NULL
    );",
    // 2: how a VM's last run ended (api::StopMode).
    "ALTER TABLE vms ADD COLUMN stop_mode TEXT;",
    // 3: a VM without a NIC is stored as the network choice `"none"`, not
    // as a policy-shaped object.
    "UPDATE vms SET policy = '\"none\"' WHERE policy = '{\"mode\":\"none\"}';",
    // 4: secret grants (names) of VMs and of commits (forks inherit them),
    // and the public SSH keys a VM's first boot installs.
    "ALTER TABLE vms ADD COLUMN secrets TEXT NOT NULL DEFAULT '[]';
    ALTER TABLE vms ADD COLUMN ssh_keys TEXT NOT NULL DEFAULT '[]';
    ALTER TABLE commits ADD COLUMN secrets TEXT NOT NULL DEFAULT '[]';",
    // 5: memory commits (hot forks): what a commit holds, the folder of a
    // memory commit's state and memory files, and the RAM bytes it holds.
    "ALTER TABLE commits ADD COLUMN mode TEXT NOT NULL DEFAULT 'disk';
    ALTER TABLE commits ADD COLUMN snapshot TEXT;
    ALTER TABLE commits ADD COLUMN memory_bytes INTEGER;
    ALTER TABLE commits ADD COLUMN has_nic INTEGER;",
    // 6: the image store: a base's content hash, what it was made from,
    // where it came from and an OCI image's process defaults (JSON).
    "ALTER TABLE images ADD COLUMN digest TEXT;
    ALTER TABLE images ADD COLUMN format TEXT NOT NULL DEFAULT 'raw';
    ALTER TABLE images ADD COLUMN origin TEXT NOT NULL DEFAULT 'built-in';
    ALTER TABLE images ADD COLUMN exec_defaults TEXT;",
    // 7: a memory commit's own warm pool size (NULL: its group's).
    "ALTER TABLE commits ADD COLUMN hot_fork_pool INTEGER;",
];

/// One VM as recorded.
#[derive(Debug, Clone, PartialEq)]
pub struct VmRecord {
    /// `GROUP-N`.
    pub hostname: String,
    /// Host group.
    pub host_group: String,
    /// N.
    pub idx: u32,
    /// State.
    pub state: VmState,
    /// vCPUs.
    pub cpus: u32,
    /// RAM in bytes.
    pub ram_bytes: u64,
    /// Keeps its disk when stopped.
    pub persistent: bool,
    /// Kept running by the group's `count`.
    pub managed: bool,
    /// Tags.
    pub tags: Vec<String>,
    /// Friendly name.
    pub name: Option<String>,
    /// Userdata to install at first boot.
    pub userdata: Option<String>,
    /// Disk file.
    pub disk: String,
    /// Network the VM got (stored as JSON).
    pub network: Option<VmNetwork>,
    /// What the VM asked for: no NIC, or a policy override (stored as JSON).
    pub policy: Option<NetworkChoice>,
    /// tine-vmm pid while live.
    pub pid: Option<u32>,
    /// That process's start time (clock ticks since boot, /proc stat field
    /// 22): a pid reused by another process does not match.
    pub pid_start: Option<u64>,
    /// Why it stopped or failed.
    pub reason: Option<String>,
    /// How its last run ended; `None` while it runs or before it ran.
    pub stop_mode: Option<StopMode>,
    /// Created, Unix ms.
    pub created_ms: u64,
    /// Last started, Unix ms.
    pub started_ms: Option<u64>,
    /// Process start to agent ready, last boot.
    pub boot_ms: Option<u64>,
    /// Whether the first boot's set-up (userdata) was done.
    pub booted_once: bool,
    /// Commit made from this VM.
    pub commit_id: Option<String>,
    /// Commit this VM was forked from.
    pub parent_commit_id: Option<String>,
    /// Fix-ups still to apply at the next agent-ready (JSON list).
    pub fixups: Option<Vec<Fixup>>,
    /// Names of the secrets granted to it.
    pub secrets: Vec<String>,
    /// Public SSH keys its first boot installs.
    pub ssh_keys: Vec<String>,
}

impl VmRecord {
    /// A fork that has not reached agent-ready yet (its fix-ups are still
    /// pending): if it fails now, it is removed rather than kept failed.
    pub fn is_unborn_fork(&self) -> bool {
        self.parent_commit_id.is_some() && self.fixups.is_some()
    }
}

/// A new VM's fields; the store picks the hostname.
#[derive(Debug, Clone, Default)]
pub struct NewVm {
    /// Host group.
    pub host_group: String,
    /// vCPUs.
    pub cpus: u32,
    /// RAM in bytes.
    pub ram_bytes: u64,
    /// Keeps its disk when stopped.
    pub persistent: bool,
    /// Kept running by `count`.
    pub managed: bool,
    /// Tags.
    pub tags: Vec<String>,
    /// Friendly name.
    pub name: Option<String>,
    /// Userdata.
    pub userdata: Option<String>,
    /// No NIC, or a policy override.
    pub policy: Option<NetworkChoice>,
    /// Parent commit (forks).
    pub parent_commit_id: Option<String>,
    /// Fix-ups for the first agent-ready (forks).
    pub fixups: Option<Vec<Fixup>>,
    /// Whether first-boot set-up is already done (forks inherit it).
    pub booted_once: bool,
    /// Names of the secrets granted to it.
    pub secrets: Vec<String>,
    /// Public SSH keys its first boot installs.
    pub ssh_keys: Vec<String>,
}

/// One commit as recorded.
#[derive(Debug, Clone, PartialEq)]
pub struct CommitRecord {
    /// `cmt-<group>-<16 hex>`.
    pub id: String,
    /// Source's group.
    pub host_group: String,
    /// Source VM.
    pub source: String,
    /// The immutable disk.
    pub disk: String,
    /// Tags.
    pub tags: Vec<String>,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// The source's tags when it was committed (forks inherit them).
    pub source_tags: Vec<String>,
    /// Cache key.
    pub cache_key: Option<String>,
    /// The source's own parent commit.
    pub parent_commit_id: Option<String>,
    /// Source vCPUs.
    pub cpus: u32,
    /// Source RAM.
    pub ram_bytes: u64,
    /// Disk virtual size.
    pub size_bytes: u64,
    /// Created, Unix ms.
    pub created_ms: u64,
    /// How long the commit took.
    pub elapsed_ms: u64,
    /// The source's secret grants (forks inherit them).
    pub secrets: Vec<String>,
    /// What it holds.
    pub mode: CommitMode,
    /// A memory commit's snapshot folder (its `state` and `memory` files).
    pub snapshot: Option<String>,
    /// Bytes of guest RAM a memory commit holds.
    pub memory_bytes: Option<u64>,
    /// Whether a memory commit's source had a NIC (its forks must too).
    pub has_nic: Option<bool>,
    /// A memory commit's own warm pool size (none: its group's
    /// `hot_fork_pool`).
    pub hot_fork_pool: Option<u32>,
}

/// Which commits a listing shows: those matching every filter given.
#[derive(Debug, Clone, Copy, Default)]
pub struct CommitFilter<'a> {
    /// Tags a commit has (all of them).
    pub tags: &'a [&'a str],
    /// Its cache key.
    pub cache_key: Option<&'a str>,
    /// Its source VM.
    pub source: Option<&'a str>,
    /// What it holds.
    pub mode: Option<CommitMode>,
}

/// An image imported into the data directory.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageRecord {
    /// Name or the source path.
    pub name: String,
    /// Where it came from.
    pub source: String,
    /// The immutable copy.
    pub path: String,
    /// Size in bytes.
    pub size_bytes: u64,
    /// `sha256:<hex>` of the base file (absent for bases recorded before
    /// images were hashed).
    pub digest: Option<String>,
    /// What it was made from.
    pub format: ImageFormat,
    /// Where it came from.
    pub origin: ImageOrigin,
    /// An OCI image's process defaults.
    pub exec_defaults: Option<ImageExecDefaults>,
    /// Recorded, Unix ms.
    pub created_ms: u64,
}

/// The database.
#[derive(Debug)]
pub struct Store {
    conn: Mutex<Connection>,
    /// The WAL file of a file store, which [`Store::sync`] syncs through a
    /// descriptor of its own, so that the sync never holds `conn`; none
    /// for an in-memory store.
    wal: Option<PathBuf>,
    /// Held by a sync or checkpoint under way: a second caller waits for it
    /// instead of finding the change count taken and returning early.
    syncing: Mutex<()>,
    /// The connection's change count at the last [`Store::sync`].
    synced_changes: AtomicU64,
}

fn json_vec(s: &str, what: &'static str) -> Result<Vec<String>> {
    serde_json::from_str(s).map_err(|e| DbError::Corrupt {
        what,
        detail: e.to_string(),
    })
}

fn json_typed<T: serde::de::DeserializeOwned>(
    s: Option<String>,
    what: &'static str,
) -> Result<Option<T>> {
    s.map(|text| {
        serde_json::from_str(&text).map_err(|e| DbError::Corrupt {
            what,
            detail: e.to_string(),
        })
    })
    .transpose()
}

fn to_json<T: serde::Serialize>(v: &T) -> String {
    // Vec<String>, maps and Values always serialize.
    serde_json::to_string(v).unwrap_or_else(|_| "null".into())
}

const VM_COLUMNS: &str = "hostname, host_group, idx, state, cpus, ram_bytes, persistent, managed, \
     tags, name, userdata, disk, network, policy, pid, pid_start, reason, created_ms, started_ms, \
     boot_ms, booted_once, commit_id, parent_commit_id, fixups, stop_mode, secrets, ssh_keys";

fn vm_from_row(row: &Row<'_>) -> rusqlite::Result<std::result::Result<VmRecord, DbError>> {
    let state: String = row.get(3)?;
    let tags: String = row.get(8)?;
    let network: Option<String> = row.get(12)?;
    let policy: Option<String> = row.get(13)?;
    let fixups: Option<String> = row.get(23)?;
    let stop_mode: Option<String> = row.get(24)?;
    let secrets: String = row.get(25)?;
    let ssh_keys: String = row.get(26)?;
    let build = || -> Result<VmRecord> {
        Ok(VmRecord {
            hostname: row.get(0)?,
            host_group: row.get(1)?,
            idx: row.get(2)?,
            state: VmState::parse(&state).ok_or_else(|| DbError::Corrupt {
                what: "vms.state",
                detail: state.clone(),
            })?,
            cpus: row.get(4)?,
            ram_bytes: row.get::<_, i64>(5)? as u64,
            persistent: row.get(6)?,
            managed: row.get(7)?,
            tags: json_vec(&tags, "vms.tags")?,
            name: row.get(9)?,
            userdata: row.get(10)?,
            disk: row.get(11)?,
            network: json_typed(network, "vms.network")?,
            policy: json_typed(policy, "vms.policy")?,
            pid: row.get(14)?,
            pid_start: row.get::<_, Option<i64>>(15)?.map(|v| v as u64),
            reason: row.get(16)?,
            created_ms: row.get::<_, i64>(17)? as u64,
            started_ms: row.get::<_, Option<i64>>(18)?.map(|v| v as u64),
            boot_ms: row.get::<_, Option<i64>>(19)?.map(|v| v as u64),
            booted_once: row.get(20)?,
            commit_id: row.get(21)?,
            parent_commit_id: row.get(22)?,
            fixups: json_typed(fixups, "vms.fixups")?,
            stop_mode: stop_mode
                .map(|m| {
                    StopMode::parse(&m).ok_or(DbError::Corrupt {
                        what: "vms.stop_mode",
                        detail: m,
                    })
                })
                .transpose()?,
            secrets: json_vec(&secrets, "vms.secrets")?,
            ssh_keys: json_vec(&ssh_keys, "vms.ssh_keys")?,
        })
    };
    Ok(build())
}

const COMMIT_COLUMNS: &str = "id, host_group, source, disk, tags, labels, cache_key, \
     parent_commit_id, cpus, ram_bytes, size_bytes, created_ms, elapsed_ms, source_tags, secrets, \
     mode, snapshot, memory_bytes, has_nic, hot_fork_pool";

fn commit_from_row(row: &Row<'_>) -> rusqlite::Result<std::result::Result<CommitRecord, DbError>> {
    let tags: String = row.get(4)?;
    let labels: String = row.get(5)?;
    let source_tags: String = row.get(13)?;
    let secrets: String = row.get(14)?;
    let mode: String = row.get(15)?;
    let build = || -> Result<CommitRecord> {
        Ok(CommitRecord {
            id: row.get(0)?,
            host_group: row.get(1)?,
            source: row.get(2)?,
            disk: row.get(3)?,
            tags: json_vec(&tags, "commits.tags")?,
            labels: serde_json::from_str(&labels).map_err(|e| DbError::Corrupt {
                what: "commits.labels",
                detail: e.to_string(),
            })?,
            cache_key: row.get(6)?,
            parent_commit_id: row.get(7)?,
            cpus: row.get(8)?,
            ram_bytes: row.get::<_, i64>(9)? as u64,
            size_bytes: row.get::<_, i64>(10)? as u64,
            created_ms: row.get::<_, i64>(11)? as u64,
            elapsed_ms: row.get::<_, i64>(12)? as u64,
            source_tags: json_vec(&source_tags, "commits.source_tags")?,
            secrets: json_vec(&secrets, "commits.secrets")?,
            mode: mode.parse::<CommitMode>().map_err(|_| DbError::Corrupt {
                what: "commits.mode",
                detail: mode.clone(),
            })?,
            snapshot: row.get(16)?,
            memory_bytes: row.get::<_, Option<i64>>(17)?.map(|b| b as u64),
            has_nic: row.get(18)?,
            hot_fork_pool: row.get(19)?,
        })
    };
    Ok(build())
}

/// Current Unix time in milliseconds.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The WAL of the database at `db`: `<db>-wal`, beside it.
fn wal_path(db: &Path) -> PathBuf {
    let mut wal = db.as_os_str().to_owned();
    wal.push("-wal");
    PathBuf::from(wal)
}

impl Store {
    /// Opens (creating if needed) the database at `path` and migrates it,
    /// for itself ([`Locking::Exclusive`]).
    pub fn open(path: &Path) -> Result<Self> {
        Self::open_with(path, Locking::Exclusive)
    }

    /// Opens (creating if needed) the database at `path` and migrates it,
    /// holding it as `locking` says.
    pub fn open_with(path: &Path, locking: Locking) -> Result<Self> {
        let conn = Connection::open(path)?;
        match locking {
            Locking::Exclusive => {
                // Set before the first read, which takes the lock: the
                // WAL's index then lives in this process's memory (no
                // `-shm` file), and no transaction takes or releases a
                // file lock.
                conn.pragma_update(None, "locking_mode", "EXCLUSIVE")?;
                // Taken at once or not at all: only one daemon may use a
                // data directory (its lock file says so first).
                conn.busy_timeout(Duration::ZERO)?;
            }
            Locking::Shared => conn.busy_timeout(Duration::from_secs(5))?,
        }
        let mut store = Self::setup(conn).map_err(|e| match e {
            DbError::Sqlite(e)
                if e.sqlite_error_code() == Some(rusqlite::ErrorCode::DatabaseBusy) =>
            {
                DbError::InUse(path.to_path_buf())
            }
            e => e,
        })?;
        // No commit checkpoints on its own (that would sync the disk
        // twice on a request's path): `checkpoint` does, when asked.
        store.lock().pragma_update(None, "wal_autocheckpoint", 0)?;
        store.wal = Some(wal_path(path));
        Ok(store)
    }

    /// An in-memory store, for tests.
    pub fn in_memory() -> Result<Self> {
        Self::setup(Connection::open_in_memory()?)
    }

    fn setup(mut conn: Connection) -> Result<Self> {
        // Every statement the store runs stays prepared.
        conn.set_prepared_statement_cache_capacity(64);
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
        let known = MIGRATIONS.len() as i64;
        if version > known {
            return Err(DbError::TooNew {
                found: version,
                known,
            });
        }
        for (i, sql) in MIGRATIONS.iter().enumerate().skip(version as usize) {
            let tx = conn.transaction()?;
            tx.execute_batch(sql)?;
            tx.pragma_update(None, "user_version", (i + 1) as i64)?;
            tx.commit()?;
        }
        Ok(Store {
            conn: Mutex::new(conn),
            wal: None,
            syncing: Mutex::new(()),
            synced_changes: AtomicU64::new(0),
        })
    }

    /// Makes every committed transaction durable against a power loss: a
    /// committed transaction is in the WAL, so syncing the WAL's file is
    /// enough (nothing to do when no transaction came since the last
    /// call). It syncs through its own descriptor, without the
    /// connection: requests go on meanwhile.
    pub fn sync(&self) -> Result<()> {
        let _one_at_a_time = self.syncing.lock().unwrap_or_else(|p| p.into_inner());
        let changes = self.lock().total_changes();
        if self.synced_changes.load(Ordering::SeqCst) == changes {
            return Ok(());
        }
        if let Some(wal) = &self.wal {
            match File::open(wal) {
                Ok(f) => f.sync_data(),
                // No WAL yet: nothing was written since the store opened
                // the file, and a clean close leaves all in the main file,
                // synced, before it removes the WAL.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(e),
            }
            .map_err(|source| DbError::Sync {
                path: wal.clone(),
                source,
            })?;
        }
        self.synced_changes.store(changes, Ordering::SeqCst);
        Ok(())
    }

    /// Changes committed since the last [`Store::sync`]: those a power
    /// loss could take.
    pub fn unsynced_changes(&self) -> u64 {
        self.lock()
            .total_changes()
            .saturating_sub(self.synced_changes.load(Ordering::SeqCst))
    }

    /// Bytes in the WAL (0 for an in-memory store).
    pub fn wal_bytes(&self) -> u64 {
        self.wal
            .as_ref()
            .and_then(|wal| std::fs::metadata(wal).ok())
            .map_or(0, |m| m.len())
    }

    /// Copies the WAL into the main file and starts it over, if it holds
    /// at least `min_wal_bytes`; true if it did. It holds the connection
    /// throughout (copying the pages, then syncing the WAL before and the
    /// main file after): requests wait meanwhile, so the daemon asks when
    /// no fork is under way.
    pub fn checkpoint(&self, min_wal_bytes: u64) -> Result<bool> {
        if self.wal.is_none() || self.wal_bytes() < min_wal_bytes {
            return Ok(false);
        }
        // The WAL's own sync, first and without the connection, leaves the
        // checkpoint's little to wait for.
        self.sync()?;
        let _one_at_a_time = self.syncing.lock().unwrap_or_else(|p| p.into_inner());
        let conn = self.lock();
        let busy: i64 = conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get(0))?;
        if busy != 0 {
            // No other connection can read the file, so this is not
            // expected; the WAL stays as it is, and whole.
            return Err(DbError::CheckpointBusy);
        }
        // The first write after a checkpoint starts the WAL over and syncs
        // its new header (0.2 to 0.4 ms here): made now, by a write that
        // changes nothing, it is not a request's.
        let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
        conn.pragma_update(None, "user_version", version)?;
        // Everything committed is in the synced main file now.
        self.synced_changes
            .store(conn.total_changes(), Ordering::SeqCst);
        Ok(true)
    }

    /// [`Store::sync`] after a change that must survive a power loss once
    /// answered; the change itself is already committed, so a failed sync
    /// is logged, not returned.
    fn sync_now(&self, what: &str) {
        if let Err(e) = self.sync() {
            tracing::warn!("cannot sync the state after {what}: {e}");
        }
    }

    fn lock(&self) -> MutexGuard<'_, Connection> {
        // A panic while holding the lock cannot leave a half transaction
        // (rusqlite rolls back on drop), so a poisoned lock is still usable.
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` in one transaction.
    pub fn transaction<T>(&self, f: impl FnOnce(&Transaction<'_>) -> Result<T>) -> Result<T> {
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        let out = f(&tx)?;
        tx.commit()?;
        Ok(out)
    }

    /// Records a new VM with the next free `GROUP-N` hostname, queued for
    /// its first boot (`starting`, no process); `disk_for` names its disk
    /// from the hostname.
    pub fn insert_vm(&self, new: &NewVm, disk_for: impl Fn(&str) -> String) -> Result<VmRecord> {
        self.insert_vm_with(new, disk_for, |_| Ok::<(), DbError>(()))
    }

    /// [`Store::insert_vm`], with `prepare` making the VM's files inside
    /// the transaction, before it commits: a crash leaves either no record
    /// (and files that start-up reconciliation removes) or the record with
    /// its files, and a failed `prepare` records nothing. The store is
    /// locked meanwhile, so `prepare` must be quick.
    pub fn insert_vm_with<E: From<DbError>>(
        &self,
        new: &NewVm,
        disk_for: impl Fn(&str) -> String,
        prepare: impl FnOnce(&VmRecord) -> std::result::Result<(), E>,
    ) -> std::result::Result<VmRecord, E> {
        let mut conn = self.lock();
        let tx = conn.transaction().map_err(DbError::from)?;
        let vm = insert_vm_tx(&tx, new, &disk_for)?;
        prepare(&vm)?;
        tx.commit().map_err(DbError::from)?;
        Ok(vm)
    }

    /// The VM with this hostname, or with this friendly name.
    pub fn find_vm(&self, key: &str) -> Result<Option<VmRecord>> {
        let conn = self.lock();
        let sql = format!("SELECT {VM_COLUMNS} FROM vms WHERE hostname = ?1 OR name = ?1 LIMIT 1");
        let found = conn
            .prepare_cached(&sql)?
            .query_row([key], vm_from_row)
            .optional()?;
        found.transpose()
    }

    /// Every VM, optionally of one group, ordered by group and number.
    pub fn list_vms(&self, group: Option<&str>) -> Result<Vec<VmRecord>> {
        let conn = self.lock();
        let sql = format!(
            "SELECT {VM_COLUMNS} FROM vms WHERE (?1 IS NULL OR host_group = ?1) \
             ORDER BY host_group, idx"
        );
        let mut stmt = conn.prepare_cached(&sql)?;
        let rows = stmt.query_map([group], vm_from_row)?;
        let mut out = Vec::new();
        for row in rows {
            out.push(row??);
        }
        Ok(out)
    }

    /// Sets a VM's state and reason; `None` reason clears it.
    pub fn set_state(&self, hostname: &str, state: VmState, reason: Option<&str>) -> Result<()> {
        self.lock()
            .prepare_cached("UPDATE vms SET state = ?2, reason = ?3 WHERE hostname = ?1")?
            .execute(params![hostname, state.as_str(), reason])?;
        Ok(())
    }

    /// Sets the state only if it is currently one of `from`; returns whether
    /// it changed.
    pub fn transition(
        &self,
        hostname: &str,
        from: &[VmState],
        to: VmState,
        reason: Option<&str>,
    ) -> Result<bool> {
        self.transaction(|tx| {
            let Some(vm) = get_vm_tx(tx, hostname)? else {
                return Ok(false);
            };
            if !from.contains(&vm.state) {
                return Ok(false);
            }
            tx.prepare_cached("UPDATE vms SET state = ?2, reason = ?3 WHERE hostname = ?1")?
                .execute(params![hostname, to.as_str(), reason])?;
            Ok(true)
        })
    }

    /// Records a started process.
    pub fn set_process(&self, hostname: &str, pid: u32, pid_start: u64) -> Result<()> {
        self.lock()
            .prepare_cached(
                "UPDATE vms SET state = 'starting', pid = ?2, pid_start = ?3, started_ms = ?4, \
             reason = NULL, stop_mode = NULL, boot_ms = NULL WHERE hostname = ?1",
            )?
            .execute(params![hostname, pid, pid_start as i64, now_ms() as i64])?;
        Ok(())
    }

    /// Records a suspend as done, in one statement: `suspending` becomes
    /// `suspended` and the process is forgotten (its VMM is stopped after
    /// this, and a crash before that leaves a run no record names, which
    /// start-up kills). False when the VM was not `suspending`.
    pub fn record_suspended(&self, hostname: &str) -> Result<bool> {
        let changed = self
            .lock()
            .prepare_cached(
                "UPDATE vms SET state = 'suspended', pid = NULL, pid_start = NULL, reason = NULL, \
             stop_mode = NULL WHERE hostname = ?1 AND state = 'suspending'",
            )?
            .execute([hostname])?;
        Ok(changed == 1)
    }

    /// Records the process a suspended VM was restored into, in one
    /// statement: `suspended` becomes `starting` (the agent has not answered
    /// yet) with the process. False when the VM was not `suspended`.
    pub fn record_restored(&self, hostname: &str, pid: u32, pid_start: u64) -> Result<bool> {
        let changed = self
            .lock()
            .prepare_cached(
                "UPDATE vms SET state = 'starting', pid = ?2, pid_start = ?3, started_ms = ?4, \
             reason = NULL, stop_mode = NULL, boot_ms = NULL \
             WHERE hostname = ?1 AND state = 'suspended'",
            )?
            .execute(params![hostname, pid, pid_start as i64, now_ms() as i64])?;
        Ok(changed == 1)
    }

    /// Marks a VM as waiting for a boot slot: `starting`, no process yet.
    pub fn queue_start(&self, hostname: &str) -> Result<()> {
        self.lock()
            .prepare_cached(
                "UPDATE vms SET state = 'starting', pid = NULL, pid_start = NULL, reason = NULL, \
             stop_mode = NULL, boot_ms = NULL WHERE hostname = ?1",
            )?
            .execute([hostname])?;
        Ok(())
    }

    /// Records that the process is gone, why, and how it ended.
    pub fn clear_process(
        &self,
        hostname: &str,
        state: VmState,
        reason: Option<&str>,
        stop_mode: Option<StopMode>,
    ) -> Result<()> {
        self.lock().prepare_cached("UPDATE vms SET state = ?2, reason = ?3, stop_mode = ?4, pid = NULL, pid_start = NULL \
             WHERE hostname = ?1")?.execute(params![
                hostname,
                state.as_str(),
                reason,
                stop_mode.map(StopMode::as_str)
            ],
        )?;
        Ok(())
    }

    /// Marks the agent ready after this boot's set-up.
    pub fn set_running(&self, hostname: &str, boot_ms: u64) -> Result<()> {
        self.lock()
            .prepare_cached(
                "UPDATE vms SET state = 'running', boot_ms = ?2, booted_once = 1, fixups = NULL \
             WHERE hostname = ?1 AND state = 'starting'",
            )?
            .execute(params![hostname, boot_ms as i64])?;
        Ok(())
    }

    /// Stores the VM's network.
    pub fn set_network(&self, hostname: &str, network: Option<&VmNetwork>) -> Result<()> {
        self.lock()
            .prepare_cached("UPDATE vms SET network = ?2 WHERE hostname = ?1")?
            .execute(params![hostname, network.map(to_json)])?;
        Ok(())
    }

    /// Stores a VM's policy choice and its network together (a live policy
    /// change), in one statement.
    pub fn set_policy(
        &self,
        hostname: &str,
        policy: Option<&NetworkChoice>,
        network: Option<&VmNetwork>,
    ) -> Result<()> {
        self.lock()
            .prepare_cached("UPDATE vms SET policy = ?2, network = ?3 WHERE hostname = ?1")?
            .execute(params![hostname, policy.map(to_json), network.map(to_json)])?;
        Ok(())
    }

    /// Replaces a VM's tags.
    pub fn set_tags(&self, hostname: &str, tags: &[String]) -> Result<()> {
        self.lock()
            .prepare_cached("UPDATE vms SET tags = ?2 WHERE hostname = ?1")?
            .execute(params![hostname, to_json(&tags)])?;
        Ok(())
    }

    /// Points a VM at another disk file.
    pub fn set_disk(&self, hostname: &str, disk: &str) -> Result<()> {
        self.lock()
            .prepare_cached("UPDATE vms SET disk = ?2 WHERE hostname = ?1")?
            .execute(params![hostname, disk])?;
        Ok(())
    }

    /// Removes a VM's record.
    pub fn delete_vm(&self, hostname: &str) -> Result<()> {
        self.lock()
            .prepare_cached("DELETE FROM vms WHERE hostname = ?1")?
            .execute([hostname])?;
        self.sync_now("a VM's deletion");
        Ok(())
    }

    /// Records a commit and marks its source, in one transaction; a taken
    /// cache key or an already committed source is a conflict.
    pub fn insert_commit(&self, c: &CommitRecord, source_new_disk: &str) -> Result<()> {
        self.transaction(|tx| {
            if let Some(key) = &c.cache_key {
                let taken: Option<String> = tx
                    .prepare_cached("SELECT id FROM commits WHERE cache_key = ?1")?.query_row([key], |r| {
                        r.get(0)
                    })
                    .optional()?;
                if let Some(id) = taken {
                    return Err(DbError::Conflict(format!(
                        "the cache key `{key}` is already used by commit {id}"
                    )));
                }
            }
            let source = get_vm_tx(tx, &c.source)?.ok_or_else(|| {
                DbError::Conflict(format!("{} was deleted during the commit", c.source))
            })?;
            if let Some(id) = source.commit_id {
                return Err(DbError::Conflict(format!(
                    "{} was already committed as {id}",
                    c.source
                )));
            }
            tx.prepare_cached(&format!("INSERT INTO commits ({COMMIT_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20)"))?.execute(params![
                    c.id,
                    c.host_group,
                    c.source,
                    c.disk,
                    to_json(&c.tags),
                    to_json(&c.labels),
                    c.cache_key,
                    c.parent_commit_id,
                    c.cpus,
                    c.ram_bytes as i64,
                    c.size_bytes as i64,
                    c.created_ms as i64,
                    c.elapsed_ms as i64,
                    to_json(&c.source_tags),
                    to_json(&c.secrets),
                    c.mode.as_str(),
                    c.snapshot,
                    c.memory_bytes.map(|b| b as i64),
                    c.has_nic,
                    c.hot_fork_pool,
                ],
            )?;
            tx.prepare_cached("UPDATE vms SET commit_id = ?2, disk = ?3 WHERE hostname = ?1")?.execute(params![c.source, c.id, source_new_disk],
            )?;
            Ok(())
        })?;
        self.sync_now("a commit");
        Ok(())
    }

    /// Sets a commit's own warm pool size (none: its group's); false when
    /// there is no such commit.
    pub fn set_commit_pool(&self, id: &str, size: Option<u32>) -> Result<bool> {
        let changed = self
            .lock()
            .prepare_cached("UPDATE commits SET hot_fork_pool = ?2 WHERE id = ?1")?
            .execute(params![id, size])?;
        Ok(changed == 1)
    }

    /// One commit.
    pub fn get_commit(&self, id: &str) -> Result<Option<CommitRecord>> {
        let conn = self.lock();
        let sql = format!("SELECT {COMMIT_COLUMNS} FROM commits WHERE id = ?1");
        let found = conn
            .prepare_cached(&sql)?
            .query_row([id], commit_from_row)
            .optional()?;
        found.transpose()
    }

    /// Commits matching every filter given, oldest first.
    pub fn list_commits(&self, filter: &CommitFilter<'_>) -> Result<Vec<CommitRecord>> {
        let conn = self.lock();
        let sql = format!(
            "SELECT {COMMIT_COLUMNS} FROM commits WHERE (?1 IS NULL OR cache_key = ?1) \
             AND (?2 IS NULL OR source = ?2) AND (?3 IS NULL OR mode = ?3) \
             ORDER BY created_ms, id"
        );
        let mut stmt = conn.prepare_cached(&sql)?;
        let mode = filter.mode.map(CommitMode::as_str);
        let rows = stmt.query_map(
            params![filter.cache_key, filter.source, mode],
            commit_from_row,
        )?;
        let mut out = Vec::new();
        for row in rows {
            let c = row??;
            if filter.tags.iter().all(|t| c.tags.iter().any(|x| x == t)) {
                out.push(c);
            }
        }
        Ok(out)
    }

    /// Deletes a commit unless a VM depends on it (its source still exists,
    /// or a fork of it); the conflict names them.
    pub fn delete_commit(&self, id: &str) -> Result<Option<CommitRecord>> {
        self.transaction(|tx| {
            let sql = format!("SELECT {COMMIT_COLUMNS} FROM commits WHERE id = ?1");
            let Some(c) = tx
                .prepare_cached(&sql)?
                .query_row([id], commit_from_row)
                .optional()?
                .transpose()?
            else {
                return Ok(None);
            };
            let mut stmt = tx.prepare_cached(
                "SELECT hostname FROM vms WHERE commit_id = ?1 OR parent_commit_id = ?1 \
                 ORDER BY hostname",
            )?;
            let users: Vec<String> = stmt
                .query_map([id], |r| r.get(0))?
                .collect::<rusqlite::Result<_>>()?;
            let mut children = tx
                .prepare_cached("SELECT id FROM commits WHERE parent_commit_id = ?1 ORDER BY id")?;
            let child_commits: Vec<String> = children
                .query_map([id], |r| r.get(0))?
                .collect::<rusqlite::Result<_>>()?;
            if !users.is_empty() || !child_commits.is_empty() {
                let mut names = users;
                names.extend(child_commits);
                return Err(DbError::Conflict(format!(
                    "commit {id} is still used by {}; delete them first",
                    names.join(", ")
                )));
            }
            tx.prepare_cached("DELETE FROM commits WHERE id = ?1")?
                .execute([id])?;
            Ok(Some(c))
        })
        .inspect(|_| self.sync_now("a commit's deletion"))
    }

    /// An imported image.
    pub fn get_image(&self, name: &str) -> Result<Option<ImageRecord>> {
        self.lock()
            .prepare_cached(&format!(
                "SELECT {IMAGE_COLUMNS} FROM images WHERE name = ?1"
            ))?
            .query_row([name], image_from_row)
            .optional()
            .map_err(Into::into)
    }

    /// Every recorded image, by name.
    pub fn list_images(&self) -> Result<Vec<ImageRecord>> {
        let conn = self.lock();
        let mut stmt =
            conn.prepare_cached(&format!("SELECT {IMAGE_COLUMNS} FROM images ORDER BY name"))?;
        let out = stmt
            .query_map([], image_from_row)?
            .collect::<rusqlite::Result<_>>()?;
        Ok(out)
    }

    /// Records (or replaces) a built-in image's base.
    pub fn put_image(&self, img: &ImageRecord) -> Result<()> {
        write_image(&self.lock(), "INSERT OR REPLACE", img)?;
        self.sync_now("an image's record");
        Ok(())
    }

    /// Records a new image; a name already recorded is a conflict (images
    /// are immutable).
    pub fn insert_image(&self, img: &ImageRecord) -> Result<()> {
        self.transaction(|tx| {
            let taken: Option<String> = tx
                .prepare_cached("SELECT name FROM images WHERE name = ?1")?
                .query_row([&img.name], |r| r.get(0))
                .optional()?;
            if taken.is_some() {
                return Err(DbError::Conflict(format!(
                    "an image called `{}` already exists; images are immutable: \
                     delete it first or pick another name",
                    img.name
                )));
            }
            write_image(tx, "INSERT", img)
        })?;
        self.sync_now("an image's record");
        Ok(())
    }

    /// Forgets an image; returns whether it was recorded.
    pub fn delete_image(&self, name: &str) -> Result<bool> {
        let n = self
            .lock()
            .prepare_cached("DELETE FROM images WHERE name = ?1")?
            .execute([name])?;
        self.sync_now("an image's deletion");
        Ok(n > 0)
    }

    /// Every file and folder a commit holds: each one's disk and, for a
    /// memory commit, its snapshot folder.
    pub fn commit_paths(&self) -> Result<Vec<String>> {
        let conn = self.lock();
        let mut stmt = conn.prepare_cached("SELECT disk, snapshot FROM commits")?;
        let mut out = Vec::new();
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get::<_, Option<String>>(1)?)))?;
        for row in rows {
            let (disk, snapshot) = row?;
            out.push(disk);
            out.extend(snapshot);
        }
        Ok(out)
    }

    /// Every image path recorded.
    pub fn image_paths(&self) -> Result<Vec<String>> {
        let conn = self.lock();
        let mut stmt = conn.prepare_cached("SELECT path FROM images")?;
        let out = stmt
            .query_map([], |r| r.get(0))?
            .collect::<rusqlite::Result<_>>()?;
        Ok(out)
    }
}

/// The columns [`image_from_row`] reads, in its order.
const IMAGE_COLUMNS: &str =
    "name, source, path, size_bytes, digest, format, origin, exec_defaults, imported_ms";

fn image_from_row(r: &Row<'_>) -> rusqlite::Result<ImageRecord> {
    let text_column = |i: usize, e: String| {
        rusqlite::Error::FromSqlConversionFailure(i, rusqlite::types::Type::Text, e.into())
    };
    let format: String = r.get(5)?;
    let origin: String = r.get(6)?;
    let exec_defaults: Option<String> = r.get(7)?;
    Ok(ImageRecord {
        name: r.get(0)?,
        source: r.get(1)?,
        path: r.get(2)?,
        size_bytes: r.get::<_, i64>(3)? as u64,
        digest: r.get(4)?,
        format: format.parse().map_err(|e| text_column(5, format!("{e}")))?,
        origin: origin.parse().map_err(|e| text_column(6, format!("{e}")))?,
        exec_defaults: exec_defaults
            .map(|j| serde_json::from_str(&j).map_err(|e| text_column(7, e.to_string())))
            .transpose()?,
        created_ms: r.get::<_, i64>(8)? as u64,
    })
}

fn write_image(conn: &Connection, verb: &str, img: &ImageRecord) -> Result<()> {
    let exec_defaults = img
        .exec_defaults
        .as_ref()
        .map(serde_json::to_string)
        .transpose()
        .map_err(|e| DbError::Corrupt {
            what: "images.exec_defaults",
            detail: e.to_string(),
        })?;
    conn.prepare_cached(&format!(
        "{verb} INTO images (name, source, path, size_bytes, digest, format, origin, \
         exec_defaults, imported_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)"
    ))?
    .execute(params![
        img.name,
        img.source,
        img.path,
        img.size_bytes as i64,
        img.digest,
        img.format.as_str(),
        img.origin.as_str(),
        exec_defaults,
        img.created_ms as i64
    ])?;
    Ok(())
}

/// Inserts a new VM's row (see [`Store::insert_vm`]).
fn insert_vm_tx(
    tx: &Transaction<'_>,
    new: &NewVm,
    disk_for: &dyn Fn(&str) -> String,
) -> Result<VmRecord> {
    if let Some(name) = &new.name {
        let taken: Option<String> = tx
            .prepare_cached("SELECT hostname FROM vms WHERE name = ?1")?
            .query_row([name], |r| r.get(0))
            .optional()?;
        if let Some(h) = taken {
            return Err(DbError::Conflict(format!(
                "the name `{name}` is already used by {h}"
            )));
        }
    }
    let idx: u32 = tx
        .prepare_cached("SELECT COALESCE(MAX(idx), 0) + 1 FROM vms WHERE host_group = ?1")?
        .query_row([&new.host_group], |r| r.get(0))?;
    let hostname = format!("{}-{idx}", new.host_group);
    let disk = disk_for(&hostname);
    tx.prepare_cached(
        "INSERT INTO vms (hostname, host_group, idx, state, cpus, ram_bytes, persistent, \
             managed, tags, name, userdata, disk, policy, created_ms, booted_once, \
             parent_commit_id, fixups, secrets, ssh_keys) \
             VALUES (?1, ?2, ?3, 'starting', ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, \
             ?15, ?16, ?17, ?18)",
    )?
    .execute(params![
        hostname,
        new.host_group,
        idx,
        new.cpus,
        new.ram_bytes as i64,
        new.persistent,
        new.managed,
        to_json(&new.tags),
        new.name,
        new.userdata,
        disk,
        new.policy.as_ref().map(to_json),
        now_ms() as i64,
        new.booted_once,
        new.parent_commit_id,
        new.fixups.as_ref().map(to_json),
        to_json(&new.secrets),
        to_json(&new.ssh_keys),
    ])?;
    get_vm_tx(tx, &hostname)?.ok_or_else(|| DbError::Corrupt {
        what: "vms",
        detail: format!("{hostname} vanished after insert"),
    })
}

fn get_vm_tx(tx: &Transaction<'_>, hostname: &str) -> Result<Option<VmRecord>> {
    let sql = format!("SELECT {VM_COLUMNS} FROM vms WHERE hostname = ?1");
    tx.prepare_cached(&sql)?
        .query_row([hostname], vm_from_row)
        .optional()?
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn new_vm(group: &str) -> NewVm {
        NewVm {
            host_group: group.into(),
            cpus: 1,
            ram_bytes: 256 << 20,
            ..NewVm::default()
        }
    }

    fn disk(h: &str) -> String {
        format!("/d/{h}.qcow2")
    }

    #[test]
    fn hostnames_count_up_per_group() {
        let s = Store::in_memory().expect("open");
        let a = s.insert_vm(&new_vm("dev"), disk).expect("a");
        let b = s.insert_vm(&new_vm("dev"), disk).expect("b");
        let c = s.insert_vm(&new_vm("ci"), disk).expect("c");
        assert_eq!(
            (
                a.hostname.as_str(),
                b.hostname.as_str(),
                c.hostname.as_str()
            ),
            ("dev-1", "dev-2", "ci-1")
        );
        assert_eq!(a.state, VmState::Starting);
        assert_eq!(a.pid, None);
        assert_eq!(b.disk, "/d/dev-2.qcow2");
        assert_eq!(s.list_vms(Some("dev")).expect("list").len(), 2);
        assert_eq!(s.list_vms(None).expect("list").len(), 3);
    }

    #[test]
    fn names_are_unique_and_find_works_by_name() {
        let s = Store::in_memory().expect("open");
        let mut n = new_vm("dev");
        n.name = Some("web".into());
        s.insert_vm(&n, disk).expect("first");
        let err = s.insert_vm(&n, disk).expect_err("taken");
        assert!(
            err.to_string().contains("`web` is already used by dev-1"),
            "{err}"
        );
        assert_eq!(
            s.find_vm("web").expect("find").map(|v| v.hostname),
            Some("dev-1".into())
        );
        assert!(s.find_vm("nope").expect("find").is_none());
    }

    #[test]
    fn state_changes_and_processes_are_recorded() {
        let s = Store::in_memory().expect("open");
        let vm = s.insert_vm(&new_vm("dev"), disk).expect("vm");
        s.set_process(&vm.hostname, 42, 7).expect("proc");
        let got = s.find_vm(&vm.hostname).expect("find").expect("some");
        assert_eq!(
            (got.state, got.pid, got.pid_start),
            (VmState::Starting, Some(42), Some(7))
        );
        s.set_running(&vm.hostname, 120).expect("running");
        assert!(!s
            .transition(&vm.hostname, &[VmState::Stopped], VmState::Failed, None)
            .expect("no-op"));
        s.clear_process(
            &vm.hostname,
            VmState::Failed,
            Some("boom"),
            Some(StopMode::Crashed),
        )
        .expect("clear");
        let got = s.find_vm(&vm.hostname).expect("find").expect("some");
        assert_eq!(
            (got.state, got.pid, got.reason.as_deref(), got.boot_ms),
            (VmState::Failed, None, Some("boom"), Some(120))
        );
        assert_eq!(got.stop_mode, Some(StopMode::Crashed));
        assert!(got.booted_once);
        // A new run forgets how the last one ended.
        s.queue_start(&vm.hostname).expect("queue");
        let got = s.find_vm(&vm.hostname).expect("find").expect("some");
        assert_eq!((got.stop_mode, got.reason), (None, None));
    }

    #[test]
    fn suspend_and_restore_are_one_statement_each_from_the_state_they_need() {
        let s = Store::in_memory().expect("open");
        let vm = s.insert_vm(&new_vm("dev"), disk).expect("vm");
        s.set_process(&vm.hostname, 42, 7).expect("proc");
        s.set_running(&vm.hostname, 10).expect("running");
        assert!(!s.record_suspended(&vm.hostname).expect("not suspending"));
        assert!(!s
            .record_restored(&vm.hostname, 43, 8)
            .expect("not suspended"));
        s.transition(&vm.hostname, &[VmState::Running], VmState::Suspending, None)
            .expect("suspending");
        assert!(s.record_suspended(&vm.hostname).expect("suspended"));
        let got = s.find_vm(&vm.hostname).expect("find").expect("some");
        assert_eq!(
            (got.state, got.pid, got.pid_start),
            (VmState::Suspended, None, None)
        );
        assert!(s.record_restored(&vm.hostname, 43, 8).expect("restored"));
        let got = s.find_vm(&vm.hostname).expect("find").expect("some");
        assert_eq!(
            (got.state, got.pid, got.pid_start),
            (VmState::Starting, Some(43), Some(8))
        );
        assert!(got.booted_once, "a restore is no first boot");
    }

    fn commit(id: &str, source: &str, key: Option<&str>) -> CommitRecord {
        CommitRecord {
            id: id.into(),
            host_group: "dev".into(),
            source: source.into(),
            disk: format!("/c/{id}.qcow2"),
            tags: vec!["t".into()],
            labels: BTreeMap::new(),
            source_tags: vec![],
            cache_key: key.map(Into::into),
            parent_commit_id: None,
            cpus: 1,
            ram_bytes: 1,
            size_bytes: 1,
            created_ms: 1,
            elapsed_ms: 1,
            secrets: vec![],
            mode: CommitMode::Disk,
            snapshot: None,
            memory_bytes: None,
            has_nic: None,
            hot_fork_pool: None,
        }
    }

    #[test]
    fn commits_guard_cache_keys_sources_and_dependants() {
        let s = Store::in_memory().expect("open");
        let a = s.insert_vm(&new_vm("dev"), disk).expect("a");
        let b = s.insert_vm(&new_vm("dev"), disk).expect("b");
        s.insert_commit(&commit("cmt-dev-1", &a.hostname, Some("k")), "/d/new")
            .expect("commit");
        let vm = s.find_vm(&a.hostname).expect("find").expect("some");
        assert_eq!(
            (vm.commit_id.as_deref(), vm.disk.as_str()),
            (Some("cmt-dev-1"), "/d/new")
        );
        let again = s
            .insert_commit(&commit("cmt-dev-2", &a.hostname, None), "/x")
            .expect_err("twice");
        assert!(
            again.to_string().contains("already committed as cmt-dev-1"),
            "{again}"
        );
        let key = s
            .insert_commit(&commit("cmt-dev-3", &b.hostname, Some("k")), "/x")
            .expect_err("key");
        assert!(key
            .to_string()
            .contains("cache key `k` is already used by commit cmt-dev-1"));
        assert!(
            s.get_commit("cmt-dev-3").expect("get").is_none(),
            "no half commit"
        );
        let by_key = CommitFilter {
            cache_key: Some("k"),
            ..CommitFilter::default()
        };
        assert_eq!(s.list_commits(&by_key).expect("list").len(), 1);
        let by_tag = |tags| CommitFilter {
            tags,
            ..CommitFilter::default()
        };
        assert_eq!(s.list_commits(&by_tag(&["t"])).expect("list").len(), 1);
        assert_eq!(s.list_commits(&by_tag(&["x"])).expect("list").len(), 0);
        let memory = CommitFilter {
            mode: Some(CommitMode::Memory),
            ..CommitFilter::default()
        };
        assert_eq!(s.list_commits(&memory).expect("list").len(), 0);
        let disk_only = CommitFilter {
            mode: Some(CommitMode::Disk),
            ..CommitFilter::default()
        };
        assert_eq!(s.list_commits(&disk_only).expect("list").len(), 1);

        let mut fork = new_vm("dev");
        fork.parent_commit_id = Some("cmt-dev-1".into());
        let f = s.insert_vm(&fork, disk).expect("fork");
        let guard = s.delete_commit("cmt-dev-1").expect_err("in use");
        assert!(
            guard.to_string().contains("still used by dev-1, dev-3"),
            "{guard}"
        );
        s.delete_vm(&a.hostname).expect("del");
        s.delete_vm(&f.hostname).expect("del");
        assert!(s.delete_commit("cmt-dev-1").expect("delete").is_some());
        assert!(s.delete_commit("cmt-dev-1").expect("gone").is_none());
    }

    #[test]
    fn a_file_store_survives_reopen_and_refuses_newer_schemas() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("t.db");
        {
            let s = Store::open(&path).expect("open");
            s.insert_vm(&new_vm("dev"), disk).expect("vm");
        }
        let s = Store::open(&path).expect("reopen");
        assert_eq!(s.list_vms(None).expect("list").len(), 1);
        drop(s);
        let conn = Connection::open(&path).expect("raw");
        conn.pragma_update(None, "user_version", 99).expect("bump");
        drop(conn);
        let err = Store::open(&path).expect_err("too new");
        assert!(err.to_string().contains("schema version 99"), "{err}");
    }

    /// The VMs a copy of the main database file alone records: what is
    /// left of the state when its WAL is lost (a power loss before the
    /// WAL reached the disk); none when the copy has no table yet.
    fn vms_in_main_file(path: &Path, copy: &Path) -> i64 {
        std::fs::copy(path, copy).expect("copy the main file");
        let conn = Connection::open(copy).expect("open the copy");
        conn.query_row("SELECT count(*) FROM vms", [], |r| r.get(0))
            .unwrap_or(0)
    }

    /// The VMs recorded in a copy of the database's files as they are on
    /// the host now, the open store's WAL included: what a `kill -9` of the
    /// daemon would leave.
    fn vms_after_a_crash(path: &Path, dir: &Path) -> usize {
        let copy = dir.join("crashed.db");
        std::fs::copy(path, &copy).expect("copy the main file");
        std::fs::copy(wal_path(path), dir.join("crashed.db-wal")).expect("copy the WAL");
        let s = Store::open(&copy).expect("open the copy");
        s.list_vms(None).expect("list").len()
    }

    #[test]
    fn a_second_store_on_the_same_file_is_refused() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("t.db");
        let s = Store::open(&path).expect("open");
        let err = Store::open(&path).expect_err("a second store");
        assert!(matches!(err, DbError::InUse(_)), "{err:?}");
        assert!(err.to_string().contains("t.db is in use"), "{err}");
        // Nor can a plain connection read it meanwhile.
        let conn = Connection::open(&path).expect("raw");
        conn.busy_timeout(Duration::ZERO).expect("no wait");
        conn.query_row("SELECT count(*) FROM vms", [], |r| r.get::<_, i64>(0))
            .expect_err("read past the store's lock");
        drop(conn);
        drop(s);
        Store::open(&path).expect("free again once the first is dropped");
    }

    #[test]
    fn a_crash_keeps_every_committed_change_in_the_wal() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("t.db");
        let s = Store::open(&path).expect("open");
        let mode: i64 = s
            .lock()
            .pragma_query_value(None, "synchronous", |r| r.get(0))
            .expect("pragma");
        assert_eq!(mode, 1, "synchronous=NORMAL");
        s.insert_vm(&new_vm("dev"), disk).expect("vm");
        s.insert_vm(&new_vm("dev"), disk).expect("vm");
        assert_eq!(
            vms_in_main_file(&path, &dir.path().join("main")),
            0,
            "committed, but only in the WAL"
        );
        assert_eq!(vms_after_a_crash(&path, dir.path()), 2);
    }

    #[test]
    fn a_state_a_shared_store_left_in_its_wal_opens_for_one_store_alone() {
        // What a daemon of the version before exclusive locking leaves when
        // it is killed: changes in the WAL, and its `-shm` index.
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("t.db");
        let crashed = dir.path().join("crashed.db");
        {
            let s = Store::open_with(&path, Locking::Shared).expect("open");
            s.insert_vm(&new_vm("dev"), disk).expect("vm");
            for suffix in ["", "-wal", "-shm"] {
                let from = format!("{}{suffix}", path.display());
                let to = format!("{}{suffix}", crashed.display());
                std::fs::copy(&from, &to).expect("copy the files as a kill leaves them");
            }
        }
        assert_eq!(vms_in_main_file(&crashed, &dir.path().join("main")), 0);
        let s = Store::open(&crashed).expect("open alone");
        assert_eq!(s.list_vms(None).expect("list").len(), 1);
        Store::open(&crashed).expect_err("a second store");
    }

    #[test]
    fn deletions_are_synced_at_once_and_other_changes_when_asked() {
        let dir = tempfile::tempdir().expect("tmp");
        let s = Store::open(&dir.path().join("t.db")).expect("open");
        let vm = s.insert_vm(&new_vm("dev"), disk).expect("vm");
        assert_eq!(s.unsynced_changes(), 1);
        s.sync().expect("sync");
        assert_eq!(s.unsynced_changes(), 0);
        s.sync().expect("a second sync with nothing new");
        s.set_state(&vm.hostname, VmState::Running, None)
            .expect("state");
        assert_eq!(s.unsynced_changes(), 1);
        s.delete_vm(&vm.hostname).expect("delete");
        assert_eq!(s.unsynced_changes(), 0, "the deletion was synced");
    }

    #[test]
    fn a_grown_wal_is_checkpointed_into_the_main_file_when_asked() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("t.db");
        let s = Store::open(&path).expect("open");
        for _ in 0..20 {
            s.insert_vm(&new_vm("dev"), disk).expect("vm");
        }
        let grown = s.wal_bytes();
        assert!(grown > 20 * 4096, "the WAL holds a page a change: {grown}");
        assert!(
            !s.checkpoint(grown + 1).expect("below the size asked"),
            "checkpointed a smaller WAL"
        );
        assert_eq!(vms_in_main_file(&path, &dir.path().join("c1")), 0);
        assert!(s.checkpoint(grown).expect("checkpoint"));
        assert_eq!(vms_in_main_file(&path, &dir.path().join("c2")), 20);
        assert!(
            s.wal_bytes() < 3 * 4096,
            "the WAL started over: {} bytes",
            s.wal_bytes()
        );
        assert_eq!(s.unsynced_changes(), 0, "the checkpoint synced it all");
        // And the store goes on writing to its WAL.
        s.insert_vm(&new_vm("dev"), disk).expect("vm");
        assert_eq!(vms_in_main_file(&path, &dir.path().join("c3")), 20);
        assert_eq!(vms_after_a_crash(&path, dir.path()), 21);
    }
}
