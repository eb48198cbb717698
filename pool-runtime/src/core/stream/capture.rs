//! A stream's capture state: whether its own capture is under way, the epochs of its captures and
//! live graphs (what memory `core/deferred.rs` keeps for them), and what features noted for the
//! replays (`core/replay.rs`). The stack fences a graph reserves are `core/fence.rs`.

use std::any::Any;
use std::cell::{Cell, RefCell};

use crate::core::replay::ReplayHook;

use super::Stream;

/// A stream's capture state (one field of `Stream`).
#[derive(Default)]
pub(super) struct CaptureState {
    /// The stream's own capture is under way: nothing may reach the driver's allocator.
    capturing: Cell<bool>,
    /// Captures begun on this stream: the epoch a fallback or driver allocation is stamped with.
    captures_begun: Cell<u64>,
    /// The epochs of this stream's live graphs (each its capture's count when it began).
    live: RefCell<Vec<u64>>,
    /// What features noted for the replays of the capture under way (SharedMat's accesses).
    replay: RefCell<Option<Box<dyn ReplayHook>>>,
    /// The state of the feature that keeps graphs between calls (graphs by shape,
    /// `graph/shapes.rs`), dropped with the stream.
    kept_graphs: RefCell<Option<Box<dyn Any + Send>>>,
}

impl Stream {
    /// Whether this stream's own [`capture`](Stream::capture) is under way (not whether the
    /// driver records its CUDA stream: `Backend::is_capturing` says that).
    #[inline]
    pub(crate) fn in_own_capture(&self) -> bool {
        self.capture.capturing.get()
    }

    /// The slot of the feature that keeps graphs between calls.
    pub(crate) fn capture_slot(&self) -> &RefCell<Option<Box<dyn Any + Send>>> {
        &self.capture.kept_graphs
    }

    /// The epoch memory allocated now is stamped with.
    pub(super) fn capture_epoch(&self) -> u64 {
        self.capture.captures_begun.get()
    }

    /// Whether a live graph of this stream began its capture after `epoch`: its replays may use
    /// memory allocated then.
    pub(crate) fn graph_newer_than(&self, epoch: u64) -> bool {
        self.capture
            .live
            .borrow()
            .iter()
            .any(|&graph| graph > epoch)
    }

    /// Notes, in the hook of type `H` this stream's own capture holds (made on the first note),
    /// what its graph's replays must do.
    ///
    /// # Panics
    /// If the capture holds a hook of another type. A graph hands its launches to one hook, so
    /// one feature notes (SharedMat, the one implementation): a second would be a bug of this
    /// crate, not of its caller. It panics in every build rather than drop the note, which would
    /// let a replay run unordered against the accesses it was to be ordered after.
    #[cfg_attr(not(feature = "shared"), allow(dead_code))] // `SharedMat` is the one feature that notes
    pub(crate) fn note_for_replay<H: ReplayHook + Default>(&self, note: impl FnOnce(&mut H)) {
        let mut slot = self.capture.replay.borrow_mut();
        let hook: &mut dyn Any = &mut **slot.get_or_insert_with(|| Box::new(H::default()));
        let Some(hook) = hook.downcast_mut::<H>() else {
            panic!(
                "gpu-pool bug: two replay hook types noted in one capture (a graph replays \
                 through one); please report it"
            );
        };
        note(hook);
    }
}

#[cfg(feature = "cuda")]
impl Stream {
    /// This stream's own capture begins: nothing it takes may reach the driver's allocator.
    pub(crate) fn set_own_capture(&self, on: bool) {
        self.capture.capturing.set(on);
        if on {
            // What a failed capture noted: its work never runs.
            self.capture.replay.borrow_mut().take();
        }
    }

    /// What features noted for the replays of the capture that just ended, for its graph to hold.
    pub(crate) fn take_replay_hook(&self) -> Option<Box<dyn ReplayHook>> {
        let mut hook = self.capture.replay.borrow_mut().take()?;
        hook.capture_ended(self);
        Some(hook)
    }

    /// A capture begins: allocations from now on are of a later epoch than its graph's.
    pub(crate) fn capture_begun(&self) -> u64 {
        let epoch = self.capture.captures_begun.get() + 1;
        self.capture.captures_begun.set(epoch);
        epoch
    }

    /// A graph of the capture begun at `epoch` was made: memory allocated before that capture is
    /// kept, when released, until the graph is dropped.
    pub(crate) fn graph_made(&self, epoch: u64) {
        self.capture.live.borrow_mut().push(epoch);
    }

    /// The graph of `epoch` was dropped: what only it held is freed.
    pub(crate) fn graph_dropped(&self, epoch: u64) {
        let mut live = self.capture.live.borrow_mut();
        if let Some(i) = live.iter().position(|&e| e == epoch) {
            live.swap_remove(i);
        }
        drop(live);
        self.drain_deferred();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::device::Device;

    /// A hook type per `N`: two of them are two types.
    #[derive(Default)]
    struct Hook<const N: u8>;

    impl<const N: u8> ReplayHook for Hook<N> {
        #[cfg(feature = "cuda")]
        fn replay(
            &self,
            _: &'static str,
            _: &[(&Stream, Option<&dyn ReplayHook>)],
            _: &mut dyn FnMut(usize) -> Result<(), crate::base::error::PoolError>,
        ) -> Result<(), (usize, crate::base::error::PoolError)> {
            Ok(())
        }
    }

    #[test]
    #[should_panic(expected = "two replay hook types")]
    fn a_second_replay_hook_type_in_one_capture_panics_in_every_build() {
        let stream = Stream::new(&Device::private_host()).unwrap();
        stream.note_for_replay(|_: &mut Hook<1>| {});
        stream.note_for_replay(|_: &mut Hook<2>| {});
    }
}
