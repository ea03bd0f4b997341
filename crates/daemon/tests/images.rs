//! Image import against the real daemon and real VMs, in the test bed: an
//! OCI image the test builds itself (Debian's static busybox in two
//! layers, the second with a whiteout, and a config with `Env` and
//! `WorkingDir`) is imported, a VM boots from it, and exec runs with the
//! image's defaults; the image cannot be removed while the VM exists; the
//! same layers as a `docker save` archive convert too; malformed archives
//! are refused naming the problem.

mod support;

use std::io::Write as _;
use std::path::{Path, PathBuf};

use support::*;
use tine_client::api::{ExecOptions, TineClient, Wait};
use tine_daemon::image::oci::sha256_reader;
use tine_proto::api::{ErrorCode, ImageFormat, ImageInfo, ImageOrigin, ImportFormat};
use tine_testbed::Trial;

/// A group booting the imported image.
const GROUP: &str = "  - name: app
    image: app
    cpus: 1
    ram_mb: 256
    persistent: false
";

/// Where Debian's busybox-static puts its binary.
const BUSYBOX: &str = "/bin/busybox";

fn header(kind: tar::EntryType, size: u64, mode: u32) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_size(size);
    h.set_mode(mode);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(1_700_000_000);
    h
}

/// A layer tar: files `(path, bytes, mode)` and symlinks `(path, target)`.
fn layer(files: &[(&str, Vec<u8>, u32)], links: &[(&str, &str)]) -> R<Vec<u8>> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, data, mode) in files {
        let mut h = header(tar::EntryType::Regular, data.len() as u64, *mode);
        b.append_data(&mut h, path, &data[..])?;
    }
    for (path, target) in links {
        let mut h = header(tar::EntryType::Symlink, 0, 0o777);
        b.append_link(&mut h, path, target)?;
    }
    Ok(b.into_inner()?)
}

fn gzip(bytes: &[u8]) -> R<Vec<u8>> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes)?;
    Ok(e.finish()?)
}

fn sha(bytes: &[u8]) -> R<String> {
    Ok(sha256_reader(bytes)?)
}

/// An OCI image layout as a tar: `layers` (gzipped blobs) under a config
/// with `env` and `workdir`. `drop_blob` leaves that layer's blob out.
fn oci_archive(
    layers: &[Vec<u8>],
    env: &[&str],
    workdir: &str,
    drop_blob: Option<usize>,
) -> R<Vec<u8>> {
    let blobs: Vec<Vec<u8>> = layers.iter().map(|l| gzip(l)).collect::<R<_>>()?;
    let diff_ids: Vec<String> = layers.iter().map(|l| sha(l)).collect::<R<_>>()?;
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": tine_proto::api::go_arch(),
        "os": "linux",
        "config": {"Env": env, "WorkingDir": workdir, "Cmd": ["/bin/sh"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids}
    }))?;
    let mut layer_descs = Vec::new();
    for b in &blobs {
        layer_descs.push(serde_json::json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
            "digest": sha(b)?, "size": b.len()
        }));
    }
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": sha(&config)?, "size": config.len()
        },
        "layers": layer_descs
    }))?;
    let index = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": sha(&manifest)?, "size": manifest.len(),
            "platform": {"os": "linux", "architecture": tine_proto::api::go_arch()}
        }]
    }))?;
    let mut b = tar::Builder::new(Vec::new());
    let mut add = |name: &str, data: &[u8]| -> R {
        let mut h = header(tar::EntryType::Regular, data.len() as u64, 0o644);
        b.append_data(&mut h, name, data)?;
        Ok(())
    };
    add("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    add("index.json", &index)?;
    for blob in [&manifest, &config] {
        add(&format!("blobs/sha256/{}", &sha(blob)?[7..]), blob)?;
    }
    for (i, blob) in blobs.iter().enumerate() {
        if drop_blob != Some(i) {
            add(&format!("blobs/sha256/{}", &sha(blob)?[7..]), blob)?;
        }
    }
    Ok(b.into_inner()?)
}

/// A `docker save` archive of `layers` (uncompressed tars, as docker
/// writes them) under a config with `env` and `workdir`.
fn docker_archive(layers: &[Vec<u8>], env: &[&str], workdir: &str) -> R<Vec<u8>> {
    let diff_ids: Vec<String> = layers.iter().map(|l| sha(l)).collect::<R<_>>()?;
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": tine_proto::api::go_arch(),
        "os": "linux",
        "config": {"Env": env, "WorkingDir": workdir},
        "rootfs": {"type": "layers", "diff_ids": diff_ids}
    }))?;
    let config_name = format!("{}.json", &sha(&config)?[7..]);
    let layer_names: Vec<String> = (0..layers.len())
        .map(|i| format!("{i}/layer.tar"))
        .collect();
    let manifest = serde_json::to_vec(&serde_json::json!([{
        "Config": config_name, "RepoTags": ["app:latest"], "Layers": layer_names
    }]))?;
    let mut b = tar::Builder::new(Vec::new());
    let mut add = |name: &str, data: &[u8]| -> R {
        let mut h = header(tar::EntryType::Regular, data.len() as u64, 0o644);
        b.append_data(&mut h, name, data)?;
        Ok(())
    };
    add("manifest.json", &manifest)?;
    add(&config_name, &config)?;
    for (name, data) in layer_names.iter().zip(layers) {
        add(name, data)?;
    }
    Ok(b.into_inner()?)
}

/// The test's image: busybox and a file to whiteout, then the app's
/// folder and the whiteout.
fn app_layers() -> R<Vec<Vec<u8>>> {
    let busybox = std::fs::read(BUSYBOX).map_err(|e| {
        fail(format!(
            "cannot read {BUSYBOX} ({e}): install Debian's busybox-static (scripts/setup does)"
        ))
    })?;
    let base = layer(
        &[
            ("bin/busybox", busybox, 0o755),
            (
                "etc/passwd",
                b"root:x:0:0:root:/root:/bin/sh\n".to_vec(),
                0o644,
            ),
            ("etc/remove-me", b"lower layer".to_vec(), 0o644),
        ],
        &[("bin/sh", "busybox")],
    )?;
    let app = layer(
        &[
            ("srv/app/marker", b"from layer 2\n".to_vec(), 0o644),
            ("etc/.wh.remove-me", Vec::new(), 0o644),
        ],
        &[],
    )?;
    Ok(vec![base, app])
}

fn write_upload(dir: &Path, name: &str, bytes: &[u8]) -> R<PathBuf> {
    let path = dir.join(name);
    std::fs::write(&path, bytes)?;
    Ok(path)
}

async fn import(
    c: &TineClient,
    name: &str,
    file: &Path,
) -> Result<ImageInfo, tine_client::ApiError> {
    let reader = tokio::fs::File::open(file)
        .await
        .map_err(|e| tine_client::ApiError::Protocol(format!("open {}: {e}", file.display())))?;
    c.import_image(name, ImportFormat::Auto, reader, |e| {
        println!("import {name}: {e:?}")
    })
    .await
}

fn oci_import_boots_with_its_defaults() -> R {
    let d = Daemon::start("images", GROUP, None)?;
    let c = &d.client;
    let layers = app_layers()?;
    let good = oci_archive(
        &layers,
        &["PATH=/bin", "GREETING=hello from oci"],
        "/srv/app",
        None,
    )?;
    let good = write_upload(&d.dir, "app.tar", &good)?;
    let missing_layer = oci_archive(&layers, &["PATH=/bin"], "/", Some(1))?;
    let missing_layer = write_upload(&d.dir, "missing.tar", &missing_layer)?;
    let no_shell = oci_archive(
        &[layer(&[("etc/hostname", b"x\n".to_vec(), 0o644)], &[])?],
        &[],
        "/",
        None,
    )?;
    let no_shell = write_upload(&d.dir, "noshell.tar", &no_shell)?;
    let docker = docker_archive(&layers, &["PATH=/bin"], "/srv/app")?;
    let docker = write_upload(&d.dir, "docker.tar", &docker)?;
    let mut not_tar = std::fs::read(&good)?;
    not_tar.truncate(700);
    let not_tar = write_upload(&d.dir, "cut.tar", &not_tar)?;

    rt().block_on(async {
        // Malformed archives are refused, naming the problem, and leave
        // nothing behind.
        expect_err(
            import(c, "broken", &missing_layer).await,
            ErrorCode::BadRequest,
            "missing layer 2",
        )?;
        expect_err(
            import(c, "broken", &no_shell).await,
            ErrorCode::BadRequest,
            "no /bin/sh",
        )?;
        expect_err(
            import(c, "broken", &not_tar).await,
            ErrorCode::BadRequest,
            "not a valid tar archive",
        )?;
        let listed: Vec<_> = c
            .list_images()
            .await
            .or_fail()?
            .into_iter()
            .filter(|i| i.origin != ImageOrigin::BuiltIn)
            .collect();
        if !listed.is_empty() {
            return Err(fail(format!("refused imports were recorded: {listed:?}")));
        }

        // A `docker save` archive converts the same way.
        let from_docker = import(c, "app-docker", &docker).await.or_fail()?;
        assert_eq!(from_docker.format, ImageFormat::DockerArchive);
        assert_eq!(
            from_docker.exec_defaults.and_then(|d| d.workdir).as_deref(),
            Some("/srv/app")
        );
        c.delete_image("app-docker").await.or_fail()?;

        let image = import(c, "app", &good).await.or_fail()?;
        assert_eq!(image.format, ImageFormat::Oci);
        assert!(image.digest.as_deref().is_some_and(|d| d.starts_with("sha256:")));
        let defaults = image.exec_defaults.clone().ok_or_else(|| fail("no exec defaults"))?;
        assert_eq!(defaults.workdir.as_deref(), Some("/srv/app"));
        assert_eq!(c.image("app").await.or_fail()?, image);

        let vm = c
            .create_vm("app", &create_req(false), Wait::Agent, Some(BOOT))
            .await
            .map_err(|e| fail(format!("boot from the imported image: {e}\n{}", d.log_tail())))?;
        let h = &vm.hostname;
        // The image's env and workdir apply; its layers are stacked.
        let out = sh_ok(
            c,
            h,
            "echo \"$GREETING\"; pwd; cat marker; test -e /etc/remove-me && echo still-there || echo gone",
        )
        .await?;
        assert_eq!(out, "hello from oci\n/srv/app\nfrom layer 2\ngone\n");
        // The request's own values win.
        let mut o = ExecOptions::new("sh", ["-c", "echo \"$GREETING\"; pwd"]);
        o.env = vec!["GREETING=from the request".into()];
        o.cwd = Some("/".into());
        let out = c.exec_output(h, &o).await.or_fail()?;
        assert_eq!(String::from_utf8_lossy(&out.stdout), "from the request\n/\n");
        // PID 1 is the agent the daemon installed.
        let init = sh_ok(c, h, "readlink /sbin/init").await?;
        assert_eq!(init.trim(), "/usr/bin/tine-agent");

        expect_err(
            c.delete_image("app").await,
            ErrorCode::Conflict,
            &format!("image `app` is used by VM {h}"),
        )?;
        c.delete(h).await.or_fail()?;
        c.delete_image("app").await.or_fail()?;
        expect_err(c.image("app").await, ErrorCode::NotFound, "no image called `app`")?;
        Ok(())
    })
}

fn main() {
    bed_main(
        "image test",
        vec![Trial::test(
            "oci_import_boots_with_its_defaults",
            oci_import_boots_with_its_defaults,
        )],
    );
}
