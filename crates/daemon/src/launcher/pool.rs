//! The warm pool: `tine-vmm` processes started ahead of any fork
//! (`--prestart`: the KVM VM, its vCPUs and guest RAM registered), so that
//! a hot fork's launch only hands one over and restores into it.
//!
//! A slot is started in `<data_dir>/pool/<slot>/` and waits there until its
//! control socket listens. A VM that takes it gets its control socket and
//! logs moved into the VM's own folder (an open socket and open files keep
//! working under their new names), and the slot's folder is removed. The
//! folder its log is in is how a restarted daemon knows whose process it
//! is (see [`crate::process`]). A slot nobody took is a stray to a
//! restarted daemon: its reconciliation kills it, and the next fill starts
//! new ones.
//!
//! Processes are pooled by shape (vCPUs and RAM), not by commit: the
//! restore maps the commit's memory file over the registered RAM, so one
//! slot serves any snapshot of its shape.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Child;

use crate::process::VmPaths;

pub use super::Shape;
pub use crate::process::POOL_DIR;

/// Most pre-started processes a host group may keep per shape.
pub const MAX_POOL_SIZE: u32 = 64;

/// A process waiting in the pool.
#[derive(Debug)]
pub struct Slot {
    /// Its name (the folder under `pool/`).
    pub name: String,
    /// Its files in that folder.
    pub paths: VmPaths,
    /// The process.
    pub child: Child,
    /// Its start time (see [`crate::process::start_time`]), read when it
    /// started.
    pub pid_start: u64,
    /// For a primed process: whether its vsock socket moved into the
    /// folder a fork takes (a VM without a vsock device has none).
    pub moved_vsock: bool,
    /// For a primed process: the folder its files moved into (the one a
    /// fork takes by rename).
    pub primed_in: Option<PathBuf>,
    /// A connection to its control socket, made when it first listened:
    /// the request that hands it over needs no connect (a path lookup and
    /// a new socket) on the fork's path. The process serves any number of
    /// clients, idle ones included.
    pub control: Option<tokio::net::UnixStream>,
    /// For a primed process whose agent answered its warm-up: that
    /// connection, still open, for its fork's set-up (no connect and
    /// handshake on the fork's path).
    pub agent: Option<tine_client::AgentClient>,
}

/// Why handing a slot over to a VM failed.
#[derive(Debug, thiserror::Error)]
#[error("cannot move pool slot {slot} to {vm}: {step}")]
pub struct HandOverError {
    /// The slot's folder.
    pub slot: PathBuf,
    /// The VM's folder.
    pub vm: PathBuf,
    /// The step that failed.
    pub step: String,
    /// Why.
    #[source]
    pub source: std::io::Error,
}

/// The pool's book-keeping; the launcher holds it behind a lock.
#[derive(Debug, Default)]
pub struct Pool {
    /// How many ready processes each shape should have.
    wanted: BTreeMap<Shape, u32>,
    /// Ready processes, oldest first.
    ready: BTreeMap<Shape, Vec<Slot>>,
    /// Slots being started.
    starting: Vec<(Shape, String)>,
    /// Processes a memory commit was restored into (paused) ahead of a hot
    /// fork, by name, until a fork takes one: outside the sizes by shape.
    primed: HashMap<String, Slot>,
    /// Names of processes being primed.
    priming: HashSet<String>,
}

impl Pool {
    /// Sets the wanted sizes; returns the ready slots no longer wanted (the
    /// caller stops them).
    pub fn set_wanted(&mut self, wanted: BTreeMap<Shape, u32>) -> Vec<Slot> {
        self.wanted = wanted;
        let mut surplus = Vec::new();
        for (shape, slots) in &mut self.ready {
            let keep = self.wanted.get(shape).copied().unwrap_or(0) as usize;
            while slots.len() > keep {
                surplus.extend(slots.pop());
            }
        }
        self.ready.retain(|_, slots| !slots.is_empty());
        surplus
    }

    /// Whether forks of `shape` are pooled.
    pub fn wants(&self, shape: Shape) -> bool {
        self.wanted.get(&shape).is_some_and(|n| *n > 0)
    }

    /// The slots to start now to reach the wanted sizes (recorded as
    /// starting, named by `name`).
    pub fn to_start(&mut self, mut name: impl FnMut() -> String) -> Vec<(Shape, String)> {
        let mut out = Vec::new();
        for (shape, want) in &self.wanted {
            let have = self.ready.get(shape).map_or(0, Vec::len)
                + self.starting.iter().filter(|(s, _)| s == shape).count();
            for _ in have..*want as usize {
                out.push((*shape, name()));
            }
        }
        self.starting.extend(out.iter().cloned());
        out
    }

    /// A slot finished starting: kept when its shape still wants one,
    /// otherwise given back (the caller stops it).
    pub fn started(&mut self, shape: Shape, slot: Slot) -> Option<Slot> {
        self.starting.retain(|(_, n)| *n != slot.name);
        let want = self.wanted.get(&shape).copied().unwrap_or(0) as usize;
        let ready = self.ready.entry(shape).or_default();
        if ready.len() < want {
            ready.push(slot);
            None
        } else {
            Some(slot)
        }
    }

    /// Whether some slot is being started.
    pub fn is_starting(&self) -> bool {
        !self.starting.is_empty()
    }

    /// A slot failed to start.
    pub fn failed(&mut self, name: &str) {
        self.starting.retain(|(_, n)| n != name);
    }

    /// Takes the oldest ready slot of `shape` whose process still runs;
    /// slots whose process ended are returned in `dead` (the caller reaps
    /// them and removes their folders).
    pub fn take(&mut self, shape: Shape, dead: &mut Vec<Slot>) -> Option<Slot> {
        let ready = self.ready.get_mut(&shape)?;
        while !ready.is_empty() {
            let mut slot = ready.remove(0);
            match slot.child.try_wait() {
                Ok(None) => return Some(slot),
                Ok(Some(_)) | Err(_) => dead.push(slot),
            }
        }
        None
    }

    /// Notes a process whose priming began.
    pub fn priming(&mut self, name: &str) {
        self.priming.insert(name.to_owned());
    }

    /// The priming of `name` ended: with the primed process, or with
    /// nothing (it failed).
    pub fn primed(&mut self, name: &str, slot: Option<Slot>) {
        self.priming.remove(name);
        if let Some(slot) = slot {
            self.primed.insert(name.to_owned(), slot);
        }
    }

    /// The folder the primed process `name` waits in, while nobody has
    /// taken it.
    pub fn primed_folder(&self, name: &str) -> Option<PathBuf> {
        self.primed.get(name).and_then(|s| s.primed_in.clone())
    }

    /// Takes the primed process `name`.
    pub fn take_primed(&mut self, name: &str) -> Option<Slot> {
        self.primed.remove(name)
    }

    /// The names of the slots this pool holds or is starting, primed ones
    /// included.
    pub fn names(&self) -> HashSet<String> {
        self.ready
            .values()
            .flatten()
            .map(|s| s.name.clone())
            .chain(self.starting.iter().map(|(_, n)| n.clone()))
            .chain(self.primed.keys().cloned())
            .chain(self.priming.iter().cloned())
            .collect()
    }
}

/// A new slot name: random, so that a slot of an earlier daemon (whose
/// folder may still be a VM's link) is never reused.
pub fn new_slot_name() -> String {
    let mut bytes = [0u8; 8];
    if let Err(e) = getrandom::fill(&mut bytes) {
        tracing::warn!("no random slot name ({e}); using the time");
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        bytes = nanos.to_le_bytes();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn hand_over_error(
    slot: &VmPaths,
    vm: &VmPaths,
    step: &str,
) -> impl FnOnce(std::io::Error) -> HandOverError {
    let (slot, vm, step) = (slot.dir.clone(), vm.dir.clone(), step.to_owned());
    move |source| HandOverError {
        slot,
        vm,
        step,
        source,
    }
}

/// Readies the VM's folder for a slot's process: creates it and removes
/// sockets an earlier run left there. Runs before the restore request,
/// which makes the process bind the VM's vsock socket in that folder.
pub fn prepare_vm_dir(slot: &VmPaths, vm: &VmPaths) -> Result<(), HandOverError> {
    std::fs::create_dir_all(&vm.dir).map_err(hand_over_error(
        slot,
        vm,
        "create the VM's folder",
    ))?;
    for stale in [&vm.vsock, &vm.control] {
        match std::fs::remove_file(stale) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(hand_over_error(slot, vm, "remove a stale socket")(e))
            }
            _ => {}
        }
    }
    Ok(())
}

/// Moves a slot's control socket and log into the VM's folder (prepared by
/// [`prepare_vm_dir`]) and removes the slot's folder. The process keeps
/// its socket, its open connections and its log file, so this may run
/// while the process restores; the restore request names the serial log,
/// vsock socket, disk and TAP in the VM's folder.
pub fn move_slot(slot: &VmPaths, vm: &VmPaths) -> Result<(), HandOverError> {
    let fail = |step| hand_over_error(slot, vm, step);
    std::fs::rename(&slot.log, &vm.log).map_err(fail("move vmm.log"))?;
    std::fs::rename(&slot.control, &vm.control).map_err(fail("move the control socket"))?;
    std::fs::remove_dir(&slot.dir).map_err(fail("remove the slot's folder"))
}

/// Moves a primed process's files into the folder a fork will take by
/// rename (it exists): its vsock socket and serial log (an open listener
/// and an open file keep working under their new names), then what
/// [`move_slot`] moves. Returns whether it moved a vsock socket: the
/// fork's resume then tells the process where its socket is, so that
/// guest connections go next to it.
pub fn move_primed(slot: &VmPaths, vm: &VmPaths) -> Result<bool, HandOverError> {
    // A VM without a vsock device or a console log has no such file.
    let mut moved_vsock = false;
    for (from, to, step) in [
        (&slot.vsock, &vm.vsock, "move the vsock socket"),
        (&slot.serial, &vm.serial, "move serial.log"),
    ] {
        match std::fs::rename(from, to) {
            Ok(()) => moved_vsock |= from == &slot.vsock,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(hand_over_error(slot, vm, step)(e)),
        }
    }
    move_slot(slot, vm)?;
    Ok(moved_vsock)
}

/// Removes what `pool_dir` holds that is neither in `keep` nor named by a
/// running process: folders of slots whose process is gone (and links an
/// earlier version left for taken slots).
pub fn sweep(pool_dir: &Path, keep: &HashSet<String>, in_use: &HashSet<String>) {
    let Ok(entries) = std::fs::read_dir(pool_dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if keep.contains(&name) || in_use.contains(&name) {
            continue;
        }
        let path = entry.path();
        let removed = match entry.file_type() {
            Ok(t) if t.is_dir() => std::fs::remove_dir_all(&path),
            _ => std::fs::remove_file(&path),
        };
        if let Err(e) = removed {
            tracing::warn!("cannot remove {}: {e}", path.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(cpus: u32) -> Shape {
        Shape { cpus, ram_mib: 64 }
    }

    fn sleeper(dir: &Path, name: &str) -> Slot {
        Slot {
            name: name.to_owned(),
            paths: VmPaths::in_dir(dir.join(name)),
            child: std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .expect("sleep"),
            pid_start: 0,
            moved_vsock: false,
            primed_in: None,
            control: None,
            agent: None,
        }
    }

    #[test]
    fn the_pool_starts_what_is_missing_and_keeps_what_is_wanted() {
        let dir = tempfile::tempdir().expect("tmp");
        let mut pool = Pool::default();
        assert!(pool.set_wanted([(shape(1), 2)].into()).is_empty());
        assert!(pool.wants(shape(1)) && !pool.wants(shape(2)));
        let mut n = 0;
        let todo = pool.to_start(|| {
            n += 1;
            format!("s{n}")
        });
        assert_eq!(todo.len(), 2);
        assert!(
            pool.to_start(|| "again".into()).is_empty(),
            "starting counts"
        );
        assert!(pool.started(shape(1), sleeper(dir.path(), "s1")).is_none());
        assert!(pool.started(shape(1), sleeper(dir.path(), "s2")).is_none());
        assert_eq!(pool.names().len(), 2);
        // One more than wanted is given back.
        let mut extra = pool
            .started(shape(1), sleeper(dir.path(), "s3"))
            .expect("surplus");
        extra.child.kill().expect("kill");
        extra.child.wait().expect("reap");

        let mut dead = Vec::new();
        let mut taken = pool.take(shape(1), &mut dead).expect("a slot");
        assert_eq!(taken.name, "s1", "oldest first");
        assert!(dead.is_empty());
        assert!(pool.take(shape(2), &mut dead).is_none(), "no such shape");
        taken.child.kill().expect("kill");
        taken.child.wait().expect("reap");

        // A slot whose process ended is not handed out.
        let ready = pool.ready.get_mut(&shape(1)).expect("s2");
        ready[0].child.kill().expect("kill");
        ready[0].child.wait().expect("reap");
        assert!(pool.take(shape(1), &mut dead).is_none());
        assert_eq!(dead.len(), 1);

        // Shrinking gives back what is over the new size.
        assert!(pool.started(shape(1), sleeper(dir.path(), "s4")).is_none());
        let mut surplus = pool.set_wanted(BTreeMap::new());
        assert_eq!(surplus.len(), 1);
        for s in &mut surplus {
            s.child.kill().expect("kill");
            s.child.wait().expect("reap");
        }
        assert!(!pool.wants(shape(1)));
    }

    #[test]
    fn a_slot_handed_over_lives_in_the_vm_folder_and_leaves_nothing_behind() {
        let dir = tempfile::tempdir().expect("tmp");
        let slot = VmPaths::in_dir(dir.path().join(POOL_DIR).join("ab12"));
        std::fs::create_dir_all(&slot.dir).expect("slot");
        for f in [&slot.log, &slot.control] {
            std::fs::write(f, "x").expect("file");
        }
        let vm = VmPaths::new(dir.path(), "b-1");
        std::fs::create_dir_all(&vm.dir).expect("vm");
        std::fs::write(&vm.control, "stale").expect("stale socket");
        std::fs::write(&vm.vsock, "stale").expect("stale socket");
        prepare_vm_dir(&slot, &vm).expect("prepare");
        assert!(
            !vm.control.exists() && !vm.vsock.exists(),
            "stale sockets stay"
        );
        move_slot(&slot, &vm).expect("move");
        for f in [&vm.log, &vm.control] {
            assert_eq!(std::fs::read_to_string(f).expect("moved"), "x");
        }
        assert!(
            std::fs::symlink_metadata(&slot.dir).is_err(),
            "the slot's folder stays"
        );
        // A slot that is not there is an error naming the step.
        let gone = VmPaths::in_dir(dir.path().join(POOL_DIR).join("cd34"));
        let other = VmPaths::new(dir.path(), "b-2");
        prepare_vm_dir(&gone, &other).expect("prepare");
        let err = move_slot(&gone, &other).expect_err("gone");
        assert!(err.to_string().contains("move vmm.log"), "{err}");
    }

    #[test]
    fn a_primed_slot_says_whether_it_moved_a_vsock_socket() {
        let dir = tempfile::tempdir().expect("tmp");
        for (name, vsock) in [("with", true), ("without", false)] {
            let slot = VmPaths::in_dir(dir.path().join(POOL_DIR).join(name));
            std::fs::create_dir_all(&slot.dir).expect("slot");
            let mut files = vec![&slot.log, &slot.control, &slot.serial];
            if vsock {
                files.push(&slot.vsock);
            }
            for f in files {
                std::fs::write(f, "x").expect("file");
            }
            let spare = VmPaths::in_dir(dir.path().join("spares").join(name));
            std::fs::create_dir_all(&spare.dir).expect("spare");
            assert_eq!(move_primed(&slot, &spare).expect("move"), vsock);
            assert_eq!(spare.vsock.exists(), vsock);
            assert!(spare.serial.exists() && spare.log.exists() && spare.control.exists());
            assert!(!slot.dir.exists());
        }
    }

    #[test]
    fn sweep_removes_only_what_nobody_holds() {
        let dir = tempfile::tempdir().expect("tmp");
        for name in ["kept", "used", "old"] {
            std::fs::create_dir_all(dir.path().join(name)).expect("dir");
        }
        std::os::unix::fs::symlink("/nonexistent", dir.path().join("dangling")).expect("link");
        sweep(
            dir.path(),
            &["kept".to_owned()].into(),
            &["used".to_owned()].into(),
        );
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .expect("list")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["kept", "used"]);
    }
}
