//! Symmetric stacks: ranks that run the same pooled work take the same offsets, and a debug check
//! that says so.
//!
//! A stack hands out blocks by a bump in LIFO order, so the same takes in the same order from
//! stacks of the same config land at the same offsets on every rank, whatever the device. NCCL's
//! symmetric memory (a window registered on every rank) asks exactly that of the buffers a
//! collective uses; this check turns "should be" into "is", in debug builds, where a rank that
//! took one more buffer (a branch on rank-local data) shows up before NCCL reads the wrong bytes.

use crate::base::error::PoolError;
use crate::core::stack::LayoutTrace;
use crate::core::stream::Stream;

/// Checks that `streams` (one per rank, rank `i` at `streams[i]`) laid their stacks out alike:
/// the same blocks, at the same offsets, in the same order, with the same top now.
///
/// The traces cover each stream's whole history: once a rank took one buffer more, the check
/// fails for those streams from then on (which is what a window registered over them would see:
/// every later offset may differ). Compare streams made alike, run through the same steps.
///
/// A debug check, like OpenCV's LIFO assertions: in builds without debug assertions the stacks
/// record nothing and this returns `Ok(())`. Across processes, exchange
/// [`Stream::layout_trace`] (its [`to_bytes`](LayoutTrace::to_bytes)) and compare.
///
/// Errors: `PoolError::Asymmetric` naming the first rank that differs from rank 0 (a rank whose
/// stream has no stack, or took nothing from it yet, differs from one that did).
///
/// ```
/// use gpu_pool::{compat::opencv::BufferPool, Device, observe::check_symmetric, PoolError, Stream};
/// let ranks = [Stream::new(&Device::private_host())?, Stream::new(&Device::private_host())?];
/// let step = |s: &Stream, extra: bool| -> Result<(), PoolError> {
///     let a = BufferPool::new(s).get_buffer::<f32>(64, 64)?;
///     let b = extra.then(|| BufferPool::new(s).get_buffer_1d::<u8>(10)).transpose()?;
///     drop((b, a));
///     Ok(())
/// };
/// step(&ranks[0], false)?;
/// step(&ranks[1], false)?;
/// check_symmetric(&[&ranks[0], &ranks[1]])?;
/// step(&ranks[1], true)?; // one rank takes one more buffer
/// step(&ranks[0], false)?;
/// if cfg!(debug_assertions) {
///     assert!(matches!(check_symmetric(&[&ranks[0], &ranks[1]]), Err(PoolError::Asymmetric { rank: 1, .. })));
/// }
/// # Ok::<(), PoolError>(())
/// ```
pub fn check_symmetric(streams: &[&Stream]) -> Result<(), PoolError> {
    if !cfg!(debug_assertions) {
        return Ok(());
    }
    // A stream without a trace (no stack, or none taken yet) compares as an empty one with a
    // digest no stack can have, so it differs from every rank that took something.
    let nothing = LayoutTrace::from_bytes([0; 24]);
    let traces: Vec<LayoutTrace> = streams
        .iter()
        .map(|s| s.layout_trace().unwrap_or(nothing))
        .collect();
    let Some((first, rest)) = traces.split_first() else {
        return Ok(());
    };
    match rest.iter().position(|t| t != first) {
        None => Ok(()),
        Some(i) => {
            let t = rest[i];
            Err(PoolError::Asymmetric {
                rank: i + 1,
                takes: t.takes(),
                top: t.top(),
                digest: t.digest(),
                takes0: first.takes(),
                top0: first.top(),
                digest0: first.digest(),
            })
        }
    }
}
