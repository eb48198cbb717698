//! One deferred give-back: the releases a stream or a thread cannot do now go through here, with the
//! condition it waits for ([`After`]).
//!
//! - Fallback and driver memory released while a graph whose capture began after its allocation
//!   lives (its replays may use it), or while a capture is under way on this thread (a driver
//!   free would break it): [`After::Epoch`], kept by the stream.
//! - Work that must not run inside a capture on this thread (a dropped stream's growable stack,
//!   shared memory, a HostMem, the cuBLAS workspace): [`after_captures`], kept by the thread.
//! - Other streams' use of released memory (`record_stream`): waits the stream issues before it
//!   reuses memory ([`Stream::before_reuse`]).
//!
//! The stream's part is drained at a give-back that frees, at a fallback take, when a graph goes,
//! before a capture begins and at the stream's drop; the thread's when its captures end.
//! Everything here is cold: the hot release tests the stream's one `release_hooks` flag.
//!
//! Not yet here: HostMem's event-keyed frees (`core/pinned.rs`, kept by the device), a trim asked
//! from another thread (`ledger.trim_requested`) and the event a stack goes back with.

use std::cell::{Cell, RefCell};

use crate::allocators::Allocation;
use crate::base::error::PoolError;
use crate::core::capturing;
use crate::core::stream::Stream;
use crate::storage::backend::{DevPtr, RawEvent};

/// What a deferred give-back waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum After {
    /// No live graph of the stream whose capture began after this epoch (the stream's capture
    /// count when the memory was allocated), no capture on this thread, and no capture of the
    /// stream begun elsewhere.
    Epoch(u64),
    // What waits for the thread's captures alone to end is no stream's: [`after_captures`].
}

/// Memory of a released buffer that could not be given back yet.
///
/// Made only from what a lease gave up (`lease.rs`; the constructors are `unsafe` and say so), and
/// neither `Copy` nor `Clone`: it owns its memory alone, so freeing it needs nothing of the caller.
#[derive(Debug)]
pub(crate) struct Kept {
    memory: Memory,
    after: After,
}

/// Where kept memory came from, and so how it is freed.
#[derive(Debug)]
enum Memory {
    /// From the stream's fallback allocator.
    Fallback(Allocation),
    /// From `cuMemAlloc`/`cuMemAllocPitch` ([`DeviceMat::new`](crate::compat::opencv::DeviceMat::new)).
    Driver(DevPtr),
}

impl Kept {
    /// What a fallback lease held, allocated at the stream's capture count `epoch`.
    ///
    /// # Safety
    /// `allocation` came from this stream's allocator, its lease gave it up, and no other `Kept`
    /// is made of it: the `Kept` owns it alone.
    pub(crate) unsafe fn fallback(allocation: Allocation, epoch: u64) -> Kept {
        Kept {
            memory: Memory::Fallback(allocation),
            after: After::Epoch(epoch),
        }
    }

    /// What a driver lease held.
    ///
    /// # Safety
    /// As for [`Kept::fallback`]: `ptr` came from `take_from_driver` on this stream, its lease gave
    /// it up, and no other `Kept` is made of it.
    pub(crate) unsafe fn driver(ptr: DevPtr, epoch: u64) -> Kept {
        Kept {
            memory: Memory::Driver(ptr),
            after: After::Epoch(epoch),
        }
    }
}

/// A stream's deferred give-backs.
#[derive(Default)]
pub(crate) struct Deferred {
    /// Memory waiting for its condition.
    kept: RefCell<Vec<Kept>>,
    /// Events after other streams' use of this stream's memory: waited for (on the GPU) before
    /// memory released now is reused.
    waits: RefCell<Vec<RawEvent>>,
    /// Whether `waits` is non-empty, read by every release that has hooks.
    any_waits: Cell<bool>,
}

impl Deferred {
    /// Whether waits are pending.
    pub(crate) fn any_waits(&self) -> bool {
        self.any_waits.get()
    }

    /// Whether memory is kept.
    pub(crate) fn keeps_memory(&self) -> bool {
        !self.kept.borrow().is_empty()
    }
}

thread_local! {
    /// Work deferred until no pool capture is under way on this thread ([`after_captures`]).
    static AFTER_CAPTURES: RefCell<Vec<Box<dyn FnOnce()>>> = const { RefCell::new(Vec::new()) };
}

/// Runs `give_back` now, or once the pool captures under way on this thread have ended: what no
/// stream owns (shared memory, a dropped stream's stack) can go inside a capture, where a driver
/// call would break it.
pub(crate) fn after_captures(give_back: Box<dyn FnOnce()>) {
    if capturing::on_this_thread() {
        AFTER_CAPTURES.with(|after| after.borrow_mut().push(give_back));
    } else {
        give_back();
    }
}

/// The last pool capture on this thread ended: what waited for it runs.
#[cfg(feature = "cuda")]
pub(crate) fn captures_ended() {
    let deferred = AFTER_CAPTURES.with(|after| std::mem::take(&mut *after.borrow_mut()));
    for give_back in deferred {
        give_back();
    }
}

impl Stream {
    /// Gives `kept` back now, or once its condition holds.
    #[cold]
    pub(crate) fn give_back_after(&self, kept: Kept) -> Result<(), PoolError> {
        if self.must_wait(kept.after) {
            self.deferred().kept.borrow_mut().push(kept);
            return Ok(());
        }
        self.drain_deferred();
        self.give_back_now(kept)
    }

    /// Frees kept memory now. Its work is queued on this stream, which the allocator's free is
    /// ordered after (the driver's free synchronizes).
    fn give_back_now(&self, kept: Kept) -> Result<(), PoolError> {
        match kept.memory {
            // SAFETY: a `Kept` owns its memory alone (its constructors' contract): the allocation
            // came from this stream's allocator, and `kept` is consumed here, so it is freed once.
            Memory::Fallback(allocation) => unsafe {
                self.allocator()
                    .deallocate(&self.alloc_context(), allocation)
            },
            // SAFETY: as above; `ptr` came from `take_from_driver` on this stream's device.
            Memory::Driver(ptr) => unsafe {
                self.device().storage().free(ptr, Some(self.counters()))
            },
        }
    }

    /// Whether what waits for `after` must wait still.
    fn must_wait(&self, after: After) -> bool {
        match after {
            After::Epoch(epoch) => {
                capturing::on_this_thread()
                    || self.graph_newer_than(epoch)
                    || (!self.in_own_capture()
                        && self
                            .device()
                            .storage()
                            .backend
                            .is_capturing(self.raw())
                            .unwrap_or(true))
            }
        }
    }

    /// Gives back what no longer waits.
    #[cold]
    pub(crate) fn drain_deferred(&self) {
        if !self.deferred().keeps_memory() {
            return;
        }
        let kept = std::mem::take(&mut *self.deferred().kept.borrow_mut());
        for k in kept {
            if self.must_wait(k.after) {
                self.deferred().kept.borrow_mut().push(k);
                continue;
            }
            if let Err(e) = self.give_back_now(k) {
                tracing::error!(stream = self.id(), error = %e, "freeing memory kept for a graph failed");
            }
        }
    }

    /// The stream goes: what it keeps is given back (`idle`: its work is done and no capture runs
    /// on this thread) or leaked, said so.
    pub(crate) fn drain_deferred_for_drop(&self, idle: bool) {
        let kept = std::mem::take(&mut *self.deferred().kept.borrow_mut());
        if idle {
            // No graph of the stream is left (graphs borrow their stream).
            for k in kept {
                if let Err(e) = self.give_back_now(k) {
                    tracing::error!(stream = self.id(), error = %e, "freeing kept memory failed");
                }
            }
        } else if !kept.is_empty() {
            tracing::error!(
                stream = self.id(),
                blocks = kept.len(),
                "a stream dropped with work nobody could wait for: its kept fallback memory is leaked"
            );
        }
    }

    /// Work queued so far on another stream used this stream's memory (`event` marks its end):
    /// memory released from now on is reused only after it.
    pub(crate) fn before_reuse(&self, event: RawEvent) {
        self.deferred().waits.borrow_mut().push(event);
        self.deferred().any_waits.set(true);
        self.set_release_hooks();
    }

    /// Makes this stream wait for every recorded use, so memory released now is reused (in this
    /// stream's order) only after that work. A wait that fails stays queued with every one after
    /// it: the memory a caller would release is held, and the next release tries them again.
    #[cold]
    pub(crate) fn issue_deferred_waits(&self) -> Result<(), PoolError> {
        let backend = self.device().backend();
        let mut waits = self.deferred().waits.borrow_mut();
        let mut issued = 0;
        let mut result = Ok(());
        for event in waits.iter() {
            result = backend.wait_for(self.raw(), event);
            if result.is_err() {
                break;
            }
            issued += 1;
        }
        for event in waits.drain(..issued) {
            backend.drop_event(event);
        }
        let any = !waits.is_empty();
        drop(waits);
        self.deferred().any_waits.set(any);
        self.set_release_hooks();
        result
    }
}
