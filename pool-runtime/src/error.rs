//! The one error type of the library.
//!
//! Every fallible operation returns [`PoolError`]. Each message says what went wrong and what to do
//! about it; no error leaves a pool in a changed state unless the variant says so.

use crate::id::DeviceId;
use crate::source::{CallSite, FallbackReason};

/// Everything that can go wrong in gpu-pool.
///
/// ```
/// use gpu_pool_runtime::{BufferPool, Device, PoolError, Stream};
/// let device = Device::host();
/// let stream = Stream::new(&device)?;
/// let pool = BufferPool::new(&stream);
/// let err = pool.get_buffer::<u64>(usize::MAX, 2).unwrap_err();
/// assert!(matches!(err, PoolError::SizeOverflow { .. }));
/// # Ok::<(), PoolError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// The device (or the allocator in use) could not provide the memory.
    #[error(
        "out of memory on {device}{at}: {requested} bytes requested; release buffers, request \
         less, or give the pool less memory with set_buffer_pool_config{fix}",
        at = request_at(.request),
        fix = request_fix(.request)
    )]
    OutOfMemory {
        /// The device that ran out.
        device: DeviceId,
        /// Bytes asked for.
        requested: usize,
        /// The buffer request that needed the memory, where a buffer asked (the stream adds it as
        /// the error passes; allocators and backends leave it `None`).
        request: Option<Request>,
    },

    /// A size computation (rows x cols x element size, pitch x rows, alignment) would wrap.
    #[error(
        "size overflow: {rows} rows x {cols} cols of {elem_size}-byte elements does not fit in \
         usize; request a smaller buffer"
    )]
    SizeOverflow {
        /// Rows asked for.
        rows: usize,
        /// Columns asked for.
        cols: usize,
        /// `size_of::<T>()`.
        elem_size: usize,
    },

    /// The element type is aligned more strictly than device memory is guaranteed to be.
    #[error(
        "`{type_name}` is aligned to {align} bytes, more than the {max} bytes every device \
         allocation guarantees; use an element type aligned to at most {max} bytes"
    )]
    UnsupportedAlignment {
        /// The element type.
        type_name: &'static str,
        /// `align_of` the element type.
        align: usize,
        /// [`MAX_ELEMENT_ALIGN`](crate::MAX_ELEMENT_ALIGN).
        max: usize,
    },

    /// A pool configuration that cannot work.
    #[error("invalid buffer pool config: {reason}")]
    InvalidConfig {
        /// What is wrong and how to fix it.
        reason: String,
    },

    /// A [`GpuAllocator`](crate::GpuAllocator) answered against its contract (a null address, a
    /// pitch below the row width, or memory not aligned for the element type). Its answer was
    /// given back, not used.
    #[error("allocator contract broken: {reason}")]
    AllocatorContract {
        /// What the allocator answered and what it must answer.
        reason: String,
    },

    /// Memory given back to a pool or backend that did not hand it out (or already took it back).
    #[error("{address:#x} is not a live block of {owner}; give back only what it handed out, once")]
    UnknownBlock {
        /// The address given back.
        address: u64,
        /// Which pool or backend, in words.
        owner: String,
    },

    /// Memory the caller supplied is not aligned for the element type asked of it.
    #[error(
        "memory at {address:#x} is not aligned for `{type_name}`; supply memory aligned to {align} \
         bytes"
    )]
    Misaligned {
        /// The address.
        address: u64,
        /// `align_of` the element type.
        align: usize,
        /// The element type.
        type_name: &'static str,
    },

    /// A ppl.cv pool call made in a state where ppl.cv only logs an error.
    #[error("ppl.cv memory pool: {reason}")]
    PplPoolState {
        /// What is wrong and what to call first.
        reason: &'static str,
    },

    /// `GPU_POOL_CONF` could not be parsed.
    #[error(
        "invalid GPU_POOL_CONF {value:?}: {reason}; expected e.g. \
         \"stack_size=64MiB,stack_count=2,fallback=stream_ordered\""
    )]
    InvalidEnvConfig {
        /// The variable's value.
        value: String,
        /// What is wrong with it.
        reason: String,
    },

    /// The pool was reconfigured while streams hold stacks of it.
    #[error(
        "cannot reconfigure or release the buffer pool of {device}: {held} stack(s) are held by live streams; \
         drop those streams first (OpenCV frees the memory under them, gpu-pool refuses)"
    )]
    ConfigInUse {
        /// The device whose pool is in use.
        device: DeviceId,
        /// Stacks currently held.
        held: usize,
    },

    /// The request could not be served by the stack and the fallback is `Fallback::Error`.
    #[error(
        "stack exhausted on {device}, stream {stream}{at}: {requested} bytes requested, \
         {available} free ({reason}); {fix}, or choose another fallback",
        at = at(.site),
        fix = stack_fix(*.reason, *.requested, *.available, *.stack_size)
    )]
    StackExhausted {
        /// The device.
        device: DeviceId,
        /// The stream ([`Stream::id`](crate::Stream::id)).
        stream: u64,
        /// Bytes the request needed on the stack.
        requested: usize,
        /// Bytes free on the stream's stack (0 without a stack).
        available: usize,
        /// Bytes of the stream's stack (0 without a stack).
        stack_size: usize,
        /// Why the stack could not serve it.
        reason: FallbackReason,
        /// The `buffer!` or runtime call that asked.
        site: Option<CallSite>,
    },

    /// A stack buffer was released before a buffer taken after it (strict LIFO mode only).
    ///
    /// The memory is not lost: it is reclaimed when the buffers above it are released.
    #[error(
        "LIFO violation on {device}: a stack buffer at offset {offset} was released while buffers \
         above it are live; release buffers in reverse order of taking them (the DSL does this for you)"
    )]
    LifoViolation {
        /// The device.
        device: DeviceId,
        /// Offset of the released buffer in its stack.
        offset: usize,
    },

    /// No CUDA driver could be loaded.
    #[error("no CUDA driver: {detail}; install the NVIDIA driver, or use Device::host()")]
    NoCudaDriver {
        /// What was tried.
        detail: String,
    },

    /// There is no such device.
    #[error("no device {device}: {count} device(s) present")]
    NoSuchDevice {
        /// The device asked for.
        device: DeviceId,
        /// How many there are.
        count: usize,
    },

    /// A CUDA driver call failed.
    #[error("CUDA driver error {name} in {call}: {description}")]
    Driver {
        /// The driver function.
        call: &'static str,
        /// The `CUresult` name, e.g. `CUDA_ERROR_INVALID_VALUE`.
        name: String,
        /// The driver's description.
        description: String,
    },

    /// Host data and a buffer disagree in size.
    #[error(
        "shape mismatch: the buffer holds {expected} elements, the host slice {actual}; \
         pass a slice of rows x cols elements"
    )]
    ShapeMismatch {
        /// Elements the buffer holds.
        expected: usize,
        /// Elements given.
        actual: usize,
    },

    /// Two buffers of a copy differ in rows or columns.
    #[error(
        "shape mismatch: the destination is {}x{} (rows x cols), the source {}x{}; copy between \
         buffers of the same rows and cols, or through a view of the right shape",
        dst.0, dst.1, src.0, src.1
    )]
    DimensionMismatch {
        /// Rows and columns of the destination.
        dst: (usize, usize),
        /// Rows and columns of the source.
        src: (usize, usize),
    },

    /// A buffer the stack cannot serve was asked for while a CUDA graph was being captured.
    #[error(
        "a buffer of {requested} bytes does not fit the stream's stack ({available} bytes free) \
         while a CUDA graph is captured, and an allocation from the driver would break the \
         capture; raise stack_size with set_buffer_pool_config, or make the buffer before capturing"
    )]
    CaptureNeedsStack {
        /// Bytes the buffer needs on the stack.
        requested: usize,
        /// Bytes free on the stack.
        available: usize,
    },

    /// A buffer taken during a capture was still live when it ended.
    #[error(
        "a buffer taken while capturing a CUDA graph was still live when the capture ended; the \
         graph reuses that memory on every replay, so release every buffer taken inside (the DSL \
         does), and make long-lived outputs before capturing"
    )]
    CaptureKeptBuffers,

    /// Work that crosses streams was asked for while one of them is being captured into a CUDA
    /// graph: the other stream would join the capture (and replays would write its memory after
    /// its buffers are gone) or the capture would depend on work outside it.
    #[error(
        "{what} crosses streams while a CUDA graph is captured: the graph could only record it by \
         pulling the other stream's work (and memory) into every replay; do the cross-stream work \
         before or after the capture, or on the capturing stream"
    )]
    CaptureCrossStream {
        /// The operation refused.
        what: &'static str,
    },

    /// Pool work was asked for on a stream whose CUDA stream is being captured by something other
    /// than its own [`Stream::capture`](crate::Stream::capture) (cudarc's `begin_capture`, or
    /// another stream's capture it was joined to): the pool could not keep that work's memory for
    /// the graph's life.
    #[error(
        "{what} on stream {stream}, whose CUDA stream is being captured outside Stream::capture: \
         the graph would keep writing pool memory after its buffers are gone; capture pooled work \
         with Stream::capture on the stream itself, and end other captures before using the stream"
    )]
    CapturedElsewhere {
        /// The operation refused.
        what: &'static str,
        /// The pool stream's id.
        stream: u64,
    },

    /// A pool stream already wraps this CUDA stream: two pool streams over one CUDA stream would
    /// have two stacks whose work is ordered as one, which graph capture cannot keep apart.
    #[error(
        "pool stream {existing} already wraps this CUDA stream; use that Stream (lend it by \
         reference), or wrap another CUDA stream"
    )]
    StreamAlreadyWrapped {
        /// The id of the pool stream that wraps it.
        existing: u64,
    },

    /// A file could not be written.
    #[error("cannot write {path}: {detail}")]
    Io {
        /// The file.
        path: String,
        /// What the system said.
        detail: String,
    },

    /// A region asked of a buffer or view does not lie inside it.
    #[error(
        "region {what} {start}..{end} is out of bounds of {len} {what}; ask for a range inside \
         the buffer (start <= end <= {len})"
    )]
    OutOfBounds {
        /// `"rows"` or `"cols"`.
        what: &'static str,
        /// Start of the range asked for.
        start: usize,
        /// End of the range asked for (exclusive).
        end: usize,
        /// Rows or columns there are.
        len: usize,
    },

    /// A contiguous view was asked of a buffer whose rows are padded.
    #[error(
        "a {rows}x{cols} buffer with a step of {step} bytes has padding between its rows, so it \
         is not one contiguous run; take a 1D buffer (`buffer!(len; T)`), or use one row at a time"
    )]
    NotContinuous {
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
        /// Bytes between rows.
        step: usize,
    },

    /// An operation mixed buffers of different devices.
    #[error(
        "device mismatch: expected {expected}, got {actual}; copy through the host or use one device"
    )]
    DeviceMismatch {
        /// The device the operation runs on.
        expected: DeviceId,
        /// The other device.
        actual: DeviceId,
    },

    /// The operation exists, but not on this device's backend.
    #[error("{what} is not supported on {device}")]
    Unsupported {
        /// The device.
        device: DeviceId,
        /// The operation.
        what: &'static str,
    },
}

impl PoolError {
    /// The error with `site` as its call site, where it has one and none is set yet.
    #[cold]
    pub(crate) fn at(mut self, request: Request) -> PoolError {
        match &mut self {
            PoolError::OutOfMemory { request: r, .. } => {
                r.get_or_insert(request);
            }
            PoolError::StackExhausted { site, .. } => {
                site.get_or_insert(request.site);
            }
            _ => {}
        }
        self
    }
}

/// The buffer request behind an out-of-memory error: who asked, on which stream, and the stack
/// that would have served it without allocating.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// The `buffer!` or runtime call.
    pub site: CallSite,
    /// The stream ([`Stream::id`](crate::Stream::id)).
    pub stream: u64,
    /// Bytes of stack that would have held the request with what was in use, where the stack was
    /// too full or too small for it (`None` for a request not meant for the stack).
    pub stack_needed: Option<usize>,
}

/// ", stream N at `name` at file:line" for an out-of-memory request, or nothing.
fn request_at(request: &Option<Request>) -> String {
    request
        .map(|r| format!(", stream {} at {}", r.stream, r.site))
        .unwrap_or_default()
}

/// The stack size that would have served the request instead, as a `GPU_POOL_CONF` value.
fn request_fix(request: &Option<Request>) -> String {
    match request.and_then(|r| r.stack_needed).and_then(stack_mib) {
        Some((needed, mib)) => format!(
            "; or let the stack hold it: a stack of {needed} bytes would, \
             GPU_POOL_CONF=stack_size={mib}MiB"
        ),
        // Past what any config can hold: no stack size to suggest.
        None => String::new(),
    }
}

/// `needed` bytes and the whole MiB that hold them, where a stack size of that many MiB can be
/// written (`GPU_POOL_CONF`, `set_buffer_pool_config`) at all; `None` near the top of the address
/// space.
fn stack_mib(needed: usize) -> Option<(usize, usize)> {
    let mib = needed.div_ceil(1 << 20);
    mib.checked_mul(1 << 20).map(|_| (needed, mib))
}

/// " at `name` at file:line" for an error's call site, or nothing.
fn at(site: &Option<CallSite>) -> String {
    site.map(|s| format!(" at {s}")).unwrap_or_default()
}

/// The setting that would have let the stack serve a request, as a `GPU_POOL_CONF` value.
fn stack_fix(
    reason: FallbackReason,
    requested: usize,
    available: usize,
    stack_size: usize,
) -> String {
    match reason {
        FallbackReason::StackFull | FallbackReason::TooLarge => {
            // What was in use, plus the request, in whole MiB (alignment padding aside).
            let needed = stack_size
                .saturating_sub(available)
                .checked_add(requested)
                .and_then(stack_mib);
            match needed {
                Some((needed, mib)) => format!(
                    "a stack of {needed} bytes would serve it: GPU_POOL_CONF=stack_size={mib}MiB \
                     (or set_buffer_pool_config)"
                ),
                None => "no stack size can hold it with what is in use (it is near the size of \
                         the address space): request less"
                    .into(),
            }
        }
        FallbackReason::NoStack => "every stack is held by another stream: raise stack_count \
                                    (GPU_POOL_CONF=stack_count=N, or set_buffer_pool_config)"
            .into(),
        FallbackReason::Disabled => {
            "pooling is off for this stream: GPU_POOL_CONF=usage=on or set_buffer_pool_usage(true)"
                .into()
        }
        FallbackReason::NoStackMemory => "the device had no memory for the stacks when this \
                                          stream was made: free device memory, or lower \
                                          stack_size or stack_count, then make a new stream"
            .into(),
    }
}
