//! One deferred give-back: every release that cannot happen now goes through here, with the
//! condition it waits for ([`After`]), into a [`Queue`] of the one who keeps it.
//!
//! - The stream ([`Deferred`]): fallback and driver memory released while a graph of a later
//!   capture lives, a capture runs on this thread, or the stream is captured elsewhere
//!   ([`After::Epoch`]). Drained at a give-back that frees, a fallback take, a graph's drop, a
//!   capture's start and the stream's drop.
//! - The thread ([`after_captures`]): work that must not run inside a capture on this thread (a
//!   dropped stream's stack, shared memory, a `HostMem`, the cuBLAS workspace;
//!   [`After::CaptureEnd`]). Run when the thread's last pool capture ends.
//! - The device ([`DeviceDeferred`]): a dropped `HostMem`'s page-locked memory with copies in
//!   flight, and a dropped stream's growable stack, each after the events that end the work using
//!   it ([`After::Events`]). Checked at `HostMem::new` and each `Stream::synchronize`, waited for at
//!   the device's drop; a stack's event is waited for at once (as its stream's drop would have
//!   synchronized: a stack left queued would count as held and refuse a configuration change).
//!
//! The thread keeps its own queue because what waits there belongs to no stream: the stream that
//! dropped a stack is gone, and shared memory, a `HostMem` or a cuBLAS handle may outlive every
//! stream of the capture. The device's queue takes drops from any thread, so it is behind a lock
//! (one atomic load tells a check that nothing waits); the stream's and the thread's are
//! `RefCell`s of one thread. All three are the same [`Queue`] over what they give back.
//!
//! Three more things wait without being a give-back of anything held:
//! - Other streams' use of released memory (`record_stream`): waits the stream issues before it
//!   reuses memory ([`Stream::before_reuse`]); the memory itself goes back at once.
//! - A trim asked from another thread (`ledger.trim_requested`, honoured at the stream's next
//!   `synchronize`, `core/stack/growable.rs`): nothing is handed over (the mapping stays the
//!   stream's stack's until its own thread unmaps it), and the asker holds only the stream's
//!   `Ledger`, so it could not reach the stream's queue (a `RefCell` of the stream's thread)
//!   without a lock on every drain: it stays one atomic flag.
//! - A fixed stack handed back with an event (`return_stack`) goes back at once: the event
//!   orders its next stream's work after the last one's (a wait on the GPU); nothing waits on the
//!   host.
//!
//! Everything here is cold: the hot release tests the stream's one `release_hooks` flag.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::allocators::Allocation;
use crate::base::error::PoolError;
use crate::base::sync;
use crate::core::capturing;
use crate::core::device::DeviceInner;
use crate::core::stack::Stack;
use crate::core::stream::Stream;
use crate::storage::backend::{Backend, DevPtr, RawEvent};

/// What a deferred give-back waits for.
pub(crate) enum After {
    /// No live graph of the stream whose capture began after this epoch (the stream's capture
    /// count when the memory was allocated), no capture on this thread, and no capture of the
    /// stream begun elsewhere. Only a stream's queue keeps these.
    Epoch(u64),
    /// No pool capture on this thread.
    CaptureEnd,
    /// Every event has fired (the work after which the memory is unused is done), and no pool
    /// capture is on this thread (the give-back is a driver call). Fired events leave the list.
    Events(Vec<RawEvent>),
}

impl std::fmt::Debug for After {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            After::Epoch(epoch) => f.debug_tuple("Epoch").field(epoch).finish(),
            After::CaptureEnd => f.write_str("CaptureEnd"),
            After::Events(events) => write!(f, "Events({} pending)", events.len()),
        }
    }
}

impl After {
    /// Whether what waits for `self`, a condition of no stream (not an epoch), must wait still.
    /// Asks each event without blocking, or (`wait`) waits for it; fired events are dropped. A
    /// query or wait that fails keeps its event (what waits is then kept, never given back under
    /// work).
    // Without the cuda feature no event exists (`RawEvent` is empty): the list is always empty.
    #[cfg_attr(not(feature = "cuda"), allow(unreachable_code))]
    fn waits(&mut self, backend: &dyn Backend, wait: bool) -> bool {
        if capturing::on_this_thread() {
            return true;
        }
        match self {
            After::Epoch(_) => {
                debug_assert!(false, "an epoch is the stream's to check");
                true
            }
            After::CaptureEnd => false,
            After::Events(events) => {
                let mut i = 0;
                while i < events.len() {
                    let fired = if wait {
                        backend.wait_host(&events[i]).map(|()| true)
                    } else {
                        backend.event_done(&events[i])
                    };
                    match fired {
                        Ok(true) => backend.drop_event(events.swap_remove(i)),
                        Ok(false) => i += 1,
                        Err(e) => {
                            crate::base::event::error!(error = %e, "asking whether work is done failed: what waits for it is kept");
                            i += 1;
                        }
                    }
                }
                !events.is_empty()
            }
        }
    }
}

/// Give-backs of one keeper, each with what it waits for, in the order they came.
pub(crate) struct Queue<T> {
    entries: Vec<(After, T)>,
}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        Queue {
            entries: Vec::new(),
        }
    }
}

impl<T> Queue<T> {
    /// An empty queue, for a `static`/`thread_local!` initializer.
    const fn new() -> Queue<T> {
        Queue {
            entries: Vec::new(),
        }
    }

    pub(crate) fn push(&mut self, after: After, what: T) {
        self.entries.push((after, what));
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Takes out, in order, what no longer waits: `waits` says whether an entry must wait still
    /// (and may narrow its condition: an event found fired leaves it).
    pub(crate) fn take_ready(&mut self, mut waits: impl FnMut(&mut After) -> bool) -> Vec<T> {
        let mut ready = Vec::new();
        for (mut after, what) in std::mem::take(&mut self.entries) {
            if waits(&mut after) {
                self.entries.push((after, what));
            } else {
                ready.push(what);
            }
        }
        ready
    }

    /// Takes out everything, waiting or not (its keeper goes).
    pub(crate) fn take_all(&mut self) -> Vec<(After, T)> {
        std::mem::take(&mut self.entries)
    }
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
pub(crate) enum Memory {
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
    kept: RefCell<Queue<Memory>>,
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
    static AFTER_CAPTURES: RefCell<Queue<Box<dyn FnOnce()>>> = const { RefCell::new(Queue::new()) };
}

/// Runs `give_back` now, or once the pool captures under way on this thread have ended
/// ([`After::CaptureEnd`] in the thread's queue): what no stream owns (shared memory, a dropped
/// stream's stack) can go inside a capture, where a driver call would break it.
pub(crate) fn after_captures(give_back: Box<dyn FnOnce()>) {
    if capturing::on_this_thread() {
        AFTER_CAPTURES.with(|after| after.borrow_mut().push(After::CaptureEnd, give_back));
    } else {
        give_back();
    }
}

/// The last pool capture on this thread ended: what waited for it runs.
#[cfg(feature = "cuda")]
pub(crate) fn captures_ended() {
    let ready = AFTER_CAPTURES.with(|after| {
        after
            .borrow_mut()
            .take_ready(|_| capturing::on_this_thread())
    });
    for give_back in ready {
        give_back();
    }
}

/// The address of page-locked memory being freed, moved into the device's queue.
struct PinnedPtr(*mut u8);

// SAFETY: the address of page-locked memory whose `HostMem` is gone: nothing else holds it, and
// it is only freed (through the backend, from any thread), never read or written.
unsafe impl Send for PinnedPtr {}

/// What a device gives back for a `HostMem` or a stream that is gone.
pub(crate) struct GiveBack(Gone);

enum Gone {
    /// A dropped `HostMem`'s page-locked memory.
    Pinned { ptr: PinnedPtr, bytes: usize },
    /// A dropped stream's growable stack: unmapped, its reservation freed.
    GrowableStack(Stack),
}

impl GiveBack {
    /// A dropped `HostMem`'s memory.
    ///
    /// # Safety
    /// `ptr` was allocated by the device's backend with `alloc_pinned(bytes)`, its `HostMem` is
    /// gone, no other `GiveBack` is made of it, and nothing uses it once the [`After`] it is given
    /// back with holds.
    pub(crate) unsafe fn pinned(ptr: *mut u8, bytes: usize) -> GiveBack {
        GiveBack(Gone::Pinned {
            ptr: PinnedPtr(ptr),
            bytes,
        })
    }

    /// A dropped stream's growable stack.
    ///
    /// # Safety
    /// The stack's stream is gone (the stack retired), and its work is done once the [`After`] it
    /// is given back with holds.
    pub(crate) unsafe fn growable_stack(stack: Stack) -> GiveBack {
        GiveBack(Gone::GrowableStack(stack))
    }
}

/// A device's deferred give-backs, from any thread: `HostMem`s' memory and streams' stacks.
#[derive(Default)]
pub(crate) struct DeviceDeferred {
    /// Entries waiting: the checks' fast test, without the lock.
    waiting: AtomicUsize,
    queue: sync::Mutex<Queue<GiveBack>>,
}

impl DeviceDeferred {
    /// Gives `what` back once `after` (not an epoch) holds: now if it does (`wait`: after waiting
    /// for its events here), else at the device's next check.
    pub(crate) fn give_back_after(
        &self,
        device: &DeviceInner,
        mut after: After,
        what: GiveBack,
        wait: bool,
    ) {
        if after.waits(&*device.storage.backend, wait) {
            self.keep(after, what);
        } else {
            self.give_back_now(device, what);
        }
    }

    fn keep(&self, after: After, what: GiveBack) {
        let mut queue = sync::lock(&self.queue);
        queue.push(after, what);
        self.waiting.store(queue.len(), Ordering::Release);
    }

    /// Entries waiting.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    /// Gives back what no longer waits (asking each event, without waiting): one atomic load if
    /// nothing waits.
    pub(crate) fn give_back_done(&self, device: &DeviceInner) {
        if self.waiting() != 0 {
            self.check(device, false);
        }
    }

    /// Gives back what is queued: once its events have fired, or after waiting for them (`wait`,
    /// when the device goes). Nothing while a pool capture is under way on this thread.
    pub(crate) fn check(&self, device: &DeviceInner, wait: bool) {
        if capturing::on_this_thread() {
            return;
        }
        let backend = &*device.storage.backend;
        // What is done leaves the queue under the lock, and goes back after it: a free may wait
        // for the device, and other threads' checks need not wait behind it.
        let ready = {
            let mut queue = sync::lock(&self.queue);
            let ready = queue.take_ready(|after| after.waits(backend, wait));
            self.waiting.store(queue.len(), Ordering::Release);
            ready
        };
        for what in ready {
            self.give_back_now(device, what);
        }
    }

    /// Gives `what` back, its condition holding.
    fn give_back_now(&self, device: &DeviceInner, what: GiveBack) {
        match what.0 {
            Gone::Pinned { ptr, bytes } => {
                // SAFETY: allocated by this device's backend with `alloc_pinned(bytes)` for a
                // `HostMem` that is gone, and its copies are done (its condition held: the
                // constructor's contract); it left the queue, so it is freed once (or goes back
                // to the queue, unfreed).
                if let Err(e) = unsafe { device.storage.backend.free_pinned(ptr.0, bytes) } {
                    // A capture elsewhere on this thread (cudarc's, in global mode) may refuse
                    // it: kept for a later check, never lost.
                    crate::base::event::warn!(error = %e, "freeing page-locked memory failed: kept for the next check");
                    self.keep(
                        After::Events(Vec::new()),
                        GiveBack(Gone::Pinned { ptr, bytes }),
                    );
                }
            }
            // SAFETY: the stack's stream is gone and its work is done (the constructor's
            // contract, its condition holding).
            Gone::GrowableStack(stack) => unsafe { device.release_growable(stack) },
        }
    }
}

impl Stream {
    /// Gives `kept` back now, or once its condition holds.
    #[cold]
    pub(crate) fn give_back_after(&self, kept: Kept) -> Result<(), PoolError> {
        let Kept { memory, mut after } = kept;
        if self.must_wait(&mut after) {
            self.deferred().kept.borrow_mut().push(after, memory);
            return Ok(());
        }
        self.drain_deferred();
        self.give_back_now(memory)
    }

    /// Frees kept memory now. Its work is queued on this stream, which the allocator's free is
    /// ordered after (the driver's free synchronizes).
    fn give_back_now(&self, memory: Memory) -> Result<(), PoolError> {
        match memory {
            // SAFETY: a `Kept` owns its memory alone (its constructors' contract): the allocation
            // came from this stream's allocator, and the memory is consumed here, so it is freed
            // once.
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
    fn must_wait(&self, after: &mut After) -> bool {
        match after {
            After::Epoch(epoch) => {
                capturing::on_this_thread()
                    || self.graph_newer_than(*epoch)
                    || (!self.in_own_capture()
                        && self
                            .device()
                            .storage()
                            .backend
                            .is_capturing(self.raw())
                            .unwrap_or(true))
            }
            other => other.waits(self.device().backend(), false),
        }
    }

    /// Gives back what no longer waits.
    #[cold]
    pub(crate) fn drain_deferred(&self) {
        if !self.deferred().keeps_memory() {
            return;
        }
        let ready = self
            .deferred()
            .kept
            .borrow_mut()
            .take_ready(|after| self.must_wait(after));
        for memory in ready {
            if let Err(e) = self.give_back_now(memory) {
                crate::base::event::error!(stream = self.id(), error = %e, "freeing memory kept for a graph failed");
            }
        }
    }

    /// The stream goes: what it keeps is given back (`idle`: its work is done and no capture runs
    /// on this thread) or leaked, said so.
    pub(crate) fn drain_deferred_for_drop(&self, idle: bool) {
        let kept = self.deferred().kept.borrow_mut().take_all();
        if idle {
            // No graph of the stream is left (graphs borrow their stream).
            for (_, memory) in kept {
                if let Err(e) = self.give_back_now(memory) {
                    crate::base::event::error!(stream = self.id(), error = %e, "freeing kept memory failed");
                }
            }
        } else if !kept.is_empty() {
            crate::base::event::error!(
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The queue's one rule: an entry leaves once its condition no longer holds, in the order the
    /// entries came, and one that waits stays (with its condition as `waits` narrowed it).
    #[test]
    fn a_queue_hands_out_what_no_longer_waits_in_order_and_keeps_the_rest() {
        let mut queue = Queue::default();
        for (epoch, what) in [(3, 'a'), (1, 'b'), (5, 'c'), (2, 'd')] {
            queue.push(After::Epoch(epoch), what);
        }
        let mut done = 2;
        let mut waits = |after: &mut After| matches!(after, After::Epoch(e) if *e > done);
        assert_eq!(queue.take_ready(&mut waits), ['b', 'd']);
        assert_eq!(queue.len(), 2);
        assert!(queue.take_ready(&mut waits).is_empty(), "nothing changed");
        done = 3;
        let mut waits = |after: &mut After| matches!(after, After::Epoch(e) if *e > done);
        assert_eq!(queue.take_ready(&mut waits), ['a']);
        let rest = queue.take_all();
        assert!(matches!(rest[..], [(After::Epoch(5), 'c')]), "{rest:?}");
        assert!(queue.is_empty());
    }

    /// `After::Events` in the device's queue: page-locked memory whose events have fired (none
    /// left) still waits while a pool capture runs on this thread (the free is a driver call), and
    /// goes back at the device's first check after it.
    #[cfg(feature = "cuda")]
    #[test]
    fn the_device_gives_back_after_events_and_never_inside_a_capture() -> Result<(), PoolError> {
        let device = crate::Device::private_host();
        let backend = device.backend();
        let live = || backend.live_bytes().expect("the host backend counts");
        let before = live();
        let ptr = backend.alloc_pinned(4096)?;
        assert!(live() > before);
        let capture = capturing::ThreadCapture::begin();
        // SAFETY: from this backend's `alloc_pinned(4096)`, given back once, used by nothing.
        let memory = unsafe { GiveBack::pinned(ptr, 4096) };
        let queue = &device.inner.deferred;
        queue.give_back_after(&device.inner, After::Events(Vec::new()), memory, false);
        assert_eq!(queue.waiting(), 1, "kept: a capture runs on this thread");
        queue.give_back_done(&device.inner);
        assert_eq!(
            queue.waiting(),
            1,
            "a check inside the capture frees nothing"
        );
        assert!(live() > before);
        drop(capture);
        queue.give_back_done(&device.inner);
        assert_eq!(queue.waiting(), 0);
        assert_eq!(live(), before, "freed after the capture");
        Ok(())
    }

    /// `After::CaptureEnd` in the thread's queue: a `HostMem` dropped inside a pool capture on its
    /// thread keeps its memory until the capture ends, then frees it (its copies done: the host
    /// backend's are done when queued) without the device's queue.
    #[cfg(feature = "cuda")]
    #[test]
    fn host_memory_dropped_inside_a_capture_waits_in_the_threads_queue() -> Result<(), PoolError> {
        let device = crate::Device::private_host();
        let live = || {
            device
                .backend()
                .live_bytes()
                .expect("the host backend counts")
        };
        let before = live();
        let mem = crate::HostMem::<u8>::new(&device, 1000)?;
        let capture = capturing::ThreadCapture::begin();
        drop(mem);
        assert!(live() > before, "nothing is freed inside a capture");
        drop(capture);
        assert_eq!(live(), before, "freed when the capture ended");
        assert_eq!(device.inner.deferred.waiting(), 0);
        Ok(())
    }
}
