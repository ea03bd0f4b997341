//! The process defaults of an imported OCI image: its config's `Env`,
//! `User` and `WorkingDir`, written by the daemon to `/etc/tine/image.json`
//! when it converted the image. Exec, background exec and the shell use
//! them where the request says nothing: the image's variables sit under
//! the request's own, its user and directory apply when the request names
//! none. A guest without the file (the built-in images) has no defaults.

use std::path::Path;

use tine_proto::agent::{ErrorCode, ProcessOptions};
use tine_proto::api::ImageExecDefaults;

use crate::error::OpError;

/// Where the daemon writes the defaults in the guest.
pub(crate) const DEFAULTS_FILE: &str = "/etc/tine/image.json";

/// The defaults in `path`; none when the file is missing or unreadable
/// (logged: a broken file must not stop every exec).
pub(crate) fn read(path: &Path) -> ImageExecDefaults {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            tracing::warn!("ignoring {}: {e}", path.display());
            ImageExecDefaults::default()
        }),
        Err(_) => ImageExecDefaults::default(),
    }
}

/// `options` with the image's defaults filled in; `etc` holds the
/// `passwd` and `group` files a user or group name is looked up in.
pub(crate) fn apply(
    options: &ProcessOptions,
    defaults: &ImageExecDefaults,
    etc: &Path,
) -> Result<ProcessOptions, OpError> {
    let mut out = options.clone();
    for entry in &defaults.env {
        if let Some((key, value)) = entry.split_once('=') {
            if !key.is_empty() && !out.env.contains_key(key) {
                out.env.insert(key.to_owned(), value.to_owned());
            }
        }
    }
    if out.cwd.is_none() {
        out.cwd = defaults.workdir.clone();
    }
    if let (None, None, Some(user)) = (out.uid, out.gid, &defaults.user) {
        let (user_part, group_part) = match user.split_once(':') {
            Some((u, g)) => (u, Some(g)),
            None => (user.as_str(), None),
        };
        out.uid = Some(lookup_id(user_part, &etc.join("passwd"), "user")?);
        if let Some(g) = group_part {
            out.gid = Some(lookup_id(g, &etc.join("group"), "group")?);
        }
    }
    Ok(out)
}

/// A number, or the id of the name in an `/etc/passwd`-like file (name in
/// the first field, id in the third).
fn lookup_id(name: &str, file: &Path, what: &str) -> Result<u32, OpError> {
    if let Ok(id) = name.parse::<u32>() {
        return Ok(id);
    }
    let text = std::fs::read_to_string(file).unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            (fields.len() >= 3 && fields[0] == name).then(|| fields[2].parse::<u32>().ok())?
        })
        .next()
        .ok_or_else(|| {
            OpError::new(
                ErrorCode::NotFound,
                format!(
                    "the image's default {what} `{name}` is not in {}",
                    file.display()
                ),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> ImageExecDefaults {
        ImageExecDefaults {
            env: vec!["PATH=/opt/bin:/bin".into(), "MODE=image".into()],
            user: Some("app:staff".into()),
            workdir: Some("/srv".into()),
            ..Default::default()
        }
    }

    fn etc() -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tmp");
        std::fs::write(
            dir.path().join("passwd"),
            "root:x:0:0::/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n",
        )
        .expect("passwd");
        std::fs::write(dir.path().join("group"), "root:x:0:\nstaff:x:50:\n").expect("group");
        dir
    }

    #[test]
    fn defaults_fill_what_the_request_leaves_out() {
        let etc = etc();
        let out = apply(&ProcessOptions::default(), &defaults(), etc.path()).expect("apply");
        assert_eq!(out.env.get("MODE").map(String::as_str), Some("image"));
        assert_eq!(
            out.env.get("PATH").map(String::as_str),
            Some("/opt/bin:/bin")
        );
        assert_eq!(out.cwd.as_deref(), Some("/srv"));
        assert_eq!((out.uid, out.gid), (Some(1000), Some(50)));
    }

    #[test]
    fn the_request_wins() {
        let etc = etc();
        let mut req = ProcessOptions::default();
        req.env.insert("MODE".into(), "request".into());
        req.cwd = Some("/tmp".into());
        req.uid = Some(0);
        let out = apply(&req, &defaults(), etc.path()).expect("apply");
        assert_eq!(out.env.get("MODE").map(String::as_str), Some("request"));
        assert_eq!(out.cwd.as_deref(), Some("/tmp"));
        assert_eq!((out.uid, out.gid), (Some(0), None));
    }

    #[test]
    fn unknown_users_are_named_and_missing_files_mean_no_defaults() {
        let etc = etc();
        let d = ImageExecDefaults {
            user: Some("nobody-here".into()),
            ..Default::default()
        };
        let err = apply(&ProcessOptions::default(), &d, etc.path()).expect_err("unknown");
        assert!(
            err.to_string().contains("default user `nobody-here`"),
            "{err}"
        );
        assert_eq!(
            read(&etc.path().join("none.json")),
            ImageExecDefaults::default()
        );
        std::fs::write(etc.path().join("bad.json"), "{not json").expect("bad");
        assert_eq!(
            read(&etc.path().join("bad.json")),
            ImageExecDefaults::default()
        );
    }
}
