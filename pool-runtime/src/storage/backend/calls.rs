//! How many driver calls this thread made through the pool, by kind: what tests use to prove that
//! a path asks nothing of the driver, and what the apps print per request beside their cudarc
//! twins. One thread-local cell per kind (a plain add, no atomic); only the CUDA backend counts.

use std::cell::Cell;

/// The kinds counted, in [`DriverCalls`]' field order.
#[derive(Clone, Copy)]
pub(crate) enum Call {
    EventRecord,
    StreamWait,
    HostWait,
    CaptureQuery,
    Copy,
    Memory,
    Other,
}

const KINDS: usize = 7;

thread_local! {
    static CALLS: [Cell<u64>; KINDS] = const { [const { Cell::new(0) }; KINDS] };
}

/// Counts one driver call of `kind` on this thread (only the CUDA backend makes driver calls).
#[cfg(feature = "cuda")]
#[inline]
pub(crate) fn count(kind: Call) {
    CALLS.with(|calls| {
        let c = &calls[kind as usize];
        c.set(c.get().wrapping_add(1));
    });
}

/// The driver calls the pool made on one thread, by kind, since the thread began
/// ([`DriverCalls::on_this_thread`]); subtract two snapshots with [`DriverCalls::since`] for the
/// calls of a stretch of code. Calls made through cudarc directly (kernel launches, cuBLAS, a
/// user's own copies) are not the pool's and are not counted.
///
/// ```
/// use gpu_pool::{Device, observe::DriverCalls, shared::SharedMat, Stream};
///
/// let stream = Stream::new(&Device::cuda_or_host())?;
/// let weights = SharedMat::from_host(&stream, 1, 4, &[1.0f32; 4])?;
/// drop(weights.read(&stream)?); // the first read waits for the upload's write
/// let before = DriverCalls::on_this_thread();
/// drop(weights.read(&stream)?);
/// // A read of memory nobody wrote since this stream's last read records no event.
/// assert_eq!(DriverCalls::on_this_thread().since(before).event_records, 0);
/// # Ok::<(), gpu_pool::PoolError>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverCalls {
    /// `cuEventRecord` (an event made and recorded counts once).
    pub event_records: u64,
    /// `cuStreamWaitEvent`: a stream made to wait on the GPU.
    pub stream_waits: u64,
    /// `cuStreamSynchronize` and `cuEventSynchronize`: the host waited.
    pub host_waits: u64,
    /// `cuStreamIsCapturing`.
    pub capture_queries: u64,
    /// Copies and fills queued (`cuMemcpy2DAsync`, `cuMemsetD*Async`).
    pub copies: u64,
    /// Allocations, frees, mappings and reservations of memory.
    pub memory: u64,
    /// Everything else (event queries, pointer queries, streams made).
    pub other: u64,
}

impl std::ops::Add for DriverCalls {
    type Output = DriverCalls;

    /// The calls of two stretches (of two threads, say) together.
    fn add(self, other: DriverCalls) -> DriverCalls {
        DriverCalls {
            event_records: self.event_records + other.event_records,
            stream_waits: self.stream_waits + other.stream_waits,
            host_waits: self.host_waits + other.host_waits,
            capture_queries: self.capture_queries + other.capture_queries,
            copies: self.copies + other.copies,
            memory: self.memory + other.memory,
            other: self.other + other.other,
        }
    }
}

impl DriverCalls {
    /// The calls this thread has made so far.
    #[must_use]
    pub fn on_this_thread() -> DriverCalls {
        let n = CALLS.with(|calls| calls.each_ref().map(Cell::get));
        DriverCalls {
            event_records: n[Call::EventRecord as usize],
            stream_waits: n[Call::StreamWait as usize],
            host_waits: n[Call::HostWait as usize],
            capture_queries: n[Call::CaptureQuery as usize],
            copies: n[Call::Copy as usize],
            memory: n[Call::Memory as usize],
            other: n[Call::Other as usize],
        }
    }

    /// The calls made between `earlier` (a snapshot of this thread) and `self`.
    #[must_use]
    pub fn since(self, earlier: DriverCalls) -> DriverCalls {
        DriverCalls {
            event_records: self.event_records.wrapping_sub(earlier.event_records),
            stream_waits: self.stream_waits.wrapping_sub(earlier.stream_waits),
            host_waits: self.host_waits.wrapping_sub(earlier.host_waits),
            capture_queries: self.capture_queries.wrapping_sub(earlier.capture_queries),
            copies: self.copies.wrapping_sub(earlier.copies),
            memory: self.memory.wrapping_sub(earlier.memory),
            other: self.other.wrapping_sub(earlier.other),
        }
    }

    /// Every call counted.
    #[must_use]
    pub fn total(&self) -> u64 {
        self.event_records
            + self.stream_waits
            + self.host_waits
            + self.capture_queries
            + self.copies
            + self.memory
            + self.other
    }
}
