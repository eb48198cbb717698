//! Graphs that share their scratch: a [`GraphFamily`] holds one region of its stream's stack, and
//! every graph captured in it keeps its temporaries there. The graphs replay only on that one
//! stream, so never at once, and a replay's temporaries are dead when it ends: one region, as
//! large as the largest member's scratch, serves them all, where separate graphs hold the sum.
//!
//! What makes the sharing safe is kept by the types and the pool: a member borrows the family,
//! which borrows the stream, so every replay is queued on that stream, in order; a capture ends
//! with every buffer taken inside released (the DSL sees to that, and `CaptureKeptBuffers` refuses
//! a graph otherwise), so no member's output lives in the region: outputs are memory made before
//! the capture.

use std::cell::{Cell, RefCell};

use crate::base::error::PoolError;
use crate::core::fence::Fence;
use crate::core::stream::Stream;

use super::Graph;

/// Graphs captured on one stream that share one region of its stack for their temporaries:
/// memory for the largest member's scratch, not the sum of all of theirs.
///
/// Make it before the buffers that live beside its graphs (outputs are best made with
/// [`DeviceMat::new`](crate::DeviceMat::new)): a member is captured with the region lowered to its
/// base, which needs the region on top of the stack.
///
/// ```no_run
/// use gpu_pool::prelude::*;
/// # fn main() -> Result<(), PoolError> {
/// let stream = Stream::new(&Device::cuda(0)?)?;
/// let family = stream.graph_family()?;
/// let mut outputs = Vec::new();
/// for size in [256, 512, 1024] {
///     outputs.push(DeviceMat::<f32>::new(&stream, size, size)?);
/// }
/// let graphs = outputs
///     .iter_mut()
///     .map(|out| {
///         family.capture(move |s| {
///             let mut tmp = s.temp::<f32>(out.rows(), out.cols())?;
///             tmp.set_to(1.0)?; // ... kernels ...
///             out.copy_from(&tmp)
///         })
///     })
///     .collect::<Result<Vec<_>, _>>()?;
/// for graph in &graphs {
///     graph.launch()?;
/// }
/// assert_eq!(family.stack_bytes(), 1024 * 4096 + 512); // the largest scratch and the fence
/// # Ok(()) }
/// ```
pub struct GraphFamily<'s> {
    stream: &'s Stream,
    pub(super) region: Region,
}

/// The stack region of a family, which its members replay in.
pub(super) struct Region {
    /// A fence taken when the family was made, grown to the largest member's scratch. `None` only
    /// while the family is dropped.
    block: RefCell<Option<Fence>>,
    /// Where the fence itself ends: members' buffers are packed from here.
    pub(super) base: usize,
    /// The end every member's replays need: the largest peak so far.
    needed: Cell<usize>,
}

impl std::fmt::Debug for GraphFamily<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraphFamily")
            .field("stream", &self.stream.id())
            .field("stack_bytes", &self.stack_bytes())
            .finish()
    }
}

impl Stream {
    /// A [`GraphFamily`] on this stream: graphs captured in it share one region of the stack for
    /// their temporaries. `PoolError::Unsupported` on the host backend; `CaptureNeedsStack` if the
    /// stream has no stack room for the region's fence.
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
    pub fn graph_family(&self) -> Result<GraphFamily<'_>, PoolError> {
        if self.cuda_stream().is_none() {
            return Err(PoolError::Unsupported {
                device: self.device().id(),
                what: "CUDA graph capture",
            });
        }
        if self.in_own_capture() {
            return Err(PoolError::Unsupported {
                device: self.device().id(),
                what: "a graph family made inside a capture of its stream",
            });
        }
        let fence = self.reserve_fence()?;
        let base = fence.end();
        Ok(GraphFamily {
            stream: self,
            region: Region {
                block: RefCell::new(Some(fence)),
                base,
                needed: Cell::new(base),
            },
        })
    }
}

impl<'s> GraphFamily<'s> {
    /// Captures `work` into a graph of this family, as [`Stream::capture`] does, with its
    /// temporaries in the family's region. Besides `capture`'s errors,
    /// `PoolError::Unsupported` if a buffer taken after the family was made is still live (the
    /// region cannot be lowered to its base under it).
    pub fn capture<'f, F>(&'f self, work: F) -> Result<Graph<'f>, PoolError>
    where
        F: FnOnce(&'f Stream) -> Result<(), PoolError> + 'f,
    {
        self.capture_with(work)
    }

    /// [`capture`](Self::capture) for a closure of an error type of its own, as
    /// [`Stream::capture_with`].
    pub fn capture_with<'f, E>(
        &'f self,
        work: impl FnOnce(&'f Stream) -> Result<(), E> + 'f,
    ) -> Result<Graph<'f>, E>
    where
        E: From<PoolError>,
    {
        self.stream.capture_in(Some(&self.region), work)
    }

    /// Stack bytes the family holds for its members' replays (its fence included): the largest
    /// member's scratch.
    #[must_use]
    pub fn stack_bytes(&self) -> usize {
        self.region
            .block
            .borrow()
            .as_ref()
            .map_or(0, |block| block.end() - block.prev_top())
    }

    /// The stream the family's graphs replay on.
    #[must_use]
    pub fn stream(&self) -> &'s Stream {
        self.stream
    }
}

impl Region {
    /// Lowers the region to its base for a member's capture; `false` if it is not on top of the
    /// stack.
    pub(super) fn lower(&self, stream: &Stream) -> bool {
        match self.block.borrow_mut().as_mut() {
            Some(block) => stream.shrink_reserved(block, self.base),
            None => false,
        }
    }

    /// Raises the region to cover what its members need, `peak` (a new member's) included.
    pub(super) fn raise(&self, stream: &Stream, peak: usize) -> Result<(), PoolError> {
        self.needed.set(self.needed.get().max(peak));
        self.cover(stream)
    }

    /// Makes sure the region covers every member's scratch, raising it where it was left lowered
    /// (a failed capture whose kept buffer sat above it has since been released).
    pub(super) fn cover(&self, stream: &Stream) -> Result<(), PoolError> {
        let mut block = self.block.borrow_mut();
        let Some(block) = block.as_mut() else {
            return Ok(());
        };
        if block.end() >= self.needed.get() {
            return Ok(());
        }
        stream
            .reserve_up_to(block, self.needed.get())
            .map_err(|e| match e {
                // The region could not be mapped again: that error, as it is.
                PoolError::OutOfMemory { .. } | PoolError::Driver { .. } => e,
                _ => PoolError::Unsupported {
                    device: stream.device().id(),
                    what: "replaying a graph of a family while a buffer kept from a failed \
                           capture holds part of its scratch (release it first)",
                },
            })
    }
}

impl Drop for GraphFamily<'_> {
    fn drop(&mut self) {
        // Its members borrow it, so none lives; their replays queued on the stream run before any
        // later use of the region there.
        if let Some(block) = self.region.block.borrow_mut().take() {
            self.stream.release_reserved(block);
        }
    }
}
