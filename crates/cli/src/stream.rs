//! The streaming commands: `vm exec`, `vm shell`, `vm cp`, `vm forward`.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context};
use tine_client::api::{
    output_bytes, CpMode, ExecOptions, ForwardTarget, ShellEvent, ShellOptions, UploadOptions,
};
use tine_client::TineClient;
use tine_proto::api::ExecFrame;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::signal::unix::{signal, SignalKind};

use crate::cli::{CpArgs, ExecArgs, ForwardArgs, GlobalArgs, ShellArgs};
use crate::exit::{self, UsageError};
use crate::output::{code_name, print_json, sanitize};
use crate::terminal::{self, RawMode};
use crate::untar;

/// The exit code for how a command ended: its code, or 128+N for signal N.
/// The guest reports these numbers: a signal outside 1..=127 (no real
/// one) counts as an error rather than overflowing.
pub fn exit_status(code: Option<i32>, signal: Option<i32>) -> i32 {
    match (code, signal) {
        (Some(code), _) => code,
        (None, Some(signal @ 1..=127)) => 128 + signal,
        (None, _) => exit::API_ERROR,
    }
}

/// The exec request the flags describe: with `--shell` the words are
/// joined into one script for `/bin/sh -c`.
pub fn exec_options(args: &ExecArgs) -> ExecOptions {
    let shell = args.shell_choice();
    let (cmd, rest) = match (shell, args.command.split_first()) {
        (Some(true), _) => (args.command.join(" "), Vec::new()),
        (_, Some((cmd, rest))) => (cmd.clone(), rest.to_vec()),
        (_, None) => (String::new(), Vec::new()),
    };
    ExecOptions {
        cmd,
        args: rest,
        env: args.env.clone(),
        uid: args.uid,
        gid: args.gid,
        cwd: args.cwd.clone(),
        shell,
        timeout: args.timeout,
    }
}

/// `tine vm exec`: streams the command's output as it comes and exits with
/// its code.
pub async fn exec(g: &GlobalArgs, c: &TineClient, args: ExecArgs) -> anyhow::Result<i32> {
    let options = exec_options(&args);
    let send_stdin = args.stdin || (!args.no_stdin && !std::io::stdin().is_terminal());
    let mut frames = if send_stdin {
        c.exec(&args.vm, &options, Some(tokio::io::stdin())).await?
    } else {
        c.exec(&args.vm, &options, None::<tokio::io::Empty>).await?
    };
    let mut stdout = tokio::io::stdout();
    let mut stderr = tokio::io::stderr();
    while let Some(frame) = frames.next_frame().await {
        let frame = frame?;
        if g.json {
            let mut line = serde_json::to_vec(&frame)?;
            line.push(b'\n');
            stdout.write_all(&line).await?;
            stdout.flush().await?;
        }
        match frame {
            ExecFrame::Started { .. } => {}
            ExecFrame::Stdout { data, encoding } => {
                if !g.json {
                    stdout.write_all(&output_bytes(&data, encoding)?).await?;
                    stdout.flush().await?;
                }
            }
            ExecFrame::Stderr { data, encoding } => {
                if !g.json {
                    stderr.write_all(&output_bytes(&data, encoding)?).await?;
                    stderr.flush().await?;
                }
            }
            ExecFrame::Exit {
                exit_code,
                signal_number,
                timed_out,
                ..
            } => {
                let (code, signal) = (signal_number.is_none().then_some(exit_code), signal_number);
                if timed_out && !g.json && !g.quiet {
                    eprintln!("tine: {}: the command ran past its timeout", args.vm);
                }
                return Ok(exit_status(code, signal));
            }
            ExecFrame::Error { error, code } => {
                if !g.json {
                    // The agent's words: no escapes to the terminal.
                    let line = format!("tine: {error} ({})", code_name(code));
                    eprintln!("{}", sanitize(&line, false));
                }
                return Ok(if code == tine_proto::api::ErrorCode::Timeout {
                    exit::TIMEOUT
                } else {
                    exit::API_ERROR
                });
            }
        }
    }
    bail!("the daemon ended the exec stream without the command's exit")
}

/// Waits for a signal, or forever when it could not be registered.
async fn next_signal(sig: &mut Option<tokio::signal::unix::Signal>) {
    match sig {
        Some(sig) => {
            if sig.recv().await.is_none() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending::<()>().await,
    }
}

/// `tine vm shell`: a raw terminal joined to a shell in the VM; exits with
/// the shell's code.
pub async fn shell(c: &TineClient, args: ShellArgs) -> anyhow::Result<i32> {
    let (rows, cols) = terminal::size().unwrap_or((24, 80));
    let session = c
        .shell(
            &args.vm,
            &ShellOptions {
                rows: Some(rows),
                cols: Some(cols),
                cwd: args.cwd.clone(),
                uid: args.uid,
                shell: args.shell.clone(),
            },
        )
        .await?;
    let (mut writer, mut reader) = session.split();
    // Restored when dropped: on return, on `?` and on panic.
    let raw = RawMode::enable()?;
    let input = tokio::spawn(async move {
        let mut stdin = tokio::io::stdin();
        let mut winch = signal(SignalKind::window_change()).ok();
        let mut buf = vec![0u8; 16 << 10];
        let mut stdin_open = true;
        loop {
            tokio::select! {
                n = stdin.read(&mut buf), if stdin_open => match n {
                    Ok(0) | Err(_) => {
                        // End of piped input: ^D ends the shell's input too.
                        stdin_open = false;
                        if writer.send_input(&[4]).await.is_err() {
                            return;
                        }
                    }
                    Ok(n) => {
                        if writer.send_input(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                },
                () = next_signal(&mut winch) => {
                    if let Some((rows, cols)) = terminal::size() {
                        if writer.resize(rows, cols).await.is_err() {
                            return;
                        }
                    }
                }
            }
        }
    });
    let mut term = signal(SignalKind::terminate()).ok();
    let mut hup = signal(SignalKind::hangup()).ok();
    let mut stdout = tokio::io::stdout();
    let result = loop {
        tokio::select! {
            event = reader.next_event() => match event {
                Ok(Some(ShellEvent::Output(bytes))) => {
                    if let Err(e) = stdout.write_all(&bytes).await {
                        break Err(anyhow::Error::new(e).context("cannot write to the terminal"));
                    }
                    if let Err(e) = stdout.flush().await {
                        break Err(anyhow::Error::new(e).context("cannot write to the terminal"));
                    }
                }
                Ok(Some(ShellEvent::Exit(code))) => break Ok(code),
                Ok(None) => break Err(anyhow!("the daemon closed the shell without its exit code")),
                Err(e) => break Err(e.into()),
            },
            () = next_signal(&mut term) => break Ok(128 + libc::SIGTERM),
            () = next_signal(&mut hup) => break Ok(128 + libc::SIGHUP),
        }
    };
    input.abort();
    drop(raw);
    result
}

/// One side of `vm cp`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Side {
    /// A local path, or `-` for stdin/stdout.
    Local(String),
    /// `VM:/path`.
    Remote {
        /// Hostname or friendly name.
        vm: String,
        /// Absolute path in the VM.
        path: String,
    },
}

/// Parses `VM:/path` (remote) or a local path. A local path holding `:`
/// before any `/` needs a `./` in front.
pub fn parse_side(s: &str) -> Result<Side, UsageError> {
    match s.split_once(':') {
        Some((vm, path)) if !vm.is_empty() && !vm.contains('/') => {
            if !path.starts_with('/') {
                return Err(UsageError(format!(
                    "{s:?}: the path in the VM must be absolute (VM:/path); a local file with ':' in its name needs ./ in front"
                )));
            }
            Ok(Side::Remote {
                vm: vm.to_string(),
                path: path.to_string(),
            })
        }
        _ => Ok(Side::Local(s.to_string())),
    }
}

/// The last component of a path (`/a/b/` gives `b`).
fn base_name(path: &str) -> Option<&str> {
    path.trim_end_matches('/')
        .rsplit('/')
        .next()
        .filter(|n| !n.is_empty())
}

/// `tine vm cp`.
pub async fn cp(g: &GlobalArgs, c: &TineClient, args: CpArgs) -> anyhow::Result<i32> {
    let src = parse_side(&args.src)?;
    let dst = parse_side(&args.dst)?;
    let options = UploadOptions {
        mode_bits: args.mode,
        uid: args.uid,
        gid: args.gid,
    };
    let (bytes, to_stdout, shown) = match (src, dst) {
        (Side::Local(local), Side::Remote { vm, path }) => {
            let n = upload(c, &local, &vm, &path, args.recursive, &options).await?;
            (n, false, format!("{vm}:{path}"))
        }
        (Side::Remote { vm, path }, Side::Local(local)) => {
            let n = download(c, &vm, &path, &local, args.recursive).await?;
            (n, local == "-", local)
        }
        (Side::Local(_), Side::Local(_)) => {
            return Err(UsageError("one side must be in a VM (VM:/path)".into()).into())
        }
        (Side::Remote { .. }, Side::Remote { .. }) => {
            return Err(UsageError("copy between two VMs through the host".into()).into())
        }
    };
    if g.json {
        print_json(&serde_json::json!({ "bytes": bytes }))?;
    } else if !g.quiet && !to_stdout {
        println!("copied {bytes} bytes to {shown}");
    }
    Ok(exit::OK)
}

async fn upload(
    c: &TineClient,
    local: &str,
    vm: &str,
    path: &str,
    recursive: bool,
    options: &UploadOptions,
) -> anyhow::Result<u64> {
    if local == "-" {
        if recursive {
            // A tar archive on stdin, unpacked into the directory.
            return Ok(c
                .cp_upload(vm, path, CpMode::Tar, options, tokio::io::stdin())
                .await?);
        }
        if path.ends_with('/') {
            bail!(UsageError("name the file to write in the VM".into()));
        }
        return Ok(c
            .cp_upload(vm, path, CpMode::Binary, options, tokio::io::stdin())
            .await?);
    }
    let meta = tokio::fs::metadata(local)
        .await
        .with_context(|| format!("cannot read {local}"))?;
    if recursive {
        let (reader, writer) = tokio::io::duplex(256 << 10);
        let source = PathBuf::from(local);
        let writer = tokio_util::io::SyncIoBridge::new(writer);
        let packer = tokio::task::spawn_blocking(move || pack(&source, writer));
        let sent = c.cp_upload(vm, path, CpMode::Tar, options, reader).await;
        let packed = packer.await.context("the tar writer failed")?;
        // The packer's error explains a failed upload better than the
        // broken pipe the daemon saw.
        packed.with_context(|| format!("cannot pack {local}"))?;
        return Ok(sent?);
    }
    if meta.is_dir() {
        bail!(UsageError(format!(
            "{local} is a directory; copy it with -r"
        )));
    }
    let mut target = path.to_string();
    if target.ends_with('/') {
        let name =
            base_name(local).ok_or_else(|| UsageError(format!("{local} has no file name")))?;
        target.push_str(name);
    }
    let file = tokio::fs::File::open(local)
        .await
        .with_context(|| format!("cannot open {local}"))?;
    Ok(c.cp_upload(vm, &target, CpMode::Binary, options, file)
        .await?)
}

/// Writes a tar of `source` (a directory's contents, or one file under its
/// name) to `out`; symlinks stay symlinks.
fn pack<W: std::io::Write>(source: &Path, out: W) -> std::io::Result<()> {
    let mut builder = tar::Builder::new(out);
    builder.follow_symlinks(false);
    if source.is_dir() {
        builder.append_dir_all(".", source)?;
    } else {
        let name = source
            .file_name()
            .ok_or_else(|| std::io::Error::other("the source has no file name"))?;
        builder.append_path_with_name(source, name)?;
    }
    let mut out = builder.into_inner()?;
    out.flush()?;
    Ok(())
}

async fn download(
    c: &TineClient,
    vm: &str,
    path: &str,
    local: &str,
    recursive: bool,
) -> anyhow::Result<u64> {
    let mode = if recursive {
        CpMode::Tar
    } else {
        CpMode::Binary
    };
    let data = c.cp_download(vm, path, mode).await?;
    if local == "-" {
        return data
            .copy_to(&mut tokio::io::stdout())
            .await
            .map_err(Into::into);
    }
    if recursive {
        let dir = PathBuf::from(local);
        tokio::fs::create_dir_all(&dir)
            .await
            .with_context(|| format!("cannot create {local}"))?;
        let counted = Counted {
            inner: tokio_util::io::SyncIoBridge::new(data),
            bytes: 0,
        };
        let umask = untar::current_umask();
        let unpacked = tokio::task::spawn_blocking(move || {
            let mut counted = counted;
            let done = untar::unpack(&mut counted, &dir, umask)?;
            Ok::<_, std::io::Error>((done, counted.bytes))
        })
        .await
        .context("the tar reader failed")?;
        let (done, bytes) = unpacked.with_context(|| format!("cannot unpack into {local}"))?;
        for name in &done.skipped {
            let line =
                format!("tine: skipped {name} from {vm}:{path}: not a file, directory or symlink");
            eprintln!("{}", sanitize(&line, false));
        }
        return Ok(bytes);
    }
    let mut target = PathBuf::from(local);
    if local.ends_with('/') || target.is_dir() {
        let name = base_name(path).ok_or_else(|| UsageError(format!("{path} has no file name")))?;
        target.push(name);
    }
    let mut file = tokio::fs::File::create(&target)
        .await
        .with_context(|| format!("cannot create {}", target.display()))?;
    match data.copy_to(&mut file).await {
        Ok(n) => Ok(n),
        Err(e) => {
            drop(file);
            // Leave no half-written file behind.
            if let Err(rm) = tokio::fs::remove_file(&target).await {
                eprintln!("tine: cannot remove the partial {}: {rm}", target.display());
            }
            Err(e.into())
        }
    }
}

/// A reader that counts what passes through it.
struct Counted<R> {
    inner: R,
    bytes: u64,
}

impl<R: std::io::Read> std::io::Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.bytes += n as u64;
        Ok(n)
    }
}

/// One `-L` forward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardSpec {
    /// Local address to listen on.
    pub bind: String,
    /// Local port.
    pub port: u16,
    /// Where it goes in the VM.
    pub target: ForwardTarget,
}

/// Parses `[BIND:]LPORT:TARGET`, TARGET being `PORT`, `HOST:PORT` or a
/// `/unix/path`. With three parts, `A:B:C` is `LPORT:HOST:PORT` when `A`
/// is a number, else `BIND:LPORT:PORT`.
pub fn parse_forward(spec: &str) -> Result<ForwardSpec, UsageError> {
    let bad = |why: &str| UsageError(format!("-L {spec:?}: {why}"));
    let port = |s: &str| {
        s.parse::<u16>()
            .map_err(|_| bad(&format!("{s:?} is not a port")))
    };
    let (head, target) = if let Some(idx) = spec.find(":/") {
        let path = &spec[idx + 1..];
        (&spec[..idx], ForwardTarget::Unix(path.to_string()))
    } else {
        let parts: Vec<&str> = spec.split(':').collect();
        match parts.as_slice() {
            [lport, tport] => (
                *lport,
                ForwardTarget::Tcp {
                    host: None,
                    port: port(tport)?,
                },
            ),
            [a, b, c] if a.parse::<u16>().is_ok() => (
                *a,
                ForwardTarget::Tcp {
                    host: Some(b.to_string()),
                    port: port(c)?,
                },
            ),
            [bind, lport, tport] => {
                if bind.is_empty() {
                    return Err(bad("empty bind address"));
                }
                let lport = port(lport)?;
                return Ok(ForwardSpec {
                    bind: bind.to_string(),
                    port: lport,
                    target: ForwardTarget::Tcp {
                        host: None,
                        port: port(tport)?,
                    },
                });
            }
            [bind, lport, host, tport] => {
                if bind.is_empty() || host.is_empty() {
                    return Err(bad("empty bind address or host"));
                }
                let lport = port(lport)?;
                return Ok(ForwardSpec {
                    bind: bind.to_string(),
                    port: lport,
                    target: ForwardTarget::Tcp {
                        host: Some(host.to_string()),
                        port: port(tport)?,
                    },
                });
            }
            _ => {
                return Err(bad(
                    "use [BIND:]LPORT:PORT, LPORT:HOST:PORT or LPORT:/unix/path",
                ))
            }
        }
    };
    let (bind, lport) = match head.rsplit_once(':') {
        Some((bind, lport)) if !bind.is_empty() => (bind.to_string(), port(lport)?),
        Some(_) => return Err(bad("empty bind address")),
        None => ("127.0.0.1".to_string(), port(head)?),
    };
    if let ForwardTarget::Tcp { host: Some(h), .. } = &target {
        if h.is_empty() {
            return Err(bad("empty host"));
        }
    }
    Ok(ForwardSpec {
        bind,
        port: lport,
        target,
    })
}

/// `tine vm forward`: listens locally and opens one WebSocket per accepted
/// connection, until Ctrl-C.
pub async fn forward(g: &GlobalArgs, c: &TineClient, args: ForwardArgs) -> anyhow::Result<i32> {
    let specs = args
        .local
        .iter()
        .map(|s| parse_forward(s))
        .collect::<Result<Vec<_>, _>>()?;
    // Fail now, not at the first connection, when the VM does not exist.
    let vm = c.describe(&args.vm).await?.hostname;
    let mut listeners = Vec::new();
    for spec in specs {
        let listener = tokio::net::TcpListener::bind((spec.bind.as_str(), spec.port))
            .await
            .with_context(|| format!("cannot listen on {}:{}", spec.bind, spec.port))?;
        let local = listener.local_addr()?;
        if !g.quiet && !g.json {
            eprintln!("forwarding {local} to {vm} {}", spec.target);
        } else if g.quiet {
            println!("{local}");
        }
        listeners.push((listener, spec.target));
    }
    for (listener, target) in listeners {
        let c = c.clone();
        let vm = vm.clone();
        tokio::spawn(async move {
            loop {
                let (stream, peer) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        eprintln!("tine: accept failed: {e}");
                        continue;
                    }
                };
                let c = c.clone();
                let vm = vm.clone();
                let target = target.clone();
                tokio::spawn(async move {
                    let result = match c.forward(&vm, &target).await {
                        Ok(conn) => conn.bridge(stream).await,
                        Err(e) => Err(e),
                    };
                    if let Err(e) = result {
                        let e = anyhow::Error::new(e).context(format!("{peer} to {target}"));
                        eprintln!("{}", exit::message_for(&e));
                    }
                });
            }
        });
    }
    tokio::signal::ctrl_c()
        .await
        .context("cannot wait for Ctrl-C")?;
    Ok(exit::OK)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(host: Option<&str>, port: u16) -> ForwardTarget {
        ForwardTarget::Tcp {
            host: host.map(str::to_string),
            port,
        }
    }

    #[test]
    fn forward_specs_parse() {
        let spec = |s: &str| parse_forward(s).unwrap_or_else(|e| panic!("{s}: {e}"));
        assert_eq!(
            spec("8080:80"),
            ForwardSpec {
                bind: "127.0.0.1".into(),
                port: 8080,
                target: tcp(None, 80)
            }
        );
        assert_eq!(spec("8080:db:5432").target, tcp(Some("db"), 5432));
        assert_eq!(spec("8080:db:5432").bind, "127.0.0.1");
        let s = spec("0.0.0.0:8080:80");
        assert_eq!(
            (s.bind.as_str(), s.port, s.target),
            ("0.0.0.0", 8080, tcp(None, 80))
        );
        let s = spec("0.0.0.0:8080:10.0.0.5:80");
        assert_eq!(
            (s.bind.as_str(), s.target),
            ("0.0.0.0", tcp(Some("10.0.0.5"), 80))
        );
        assert_eq!(
            spec("9000:/run/docker.sock").target,
            ForwardTarget::Unix("/run/docker.sock".into())
        );
        let s = spec("127.0.0.2:9000:/run/x.sock");
        assert_eq!((s.bind.as_str(), s.port), ("127.0.0.2", 9000));
        for bad in [
            "80",
            "x:80",
            "8080:x",
            "1:2:3:4:5",
            ":8080:80",
            "70000:80",
            "8080::80",
        ] {
            assert!(parse_forward(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn cp_sides_parse() {
        assert_eq!(
            parse_side("dev-1:/etc/hosts").expect("remote"),
            Side::Remote {
                vm: "dev-1".into(),
                path: "/etc/hosts".into()
            }
        );
        assert_eq!(
            parse_side("./a:b").expect("local"),
            Side::Local("./a:b".into())
        );
        assert_eq!(parse_side("-").expect("stdio"), Side::Local("-".into()));
        assert_eq!(
            parse_side("/tmp/x").expect("abs"),
            Side::Local("/tmp/x".into())
        );
        assert!(parse_side("dev-1:relative").is_err());
        assert_eq!(base_name("/a/b/"), Some("b"));
        assert_eq!(base_name("/"), None);
    }

    #[test]
    fn exit_statuses_follow_the_shell_convention() {
        assert_eq!(exit_status(Some(0), None), 0);
        assert_eq!(exit_status(Some(42), None), 42);
        assert_eq!(exit_status(None, Some(9)), 137);
        assert_eq!(exit_status(None, None), 1);
    }

    #[test]
    fn exit_statuses_survive_signal_numbers_from_a_hostile_guest() {
        assert_eq!(exit_status(None, Some(i32::MAX)), exit::API_ERROR);
        assert_eq!(exit_status(None, Some(i32::MIN)), exit::API_ERROR);
        assert_eq!(exit_status(None, Some(0)), exit::API_ERROR);
        assert_eq!(exit_status(None, Some(127)), 255);
        assert_eq!(exit_status(Some(i32::MAX), Some(i32::MAX)), i32::MAX);
    }

    #[test]
    fn shell_flag_joins_the_words() {
        use clap::Parser;
        let parse = |args: &[&str]| {
            let cli =
                crate::cli::Cli::try_parse_from(["tine", "vm", "exec", "dev-1"].iter().chain(args))
                    .expect("parse");
            match cli.command {
                crate::cli::Command::Vm {
                    command: crate::cli::VmCommand::Exec(e),
                } => exec_options(&e),
                other => panic!("not exec: {other:?}"),
            }
        };
        let o = parse(&["--shell", "--", "ls", "|", "wc", "-l"]);
        assert_eq!(
            (o.cmd.as_str(), o.args.len(), o.shell),
            ("ls | wc -l", 0, Some(true))
        );
        let o = parse(&["--", "ls", "-la"]);
        assert_eq!(
            (o.cmd.as_str(), o.args, o.shell),
            ("ls", vec!["-la".to_string()], None)
        );
    }

    #[test]
    fn pack_writes_relative_names() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(dir.path().join("sub")).expect("mkdir");
        std::fs::write(dir.path().join("sub/a.txt"), b"a").expect("write");
        let mut out = Vec::new();
        pack(dir.path(), &mut out).expect("pack");
        let mut archive = tar::Archive::new(out.as_slice());
        let names: Vec<String> = archive
            .entries()
            .expect("entries")
            .map(|e| {
                e.expect("entry")
                    .path()
                    .expect("path")
                    .display()
                    .to_string()
            })
            .collect();
        assert!(names.iter().any(|n| n.ends_with("sub/a.txt")), "{names:?}");
        assert!(names.iter().all(|n| !n.starts_with('/')), "{names:?}");
    }
}
