//! The interface of a `tine-vmm` process (docs/vmm-control.md): requests and
//! responses on its control socket, one JSON object per line each way, and
//! the events it prints on stdout, one JSON object per line.
//!
//! The VMM writes these types and its supervisor reads them, so neither
//! needs the other's code: a supervisor parses a line of the VMM's log with
//! [`Event::from_line`].

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// A request to the VMM process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Current state.
    Status,
    /// Park the vCPUs.
    Pause,
    /// Park the vCPUs and hold the guest's clock where it is until the
    /// resume: the guest does not see the time it waited pass (a VM primed
    /// for a hot fork, run ahead until its agent answered).
    PauseHoldingClock,
    /// Run them again.
    Resume {
        /// The vsock socket's file was moved here while the VM was paused
        /// (a primed VM handed to its fork, whose folder it is now): guest
        /// connections to host port P go to `<vsock_uds>_P` from now on.
        /// Refused when the VM has no vsock device.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        vsock_uds: Option<PathBuf>,
    },
    /// Snapshot the paused VM.
    Snapshot {
        /// State file to write.
        state_path: PathBuf,
        /// Memory file to write.
        mem_path: PathBuf,
    },
    /// Serve a drive of the paused VM from another image of the same size
    /// (flushing the one it leaves): a memory commit freezes the disk it
    /// captured and goes on in a fresh overlay on it.
    SwitchDisk {
        /// Device id (`drive0`).
        drive: String,
        /// The image to serve from now on.
        path: PathBuf,
    },
    /// Restore into this pre-started process.
    Restore {
        /// State file.
        state_path: PathBuf,
        /// Memory file, mapped copy-on-write.
        mem_path: PathBuf,
        /// Leave it paused.
        #[serde(default)]
        paused: bool,
        /// Listen for vsock on this socket instead of the snapshot's.
        #[serde(default)]
        vsock_uds: Option<PathBuf>,
        /// Serve these drives (device id -> image) from other images than
        /// the snapshot's, as `--drive-override` does.
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        drives: BTreeMap<String, PathBuf>,
        /// Give these NICs (device id -> TAP) other TAPs than the
        /// snapshot's, as `--tap-override` does.
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        taps: BTreeMap<String, String>,
        /// Write the serial console here instead of the command line's
        /// `--serial-log` (a pooled process restores for a VM whose folder
        /// it was not started in).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        serial_log: Option<PathBuf>,
    },
    /// Write the ranges of guest memory the restored VM has written since
    /// its restore (its own copies of the memory file's pages) to `path`,
    /// as a write set: a file the next VM restored from the same memory
    /// file can copy ahead ([`Request::PopulateWriteSet`]). Refused for a
    /// booted VM, whose memory is all its own.
    SaveWriteSet {
        /// The write set to write (replaced in one rename).
        path: PathBuf,
    },
    /// Copy the pages a write set lists into the restored VM's memory now,
    /// as the guest's first write of each would: its first touch of them
    /// then costs no copy and no second fault. A pool primes its paused
    /// VMs so, off any fork's path. Refused for a write set of another
    /// memory size, and for a booted VM.
    PopulateWriteSet {
        /// The write set to read.
        path: PathBuf,
    },
    /// Ask the guest to shut down (Ctrl-Alt-Del); the process exits when
    /// the guest stops.
    Shutdown,
    /// Stop the VM now and exit the process.
    Kill,
}

impl Request {
    /// Its `op` on the wire, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Request::Status => "status",
            Request::Pause => "pause",
            Request::PauseHoldingClock => "pause_holding_clock",
            Request::Resume { .. } => "resume",
            Request::Snapshot { .. } => "snapshot",
            Request::SwitchDisk { .. } => "switch_disk",
            Request::Restore { .. } => "restore",
            Request::SaveWriteSet { .. } => "save_write_set",
            Request::PopulateWriteSet { .. } => "populate_write_set",
            Request::Shutdown => "shutdown",
            Request::Kill => "kill",
        }
    }
}

/// The answer to a [`Request`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Response {
    /// Success.
    Ok {
        /// Run state after the request, when a VM exists.
        #[serde(skip_serializing_if = "Option::is_none", default)]
        state: Option<RunState>,
        /// Snapshot details, for `snapshot`.
        #[serde(skip_serializing_if = "Option::is_none", default)]
        snapshot: Option<SnapshotInfo>,
        /// Why the VM stopped, if it did.
        #[serde(skip_serializing_if = "Option::is_none", default)]
        stop_reason: Option<StopReason>,
        /// Bytes of guest memory a write set covers, for `save_write_set`
        /// and `populate_write_set`.
        #[serde(skip_serializing_if = "Option::is_none", default)]
        write_set_bytes: Option<u64>,
        /// Microseconds the request took inside the VMM.
        duration_us: u64,
    },
    /// Failure, with the reason.
    Error {
        /// What went wrong.
        error: String,
    },
}

/// Run state of the VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    /// vCPUs are running.
    Running,
    /// vCPUs are parked.
    Paused,
    /// The VM has stopped for good.
    Stopped,
}

impl RunState {
    /// The name on the wire (`running`, `paused`, `stopped`).
    pub fn as_str(self) -> &'static str {
        match self {
            RunState::Running => "running",
            RunState::Paused => "paused",
            RunState::Stopped => "stopped",
        }
    }
}

impl fmt::Display for RunState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a snapshot wrote.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotInfo {
    /// State file.
    pub state_path: PathBuf,
    /// Memory file.
    pub mem_path: PathBuf,
    /// Bytes of guest RAM written (the rest are holes).
    pub mem_bytes_written: u64,
    /// Wall time in microseconds.
    pub duration_us: u64,
}

/// Why the VM stopped: `{"reason":R}` or `{"reason":R,"detail":D}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "reason", content = "detail", rename_all = "snake_case")]
pub enum StopReason {
    /// The guest powered off (debug-exit port or KVM shutdown event), with
    /// the value it wrote.
    GuestPoweroff(u8),
    /// The guest rebooted (i8042 reset or KVM reset event).
    GuestReboot,
    /// The guest triple-faulted.
    TripleFault,
    /// The guest kernel reported a crash.
    GuestCrash,
    /// The VMM stopped it on request.
    Killed,
    /// The VMM failed.
    VmmError(String),
}

impl StopReason {
    /// The reason's name on the wire (`guest_poweroff`, `killed`, ...).
    pub fn as_str(&self) -> &'static str {
        match self {
            StopReason::GuestPoweroff(_) => "guest_poweroff",
            StopReason::GuestReboot => "guest_reboot",
            StopReason::TripleFault => "triple_fault",
            StopReason::GuestCrash => "guest_crash",
            StopReason::Killed => "killed",
            StopReason::VmmError(_) => "vmm_error",
        }
    }

    /// A poweroff, a reboot or a requested kill: not a failure. The VMM
    /// exits 0 for these and 1 otherwise.
    pub fn is_clean(&self) -> bool {
        matches!(
            self,
            StopReason::GuestPoweroff(_) | StopReason::GuestReboot | StopReason::Killed
        )
    }
}

/// For people: `guest_poweroff: 0`, `triple_fault`, `vmm_error: MESSAGE`.
impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())?;
        match self {
            StopReason::GuestPoweroff(value) => write!(f, ": {value}"),
            StopReason::VmmError(message) if !message.is_empty() => write!(f, ": {message}"),
            _ => Ok(()),
        }
    }
}

/// A line the VMM prints on stdout: `{"event":E,...}`, written with
/// `serde_json::to_string`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// The VM runs (or, with `--prestart`, the VM and vCPUs exist): the
    /// control socket takes requests.
    Ready {
        /// The VMM's process ID.
        pid: u32,
    },
    /// The VM stopped; the last line the process prints.
    Stopped {
        /// Why.
        stop: StopReason,
    },
}

impl Event {
    /// Parses one line of the VMM's output (surrounding whitespace is
    /// ignored). Fails on anything else, such as serial console output or
    /// a start-up error message.
    pub fn from_line(line: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(line.trim())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_request_json_shape_is_stable() {
        let req: Request =
            serde_json::from_str(r#"{"op":"snapshot","state_path":"/s","mem_path":"/m"}"#)
                .expect("parse");
        assert_eq!(
            req,
            Request::Snapshot {
                state_path: "/s".into(),
                mem_path: "/m".into()
            }
        );
        let text = serde_json::to_string(&Request::Pause).expect("json");
        assert_eq!(text, r#"{"op":"pause"}"#);
        let text = serde_json::to_string(&Request::SaveWriteSet {
            path: "/c/write-set".into(),
        })
        .expect("json");
        assert_eq!(text, r#"{"op":"save_write_set","path":"/c/write-set"}"#);
        let req: Request =
            serde_json::from_str(r#"{"op":"populate_write_set","path":"/c/write-set"}"#)
                .expect("parse");
        assert_eq!(
            req,
            Request::PopulateWriteSet {
                path: "/c/write-set".into()
            }
        );
        let req: Request =
            serde_json::from_str(r#"{"op":"restore","state_path":"/s","mem_path":"/m"}"#)
                .expect("restore without the optional fields");
        assert!(matches!(
            req,
            Request::Restore {
                paused: false,
                vsock_uds: None,
                serial_log: None,
                ref drives,
                ref taps,
                ..
            } if drives.is_empty() && taps.is_empty()
        ));
        let req: Request = serde_json::from_str(
            r#"{"op":"restore","state_path":"/s","mem_path":"/m","drives":{"drive0":"/d"},"taps":{"net0":"t7"},"serial_log":"/vm/serial.log"}"#,
        )
        .expect("restore with overrides");
        let Request::Restore {
            drives,
            taps,
            serial_log,
            ..
        } = req
        else {
            panic!("not a restore: {req:?}");
        };
        assert_eq!(drives.get("drive0"), Some(&PathBuf::from("/d")));
        assert_eq!(taps.get("net0").map(String::as_str), Some("t7"));
        assert_eq!(serial_log, Some(PathBuf::from("/vm/serial.log")));
    }

    #[test]
    fn test_request_unknown_op_is_an_error() {
        assert!(serde_json::from_str::<Request>(r#"{"op":"explode"}"#).is_err());
    }

    #[test]
    fn test_response_json_shape_is_stable() {
        let ok = Response::Ok {
            state: Some(RunState::Paused),
            snapshot: None,
            stop_reason: None,
            write_set_bytes: None,
            duration_us: 7,
        };
        assert_eq!(
            serde_json::to_string(&ok).expect("json"),
            r#"{"status":"ok","state":"paused","duration_us":7}"#
        );
        let populated: Response =
            serde_json::from_str(r#"{"status":"ok","write_set_bytes":8192,"duration_us":3}"#)
                .expect("parse");
        assert!(matches!(
            populated,
            Response::Ok {
                write_set_bytes: Some(8192),
                ..
            }
        ));
        let stopped: Response = serde_json::from_str(
            r#"{"status":"ok","state":"stopped","stop_reason":{"reason":"killed"},"duration_us":1}"#,
        )
        .expect("parse");
        assert!(matches!(
            stopped,
            Response::Ok {
                stop_reason: Some(StopReason::Killed),
                ..
            }
        ));
        let error: Response =
            serde_json::from_str(r#"{"status":"error","error":"no VM yet"}"#).expect("parse");
        assert_eq!(
            error,
            Response::Error {
                error: "no VM yet".into()
            }
        );
    }

    #[test]
    fn test_event_lines_are_what_the_vmm_prints() {
        let line = |event: &Event| serde_json::to_string(event).expect("json");
        assert_eq!(
            line(&Event::Ready { pid: 42 }),
            r#"{"event":"ready","pid":42}"#
        );
        let cases = [
            (
                StopReason::GuestPoweroff(0),
                r#"{"event":"stopped","stop":{"reason":"guest_poweroff","detail":0}}"#,
            ),
            (
                StopReason::GuestReboot,
                r#"{"event":"stopped","stop":{"reason":"guest_reboot"}}"#,
            ),
            (
                StopReason::VmmError("KVM_RUN failed".into()),
                r#"{"event":"stopped","stop":{"reason":"vmm_error","detail":"KVM_RUN failed"}}"#,
            ),
        ];
        for (stop, text) in cases {
            let event = Event::Stopped { stop };
            assert_eq!(line(&event), text);
            assert_eq!(
                Event::from_line(&format!("{text}\n")).expect("parse"),
                event
            );
        }
    }

    #[test]
    fn test_other_lines_are_not_events() {
        for line in [
            "",
            "[    0.000000] Linux version 6.1",
            "Error: boot failed",
            r#"{"event":"exploded"}"#,
            r#"{"event":"stopped","stop":{"reason":"eaten"}}"#,
        ] {
            assert!(Event::from_line(line).is_err(), "{line:?}");
        }
    }

    #[test]
    fn test_stop_reasons_for_people() {
        assert_eq!(
            StopReason::GuestPoweroff(3).to_string(),
            "guest_poweroff: 3"
        );
        assert_eq!(StopReason::TripleFault.to_string(), "triple_fault");
        assert_eq!(StopReason::VmmError("x".into()).to_string(), "vmm_error: x");
        assert!(StopReason::Killed.is_clean() && StopReason::GuestReboot.is_clean());
        assert!(!StopReason::GuestCrash.is_clean());
        assert!(!StopReason::VmmError(String::new()).is_clean());
    }

    #[test]
    fn a_requests_name_is_its_op_on_the_wire() {
        let requests = [
            Request::Status,
            Request::Pause,
            Request::PauseHoldingClock,
            Request::Resume { vsock_uds: None },
            Request::Resume {
                vsock_uds: Some("v".into()),
            },
            Request::Snapshot {
                state_path: "s".into(),
                mem_path: "m".into(),
            },
            Request::SwitchDisk {
                drive: "drive0".into(),
                path: "d".into(),
            },
            Request::Restore {
                state_path: "s".into(),
                mem_path: "m".into(),
                paused: false,
                vsock_uds: None,
                drives: BTreeMap::new(),
                taps: BTreeMap::new(),
                serial_log: None,
            },
            Request::Shutdown,
            Request::Kill,
        ];
        for r in requests {
            let wire: serde_json::Value = serde_json::to_value(&r).expect("json");
            assert_eq!(wire["op"], r.name());
        }
    }

    /// A plain resume is `{"op":"resume"}` both ways, as before resume
    /// could name a moved vsock socket.
    #[test]
    fn a_resume_names_a_moved_vsock_socket_only_when_asked() {
        let plain: Request = serde_json::from_str(r#"{"op":"resume"}"#).expect("parse");
        assert_eq!(plain, Request::Resume { vsock_uds: None });
        assert_eq!(
            serde_json::to_string(&plain).expect("json"),
            r#"{"op":"resume"}"#
        );
        let moved: Request =
            serde_json::from_str(r#"{"op":"resume","vsock_uds":"/v/vsock.sock"}"#).expect("parse");
        assert_eq!(
            moved,
            Request::Resume {
                vsock_uds: Some("/v/vsock.sock".into())
            }
        );
    }
}
