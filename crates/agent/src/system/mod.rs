//! The guest-system side of the agent.
//!
//! - [`reaper`]: the SIGCHLD-driven reaper. **Exec code must spawn through
//!   [`reaper::Reaper::spawn`] (or `register_with`) and read exit statuses
//!   from the returned [`reaper::ExitWatch`], never through `Child::wait`**:
//!   as PID 1 the reaper collects every child with `waitpid(-1)`.

pub mod reaper;
