//! The seam between a graph and the features that order work inside its capture (today only
//! [`SharedMat`](crate::shared::SharedMat)'s accesses): while a stream's own capture runs, a
//! feature notes what each replay of the graph must do in a [`ReplayHook`] the stream holds; the
//! graph takes it when the capture ends and hands it back at every launch. Neither side names the
//! other: the graph sees only the trait, the feature only the stream.

use std::any::Any;

#[cfg(feature = "cuda")]
use crate::base::error::PoolError;
#[cfg(feature = "cuda")]
use crate::core::stream::Stream;

/// What a feature noted during a capture, for its graph's replays: each launch goes through
/// [`replay`](ReplayHook::replay), which queues the replays (with `launch`) ordered as the
/// feature needs.
///
/// Without the `cuda` feature there are no graphs: a hook is only noted (by code a capture runs,
/// which never does), never ended or replayed.
pub(crate) trait ReplayHook: Any + Send + Sync {
    /// The capture of `stream` that noted this ended (the stream is no longer captured): what it
    /// noted is final.
    #[cfg(feature = "cuda")]
    fn capture_ended(&mut self, _stream: &Stream) {}

    /// Queues `launch(i)` for each of `parts` in order, part `i` being the stream replay `i` is
    /// queued on and the hook its graph holds (of this hook's type, or none). Every refusal comes
    /// before anything is queued; an error comes with how many replays were queued before it.
    #[cfg(feature = "cuda")]
    fn replay(
        &self,
        what: &'static str,
        parts: &[(&Stream, Option<&dyn ReplayHook>)],
        launch: &mut dyn FnMut(usize) -> Result<(), PoolError>,
    ) -> Result<(), (usize, PoolError)>;
}

/// Queues the replays of `parts` (see [`ReplayHook::replay`]): through the hook of the first part
/// that has one, or, where none has (graphs of stream-owned memory only), directly, with nothing
/// allocated.
#[cfg(feature = "cuda")]
pub(crate) fn replay(
    what: &'static str,
    parts: &[(&Stream, Option<&dyn ReplayHook>)],
    launch: &mut dyn FnMut(usize) -> Result<(), PoolError>,
) -> Result<(), (usize, PoolError)> {
    match parts.iter().find_map(|(_, hook)| *hook) {
        Some(hook) => hook.replay(what, parts, launch),
        None => (0..parts.len()).try_for_each(|i| launch(i).map_err(|e| (i, e))),
    }
}
