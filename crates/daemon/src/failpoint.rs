//! Crash points for fault-injection tests. With `TINE_FAILPOINT=NAME` in its
//! environment the daemon kills itself with `SIGKILL` the first time it
//! reaches the point `NAME`, exactly as a `kill -9` at that instant would:
//! no destructor, no log flush, no answer. Unset (always, outside tests), a
//! point costs one load of an initialised cell.
//!
//! The points sit between the steps of every state change (record, files,
//! process), where a crash is hardest to recover from; start-up
//! reconciliation must leave nothing half-made after any of them
//! (crates/daemon/tests/faults.rs checks that it does).

use std::sync::OnceLock;

/// The environment variable that arms one point.
pub const ENV: &str = "TINE_FAILPOINT";

/// A place where the daemon can be made to crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Failpoint {
    /// A new VM's (create or fork) folder and disk exist; the transaction
    /// recording it has not committed.
    ProvisionDiskMade,
    /// The new VM is recorded `starting`, queued for a boot slot, with no
    /// process; a fork's disk is not synced yet.
    ProvisionRecorded,
    /// A boot slot is taken and the disk synced; no process yet (a boot;
    /// a hot fork syncs its disk during its set-up).
    BootDiskSynced,
    /// Its tine-vmm runs, but no record names the process yet.
    BootSpawned,
    /// The process is recorded; the agent has not answered.
    BootRecorded,
    /// The agent answered and the set-up ran; not yet recorded `running`.
    BootSetUp,
    /// A commit's file is linked (or flattened) next to the source's disk.
    CommitLinked,
    /// The source's fresh overlay exists too; nothing is recorded.
    CommitOverlayMade,
    /// The commit is recorded; the source's old disk name is still there.
    CommitRecorded,
    /// A deleted VM's process is gone; its record is still there.
    DeleteStopped,
    /// The record is gone; its folder is still there.
    DeleteRecordRemoved,
    /// A VM is recorded `suspending`; it is neither paused nor written.
    SuspendRecorded,
    /// Its VMM wrote the snapshot into the temporary folder; not synced
    /// or renamed into place.
    SuspendSnapshotTaken,
    /// The snapshot is synced and renamed into place; the VM is still
    /// recorded `suspending`, its VMM runs paused.
    SuspendSnapshotSealed,
    /// The VM is recorded `suspended`; its VMM still runs, paused.
    SuspendRecordedSuspended,
    /// A VMM restored a suspended VM's snapshot and runs it; no record
    /// names it (the VM is still `suspended`).
    RestoreSpawned,
    /// The restored process is recorded; the snapshot files are still
    /// there.
    RestoreRecorded,
    /// A memory commit's snapshot is sealed; its source is paused, its
    /// disk not frozen yet, nothing recorded.
    MemoryCommitCaptured,
    /// The source's VMM writes its fresh overlay (still paused); nothing
    /// is recorded.
    MemoryCommitSwitched,
    /// The memory commit is recorded; its source is still paused.
    MemoryCommitRecorded,
}

impl Failpoint {
    /// Every point, in the order an operation reaches them.
    pub const ALL: &'static [Failpoint] = &[
        Failpoint::ProvisionDiskMade,
        Failpoint::ProvisionRecorded,
        Failpoint::BootDiskSynced,
        Failpoint::BootSpawned,
        Failpoint::BootRecorded,
        Failpoint::BootSetUp,
        Failpoint::CommitLinked,
        Failpoint::CommitOverlayMade,
        Failpoint::CommitRecorded,
        Failpoint::DeleteStopped,
        Failpoint::DeleteRecordRemoved,
        Failpoint::SuspendRecorded,
        Failpoint::SuspendSnapshotTaken,
        Failpoint::SuspendSnapshotSealed,
        Failpoint::SuspendRecordedSuspended,
        Failpoint::RestoreSpawned,
        Failpoint::RestoreRecorded,
        Failpoint::MemoryCommitCaptured,
        Failpoint::MemoryCommitSwitched,
        Failpoint::MemoryCommitRecorded,
    ];

    /// The name `TINE_FAILPOINT` takes.
    pub fn name(self) -> &'static str {
        match self {
            Failpoint::ProvisionDiskMade => "provision-disk-made",
            Failpoint::ProvisionRecorded => "provision-recorded",
            Failpoint::BootDiskSynced => "boot-disk-synced",
            Failpoint::BootSpawned => "boot-spawned",
            Failpoint::BootRecorded => "boot-recorded",
            Failpoint::BootSetUp => "boot-set-up",
            Failpoint::CommitLinked => "commit-linked",
            Failpoint::CommitOverlayMade => "commit-overlay-made",
            Failpoint::CommitRecorded => "commit-recorded",
            Failpoint::DeleteStopped => "delete-stopped",
            Failpoint::DeleteRecordRemoved => "delete-record-removed",
            Failpoint::SuspendRecorded => "suspend-recorded",
            Failpoint::SuspendSnapshotTaken => "suspend-snapshot-taken",
            Failpoint::SuspendSnapshotSealed => "suspend-snapshot-sealed",
            Failpoint::SuspendRecordedSuspended => "suspend-recorded-suspended",
            Failpoint::RestoreSpawned => "restore-spawned",
            Failpoint::RestoreRecorded => "restore-recorded",
            Failpoint::MemoryCommitCaptured => "memory-commit-captured",
            Failpoint::MemoryCommitSwitched => "memory-commit-switched",
            Failpoint::MemoryCommitRecorded => "memory-commit-recorded",
        }
    }

    /// Parses [`Failpoint::name`]'s output.
    pub fn parse(name: &str) -> Option<Failpoint> {
        Failpoint::ALL.iter().copied().find(|p| p.name() == name)
    }
}

/// A `TINE_FAILPOINT` value that names no point.
#[derive(Debug, thiserror::Error)]
#[error("{ENV}={value:?} names no crash point; use one of: {}", names())]
pub struct UnknownFailpoint {
    /// What the variable held.
    pub value: String,
}

fn names() -> String {
    Failpoint::ALL
        .iter()
        .map(|p| p.name())
        .collect::<Vec<_>>()
        .join(", ")
}

static ARMED: OnceLock<Option<Failpoint>> = OnceLock::new();

/// Reads `TINE_FAILPOINT` once; call at start-up so a bad value is refused
/// before anything runs.
pub fn arm_from_env() -> Result<Option<Failpoint>, UnknownFailpoint> {
    let wanted = match std::env::var(ENV) {
        Ok(v) if !v.is_empty() => Some(Failpoint::parse(&v).ok_or(UnknownFailpoint { value: v })?),
        _ => None,
    };
    Ok(*ARMED.get_or_init(|| wanted))
}

/// Crashes the daemon here if this point is armed.
pub fn hit(point: Failpoint) {
    #[cfg(test)]
    freeze::hit(point);
    if ARMED.get().copied().flatten() == Some(point) {
        eprintln!("tine: crash point {} reached: SIGKILL", point.name());
        if let Err(e) = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL) {
            eprintln!("tine: cannot raise SIGKILL at {}: {e}", point.name());
            std::process::abort();
        }
    }
}

/// The unit tests' stand-in for the `SIGKILL`: a thread armed with
/// [`freeze::arm`] stops for good at the point (it parks forever), so the
/// daemon running on it (on a current-thread runtime) does nothing more,
/// as after a `kill -9`, while the test goes on and starts another daemon
/// on the same data directory.
#[cfg(test)]
pub mod freeze {
    use std::cell::RefCell;
    use std::sync::mpsc::Sender;

    use super::Failpoint;

    thread_local! {
        static ARMED: RefCell<Option<(Failpoint, Sender<Failpoint>)>> = const { RefCell::new(None) };
    }

    /// Arms `point` on this thread; `reached` hears when it is reached.
    pub fn arm(point: Failpoint, reached: Sender<Failpoint>) {
        ARMED.with(|a| *a.borrow_mut() = Some((point, reached)));
    }

    pub(super) fn hit(point: Failpoint) {
        let armed = ARMED.with(|a| {
            let mut a = a.borrow_mut();
            match a.as_ref() {
                Some((p, _)) if *p == point => a.take(),
                _ => None,
            }
        });
        if let Some((_, reached)) = armed {
            // The test may have given up already; the thread stops anyway.
            if reached.send(point).is_err() {
                tracing::debug!(?point, "failpoint reached after its test gave up");
            }
            loop {
                std::thread::park();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_distinct() {
        let mut seen = std::collections::HashSet::new();
        for p in Failpoint::ALL {
            assert_eq!(Failpoint::parse(p.name()), Some(*p));
            assert!(seen.insert(p.name()), "{} twice", p.name());
        }
        assert_eq!(Failpoint::parse("nope"), None);
    }

    #[test]
    fn an_unknown_name_lists_the_points() {
        let e = UnknownFailpoint {
            value: "commit".into(),
        };
        let text = e.to_string();
        assert!(text.contains("\"commit\" names no crash point"), "{text}");
        assert!(text.contains("commit-linked"), "{text}");
    }

    #[test]
    fn an_unarmed_point_returns() {
        // Nothing in the test environment arms a point.
        hit(Failpoint::BootDiskSynced);
    }
}
