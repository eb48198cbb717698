//! CUDA graphs of pooled code: capture a function once, replay it with one launch.
//!
//! A stack take makes no stream operation (and no driver call at all below a growable stack's
//! mapped end; above it, mapping more is no stream work either), so pooled code can be captured:
//! every `buffer!` of the captured work gets a stack address during the capture, and the graph reuses those addresses on
//! every replay. The graph holds that part of the stack for as long as it lives, so no other buffer
//! is given memory a replay writes.
//!
//! What the API guarantees:
//! - a graph replays on the stream it was captured on, which it borrows: the stream, its stack, and
//!   everything the captured closure borrowed outlive the graph. So an output read between
//!   replays is borrowed shared by the closure: kernels take its address with
//!   [`.buf(&out)`](crate::interop::LaunchArgsExt::buf), and pool operations that need `&mut`
//!   (`copy_from`, `set_to`) reach it through a `RefCell` (`out.borrow_mut()` in the closure,
//!   `out.borrow()` between replays), as in the example below and the guide's "Graphs". An output
//!   borrowed mutably is readable once the graph is dropped;
//! - a buffer the stack cannot serve during capture is `CaptureError::NeedsStack`, before any
//!   driver call could invalidate the capture; a failing or panicking closure ends the capture and
//!   leaves the stream usable;
//! - buffers taken during the capture must be gone when it ends (the DSL sees to that); a buffer
//!   kept past it is `CaptureError::KeptBuffers` and no graph is made;
//! - a fallback or driver buffer released inside the capture (one made before it) is freed when
//!   the graph is dropped, not before: its replays may use it;
//! - the capture records only this stream's work: work that would cross streams (a cross-stream
//!   `copy_from`, `record_stream`, a cudarc call on another stream with pool memory) is refused
//!   with `CaptureError::CrossStream`, and pool work on a stream that another capture pulled
//!   in with `CaptureError::Elsewhere`. Buffers of other streams (`gpu_scope!` on another
//!   stream inside the closure) run eagerly on their stream, as outside a capture;
//! - nothing captured reads host memory the graph could outlive: uploads wait for the host (which a
//!   capture refuses), `set_to` fills with device-side operations only, and `MixMemory` copies
//!   are refused while capturing;
//! - a fallback or driver buffer of the stream made before the capture began, and released while
//!   the graph lives (inside the closure, or after it through a `RefCell` say), is freed when the
//!   graph is dropped: every replay may write it. Buffers made after the capture are no graph's;
//! - only the pool can end the capture, so only the pool makes its graph: the capture is begun on
//!   a private stream that the stream joins, and cudarc's `end_capture` on the stream fails.
//!
//! Errors compose: inside the closure, cudarc's errors convert into `PoolError` with `?` (a kernel
//! launch's `DriverError`, cuBLAS's `CublasError`; each kept as the error's `source()`), so
//! [`Stream::capture`] takes a closure of `Result<(), PoolError>` with no `map_err`. A closure of an
//! error type of your own, one a `PoolError` converts into, goes to
//! [`Stream::capture_with`]`::<E>`: its error comes back unchanged, the pool's converted.
//!
//! ```no_run
//! use std::cell::RefCell;
//! use gpu_pool::prelude::*;
//! # fn main() -> Result<(), PoolError> {
//! let stream = Stream::new(&Device::cuda(0)?)?;
//! let out = RefCell::new(DeviceMat::<f32>::new(&stream, 512, 512)?);
//! let graph = stream.capture(|s| {
//!     let mut tmp = s.temp::<f32>(512, 512)?;                        // a stack address, reused
//!     tmp.set_to(1.0)?;                                               // ... kernels on tmp ...
//!     out.borrow_mut().copy_from(&tmp)                                // an output, through RefCell
//! })?;
//! for _ in 0..1000 {
//!     graph.launch()?; // one driver call, no allocation
//!     let _first = out.borrow().row_range(0..1)?.to_vec()?; // readable between replays
//! }
//! # Ok(()) }
//! ```

mod family;
mod shapes;

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{CudaContext, result, sys};

use crate::base::error::CaptureError;
use crate::base::error::PoolError;
use crate::core::capturing::{self, ThreadCapture};
use crate::core::fence::Fence;
use crate::core::replay::{self, ReplayHook};
use crate::core::stream::Stream;
use crate::storage::backend::cuda::{ContextGuard, driver_error};

pub use family::GraphFamily;
pub use shapes::{EagerCalls, GraphKey, GraphKeys, Outputs, ShapeStats, shape_stats};
#[doc(hidden)]
pub use shapes::{GraphSite, OutputLayout, graphed};

/// A captured CUDA graph of pooled work, replayed with [`launch`](Graph::launch) on the stream it
/// was captured on. Dropping it gives back the stack memory its replays use.
#[must_use = "a graph does nothing unless launched; dropping it gives its memory back"]
pub struct Graph<'a> {
    stream: &'a Stream,
    /// The stream's CUDA stream, which the replays are queued on.
    cu_stream: sys::CUstream,
    exec: Exec,
    /// The stack block the replays use: a one-byte fence at the capture's start, grown to the
    /// bytes the captured buffers reached above it. Released on drop. (Always `Some` while the
    /// graph lives: an `Option` so the capture's guard can hand it over, and `drop` take it.)
    reserved: Option<Fence>,
    /// The stream's capture count when this graph's capture began: memory allocated before it
    /// may be used by the replays, and is kept when released until the graph is dropped.
    epoch: u64,
    /// What features noted during the capture for each replay to do (SharedMat's accesses: each
    /// replay is ordered as an access of the memory).
    replays: Option<Box<dyn ReplayHook>>,
    /// The family whose region holds the replays' buffers, for a member of one (`reserved` is
    /// then `None`).
    family: Option<&'a family::Region>,
    /// Whatever the captured closure borrowed stays borrowed while the graph lives.
    _captures: PhantomData<&'a ()>,
}

impl std::fmt::Debug for Graph<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graph")
            .field("stream", &self.stream.id())
            .field("stack_bytes", &self.stack_bytes())
            .finish()
    }
}

impl Graph<'_> {
    /// Replays the captured work on its stream: one launch, no allocation.
    ///
    /// `CaptureError::Elsewhere` if the stream is being captured by anything else: that
    /// graph would replay this one's memory after it is given back. `CaptureError::SharedAccessOpen`
    /// if the graph accesses a [`SharedMat`](crate::shared::SharedMat) that a guard on another stream
    /// still accesses in a conflicting way (see [`crate::shared`]): nothing is queued.
    pub fn launch(&self) -> Result<(), PoolError> {
        self.ready()?;
        // Each replay is an access of the shared memory its capture accessed: ordered after the
        // accesses it conflicts with, and before later ones.
        let parts = [(self.stream, self.replays.as_deref())];
        replay::replay("Graph::launch", &parts, &mut |_| self.queue()).map_err(|(_, e)| e)
    }

    /// Replays `graphs` in order, each on its stream, as one step for their shared memory: every
    /// graph's checks (and a refusal) come before any is queued. An error comes with how many
    /// graphs were queued before it.
    #[cfg(feature = "nccl")]
    pub(crate) fn launch_together(graphs: &[Graph<'_>]) -> Result<(), (usize, PoolError)> {
        for graph in graphs {
            if graph.stream.in_own_capture() {
                // Its replay would only be captured while the others run: out of step for good.
                return Err((
                    0,
                    PoolError::Unsupported {
                        device: graph.stream.device().id(),
                        what: "replaying rank graphs inside a capture of one rank's stream",
                    },
                ));
            }
            graph.ready().map_err(|e| (0, e))?;
        }
        let parts: Vec<_> = graphs
            .iter()
            .map(|g| (g.stream, g.replays.as_deref()))
            .collect();
        replay::replay("RankGraphs::launch", &parts, &mut |i| graphs[i].queue())
    }

    /// What must hold before a replay is queued.
    fn ready(&self) -> Result<(), PoolError> {
        self.stream.work_stream("Graph::launch")?;
        if let Some(region) = self.family {
            if self.stream.in_own_capture() {
                // The region is lowered under the capture of another member.
                return Err(PoolError::Unsupported {
                    device: self.stream.device().id(),
                    what: "launching a graph of a family inside a capture on its stream",
                });
            }
            region.cover(self.stream)?;
        }
        Ok(())
    }

    /// Queues one replay.
    fn queue(&self) -> Result<(), PoolError> {
        self.exec.launch(self.cu_stream)
    }

    /// What the graph is made of: its nodes counted by kind. A graph of pooled work has no
    /// allocation nodes; a library that allocated during the capture (cuBLAS without a workspace,
    /// say) shows up as `allocs`.
    pub fn nodes(&self) -> Result<GraphNodes, PoolError> {
        use sys::CUgraphNodeType as Kind;
        let _guard = ContextGuard::bind(&self.exec.ctx)?;
        let mut count = 0usize;
        // SAFETY: `graph` is live (owned by `self`); a null array asks for the count only.
        unsafe { sys::cuGraphGetNodes(self.exec.graph, std::ptr::null_mut(), &mut count) }
            .result()
            .map_err(|e| driver_error("cuGraphGetNodes", e))?;
        let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); count];
        // SAFETY: as above; `nodes` has room for `count` handles, and `count` says how many were
        // written.
        unsafe { sys::cuGraphGetNodes(self.exec.graph, nodes.as_mut_ptr(), &mut count) }
            .result()
            .map_err(|e| driver_error("cuGraphGetNodes", e))?;
        let mut census = GraphNodes::default();
        for &node in &nodes[..count.min(nodes.len())] {
            let mut kind = Kind::CU_GRAPH_NODE_TYPE_EMPTY;
            // SAFETY: a node of the live graph, as the driver just listed it.
            unsafe { sys::cuGraphNodeGetType(node, &mut kind) }
                .result()
                .map_err(|e| driver_error("cuGraphNodeGetType", e))?;
            let slot = match kind {
                Kind::CU_GRAPH_NODE_TYPE_KERNEL => &mut census.kernels,
                Kind::CU_GRAPH_NODE_TYPE_MEMCPY => &mut census.memcpys,
                Kind::CU_GRAPH_NODE_TYPE_MEMSET => &mut census.memsets,
                Kind::CU_GRAPH_NODE_TYPE_MEM_ALLOC => &mut census.allocs,
                Kind::CU_GRAPH_NODE_TYPE_MEM_FREE => &mut census.frees,
                _ => &mut census.others,
            };
            *slot += 1;
        }
        Ok(census)
    }

    /// The stream the graph replays on.
    #[must_use]
    pub fn stream(&self) -> &Stream {
        self.stream
    }

    /// Stack bytes held for the replays' buffers (the fence included); 0 for a member of a
    /// [`GraphFamily`], whose region holds them ([`GraphFamily::stack_bytes`]).
    #[must_use]
    pub fn stack_bytes(&self) -> usize {
        self.reserved
            .as_ref()
            .map_or(0, |block| block.end() - block.prev_top())
    }
}

impl Drop for Graph<'_> {
    fn drop(&mut self) {
        // Replays queued on the stream run before any later use of this memory on that stream.
        if let Some(reserved) = self.reserved.take() {
            self.stream.release_reserved(reserved);
        }
        self.stream.graph_dropped(self.epoch);
    }
}

/// The nodes of a [`Graph`], counted by kind ([`Graph::nodes`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GraphNodes {
    /// Kernel launches.
    pub kernels: usize,
    /// Copies.
    pub memcpys: usize,
    /// Fills.
    pub memsets: usize,
    /// Memory allocations (`cudaMallocAsync` captured): what a pooled graph never has.
    pub allocs: usize,
    /// Frees of such allocations.
    pub frees: usize,
    /// Everything else (event records and waits, empty nodes, child graphs, host calls).
    pub others: usize,
}

/// An instantiated graph and the graph it came from, destroyed together.
struct Exec {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    ctx: Arc<CudaContext>,
}

// SAFETY: the handles are the driver's, usable from any thread with their context bound (every
// use binds `ctx`); `Exec` owns them alone, so moving it moves that ownership.
unsafe impl Send for Exec {}

impl Exec {
    /// Queues one replay on `cu_stream`.
    fn launch(&self, cu_stream: sys::CUstream) -> Result<(), PoolError> {
        let _guard = ContextGuard::bind(&self.ctx)?;
        // SAFETY: `exec` is a live executable graph of this context (owned by `self`); every
        // caller passes the CUDA stream of the pool stream the graph was captured on, alive while
        // that stream is borrowed.
        unsafe { result::graph::launch(self.exec, cu_stream) }
            .map_err(|e| driver_error("cuGraphLaunch", e))
    }
}

impl Drop for Exec {
    fn drop(&mut self) {
        let _guard = ContextGuard::bind(&self.ctx);
        // SAFETY: both handles are ours alone (made by `Capturing::end`), live, destroyed once.
        // Launches queued on the stream keep what they need: the driver defers the release.
        unsafe {
            let _ = result::graph::exec_destroy(self.exec);
            let _ = result::graph::destroy(self.graph);
        }
    }
}

/// A stream of the pool's own that a capture begins on, so that only the pool can end it.
struct Origin {
    stream: sys::CUstream,
    ctx: Arc<CudaContext>,
}

impl Origin {
    fn new(ctx: &Arc<CudaContext>) -> Result<Origin, PoolError> {
        let _guard = ContextGuard::bind(ctx)?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| driver_error("cuStreamCreate", e))?;
        Ok(Origin {
            stream,
            ctx: ctx.clone(),
        })
    }
}

impl Drop for Origin {
    fn drop(&mut self) {
        let _guard = ContextGuard::bind(&self.ctx);
        // SAFETY: made by `Origin::new`, no longer capturing (the capture ended first), destroyed
        // once.
        let _ = unsafe { result::stream::destroy(self.stream) };
    }
}

/// Makes `later` wait for the work queued on `first` so far: an event between them, which inside a
/// capture joins `later` to `first`'s capture.
///
/// # Safety
/// Both streams are live streams of the current context.
unsafe fn follow(first: sys::CUstream, later: sys::CUstream) -> Result<(), PoolError> {
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
    let event = result::event::create(flags).map_err(|e| driver_error("cuEventCreate", e))?;
    // SAFETY: the event was made above; the streams are live (the caller's contract). Destroying
    // an event with work waiting on it is allowed: the driver releases it once that work is done.
    let joined = unsafe {
        result::event::record(event, first).and_then(|()| {
            result::stream::wait_event(later, event, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
        })
    };
    // SAFETY: made above, destroyed once.
    let _ = unsafe { result::event::destroy(event) };
    joined.map_err(|e| driver_error("cuStreamWaitEvent", e))
}

/// Ends a capture on every way out of [`Stream::capture`], a panic included, so the stream is never
/// left capturing and the fence never left held.
struct Capturing<'s> {
    stream: &'s Stream,
    /// The pool stream's CUDA stream, which joins the capture of `origin`.
    cu_stream: sys::CUstream,
    origin: Origin,
    fence: Option<Fence>,
    /// Where the fence ends: the stack's top once every buffer taken inside is released.
    fence_end: usize,
    /// The stream's capture count when this capture began (the graph's epoch).
    epoch: u64,
    /// The stream's stack high-water mark before the capture, restored after it (taken by
    /// whichever comes first: the capture's end, or the guard's drop where it never began).
    high_water: Option<u64>,
    /// The highest stack offset the captured buffers reached.
    peak: usize,
    /// Marks the capture on this thread until it ends.
    thread: Option<ThreadCapture>,
    /// What features noted for the replays, taken from the stream when the capture ends.
    replays: Option<Box<dyn ReplayHook>>,
    /// The family region the capture packs its buffers in (instead of `fence`), lowered to its
    /// base while the capture is under way.
    family: Option<&'s family::Region>,
}

impl Capturing<'_> {
    /// Begins the capture on the private origin stream and joins the pool stream to it.
    fn begin(&mut self) -> Result<(), PoolError> {
        let _guard = ContextGuard::bind(&self.origin.ctx)?;
        // Relaxed: the thread may still wait for other streams and free memory (a stream dropped
        // inside, a lend to cudarc on another stream, MixMemory's waits). What would break the
        // capture is refused by the pool itself, before the driver sees it.
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: the origin stream is live and ours.
        unsafe { result::stream::begin_capture(self.origin.stream, mode) }
            .map_err(|e| driver_error("cuStreamBeginCapture", e))?;
        capturing::take_refused();
        self.thread = Some(ThreadCapture::begin());
        self.stream.set_own_capture(true);
        // SAFETY: both streams are live streams of the context bound above.
        unsafe { follow(self.origin.stream, self.cu_stream) }
    }

    /// Ends the capture: the executable graph, if the driver made one and nothing was refused.
    /// The capture always ends, whatever happened inside; after a failed one the device is
    /// waited for, so work that ran eagerly beside it is done before its memory is reused.
    fn end(&mut self) -> Result<Option<Exec>, PoolError> {
        // Best effort: the capture must end even if the context cannot be bound (the calls below
        // name their streams, which carry their context).
        let _guard = ContextGuard::bind(&self.origin.ctx).ok();
        // SAFETY: both streams are live streams of the context bound above.
        let joined = unsafe { follow(self.cu_stream, self.origin.stream) };
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: the origin stream is live and capturing; `graph` receives the graph or null.
        let ended = unsafe { sys::cuStreamEndCapture(self.origin.stream, &mut graph) }.result();
        self.stream.set_own_capture(false);
        self.replays = self.stream.take_replay_hook();
        self.thread = None;
        if let Some(before) = self.high_water.take() {
            self.peak = self.stream.end_high_water(before);
        }
        let refused = capturing::take_refused();
        let made = (|| {
            if refused {
                return Err(PoolError::Capture(CaptureError::CrossStream {
                    what: "a cudarc call with pool memory",
                }));
            }
            joined?;
            ended.map_err(|e| driver_error("cuStreamEndCapture", e))?;
            if graph.is_null() {
                return Ok(None);
            }
            // SAFETY: a graph the driver just made from our capture.
            let exec =
                unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) }
                    .map_err(|e| driver_error("cuGraphInstantiate", e))?;
            Ok(Some(Exec {
                graph: std::mem::replace(&mut graph, std::ptr::null_mut()),
                exec,
                ctx: self.origin.ctx.clone(),
            }))
        })();
        if !graph.is_null() {
            // SAFETY: made by the driver for us, not instantiated, destroyed once.
            let _ = unsafe { result::graph::destroy(graph) };
        }
        if made.is_err() {
            // SAFETY: a plain device-wide wait, outside any capture of this thread now.
            if let Err(e) = unsafe { sys::cuCtxSynchronize() }.result() {
                crate::base::event::error!(error = %driver_error("cuCtxSynchronize", e), "waiting after a failed capture failed");
            }
        }
        made
    }
}

impl<'s> Capturing<'s> {
    /// The graph of a capture that ended with `ended` (what [`end`](Capturing::end) returned),
    /// after the closure succeeded: the fence grown to what the captured buffers used, held by the
    /// graph. On an error the guard gives the fence back as it drops.
    fn into_graph(
        mut self,
        ended: Result<Option<Exec>, PoolError>,
    ) -> Result<Graph<'s>, PoolError> {
        let stream = self.stream;
        let exec = ended?.ok_or(PoolError::Unsupported {
            device: stream.device().id(),
            what: "a capture the driver made no graph of",
        })?;
        if stream.stack_top() != Some(self.fence_end) {
            // A buffer taken inside is still live: the graph would write memory it owns.
            return Err(PoolError::Capture(CaptureError::KeptBuffers));
        }
        if let Some(fence) = self.fence.as_mut() {
            stream.reserve_up_to(fence, self.peak)?;
        }
        if let Some(region) = self.family {
            region.raise(stream, self.peak)?;
        }
        let family = self.family.take();
        let reserved = self.fence.take();
        stream.graph_made(self.epoch);
        Ok(Graph {
            stream,
            cu_stream: self.cu_stream,
            exec,
            reserved,
            epoch: self.epoch,
            replays: self.replays.take(),
            family,
            _captures: PhantomData,
        })
    }
}

impl Drop for Capturing<'_> {
    fn drop(&mut self) {
        if self.stream.in_own_capture() {
            drop(self.end());
        }
        if let Some(before) = self.high_water.take() {
            // The driver refused to begin: the stream's mark is what it was.
            self.stream.end_high_water(before);
        }
        if let Some(fence) = self.fence.take() {
            self.stream.release_reserved(fence);
            // No graph: what releases kept for it can go.
            self.stream.drain_deferred();
        }
        if let Some(region) = self.family.take() {
            // No new member: the region goes back up to what the members have (or, under a
            // buffer kept from the capture, when that is released: their launches check).
            let _ = region.cover(self.stream);
            self.stream.drain_deferred();
        }
        // The captured buffers' memory is the graph's fence's now, or no graph's.
        self.stream.hold_stack_for_capture(false);
    }
}

impl Stream {
    /// Captures the GPU work `work` queues on this stream into a [`Graph`], to replay it with one
    /// launch (see [the module](crate::graph)). Buffers taken inside come from this stream's
    /// stack, and the graph keeps their memory for its replays.
    ///
    /// For a closure of another error type (one of your own that wraps `PoolError`), use
    /// [`capture_with`](Stream::capture_with): this one fixes the error to `PoolError`, so a
    /// closure that ends in `Ok(())` needs no annotation.
    ///
    /// Errors: `PoolError::Unsupported` on the host backend; `CaptureOnLegacyStream` on a stream
    /// over the legacy default (null) stream, refused before any driver call (capture on a stream
    /// of its own); `CaptureNeedsStack` for a buffer the
    /// stack cannot serve; `CaptureKeptBuffers` if a buffer taken inside outlives the capture;
    /// `CaptureCrossStream` for work that would reach another stream (preferred over the error
    /// the closure returned after it); `CapturedElsewhere` if the stream is already being captured;
    /// `CaptureHostCopy` for an `upload` or `download` of a host slice inside it; the closure's
    /// own error; `PoolError::Driver` if the driver refused the capture (a synchronizing call
    /// inside it). The stream stays usable after any of them.
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
    pub fn capture<'a, F>(&'a self, work: F) -> Result<Graph<'a>, PoolError>
    where
        F: FnOnce(&'a Stream) -> Result<(), PoolError> + 'a,
    {
        self.capture_with(work)
    }

    /// [`capture`](Stream::capture) for a closure of any error type `E` that a `PoolError`
    /// converts into: the closure's error comes back unchanged, the pool's own errors (the same
    /// as `capture`'s) converted with `E::from`. Name the type once, where `?` inside the closure
    /// leaves it open: `stream.capture_with::<AppError>(|s| { ...; Ok(()) })`.
    ///
    /// ```no_run
    /// use gpu_pool::prelude::*;
    ///
    /// #[derive(Debug)]
    /// enum AppError {
    ///     Pool(PoolError),
    ///     BadInput,
    /// }
    /// impl From<PoolError> for AppError {
    ///     fn from(e: PoolError) -> Self {
    ///         AppError::Pool(e)
    ///     }
    /// }
    ///
    /// # fn main() -> Result<(), AppError> {
    /// let stream = Stream::new(&Device::cuda(0)?)?;
    /// let (rows, cols) = (512, 512);
    /// let graph = stream.capture_with::<AppError>(|s| {
    ///     if rows == 0 {
    ///         return Err(AppError::BadInput); // comes back as it is
    ///     }
    ///     let mut tmp = s.temp::<f32>(rows, cols)?;
    ///     tmp.set_to(0.0)?; // a PoolError, converted
    ///     Ok(())
    /// })?;
    /// graph.launch()?;
    /// # Ok(()) }
    /// ```
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
    pub fn capture_with<'a, E>(
        &'a self,
        work: impl FnOnce(&'a Stream) -> Result<(), E> + 'a,
    ) -> Result<Graph<'a>, E>
    where
        E: From<PoolError>,
    {
        self.capture_in(None, work)
    }

    /// A capture of `work`, in `family`'s region or behind a fence of its own.
    fn capture_in<'a, E>(
        &'a self,
        family: Option<&'a family::Region>,
        work: impl FnOnce(&'a Stream) -> Result<(), E> + 'a,
    ) -> Result<Graph<'a>, E>
    where
        E: From<PoolError>,
    {
        let mut capturing = self.begin_capture(family, false)?;
        let worked = work(self);
        let ended = capturing.end();
        if let Err(e @ PoolError::Capture(CaptureError::CrossStream { .. })) = ended {
            // The cause, rather than what the invalidated capture made of the closure's later
            // work.
            return Err(e.into());
        }
        worked?;
        Ok(capturing.into_graph(ended)?)
    }

    /// `CaptureError::LegacyStream` for `what` if this stream wraps the legacy default (null)
    /// stream. The driver refuses to capture it, and with a raw error whose advice would say the
    /// context is unusable; refused here, before any driver call, nothing needs undoing.
    pub(crate) fn refuse_legacy_capture(&self, what: &'static str) -> Result<(), PoolError> {
        match self.cuda_stream() {
            Some(cuda) if cuda.cu_stream().is_null() => {
                Err(PoolError::Capture(CaptureError::LegacyStream {
                    what,
                    stream: self.id(),
                    device: self.device().id(),
                }))
            }
            _ => Ok(()),
        }
    }

    /// Everything before the captured closure runs: checks, the fence, the capture begun (and
    /// ended again by the guard returned, on every way out).
    fn begin_capture<'a>(
        &'a self,
        family: Option<&'a family::Region>,
        at_top: bool,
    ) -> Result<Capturing<'a>, PoolError> {
        let Some(cuda) = self.cuda_stream() else {
            return Err(PoolError::Unsupported {
                device: self.device().id(),
                what: "CUDA graph capture",
            });
        };
        self.refuse_legacy_capture(if family.is_some() {
            "GraphFamily::capture"
        } else {
            "Stream::capture"
        })?;
        if self.in_own_capture() {
            return Err(PoolError::Unsupported {
                device: self.device().id(),
                what: "a capture inside a capture of the same stream",
            });
        }
        self.work_stream("Stream::capture")?;
        // Waits on events recorded outside the capture cannot join it: issue them now.
        self.issue_deferred_waits()?;
        let origin = Origin::new(cuda.context())?;
        // From here until the guard drops, its graph made or not, nothing above the top is given
        // back: a family's region lowered below is what its new member captures into.
        self.hold_stack_for_capture(true);
        // The fence may claim the stream's stack, and with it a wait for its last stream's work.
        // A family's region is the fence of its members, lowered to its base for the capture.
        let (fence, fence_end) = match family {
            // Graphs by shape hold nothing between calls: the capture's buffers are packed from
            // the top, where every replay of the same key finds the stack again.
            None if at_top => {
                if self.stack().is_none() {
                    let _ = self.claim_stack();
                }
                (None, self.stack_top().unwrap_or(0))
            }
            None => {
                let fence = self
                    .reserve_fence()
                    .inspect_err(|_| self.hold_stack_for_capture(false))?;
                let end = fence.end();
                (Some(fence), end)
            }
            Some(region) if region.lower(self) => (None, region.base),
            Some(_) => {
                self.hold_stack_for_capture(false);
                return Err(PoolError::Unsupported {
                    device: self.device().id(),
                    what: "capturing into a graph family while something taken after the \
                           family (a buffer, a graph, another family) is live (make the family \
                           first)",
                });
            }
        };
        // Again: the fence may have claimed the stack only now.
        self.hold_stack_for_capture(true);
        // Work queued before the capture is done before it starts, so nothing eager beside the
        // capture races it (if it fails here, the fence goes back as a release out of order).
        if let Err(e) = self.synchronize() {
            match (fence, family) {
                (Some(fence), _) => self.release_reserved(fence),
                (None, Some(region)) => drop(region.cover(self)),
                (None, None) => {}
            }
            self.hold_stack_for_capture(false);
            return Err(e);
        }
        // Memory released before the capture is freed before it (unless a graph still needs it).
        self.drain_deferred();
        let epoch = self.capture_begun();
        let mut capturing = Capturing {
            stream: self,
            cu_stream: cuda.cu_stream(),
            origin,
            fence,
            fence_end,
            epoch,
            high_water: Some(self.start_high_water(fence_end)),
            peak: fence_end,
            thread: None,
            replays: None,
            family,
        };
        capturing.begin()?;
        Ok(capturing)
    }
}
