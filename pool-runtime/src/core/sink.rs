//! The seam between a stream's take and release and what watches them: the recording of takes and
//! releases (read by `Device::recordings` and the timeline, in `observe/`) and the sizing of
//! demand (`Stream::measure`, `StreamStats::peak_demand`, in `stream/sizing.rs`).
//!
//! The stream holds a [`Sink`]; the hot path tests the same two flags it tested before the seam
//! (`records`, and the demand's `hooked`), so a stream that neither records nor is measured pays
//! nothing more. Everything behind them is cold: [`Stream::emit`](crate::Stream) for an [`Op`],
//! the `sizing.rs` hooks for the demand. What outlives a stream goes to its device's
//! [`DeviceSink`].

use std::collections::VecDeque;
use std::sync::Mutex;

use crate::base::source::{CallSite, Source};
use crate::base::sync;
use crate::core::record::{RecordKind, StreamRecording};
use crate::core::stream::Demand;

/// A stream's side of the seam.
#[derive(Debug, Default)]
pub(crate) struct Sink {
    /// The stream records its takes and releases (its ledger holds the ring).
    recording: bool,
    /// The stack the stream would have with unlimited room, where its demand is measured.
    pub(crate) demand: Demand,
}

impl Sink {
    /// The sink of a stream that records `record` events (0: none).
    pub(crate) fn new(record: usize) -> Sink {
        Sink {
            recording: record > 0,
            demand: Demand::default(),
        }
    }

    /// Whether takes and releases are emitted as [`Op`]s.
    #[inline(always)]
    pub(crate) fn records(&self) -> bool {
        self.recording
    }

    /// Whether a release has something to tell the sink: the stream records, or the unlimited
    /// stack holds blocks of its own. Part of the stream's `release_hooks` flag.
    pub(crate) fn wants_releases(&self) -> bool {
        self.recording || self.demand.holds_blocks()
    }
}

/// One take or release, as the stream emits it; the stream adds the time and its stack's state.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Op {
    pub(crate) kind: RecordKind,
    pub(crate) source: Source,
    /// Offset of the buffer in the stack (0 for other sources).
    pub(crate) offset: usize,
    pub(crate) bytes: usize,
    /// Who asked, for a take.
    pub(crate) site: Option<CallSite>,
}

impl Op {
    /// A take of `bytes` at `offset` of `source`, asked for at `site`.
    pub(crate) fn take(source: Source, offset: usize, bytes: usize, site: CallSite) -> Op {
        Op {
            kind: RecordKind::Take,
            source,
            offset,
            bytes,
            site: Some(site),
        }
    }

    /// A release of `bytes` at `offset` of `source`.
    pub(crate) fn release(source: Source, offset: usize, bytes: usize) -> Op {
        Op {
            kind: RecordKind::Release,
            source,
            offset,
            bytes,
            site: None,
        }
    }
}

/// How many dropped streams' recordings a device keeps.
const RETIRED_RECORDINGS: usize = 64;

/// A device's side of the seam: what its dropped streams recorded, the last
/// `RETIRED_RECORDINGS` of them. Its own lock: retiring a recording takes no device state.
#[derive(Debug, Default)]
pub(crate) struct DeviceSink {
    retired: Mutex<VecDeque<StreamRecording>>,
}

impl DeviceSink {
    /// Keeps the recording of a dropped stream, forgetting the oldest past the bound.
    pub(crate) fn retire(&self, recording: StreamRecording) {
        let mut retired = sync::lock(&self.retired);
        if retired.len() == RETIRED_RECORDINGS {
            retired.pop_front();
        }
        retired.push_back(recording);
    }

    /// The kept recordings, oldest first.
    pub(crate) fn retired(&self) -> Vec<StreamRecording> {
        sync::lock(&self.retired).iter().cloned().collect()
    }
}
