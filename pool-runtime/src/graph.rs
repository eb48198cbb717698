//! CUDA graphs of pooled code: capture a function once, replay it with one launch.
//!
//! A stack take makes no driver call, so pooled code can be captured: every `buffer!` of the
//! captured work gets a stack address during the capture, and the graph reuses those addresses on
//! every replay. The graph holds that part of the stack for as long as it lives, so no other buffer
//! is given memory a replay writes.
//!
//! What the API guarantees:
//! - a graph replays on the stream it was captured on, which it borrows: the stream, its stack, and
//!   everything the captured closure borrowed outlive the graph. Capture outputs by shared
//!   reference (kernel arguments take `&GpuMat`) and read them between replays;
//! - a buffer the stack cannot serve during capture is `PoolError::CaptureNeedsStack`, before any
//!   driver call could invalidate the capture; a failing or panicking closure ends the capture and
//!   leaves the stream usable;
//! - buffers taken during the capture must be gone when it ends (the DSL sees to that); a buffer
//!   kept past it is `PoolError::CaptureKeptBuffers` and no graph is made;
//! - a fallback or driver buffer released inside the capture (one made before it) is freed when
//!   the graph is dropped, not before: its replays may use it;
//! - the capture records only this stream's work: work that would cross streams (a cross-stream
//!   `copy_from`, `record_stream`, a cudarc call on another stream with pool memory) is refused
//!   with `PoolError::CaptureCrossStream`, and pool work on a stream that another capture pulled
//!   in with `PoolError::CapturedElsewhere`. Buffers of other streams (`gpu_scope!` on another
//!   stream inside the closure) run eagerly on their stream, as outside a capture;
//! - nothing captured reads host memory the graph could outlive: uploads wait for the host (which a
//!   capture refuses), and `set_to` fills with device-side operations only.
//!
//! ```no_run
//! use gpu_pool_runtime::{BufferPool, Device, GpuMat, PoolError, Stream};
//! # fn main() -> Result<(), PoolError> {
//! let stream = Stream::new(&Device::cuda(0)?)?;
//! let out = GpuMat::<f32>::new(&stream, 512, 512)?;
//! let graph = stream.capture(|s| {
//!     let mut tmp = BufferPool::new(s).get_buffer::<f32>(512, 512)?; // a stack address, reused
//!     tmp.set_to(1.0)?;                                               // ... kernels on tmp, out ...
//!     let _ = &out;
//!     Ok(())
//! })?;
//! for _ in 0..1000 {
//!     graph.launch()?; // one driver call, no allocation
//! }
//! let result = out.to_vec()?; // outputs are readable between replays
//! # drop(result); Ok(()) }
//! ```

use std::marker::PhantomData;

use cudarc::driver::{CudaGraph, result, sys};

use crate::backend::cuda::driver_error;
use crate::capturing::{Kept, ThreadCapture};
use crate::error::PoolError;
use crate::stack::Block;
use crate::stream::Stream;

/// A captured CUDA graph of pooled work, replayed with [`launch`](Graph::launch) on the stream it
/// was captured on. Dropping it gives back the stack memory its replays use.
pub struct Graph<'a> {
    stream: &'a Stream,
    exec: CudaGraph,
    /// The stack blocks the replays use: a one-byte fence at the capture's start, and the bytes
    /// the captured buffers reached above it. Released in reverse order on drop.
    fence: Block,
    reserved: Option<Block>,
    /// Fallback and driver memory released during the capture, which replays may use.
    kept: Vec<Kept>,
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
    /// Replays the captured work on its stream: one driver call, no allocation.
    pub fn launch(&self) -> Result<(), PoolError> {
        self.exec
            .launch()
            .map_err(|e| driver_error("cuGraphLaunch", e))
    }

    /// The stream the graph replays on.
    pub fn stream(&self) -> &Stream {
        self.stream
    }

    /// Stack bytes held for the replays' buffers (the fence included).
    pub fn stack_bytes(&self) -> usize {
        let top = self.reserved.map_or(self.fence.end, |r| r.end);
        top - self.fence.prev_top
    }
}

impl Drop for Graph<'_> {
    fn drop(&mut self) {
        // Replays queued on the stream run before any later use of this memory on that stream.
        if let Some(reserved) = self.reserved.take() {
            self.stream.release_reserved(&reserved);
        }
        self.stream.release_reserved(&self.fence);
        self.stream.settle_kept(std::mem::take(&mut self.kept));
    }
}

/// Ends a capture on every way out of [`Stream::capture`], a panic included, so the stream is never
/// left capturing and the fence never left held.
struct Capturing<'s> {
    stream: &'s Stream,
    cuda: &'s std::sync::Arc<cudarc::driver::CudaStream>,
    fence: Option<Block>,
    /// The stream's stack high-water mark before the capture, restored after it.
    high_water: u64,
    /// The highest stack offset the captured buffers reached.
    peak: usize,
    /// Marks the capture on this thread until it ends.
    thread: Option<ThreadCapture>,
}

impl Capturing<'_> {
    /// Ends the capture: the graph if the driver made one.
    ///
    /// The capture always ends: cudarc's `end_capture` returns an error its context recorded
    /// earlier without ending it, so that error is taken first (it fails the capture), and a
    /// capture still under way after cudarc's call is ended here.
    fn end(&mut self) -> Result<Option<CudaGraph>, PoolError> {
        let recorded = self.cuda.context().check_err();
        let ended = self.cuda.end_capture(sys::CUgraphInstantiate_flags(0));
        let backend = &self.stream.device().storage().backend;
        if ended.is_err() && backend.is_capturing(&self.stream.raw).unwrap_or(true) {
            // SAFETY: the stream is alive (borrowed) and capturing; the graph the driver returns
            // is ours alone and destroyed once, here.
            unsafe {
                if let Ok(graph) = result::stream::end_capture(self.cuda.cu_stream())
                    && !graph.is_null()
                {
                    let _ = result::graph::destroy(graph);
                }
            }
        }
        self.stream.capturing.set(false);
        self.thread = None;
        self.peak = self.stream.end_high_water(self.high_water);
        if let Err(e) = recorded {
            // A refused cudarc call on another stream may still run eagerly on this stream's
            // memory, which is reused once the capture has failed: wait for every stream first.
            if let Err(e) = self.cuda.context().synchronize() {
                tracing::error!(error = %e, "synchronize after a refused capture failed");
            }
            return Err(
                if e.0 == sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_ISOLATION {
                    PoolError::CaptureCrossStream {
                        what: "a cudarc call with pool memory",
                    }
                } else {
                    driver_error("a cudarc call inside the capture", e)
                },
            );
        }
        ended.map_err(|e| driver_error("cuStreamEndCapture", e))
    }
}

impl Drop for Capturing<'_> {
    fn drop(&mut self) {
        if self.stream.capturing.get() {
            drop(self.end());
        }
        if let Some(fence) = self.fence.take() {
            self.stream.release_reserved(&fence);
            // No graph: what releases kept for it can go.
            self.stream.settle_kept(self.stream.take_kept());
        }
    }
}

impl Stream {
    /// Captures the GPU work `work` queues on this stream into a [`Graph`], to replay it with one
    /// launch (see [the module](crate::graph)). Buffers taken inside come from this stream's
    /// stack, and the graph keeps their memory for its replays.
    ///
    /// Errors: `PoolError::Unsupported` on the host backend; `CaptureNeedsStack` for a buffer the
    /// stack cannot serve; `CaptureKeptBuffers` if a buffer taken inside outlives the capture; the
    /// closure's own error; `PoolError::Driver` if the driver refused the capture (a synchronizing
    /// call such as `download` inside it). The stream stays usable after any of them.
    pub fn capture<'a, F>(&'a self, work: F) -> Result<Graph<'a>, PoolError>
    where
        F: FnOnce(&'a Stream) -> Result<(), PoolError> + 'a,
    {
        let Some(cuda) = self.cuda_stream() else {
            return Err(PoolError::Unsupported {
                device: self.device().id(),
                what: "CUDA graph capture",
            });
        };
        if self.capturing.get() {
            return Err(PoolError::Unsupported {
                device: self.device().id(),
                what: "a capture inside a capture of the same stream",
            });
        }
        if self.device().storage().backend.is_capturing(&self.raw)? {
            return Err(PoolError::CapturedElsewhere {
                what: "Stream::capture",
                stream: self.id(),
            });
        }
        if self.has_deferred_waits.get() {
            // Waits on events recorded outside the capture cannot join it: issue them now.
            self.issue_deferred_waits()?;
        }
        // Work queued before the capture is done before it starts, so an eager call on another
        // stream during it (refused, but already issued by cudarc) races nothing.
        self.synchronize()?;
        // Memory released before the capture is freed before it: inside, it could not be.
        self.settle_kept(self.take_kept());
        let fence = self.reserve_fence()?;
        let mut capturing = Capturing {
            stream: self,
            cuda,
            fence: Some(fence),
            high_water: self.start_high_water(fence.end),
            peak: fence.end,
            thread: None,
        };
        cuda.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| driver_error("cuStreamBeginCapture", e))?;
        capturing.thread = Some(ThreadCapture::begin());
        self.capturing.set(true);
        let worked = work(self);
        let graph = capturing.end();
        if let Err(e @ PoolError::CaptureCrossStream { .. }) = graph {
            // The cause, rather than what the invalidated capture made of the closure's later
            // work.
            return Err(e);
        }
        worked?;
        let exec = graph?.ok_or(PoolError::Unsupported {
            device: self.device().id(),
            what: "a capture the driver made no graph of",
        })?;
        if self.stack_top() != Some(fence.end) {
            // A buffer taken inside is still live: the graph would write memory it owns.
            return Err(PoolError::CaptureKeptBuffers);
        }
        let reserved = self.reserve_up_to(capturing.peak)?;
        capturing.fence = None;
        Ok(Graph {
            stream: self,
            exec,
            fence,
            reserved,
            kept: self.take_kept(),
            _captures: PhantomData,
        })
    }
}
