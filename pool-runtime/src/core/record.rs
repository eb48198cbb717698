//! Recording: a bounded ring of take and release events per stream, opt-in
//! (`GPU_POOL_CONF=record=N` or [`Device::set_recording`](crate::Device::set_recording)). A stream
//! that does not record pays one predictable branch on a field it already has in cache.

use std::collections::VecDeque;
use std::sync::OnceLock;
use std::time::Instant;

use crate::base::id::DeviceId;
use crate::base::source::{CallSite, Source};

/// What happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordKind {
    /// A buffer was taken.
    Take,
    /// A buffer was given back.
    Release,
}

/// One take or release on a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordEntry {
    /// Nanoseconds since the first event of the process.
    pub t_ns: u64,
    /// Take or release.
    pub kind: RecordKind,
    /// Where the buffer's memory came from.
    pub source: Source,
    /// Offset of the buffer in the stack (0 for other sources).
    pub offset: usize,
    /// Bytes of the buffer (as the stack would reserve them).
    pub bytes: usize,
    /// Stack bytes in use after the event.
    pub stack_in_use: usize,
    /// Bytes of memory behind the stack after the event: a fixed stack's size, or what a
    /// growable stack has mapped.
    pub stack_mapped: usize,
    /// Who asked, for a take.
    pub site: Option<CallSite>,
}

/// The clock of every recording: nanoseconds since the first call.
pub(crate) fn now_ns() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// The last `capacity` events of one stream, and how many older ones were dropped.
#[derive(Clone, Debug)]
pub(crate) struct Ring {
    capacity: usize,
    events: VecDeque<RecordEntry>,
    dropped: u64,
}

impl Ring {
    pub(crate) fn new(capacity: usize) -> Ring {
        Ring {
            capacity,
            events: VecDeque::with_capacity(capacity.min(1 << 16)),
            dropped: 0,
        }
    }

    pub(crate) fn push(&mut self, event: RecordEntry) {
        if self.events.len() == self.capacity {
            self.events.pop_front();
            self.dropped += 1;
        }
        self.events.push_back(event);
    }

    pub(crate) fn events(&self) -> impl Iterator<Item = &RecordEntry> {
        self.events.iter()
    }

    pub(crate) fn dropped(&self) -> u64 {
        self.dropped
    }
}

/// What one stream recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StreamRecording {
    /// The stream's device.
    pub device: DeviceId,
    /// The stream ([`Stream::id`](crate::Stream::id)).
    pub stream: u64,
    /// Bytes of each stack of the device (0 when unknown).
    pub stack_size: usize,
    /// Events older than the ring kept.
    pub dropped: u64,
    /// The events, oldest first.
    pub events: Vec<RecordEntry>,
}

impl StreamRecording {
    pub(crate) fn of(device: DeviceId, stream: u64, ring: &Ring) -> StreamRecording {
        StreamRecording {
            device,
            stream,
            stack_size: 0,
            dropped: ring.dropped(),
            events: ring.events().copied().collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_keeps_the_last_events_and_counts_the_rest() {
        let mut ring = Ring::new(3);
        for t in 0..10 {
            ring.push(RecordEntry {
                t_ns: t,
                kind: RecordKind::Take,
                source: Source::Stack,
                offset: 0,
                bytes: 1,
                stack_in_use: 1,
                stack_mapped: 1,
                site: None,
            });
        }
        let kept: Vec<u64> = ring.events().map(|e| e.t_ns).collect();
        assert_eq!((kept, ring.dropped()), (vec![7, 8, 9], 7));
    }
}
