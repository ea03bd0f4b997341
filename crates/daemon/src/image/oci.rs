//! Reading an unpacked OCI image layout (`oci-layout`, `index.json`,
//! `blobs/sha256/...`) or `docker save` archive (`manifest.json`, a config
//! and layer tars): which layers to apply, in order, each checked against
//! its digest, and the config's process defaults.

use std::io::{self, Read};
use std::path::{Path, PathBuf};

use oci_spec::image::{Descriptor, ImageConfiguration, ImageIndex, ImageManifest, MediaType};
use serde::Deserialize;
use sha2::{Digest as _, Sha256};
use tine_proto::api::{ImageExecDefaults, ImageFormat};

use super::layers::{clean_relative, resolve_in_root};

/// Errors reading an image's manifest, config or layers.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    /// Neither an OCI layout nor a `docker save` archive.
    #[error(
        "not an OCI image or docker archive: the archive has no `oci-layout` and `index.json`, \
         nor a `manifest.json`, at its top"
    )]
    NotAnImage,
    /// A manifest, index or config does not parse.
    #[error("malformed {what}: {detail}")]
    Malformed {
        /// Which document.
        what: String,
        /// Why.
        detail: String,
    },
    /// A blob or layer the manifest names is not in the archive.
    #[error("missing {what}: {path} is not in the archive")]
    Missing {
        /// What it is (`layer 2 (sha256:...)`).
        what: String,
        /// Where it should be.
        path: String,
    },
    /// A blob's content does not match its digest.
    #[error("digest mismatch for {what}: expected {expected}, the content hashes to {actual}")]
    DigestMismatch {
        /// What it is.
        what: String,
        /// The digest the manifest or config names.
        expected: String,
        /// The content's.
        actual: String,
    },
    /// A media type this importer does not handle.
    #[error("{what} has the media type {media_type}, which tine cannot import")]
    UnknownMediaType {
        /// What it is.
        what: String,
        /// Its media type.
        media_type: String,
    },
    /// No manifest for this machine.
    #[error("the image has no manifest for linux/{host}; it offers {offered}")]
    NoPlatform {
        /// This machine's architecture.
        host: &'static str,
        /// What the index offers.
        offered: String,
    },
    /// Reading the archive failed.
    #[error("cannot read {what}")]
    Io {
        /// What was read.
        what: String,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// One layer to apply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layer {
    /// Where its blob is.
    pub path: PathBuf,
    /// `layer N (sha256:...)`, for messages.
    pub label: String,
    /// The `sha256:<hex>` its content must hash to.
    pub digest: String,
    /// Whether `digest` is of the blob as stored (OCI) or of the
    /// uncompressed tar (a docker archive's diff ID).
    pub digest_of: DigestOf,
}

/// What a layer's digest covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DigestOf {
    /// The blob as stored (compressed or not).
    Blob,
    /// The uncompressed tar.
    Uncompressed,
}

/// What an image archive holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSource {
    /// `oci` or `docker-archive`.
    pub format: ImageFormat,
    /// Its layers, bottom first.
    pub layers: Vec<Layer>,
    /// The config's process defaults.
    pub defaults: ImageExecDefaults,
}

/// Reads the image in the unpacked archive `dir`.
pub fn read_image(dir: &Path) -> Result<ImageSource, OciError> {
    if dir.join("oci-layout").is_file() && dir.join("index.json").is_file() {
        read_oci_layout(dir)
    } else if dir.join("manifest.json").is_file() {
        read_docker_archive(dir)
    } else {
        Err(OciError::NotAnImage)
    }
}

fn malformed(what: impl Into<String>, e: impl std::fmt::Display) -> OciError {
    OciError::Malformed {
        what: what.into(),
        detail: e.to_string(),
    }
}

/// The file `rel` of the archive, resolved inside it (a link in a docker
/// archive never leads out), or missing.
fn archive_file(dir: &Path, rel: &str, what: &str) -> Result<PathBuf, OciError> {
    let missing = || OciError::Missing {
        what: what.to_owned(),
        path: rel.to_owned(),
    };
    let clean = clean_relative(Path::new(rel)).ok_or_else(missing)?;
    let path = resolve_in_root(dir, &clean, true).map_err(|_| missing())?;
    if path.is_file() {
        Ok(path)
    } else {
        Err(missing())
    }
}

/// The blob a descriptor names, checked against its digest.
fn blob(dir: &Path, d: &Descriptor, what: &str) -> Result<PathBuf, OciError> {
    let digest = d.digest().to_string();
    let hex = sha256_hex_of_digest(&digest).ok_or_else(|| {
        malformed(
            what,
            format!("the digest {digest} is not sha256:<64 hex digits>"),
        )
    })?;
    let path = archive_file(
        dir,
        &format!("blobs/sha256/{hex}"),
        &format!("{what} ({digest})"),
    )?;
    let actual = sha256_file(&path).map_err(|source| OciError::Io {
        what: format!("{what} ({digest})"),
        source,
    })?;
    if actual != digest {
        return Err(OciError::DigestMismatch {
            what: what.to_owned(),
            expected: digest,
            actual,
        });
    }
    Ok(path)
}

fn sha256_hex_of_digest(digest: &str) -> Option<&str> {
    let hex = digest.strip_prefix("sha256:")?;
    (hex.len() == 64
        && hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
    .then_some(hex)
}

/// `sha256:<hex>` of everything `reader` yields.
pub fn sha256_reader(mut reader: impl Read) -> io::Result<String> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        hasher.update(&buf[..n]);
    }
    let hex: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Ok(format!("sha256:{hex}"))
}

/// `sha256:<hex>` of a file.
pub fn sha256_file(path: &Path) -> io::Result<String> {
    sha256_reader(std::fs::File::open(path)?)
}

fn read_oci_layout(dir: &Path) -> Result<ImageSource, OciError> {
    let index =
        ImageIndex::from_file(dir.join("index.json")).map_err(|e| malformed("index.json", e))?;
    let manifest_desc = pick_manifest(index.manifests(), "index.json")?;
    let manifest_desc = match manifest_desc.media_type() {
        MediaType::ImageIndex => {
            // A nested index (as `docker save` of a multi-platform image
            // writes): one more level.
            let path = blob(dir, &manifest_desc, "the nested image index")?;
            let nested =
                ImageIndex::from_file(&path).map_err(|e| malformed("the nested image index", e))?;
            pick_manifest(nested.manifests(), "the nested image index")?
        }
        _ => manifest_desc,
    };
    check_manifest_type(manifest_desc.media_type())?;
    let path = blob(dir, &manifest_desc, "the image manifest")?;
    let manifest =
        ImageManifest::from_file(&path).map_err(|e| malformed("the image manifest", e))?;
    let config_path = blob(dir, manifest.config(), "the image config")?;
    let config = read_config(&config_path)?;
    let mut layers = Vec::new();
    for (i, d) in manifest.layers().iter().enumerate() {
        let what = format!("layer {}", i + 1);
        check_layer_type(d.media_type(), &what)?;
        let digest = d.digest().to_string();
        let hex = sha256_hex_of_digest(&digest)
            .ok_or_else(|| malformed(&what, format!("the digest {digest} is not sha256")))?;
        let path = archive_file(
            dir,
            &format!("blobs/sha256/{hex}"),
            &format!("{what} ({digest})"),
        )?;
        layers.push(Layer {
            path,
            label: format!("{what} ({digest})"),
            digest,
            digest_of: DigestOf::Blob,
        });
    }
    Ok(ImageSource {
        format: ImageFormat::Oci,
        layers,
        defaults: exec_defaults(&config),
    })
}

/// The manifest for linux on this machine's architecture (or the only one,
/// when it names no platform).
fn pick_manifest(list: &[Descriptor], what: &str) -> Result<Descriptor, OciError> {
    let host = tine_proto::api::go_arch();
    let fits = |d: &&Descriptor| match d.platform() {
        Some(p) => p.os().to_string() == "linux" && p.architecture().to_string() == host,
        None => true,
    };
    // Attestation manifests (buildx) name the platform `unknown/unknown`.
    if let Some(d) = list.iter().find(fits) {
        return Ok(d.clone());
    }
    if list.is_empty() {
        return Err(malformed(what, "it lists no manifests"));
    }
    let offered: Vec<String> = list
        .iter()
        .filter_map(|d| d.platform().as_ref())
        .map(|p| format!("{}/{}", p.os(), p.architecture()))
        .collect();
    Err(OciError::NoPlatform {
        host,
        offered: offered.join(", "),
    })
}

fn check_manifest_type(t: &MediaType) -> Result<(), OciError> {
    match t {
        MediaType::ImageManifest => Ok(()),
        MediaType::Other(s) if s == "application/vnd.docker.distribution.manifest.v2+json" => {
            Ok(())
        }
        other => Err(OciError::UnknownMediaType {
            what: "the image manifest".into(),
            media_type: other.to_string(),
        }),
    }
}

fn check_layer_type(t: &MediaType, what: &str) -> Result<(), OciError> {
    match t {
        MediaType::ImageLayer
        | MediaType::ImageLayerGzip
        | MediaType::ImageLayerNonDistributable
        | MediaType::ImageLayerNonDistributableGzip => Ok(()),
        MediaType::Other(s)
            if s == "application/vnd.docker.image.rootfs.diff.tar.gzip"
                || s == "application/vnd.docker.image.rootfs.diff.tar" =>
        {
            Ok(())
        }
        other => Err(OciError::UnknownMediaType {
            what: what.to_owned(),
            media_type: other.to_string(),
        }),
    }
}

/// One image of a `docker save` archive's `manifest.json`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerManifest {
    /// The config file, relative to the archive's top.
    config: String,
    /// The layer tars, bottom first.
    layers: Vec<String>,
}

fn read_docker_archive(dir: &Path) -> Result<ImageSource, OciError> {
    let text = std::fs::read(dir.join("manifest.json")).map_err(|source| OciError::Io {
        what: "manifest.json".into(),
        source,
    })?;
    let images: Vec<DockerManifest> =
        serde_json::from_slice(&text).map_err(|e| malformed("manifest.json", e))?;
    let image = match images.as_slice() {
        [one] => one,
        [] => return Err(malformed("manifest.json", "it lists no images")),
        more => {
            return Err(malformed(
                "manifest.json",
                format!("it lists {} images; save one image per archive", more.len()),
            ))
        }
    };
    let config_path = archive_file(dir, &image.config, "the image config")?;
    let config = read_config(&config_path)?;
    let diff_ids = config.rootfs().diff_ids();
    if diff_ids.len() != image.layers.len() {
        return Err(malformed(
            "the image config",
            format!(
                "it names {} layer digests (rootfs.diff_ids) but manifest.json lists {} layers",
                diff_ids.len(),
                image.layers.len()
            ),
        ));
    }
    let mut layers = Vec::new();
    for (i, (rel, digest)) in image.layers.iter().zip(diff_ids).enumerate() {
        let what = format!("layer {} ({rel})", i + 1);
        let path = archive_file(dir, rel, &what)?;
        layers.push(Layer {
            path,
            label: what,
            digest: digest.clone(),
            digest_of: DigestOf::Uncompressed,
        });
    }
    Ok(ImageSource {
        format: ImageFormat::DockerArchive,
        layers,
        defaults: exec_defaults(&config),
    })
}

fn read_config(path: &Path) -> Result<ImageConfiguration, OciError> {
    let config =
        ImageConfiguration::from_file(path).map_err(|e| malformed("the image config", e))?;
    let os = config.os().to_string();
    let arch = config.architecture().to_string();
    let host = tine_proto::api::go_arch();
    if os != "linux" || arch != host {
        return Err(OciError::NoPlatform {
            host,
            offered: format!("{os}/{arch}"),
        });
    }
    Ok(config)
}

fn exec_defaults(config: &ImageConfiguration) -> ImageExecDefaults {
    let Some(c) = config.config() else {
        return ImageExecDefaults::default();
    };
    ImageExecDefaults {
        env: c.env().clone().unwrap_or_default(),
        user: c.user().clone().filter(|u| !u.is_empty()),
        workdir: c.working_dir().clone().filter(|w| !w.is_empty()),
        entrypoint: c.entrypoint().clone().unwrap_or_default(),
        cmd: c.cmd().clone().unwrap_or_default(),
    }
}

/// Opens a layer's tar, uncompressing gzip; zstd is refused by name.
pub fn open_layer(path: &Path) -> io::Result<Box<dyn Read>> {
    let mut file = std::fs::File::open(path)?;
    let mut magic = [0u8; 4];
    let mut got = 0;
    while got < magic.len() {
        match file.read(&mut magic[got..])? {
            0 => break,
            n => got += n,
        }
    }
    let head = io::Cursor::new(magic[..got].to_vec());
    let whole = head.chain(file);
    match magic {
        [0x1f, 0x8b, ..] => Ok(Box::new(flate2::read::MultiGzDecoder::new(whole))),
        [0x28, 0xb5, 0x2f, 0xfd] => Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "zstd-compressed layers are not supported (re-save the image with gzip or no compression)",
        )),
        _ => Ok(Box::new(whole)),
    }
}

/// Checks a layer's content against its digest.
pub fn verify_layer(layer: &Layer) -> Result<(), OciError> {
    let io_err = |source| OciError::Io {
        what: layer.label.clone(),
        source,
    };
    let actual = match layer.digest_of {
        DigestOf::Blob => sha256_file(&layer.path).map_err(io_err)?,
        DigestOf::Uncompressed => {
            sha256_reader(open_layer(&layer.path).map_err(io_err)?).map_err(io_err)?
        }
    };
    if actual != layer.digest {
        return Err(OciError::DigestMismatch {
            what: layer.label.clone(),
            expected: layer.digest.clone(),
            actual,
        });
    }
    Ok(())
}
