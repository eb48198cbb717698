//! cuBLAS on a pool stream: a handle made only where the library loads, so a missing `libcublas`
//! is a [`PoolError::NoCudaLibrary`], never cudarc's panic.

use cudarc::cublas::CudaBlas;

use std::sync::{Arc, Mutex};

use cudarc::driver::CudaStream;

use crate::base::error::CaptureError;
use crate::base::error::PoolError;
use crate::base::sync::lock;
use crate::core::capturing;
use crate::core::stream::Stream;
use crate::core::view::{GpuViewMut, Keeper};
use crate::storage::Storage;
use crate::storage::backend::DevPtr;
use crate::storage::backend::cuda::ContextGuard;

/// Whether `libcublas` can be loaded. cudarc panics on the first cuBLAS call when it cannot, so
/// [`Stream::cublas`] asks this first.
fn cublas_present() -> bool {
    // SAFETY: only tries to open the library by its usual names; nothing in it is called.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

impl Stream {
    /// A cuBLAS handle whose work is queued on this stream, for cuBLAS calls on pool buffers
    /// (lent with [`GpuRead::as_cudarc`](crate::GpuRead::as_cudarc)). Feature `cublas`.
    ///
    /// The handle works in a workspace of its own ([`BLAS_WORKSPACE_BYTES`], one driver
    /// allocation, which a dropped handle leaves to the next handle on this stream, since a graph
    /// may still use it, and which is freed once nothing holds the stream): so a GEMM captured
    /// into a graph
    /// ([`Stream::capture`]) allocates nothing, where cuBLAS's default workspace puts an
    /// allocation and a free node in the graph and slows every replay (3% on a captured MLP on
    /// an H200, `benches/mlp_graph`).
    ///
    /// Use it rather than cudarc's `CudaBlas::new`, which panics where `libcublas` cannot be
    /// loaded: `PoolError::NoCudaLibrary` if it cannot (checked first, wherever the stream runs);
    /// `PoolError::Unsupported` on the host backend; `PoolError::Cublas` if cuBLAS could not make
    /// the handle (its `CublasError` as the source); `CaptureError::Allocates` inside a
    /// capture. The caller's current CUDA context is kept.
    ///
    /// ```no_run
    /// use gpu_pool::{Device, PoolError, Stream};
    /// let stream = Stream::new(&Device::cuda(0)?)?;
    /// let blas = stream.cublas()?; // then `unsafe { blas.gemm(cfg, &a.as_cudarc()?, ...) }?`
    /// # drop(blas);
    /// # Ok::<(), PoolError>(())
    /// ```
    #[cfg_attr(docsrs, doc(cfg(feature = "cublas")))]
    pub fn cublas(&self) -> Result<Blas, PoolError> {
        if !cublas_present() {
            return Err(PoolError::NoCudaLibrary { library: "cublas" });
        }
        let Some(cuda) = self.cuda_stream() else {
            return Err(PoolError::Unsupported {
                device: self.device().id(),
                what: "cuBLAS",
            });
        };
        if capturing::on_this_thread() {
            return Err(crate::core::graph_key::refusal(CaptureError::Allocates {
                what: "Stream::cublas (its workspace)",
                context: None,
            }));
        }
        let device = self.device();
        let workspace = match Workspace::idle_on(cuda) {
            Some(workspace) => workspace,
            None => {
                let storage = device.storage();
                let ptr = device.or_reclaim(|| storage.alloc(BLAS_WORKSPACE_BYTES, None))?;
                Workspace {
                    storage: Arc::clone(storage),
                    stream: cuda.clone(),
                    ptr,
                }
            }
        };
        let handle = match Self::blas_handle(cuda, workspace.ptr) {
            Ok(handle) => handle,
            Err(e) => {
                // Nothing used it: it waits for the next handle like a dropped one's.
                lock(&IDLE).push(workspace);
                return Err(e);
            }
        };
        Ok(Blas {
            handle,
            workspace: Some(workspace),
        })
    }

    /// A cuBLAS handle on `cuda` working in the workspace at `ptr`.
    fn blas_handle(cuda: &Arc<CudaStream>, ptr: DevPtr) -> Result<CudaBlas, PoolError> {
        // cudarc binds the stream's context to this thread; the caller's stays current.
        let _restore = ContextGuard::keep_current()?;
        let handle = CudaBlas::new(cuda.clone())?;
        // SAFETY: a live handle; the workspace is `BLAS_WORKSPACE_BYTES` of device memory (256-byte
        // aligned, as every driver allocation is) used only by work queued on this handle's
        // stream (`Workspace`'s rule), so in that stream's order; `set_stream` to another stream
        // (`unsafe` in cudarc) makes cuBLAS drop it for its default.
        unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(
                *handle.handle(),
                ptr as *mut std::ffi::c_void,
                BLAS_WORKSPACE_BYTES,
            )
        }
        .result()?;
        Ok(handle)
    }
}

/// A cuBLAS handle on a pool stream ([`Stream::cublas`]) with a workspace of its own: a cudarc
/// `CudaBlas` (it derefs to one, for cudarc's `Gemm` and friends), whose GEMMs captured into a
/// graph allocate nothing. Feature `cublas`.
///
/// ```no_run
/// use gpu_pool::{Device, interop::Blas, PoolError, Stream};
/// let stream = Stream::new(&Device::cuda(0)?)?;
/// let blas: Blas = stream.cublas()?;
/// let handle: &gpu_pool::interop::cudarc::cublas::CudaBlas = &blas;
/// # let _ = handle;
/// # Ok::<(), PoolError>(())
/// ```
#[cfg_attr(docsrs, doc(cfg(feature = "cublas")))]
pub struct Blas {
    handle: CudaBlas,
    /// Taken by the drop, which keeps it for the next handle on its stream.
    workspace: Option<Workspace>,
}

// SAFETY: the handle and the workspace its kernels were captured with: the workspace stays with
// the stream (a dropped handle leaves it to the next), and a replay queues only kernels that read
// their operands from the call's keyed buffers and scratch from that workspace.
unsafe impl crate::core::graph_key::GraphKey for Blas {
    fn graph_key(&self, keys: &mut crate::core::graph_key::GraphKeys) {
        keys.word(*self.handle.handle() as u64);
        keys.word(self.workspace_ptr());
    }
}

impl Blas {
    /// The address of the handle's own workspace.
    fn workspace_ptr(&self) -> DevPtr {
        self.workspace.as_ref().map_or(0, |w| w.ptr)
    }
}

impl std::ops::Deref for Blas {
    type Target = CudaBlas;
    fn deref(&self) -> &CudaBlas {
        &self.handle
    }
}

impl std::fmt::Debug for Blas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blas")
            .field("workspace", &format_args!("{:#x}", self.workspace_ptr()))
            .field("bytes", &BLAS_WORKSPACE_BYTES)
            .finish()
    }
}

/// A handle's own workspace, and the one CUDA stream whose work may use it: the handle's, and
/// graphs captured from that stream (a pool graph replays on its stream, and so does cudarc's).
///
/// A graph can outlive the handle it captured (the handle shared through an `Arc` the capture's
/// closure dropped, or a capture through cudarc), so a dropped handle's workspace is not freed:
/// it waits in [`IDLE`] for the next handle on the same stream, whose work is ordered after
/// everything queued there before, replays included. It is freed once nothing else holds its
/// stream (no pool stream, graph or cudarc handle can queue work there again), after the stream
/// is done.
struct Workspace {
    storage: Arc<Storage>,
    stream: Arc<CudaStream>,
    ptr: DevPtr,
}

/// Workspaces of dropped handles, for the next handle on their stream.
static IDLE: Mutex<Vec<Workspace>> = Mutex::new(Vec::new());

impl Workspace {
    /// An idle workspace whose stream is `stream`, if there is one; frees those whose stream
    /// nothing else holds any longer.
    fn idle_on(stream: &Arc<CudaStream>) -> Option<Workspace> {
        let mut idle = lock(&IDLE);
        let found = idle
            .iter()
            .position(|w| Arc::ptr_eq(&w.stream, stream))
            .map(|i| idle.swap_remove(i));
        Self::free_orphans(&mut idle);
        found
    }

    /// Frees the idle workspaces whose stream is held only by them (a strong count of one: no
    /// stream, graph or handle left to queue work on it), once it is done; outside captures on
    /// this thread, where a wait or a free would break them.
    fn free_orphans(idle: &mut Vec<Workspace>) {
        let orphans: Vec<Workspace> = idle
            .extract_if(.., |w| Arc::strong_count(&w.stream) == 1)
            .collect();
        for w in orphans {
            crate::core::deferred::after_captures(Box::new(move || {
                if let Err(e) = w.stream.synchronize() {
                    // Work queued on it may still run: leaking the memory is the safe outcome.
                    crate::base::event::error!(error = ?e, "waiting for a cuBLAS workspace's stream failed; the workspace is leaked");
                    return;
                }
                // SAFETY: allocated from this storage by `Stream::cublas`, owned by this
                // workspace alone; nothing can queue work on its stream any more (this is the
                // last holder), and the work queued there is done.
                if let Err(e) = unsafe { w.storage.free(w.ptr, None) } {
                    crate::base::event::error!(error = %e, "freeing a cuBLAS workspace failed");
                }
            }));
        }
    }
}

impl Drop for Blas {
    /// The workspace waits for the next handle on its stream (the handle is destroyed right
    /// after, with no work left to queue: a next handle's work on the stream comes after its
    /// last). Dropping a handle inside a capture breaks the capture: `cublasDestroy` waits for
    /// the device.
    fn drop(&mut self) {
        if let Some(workspace) = self.workspace.take() {
            let mut idle = lock(&IDLE);
            idle.push(workspace);
            Workspace::free_orphans(&mut idle);
        }
    }
}

/// What NVIDIA recommends for a cuBLAS workspace on Hopper GPUs (32 MiB; 4 MiB on earlier ones):
/// enough that no GEMM picks a slower algorithm for want of room.
#[cfg_attr(docsrs, doc(cfg(feature = "cublas")))]
pub const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// Runs `work` with `blas` working in a pool buffer: the handle's workspace is `workspace` while
/// `work` runs (`cublasSetWorkspace`), and its own again when `work` returns (or unwinds). A
/// [`Blas`]'s own workspace already keeps captured GEMMs free of allocations; this puts the
/// workspace where the graph's other buffers are instead (a [`GraphFamily`](crate::graph::GraphFamily)'s
/// shared region, say), so the graph holds it like them. Feature `cublas`.
///
/// A closure rather than a guard: a guard could be forgotten (`mem::forget`), leaving the handle
/// writing into memory the stack has handed out again. The handle is borrowed `&mut`, so no other
/// thread uses it meanwhile (cuBLAS asks callers to serialize calls on a handle with a workspace of
/// their own). The workspace must be a pool stream's memory (a `buffer!`, a `GpuMat`, a region
/// of one): a graph captured inside `work` keeps that memory for its replays, as it keeps its own
/// buffers; shared memory is refused, since its access would end before the replays.
///
/// ```no_run
/// use gpu_pool::{compat::opencv::BufferPool, Device, GpuWrite, interop::{BLAS_WORKSPACE_BYTES, with_blas_workspace}, PoolError, Stream};
/// let stream = Stream::new(&Device::cuda(0)?)?;
/// let mut blas = stream.cublas()?;
/// let graph = stream.capture(|s| {
///     let mut room = BufferPool::new(s).get_buffer_1d::<u8>(BLAS_WORKSPACE_BYTES)?;
///     with_blas_workspace(&mut blas, room.view_mut(), |blas| {
///         // ... blas.gemm(..) on pool buffers: captured with no allocation ...
///         let _ = blas;
///     })
/// })?;
/// # drop(graph);
/// # Ok::<(), PoolError>(())
/// ```
///
/// `PoolError::Unsupported` for memory of another stream than the handle's (cuBLAS would use it
/// out of that stream's order), of no CUDA stream, or shared memory, and for one with fewer than 256 bytes from
/// its first 256-byte boundary (cuBLAS's alignment, where the workspace starts);
/// `PoolError::NotContinuous` for padded rows; `PoolError::Cublas` if cuBLAS refuses it.
#[cfg_attr(docsrs, doc(cfg(feature = "cublas")))]
pub fn with_blas_workspace<R>(
    blas: &mut Blas,
    workspace: GpuViewMut<'_, u8>,
    work: impl FnOnce(&CudaBlas) -> R,
) -> Result<R, PoolError> {
    let device = workspace.device;
    if matches!(workspace.keeper, Keeper::Shared(_)) {
        return Err(PoolError::Unsupported {
            device,
            what: "a cuBLAS workspace in shared memory (take it from the stack: a graph captured \
                   with it would outlive the access)",
        });
    }
    let Some(stream) = workspace.keeper.cuda() else {
        return Err(PoolError::Unsupported {
            device,
            what: "a cuBLAS workspace outside a CUDA stream",
        });
    };
    let cu_stream = stream.cuda_stream().map(|s| s.cu_stream());
    let mut handle_stream: cudarc::cublas::sys::cudaStream_t = std::ptr::null_mut();
    // SAFETY: a live handle (borrowed); the call writes the stream it queues on.
    unsafe { cudarc::cublas::sys::cublasGetStream_v2(*blas.handle(), &mut handle_stream) }
        .result()?;
    if cu_stream.map(|s| s as usize) != Some(handle_stream as usize) {
        return Err(PoolError::Unsupported {
            device,
            what: "a cuBLAS workspace from another stream than the handle's (take it on the \
                   handle's stream)",
        });
    }
    let window = workspace.window.flat::<u8>()?;
    // cuBLAS wants a 256-byte aligned workspace; a stack buffer is aligned to its layout's block
    // (64 bytes for bytes), so the workspace starts at the first 256-byte boundary in it.
    let skip = window.ptr.next_multiple_of(256) - window.ptr;
    let bytes = (window.cols as u64).saturating_sub(skip) as usize;
    if bytes < 256 {
        return Err(PoolError::Unsupported {
            device,
            what: "a cuBLAS workspace of fewer than 256 bytes from a 256-byte boundary",
        });
    }
    let ptr = (window.ptr + skip) as *mut std::ffi::c_void;
    // SAFETY: a live handle; the workspace is `bytes` bytes of device memory on the handle's
    // stream, borrowed exclusively until this function returns, and `_restore` takes it back
    // from the handle before then, on every way out. Work cuBLAS queued in it is ordered on that
    // stream, before any later use of the memory there.
    unsafe { cudarc::cublas::sys::cublasSetWorkspace_v2(*blas.handle(), ptr, bytes) }.result()?;
    let _restore = Restore {
        handle: *blas.handle(),
        own: blas.workspace_ptr(),
    };
    Ok(work(blas))
}

/// Gives a [`Blas`] its own workspace back when dropped.
struct Restore {
    handle: cudarc::cublas::sys::cublasHandle_t,
    own: DevPtr,
}

impl Drop for Restore {
    fn drop(&mut self) {
        // SAFETY: the handle is borrowed by `with_blas_workspace` for as long as this lives, and
        // `own` is the workspace its `Blas` owns (see `Stream::cublas`), on the same stream.
        let restored = unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(
                self.handle,
                self.own as *mut std::ffi::c_void,
                BLAS_WORKSPACE_BYTES,
            )
        };
        if let Err(e) = restored.result() {
            // The handle would go on writing into memory about to be handed out again.
            crate::base::event::error!(error = ?e, "giving a cuBLAS handle its own workspace back failed");
            std::process::abort();
        }
    }
}
