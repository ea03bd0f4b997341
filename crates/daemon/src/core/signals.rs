//! Change signals per VM. A waiter (a fork's `--wait`, a stop waiting for
//! its process) re-reads the store only when the VM it waits on changed:
//! N forks waiting at once cost N reads per change of one of them, not one
//! read each per change of any VM (N² under a burst, all on the store's
//! one connection).

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::sync::watch;

/// Channels kept before those nobody waits on are dropped on subscribe.
const PRUNE_AT: usize = 256;

/// One channel per VM somebody waits on; none for the others.
#[derive(Debug, Default)]
pub(super) struct VmSignals {
    channels: Mutex<HashMap<String, watch::Sender<u64>>>,
}

impl VmSignals {
    fn channels(&self) -> std::sync::MutexGuard<'_, HashMap<String, watch::Sender<u64>>> {
        self.channels.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A receiver that sees every change of `hostname` signalled from now
    /// on. Subscribe before reading what it guards, so that no change
    /// falls between the read and the wait.
    pub fn subscribe(&self, hostname: &str) -> watch::Receiver<u64> {
        let mut channels = self.channels();
        if channels.len() >= PRUNE_AT {
            // Waiters that timed out on VMs that never changed again.
            channels.retain(|_, tx| tx.receiver_count() > 0);
        }
        channels
            .entry(hostname.to_owned())
            .or_insert_with(|| watch::channel(0).0)
            .subscribe()
    }

    /// Wakes the waiters of `hostname`; forgets its channel once nobody
    /// waits on it.
    pub fn notify(&self, hostname: &str) {
        let mut channels = self.channels();
        if let Some(tx) = channels.get(hostname) {
            if tx.receiver_count() == 0 {
                channels.remove(hostname);
            } else {
                tx.send_modify(|n| *n = n.wrapping_add(1));
            }
        }
    }

    /// Wakes every waiter (a change that may touch any VM, e.g. a
    /// reconcile); forgets the channels nobody waits on.
    pub fn notify_all(&self) {
        self.channels().retain(|_, tx| {
            tx.send_modify(|n| *n = n.wrapping_add(1));
            tx.receiver_count() > 0
        });
    }

    /// How many VMs are waited on (for tests).
    #[cfg(test)]
    pub fn waited_on(&self) -> usize {
        self.channels().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_waiter_wakes_for_its_own_vm_only() {
        let signals = VmSignals::default();
        let mut a = signals.subscribe("a");
        let b = signals.subscribe("b");
        signals.notify("a");
        assert!(a.has_changed().expect("open"));
        assert!(!b.has_changed().expect("open"));
        a.borrow_and_update();
        signals.notify_all();
        assert!(a.has_changed().expect("open"));
        assert!(b.has_changed().expect("open"));
    }

    #[test]
    fn channels_go_once_nobody_waits() {
        let signals = VmSignals::default();
        let a = signals.subscribe("a");
        let b = signals.subscribe("b");
        // A VM nobody waits on gets no channel.
        signals.notify("c");
        assert_eq!(signals.waited_on(), 2);
        drop(a);
        signals.notify("a");
        assert_eq!(signals.waited_on(), 1);
        drop(b);
        signals.notify_all();
        assert_eq!(signals.waited_on(), 0);
    }
}
