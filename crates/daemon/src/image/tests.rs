//! Image archives built in the test: OCI layouts and docker archives, good
//! and broken.

use std::io::Write as _;

use super::*;

/// A GNU header with owner root and a fixed time (as real tars have).
pub(crate) fn test_header() -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(1_700_000_000);
    h
}

/// A tar of `(name, bytes)` files (directories made implicitly by names).
pub(crate) fn tar_files(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, data) in files {
        let mut h = test_header();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_size(data.len() as u64);
        h.set_mode(if name.contains("bin/") { 0o755 } else { 0o644 });
        b.append_data(&mut h, name, *data).expect("append");
    }
    b.into_inner().expect("tar")
}

fn sha(bytes: &[u8]) -> String {
    oci::sha256_reader(bytes).expect("hash")
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).expect("gzip");
    e.finish().expect("gzip")
}

fn config_json(diff_ids: &[String]) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "architecture": tine_proto::api::go_arch(),
        "os": "linux",
        "config": {
            "Env": ["PATH=/usr/bin:/bin", "GREETING=hello"],
            "WorkingDir": "/srv",
            "User": "1000",
            "Cmd": ["/bin/sh"]
        },
        "rootfs": {"type": "layers", "diff_ids": diff_ids}
    }))
    .expect("config")
}

/// An OCI layout tar of `layers` (gzipped), and the layers' blobs' digests.
pub(crate) fn oci_archive(layers: &[Vec<u8>], layer_media_type: &str) -> Vec<u8> {
    let blobs: Vec<Vec<u8>> = layers.iter().map(|l| gzip(l)).collect();
    let diff_ids: Vec<String> = layers.iter().map(|l| sha(l)).collect();
    let config = config_json(&diff_ids);
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": sha(&config), "size": config.len()
        },
        "layers": blobs.iter().map(|b| serde_json::json!({
            "mediaType": layer_media_type, "digest": sha(b), "size": b.len()
        })).collect::<Vec<_>>()
    }))
    .expect("manifest");
    let index = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": sha(&manifest), "size": manifest.len()
        }]
    }))
    .expect("index");
    let mut files: Vec<(String, Vec<u8>)> = vec![
        (
            "oci-layout".into(),
            br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec(),
        ),
        ("index.json".into(), index),
    ];
    for blob in [manifest, config].into_iter().chain(blobs) {
        let name = format!("blobs/sha256/{}", &sha(&blob)["sha256:".len()..]);
        files.push((name, blob));
    }
    let refs: Vec<(&str, &[u8])> = files
        .iter()
        .map(|(n, d)| (n.as_str(), d.as_slice()))
        .collect();
    tar_files(&refs)
}

/// A `docker save` archive of `layers` (uncompressed).
pub(crate) fn docker_archive(layers: &[Vec<u8>]) -> Vec<u8> {
    let diff_ids: Vec<String> = layers.iter().map(|l| sha(l)).collect();
    let config = config_json(&diff_ids);
    let config_name = format!("{}.json", &sha(&config)["sha256:".len()..]);
    let layer_names: Vec<String> = (0..layers.len())
        .map(|i| format!("l{i}/layer.tar"))
        .collect();
    let manifest = serde_json::to_vec(&serde_json::json!([{
        "Config": config_name, "RepoTags": ["test:latest"], "Layers": layer_names
    }]))
    .expect("manifest");
    let mut files: Vec<(String, Vec<u8>)> =
        vec![("manifest.json".into(), manifest), (config_name, config)];
    for (n, l) in layer_names.iter().zip(layers) {
        files.push((n.clone(), l.clone()));
    }
    let refs: Vec<(&str, &[u8])> = files
        .iter()
        .map(|(n, d)| (n.as_str(), d.as_slice()))
        .collect();
    tar_files(&refs)
}

fn base_layers() -> Vec<Vec<u8>> {
    vec![
        tar_files(&[
            ("bin/sh", b"#!shell"),
            ("etc/old", b"old"),
            ("srv/keep", b"k"),
        ]),
        tar_files(&[("etc/.wh.old", b""), ("etc/new", b"new")]),
    ]
}

fn unpacked(archive: &[u8]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tmp");
    let upload = dir.path().join("upload.tar");
    std::fs::write(&upload, archive).expect("write");
    unpack_archive(&upload, &dir.path().join("archive")).expect("unpack");
    dir
}

fn apply_all(source: &oci::ImageSource, root: &Path) -> Result<(), ImageError> {
    for layer in &source.layers {
        oci::verify_layer(layer)?;
        let path = layer.path.clone();
        let open = move || oci::open_layer(&path);
        layers::apply_layer(root, &layer.label, &open)?;
    }
    Ok(())
}

#[test]
fn oci_layouts_and_docker_archives_read_the_same() {
    for (archive, format) in [
        (
            oci_archive(
                &base_layers(),
                "application/vnd.oci.image.layer.v1.tar+gzip",
            ),
            ImageFormat::Oci,
        ),
        (docker_archive(&base_layers()), ImageFormat::DockerArchive),
    ] {
        let dir = unpacked(&archive);
        let source = oci::read_image(&dir.path().join("archive")).expect("read");
        assert_eq!(source.format, format);
        assert_eq!(source.layers.len(), 2);
        assert_eq!(source.defaults.workdir.as_deref(), Some("/srv"));
        assert_eq!(source.defaults.user.as_deref(), Some("1000"));
        assert!(source.defaults.env.contains(&"GREETING=hello".to_owned()));
        assert_eq!(source.defaults.cmd, vec!["/bin/sh".to_owned()]);
        let root = dir.path().join("root");
        std::fs::create_dir(&root).expect("root");
        apply_all(&source, &root).expect("apply");
        assert!(!root.join("etc/old").exists(), "{format}: whiteout applied");
        assert!(root.join("etc/new").is_file());
        assert!(root.join("bin/sh").is_file());
    }
}

#[test]
fn a_missing_layer_is_named() {
    let archive = docker_archive(&base_layers());
    let dir = unpacked(&archive);
    std::fs::remove_file(dir.path().join("archive/l1/layer.tar")).expect("rm");
    let err = oci::read_image(&dir.path().join("archive")).expect_err("missing");
    assert_eq!(
        err.to_string(),
        "missing layer 2 (l1/layer.tar): l1/layer.tar is not in the archive"
    );
}

#[test]
fn a_changed_layer_fails_its_digest() {
    let archive = docker_archive(&base_layers());
    let dir = unpacked(&archive);
    std::fs::write(
        dir.path().join("archive/l0/layer.tar"),
        tar_files(&[("bin/sh", b"tampered")]),
    )
    .expect("tamper");
    let source = oci::read_image(&dir.path().join("archive")).expect("read");
    let root = dir.path().join("root");
    std::fs::create_dir(&root).expect("root");
    let err = apply_all(&source, &root).expect_err("mismatch");
    assert!(
        err.to_string()
            .starts_with("digest mismatch for layer 1 (l0/layer.tar): expected sha256:"),
        "{err}"
    );
    // An OCI blob whose bytes changed is caught before it is read.
    let archive = oci_archive(
        &base_layers(),
        "application/vnd.oci.image.layer.v1.tar+gzip",
    );
    let dir = unpacked(&archive);
    let blobs = dir.path().join("archive/blobs/sha256");
    let source = oci::read_image(&dir.path().join("archive")).expect("read");
    std::fs::write(&source.layers[0].path, gzip(b"other")).expect("tamper");
    let err = oci::verify_layer(&source.layers[0]).expect_err("mismatch");
    assert!(
        err.to_string().contains("digest mismatch for layer 1"),
        "{err}"
    );
    assert!(blobs.is_dir());
}

#[test]
fn unknown_layer_media_types_are_named() {
    let archive = oci_archive(&base_layers(), "application/x-squashfs");
    let dir = unpacked(&archive);
    let err = oci::read_image(&dir.path().join("archive")).expect_err("media type");
    assert_eq!(
        err.to_string(),
        "layer 1 has the media type application/x-squashfs, which tine cannot import"
    );
}

#[test]
fn broken_uploads_are_refused_by_name() {
    let dir = tempfile::tempdir().expect("tmp");
    let upload = dir.path().join("upload");
    // Not a tar, disk or anything else.
    std::fs::write(&upload, vec![0x42; 4096]).expect("write");
    let err = detect(&upload).expect_err("garbage");
    assert!(err.to_string().contains("neither a qcow2 image"), "{err}");
    // A tar cut short in its second entry.
    let mut archive = docker_archive(&base_layers());
    archive.truncate(1024 + 300);
    std::fs::write(&upload, &archive).expect("write");
    let err = unpack_archive(&upload, &dir.path().join("a")).expect_err("short");
    assert!(err.to_string().contains("not a valid tar archive"), "{err}");
    // A tar that is no image.
    std::fs::write(&upload, tar_files(&[("hello.txt", b"hi")])).expect("write");
    unpack_archive(&upload, &dir.path().join("b")).expect("unpack");
    let err = oci::read_image(&dir.path().join("b")).expect_err("no image");
    assert!(
        err.to_string()
            .starts_with("not an OCI image or docker archive"),
        "{err}"
    );
}

#[test]
fn names_are_checked_and_built_ins_reserved() {
    check_name("alpine-3.20").expect("ok");
    assert!(check_name("min")
        .expect_err("built-in")
        .to_string()
        .contains("built-in"));
    assert!(check_name("debian").is_err());
    assert!(check_name("../x").is_err());
    assert!(check_name("").is_err());
    assert!(check_name("Upper").is_err());
}

#[test]
fn an_oci_image_converts_to_a_bootable_ext4() {
    // Needs root (file owners) and mkfs.ext4, as the daemon does.
    let dir = tempfile::tempdir().expect("tmp");
    let upload = dir.path().join("upload.tar");
    std::fs::write(
        &upload,
        oci_archive(
            &base_layers(),
            "application/vnd.oci.image.layer.v1.tar+gzip",
        ),
    )
    .expect("write");
    let agent = dir.path().join("agent");
    std::fs::write(&agent, b"\x7fELF agent").expect("agent");
    let work = dir.path().join("work");
    std::fs::create_dir(&work).expect("work");
    let mut events = Vec::new();
    let agent_path = agent.clone();
    let converted = convert(
        &upload,
        ImportFormat::Auto,
        &work,
        &move || Ok(agent_path.clone()),
        &mut |e| events.push(e),
    )
    .expect("convert");
    assert_eq!(converted.format, ImageFormat::Oci);
    assert_eq!(
        converted
            .exec_defaults
            .as_ref()
            .and_then(|d| d.workdir.as_deref()),
        Some("/srv")
    );
    let mut head = vec![0u8; 2048];
    std::fs::File::open(&converted.base)
        .and_then(|mut f| f.read_exact(&mut head))
        .expect("read");
    assert!(is_ext4(&head));
    let stages: Vec<ImportStage> = events
        .iter()
        .filter_map(|e| match e {
            ImportEvent::Progress { stage, .. } => Some(*stage),
            _ => None,
        })
        .collect();
    assert_eq!(
        stages,
        [
            ImportStage::Unpack,
            ImportStage::Layer,
            ImportStage::Layer,
            ImportStage::Agent,
            ImportStage::Filesystem
        ]
    );
    // debugfs reads the agent and /sbin/init back out of the file system.
    let debugfs = rootfs::find_tool("debugfs").expect("debugfs");
    let out = std::process::Command::new(debugfs)
        .args(["-R", "stat /sbin/init"])
        .arg(&converted.base)
        .output()
        .expect("debugfs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("Fast link dest: \"/usr/bin/tine-agent\""),
        "{text}"
    );
}

#[test]
fn an_image_without_a_shell_is_refused() {
    let dir = tempfile::tempdir().expect("tmp");
    let upload = dir.path().join("upload.tar");
    let layers = vec![tar_files(&[("etc/hostname", b"x")])];
    std::fs::write(&upload, docker_archive(&layers)).expect("write");
    let work = dir.path().join("work");
    std::fs::create_dir(&work).expect("work");
    let err = convert(
        &upload,
        ImportFormat::DockerArchive,
        &work,
        &|| Ok(PathBuf::from("/bin/true")),
        &mut |_| {},
    )
    .expect_err("no shell");
    assert!(err.to_string().contains("no /bin/sh"), "{err}");
    assert!(err.is_bad_input());
}

#[test]
fn a_format_that_does_not_match_the_upload_is_named() {
    let dir = tempfile::tempdir().expect("tmp");
    let upload = dir.path().join("upload.tar");
    std::fs::write(&upload, docker_archive(&base_layers())).expect("write");
    let work = dir.path().join("work");
    std::fs::create_dir(&work).expect("work");
    let agent = || Ok(PathBuf::from("/bin/true"));
    let err = convert(&upload, ImportFormat::Oci, &work, &agent, &mut |_| {}).expect_err("kind");
    assert_eq!(
        err.to_string(),
        "the upload was said to be oci but is docker-archive"
    );
    let err = convert(&upload, ImportFormat::Qcow2, &work, &agent, &mut |_| {}).expect_err("qcow2");
    assert_eq!(
        err.to_string(),
        "the upload was said to be qcow2 but looks like a tar"
    );
}
