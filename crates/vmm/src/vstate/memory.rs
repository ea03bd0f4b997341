//! Guest memory.
//!
//! Guest RAM is one or two regions (the second above 4 GiB when RAM reaches
//! into the 32-bit MMIO hole), mapped from a single file descriptor:
//! - a fresh VM maps a memfd `MAP_SHARED`, so the snapshot writer can read
//!   the pages straight from the fd and skip holes (`SEEK_DATA`): a snapshot
//!   copies only pages the guest touched;
//! - a restored VM maps the snapshot's memory file `MAP_PRIVATE`: pages are
//!   shared through the page cache by every VM restored from it and copied
//!   only when written, so a fork costs no copy up front.

/// The guest memory type used throughout the VMM.
pub type GuestMemoryMmap = vm_memory::GuestMemoryMmap<()>;
