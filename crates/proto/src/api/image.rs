//! Images: `GET /images`, `GET /images/{name}`, `POST /images` (an import,
//! answered as NDJSON [`ImportEvent`]s) and `DELETE /images/{name}`.

use serde::{Deserialize, Serialize};

use super::{DeleteStatus, ErrorBody, UnknownValue};

wire_enum! {
    /// What an image was made from.
    ImageFormat, "format" {
        /// A raw disk image holding an ext4 file system (the built-in
        /// images are these).
        Raw = "raw",
        /// A qcow2 disk image (without a backing file).
        Qcow2 = "qcow2",
        /// An OCI image layout (a directory or a tar of one), converted to
        /// an ext4 base with the agent installed.
        Oci = "oci",
        /// A `docker save` archive, converted like `oci`.
        DockerArchive = "docker-archive",
    }
}

wire_enum! {
    /// What `POST /images` is told the upload is (`format=`).
    #[derive(Default)]
    ImportFormat, "format" {
        /// Found from the content: the qcow2 magic, an ext4 superblock, or
        /// a tar holding `oci-layout` or `manifest.json`.
        #[default]
        Auto = "auto",
        /// A raw disk image holding ext4.
        Raw = "raw",
        /// A qcow2 disk image.
        Qcow2 = "qcow2",
        /// A tar of an OCI image layout.
        Oci = "oci",
        /// A `docker save` archive.
        DockerArchive = "docker-archive",
    }
}

wire_enum! {
    /// Where an image came from.
    ImageOrigin, "origin" {
        /// A built-in image (`min`, `debian`) found in the project's build
        /// cache, `<data_dir>/images/<name>.img` or `$TINE_IMAGE_<NAME>`
        /// on its first use.
        BuiltIn = "built-in",
        /// A file a host group's `image:` names by path.
        File = "file",
        /// Uploaded with `POST /images` (`tine image import`).
        Imported = "imported",
    }
}

wire_enum! {
    /// A step of an import, in the order they happen.
    ImportStage, "stage" {
        /// The upload was received (`done` bytes).
        Received = "received",
        /// The archive is unpacked and its manifest read.
        Unpack = "unpack",
        /// A layer is applied (`done` of `total` layers).
        Layer = "layer",
        /// The agent is installed as `/sbin/init`.
        Agent = "agent",
        /// The ext4 file system is written.
        Filesystem = "filesystem",
        /// The base file is hashed and checked.
        Verify = "verify",
    }
}

/// The defaults an OCI image's config gives processes: `exec` uses them
/// when the request does not say otherwise. The agent reads them from
/// `/etc/tine/image.json` in the guest.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageExecDefaults {
    /// `KEY=VALUE` entries, under the request's own environment.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// The user (`name`, `uid`, `name:group` or `uid:gid`) when the request
    /// gives none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// The working directory when the request gives none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    /// The image's entrypoint (for information: nothing runs it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub entrypoint: Vec<String>,
    /// The image's command (for information: nothing runs it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cmd: Vec<String>,
}

/// An image: an immutable base VM disks are made over.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageInfo {
    /// Its name (what a host group's `image:` names).
    pub name: String,
    /// `sha256:<hex>` of the base file; absent for a base recorded before
    /// images were hashed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// What it was made from.
    pub format: ImageFormat,
    /// Where it came from.
    pub origin: ImageOrigin,
    /// Bytes of the base file (its virtual size for qcow2).
    pub size: u64,
    /// When the base was made (RFC 3339).
    pub created_at: String,
    /// The file it was copied from, or the upload's description.
    pub source: String,
    /// An OCI image's process defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exec_defaults: Option<ImageExecDefaults>,
}

/// One line of the NDJSON answer of `POST /images`: progress events, then
/// exactly one `done` or `error`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum ImportEvent {
    /// A step started or advanced.
    Progress {
        /// The step.
        stage: ImportStage,
        /// Units done (bytes for `received`, layers for `layer`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        done: Option<u64>,
        /// Units in all, when known.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        total: Option<u64>,
        /// For people.
        message: String,
    },
    /// The image is recorded.
    Done {
        /// The new image.
        image: ImageInfo,
    },
    /// The import failed and left nothing behind.
    Error(ErrorBody),
}

/// `DELETE /images/{name}` response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeleteImageResponse {
    /// The image.
    pub name: String,
    /// Always `deleted`.
    pub status: DeleteStatus,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::ErrorCode;

    #[test]
    fn import_events_are_tagged_lines() {
        let e = ImportEvent::Progress {
            stage: ImportStage::Layer,
            done: Some(1),
            total: Some(2),
            message: "layer 1 of 2".into(),
        };
        let line = serde_json::to_string(&e).expect("json");
        assert_eq!(
            line,
            r#"{"event":"progress","stage":"layer","done":1,"total":2,"message":"layer 1 of 2"}"#
        );
        let err = ImportEvent::Error(ErrorBody {
            error: "bad tar".into(),
            code: ErrorCode::BadRequest,
        });
        let line = serde_json::to_string(&err).expect("json");
        assert_eq!(
            line,
            r#"{"event":"error","error":"bad tar","code":"bad_request"}"#
        );
        assert_eq!(
            serde_json::from_str::<ImportEvent>(&line).expect("back"),
            err
        );
    }

    #[test]
    fn formats_name_the_allowed_values() {
        let e = "tgz".parse::<ImportFormat>().expect_err("unknown");
        assert_eq!(
            e.to_string(),
            "format `tgz` is not one of auto, raw, qcow2, oci, docker-archive"
        );
        assert_eq!(
            "docker-archive".parse::<ImageFormat>(),
            Ok(ImageFormat::DockerArchive)
        );
    }
}
