//! Files, tar trees and forwarding over a Unix socket.

mod common;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use common::{is_root, s, TestAgent};
use tine_client::proto::{
    ErrorCode, FileAttrs, FileKind, ForwardTarget, MkdirRequest, UploadRequest, UploadTarRequest,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn pattern(len: usize) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_246_822_519) >> 11) as u8)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_file_round_trip_keeps_bytes_mode_and_owner() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let dir = agent.scratch("files");
    let path = dir.join("sub/dir/data.bin");
    let data = pattern(3 << 20);
    assert!(
        is_root(),
        "this test sets owners and needs root (as CI runs it)"
    );
    let attrs = FileAttrs {
        mode: Some(0o4750),
        uid: Some(1234),
        gid: Some(5678),
    };

    let written = client
        .write_file(s(&path), &data, attrs)
        .await
        .expect("upload");
    let back = client.read_file(s(&path)).await.expect("download");
    let stat = client.stat(s(&path), false).await.expect("stat");

    assert_eq!(written, data.len() as u64);
    assert!(back == data, "downloaded bytes differ");
    assert_eq!(stat.kind, FileKind::File);
    assert_eq!(stat.size, data.len() as u64);
    assert_eq!(stat.mode, 0o4750);
    let meta = fs::metadata(&path).expect("local stat");
    assert_eq!(meta.mode() & 0o7777, 0o4750);
    assert_eq!((stat.uid, stat.gid), (1234, 5678));
    assert_eq!((meta.uid(), meta.gid()), (1234, 5678));
    let leftovers: Vec<_> = fs::read_dir(dir.join("sub/dir"))
        .expect("list")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(".tine-"))
        .collect();
    assert!(leftovers.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_file_upload_replaces_existing_file_atomically() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let path = agent.scratch("replace").join("f");
    fs::write(&path, b"old contents").expect("seed");

    client
        .write_file(s(&path), b"new", FileAttrs::default())
        .await
        .expect("upload");

    assert_eq!(fs::read(&path).expect("read"), b"new");
    assert_eq!(fs::metadata(&path).expect("stat").mode() & 0o777, 0o644);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_negative_upload_with_wrong_size_leaves_nothing() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let dir = agent.scratch("short");
    let path = dir.join("f");
    let req = UploadRequest {
        path: s(&path).to_owned(),
        attrs: FileAttrs::default(),
        mkdirs: false,
        size: Some(1000),
    };

    let err = client
        .upload(req, &b"only a few bytes"[..])
        .await
        .expect_err("short upload");

    assert_eq!(err.code(), Some(ErrorCode::BadRequest));
    assert_eq!(fs::read_dir(&dir).expect("list").count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_negative_download_missing_file_is_not_found() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;

    let err = client
        .read_file("/nonexistent/tine/file")
        .await
        .expect_err("missing");

    assert_eq!(err.code(), Some(ErrorCode::NotFound));
    assert!(err.to_string().contains("/nonexistent/tine/file"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_negative_relative_path_is_invalid() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;

    let err = client
        .stat("etc/passwd", false)
        .await
        .expect_err("relative");

    assert_eq!(err.code(), Some(ErrorCode::InvalidPath));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_mkdir_list_stat_and_remove() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let dir = agent.scratch("fsops");
    let deep = dir.join("a/b/c");

    client
        .mkdir(MkdirRequest {
            path: s(&deep).to_owned(),
            parents: true,
            attrs: FileAttrs {
                mode: Some(0o700),
                ..FileAttrs::default()
            },
        })
        .await
        .expect("mkdir -p");
    let again = client
        .mkdir(MkdirRequest {
            path: s(&deep).to_owned(),
            parents: false,
            attrs: FileAttrs::default(),
        })
        .await
        .expect_err("exists");
    fs::write(dir.join("a/file"), b"x").expect("file");
    std::os::unix::fs::symlink("file", dir.join("a/link")).expect("symlink");
    let entries = client.list(s(&dir.join("a"))).await.expect("list");
    let link = client
        .stat(s(&dir.join("a/link")), false)
        .await
        .expect("stat");
    let followed = client
        .stat(s(&dir.join("a/link")), true)
        .await
        .expect("stat");
    let not_empty = client
        .remove(s(&dir.join("a")), false)
        .await
        .expect_err("not empty");
    client.remove(s(&dir.join("a")), true).await.expect("rm -r");

    assert_eq!(again.code(), Some(ErrorCode::AlreadyExists));
    assert!(fs::metadata(&deep).is_err());
    let names: Vec<(&str, FileKind)> = entries
        .iter()
        .map(|e| (e.name.as_str(), e.stat.kind))
        .collect();
    assert_eq!(
        names,
        vec![
            ("b", FileKind::Dir),
            ("file", FileKind::File),
            ("link", FileKind::Symlink)
        ]
    );
    assert_eq!(link.kind, FileKind::Symlink);
    assert_eq!(link.symlink_target.as_deref(), Some("file"));
    assert_eq!(followed.kind, FileKind::File);
    assert_eq!(not_empty.code(), Some(ErrorCode::Io));
}

/// A tree with nested and empty directories, modes, and symlinks (relative,
/// dangling and absolute).
fn build_tree(root: &Path) {
    fs::create_dir_all(root.join("a/b/c")).expect("mkdir");
    fs::create_dir_all(root.join("empty")).expect("mkdir");
    fs::create_dir_all(root.join("private")).expect("mkdir");
    fs::write(root.join("a/b/c/deep.txt"), b"deep").expect("write");
    fs::write(root.join("top.bin"), pattern(300_000)).expect("write");
    fs::write(root.join("private/secret"), b"s").expect("write");
    fs::set_permissions(
        root.join("private/secret"),
        fs::Permissions::from_mode(0o600),
    )
    .expect("chmod");
    fs::set_permissions(root.join("private"), fs::Permissions::from_mode(0o700)).expect("chmod");
    fs::write(root.join("run.sh"), b"#!/bin/sh\n").expect("write");
    fs::set_permissions(root.join("run.sh"), fs::Permissions::from_mode(0o755)).expect("chmod");
    std::os::unix::fs::symlink("a/b/c/deep.txt", root.join("rel-link")).expect("symlink");
    std::os::unix::fs::symlink("/etc/passwd", root.join("abs-link")).expect("symlink");
    std::os::unix::fs::symlink("missing", root.join("a/dangling")).expect("symlink");
    let long = "n".repeat(150);
    fs::write(root.join("a").join(&long), b"long name").expect("write");
}

/// (relative path, kind, mode, contents or link target) for every entry.
fn describe_tree(root: &Path) -> Vec<(String, String, u32, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).expect("list") {
            let path = entry.expect("entry").path();
            let rel = path
                .strip_prefix(root)
                .expect("prefix")
                .display()
                .to_string();
            let meta = fs::symlink_metadata(&path).expect("stat");
            let (kind, content) = if meta.file_type().is_symlink() {
                (
                    "symlink",
                    fs::read_link(&path)
                        .expect("readlink")
                        .display()
                        .to_string()
                        .into_bytes(),
                )
            } else if meta.is_dir() {
                stack.push(path.clone());
                ("dir", Vec::new())
            } else {
                ("file", fs::read(&path).expect("read"))
            };
            let mode = if kind == "symlink" {
                0
            } else {
                meta.mode() & 0o7777
            };
            out.push((rel, kind.to_owned(), mode, content));
        }
    }
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_tar_tree_round_trip_keeps_symlinks_empty_dirs_and_modes() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let source = agent.scratch("tree-src");
    let dest = agent.dir.path().join("tree-dst");
    build_tree(&source);

    let mut archive = Vec::new();
    let packed = client
        .download_tar(s(&source), &mut archive)
        .await
        .expect("download tar");
    let unpacked = client
        .upload_tar(
            UploadTarRequest {
                path: s(&dest).to_owned(),
                mkdirs: true,
                uid: None,
                gid: None,
                exclude: Vec::new(),
            },
            archive.as_slice(),
        )
        .await
        .expect("upload tar");

    assert_eq!(packed.entries, unpacked.entries);
    assert_eq!(describe_tree(&source), describe_tree(&dest));
    assert!(describe_tree(&dest)
        .iter()
        .any(|(p, k, _, _)| p == "empty" && k == "dir"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_tar_upload_with_owner_override_chowns_entries() {
    assert!(
        is_root(),
        "this test chowns files and needs root (run the suite as root, as CI does)"
    );
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let source = agent.scratch("own-src");
    let dest = agent.dir.path().join("own-dst");
    fs::create_dir_all(source.join("d")).expect("mkdir");
    fs::write(source.join("d/f"), b"x").expect("write");
    let mut archive = Vec::new();
    client
        .download_tar(s(&source), &mut archive)
        .await
        .expect("pack");

    client
        .upload_tar(
            UploadTarRequest {
                path: s(&dest).to_owned(),
                mkdirs: true,
                uid: Some(2000),
                gid: Some(3000),
                exclude: Vec::new(),
            },
            archive.as_slice(),
        )
        .await
        .expect("unpack");

    for rel in ["d", "d/f"] {
        let meta = fs::metadata(dest.join(rel)).expect("stat");
        assert_eq!((meta.uid(), meta.gid()), (2000, 3000), "{rel}");
    }
}

/// A ustar header with a raw name, bypassing the tar crate's own checks.
fn raw_entry(archive: &mut Vec<u8>, name: &str, kind: tar::EntryType, link: &str, data: &[u8]) {
    let mut header = tar::Header::new_ustar();
    {
        let old = header.as_old_mut();
        old.name[..name.len()].copy_from_slice(name.as_bytes());
        old.linkname[..link.len()].copy_from_slice(link.as_bytes());
    }
    header.set_entry_type(kind);
    header.set_size(data.len() as u64);
    header.set_mode(0o644);
    header.set_cksum();
    archive.extend_from_slice(header.as_bytes());
    archive.extend_from_slice(data);
    archive.resize(archive.len().div_ceil(512) * 512, 0);
}

fn finish(archive: &mut Vec<u8>) {
    archive.extend_from_slice(&[0u8; 1024]);
}

async fn upload_raw(agent: &TestAgent, dest: &Path, archive: Vec<u8>) -> tine_client::ClientError {
    let client = agent.client().await;
    client
        .upload_tar(
            UploadTarRequest {
                path: s(dest).to_owned(),
                mkdirs: true,
                uid: None,
                gid: None,
                exclude: Vec::new(),
            },
            archive.as_slice(),
        )
        .await
        .expect_err("must be refused")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_negative_tar_parent_dir_entry_is_refused() {
    let agent = TestAgent::start().await;
    let base = agent.scratch("escape1");
    let dest = base.join("dest");
    let mut archive = Vec::new();
    raw_entry(&mut archive, "ok.txt", tar::EntryType::Regular, "", b"fine");
    raw_entry(
        &mut archive,
        "../evil.txt",
        tar::EntryType::Regular,
        "",
        b"evil",
    );
    finish(&mut archive);

    let err = upload_raw(&agent, &dest, archive).await;

    assert_eq!(err.code(), Some(ErrorCode::InvalidPath));
    assert!(err.to_string().contains("../evil.txt"), "{err}");
    assert!(!base.join("evil.txt").exists());
    assert!(agent.client().await.health().await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_negative_tar_absolute_entry_is_refused() {
    let agent = TestAgent::start().await;
    let base = agent.scratch("escape2");
    let target = base.join("abs-target");
    let mut archive = Vec::new();
    raw_entry(
        &mut archive,
        s(&target),
        tar::EntryType::Regular,
        "",
        b"evil",
    );
    finish(&mut archive);

    let err = upload_raw(&agent, &base.join("dest"), archive).await;

    assert_eq!(err.code(), Some(ErrorCode::InvalidPath));
    assert!(!target.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_negative_tar_write_through_outside_symlink_is_refused() {
    let agent = TestAgent::start().await;
    let outside = agent.scratch("outside");
    let dest = agent.scratch("escape3");
    let mut archive = Vec::new();
    raw_entry(
        &mut archive,
        "link",
        tar::EntryType::Symlink,
        s(&outside),
        b"",
    );
    raw_entry(
        &mut archive,
        "link/pwned",
        tar::EntryType::Regular,
        "",
        b"evil",
    );
    finish(&mut archive);

    let err = upload_raw(&agent, &dest, archive).await;

    assert_eq!(err.code(), Some(ErrorCode::InvalidPath));
    assert!(!outside.join("pwned").exists());
    // The symlink itself may exist: it is never followed out.
    assert_eq!(fs::read_dir(&outside).expect("list").count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_negative_tar_hard_link_outside_is_refused() {
    let agent = TestAgent::start().await;
    let dest = agent.scratch("escape4");
    let mut archive = Vec::new();
    raw_entry(
        &mut archive,
        "passwd",
        tar::EntryType::Link,
        "../../../../etc/passwd",
        b"",
    );
    finish(&mut archive);

    let err = upload_raw(&agent, &dest, archive).await;

    assert_eq!(err.code(), Some(ErrorCode::InvalidPath));
    assert!(!dest.join("passwd").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_forward_to_tcp_listener_on_loopback() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.expect("accept");
        let mut got = Vec::new();
        socket.read_to_end(&mut got).await.expect("read");
        socket
            .write_all(&got.to_ascii_uppercase())
            .await
            .expect("write");
    });
    let payload = b"hello over tcp ".repeat(20_000);

    let mut forward = client
        .forward(ForwardTarget::Tcp { port, host: None })
        .await
        .expect("forward");
    forward.write(&payload).await.expect("write");
    forward.shutdown_write().await.expect("eof");
    let mut back = Vec::new();
    while let Some(data) = forward.read().await.expect("read") {
        back.extend_from_slice(&data);
    }

    assert_eq!(back, payload.to_ascii_uppercase());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_forward_to_unix_socket_bridges_local_stream() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let path = agent.dir.path().join("svc.sock");
    let listener = tokio::net::UnixListener::bind(&path).expect("bind");
    tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.expect("accept");
        let mut got = Vec::new();
        socket.read_to_end(&mut got).await.expect("read");
        socket.write_all(b"echo:").await.expect("write");
        socket.write_all(&got).await.expect("write");
    });
    let forward = client
        .forward(ForwardTarget::Unix {
            path: s(&path).to_owned(),
        })
        .await
        .expect("forward");
    let (mut local, remote) = tokio::io::duplex(64 << 10);

    let bridge = tokio::spawn(forward.bridge(remote));
    local.write_all(b"ping").await.expect("write");
    local.shutdown().await.expect("shutdown");
    let mut back = Vec::new();
    local.read_to_end(&mut back).await.expect("read");

    assert_eq!(back, b"echo:ping");
    let (sent, received) = bridge.await.expect("join").expect("bridge");
    assert_eq!((sent, received), (4, 9));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_negative_forward_to_closed_port_reports_error() {
    let agent = TestAgent::start().await;
    let client = agent.client().await;
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("addr").port()
    };

    let err = client
        .forward(ForwardTarget::Tcp { port, host: None })
        .await
        .expect_err("refused");

    assert_eq!(err.code(), Some(ErrorCode::Io));
    assert!(err.to_string().contains(&port.to_string()), "{err}");
}
