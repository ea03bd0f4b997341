//! Images: list, inspect, import (the file as the request body, answered
//! with NDJSON progress events) and delete.

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt as _;
use tine_proto::api::{
    DeleteImageResponse, DeleteStatus, ImageInfo, ImportEvent, ImportFormat, ImportStage,
};
use tokio::io::AsyncWriteExt as _;

use super::params::{parse_query_enum, query_get, query_only, query_pairs, AppState};
use crate::core::image_info;
use crate::error::{ApiError, ApiResult};

pub(super) async fn list(State(d): State<AppState>) -> ApiResult<Json<Vec<ImageInfo>>> {
    Ok(Json(d.images()?.iter().map(image_info).collect()))
}

pub(super) async fn get(
    State(d): State<AppState>,
    Path(name): Path<String>,
) -> ApiResult<Json<ImageInfo>> {
    Ok(Json(image_info(&d.image_shown(&name)?)))
}

pub(super) async fn delete(
    State(d): State<AppState>,
    Path(name): Path<String>,
) -> ApiResult<Json<DeleteImageResponse>> {
    let daemon = d.clone();
    let key = name.clone();
    tokio::task::spawn_blocking(move || daemon.delete_image(&key))
        .await
        .map_err(|e| ApiError::internal(format!("delete image: {e}")))??;
    Ok(Json(DeleteImageResponse {
        name,
        status: DeleteStatus::Deleted,
    }))
}

fn event_line(e: &ImportEvent) -> Bytes {
    let mut line = serde_json::to_vec(e).unwrap_or_default();
    line.push(b'\n');
    Bytes::from(line)
}

/// Writes the request body to `path`; returns its length.
async fn receive(body: Body, path: &std::path::Path) -> std::io::Result<u64> {
    let mut file = tokio::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .await?;
    let mut stream = body.into_data_stream();
    let mut total = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| std::io::Error::other(e.to_string()))?;
        file.write_all(&chunk).await?;
        total += chunk.len() as u64;
    }
    file.flush().await?;
    Ok(total)
}

pub(super) async fn import(State(d): State<AppState>, uri: Uri, body: Body) -> ApiResult<Response> {
    let q = query_pairs(&uri);
    query_only(&q, &["name", "format"])?;
    let name = query_get(&q, "name")
        .filter(|n| !n.is_empty())
        .ok_or_else(|| ApiError::bad_request("name= is required: the new image's name"))?
        .to_owned();
    let format: ImportFormat = parse_query_enum(&q, "format")?.unwrap_or_default();
    let slot = d.begin_import(&name)?;
    let upload = d.import_temp("upload")?;
    let received = match receive(body, &upload).await {
        Ok(0) => Err(ApiError::bad_request("the upload is empty")),
        Ok(n) => Ok(n),
        Err(e) => Err(ApiError::bad_request(format!(
            "the upload was not received whole: {e}"
        ))),
    };
    let received = match received {
        Ok(n) => n,
        Err(e) => {
            if let Err(rm) = tokio::fs::remove_file(&upload).await {
                tracing::warn!(
                    "cannot remove the partial upload {}: {rm}",
                    upload.display()
                );
            }
            return Err(e);
        }
    };
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let received_event = ImportEvent::Progress {
        stage: ImportStage::Received,
        done: Some(received),
        total: Some(received),
        message: format!("received {received} bytes"),
    };
    if tx.send(received_event).is_err() {
        tracing::debug!("image upload: its progress stream has gone");
    }
    let source = format!("upload ({format}, {received} bytes)");
    tokio::spawn(async move {
        let last = match d
            .import_image(slot, format, upload, source, tx.clone())
            .await
        {
            Ok(rec) => ImportEvent::Done {
                image: image_info(&rec),
            },
            Err(e) => {
                let e = ApiError::from(e);
                tracing::warn!(image = %name, "import failed: {}", e.message);
                ImportEvent::Error(e.body())
            }
        };
        if tx.send(last).is_err() {
            tracing::debug!(image = %name, "the client left before the import's last event");
        }
    });
    let stream = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
        .map(|e| Ok::<_, std::convert::Infallible>(event_line(&e)));
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(stream),
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use axum::http::{Method, StatusCode};
    use tine_proto::api::{ErrorBody, ErrorCode, ImageFormat, ImageOrigin};

    use super::*;
    use crate::config::{Config, HostGroup};
    use crate::core::{Daemon, Deadlines, Parts};
    use crate::launcher::fake::FakeLauncher;

    struct Api {
        dir: tempfile::TempDir,
        app: axum::Router,
    }

    /// A raw "disk" with an ext4 superblock magic: enough for an import.
    fn raw_image(bytes: usize) -> Vec<u8> {
        let mut v = vec![0u8; bytes];
        v[1080] = 0x53;
        v[1081] = 0xef;
        v
    }

    /// A 64-bit ELF header without program headers: a "static" agent.
    fn fake_static_agent(path: &std::path::Path) {
        let mut elf = vec![0u8; 64];
        elf[..5].copy_from_slice(b"\x7fELF\x02");
        std::fs::write(path, elf).expect("agent");
    }

    impl Api {
        fn new(storage_size: Option<&str>) -> Self {
            let dir = tempfile::tempdir().expect("tmp");
            let agent = dir.path().join("tine-agent");
            fake_static_agent(&agent);
            Self::with_agent(dir, Some(agent), storage_size)
        }

        fn with_agent(
            dir: tempfile::TempDir,
            agent: Option<std::path::PathBuf>,
            storage_size: Option<&str>,
        ) -> Self {
            let mut config = Config::embedded_default();
            config.agent = agent;
            config.host_groups = vec![HostGroup {
                name: "dev".into(),
                image: "imported".into(),
                persistent: true,
                ram_mb: 256,
                storage_size: storage_size.map(str::to_owned),
                ..config.host_groups[0].clone()
            }];
            let parts = Parts::on_launcher(
                config,
                dir.path().join("data"),
                Arc::new(FakeLauncher::new()),
                Deadlines::default(),
            );
            let daemon = Daemon::from_parts(parts.expect("daemon parts"));
            Api {
                app: crate::api::app(daemon),
                dir,
            }
        }

        async fn send(&self, method: Method, uri: &str, body: Vec<u8>) -> (StatusCode, Vec<u8>) {
            let a = crate::api::testing::send(&self.app, method, uri, None, body).await;
            (a.status, a.body)
        }

        /// An import's events (the answer must be a 200 stream).
        async fn import(&self, query: &str, body: Vec<u8>) -> Vec<ImportEvent> {
            let (status, bytes) = self
                .send(Method::POST, &format!("/images?{query}"), body)
                .await;
            assert_eq!(
                status,
                StatusCode::OK,
                "{}",
                String::from_utf8_lossy(&bytes)
            );
            bytes
                .split(|b| *b == b'\n')
                .filter(|l| !l.is_empty())
                .map(|l| serde_json::from_slice(l).expect("an import event"))
                .collect()
        }

        fn stray_files(&self) -> Vec<String> {
            std::fs::read_dir(self.dir.path().join("data/images"))
                .map(|d| {
                    d.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .filter(|n| n.starts_with('.'))
                        .collect()
                })
                .unwrap_or_default()
        }
    }

    #[tokio::test]
    async fn a_built_but_unused_built_in_image_is_listed_and_shown() {
        let api = Api::new(None);
        // The daemon's own folder is the second place it looks for `debian`
        // (after $TINE_IMAGE_DEBIAN, which tests never set).
        let images = api.dir.path().join("data/images");
        std::fs::create_dir_all(&images).expect("dir");
        std::fs::write(images.join("debian.img"), raw_image(1 << 20)).expect("image");
        let (status, body) = api.send(Method::GET, "/images", vec![]).await;
        assert_eq!(status, StatusCode::OK);
        let list: Vec<ImageInfo> = serde_json::from_slice(&body).expect("list");
        let debian = list
            .iter()
            .find(|i| i.name == "debian")
            .unwrap_or_else(|| panic!("debian is not listed: {list:?}"));
        assert_eq!(debian.origin, ImageOrigin::BuiltIn);
        assert_eq!(debian.size, 1 << 20);
        let (status, body) = api.send(Method::GET, "/images/debian", vec![]).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            &serde_json::from_slice::<ImageInfo>(&body).expect("one"),
            debian
        );
        // Shown, not recorded: there is nothing of the daemon's to delete.
        let (status, _) = api.send(Method::DELETE, "/images/debian", vec![]).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert!(
            images.join("debian.img").is_file(),
            "the build output stays"
        );
    }

    fn error_of(events: &[ImportEvent]) -> &ErrorBody {
        match events.last() {
            Some(ImportEvent::Error(e)) => e,
            other => panic!("expected an error event last, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn raw_images_import_list_and_delete_unless_used() {
        let api = Api::new(None);
        let events = api
            .import("name=imported&format=auto", raw_image(1 << 20))
            .await;
        assert!(matches!(
            events.first(),
            Some(ImportEvent::Progress {
                stage: ImportStage::Received,
                done: Some(1_048_576),
                ..
            })
        ));
        let image = match events.last() {
            Some(ImportEvent::Done { image }) => image.clone(),
            other => panic!("not done: {other:?}"),
        };
        assert_eq!(image.format, ImageFormat::Raw);
        assert_eq!(image.origin, ImageOrigin::Imported);
        assert_eq!(image.size, 1 << 20);
        let digest = image.digest.clone().expect("digest");
        assert_eq!(
            digest,
            crate::image::oci::sha256_reader(&raw_image(1 << 20)[..]).expect("hash")
        );

        let (status, body) = api.send(Method::GET, "/images", vec![]).await;
        assert_eq!(status, StatusCode::OK);
        let list: Vec<ImageInfo> = serde_json::from_slice(&body).expect("list");
        // Built-in images this machine has built are listed too.
        let imported: Vec<_> = list
            .into_iter()
            .filter(|i| i.origin != ImageOrigin::BuiltIn)
            .collect();
        assert_eq!(imported, vec![image.clone()]);
        let (status, body) = api.send(Method::GET, "/images/imported", vec![]).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            serde_json::from_slice::<ImageInfo>(&body).expect("one"),
            image
        );

        // Images are immutable: the name is taken.
        let (status, body) = api
            .send(Method::POST, "/images?name=imported", raw_image(8192))
            .await;
        assert_eq!(status, StatusCode::CONFLICT);
        assert!(String::from_utf8_lossy(&body).contains("already exists"));

        // A VM over it keeps it.
        let (status, body) = api
            .send(
                Method::POST,
                "/hostgroup/dev/nodes?wait=agent&timeout=30s",
                b"{}".to_vec(),
            )
            .await;
        assert!(status.is_success(), "{}", String::from_utf8_lossy(&body));
        let vm: tine_proto::api::CreateVmResponse = serde_json::from_slice(&body).expect("vm");
        let (status, body) = api.send(Method::DELETE, "/images/imported", vec![]).await;
        assert_eq!(status, StatusCode::CONFLICT);
        let err: ErrorBody = serde_json::from_slice(&body).expect("error");
        assert_eq!(
            err.error,
            format!(
                "image `imported` is used by VM {}; delete them first",
                vm.hostname
            )
        );
        let (status, _) = api
            .send(Method::DELETE, &format!("/vm/{}", vm.hostname), vec![])
            .await;
        assert!(status.is_success());
        let (status, body) = api.send(Method::DELETE, "/images/imported", vec![]).await;
        assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
        let (status, _) = api.send(Method::GET, "/images/imported", vec![]).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(api.stray_files(), Vec::<String>::new());
        let left: Vec<_> = std::fs::read_dir(api.dir.path().join("data/images"))
            .expect("dir")
            .flatten()
            .collect();
        assert!(left.is_empty(), "the base file is removed too: {left:?}");
    }

    #[tokio::test]
    async fn bad_requests_and_malformed_uploads_name_the_problem() {
        let api = Api::new(None);
        let (status, body) = api
            .send(Method::POST, "/images?name=min", raw_image(8192))
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(String::from_utf8_lossy(&body).contains("built-in"));
        let (status, body) = api.send(Method::POST, "/images", raw_image(8192)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(String::from_utf8_lossy(&body).contains("name= is required"));
        let (status, body) = api
            .send(Method::POST, "/images?name=x&format=zip", raw_image(8192))
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(String::from_utf8_lossy(&body).contains("format `zip` is not one of"));

        let events = api.import("name=junk", vec![0x42; 4096]).await;
        let err = error_of(&events);
        assert_eq!(err.code, ErrorCode::BadRequest);
        assert!(err.error.contains("neither a qcow2 image"), "{}", err.error);

        let events = api.import("name=junk&format=qcow2", raw_image(8192)).await;
        assert!(error_of(&events)
            .error
            .contains("said to be qcow2 but looks like a raw ext4 image"));

        // A docker archive whose second layer is missing.
        let layers = vec![crate::image::tests::tar_files(&[("bin/sh", b"sh")])];
        let mut archive = crate::image::tests::docker_archive(&layers);
        // Cut the archive after its manifest and config: the layer is gone.
        let mut cut = tar::Archive::new(&archive[..]);
        let mut keep = tar::Builder::new(Vec::new());
        for e in cut.entries().expect("entries") {
            let mut e = e.expect("entry");
            let path = e.path().expect("path").into_owned();
            if path.to_string_lossy().ends_with("layer.tar") {
                continue;
            }
            let mut h = e.header().clone();
            let mut data = Vec::new();
            std::io::Read::read_to_end(&mut e, &mut data).expect("read");
            keep.append_data(&mut h, &path, &data[..]).expect("append");
        }
        archive = keep.into_inner().expect("tar");
        let events = api.import("name=broken", archive).await;
        let err = error_of(&events);
        assert_eq!(err.code, ErrorCode::BadRequest);
        assert_eq!(
            err.error,
            "missing layer 1 (l0/layer.tar): l0/layer.tar is not in the archive"
        );
        let (_, body) = api.send(Method::GET, "/images", vec![]).await;
        let list: Vec<ImageInfo> = serde_json::from_slice(&body).expect("list");
        assert!(
            list.iter().all(|i| i.origin == ImageOrigin::BuiltIn),
            "nothing was imported: {list:?}"
        );
        assert_eq!(api.stray_files(), Vec::<String>::new());
    }

    #[tokio::test]
    async fn an_oci_image_imports_with_its_exec_defaults() {
        let api = Api::new(None);
        let layers = vec![crate::image::tests::tar_files(&[
            ("bin/sh", b"#!sh"),
            ("srv/app", b"app"),
        ])];
        let archive = crate::image::tests::oci_archive(
            &layers,
            "application/vnd.oci.image.layer.v1.tar+gzip",
        );
        let events = api.import("name=imported&format=oci", archive).await;
        let image = match events.last() {
            Some(ImportEvent::Done { image }) => image.clone(),
            other => panic!("not done: {other:?}"),
        };
        assert_eq!(image.format, ImageFormat::Oci);
        let defaults = image.exec_defaults.expect("defaults");
        assert_eq!(defaults.workdir.as_deref(), Some("/srv"));
        assert!(defaults.env.contains(&"GREETING=hello".to_owned()));
        assert_eq!(api.stray_files(), Vec::<String>::new());
    }

    #[tokio::test]
    async fn an_image_larger_than_the_groups_disk_is_refused_at_create() {
        let api = Api::new(Some("1M"));
        let events = api.import("name=imported", raw_image(2 << 20)).await;
        assert!(matches!(events.last(), Some(ImportEvent::Done { .. })));
        let (status, body) = api
            .send(
                Method::POST,
                "/hostgroup/dev/nodes?wait=agent",
                b"{}".to_vec(),
            )
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        let text = String::from_utf8_lossy(&body);
        assert!(
            text.contains("image `imported` (2 MiB) is too large for the disk size of host group `dev` (1 MiB)"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn without_a_configured_agent_the_min_images_agent_is_installed() {
        if std::env::var_os("TINE_AGENT_BIN").is_some()
            || std::env::var_os("TINE_IMAGE_MIN").is_some()
        {
            panic!("unset TINE_AGENT_BIN and TINE_IMAGE_MIN: this test makes its own min image");
        }
        // A "min image" at <data_dir>/images/min.img carrying an agent.
        let dir = tempfile::tempdir().expect("tmp");
        let min_root = dir.path().join("min-root");
        std::fs::create_dir_all(min_root.join("usr/bin")).expect("root");
        fake_static_agent(&min_root.join("usr/bin/tine-agent"));
        let images = dir.path().join("data/images");
        std::fs::create_dir_all(&images).expect("images");
        crate::image::rootfs::make_ext4(&min_root, &images.join("min.img"), 64 << 20)
            .expect("min image");
        let api = Api::with_agent(dir, None, None);
        let layers = vec![crate::image::tests::tar_files(&[("bin/sh", b"#!sh")])];
        let archive = crate::image::tests::docker_archive(&layers);
        let events = api.import("name=imported", archive).await;
        let image = match events.last() {
            Some(ImportEvent::Done { image }) => image.clone(),
            other => panic!("not done: {other:?}"),
        };
        assert_eq!(image.format, ImageFormat::DockerArchive);
        let (_, body) = api.send(Method::GET, "/images/imported", vec![]).await;
        let info: ImageInfo = serde_json::from_slice(&body).expect("info");
        assert_eq!(info, image);
        // The installed agent is the min image's.
        let base = std::fs::read_dir(api.dir.path().join("data/images"))
            .expect("dir")
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "base"))
            .expect("a base");
        let debugfs = crate::image::rootfs::find_tool("debugfs").expect("debugfs");
        let out = std::process::Command::new(debugfs)
            .args(["-R", "cat /usr/bin/tine-agent"])
            .arg(&base)
            .output()
            .expect("debugfs");
        assert_eq!(&out.stdout[..5], b"\x7fELF\x02");
        assert_eq!(out.stdout.len(), 64);
    }
}
