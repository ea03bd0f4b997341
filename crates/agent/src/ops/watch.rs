//! `watch`: file-system changes from inotify, as Slicer's watch reports
//! them (create, write, remove, rename, chmod), until the client closes
//! the stream.
//!
//! Bounded both ways: a watch covers at most [`WatchLimits::max_dirs`]
//! directories (a tree larger than that is refused up front; a directory
//! created past it later is reported as an `overflow` event and left
//! unwatched), and at most [`WatchLimits::max_queued`] events wait for a
//! slow client: those past it are dropped and counted in one `overflow`
//! event, as is an overflow of the kernel's own queue.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use glob::{MatchOptions, Pattern};
use nix::errno::Errno;
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, InotifyEvent, WatchDescriptor};
use tine_proto::agent::mux::{StreamReceiver, StreamSender};
use tine_proto::agent::{ErrorCode, Response, WatchEvent, WatchEventKind, WatchRequest};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::mpsc;

use crate::error::OpError;

/// Events sent in one message at most.
const BATCH: usize = 64;
/// Paths a request may name.
const MAX_PATHS: usize = 64;
/// Patterns a request may give.
const MAX_PATTERNS: usize = 64;
/// The longest debounce window accepted.
const MAX_DEBOUNCE: Duration = Duration::from_secs(60);

/// The bounds of one watch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WatchLimits {
    /// Directories (and files) one watch may cover.
    pub(crate) max_dirs: usize,
    /// Events that may wait for the client before new ones are dropped.
    pub(crate) max_queued: usize,
}

/// The inotify instance, for tokio's readiness.
struct InotifyFd(Inotify);

impl AsRawFd for InotifyFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

/// What is watched under one inotify watch.
#[derive(Debug, Clone)]
struct Watched {
    path: PathBuf,
    /// The root it was found under (for patterns with a `/`).
    root: usize,
    /// Whether it is one of the paths the request named.
    is_root: bool,
    is_dir: bool,
}

/// Which events the client wants.
struct Filter {
    kinds: HashSet<WatchEventKind>,
    patterns: Vec<Pattern>,
}

impl Filter {
    fn new(req: &WatchRequest) -> Result<Self, OpError> {
        if req.patterns.len() > MAX_PATTERNS {
            return Err(OpError::bad_request(format!(
                "at most {MAX_PATTERNS} patterns may be given"
            )));
        }
        let patterns = req
            .patterns
            .iter()
            .map(|p| {
                Pattern::new(p)
                    .map_err(|e| OpError::bad_request(format!("pattern {p:?} is not a glob: {e}")))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            kinds: req.events.iter().copied().collect(),
            patterns,
        })
    }

    fn wants(&self, kind: WatchEventKind, path: &Path, root: &Path) -> bool {
        if kind == WatchEventKind::Overflow {
            return true;
        }
        if !self.kinds.is_empty() && !self.kinds.contains(&kind) {
            return false;
        }
        if self.patterns.is_empty() {
            return true;
        }
        let options = MatchOptions {
            case_sensitive: true,
            require_literal_separator: true,
            require_literal_leading_dot: false,
        };
        let name = path.file_name().unwrap_or(OsStr::new(""));
        let below = path.strip_prefix(root).unwrap_or(path);
        self.patterns.iter().any(|p| {
            if p.as_str().contains('/') {
                p.matches_path_with(below, options)
            } else {
                p.matches_with(&name.to_string_lossy(), options)
            }
        })
    }
}

/// The events inotify is asked for on every watch.
fn watch_mask() -> AddWatchFlags {
    AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_MODIFY
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_DELETE_SELF
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_MOVE_SELF
        | AddWatchFlags::IN_ATTRIB
}

/// Why a directory could not be watched.
enum AddError {
    /// The watch's limit of directories is reached.
    Limit,
    /// The kernel refused (the path went away, no permission, its limit).
    Os(Errno),
}

struct Watcher {
    fd: AsyncFd<InotifyFd>,
    watched: HashMap<WatchDescriptor, Watched>,
    roots: Vec<PathBuf>,
    recursive: bool,
    max_dirs: usize,
}

impl Watcher {
    fn inotify(&self) -> &Inotify {
        &self.fd.get_ref().0
    }

    fn add(&mut self, path: &Path, root: usize, is_root: bool) -> Result<bool, AddError> {
        if self.watched.len() >= self.max_dirs {
            return Err(AddError::Limit);
        }
        let mut mask = watch_mask();
        if !is_root {
            // Below a root only real directories are walked.
            mask |= AddWatchFlags::IN_DONT_FOLLOW | AddWatchFlags::IN_ONLYDIR;
        }
        let is_dir = std::fs::metadata(path).is_ok_and(|m| m.is_dir());
        let wd = self.inotify().add_watch(path, mask).map_err(AddError::Os)?;
        let fresh = self
            .watched
            .insert(
                wd,
                Watched {
                    path: path.to_path_buf(),
                    root,
                    is_root,
                    is_dir,
                },
            )
            .is_none();
        Ok(fresh && is_dir)
    }

    /// Watches `dir` and, when recursive, every directory below it.
    /// `found` gets each entry found below `dir` (for a directory created
    /// after the watch began: what was made in it before its watch was).
    fn add_tree(
        &mut self,
        dir: &Path,
        root: usize,
        is_root: bool,
        mut found: Option<&mut Vec<(PathBuf, bool)>>,
    ) -> Result<(), AddError> {
        if !self.add(dir, root, is_root)? || !self.recursive {
            return Ok(());
        }
        let mut stack = vec![dir.to_path_buf()];
        while let Some(next) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&next) else {
                continue;
            };
            for entry in entries.filter_map(|e| e.ok()) {
                let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
                let path = entry.path();
                if let Some(found) = found.as_deref_mut() {
                    found.push((path.clone(), is_dir));
                }
                if !is_dir {
                    continue;
                }
                match self.add(&path, root, false) {
                    Ok(true) => stack.push(path),
                    Ok(false) => {}
                    Err(AddError::Limit) => return Err(AddError::Limit),
                    // Gone already, or not readable: not watched.
                    Err(AddError::Os(_)) => {}
                }
            }
        }
        Ok(())
    }

    /// Forgets the watches at and below `path` (moved away or removed).
    fn forget_below(&mut self, path: &Path) {
        let gone: Vec<WatchDescriptor> = self
            .watched
            .iter()
            .filter(|(_, w)| !w.is_root && w.path.starts_with(path))
            .map(|(wd, _)| *wd)
            .collect();
        for wd in gone {
            match self.inotify().rm_watch(wd) {
                // EINVAL: the kernel has dropped it already.
                Ok(()) | Err(Errno::EINVAL) => {}
                Err(e) => tracing::debug!(
                    "cannot remove an inotify watch below {}: {e}",
                    path.display()
                ),
            }
            self.watched.remove(&wd);
        }
    }

    /// Turns one inotify event into the events to report (none, one, or
    /// for a new directory in a recursive watch, what it already holds).
    fn translate(&mut self, ev: InotifyEvent, out: &mut Vec<(WatchEvent, usize)>) {
        let now = unix_nanos();
        if ev.mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
            out.push((
                overflow(now, "the kernel's event queue overflowed: events were lost"),
                0,
            ));
            return;
        }
        if ev.mask.contains(AddWatchFlags::IN_IGNORED) {
            self.watched.remove(&ev.wd);
            return;
        }
        let Some(w) = self.watched.get(&ev.wd).cloned() else {
            return;
        };
        let self_event = ev.name.is_none();
        let path = match &ev.name {
            Some(name) => w.path.join(name),
            None => w.path.clone(),
        };
        let is_dir = if self_event {
            w.is_dir
        } else {
            ev.mask.contains(AddWatchFlags::IN_ISDIR)
        };
        // A directory below a root reports its own removal and moves to its
        // parent's watch too: those are reported once, from the parent.
        if self_event
            && !w.is_root
            && ev
                .mask
                .intersects(AddWatchFlags::IN_DELETE_SELF | AddWatchFlags::IN_MOVE_SELF)
        {
            return;
        }
        let kind = if ev
            .mask
            .intersects(AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO)
        {
            WatchEventKind::Create
        } else if ev.mask.contains(AddWatchFlags::IN_MODIFY) {
            WatchEventKind::Write
        } else if ev
            .mask
            .intersects(AddWatchFlags::IN_DELETE | AddWatchFlags::IN_DELETE_SELF)
        {
            WatchEventKind::Remove
        } else if ev
            .mask
            .intersects(AddWatchFlags::IN_MOVED_FROM | AddWatchFlags::IN_MOVE_SELF)
        {
            WatchEventKind::Rename
        } else if ev.mask.contains(AddWatchFlags::IN_ATTRIB) {
            WatchEventKind::Chmod
        } else {
            return;
        };
        let size = match kind {
            WatchEventKind::Remove | WatchEventKind::Rename => 0,
            _ => size_of(&path),
        };
        out.push((event(kind, &path, is_dir, size, now), w.root));
        if !is_dir || self_event {
            return;
        }
        match kind {
            WatchEventKind::Remove | WatchEventKind::Rename => self.forget_below(&path),
            WatchEventKind::Create if self.recursive => {
                let mut found = Vec::new();
                let added = self.add_tree(&path, w.root, false, Some(&mut found));
                for (p, d) in found {
                    let size = if d { 0 } else { size_of(&p) };
                    out.push((event(WatchEventKind::Create, &p, d, size, now), w.root));
                }
                if let Err(AddError::Limit) = added {
                    let msg = format!(
                        "the watch's limit of {} directories is reached: changes in {} are not reported",
                        self.max_dirs,
                        path.display()
                    );
                    out.push((overflow(now, &msg), w.root));
                }
            }
            _ => {}
        }
    }
}

fn unix_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos().min(u128::from(u64::MAX)) as u64)
        .unwrap_or(0)
}

fn size_of(path: &Path) -> u64 {
    std::fs::symlink_metadata(path)
        .ok()
        .filter(|m| m.is_file())
        .map_or(0, |m| m.len())
}

fn event(kind: WatchEventKind, path: &Path, is_dir: bool, size: u64, now: u64) -> WatchEvent {
    WatchEvent {
        kind,
        path: path.to_string_lossy().into_owned(),
        is_dir,
        size,
        unix_nanos: now,
        message: None,
    }
}

fn overflow(now: u64, message: &str) -> WatchEvent {
    WatchEvent {
        kind: WatchEventKind::Overflow,
        path: String::new(),
        is_dir: false,
        size: 0,
        unix_nanos: now,
        message: Some(message.to_owned()),
    }
}

/// `~` and `~/rest` as the home of `uid` (root's without one).
fn resolve(path: &str, uid: Option<u32>) -> Result<PathBuf, OpError> {
    let rest = match path.strip_prefix('~') {
        None => {
            let p = PathBuf::from(path);
            if !p.is_absolute() || path.contains('\0') {
                return Err(OpError::new(
                    ErrorCode::InvalidPath,
                    format!("watch path {path:?} is not absolute (or ~/...)"),
                ));
            }
            return Ok(p);
        }
        Some("") => "",
        Some(rest) if rest.starts_with('/') => rest.trim_start_matches('/'),
        Some(_) => {
            return Err(OpError::new(
                ErrorCode::InvalidPath,
                format!("watch path {path:?}: only ~ and ~/... are understood"),
            ))
        }
    };
    let uid = nix::unistd::Uid::from_raw(uid.unwrap_or(0));
    let home = match nix::unistd::User::from_uid(uid) {
        Ok(Some(user)) => user.dir,
        _ if uid.is_root() => PathBuf::from("/root"),
        _ => {
            return Err(OpError::new(
                ErrorCode::NotFound,
                format!("uid {uid} has no home in /etc/passwd to resolve {path:?}"),
            ))
        }
    };
    Ok(home.join(rest))
}

/// Events held for the debounce window: each (kind, path) once, in the
/// order first seen.
#[derive(Default)]
struct Pending {
    events: Vec<WatchEvent>,
    seen: HashSet<(WatchEventKind, String)>,
    flush_at: Option<tokio::time::Instant>,
}

/// Hands events to the sender task through a bounded queue; what does not
/// fit is counted and reported as one `overflow` event once there is room.
struct Outbox {
    queue: mpsc::Sender<WatchEvent>,
    dropped: u64,
}

impl Outbox {
    fn push(&mut self, event: WatchEvent) {
        if self.dropped > 0 && !self.try_overflow() {
            self.dropped += 1;
            return;
        }
        if self.queue.try_send(event).is_err() {
            self.dropped += 1;
        }
    }

    fn overflow_event(&self) -> WatchEvent {
        overflow(
            unix_nanos(),
            &format!(
                "{} event{} dropped: the client did not keep up",
                self.dropped,
                if self.dropped == 1 { " was" } else { "s were" }
            ),
        )
    }

    fn try_overflow(&mut self) -> bool {
        let ok = self.queue.try_send(self.overflow_event()).is_ok();
        if ok {
            self.dropped = 0;
        }
        ok
    }
}

/// Sends queued events in batches until the queue closes or the client
/// goes.
async fn send_batches(tx: StreamSender, mut queue: mpsc::Receiver<WatchEvent>) {
    let mut batch = Vec::with_capacity(BATCH);
    while queue.recv_many(&mut batch, BATCH).await > 0 {
        let events = std::mem::take(&mut batch);
        if tx
            .send_msg(&Response::WatchEvents { events })
            .await
            .is_err()
        {
            return;
        }
    }
}

/// Runs a watch: answers [`Response::Watching`] once every watch is in
/// place, then sends events until the client closes the stream.
pub(crate) async fn run(
    req: WatchRequest,
    limits: &WatchLimits,
    tx: StreamSender,
    mut rx: StreamReceiver,
) -> Result<Response, OpError> {
    if req.paths.is_empty() || req.paths.len() > MAX_PATHS {
        return Err(OpError::bad_request(format!(
            "a watch names 1 to {MAX_PATHS} paths"
        )));
    }
    let filter = Filter::new(&req)?;
    let debounce = req.debounce_ms.map(Duration::from_millis);
    if debounce.is_some_and(|d| d > MAX_DEBOUNCE) {
        return Err(OpError::bad_request(format!(
            "debounce is at most {}s",
            MAX_DEBOUNCE.as_secs()
        )));
    }
    let roots = req
        .paths
        .iter()
        .map(|p| resolve(p, req.uid))
        .collect::<Result<Vec<_>, _>>()?;
    let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
        .map_err(|e| OpError::io("inotify_init", &std::io::Error::from(e)))?;
    // SAFETY: the Inotify owns its descriptor and moves into the AsyncFd,
    // so the descriptor stays open and the same for the AsyncFd's life.
    let fd = unsafe { AsyncFd::register_with_interest(InotifyFd(inotify), Interest::READABLE) }
        .map_err(|e| OpError::io("register the inotify descriptor", &e.into()))?;
    let mut w = Watcher {
        fd,
        watched: HashMap::new(),
        roots: roots.clone(),
        recursive: req.recursive,
        max_dirs: limits.max_dirs.max(1),
    };
    for (i, root) in roots.iter().enumerate() {
        match w.add_tree(root, i, true, None) {
            Ok(()) => {}
            Err(AddError::Limit) => {
                return Err(OpError::new(
                    ErrorCode::LimitExceeded,
                    format!(
                        "watching {} needs more than {} directories, the limit of one watch; watch a smaller tree",
                        root.display(),
                        w.max_dirs
                    ),
                ))
            }
            Err(AddError::Os(Errno::ENOSPC)) => {
                return Err(OpError::new(
                    ErrorCode::LimitExceeded,
                    format!(
                        "watch {}: the kernel's inotify limit (fs.inotify.max_user_watches) is reached",
                        root.display()
                    ),
                ))
            }
            Err(AddError::Os(e)) => {
                return Err(OpError::path(
                    "watch",
                    root,
                    &std::io::Error::from_raw_os_error(e as i32),
                ))
            }
        }
    }
    tx.send_msg(&Response::Watching {
        watched: w.watched.len() as u64,
    })
    .await
    .map_err(|_| OpError::cancelled())?;

    let (queue, queued) = mpsc::channel(limits.max_queued.max(1));
    let mut outbox = Outbox { queue, dropped: 0 };
    let mut sender = tokio::spawn(send_batches(tx, queued));
    let mut pending = Pending::default();
    let mut translated = Vec::new();
    loop {
        let flush_at = pending.flush_at;
        let queue = outbox.queue.clone();
        tokio::select! {
            ready = w.fd.readable() => {
                let events = {
                    let mut guard = ready.map_err(|e| OpError::io("wait for inotify", &e))?;
                    match guard.get_inner().0.read_events() {
                        Ok(events) => events,
                        Err(Errno::EAGAIN) => {
                            guard.clear_ready();
                            Vec::new()
                        }
                        Err(e) => {
                            return Err(OpError::io("read inotify events", &std::io::Error::from(e)))
                        }
                    }
                };
                for ev in events {
                    w.translate(ev, &mut translated);
                }
                for (event, root) in translated.drain(..) {
                    let root = &w.roots[root.min(w.roots.len() - 1)];
                    if !filter.wants(event.kind, Path::new(&event.path), root) {
                        continue;
                    }
                    match debounce {
                        None => outbox.push(event),
                        Some(window) => {
                            if pending.seen.insert((event.kind, event.path.clone())) {
                                pending.events.push(event);
                            }
                            pending.flush_at.get_or_insert_with(|| tokio::time::Instant::now() + window);
                        }
                    }
                }
            }
            () = async { if let Some(at) = flush_at { tokio::time::sleep_until(at).await } }, if flush_at.is_some() => {
                for event in pending.events.drain(..) {
                    outbox.push(event);
                }
                pending.seen.clear();
                pending.flush_at = None;
            }
            permit = queue.reserve(), if outbox.dropped > 0 => {
                if let Ok(permit) = permit {
                    permit.send(outbox.overflow_event());
                    outbox.dropped = 0;
                }
            }
            item = rx.recv() => {
                if item.is_none() {
                    sender.abort();
                    return Err(OpError::cancelled());
                }
            }
            _ = &mut sender => {
                // The client is gone.
                return Err(OpError::cancelled());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_patterns_match_names_or_paths_below_the_root() {
        let req = WatchRequest {
            paths: vec!["/w".into()],
            patterns: vec!["*.go".into(), "bin/*".into()],
            events: vec![WatchEventKind::Create, WatchEventKind::Write],
            ..WatchRequest::default()
        };
        let f = Filter::new(&req).expect("filter");
        let root = Path::new("/w");
        assert!(f.wants(WatchEventKind::Create, Path::new("/w/a/main.go"), root));
        assert!(f.wants(WatchEventKind::Write, Path::new("/w/bin/tool"), root));
        assert!(!f.wants(WatchEventKind::Write, Path::new("/w/bin/sub/tool"), root));
        assert!(!f.wants(WatchEventKind::Create, Path::new("/w/a/main.rs"), root));
        assert!(!f.wants(WatchEventKind::Remove, Path::new("/w/main.go"), root));
        assert!(f.wants(WatchEventKind::Overflow, Path::new(""), root));
        let bad = WatchRequest {
            patterns: vec!["[".into()],
            ..req
        };
        let e = Filter::new(&bad).err().expect("a bad glob");
        assert!(e.message.contains("pattern \"[\""), "{}", e.message);
    }

    #[test]
    fn test_paths_resolve_home_and_refuse_relative_ones() {
        assert_eq!(resolve("/tmp", None).expect("abs"), PathBuf::from("/tmp"));
        let home = resolve("~/x", Some(0)).expect("root's home");
        assert!(home.ends_with("x") && home.is_absolute(), "{home:?}");
        assert_eq!(
            resolve("tmp", None).expect_err("relative").code,
            ErrorCode::InvalidPath
        );
        assert_eq!(
            resolve("~other/x", None).expect_err("other user").code,
            ErrorCode::InvalidPath
        );
    }

    #[tokio::test]
    async fn test_a_full_queue_drops_and_reports_the_count_once() {
        let (queue, mut rx) = mpsc::channel(2);
        let mut out = Outbox { queue, dropped: 0 };
        let e = |n: u64| event(WatchEventKind::Write, Path::new("/f"), false, n, 0);
        for n in 0..5 {
            out.push(e(n));
        }
        assert_eq!(out.dropped, 3);
        assert_eq!(rx.recv().await.map(|e| e.size), Some(0));
        // Room for one: the overflow takes it, so 9 is dropped in turn.
        out.push(e(9));
        assert_eq!(rx.recv().await.map(|e| e.size), Some(1));
        let says = |o: Option<WatchEvent>| {
            let o = o.expect("an event");
            assert_eq!(o.kind, WatchEventKind::Overflow, "{o:?}");
            o.message.unwrap_or_default()
        };
        assert!(says(rx.recv().await).starts_with("3 events were dropped"));
        out.push(e(10));
        assert!(says(rx.recv().await).starts_with("1 event was dropped"));
        assert_eq!(rx.recv().await.map(|e| e.size), Some(10));
    }
}
