//! Which of a stream's host copies and shared-memory reads are known to be done without asking
//! the driver: each copy [`HostMem`](crate::HostMem) queues, and each end of a read of a
//! [`SharedMat`](crate::shared::SharedMat), takes a ticket, and a [`Stream::synchronize`] (or a download,
//! which waits for the stream's work up to its copy) covers every ticket taken before it began.
//!
//! An event after every copy would mark each precisely, but on an H100 a `cuEventRecord` queued
//! after a copy costs 300-700 ns of the host's time (`benches/copy`), on the path of the kernels
//! that follow an upload: about 2% of a 256x256 frame. A frame loop synchronizes its stream before
//! it touches the host memory again, and then a ticket answers for free.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::base::error::CaptureError;
use crate::base::error::PoolError;
use crate::storage::backend::{Backend, RawStream};

use super::Stream;

/// The ticket counters of one stream, shared with the `HostMem`s that copied on it (they may
/// outlive the stream, or live on another thread).
#[derive(Debug, Default)]
pub(crate) struct SyncClock {
    /// Tickets taken: the last copy noted is ticket `issued`.
    issued: AtomicU64,
    /// Every ticket up to this one is done: its copy was queued before a synchronize that
    /// returned.
    covered: AtomicU64,
}

impl SyncClock {
    /// A ticket for the copy just queued on the stream. SeqCst with `synchronize`'s load: a
    /// synchronize that reads this ticket began after the copy was queued.
    pub(crate) fn ticket(&self) -> u64 {
        self.issued.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// The last ticket taken: a wait that begins after this load covers it.
    pub(crate) fn issued(&self) -> u64 {
        self.issued.load(Ordering::SeqCst)
    }

    /// Every ticket up to `issued` (loaded before a wait for the stream began) is done: the wait
    /// returned.
    pub(crate) fn cover(&self, issued: u64) {
        self.covered.fetch_max(issued, Ordering::SeqCst);
    }

    /// Whether the copy of `ticket` is known done.
    pub(crate) fn is_done(&self, ticket: u64) -> bool {
        self.covered.load(Ordering::SeqCst) >= ticket
    }

    /// Waits on the host for everything queued on `raw` (the stream this clock counts), so for
    /// every ticket taken so far.
    pub(crate) fn synchronize(
        &self,
        backend: &dyn Backend,
        raw: &RawStream,
    ) -> Result<(), PoolError> {
        let issued = self.issued();
        backend.synchronize(raw)?;
        self.cover(issued);
        Ok(())
    }

    /// [`synchronize`](Self::synchronize), for a ticket's sake: `CaptureError::Elsewhere`
    /// (for `what`, which says when to ask again) while the stream captures a graph, where the
    /// driver refuses a synchronize (and it would end the capture). Nothing is lost: the wait can
    /// be asked again once the capture is over.
    pub(crate) fn synchronize_uncaptured(
        &self,
        backend: &dyn Backend,
        raw: &RawStream,
        stream_id: u64,
        what: &'static str,
    ) -> Result<(), PoolError> {
        if backend.is_capturing(raw)? {
            return Err(crate::core::graph_key::refusal(CaptureError::Elsewhere {
                what,
                stream: stream_id,
            }));
        }
        self.synchronize(backend, raw)
    }

    /// What a wait for a host copy is refused as, under a capture of its stream.
    pub(crate) const HOST_COPY: &'static str =
        "a wait for a host copy in flight (touch or drop the host memory after the capture ends)";
}

impl Stream {
    /// This stream's ticket counters, for the host copies queued on it.
    pub(crate) fn clock(&self) -> &Arc<SyncClock> {
        &self.clock
    }
}
