//! The library's errors: [`PoolError`], the core's, with each feature's own errors nested in it
//! ([`CaptureError`] for CUDA graph captures, [`NcclError`] for NCCL, [`PplError`] for ppl.cv's
//! pool; `PoolError::Capture(CaptureError::Allocates { .. })`), each shown as the feature's error
//! and keeping its cause as `source()`.
//!
//! Every fallible operation returns [`PoolError`]: one variant per situation, each message saying
//! what went wrong and what to do about it; no error leaves a pool in a changed state unless the
//! variant says so. An error with an underlying cause (a CUDA call, a file) keeps that error whole
//! as its [`source`](std::error::Error::source); an error about memory for a buffer carries the
//! [`RequestContext`] of the request (who asked, on which stream), attached by the stream as the
//! error leaves the take.
//!
//! cudarc's errors convert into `PoolError` (feature `cuda`), so `?` works on them in a function
//! that returns `PoolError`: a `DriverError` becomes [`PoolError::Driver`] (its call
//! [`PoolError::CUDARC_CALL`]), nvrtc's `CompileError` and `NvrtcError` [`PoolError::Nvrtc`],
//! cuBLAS's `CublasError` (feature `cublas`) [`PoolError::Cublas`]; each kept as the source.

use std::error::Error;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use crate::base::holders::Reclaimed;
use crate::base::id::DeviceId;
use crate::base::source::{CallSite, FallbackReason};

/// Everything that can go wrong in gpu-pool.
///
/// ```
/// use gpu_pool::{compat::opencv::BufferPool, Device, PoolError, Stream};
/// let device = Device::host();
/// let stream = Stream::new(&device)?;
/// let pool = BufferPool::new(&stream);
/// let err = pool.get_buffer::<u64>(usize::MAX, 2).unwrap_err();
/// assert!(matches!(err, PoolError::SizeOverflow { .. }));
/// # Ok::<(), PoolError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PoolError {
    /// The device (or the allocator in use) could not provide the memory.
    OutOfMemory {
        /// The device that ran out.
        device: DeviceId,
        /// Bytes asked for.
        requested: usize,
        /// The buffer request that needed the memory, where a buffer asked (the stream attaches it
        /// as the error leaves the take; allocators and backends leave it `None`).
        context: Option<RequestContext>,
        /// What the device's holders of idle memory held and gave back before the request was
        /// tried again and failed, and the device's memory limit if that refused it (the pool
        /// attaches it; allocators and backends leave it `None`).
        reclaimed: Option<Box<Reclaimed>>,
    },

    /// A size computation (rows x cols x element size, pitch x rows, alignment) would wrap.
    SizeOverflow {
        /// Rows asked for.
        rows: usize,
        /// Columns asked for.
        cols: usize,
        /// `size_of::<T>()`.
        elem_size: usize,
    },

    /// The element type is aligned more strictly than device memory is guaranteed to be.
    UnsupportedAlignment {
        /// The element type.
        type_name: &'static str,
        /// `align_of` the element type.
        align: usize,
        /// [`MAX_ELEMENT_ALIGN`](crate::config::MAX_ELEMENT_ALIGN).
        max: usize,
    },

    /// A pool configuration that cannot work.
    InvalidConfig {
        /// What is wrong and how to fix it.
        reason: String,
    },

    /// A [`GpuAllocator`](crate::alloc::GpuAllocator) answered against its contract (a null address, a
    /// pitch below the row width, or memory not aligned for the element type). Its answer was
    /// given back, not used.
    AllocatorContract {
        /// What the allocator answered and what it must answer.
        reason: String,
        /// The buffer request it answered (attached by the stream, as for
        /// [`OutOfMemory`](PoolError::OutOfMemory)).
        context: Option<RequestContext>,
    },

    /// Memory given back to a pool or backend that did not hand it out (or already took it back).
    UnknownBlock {
        /// The address given back.
        address: u64,
        /// Which pool or backend, in words.
        owner: String,
    },

    /// Memory the caller supplied is not aligned for the element type asked of it.
    Misaligned {
        /// The address.
        address: u64,
        /// `align_of` the element type.
        align: usize,
        /// The element type.
        type_name: &'static str,
    },

    /// `GPU_POOL_CONF` could not be parsed.
    InvalidEnvConfig {
        /// The variable's value.
        value: String,
        /// What is wrong with it.
        reason: String,
    },

    /// The stack pool was reconfigured or its memory released while streams hold stacks of it.
    ConfigInUse {
        /// The device whose pool is in use.
        device: DeviceId,
        /// Stacks currently held.
        held: usize,
    },

    /// The request could not be served by the stack and the fallback is `Fallback::Error`.
    StackExhausted {
        /// The device.
        device: DeviceId,
        /// Bytes the request needed on the stack.
        requested: usize,
        /// Bytes free on the stream's stack (0 without a stack).
        available: usize,
        /// Bytes of the stream's stack (0 without a stack).
        stack_size: usize,
        /// Why the stack could not serve it.
        reason: FallbackReason,
        /// The buffer request: the `buffer!` or runtime call that asked, and its stream (attached
        /// by the stream; [`NoFallback`](crate::alloc::NoFallback) leaves it `None`).
        context: Option<RequestContext>,
    },

    /// A stack buffer was released before a buffer taken after it (strict LIFO mode only).
    ///
    /// The memory is not lost: it is reclaimed when the buffers above it are released.
    LifoViolation {
        /// The device.
        device: DeviceId,
        /// Offset of the released buffer in its stack.
        offset: usize,
    },

    /// No CUDA driver could be loaded.
    NoCudaDriver {
        /// What was tried.
        detail: String,
    },

    /// There is no such device.
    NoSuchDevice {
        /// The device asked for.
        device: DeviceId,
        /// How many there are.
        count: usize,
    },

    /// A CUDA driver call failed: one the pool made, or one of cudarc's that returned its
    /// `DriverError` into a `PoolError` (`?` converts it: `From<DriverError>`).
    ///
    /// The call's own error is the [`source`](std::error::Error::source): cudarc's `DriverError`
    /// (downcast it to read its `CUresult`).
    Driver {
        /// The function that failed, e.g. `cuMemAlloc`; [`PoolError::CUDARC_CALL`] for an error
        /// converted from cudarc's, whose call is not known.
        call: &'static str,
        /// What it returned.
        source: Cause,
    },

    /// nvrtc could not compile a kernel source (or make its program, or hand out its PTX).
    ///
    /// The [`source`](std::error::Error::source) is cudarc's error: its `CompileError` (whose
    /// `CompileError::CompileError { log, .. }` holds the compiler's log), or an `NvrtcError`.
    Nvrtc {
        /// cudarc's error.
        source: Cause,
    },

    /// A cuBLAS call failed.
    ///
    /// The [`source`](std::error::Error::source) is cudarc's `CublasError` (downcast it to read
    /// its `cublasStatus_t`).
    Cublas {
        /// cudarc's error.
        source: Cause,
    },

    /// A device's stack memory is registered with NCCL, so it cannot be freed or replaced.
    StackMemoryRegistered {
        /// The device.
        device: DeviceId,
    },

    /// Two ranks' stacks laid their blocks out differently ([`check_symmetric`](crate::observe::check_symmetric)).
    Asymmetric {
        /// The first rank that differs from rank 0.
        rank: usize,
        /// Blocks its stack handed out.
        takes: u64,
        /// Its stack's top now.
        top: u64,
        /// The digest of its blocks' offsets and ends.
        digest: u64,
        /// Blocks rank 0's stack handed out.
        takes0: u64,
        /// Rank 0's top.
        top0: u64,
        /// Rank 0's digest.
        digest0: u64,
    },

    /// A CUDA library the program asked for could not be loaded (cudarc loads them at run time,
    /// and would panic on the first call into a missing one).
    NoCudaLibrary {
        /// The library, e.g. `cublas`.
        library: &'static str,
    },

    /// A host slice given to an upload or download differs in length from the buffer.
    ShapeMismatch {
        /// Elements the buffer holds.
        expected: usize,
        /// Elements of the host slice.
        actual: usize,
    },

    /// Two buffers of a copy differ in rows or columns.
    DimensionMismatch {
        /// Rows and columns of the destination.
        dst: (usize, usize),
        /// Rows and columns of the source.
        src: (usize, usize),
    },

    /// A pool stream already wraps this CUDA stream: two pool streams over one CUDA stream would
    /// have two stacks whose work is ordered as one, which graph capture cannot keep apart.
    StreamAlreadyWrapped {
        /// The id of the pool stream that wraps it.
        existing: u64,
    },

    /// A file could not be written.
    Io {
        /// The file.
        path: String,
        /// What the system said: the [`source`](std::error::Error::source).
        source: Cause<std::io::Error>,
    },

    /// A region asked of a buffer or view does not lie inside it.
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
    NotContinuous {
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
        /// Bytes between rows.
        step: usize,
    },

    /// An operation mixed buffers of different devices.
    DeviceMismatch {
        /// The device the operation runs on.
        expected: DeviceId,
        /// The other device.
        actual: DeviceId,
    },

    /// The operation exists, but not on this device's backend.
    Unsupported {
        /// The device.
        device: DeviceId,
        /// The operation.
        what: &'static str,
    },

    /// A CUDA graph capture refused the call: see [`CaptureError`].
    Capture(CaptureError),

    /// NCCL refused or failed (feature `nccl`): see [`NcclError`].
    Nccl(NcclError),

    /// ppl.cv's memory pool refused the call: see [`PplError`].
    Ppl(PplError),
}

/// A CUDA graph capture refused the call; a [`PoolError::Capture`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CaptureError {
    /// A buffer the stack cannot serve was asked for while a CUDA graph was being captured.
    NeedsStack {
        /// Bytes the buffer needs on the stack.
        requested: usize,
        /// Bytes free on the stack.
        available: usize,
        /// The buffer request (attached by the stream; `None` for the stack a capture keeps for its
        /// graph's replays).
        context: Option<RequestContext>,
    },

    /// Long-lived memory was asked for while a CUDA graph is captured on this thread: a driver
    /// allocation would break the capture.
    Allocates {
        /// What asked for the memory.
        what: &'static str,
        /// The buffer request (`GpuMat::new`'s; `None` for shared memory, which no stream asked
        /// for).
        context: Option<RequestContext>,
    },

    /// A buffer taken during a capture was still live when it ended.
    KeptBuffers,

    /// A copy between device memory and a host slice borrowed only for the call
    /// (`upload`, `download`, `to_vec`) was asked for inside the stream's own capture: the graph
    /// would copy from or into the slice at every replay, after the slice is gone.
    HostCopy {
        /// The operation refused.
        what: &'static str,
    },

    /// Work that crosses streams was asked for while one of them is being captured into a CUDA
    /// graph: the other stream would join the capture (and replays would write its memory after
    /// its buffers are gone) or the capture would depend on work outside it.
    CrossStream {
        /// The operation refused.
        what: &'static str,
    },

    /// Pool work was asked for on a stream whose CUDA stream is being captured by something other
    /// than its own `Stream::capture` (cudarc's `begin_capture`, or
    /// another stream's capture it was joined to): the pool could not keep that work's memory for
    /// the graph's life.
    Elsewhere {
        /// The operation refused.
        what: &'static str,
        /// The pool stream's id.
        stream: u64,
    },

    /// A graph replay would access `SharedMat` memory while a conflicting
    /// access of it through a guard is still open on another stream (a write, for a replay that
    /// reads; any access, for a replay that writes). The guard's work is not all queued yet, so
    /// nothing can order the replay after it; nothing was queued.
    SharedAccessOpen {
        /// The operation refused.
        what: &'static str,
        /// `"read"` or `"write"`: what the replay does to the memory.
        replay: &'static str,
        /// `"read"` or `"write"`: the open access.
        open: &'static str,
        /// The id of the pool stream the open access is on.
        stream: u64,
    },

    /// A CUDA graph capture was asked of a pool stream over the legacy default (null) stream
    /// ([`Stream::from_cuda`](crate::Stream::from_cuda) of cudarc's `default_stream()`), which the
    /// driver never captures. Refused before any driver call: the stream and its context stay
    /// usable.
    LegacyStream {
        /// The capture refused (`Stream::capture`, `GraphFamily::capture`,
        /// `Communicators::capture`).
        what: &'static str,
        /// The pool stream's id.
        stream: u64,
        /// Its device.
        device: DeviceId,
    },
}

/// NCCL refused or failed (feature `nccl`); a [`NcclError::Call`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum NcclError {
    /// An NCCL call failed (feature `nccl`).
    ///
    /// The [`source`](std::error::Error::source) is an [`NcclFailure`] holding cudarc's
    /// `NcclError` (downcast it to read the `ncclResult_t`).
    Call {
        /// The NCCL function.
        call: &'static str,
        /// NCCL's status.
        source: Cause,
    },

    /// The NCCL calls of a group disagree across ranks; nothing was queued (feature `nccl`).
    Group {
        /// What disagrees.
        problem: String,
    },

    /// Text or bytes that are not an NCCL unique id (`nccl::UniqueId`), refused before NCCL sees
    /// them (feature `nccl`).
    Id {
        /// What is wrong with it.
        problem: String,
    },

    /// A rank outside its world, or a world of no ranks, refused before NCCL sees it
    /// (feature `nccl`).
    Rank {
        /// The rank asked for.
        rank: usize,
        /// The world size asked for.
        world: usize,
    },

    /// Ranks in other processes did not meet this one within the communicator's timeout; the
    /// communicator was aborted (`ncclCommAbort`) and refuses every call from now on
    /// (feature `nccl`).
    Timeout {
        /// What waited.
        what: &'static str,
        /// How long it waited.
        waited: std::time::Duration,
    },
}

/// ppl.cv's memory pool refused the call; a [`PoolError::Ppl`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PplError {
    /// A ppl.cv pool call made in a state where ppl.cv only logs an error.
    State {
        /// What is wrong and what to call first.
        reason: &'static str,
    },

    /// ppl.cv's pool was shut down while blocks of it are live.
    InUse {
        /// The device of the pool.
        device: DeviceId,
        /// Blocks of the pool still live.
        live: usize,
    },
}

// Display and Error by hand (no derive macro: one proc-macro and its parser less in every
// user's build). Each message says what went wrong and what to do; `source()` is the
// cause a variant keeps, and a nested feature error shows as itself (transparent).
impl fmt::Display for PoolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoolError::OutOfMemory {
                device,
                requested,
                context,
                reclaimed,
            } => write!(
                f,
                "out of memory on {device}{at}: {requested} bytes requested{held}; release buffers, \
                 request less, or give the pool less memory with set_buffer_pool_config{fix}",
                at = request_at(context),
                held = reclaimed_text(reclaimed),
                fix = request_fix(context)
            ),
            PoolError::SizeOverflow {
                rows,
                cols,
                elem_size,
            } => write!(
                f,
                "size overflow: {rows} rows x {cols} cols of {elem_size}-byte elements does not fit in \
                 usize; request a smaller buffer"
            ),
            PoolError::UnsupportedAlignment {
                type_name,
                align,
                max,
            } => write!(
                f,
                "`{type_name}` is aligned to {align} bytes, more than the {max} bytes every device \
                 allocation guarantees; use an element type aligned to at most {max} bytes"
            ),
            PoolError::InvalidConfig { reason } => {
                write!(f, "invalid buffer pool config: {reason}")
            }
            PoolError::AllocatorContract { reason, context } => write!(
                f,
                "allocator contract broken{at}: {reason}",
                at = request_at(context)
            ),
            PoolError::UnknownBlock { address, owner } => write!(
                f,
                "{address:#x} is not a live block of {owner}; give back only what it handed out, once"
            ),
            PoolError::Misaligned {
                address,
                align,
                type_name,
            } => write!(
                f,
                "memory at {address:#x} is not aligned for `{type_name}`; supply memory aligned to {align} \
                 bytes"
            ),
            PoolError::InvalidEnvConfig { value, reason } => write!(
                f,
                "invalid GPU_POOL_CONF {value:?}: {reason}; expected e.g. \
                 \"stack_size=64MiB,stack_count=2,fallback=stream_ordered\""
            ),
            PoolError::ConfigInUse { device, held } => write!(
                f,
                "cannot reconfigure or release the buffer pool of {device}: {held} stack(s) are held by live streams; \
                 drop those streams first (OpenCV frees the memory under them, gpu-pool refuses)"
            ),
            PoolError::StackExhausted {
                device,
                requested,
                available,
                stack_size,
                reason,
                context,
            } => write!(
                f,
                "stack exhausted on {device}{at}: {requested} bytes requested, {available} free \
                 ({reason}); {fix}, or choose another fallback",
                at = request_at(context),
                fix = stack_fix(*reason, *requested, *available, *stack_size)
            ),
            PoolError::LifoViolation { device, offset } => write!(
                f,
                "LIFO violation on {device}: a stack buffer at offset {offset} was released while buffers \
                 above it are live; release buffers in reverse order of taking them (the DSL does this for you)"
            ),
            PoolError::NoCudaDriver { detail } => write!(
                f,
                "no CUDA driver: {detail}; install the NVIDIA driver, or use Device::host()"
            ),
            PoolError::NoSuchDevice { device, count } => write!(
                f,
                "no device {device}: {count} device(s) present (Device::cuda_device_count); ask for an \
                 ordinal below that, or use Device::cuda_or_host()"
            ),
            PoolError::Driver { call, source } => write!(
                f,
                "{what} failed: {source}; see what the call returns this error for in the CUDA \
                 documentation (an error of earlier asynchronous work, such as CUDA_ERROR_ILLEGAL_ADDRESS, \
                 is sticky: the context stays unusable, restart the process)",
                what = call_words(call)
            ),
            PoolError::Nvrtc { source } => write!(
                f,
                "nvrtc failed: {source}; for a compile error the compiler's log is in it (cudarc's \
                 CompileError::CompileError {{ log, .. }}): fix the kernel source or the options, and check \
                 that libnvrtc matches the driver's CUDA version"
            ),
            PoolError::Cublas { source } => write!(
                f,
                "cuBLAS call failed: {source}; CUBLAS_STATUS_INVALID_VALUE is an argument out of range \
                 (sizes, leading dimensions, a buffer lent too short), NOT_INITIALIZED or ALLOC_FAILED a \
                 handle that could not be made (device memory, driver); see cublasStatus_t in the cuBLAS \
                 documentation for the others"
            ),
            PoolError::StackMemoryRegistered { device } => write!(
                f,
                "the stack memory of {device} is registered with an NCCL communicator: drop the \
                 nccl::Registered handle first (it deregisters the memory), then change the config, \
                 release the stack memory or change where it comes from"
            ),
            PoolError::Asymmetric {
                rank,
                takes,
                top,
                digest,
                takes0,
                top0,
                digest0,
            } => write!(
                f,
                "the stacks are not symmetric: rank {rank} took {takes} block(s), its top at offset {top}, \
                 layout digest {digest:#018x}; rank 0 took {takes0}, its top at {top0}, digest \
                 {digest0:#018x}. Run the same pooled work in the same order on every rank, with the same \
                 stack config, and compare from streams made alike (a fresh stream per rank)"
            ),
            PoolError::NoCudaLibrary { library } => write!(
                f,
                "the CUDA library {library} could not be loaded (searched for lib{library}.so and its \
                 versioned names); install it (the CUDA toolkit, or the {library} package of the driver's \
                 CUDA version), put its directory on LD_LIBRARY_PATH, or run without it"
            ),
            PoolError::ShapeMismatch { expected, actual } => write!(
                f,
                "host slice length mismatch: the buffer holds {expected} elements (rows x cols), the host \
                 slice {actual}; pass a slice of exactly {expected} elements"
            ),
            PoolError::DimensionMismatch { dst, src } => write!(
                f,
                "buffer dimension mismatch: the destination buffer is {}x{} (rows x cols), the source \
                 buffer {}x{}; copy between buffers of the same rows and cols, or through a view of the \
                 right shape",
                dst.0, dst.1, src.0, src.1
            ),
            PoolError::StreamAlreadyWrapped { existing } => write!(
                f,
                "pool stream {existing} already wraps this CUDA stream; use that Stream (lend it by \
                 reference), or wrap another CUDA stream"
            ),
            PoolError::Io { path, source } => write!(
                f,
                "cannot write {path}: {source}; check that its directory exists and is writable, and that \
                 the disk has room"
            ),
            PoolError::OutOfBounds {
                what,
                start,
                end,
                len,
            } => write!(
                f,
                "region {what} {start}..{end} is out of bounds of {len} {what}; ask for a range inside \
                 the buffer (start <= end <= {len})"
            ),
            PoolError::NotContinuous { rows, cols, step } => write!(
                f,
                "a {rows}x{cols} buffer with a step of {step} bytes has padding between its rows, so it \
                 is not one contiguous run; take a 1D buffer (`buffer!(len; T)`), or use one row at a time"
            ),
            PoolError::DeviceMismatch { expected, actual } => write!(
                f,
                "device mismatch: expected {expected}, got {actual}; copy through the host or use one device"
            ),
            PoolError::Unsupported { device, what } => {
                write!(f, "{what} is not supported on {device}")
            }
            PoolError::Capture(inner) => fmt::Display::fmt(inner, f),
            PoolError::Nccl(inner) => fmt::Display::fmt(inner, f),
            PoolError::Ppl(inner) => fmt::Display::fmt(inner, f),
        }
    }
}

impl Error for PoolError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match self {
            PoolError::Capture(inner) => inner.source(),
            PoolError::Nccl(inner) => inner.source(),
            PoolError::Ppl(inner) => inner.source(),
            PoolError::Driver { source, .. } => Some(&**source),
            PoolError::Nvrtc { source, .. } => Some(&**source),
            PoolError::Cublas { source, .. } => Some(&**source),
            PoolError::Io { source, .. } => Some(&**source),
            _ => None,
        }
    }
}

impl From<CaptureError> for PoolError {
    fn from(error: CaptureError) -> Self {
        PoolError::Capture(error)
    }
}

impl From<NcclError> for PoolError {
    fn from(error: NcclError) -> Self {
        PoolError::Nccl(error)
    }
}

impl From<PplError> for PoolError {
    fn from(error: PplError) -> Self {
        PoolError::Ppl(error)
    }
}

impl fmt::Display for CaptureError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CaptureError::NeedsStack {
                requested,
                available,
                context,
            } => write!(
                f,
                "a buffer of {requested} bytes{at} does not fit the stream's stack ({available} bytes \
                 free) while a CUDA graph is captured, and an allocation from the driver would break the \
                 capture; raise stack_size with set_buffer_pool_config{hint}, or make the buffer before \
                 capturing",
                at = request_paren(context),
                hint = stack_hint(context)
            ),
            CaptureError::Allocates { what, context } => write!(
                f,
                "{what}{at} allocates device memory, which would break the CUDA graph capture under way \
                 on this thread; make it before capturing",
                at = request_paren(context)
            ),
            CaptureError::KeptBuffers => write!(
                f,
                "a buffer taken while capturing a CUDA graph was still live when the capture ended; the \
                 graph reuses that memory on every replay, so release every buffer taken inside (the DSL \
                 does), and make long-lived outputs before capturing"
            ),
            CaptureError::HostCopy { what } => write!(
                f,
                "{what} copies to or from a host slice borrowed only for the call, inside a CUDA graph \
                 capture: every replay would copy from or into the slice after it is gone; copy before or \
                 after the capture, or through `HostMem` (`upload_async` / `download_async`), whose \
                 memory the graph can keep"
            ),
            CaptureError::CrossStream { what } => write!(
                f,
                "{what} crosses streams while a CUDA graph is captured: the graph could only record it by \
                 pulling the other stream's work (and memory) into every replay; do the cross-stream work \
                 before or after the capture, or on the capturing stream"
            ),
            CaptureError::Elsewhere { what, stream } => write!(
                f,
                "{what} on stream {stream}, whose CUDA stream is being captured outside Stream::capture: \
                 the graph would keep writing pool memory after its buffers are gone; capture pooled work \
                 with Stream::capture on the stream itself, and end other captures before using the stream"
            ),
            CaptureError::SharedAccessOpen {
                what,
                replay,
                open,
                stream,
            } => write!(
                f,
                "{what} would {replay} shared memory while a {open} of it is open on stream {stream}: the \
                 replay cannot be ordered after work not queued yet; end that access first (drop its \
                 guard: hold the lock that guards the SharedMat across the launch, its read lock for a \
                 graph that reads, its write lock for one that writes). A guard that was forgotten, or \
                 dropped while its stream was captured outside Stream::capture, stays open until an \
                 eager access that conflicts with it (a write, for an open read) waits for its stream"
            ),
            CaptureError::LegacyStream {
                what,
                stream,
                device,
            } => write!(
                f,
                "{what} on stream {stream}, which wraps the legacy default (null) stream of {device}: the \
                 driver cannot capture that stream (it synchronizes with every other); capture on a \
                 stream of its own (Stream::new, or Stream::from_cuda of context.new_stream()). Nothing \
                 was queued: the stream and its context stay usable"
            ),
        }
    }
}

impl Error for CaptureError {}

impl fmt::Display for NcclError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NcclError::Call { call, source } => write!(
                f,
                "{} failed: {source}; set NCCL_DEBUG=WARN for NCCL's own reason. \
                 ncclInvalidUsage is a call out of order or ranks that disagree (a rank missing from a \
                 group, different counts), ncclUnhandledCudaError a CUDA error underneath, ncclSystemError \
                 the operating system (shared memory, sockets)",
                nccl_call_words(call)
            ),
            NcclError::Group { problem } => write!(
                f,
                "the NCCL group was not queued: {problem}. Every rank must make the same collectives in \
                 the same order with the same count and type, and each send needs a receive of the same \
                 count and type on its peer"
            ),
            NcclError::Id { problem } => write!(
                f,
                "not an NCCL unique id: {problem}. Pass on exactly the text rank 0's UniqueId printed \
                 (its Display: 256 hex digits) or its to_bytes, unchanged, to every other rank"
            ),
            NcclError::Rank { rank, world } => write!(
                f,
                "NCCL rank {rank} of a world of {world} ranks: ranks are numbered 0 to world - 1, every \
                 process passes the same world size (at least 1, at most i32::MAX) and a rank of its own"
            ),
            NcclError::Timeout { what, waited } => write!(
                f,
                "{what} waited {waited:?} for ranks in other processes and gave up: a peer exited, \
                 hangs, never made this call, or made calls that differ (a count, a type, one call more). \
                 The communicator was aborted: make a new one from a new UniqueId on every rank, or \
                 raise the timeout (Communicators::set_timeout) if the peers are only slow"
            ),
        }
    }
}

impl Error for NcclError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        match self {
            NcclError::Call { source, .. } => Some(&**source),
            _ => None,
        }
    }
}

impl fmt::Display for PplError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PplError::State { reason } => write!(f, "ppl.cv memory pool: {reason}"),
            PplError::InUse { device, live } => write!(
                f,
                "cannot shut down the ppl.cv memory pool on {device}: {live} block(s) of it are live; free \
                 them first (ppl_cuda_free, or drop their GpuMemoryBlock)"
            ),
        }
    }
}

impl Error for PplError {}

impl PoolError {
    /// The `call` of a [`PoolError::Driver`] converted from cudarc's `DriverError` (with `?` or
    /// `From`), which does not say which call returned it.
    pub const CUDARC_CALL: &'static str = "a cudarc call";

    /// The buffer request behind a memory error ([`OutOfMemory`](PoolError::OutOfMemory),
    /// [`StackExhausted`](PoolError::StackExhausted),
    /// [`CaptureNeedsStack`](CaptureError::NeedsStack),
    /// [`AllocatorContract`](PoolError::AllocatorContract)), where a buffer asked: `None` for
    /// other errors, and for memory that was not for a buffer (the stacks themselves,
    /// `MixMemory` (feature `mix`), the ppl.cv pool, the stack a capture keeps).
    ///
    /// ```
    /// use gpu_pool::{compat::opencv::BufferPool, Device, PoolError, Stream};
    /// let stream = Stream::new(&Device::host_with_limit(64 << 20))?;
    /// let err = BufferPool::new(&stream).get_buffer_1d::<u8>(1 << 30).unwrap_err();
    /// let context = err.context().expect("a buffer asked");
    /// assert_eq!(context.stream, stream.id());
    /// assert_eq!(context.site.file(), file!());
    /// # Ok::<(), PoolError>(())
    /// ```
    pub fn context(&self) -> Option<&RequestContext> {
        match self {
            PoolError::OutOfMemory { context, .. }
            | PoolError::StackExhausted { context, .. }
            | PoolError::Capture(CaptureError::NeedsStack { context, .. })
            | PoolError::Capture(CaptureError::Allocates { context, .. })
            | PoolError::AllocatorContract { context, .. } => context.as_ref(),
            _ => None,
        }
    }

    /// An out-of-memory with what the device's holders gave back (`reclaimed`, the limit it
    /// already carries kept); other errors as they are.
    #[cold]
    pub(crate) fn with_reclaimed(mut self, mut reclaimed: Reclaimed) -> PoolError {
        if let PoolError::OutOfMemory { reclaimed: r, .. } = &mut self {
            reclaimed.limit = reclaimed.limit.or(r.as_ref().and_then(|r| r.limit));
            *r = Some(Box::new(reclaimed));
        }
        self
    }

    /// The error with `context` as its request context, where it is a memory error and has none
    /// yet: the one way a request context is attached (by the stream, as the error leaves the take).
    #[cold]
    pub(crate) fn at(mut self, request: RequestContext) -> PoolError {
        match &mut self {
            PoolError::OutOfMemory { context, .. }
            | PoolError::StackExhausted { context, .. }
            | PoolError::Capture(CaptureError::NeedsStack { context, .. })
            | PoolError::Capture(CaptureError::Allocates { context, .. })
            | PoolError::AllocatorContract { context, .. } => {
                context.get_or_insert(request);
            }
            _ => {}
        }
        self
    }
}

/// The buffer request behind a memory error: who asked, on which stream, and the stack that would
/// have served it without allocating. See [`PoolError::context`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RequestContext {
    /// The `buffer!` or runtime call.
    pub site: CallSite,
    /// The stream ([`Stream::id`](crate::Stream::id)).
    pub stream: u64,
    /// Bytes of stack that would have held the request with what was in use, where the stack was
    /// too full or too small for it (`None` for a request not meant for the stack, or where that
    /// sum wraps).
    pub stack_needed: Option<usize>,
}

/// The error a failed call returned, kept whole as a [`PoolError`]'s cause (shared, so the
/// `PoolError` stays `Clone`). [`source`](std::error::Error::source) of the `PoolError` is that
/// error itself, not this wrapper, so it downcasts to its own type; a match on the variant reaches
/// it through `Deref`. Made with `.into()` from any error. Two causes are equal when they are one
/// error (clones) or print the same `Debug` text (the same `CUresult`, the same OS error), so
/// `PoolError` keeps `PartialEq` and `Eq`.
///
/// ```
/// use std::error::Error as _;
/// use std::io;
/// use gpu_pool::PoolError;
/// let err = PoolError::Io {
///     path: "trace.json".into(),
///     source: io::Error::from(io::ErrorKind::PermissionDenied).into(),
/// };
/// let io = err.source().and_then(|e| e.downcast_ref::<io::Error>()).unwrap();
/// assert_eq!(io.kind(), io::ErrorKind::PermissionDenied);
/// if let PoolError::Io { source, .. } = &err {
///     assert_eq!(source.kind(), io::ErrorKind::PermissionDenied);
/// }
/// ```
// Deliberately not `Error` itself: `source()` of the `PoolError` returns the error inside, through
// `Deref`, so that it downcasts to its own type.
pub struct Cause<E: ?Sized + 'static = dyn Error + Send + Sync>(Arc<E>);

impl<E: ?Sized> Clone for Cause<E> {
    fn clone(&self) -> Self {
        Cause(Arc::clone(&self.0))
    }
}

// As anyhow's `Error`: a cause is read, never changed, so a panic cannot leave one half-written;
// this keeps `PoolError` as unwind-safe as its other fields are.
impl<E: ?Sized> std::panic::UnwindSafe for Cause<E> {}
impl<E: ?Sized> std::panic::RefUnwindSafe for Cause<E> {}

impl<E: ?Sized> Deref for Cause<E> {
    type Target = E;

    fn deref(&self) -> &E {
        &self.0
    }
}

impl<E: ?Sized + fmt::Debug> fmt::Debug for Cause<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

// Equal when they are one error (clones of one `PoolError`): errors have no equality of their own,
// and comparing their texts would format them, which for cudarc's `DriverError` asks the driver.
impl<E: ?Sized> PartialEq for Cause<E> {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl<E: ?Sized> Eq for Cause<E> {}

impl<E: ?Sized + fmt::Display> fmt::Display for Cause<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

impl<E: Error + Send + Sync + 'static> From<E> for Cause {
    fn from(error: E) -> Self {
        Cause(Arc::new(error))
    }
}

impl From<std::io::Error> for Cause<std::io::Error> {
    fn from(error: std::io::Error) -> Self {
        Cause(Arc::new(error))
    }
}

/// "NCCL call ncclCommInitAll", or "an NCCL call made through cudarc".
fn nccl_call_words(call: &str) -> String {
    if call == PoolError::CUDARC_CALL {
        "an NCCL call made through cudarc".into()
    } else {
        format!("NCCL call {call}")
    }
}

/// "CUDA call cuMemAlloc", or "a CUDA driver call made through cudarc" where the call is not known.
fn call_words(call: &str) -> String {
    if call == PoolError::CUDARC_CALL {
        "a CUDA driver call made through cudarc".into()
    } else {
        format!("CUDA call {call}")
    }
}

#[cfg(feature = "cuda")]
impl From<cudarc::driver::DriverError> for PoolError {
    /// A driver error of a cudarc call, as [`PoolError::Driver`] with
    /// [`CUDARC_CALL`](PoolError::CUDARC_CALL) as its call and the error as its source.
    fn from(error: cudarc::driver::DriverError) -> Self {
        PoolError::Driver {
            call: PoolError::CUDARC_CALL,
            source: error.into(),
        }
    }
}

#[cfg(feature = "cuda")]
impl From<cudarc::nvrtc::CompileError> for PoolError {
    /// An nvrtc compile error, as [`PoolError::Nvrtc`] with the error as its source.
    fn from(error: cudarc::nvrtc::CompileError) -> Self {
        PoolError::Nvrtc {
            source: error.into(),
        }
    }
}

#[cfg(feature = "cuda")]
impl From<cudarc::nvrtc::result::NvrtcError> for PoolError {
    /// An error of a call into nvrtc, as [`PoolError::Nvrtc`] with the error as its source.
    fn from(error: cudarc::nvrtc::result::NvrtcError) -> Self {
        PoolError::Nvrtc {
            source: error.into(),
        }
    }
}

#[cfg(feature = "cublas")]
impl From<cudarc::cublas::result::CublasError> for PoolError {
    /// An error of a cuBLAS call, as [`PoolError::Cublas`] with the error as its source.
    fn from(error: cudarc::cublas::result::CublasError) -> Self {
        PoolError::Cublas {
            source: error.into(),
        }
    }
}

/// NCCL's status of a failed call as an error: cudarc's `NcclError` is not a
/// `std::error::Error`, so [`NcclError::Call`] keeps it in this one (feature `nccl`).
#[cfg(feature = "nccl")]
#[derive(Debug)]
pub struct NcclFailure(pub cudarc::nccl::result::NcclError);

#[cfg(feature = "nccl")]
impl fmt::Display for NcclFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The status's name (`ncclInvalidUsage`): no call into NCCL, which may be what failed.
        write!(f, "{:?}", self.0.0)
    }
}

#[cfg(feature = "nccl")]
impl Error for NcclFailure {}

#[cfg(feature = "nccl")]
impl From<cudarc::nccl::result::NcclError> for PoolError {
    /// An error of an NCCL call made through cudarc (`Comm::all_reduce` and the like), as
    /// [`NcclError::Call`] with the status as its source.
    fn from(error: cudarc::nccl::result::NcclError) -> Self {
        PoolError::Nccl(NcclError::Call {
            call: PoolError::CUDARC_CALL,
            source: NcclFailure(error).into(),
        })
    }
}

/// What the device held idle and gave back before an out-of-memory, or nothing.
fn reclaimed_text(reclaimed: &Option<Box<Reclaimed>>) -> String {
    reclaimed
        .as_ref()
        .map(|r| r.to_string())
        .unwrap_or_default()
}

/// ", stream N at `name` at file:line" for a memory error's request, or nothing.
fn request_at(context: &Option<RequestContext>) -> String {
    context
        .map(|r| format!(", stream {} at {}", r.stream, r.site))
        .unwrap_or_default()
}

/// " (stream N at `name` at file:line)" for a memory error's request, or nothing.
fn request_paren(context: &Option<RequestContext>) -> String {
    context
        .map(|r| format!(" (stream {} at {})", r.stream, r.site))
        .unwrap_or_default()
}

/// " (a stack of N bytes would hold it: GPU_POOL_CONF=stack_size=XMiB)", where one can be written.
fn stack_hint(context: &Option<RequestContext>) -> String {
    match context.and_then(|r| r.stack_needed).and_then(stack_mib) {
        Some((needed, mib)) => {
            format!(" (a stack of {needed} bytes would hold it: GPU_POOL_CONF=stack_size={mib}MiB)")
        }
        None => String::new(),
    }
}

/// The stack size that would have served the request instead, as a `GPU_POOL_CONF` value.
fn request_fix(context: &Option<RequestContext>) -> String {
    match context.and_then(|r| r.stack_needed).and_then(stack_mib) {
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

#[cfg(test)]
mod tests {
    /// A buffer refused during a capture carries its request, as every memory error of a buffer
    /// does. On the host: the thread marked as capturing, as `Stream::capture` marks it.
    #[cfg(feature = "cuda")]
    #[test]
    fn a_buffer_refused_in_a_capture_carries_its_request() -> Result<(), crate::PoolError> {
        use crate::base::error::CaptureError;
        use crate::compat::opencv::{BufferPool, GpuMat, set_buffer_pool_config};
        use crate::{Device, PoolError, Stream};

        let device = Device::private_host();
        set_buffer_pool_config(&device, 1 << 20, 1)?;
        let stream = Stream::new(&device)?;
        let pool = BufferPool::new(&stream);
        let live = pool.get_buffer_1d::<u8>(4096)?; // the stream holds its stack
        let capture = crate::core::capturing::ThreadCapture::begin();

        let (line, err) = (line!(), pool.get_buffer_1d::<u8>(2 << 20).unwrap_err());
        assert!(
            matches!(err, PoolError::Capture(CaptureError::NeedsStack { requested, .. }) if requested == 2 << 20),
            "{err}"
        );
        let context = err.context().expect("a request");
        assert_eq!((context.stream, context.site.line()), (stream.id(), line));
        assert_eq!(context.stack_needed, Some(4096 + (2 << 20)));
        let text = err.to_string();
        let at = format!("(stream {} at {}:{line})", stream.id(), file!());
        assert!(text.contains(&at), "{text}");
        assert!(text.contains("GPU_POOL_CONF=stack_size=3MiB"), "{text}");

        // A buffer of its own asks the driver, which a capture refuses too.
        let (line, err) = (line!(), GpuMat::<u8>::new(&stream, 4, 4).unwrap_err());
        assert!(
            matches!(err, PoolError::Capture(CaptureError::Allocates { .. })),
            "{err}"
        );
        let context = err.context().expect("a request");
        assert_eq!((context.stream, context.site.line()), (stream.id(), line));
        assert_eq!(context.stack_needed, None);

        drop(capture);
        drop(live);
        assert_eq!(stream.stats().stack_in_use, 0);
        Ok(())
    }
}
