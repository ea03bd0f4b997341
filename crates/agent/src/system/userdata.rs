//! Userdata: a script that runs once, on the first boot of a VM.
//!
//! The script is [`USERDATA`] (the daemon writes it into the image before
//! the first boot). It runs with `/` as working directory, its stdout and
//! stderr appended to [`LOG`]. Before it starts, [`STARTED`] is written;
//! when it ends, [`DONE`] records how (`exit=N`, `signal=N`, or
//! `interrupted` when a boot finds [`STARTED`] without [`DONE`]). Forks
//! inherit the marker with the disk, so userdata never runs again in them.

use std::fs;
use std::io;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

use super::fs::{under, write_atomic};
use super::reaper;
use crate::error::describe_error;

/// The userdata script (guest path).
pub const USERDATA: &str = "/etc/tine/userdata";
/// Its output.
pub const LOG: &str = "/var/log/tine-userdata.log";
/// Written just before the script starts.
pub const STARTED: &str = "/var/lib/tine/userdata.started";
/// Written when it has run: `exit=N`, `signal=N` or `interrupted`.
pub const DONE: &str = "/var/lib/tine/userdata.done";

/// Whether userdata exists under `root` and whether it has run (and how).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct UserdataStatus {
    /// `/etc/tine/userdata` exists.
    pub present: bool,
    /// It has run to completion (or was interrupted and will not run again).
    pub ran: bool,
    /// Its exit code; `None` when it did not run, was killed by a signal or
    /// was interrupted by a shutdown.
    pub exit_code: Option<i32>,
}

/// Errors from [`run_once`].
#[derive(Debug, thiserror::Error)]
pub enum UserdataError {
    /// A marker or the log could not be written.
    #[error("Cannot write {}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The script could not be started.
    #[error("Cannot start {}", path.display())]
    Spawn {
        /// The script.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// Writes `script` as the userdata (mode 0755, atomically) unless userdata
/// already ran or started under `root`: then the disk keeps what it has.
pub fn install(root: &Path, script: &str) -> Result<(), UserdataError> {
    let _guard = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
    if under(root, DONE).exists() || under(root, STARTED).exists() {
        return Ok(());
    }
    let path = under(root, USERDATA);
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).map_err(|source| UserdataError::Write {
            path: path.clone(),
            source,
        })?;
    }
    write_atomic(&path, script.as_bytes(), 0o755).map_err(|source| UserdataError::Write {
        path: path.clone(),
        source,
    })
}

/// Serializes runs within this process.
static RUNNING: Mutex<()> = Mutex::new(());

/// Reads the state under `root`.
pub fn status(root: &Path) -> UserdataStatus {
    let present = under(root, USERDATA).is_file();
    match fs::read_to_string(under(root, DONE)) {
        Ok(s) => UserdataStatus {
            present,
            ran: true,
            exit_code: s.trim().strip_prefix("exit=").and_then(|c| c.parse().ok()),
        },
        Err(_) => UserdataStatus {
            present,
            ran: false,
            exit_code: None,
        },
    }
}

/// Runs the userdata under `root` if it exists and has not run, waiting for
/// it to finish; returns the resulting state. Children go through the global
/// reaper when one is installed.
pub fn run_once(root: &Path) -> Result<UserdataStatus, UserdataError> {
    let _guard = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
    let script = under(root, USERDATA);
    let done = under(root, DONE);
    let started = under(root, STARTED);
    if !script.is_file() || done.exists() {
        return Ok(status(root));
    }
    let write = |path: &Path, text: &str| {
        write_atomic(path, text.as_bytes(), 0o644).map_err(|source| UserdataError::Write {
            path: path.to_path_buf(),
            source,
        })
    };
    if started.exists() {
        // The last boot started it and never finished: do not run it twice.
        write(&done, "interrupted\n")?;
        remove_started_marker(&started);
        return Ok(status(root));
    }

    let log_path = under(root, LOG);
    let log_err = |source| UserdataError::Write {
        path: log_path.clone(),
        source,
    };
    if let Some(dir) = log_path.parent() {
        fs::create_dir_all(dir).map_err(log_err)?;
    }
    let log = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o640)
        .open(&log_path)
        .map_err(log_err)?;
    let log2 = log.try_clone().map_err(log_err)?;

    write(&started, "")?;
    let executable = fs::metadata(&script)
        .map(|m| m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false);
    let mut cmd = if executable {
        Command::new(&script)
    } else {
        let mut c = Command::new("/bin/sh");
        c.arg(&script);
        c
    };
    cmd.current_dir(root)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2)
        .env("TINE_USERDATA", "1");
    // ETXTBSY: another thread's fork may briefly hold a writable fd to a
    // script that was just written; it goes away at that child's exec.
    let mut spawned = reaper::status(&mut cmd);
    for _ in 0..10 {
        match &spawned {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) => {
                std::thread::sleep(std::time::Duration::from_millis(20));
                spawned = reaper::status(&mut cmd);
            }
            _ => break,
        }
    }
    let result = match spawned {
        Ok(st) => match (st.code(), st.signal()) {
            (Some(c), _) => format!("exit={c}\n"),
            (None, Some(s)) => format!("signal={s}\n"),
            (None, None) => "interrupted\n".to_string(),
        },
        Err(source) => {
            // Never started: mark it so that it is not retried on every boot.
            write(&done, "interrupted\n")?;
            remove_started_marker(&started);
            return Err(UserdataError::Spawn {
                path: script,
                source,
            });
        }
    };
    write(&done, &result)?;
    remove_started_marker(&started);
    Ok(status(root))
}

/// Removes [`STARTED`] once [`DONE`] holds the outcome. A marker that stays
/// behind is logged to stderr, like the rest of userdata's outcome.
fn remove_started_marker(started: &Path) {
    if let Err(e) = fs::remove_file(started) {
        eprintln!(
            "tine-agent: userdata: cannot remove {}: {e}",
            started.display()
        );
    }
}

/// Runs [`run_once`] on a thread of its own, logging failures to stderr.
pub fn spawn_run_once(root: PathBuf) -> Option<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("tine-userdata".into())
        .spawn(move || match run_once(&root) {
            Ok(s) if s.present => eprintln!(
                "tine-agent: userdata ran: {}",
                s.exit_code
                    .map(|c| format!("exit code {c}"))
                    .unwrap_or_else(|| "no exit code".into())
            ),
            Ok(_) => {}
            Err(e) => eprintln!("tine-agent: userdata: {}", describe_error(&e)),
        })
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root_with_userdata(script: &str, executable: bool) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = under(dir.path(), USERDATA);
        fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        fs::write(&p, script).expect("script");
        let mode = if executable { 0o755 } else { 0o644 };
        fs::set_permissions(&p, fs::Permissions::from_mode(mode)).expect("chmod");
        dir
    }

    #[test]
    fn test_no_userdata() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = run_once(dir.path()).expect("run");
        assert!(!s.present && !s.ran && s.exit_code.is_none());
        assert!(!under(dir.path(), DONE).exists());
    }

    #[test]
    fn test_runs_once_and_is_marked() {
        let root = root_with_userdata(
            "#!/bin/sh\necho run >> counter\necho to-stdout\necho to-stderr >&2\n[ \"$TINE_USERDATA\" = 1 ] && exit 7\n",
            true,
        );
        let before = status(root.path());
        assert!(before.present && !before.ran);

        let s = run_once(root.path()).expect("first run");
        assert!(s.present && s.ran);
        assert_eq!(s.exit_code, Some(7));
        assert_eq!(
            fs::read_to_string(under(root.path(), DONE)).expect("marker"),
            "exit=7\n"
        );
        assert!(!under(root.path(), STARTED).exists());
        let log = fs::read_to_string(under(root.path(), LOG)).expect("log");
        assert!(
            log.contains("to-stdout\n") && log.contains("to-stderr\n"),
            "{log}"
        );

        // A second boot (or a fork of this disk) does not run it again.
        let again = run_once(root.path()).expect("second run");
        assert_eq!(again.exit_code, Some(7));
        assert_eq!(
            fs::read_to_string(root.path().join("counter")).expect("counter"),
            "run\n"
        );
        assert_eq!(status(root.path()).exit_code, Some(7));
    }

    #[test]
    fn test_non_executable_script_runs_with_sh() {
        let root = root_with_userdata("exit 0\n", false);
        let s = run_once(root.path()).expect("run");
        assert_eq!(s.exit_code, Some(0));
    }

    #[test]
    fn test_killed_script_records_the_signal() {
        let root = root_with_userdata("kill -9 $$\n", false);
        let s = run_once(root.path()).expect("run");
        assert!(s.ran);
        assert_eq!(s.exit_code, None);
        assert_eq!(
            fs::read_to_string(under(root.path(), DONE)).expect("marker"),
            "signal=9\n"
        );
    }

    #[test]
    fn test_interrupted_run_is_not_repeated() {
        let root = root_with_userdata("echo run >> counter\n", false);
        let started = under(root.path(), STARTED);
        fs::create_dir_all(started.parent().expect("parent")).expect("mkdir");
        fs::write(&started, "").expect("marker");
        let s = run_once(root.path()).expect("run");
        assert!(s.ran);
        assert_eq!(s.exit_code, None);
        assert!(!root.path().join("counter").exists());
        assert_eq!(
            fs::read_to_string(under(root.path(), DONE)).expect("marker"),
            "interrupted\n"
        );
    }
}
