//! Page-locked memory freed later: a dropped `HostMem`'s, whose copies were
//! still in flight, waits here with the events after those copies, and is freed once they have
//! fired (never under a copy). The device holds the list; `HostMem::new` and `Stream::synchronize`
//! free what is done, and the device's drop waits for the rest.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::backend::{Backend, RawEvent};
use crate::capturing;
use crate::sync;

/// The address of memory being freed, moved into the deferred free.
pub(crate) struct PinnedPtr(pub(crate) *mut u8);

// SAFETY: the address of page-locked memory whose `HostMem` is gone: nothing else holds it, and
// it is only freed (through the backend, from any thread), never read or written.
unsafe impl Send for PinnedPtr {}

/// Page-locked memory of dropped `HostMem`s whose copies were in flight, with the events after
/// those copies: freed once every event has fired, never under a copy. One list per device.
#[derive(Default)]
pub(crate) struct DeferredFrees {
    /// Entries waiting: the checks' fast test, without the lock.
    waiting: AtomicUsize,
    list: sync::Mutex<Vec<DeferredFree>>,
}

/// One dropped `HostMem`'s memory and the events after its copies.
pub(crate) struct DeferredFree {
    pub(crate) ptr: PinnedPtr,
    pub(crate) bytes: usize,
    pub(crate) after: Vec<RawEvent>,
}

impl DeferredFrees {
    pub(crate) fn defer(&self, free: DeferredFree) {
        let mut list = sync::lock(&self.list);
        list.push(free);
        self.waiting.store(list.len(), Ordering::Release);
    }

    /// Entries waiting for their copies.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// Frees the memory whose copies are done (asking each event, without waiting).
    pub(crate) fn free_done(&self, backend: &dyn Backend) {
        if self.waiting() != 0 {
            self.free(backend, false);
        }
    }

    /// Frees what is listed: once its events have fired, or after waiting for them (`wait`, when
    /// the device goes). A query or wait that fails keeps the memory (leaked, never freed under a
    /// copy). Nothing while a pool capture is under way on this thread: a free would break it.
    pub(crate) fn free(&self, backend: &dyn Backend, wait: bool) {
        if capturing::on_this_thread() {
            return;
        }
        let mut list = sync::lock(&self.list);
        list.retain_mut(|entry| {
            let mut i = 0;
            while i < entry.after.len() {
                let event = &entry.after[i];
                let done = if wait {
                    backend.wait_host(event).map(|()| true)
                } else {
                    backend.event_done(event)
                };
                match done {
                    Ok(true) => backend.drop_event(entry.after.swap_remove(i)),
                    Ok(false) => i += 1,
                    Err(e) => {
                        tracing::error!(error = %e, "asking whether a host copy is done failed: its memory is kept");
                        i += 1;
                    }
                }
            }
            if !entry.after.is_empty() {
                return true;
            }
            // SAFETY: allocated by this device's backend with `alloc_pinned(bytes)` for a
            // `HostMem` that is gone; every copy of it is done (its events fired); it leaves the
            // list here, so it is freed once.
            if let Err(e) = unsafe { backend.free_pinned(entry.ptr.0, entry.bytes) } {
                tracing::error!(error = %e, "freeing page-locked memory failed");
            }
            false
        });
        self.waiting.store(list.len(), Ordering::Release);
    }
}
