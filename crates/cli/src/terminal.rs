//! The local terminal: raw mode for `vm shell` (restored on drop, so on
//! every exit path including errors and panics) and its size.

use std::io::IsTerminal;
use std::os::fd::AsFd;

use anyhow::Context;
use nix::sys::termios::{self, SetArg, Termios};

/// Puts stdin's terminal in raw mode until dropped.
pub struct RawMode {
    saved: Termios,
}

impl RawMode {
    /// Enters raw mode; `None` when stdin is not a terminal.
    pub fn enable() -> anyhow::Result<Option<Self>> {
        let stdin = std::io::stdin();
        if !stdin.is_terminal() {
            return Ok(None);
        }
        let saved = termios::tcgetattr(stdin.as_fd()).context("cannot read the terminal mode")?;
        let mut raw = saved.clone();
        termios::cfmakeraw(&mut raw);
        termios::tcsetattr(stdin.as_fd(), SetArg::TCSANOW, &raw)
            .context("cannot put the terminal in raw mode")?;
        Ok(Some(Self { saved }))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        // Nothing more can be done if restoring fails than to say so (the
        // shell said goodbye already): `stty sane` mends it.
        if let Err(e) = termios::tcsetattr(std::io::stdin().as_fd(), SetArg::TCSADRAIN, &self.saved)
        {
            eprintln!("tine: cannot restore the terminal's mode (`stty sane` does): {e}");
        }
    }
}

/// The terminal's (rows, columns), from stdout or stdin; `None` when
/// neither is a terminal.
pub fn size() -> Option<(u16, u16)> {
    for fd in [libc::STDOUT_FILENO, libc::STDIN_FILENO] {
        let mut ws = libc::winsize {
            ws_row: 0,
            ws_col: 0,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCGWINSZ writes one `winsize` through the pointer, which
        // points at a live, properly aligned local; a bad fd only fails.
        let rc = unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws as *mut libc::winsize) };
        if rc == 0 && ws.ws_row > 0 && ws.ws_col > 0 {
            return Some((ws.ws_row, ws.ws_col));
        }
    }
    None
}
