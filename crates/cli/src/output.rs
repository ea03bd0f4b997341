//! Human output: aligned tables, sizes, ages, the `--json` printer, and
//! [`sanitize`] for text a guest may have written.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use serde::Serialize;
use tine_proto::api::{
    CommitInfo, EgressPolicy, ErrorCode, HostGroupInfo, NetworkMode, StopMode, VmInfo,
    VmNetworkInfo,
};

/// Columns are separated by this many spaces.
const GAP: usize = 3;

/// Makes text fit to print on a terminal as text: control characters
/// (C0 with ESC, DEL, C1) and bidirectional overrides are written as
/// escapes (`\x1b`, `\u{9b}`, `\u{202e}`), so a guest cannot set the
/// window title, clear the screen, write the clipboard (OSC 52) or reorder
/// what the operator reads. `multiline` keeps `\n` and `\t` (logs).
///
/// Everything the CLI prints as text that a guest may have written (console
/// logs, agent versions, agent errors, tar entry names, a VM's `reason`)
/// goes through here; exec and shell output stay raw, like ssh's.
pub fn sanitize(text: &str, multiline: bool) -> Cow<'_, str> {
    let unsafe_char = |c: char| {
        let kept = multiline && (c == '\n' || c == '\t');
        !kept && (c.is_control() || is_bidi_control(c))
    };
    if !text.chars().any(unsafe_char) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if !unsafe_char(c) {
            out.push(c);
            continue;
        }
        // Writing to a String cannot fail.
        let _ = match c {
            '\n' => write!(out, "\\n"),
            '\t' => write!(out, "\\t"),
            '\r' => write!(out, "\\r"),
            c if (c as u32) < 0x80 => write!(out, "\\x{:02x}", c as u32),
            c => write!(out, "\\u{{{:x}}}", c as u32),
        };
    }
    Cow::Owned(out)
}

/// Unicode's explicit bidirectional formatting characters.
fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{61c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// Lays out rows under headers, each column as wide as its widest cell;
/// the last column is not padded. Cells are [`sanitize`]d.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|row| {
            row.iter()
                .map(|cell| sanitize(cell, false).into_owned())
                .collect()
        })
        .collect();
    let rows = rows.as_slice();
    let columns = headers.len();
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate().take(columns) {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = headers.iter().map(|h| h.to_string()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate().take(columns) {
            if i + 1 < columns {
                let pad = widths[i] - cell.chars().count() + GAP;
                line.push_str(cell);
                line.extend(std::iter::repeat_n(' ', pad));
            } else {
                line.push_str(cell);
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// Bytes as a short size: `512M`, `1G`, `1.5G`, `4K`, `100B`.
pub fn size(bytes: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("T", 1 << 40),
        ("G", 1 << 30),
        ("M", 1 << 20),
        ("K", 1 << 10),
    ];
    for (unit, scale) in UNITS {
        if bytes >= scale {
            let whole = bytes / scale;
            let tenth = (bytes % scale) * 10 / scale;
            return if tenth == 0 || whole >= 100 {
                format!("{whole}{unit}")
            } else {
                format!("{whole}.{tenth}{unit}")
            };
        }
    }
    format!("{bytes}B")
}

/// A duration as the largest fitting unit: `45s`, `12m`, `3h`, `4d`.
pub fn age(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m", s / 60),
        3600..=86_399 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

/// The age of an RFC 3339 instant at `now`; `-` when it does not parse.
pub fn age_since(rfc3339: &str, now: SystemTime) -> String {
    match humantime::parse_rfc3339_weak(rfc3339.trim_end_matches('Z')) {
        Ok(then) => now
            .duration_since(then)
            .map(age)
            .unwrap_or_else(|_| "0s".into()),
        Err(_) => "-".into(),
    }
}

/// Milliseconds for people: `812 ms`, `1.2 s`.
pub fn millis(ms: u64) -> String {
    if ms < 1000 {
        format!("{ms} ms")
    } else {
        format!("{}.{} s", ms / 1000, (ms % 1000) / 100)
    }
}

/// The wire name of an error code (`not_found`).
pub fn code_name(code: ErrorCode) -> String {
    serde_json::to_value(code)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{code:?}"))
}

/// The `tine vm list` table.
pub fn vm_table(vms: &[VmInfo], now: SystemTime) -> String {
    let rows: Vec<Vec<String>> = vms
        .iter()
        .map(|v| {
            vec![
                v.hostname.clone(),
                v.host_group.clone(),
                v.state.to_string(),
                v.cpus.to_string(),
                size(v.ram_bytes),
                v.ip.clone().unwrap_or_else(|| "-".into()),
                age_since(&v.created_at, now),
                if v.tags.is_empty() {
                    "-".into()
                } else {
                    v.tags.join(",")
                },
            ]
        })
        .collect();
    table(
        &[
            "HOSTNAME", "GROUP", "STATE", "CPUS", "RAM", "IP", "AGE", "TAGS",
        ],
        &rows,
    )
}

/// The `tine group list` table.
pub fn group_table(groups: &[HostGroupInfo]) -> String {
    let rows: Vec<Vec<String>> = groups
        .iter()
        .map(|g| {
            vec![
                g.name.clone(),
                g.count.to_string(),
                g.nodes.to_string(),
                format!("{}/{}", g.cpus, g.max_cpus),
                format!("{}/{}", size(g.ram_bytes), size(g.max_ram_bytes)),
                size(g.storage_bytes),
                if g.persistent { "yes" } else { "no" }.into(),
                g.network.clone(),
                g.image.clone(),
            ]
        })
        .collect();
    table(
        &[
            "NAME",
            "COUNT",
            "VMS",
            "CPUS",
            "RAM",
            "DISK",
            "PERSISTENT",
            "NETWORK",
            "IMAGE",
        ],
        &rows,
    )
}

/// The `tine vm commit list` table.
pub fn commit_table(commits: &[CommitInfo], now: SystemTime) -> String {
    let rows: Vec<Vec<String>> = commits
        .iter()
        .map(|c| {
            vec![
                c.commit_id.clone(),
                c.mode.to_string(),
                c.source.clone(),
                c.cache_key.clone().unwrap_or_else(|| "-".into()),
                size(c.size_bytes),
                age_since(&c.created_at, now),
                if c.tags.is_empty() {
                    "-".into()
                } else {
                    c.tags.join(",")
                },
            ]
        })
        .collect();
    table(
        &[
            "COMMIT",
            "MODE",
            "SOURCE",
            "CACHE KEY",
            "SIZE",
            "AGE",
            "TAGS",
        ],
        &rows,
    )
}

/// `key: value` lines, keys aligned, values [`sanitize`]d.
pub fn fields(pairs: &[(&str, String)]) -> String {
    let width = pairs.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 1;
    let mut out = String::new();
    for (k, v) in pairs {
        let v = sanitize(v, false);
        out.push_str(&format!("{:<width$} {v}\n", format!("{k}:")));
    }
    out
}

/// `tine vm describe`.
pub fn describe(v: &VmInfo, now: SystemTime) -> String {
    let or_dash = |o: &Option<String>| o.clone().unwrap_or_else(|| "-".into());
    let mut pairs = vec![
        ("hostname", v.hostname.clone()),
        ("group", v.host_group.clone()),
        ("state", v.state.to_string()),
        ("cpus", v.cpus.to_string()),
        ("ram", size(v.ram_bytes)),
        ("persistent", if v.persistent { "yes" } else { "no" }.into()),
        (
            "tags",
            if v.tags.is_empty() {
                "-".into()
            } else {
                v.tags.join(", ")
            },
        ),
        (
            "secrets",
            if v.secrets.is_empty() {
                "-".into()
            } else {
                v.secrets.join(", ")
            },
        ),
        ("ip", or_dash(&v.ip)),
        (
            "created",
            format!("{} ({} ago)", v.created_at, age_since(&v.created_at, now)),
        ),
        ("started", or_dash(&v.started_at)),
        ("boot", v.boot_ms.map(millis).unwrap_or_else(|| "-".into())),
        (
            "pid",
            v.pid.map(|p| p.to_string()).unwrap_or_else(|| "-".into()),
        ),
    ];
    if let Some(reason) = &v.reason {
        pairs.push(("reason", reason.clone()));
    }
    if let Some(mode) = v.stop_mode {
        pairs.push(("stop", stop_mode_text(mode).to_owned()));
    }
    pairs.push((
        "disk",
        format!(
            "{} ({}, {} used of {})",
            v.disk.path,
            v.disk.format,
            size(v.disk.allocated_bytes),
            size(v.disk.size_bytes)
        ),
    ));
    pairs.push(("commit", or_dash(&v.commit_id)));
    pairs.push(("forked from", or_dash(&v.parent_commit_id)));
    if let Some(m) = &v.memory {
        pairs.push((
            "memory",
            format!(
                "USS {}, PSS {}, RSS {}",
                size(m.uss_bytes),
                size(m.pss_bytes),
                size(m.rss_bytes)
            ),
        ));
        pairs.push((
            "copied",
            match m.guest_pages_copied {
                Some(n) => format!(
                    "{n} guest pages ({}) since the restore",
                    size(n.saturating_mul(tine_proto::api::GUEST_PAGE_BYTES))
                ),
                None => "- (booted: its RAM is its own)".into(),
            },
        ));
    }
    pairs.extend(network_pairs(&v.network));
    fields(&pairs)
}

/// The `network` and policy lines of describe and `tine vm network`.
pub fn network_pairs(n: &VmNetworkInfo) -> Vec<(&'static str, String)> {
    let list = |l: &[String]| {
        if l.is_empty() {
            "-".to_string()
        } else {
            l.join(", ")
        }
    };
    let policy = |p: &EgressPolicy| {
        format!(
            "allow {}; drop {}; the rest: {}",
            list(&p.allow),
            list(&p.drop),
            p.default
        )
    };
    let mut pairs = Vec::new();
    let attached = match (&n.address, &n.gateway, &n.tap, &n.mac) {
        (Some(address), Some(gateway), Some(tap), Some(mac)) => {
            format!("{} {address} via {gateway} (tap {tap}, mac {mac})", n.mode)
        }
        _ if n.mode == NetworkMode::None => "none".to_owned(),
        _ => format!("{} (not attached yet)", n.mode),
    };
    pairs.push(("network", attached));
    if n.mode == NetworkMode::Isolated {
        pairs.push((
            "policy",
            format!("{} (from {})", policy(&n.effective), n.policy_source),
        ));
        if n.overrides.is_some() {
            pairs.push(("group policy", policy(&n.host_group)));
        }
    }
    if !n.dns.is_empty() {
        pairs.push(("dns", n.dns.join(", ")));
    }
    pairs
}

/// Prints one JSON document (pretty) on stdout.
pub fn print_json<T: Serialize>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// Prints a list the way every list command does: the JSON array with
/// `--json`, one `id` per line with `--quiet`, otherwise `table` (or
/// `empty` on stderr when there is nothing to show).
pub fn print_list<T: Serialize>(
    json: bool,
    quiet: bool,
    items: &[T],
    id: impl Fn(&T) -> &str,
    empty: &str,
    table: impl FnOnce(&[T]) -> String,
) -> anyhow::Result<()> {
    if json {
        print_json(&items)?;
    } else if quiet {
        for item in items {
            println!("{}", id(item));
        }
    } else if items.is_empty() {
        eprintln!("{empty}");
    } else {
        print!("{}", table(items));
    }
    Ok(())
}

/// How a stop mode reads for people.
pub fn stop_mode_text(mode: StopMode) -> &'static str {
    match mode {
        StopMode::Graceful => "graceful (the guest synced and powered off)",
        StopMode::Forced => "forced (killed: writes the guest had not synced may be lost)",
        StopMode::Guest => "by the guest (it powered off or rebooted itself)",
        StopMode::Crashed => "crashed",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tine_proto::api::{StorageInfo, StorageKind, VmState};

    fn vm(hostname: &str, state: VmState, tags: &[&str], ip: Option<&str>) -> VmInfo {
        VmInfo {
            hostname: hostname.into(),
            host_group: "dev".into(),
            status: state.into(),
            state,
            cpus: 2,
            ram_bytes: 512 << 20,
            persistent: true,
            tags: tags.iter().map(|t| t.to_string()).collect(),
            secrets: vec![],
            ip: ip.map(str::to_string),
            arch: "amd64".into(),
            image: "min".into(),
            network: VmNetworkInfo::no_device(),
            pid: None,
            reason: None,
            stop_mode: None,
            created_at: "2026-01-01T00:00:00.000Z".into(),
            started_at: None,
            boot_ms: None,
            commit_id: None,
            parent_commit_id: None,
            storage: StorageKind::Image,
            disk: StorageInfo {
                path: "/d".into(),
                format: "qcow2".into(),
                size_bytes: 4 << 30,
                allocated_bytes: 0,
            },
            memory: None,
        }
    }

    #[test]
    fn vm_table_is_aligned() {
        let now = humantime::parse_rfc3339("2026-01-01T02:30:00Z").expect("now");
        let vms = vec![
            vm(
                "dev-1",
                VmState::Running,
                &["name=web", "env=ci"],
                Some("10.0.0.2"),
            ),
            vm("dev-10", VmState::Stopped, &[], None),
        ];
        let text = vm_table(&vms, now);
        assert_eq!(
            text,
            "\
HOSTNAME   GROUP   STATE     CPUS   RAM    IP         AGE   TAGS
dev-1      dev     running   2      512M   10.0.0.2   2h    name=web,env=ci
dev-10     dev     stopped   2      512M   -          2h    -
"
        );
    }

    #[test]
    fn sizes_ages_and_millis_read_well() {
        assert_eq!(size(512 << 20), "512M");
        assert_eq!(size(3 << 29), "1.5G");
        assert_eq!(size(4 << 30), "4G");
        assert_eq!(size(100), "100B");
        assert_eq!(size(1536), "1.5K");
        assert_eq!(age(Duration::from_secs(45)), "45s");
        assert_eq!(age(Duration::from_secs(600)), "10m");
        assert_eq!(age(Duration::from_secs(7200)), "2h");
        assert_eq!(age(Duration::from_secs(3 * 86_400)), "3d");
        assert_eq!(millis(812), "812 ms");
        assert_eq!(millis(1234), "1.2 s");
        let now = humantime::parse_rfc3339("2026-01-01T00:00:10Z").expect("now");
        assert_eq!(age_since("2026-01-01T00:00:00.000Z", now), "10s");
        assert_eq!(age_since("garbage", now), "-");
        assert_eq!(age_since("2027-01-01T00:00:00Z", now), "0s");
    }

    #[test]
    fn tables_handle_empty_and_wide_cells() {
        assert_eq!(table(&["A", "B"], &[]), "A   B\n");
        let rows = vec![vec!["long-cell".to_string(), "x".to_string()]];
        assert_eq!(table(&["A", "B"], &rows), "A           B\nlong-cell   x\n");
    }

    #[test]
    fn describe_shows_lineage_and_disk() {
        let mut v = vm("dev-4", VmState::Running, &[], None);
        v.parent_commit_id = Some("cmt-dev-1".into());
        let now = humantime::parse_rfc3339("2026-01-01T00:01:00Z").expect("now");
        let text = describe(&v, now);
        assert!(text.contains("forked from: cmt-dev-1"), "{text}");
        assert!(
            text.contains("disk:        /d (qcow2, 0B used of 4G)"),
            "{text}"
        );
        assert!(text.contains("network:     none"), "{text}");
        assert!(!text.contains("memory:"), "{text}");
    }

    #[test]
    fn describe_shows_memory_and_copied_pages() {
        let mut v = vm("dev-4", VmState::Running, &[], None);
        v.memory = Some(tine_proto::api::VmMemoryInfo {
            rss_bytes: 3 << 20,
            pss_bytes: 2 << 20,
            uss_bytes: 1536 << 10,
            guest_pages_copied: Some(256),
        });
        let now = humantime::parse_rfc3339("2026-01-01T00:01:00Z").expect("now");
        let text = describe(&v, now);
        assert!(
            text.contains("memory:      USS 1.5M, PSS 2M, RSS 3M\n"),
            "{text}"
        );
        assert!(
            text.contains("copied:      256 guest pages (1M) since the restore\n"),
            "{text}"
        );
        if let Some(m) = v.memory.as_mut() {
            m.guest_pages_copied = None;
        }
        let text = describe(&v, now);
        assert!(
            text.contains("copied:      - (booted: its RAM is its own)"),
            "{text}"
        );
    }

    #[test]
    fn terminal_escapes_from_a_guest_come_out_escaped() {
        // OSC 0 sets the window title, ESC[2J clears the screen, OSC 52
        // writes the clipboard, CSI as one C1 character, a bidi override.
        let cases = [
            ("\u{1b}]0;pwned\u{7}", "\\x1b]0;pwned\\x07"),
            ("a\u{1b}[2Jb", "a\\x1b[2Jb"),
            (
                "\u{1b}]52;c;cm0gLXJmIH4K\u{1b}\\",
                "\\x1b]52;c;cm0gLXJmIH4K\\x1b\\",
            ),
            ("\u{9b}2J", "\\u{9b}2J"),
            ("\u{202e}txt.exe", "\\u{202e}txt.exe"),
            ("nul\0del\u{7f}cr\r", "nul\\x00del\\x7fcr\\r"),
        ];
        for (raw, shown) in cases {
            assert_eq!(sanitize(raw, false), shown, "{raw:?}");
            assert_eq!(sanitize(raw, true), shown, "{raw:?}");
        }
        assert_eq!(sanitize("a\tb\nc", false), "a\\tb\\nc");
        assert_eq!(sanitize("a\tb\nc", true), "a\tb\nc");
        assert!(matches!(
            sanitize("plain text, ünïcödé", false),
            Cow::Borrowed(_)
        ));
    }

    #[test]
    fn describe_and_tables_escape_guest_text() {
        let mut v = vm("dev-4", VmState::Failed, &["t=\u{1b}[2J"], None);
        v.reason = Some("agent said \u{1b}]52;c;eA==\u{7}".into());
        let now = humantime::parse_rfc3339("2026-01-01T00:01:00Z").expect("now");
        let text = describe(&v, now);
        assert!(!text.contains('\u{1b}'), "{text:?}");
        assert!(text.contains("agent said \\x1b]52;c;eA==\\x07"), "{text}");
        let table = vm_table(&[v], now);
        assert!(table.contains("t=\\x1b[2J"), "{table}");
    }

    #[test]
    fn error_codes_have_wire_names() {
        assert_eq!(code_name(ErrorCode::NotFound), "not_found");
        assert_eq!(code_name(ErrorCode::AgentUnavailable), "agent_unavailable");
    }
}
