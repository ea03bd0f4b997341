//! `watch` and `stats` against the real agent on the host: inotify events
//! for changes made on the host's file system, the recursive and bounded
//! watch, and the figures of this machine.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use common::{s, TestAgent};
use tine_agent::AgentConfig;
use tine_client::agent::FsWatch;
use tine_client::proto::{ErrorCode, WatchEvent, WatchEventKind, WatchRequest};

/// Reads events until `done` says the ones seen are enough; fails after
/// 10 s with what came.
async fn until(watch: &mut FsWatch, done: impl Fn(&[WatchEvent]) -> bool) -> Vec<WatchEvent> {
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !done(&seen) {
        match tokio::time::timeout_at(deadline, watch.next_batch()).await {
            Ok(Ok(Some(batch))) => seen.extend(batch),
            Ok(other) => panic!("the watch ended: {other:?} after {seen:?}"),
            Err(_) => panic!("timed out; seen {seen:?}"),
        }
    }
    seen
}

fn has(events: &[WatchEvent], kind: WatchEventKind, path: &Path) -> bool {
    events
        .iter()
        .any(|e| e.kind == kind && Path::new(&e.path) == path)
}

fn watch(paths: &[&Path], recursive: bool) -> WatchRequest {
    WatchRequest {
        paths: paths.iter().map(|p| s(p).to_owned()).collect(),
        recursive,
        ..WatchRequest::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_watch_reports_each_kind_of_change_recursively() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let dir = agent.scratch("w");
    std::fs::create_dir(dir.join("old")).expect("mkdir");
    let mut w = client.watch(watch(&[&dir], true)).await.expect("watch");
    assert_eq!(w.watched(), 2, "the root and the directory below it");

    let file = dir.join("a.txt");
    std::fs::write(&file, b"hello").expect("write");
    let e = until(&mut w, |e| has(e, WatchEventKind::Write, &file)).await;
    let create = e
        .iter()
        .find(|e| e.kind == WatchEventKind::Create)
        .expect("create");
    assert_eq!((create.path.as_str(), create.is_dir), (s(&file), false));
    assert!(create.unix_nanos > 0);
    let write = e.iter().rfind(|e| e.kind == WatchEventKind::Write);
    assert_eq!(write.map(|w| w.size), Some(5));

    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    until(&mut w, |e| has(e, WatchEventKind::Chmod, &file)).await;
    let moved = dir.join("b.txt");
    std::fs::rename(&file, &moved).expect("rename");
    let e = until(&mut w, |e| has(e, WatchEventKind::Create, &moved)).await;
    assert!(has(&e, WatchEventKind::Rename, &file), "{e:?}");
    std::fs::remove_file(&moved).expect("rm");
    until(&mut w, |e| has(e, WatchEventKind::Remove, &moved)).await;

    // A directory that existed before, and one made now: both watched,
    // with what was written into the new one right away.
    let deep = dir.join("old/x");
    std::fs::write(&deep, b"1").expect("write");
    until(&mut w, |e| has(e, WatchEventKind::Create, &deep)).await;
    let new = dir.join("new");
    std::fs::create_dir_all(new.join("inner")).expect("mkdir -p");
    std::fs::write(new.join("inner/f"), b"22").expect("write");
    // Written before its directory's watch may have been in place: found
    // by the scan of the new directory, or seen by the watch.
    let e = until(&mut w, |e| {
        has(e, WatchEventKind::Create, &new.join("inner/f"))
    })
    .await;
    let dir_event = e
        .iter()
        .find(|e| Path::new(&e.path) == new)
        .expect("the new directory");
    assert!(dir_event.is_dir && dir_event.kind == WatchEventKind::Create);
    // A moved-away directory is forgotten: changes there are not
    // reported under its old name.
    let outside = agent.scratch("outside").join("new");
    std::fs::rename(&new, &outside).expect("move out");
    until(&mut w, |e| has(e, WatchEventKind::Rename, &new)).await;
    std::fs::write(outside.join("inner/g"), b"").expect("write outside");
    std::fs::write(dir.join("last"), b"").expect("write");
    let e = until(&mut w, |e| {
        has(e, WatchEventKind::Create, &dir.join("last"))
    })
    .await;
    assert!(!e.iter().any(|e| e.path.ends_with("/g")), "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_watch_filters_by_kind_and_pattern_and_stays_flat_unless_recursive() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let dir = agent.scratch("f");
    std::fs::create_dir(dir.join("sub")).expect("mkdir");
    let mut req = watch(&[&dir], false);
    req.patterns = vec!["*.go".into()];
    req.events = vec![WatchEventKind::Create];
    let mut w = client.watch(req).await.expect("watch");
    assert_eq!(w.watched(), 1);
    std::fs::write(dir.join("sub/deep.go"), b"x").expect("write below");
    std::fs::write(dir.join("skip.rs"), b"x").expect("write");
    std::fs::write(dir.join("main.go"), b"x").expect("write");
    let e = until(&mut w, |e| !e.is_empty()).await;
    assert_eq!(e.len(), 1, "{e:?}");
    assert_eq!(
        (e[0].kind, e[0].path.as_str()),
        (WatchEventKind::Create, s(&dir.join("main.go")))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_watch_is_bounded_in_directories() {
    let agent = TestAgent::start_with(AgentConfig {
        max_watch_dirs: 3,
        ..AgentConfig::default()
    })
    .await;
    let client = agent.client().await;
    let big = agent.scratch("big");
    for d in ["a", "b", "c"] {
        std::fs::create_dir(big.join(d)).expect("mkdir");
    }
    let e = client
        .watch(watch(&[&big], true))
        .await
        .expect_err("4 directories");
    assert_eq!(e.code(), Some(ErrorCode::LimitExceeded), "{e}");
    assert!(e.to_string().contains("more than 3 directories"), "{e}");

    // Within the limit at first; a directory past it is reported.
    let small = agent.scratch("small");
    std::fs::create_dir(small.join("a")).expect("mkdir");
    let mut w = client.watch(watch(&[&small], true)).await.expect("watch");
    std::fs::create_dir(small.join("b")).expect("mkdir b");
    std::fs::create_dir(small.join("c")).expect("mkdir c");
    let e = until(&mut w, |e| {
        e.iter().any(|e| e.kind == WatchEventKind::Overflow)
    })
    .await;
    let o = e
        .iter()
        .find(|e| e.kind == WatchEventKind::Overflow)
        .expect("overflow");
    let msg = o.message.as_deref().unwrap_or_default();
    assert!(
        msg.contains("limit of 3 directories") && msg.contains("/small/c"),
        "{msg}"
    );

    // Bad requests are named.
    let e = client
        .watch(watch(&[Path::new("relative")], false))
        .await
        .expect_err("relative");
    assert_eq!(e.code(), Some(ErrorCode::InvalidPath));
    let e = client
        .watch(watch(&[&small.join("absent")], false))
        .await
        .expect_err("absent");
    assert_eq!(e.code(), Some(ErrorCode::NotFound), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_watch_ends_when_the_client_drops_it() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let dir = agent.scratch("d");
    let w = client.watch(watch(&[&dir], false)).await.expect("watch");
    drop(w);
    // The connection stays usable, and a new watch works.
    let mut w = client.watch(watch(&[&dir], false)).await.expect("again");
    std::fs::write(dir.join("x"), b"").expect("write");
    until(&mut w, |e| has(e, WatchEventKind::Create, &dir.join("x"))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_stats_reports_this_machines_figures() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let st = client.stats().await.expect("stats");
    assert!(st.errors.is_empty(), "{:?}", st.errors);
    assert!(st.cpus >= 1);
    assert!(st.mem_total_bytes > 0 && st.mem_available_bytes <= st.mem_total_bytes);
    assert!(st.root_fs.total_bytes > 0);
    assert!(st.uptime_ms > 0 && st.open_files > 0);
}
