//! Page-locked memory freed later: a dropped `HostMem`'s, whose copies were
//! still in flight, waits here with the events after those copies, and is freed once they have
//! fired (never under a copy). The device holds the list; `HostMem::new` and `Stream::synchronize`
//! free what is done, and the device's drop waits for the rest (a `Device::cuda` device lives as
//! long as the process: its list is emptied by those checks alone).

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::base::sync;
use crate::core::capturing;
use crate::storage::backend::{Backend, RawEvent};

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
        // What is done leaves the list under the lock, and is freed after it: a free may wait for
        // the device, and other threads' checks need not wait behind it.
        let mut done = Vec::new();
        {
            let mut list = sync::lock(&self.list);
            let mut i = 0;
            while i < list.len() {
                let entry = &mut list[i];
                let mut j = 0;
                while j < entry.after.len() {
                    let event = &entry.after[j];
                    let fired = if wait {
                        backend.wait_host(event).map(|()| true)
                    } else {
                        backend.event_done(event)
                    };
                    match fired {
                        Ok(true) => backend.drop_event(entry.after.swap_remove(j)),
                        Ok(false) => j += 1,
                        Err(e) => {
                            tracing::error!(error = %e, "asking whether a host copy is done failed: its memory is kept");
                            j += 1;
                        }
                    }
                }
                if entry.after.is_empty() {
                    done.push(list.swap_remove(i));
                } else {
                    i += 1;
                }
            }
            self.waiting.store(list.len(), Ordering::Release);
        }
        let mut failed = Vec::new();
        for entry in done {
            // SAFETY: allocated by this device's backend with `alloc_pinned(bytes)` for a
            // `HostMem` that is gone; every copy of it is done (its events fired); it left the
            // list above, so it is freed once (or goes back to the list, unfreed).
            if let Err(e) = unsafe { backend.free_pinned(entry.ptr.0, entry.bytes) } {
                // A capture elsewhere on this thread (cudarc's, in global mode) may refuse it:
                // kept for a later check, never lost.
                tracing::warn!(error = %e, "freeing page-locked memory failed: kept for the next check");
                failed.push(entry);
            }
        }
        if !failed.is_empty() {
            let mut list = sync::lock(&self.list);
            list.extend(failed);
            self.waiting.store(list.len(), Ordering::Release);
        }
    }
}
