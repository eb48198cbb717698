//! NCCL on pool streams (feature `nccl`): one communicator per pool stream, collectives and
//! point-to-point calls on pool buffers, and stacks in memory NCCL can register.
//!
//! One process drives every GPU: [`Communicators::new`] makes a rank of each pool stream (one per
//! device), and every NCCL call goes through [`Communicators::group`], which checks the whole
//! group before NCCL sees any of it: each rank's collectives in the same order with the same
//! count, type, reduction and root; each send matched by a receive of the same count and type on
//! its peer; each buffer continuous, of its rank's own stream, and (while the stacks are a
//! symmetric window) at the same window offset on every rank; every rank's stream eager, or every
//! one in [`Communicators::capture`]. Otherwise the group is refused (`PoolError::NcclGroup`) and
//! nothing is queued. Element types are NCCL's own ([`NcclElement`], sealed), so the count NCCL is
//! told is the buffer's. The buffers are borrowed for the whole group, so none is released (and
//! its stack memory handed out again) before NCCL has queued its work; and since that work is on
//! the buffer's own stream, the stack reuses the memory only after it.
//!
//! A graph of [`Communicators::capture`] replays every rank at once ([`RankGraphs::launch`]), so
//! the ranks cannot fall out of step. Not covered: ranks in other processes (one process drives
//! every rank here).
//!
//! `libnccl` is loaded at run time, like the driver: where it is missing every call returns
//! `PoolError::NoCudaLibrary`, never cudarc's panic.
//!
//! Symmetric stacks: ranks that run the same pooled work take the same offsets
//! ([`check_symmetric`](crate::check_symmetric) proves it in debug builds). With
//! [`use_nccl_memory`] a device's stacks come from `ncclMemAlloc`, and
//! [`Communicators::register_stacks`] registers every rank's stacks with its communicator, as
//! NCCL buffers or as one symmetric window, so collectives on `buffer!` temporaries can skip
//! NCCL's staging copies.
//!
//! ```no_run
//! use gpu_pool_runtime::nccl::{Communicators, Reduce};
//! use gpu_pool_runtime::{BufferPool, Device, GpuRead, GpuWrite, PoolError, Stream};
//! let streams = [Stream::new(&Device::cuda(0)?)?, Stream::new(&Device::cuda(1)?)?];
//! let ranks = Communicators::new(&[&streams[0], &streams[1]])?;
//! let mut x0 = BufferPool::new(&streams[0]).get_buffer_1d::<f32>(1024)?;
//! let mut x1 = BufferPool::new(&streams[1]).get_buffer_1d::<f32>(1024)?;
//! x0.set_to(1.0)?;
//! x1.set_to(2.0)?;
//! ranks.group(|g| {
//!     g.all_reduce_in_place(0, &mut x0, Reduce::Sum)?;
//!     g.all_reduce_in_place(1, &mut x1, Reduce::Sum)
//! })?;
//! assert!(x0.to_vec()?.iter().all(|&v| v == 3.0));
//! # Ok::<(), PoolError>(())
//! ```

use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::rc::Rc;
use std::sync::Arc;

use bytemuck::Pod;
use cudarc::driver::{CudaContext, DevicePtr, DevicePtrMut, DeviceSlice};
use cudarc::nccl::{result, sys};

use crate::access::{GpuRead, GpuWrite};
use crate::arena::StackMemory;
use crate::backend::DevPtr;
use crate::backend::cuda::ContextGuard;
use crate::device::Device;
use crate::error::{NcclFailure, PoolError};
use crate::graph::{Graph, GraphNodes};
use crate::stream::Stream;
use crate::view::{GpuView, GpuViewMut};

mod sealed {
    pub trait Sealed {}
}

/// An element type NCCL reduces and moves, with NCCL's name for it. Sealed: the type NCCL is told
/// always has the element's size, so the count it is told covers exactly the buffer.
pub trait NcclElement: Pod + sealed::Sealed {
    /// NCCL's data type of the element.
    #[doc(hidden)]
    const TYPE: sys::ncclDataType_t;
}

macro_rules! nccl_elements {
    ($($t:ty => $nccl:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl NcclElement for $t {
            const TYPE: sys::ncclDataType_t = sys::ncclDataType_t::$nccl;
        }
    )*};
}
nccl_elements!(
    i8 => ncclInt8, u8 => ncclUint8, i32 => ncclInt32, u32 => ncclUint32,
    i64 => ncclInt64, u64 => ncclUint64, f32 => ncclFloat32, f64 => ncclFloat64,
);

/// NCCL's own flag for a window that every rank registers alike (`NCCL_WIN_COLL_SYMMETRIC`).
const NCCL_WIN_COLL_SYMMETRIC: i32 = 1;

/// The first NCCL with `ncclMemAlloc` and `ncclCommRegister` (2.19), and with windows (2.27), as
/// `ncclGetVersion` encodes them.
const NCCL_REGISTER: i32 = 21900;
const NCCL_WINDOWS: i32 = 22700;

/// Whether `libnccl` can be loaded: cudarc panics on the first call into a missing library.
fn present() -> Result<(), PoolError> {
    // SAFETY: only tries to open the library by its usual names; nothing in it is called.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(PoolError::NoCudaLibrary { library: "nccl" })
    }
}

/// `PoolError::Nccl` for a failed `call`.
fn failed(call: &'static str) -> impl Fn(result::NcclError) -> PoolError {
    move |e| PoolError::Nccl {
        call,
        source: NcclFailure(e).into(),
    }
}

/// The NCCL loaded, as `ncclGetVersion` encodes it (2.28.3 is 22803).
/// `PoolError::NoCudaLibrary` where `libnccl` cannot be loaded.
///
/// ```no_run
/// let version = gpu_pool_runtime::nccl::version()?;
/// println!("NCCL {}.{}.{}", version / 10000, version / 100 % 100, version % 100);
/// # Ok::<(), gpu_pool_runtime::PoolError>(())
/// ```
pub fn version() -> Result<i32, PoolError> {
    present()?;
    result::get_nccl_version().map_err(failed("ncclGetVersion"))
}

/// An NCCL reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    /// The sum over ranks.
    Sum,
    /// The product over ranks.
    Prod,
    /// The largest value.
    Max,
    /// The smallest value.
    Min,
    /// The mean over ranks.
    Avg,
}

impl Reduce {
    fn raw(self) -> sys::ncclRedOp_t {
        match self {
            Reduce::Sum => sys::ncclRedOp_t::ncclSum,
            Reduce::Prod => sys::ncclRedOp_t::ncclProd,
            Reduce::Max => sys::ncclRedOp_t::ncclMax,
            Reduce::Min => sys::ncclRedOp_t::ncclMin,
            Reduce::Avg => sys::ncclRedOp_t::ncclAvg,
        }
    }
}

/// One communicator per pool stream, in one process: rank `i` works on `streams[i]`, each on a
/// device of its own. See the [module](self) for what a group checks.
pub struct Communicators<'s> {
    ranks: Vec<Rank<'s>>,
    /// Inside [`capture`](Communicators::capture): groups are captured, every rank at once.
    capturing: Cell<bool>,
    /// Each rank's symmetric window (its stack memory), while registered as one.
    windows: RefCell<Option<Vec<(DevPtr, usize)>>>,
    /// A registration lives: captures are refused (a graph would outlive it).
    registered: Cell<bool>,
    /// A replay of some ranks failed: the ranks may be out of step, so no group is queued again.
    out_of_step: Cell<bool>,
}

/// One rank: its communicator and the pool stream its work is queued on.
struct Rank<'s> {
    comm: sys::ncclComm_t,
    stream: &'s Stream,
}

impl Rank<'_> {
    /// The rank's CUDA stream (a rank is made of CUDA streams only).
    fn cuda(&self) -> Result<&Arc<cudarc::driver::CudaStream>, PoolError> {
        self.stream.cuda_stream().ok_or(PoolError::Unsupported {
            device: self.stream.device().id(),
            what: "NCCL outside a CUDA device",
        })
    }
}

impl std::fmt::Debug for Communicators<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let streams: Vec<u64> = self.ranks.iter().map(|r| r.stream.id()).collect();
        f.debug_struct("Communicators")
            .field("streams", &streams)
            .finish()
    }
}

impl<'s> Communicators<'s> {
    /// A communicator of `streams.len()` ranks (`ncclCommInitAll`), rank `i` on `streams[i]`.
    ///
    /// Errors: `PoolError::NoCudaLibrary` without `libnccl`; `Unsupported` for a host stream, for
    /// no stream, and for two streams on one device (NCCL takes one rank per GPU); `Nccl` if NCCL
    /// fails. The caller's current CUDA context is kept.
    pub fn new(streams: &[&'s Stream]) -> Result<Communicators<'s>, PoolError> {
        present()?;
        let mut ordinals = Vec::with_capacity(streams.len());
        for stream in streams {
            let device = stream.device().id();
            let Some(cuda) = stream.cuda_stream() else {
                return Err(PoolError::Unsupported {
                    device,
                    what: "NCCL outside a CUDA device",
                });
            };
            let ordinal = cuda.context().ordinal() as i32;
            if ordinals.contains(&ordinal) {
                return Err(PoolError::Unsupported {
                    device,
                    what: "two NCCL ranks on one GPU (give each rank a stream of its own device)",
                });
            }
            ordinals.push(ordinal);
        }
        if streams.is_empty() {
            return Err(PoolError::Unsupported {
                device: crate::id::DeviceId::Host(0),
                what: "a communicator of no ranks",
            });
        }
        let _restore = ContextGuard::keep_current()?;
        let mut comms = vec![std::ptr::null_mut(); streams.len()];
        // SAFETY: `comms` has room for one communicator per ordinal; the ordinals are distinct
        // devices of this process.
        unsafe { result::comm_init_all(comms.as_mut_ptr(), comms.len() as i32, ordinals.as_ptr()) }
            .map_err(failed("ncclCommInitAll"))?;
        let ranks = comms
            .into_iter()
            .zip(streams)
            .map(|(comm, stream)| Rank { comm, stream })
            .collect();
        Ok(Communicators {
            ranks,
            capturing: Cell::new(false),
            windows: RefCell::new(None),
            registered: Cell::new(false),
            out_of_step: Cell::new(false),
        })
    }

    /// How many ranks.
    #[must_use]
    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }

    /// The stream of rank `rank`, if there is such a rank.
    #[must_use]
    pub fn stream(&self, rank: usize) -> Option<&'s Stream> {
        self.ranks.get(rank).map(|r| r.stream)
    }

    /// Runs `calls`, then checks the group they made and queues it as one NCCL group
    /// (`ncclGroupStart` .. `ncclGroupEnd`): one thread drives every rank without a deadlock.
    /// The buffers are borrowed until the group is queued, on their ranks' streams.
    ///
    /// Errors: `calls`' own (nothing is queued); `PoolError::NcclGroup` for a group whose ranks
    /// disagree (nothing is queued); `Nccl` if NCCL refuses. Inside a [`Stream::capture`] of every
    /// rank's stream the group is captured, each rank's part into its own stream's graph.
    pub fn group<'b, R>(
        &'b self,
        calls: impl FnOnce(&mut Group<'b>) -> Result<R, PoolError>,
    ) -> Result<R, PoolError>
    where
        's: 'b,
    {
        let mut group = Group {
            ranks: &self.ranks,
            ops: Vec::new(),
        };
        let out = calls(&mut group)?;
        if !std::ptr::eq(
            group.ranks.as_ptr().cast::<()>(),
            self.ranks.as_ptr().cast::<()>(),
        ) {
            // `std::mem::swap` of two groups: these calls were checked for other communicators.
            return Err(PoolError::NcclGroup {
                problem: "the group was swapped with a group of other communicators".into(),
            });
        }
        if self.out_of_step.get() {
            return Err(PoolError::NcclGroup {
                problem: "a replay of these communicators failed part-way, so their ranks may be \
                          out of step; make new communicators"
                    .into(),
            });
        }
        group.check(self.windows.borrow().as_deref())?;
        self.check_capture_state()?;
        let _restore = ContextGuard::keep_current()?;
        result::group_start().map_err(failed("ncclGroupStart"))?;
        let queued = group
            .ops
            .iter()
            .try_for_each(|op| op.queue(&self.ranks[op.rank]));
        // Ended whatever happened: an open group would swallow the next NCCL call.
        let ended = result::group_end().map_err(failed("ncclGroupEnd"));
        queued?;
        ended?;
        Ok(out)
    }

    /// Every rank's stream eager, or every one in this communicator's own
    /// [`capture`](Self::capture): NCCL's work is then replayed with every rank's, and nothing
    /// else's capture (a cudarc `begin_capture` inside the group's closure) records it.
    fn check_capture_state(&self) -> Result<(), PoolError> {
        let mut captured = 0;
        for rank in &self.ranks {
            let cuda = rank.cuda()?;
            // SAFETY: a live stream; the query changes nothing.
            let status = unsafe { cudarc::driver::result::stream::is_capturing(cuda.cu_stream()) }
                .map_err(|e| crate::backend::cuda::driver_error("cuStreamIsCapturing", e))?;
            let driver =
                status != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
            if driver {
                if !(self.capturing.get() && rank.stream.in_own_capture()) {
                    return Err(PoolError::NcclGroup {
                        problem: "a rank's stream is being captured outside \
                                  Communicators::capture (a graph of one rank would replay out of \
                                  step with the others)"
                            .into(),
                    });
                }
                captured += 1;
            }
        }
        if captured != 0 && captured != self.ranks.len() {
            return Err(PoolError::NcclGroup {
                problem: "some ranks' streams are captured and some are not".into(),
            });
        }
        Ok(())
    }

    /// Captures `work`'s groups (and whatever else it queues on the ranks' streams) into one
    /// graph per rank, each rank's stream inside its own [`Stream::capture`], and returns them as
    /// one [`RankGraphs`] that replays every rank at once. Run the step once eagerly first: NCCL
    /// connects its ranks on first use.
    ///
    /// Errors: those of `Stream::capture`; `PoolError::Unsupported` while the stacks are
    /// registered ([`register_stacks`](Self::register_stacks): the graph would outlive the
    /// registration) or inside another capture of these communicators.
    ///
    /// ```no_run
    /// use gpu_pool_runtime::nccl::{Communicators, Reduce};
    /// use gpu_pool_runtime::{BufferPool, Device, GpuWrite, PoolError, Stream};
    /// let (s0, s1) = (Stream::new(&Device::cuda(0)?)?, Stream::new(&Device::cuda(1)?)?);
    /// let ranks = Communicators::new(&[&s0, &s1])?;
    /// let (mut x0, mut x1) = (
    ///     BufferPool::new(&s0).get_buffer_1d::<f32>(1024)?,
    ///     BufferPool::new(&s1).get_buffer_1d::<f32>(1024)?,
    /// );
    /// let mut step = || {
    ///     ranks.group(|g| {
    ///         g.all_reduce_in_place(0, &mut x0, Reduce::Sum)?;
    ///         g.all_reduce_in_place(1, &mut x1, Reduce::Sum)
    ///     })
    /// };
    /// step()?; // NCCL connects on first use
    /// let graphs = ranks.capture(step)?;
    /// graphs.launch()?; // both ranks, in step
    /// # Ok::<(), PoolError>(())
    /// ```
    pub fn capture<'a>(
        &'a self,
        work: impl FnOnce() -> Result<(), PoolError> + 'a,
    ) -> Result<RankGraphs<'a>, PoolError> {
        if self.registered.get() || self.capturing.get() {
            return Err(PoolError::Unsupported {
                device: self.ranks[0].stream.device().id(),
                what: "capturing NCCL work while the stacks are registered, or inside another \
                       capture of these communicators",
            });
        }
        let streams: Vec<&'a Stream> = self.ranks.iter().map(|r| r.stream).collect();
        // Before any rank begins: a later rank's refusal would leave the earlier ones' captures to
        // unwind.
        for stream in &streams {
            stream.refuse_legacy_capture("Communicators::capture")?;
        }
        let made = Rc::new(RefCell::new(Vec::new()));
        let marked = Marked::set(&self.capturing);
        let captured = nested_captures(streams, Box::new(work), made.clone());
        drop(marked);
        captured?;
        let graphs = Rc::try_unwrap(made)
            .map_err(|_| PoolError::Unsupported {
                device: self.ranks[0].stream.device().id(),
                what: "a rank graph kept by the capture",
            })?
            .into_inner();
        Ok(RankGraphs {
            comms: self,
            graphs,
        })
    }

    /// Registers every rank's stack memory with its communicator, until the returned handle
    /// drops: as a symmetric window (`ncclCommWindowRegister`, NCCL 2.27 and later), which the
    /// same offsets on every rank make usable, or as user buffers (`ncclCommRegister`, 2.19 and
    /// later). The stacks stay where they are while registered: a new config or
    /// `release_stack_memory` is `PoolError::StackMemoryRegistered` until then.
    ///
    /// Windows need memory from [`use_nccl_memory`]; buffers take either. Every rank's device
    /// must have the same stack config for a window (its size is every rank's).
    ///
    /// Errors: `Unsupported` for an NCCL too old, a second registration while one lives, a
    /// growable stack, or a window over memory not from [`use_nccl_memory`]; `InvalidConfig` for
    /// ranks whose stack memory differs in size; `Nccl` if NCCL refuses (nothing stays
    /// registered).
    ///
    /// ```no_run
    /// use gpu_pool_runtime::nccl::{Communicators, use_nccl_memory};
    /// use gpu_pool_runtime::{Device, PoolError, Stream, set_buffer_pool_config};
    /// let gpus = [Device::cuda(0)?, Device::cuda(1)?];
    /// for gpu in &gpus {
    ///     set_buffer_pool_config(gpu, 256 << 20, 1)?; // the same on every rank
    ///     use_nccl_memory(gpu)?;
    /// }
    /// let (s0, s1) = (Stream::new(&gpus[0])?, Stream::new(&gpus[1])?);
    /// let ranks = Communicators::new(&[&s0, &s1])?;
    /// let window = ranks.register_stacks(true)?;
    /// // ... groups on `buffer!` temporaries taken alike on both ranks ...
    /// drop(window);
    /// # Ok::<(), PoolError>(())
    /// ```
    pub fn register_stacks(&self, as_window: bool) -> Result<Registered<'_, 's>, PoolError> {
        let needed = if as_window {
            NCCL_WINDOWS
        } else {
            NCCL_REGISTER
        };
        let loaded = version()?;
        if self.capturing.get() || self.registered.get() {
            return Err(PoolError::Unsupported {
                device: self.ranks[0].stream.device().id(),
                what: "registering stack memory inside a capture, or twice at once (drop the \
                       first Registered)",
            });
        }
        if let Some(rank) = self.ranks.iter().find(|r| r.stream.has_growable_stack()) {
            return Err(PoolError::Unsupported {
                device: rank.stream.device().id(),
                what: "registering a growable stack (call use_nccl_memory, which gives the \
                       device fixed stacks in NCCL memory, before making the ranks' streams)",
            });
        }
        if as_window
            && let Some(rank) = self
                .ranks
                .iter()
                .find(|r| !r.stream.device().inner.stack_memory_is_external())
        {
            return Err(PoolError::Unsupported {
                device: rank.stream.device().id(),
                what: "a symmetric window on stack memory not from use_nccl_memory",
            });
        }
        if loaded < needed {
            return Err(PoolError::Unsupported {
                device: self.ranks[0].stream.device().id(),
                what: if as_window {
                    "NCCL windows before NCCL 2.27"
                } else {
                    "NCCL buffer registration before NCCL 2.19"
                },
            });
        }
        let mut registered = Registered {
            comms: self,
            handles: Vec::with_capacity(self.ranks.len()),
            as_window,
        };
        let mut ranges = Vec::with_capacity(self.ranks.len());
        for rank in &self.ranks {
            let device = rank.stream.device();
            let range = device.inner.pin_stack_memory()?;
            registered
                .handles
                .push((device.clone(), std::ptr::null_mut()));
            ranges.push(range);
        }
        if as_window && ranges.iter().any(|r| r.1 != ranges[0].1) {
            return Err(PoolError::InvalidConfig {
                reason: "a symmetric window needs the same stack memory size on every rank: \
                         give every device the same set_buffer_pool_config"
                    .into(),
            });
        }
        let _restore = ContextGuard::keep_current()?;
        let register = |handles: &mut Vec<(Device, *mut c_void)>| -> Result<(), PoolError> {
            for ((rank, (base, bytes)), slot) in self.ranks.iter().zip(&ranges).zip(handles) {
                let ptr = *base as *mut c_void;
                // SAFETY: `ptr..ptr + bytes` is the device's stack memory, pinned above: it stays
                // allocated until the handle is deregistered (`Registered::drop`). `slot.1`
                // receives the handle.
                let status = unsafe {
                    if as_window {
                        sys::ncclCommWindowRegister(
                            rank.comm,
                            ptr,
                            *bytes,
                            (&raw mut slot.1).cast(),
                            NCCL_WIN_COLL_SYMMETRIC,
                        )
                    } else {
                        sys::ncclCommRegister(rank.comm, ptr, *bytes, &raw mut slot.1)
                    }
                };
                status.result().map_err(failed(if as_window {
                    "ncclCommWindowRegister"
                } else {
                    "ncclCommRegister"
                }))?;
            }
            Ok(())
        };
        if as_window {
            // Collective: every rank registers in one group.
            result::group_start().map_err(failed("ncclGroupStart"))?;
            let done = register(&mut registered.handles);
            let ended = result::group_end().map_err(failed("ncclGroupEnd"));
            done?;
            ended?;
        } else {
            register(&mut registered.handles)?;
        }
        if registered.handles.iter().any(|h| h.1.is_null()) {
            return Err(PoolError::Unsupported {
                device: self.ranks[0].stream.device().id(),
                what: "an NCCL registration that gave no handle (NCCL_WIN_ENABLE or the \
                       transport turned it off)",
            });
        }
        self.registered.set(true);
        if as_window {
            *self.windows.borrow_mut() = Some(ranges);
        }
        Ok(registered)
    }
}

impl Drop for Communicators<'_> {
    fn drop(&mut self) {
        // NCCL switches devices as it tears down; the caller's context stays current.
        let _restore = ContextGuard::keep_current().ok();
        for rank in &self.ranks {
            // Work NCCL queued must finish before its communicator goes.
            if let Err(e) = rank.stream.synchronize() {
                tracing::error!(error = %e, "waiting for NCCL work before destroying its communicator failed");
            }
        }
        for rank in &self.ranks {
            // SAFETY: our communicator, its work done, destroyed once.
            if let Err(e) = unsafe { result::comm_destroy(rank.comm) } {
                tracing::error!(error = %failed("ncclCommDestroy")(e), "destroying an NCCL communicator failed");
            }
        }
    }
}

/// A flag set for as long as this lives: cleared when dropped, by a panic in the work it marks too
/// (a flag left set would refuse every later capture and registration).
struct Marked<'a>(&'a Cell<bool>);

impl<'a> Marked<'a> {
    fn set(flag: &'a Cell<bool>) -> Marked<'a> {
        flag.set(true);
        Marked(flag)
    }
}

impl Drop for Marked<'_> {
    fn drop(&mut self) {
        self.0.set(false);
    }
}

/// Every rank's stack memory registered with NCCL (see [`Communicators::register_stacks`]);
/// deregistered when dropped. Forgetting it (`mem::forget`) keeps the stack memory pinned for
/// the process's life: configs and `release_stack_memory` are refused from then on.
pub struct Registered<'c, 's> {
    comms: &'c Communicators<'s>,
    /// Each rank's device (whose stack memory is pinned) and NCCL's handle (null: not registered).
    handles: Vec<(Device, *mut c_void)>,
    as_window: bool,
}

impl Registered<'_, '_> {
    /// Whether the stacks are registered as a symmetric window (else as user buffers).
    #[must_use]
    pub fn is_window(&self) -> bool {
        self.as_window
    }
}

impl std::fmt::Debug for Registered<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registered")
            .field("ranks", &self.handles.len())
            .field("window", &self.as_window)
            .finish()
    }
}

impl Drop for Registered<'_, '_> {
    fn drop(&mut self) {
        let _restore = ContextGuard::keep_current().ok();
        self.comms.registered.set(false);
        *self.comms.windows.borrow_mut() = None;
        for rank in &self.comms.ranks {
            // NCCL may still read the memory for queued work.
            let _ = rank.stream.synchronize();
        }
        let any = self.handles.iter().any(|h| !h.1.is_null());
        if any && self.as_window {
            let _ = result::group_start();
        }
        for (rank, (_, handle)) in self.comms.ranks.iter().zip(&self.handles) {
            if handle.is_null() {
                continue;
            }
            // SAFETY: a handle NCCL gave for this communicator, deregistered once.
            let status = unsafe {
                if self.as_window {
                    sys::ncclCommWindowDeregister(rank.comm, handle.cast())
                } else {
                    sys::ncclCommDeregister(rank.comm, *handle)
                }
            };
            if let Err(e) = status.result() {
                tracing::error!(error = %failed("ncclCommDeregister")(e), "deregistering stack memory failed");
            }
        }
        if any && self.as_window {
            let _ = result::group_end();
        }
        for (device, _) in &self.handles {
            device.inner.unpin_stack_memory();
        }
    }
}

/// The NCCL calls of one group, checked as a whole before any is queued
/// ([`Communicators::group`]). `'b` is how long the buffers stay borrowed: past the group's end.
///
/// Each call names its rank and takes that rank's buffers: a `buffer!`, a `GpuMat`, a view or a
/// [`SharedMat`](crate::SharedMat) access of the rank's own stream (`PoolError::Unsupported`
/// for memory of another stream, `NotContinuous` for a region narrower than its buffer).
pub struct Group<'b> {
    ranks: &'b [Rank<'b>],
    ops: Vec<Op>,
}

impl std::fmt::Debug for Group<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("world", &self.ranks.len())
            .field("calls", &self.ops.len())
            .finish()
    }
}

/// One call of a group: on which rank, what, and the memory it names (alive for the group's
/// `'b`).
struct Op {
    rank: usize,
    kind: Kind,
    /// Elements NCCL is told (each rank's part, for a gather).
    count: usize,
    dtype: sys::ncclDataType_t,
    send: u64,
    recv: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    AllReduce(sys::ncclRedOp_t),
    AllGather,
    Broadcast { root: usize },
    Send { peer: usize },
    Recv { peer: usize },
}

impl Kind {
    fn is_collective(self) -> bool {
        !matches!(self, Kind::Send { .. } | Kind::Recv { .. })
    }
}

impl Op {
    /// Hands the call to NCCL (inside the group `Communicators::group` opened).
    fn queue(&self, rank: &Rank<'_>) -> Result<(), PoolError> {
        let stream = rank.cuda()?.cu_stream() as sys::cudaStream_t;
        let (send, recv) = (self.send as *const c_void, self.recv as *mut c_void);
        // SAFETY: `send` and `recv` are memory of this rank's stream, of at least `count`
        // elements of `dtype` (for a gather, `recv` holds `count` for every rank), borrowed by the
        // group until it ends; NCCL's work is queued on that stream, so the stack reuses the
        // memory only after it. The group was checked: every rank makes the same collectives and
        // each send meets a receive of its size.
        let status = unsafe {
            match self.kind {
                Kind::AllReduce(op) => {
                    sys::ncclAllReduce(send, recv, self.count, self.dtype, op, rank.comm, stream)
                }
                Kind::AllGather => {
                    sys::ncclAllGather(send, recv, self.count, self.dtype, rank.comm, stream)
                }
                Kind::Broadcast { root } => sys::ncclBroadcast(
                    send,
                    recv,
                    self.count,
                    self.dtype,
                    root as i32,
                    rank.comm,
                    stream,
                ),
                Kind::Send { peer } => {
                    sys::ncclSend(send, self.count, self.dtype, peer as i32, rank.comm, stream)
                }
                Kind::Recv { peer } => {
                    sys::ncclRecv(recv, self.count, self.dtype, peer as i32, rank.comm, stream)
                }
            }
        };
        status
            .result()
            .map(drop)
            .map_err(failed("an NCCL call of a group"))
    }
}

impl<'b> Group<'b> {
    /// `rank`'s stream, if there is such a rank and `stream` is it.
    fn rank_of(
        &self,
        rank: usize,
        stream: Option<&Stream>,
        device: crate::id::DeviceId,
    ) -> Result<(), PoolError> {
        let Some(r) = self.ranks.get(rank) else {
            return Err(PoolError::NcclGroup {
                problem: format!(
                    "rank {rank} named, the communicator has {}",
                    self.ranks.len()
                ),
            });
        };
        if stream.map(Stream::id) != Some(r.stream.id()) {
            return Err(PoolError::Unsupported {
                device,
                what: "an NCCL call on memory of another stream than its rank's (take the \
                       rank's buffers from its own stream)",
            });
        }
        Ok(())
    }

    /// The address and elements of `view`, memory that `rank` may hand NCCL to read.
    fn lend<T: Pod>(&self, rank: usize, view: &GpuView<'_, T>) -> Result<(u64, usize), PoolError> {
        self.rank_of(rank, view.stream(), view.device)?;
        continuous(view.is_continuous(), view.rows(), view.cols(), view.step())?;
        let lent = view.as_cudarc()?;
        // The memory's own stream: no event, and a capture of someone else's is refused as for
        // any lent buffer.
        let (ptr, _same_stream) = lent.device_ptr(lent.stream());
        Ok((ptr, lent.len()))
    }

    /// The address and elements of `view`, memory that `rank` may hand NCCL to write: lent through
    /// the writable view, so only memory the caller may write is written.
    fn lend_mut<T: Pod>(
        &self,
        rank: usize,
        mut view: GpuViewMut<'_, T>,
    ) -> Result<(u64, usize), PoolError> {
        self.rank_of(rank, view.stream(), view.device)?;
        continuous(view.is_continuous(), view.rows(), view.cols(), view.step())?;
        let mut lent = view.as_cudarc_mut()?;
        let len = lent.len();
        let stream = lent.stream().clone();
        let (ptr, _same_stream) = lent.device_ptr_mut(&stream);
        Ok((ptr, len))
    }

    fn push<T: NcclElement>(
        &mut self,
        rank: usize,
        kind: Kind,
        count: usize,
        send: u64,
        recv: u64,
    ) {
        self.ops.push(Op {
            rank,
            kind,
            count,
            dtype: T::TYPE,
            send,
            recv,
        });
    }

    /// `recv` on `rank` becomes the reduction of every rank's `send` (`ncclAllReduce`); both of
    /// one length (`PoolError::ShapeMismatch` otherwise).
    pub fn all_reduce<T: NcclElement>(
        &mut self,
        rank: usize,
        send: &'b impl GpuRead<T>,
        recv: &'b mut impl GpuWrite<T>,
        op: Reduce,
    ) -> Result<(), PoolError> {
        let (src, n) = self.lend(rank, &send.view())?;
        let (dst, m) = self.lend_mut(rank, recv.view_mut())?;
        if n != m {
            return Err(PoolError::ShapeMismatch {
                expected: m,
                actual: n,
            });
        }
        self.push::<T>(rank, Kind::AllReduce(op.raw()), n, src, dst);
        Ok(())
    }

    /// `buffer` on `rank` becomes the reduction of every rank's `buffer` (in place).
    pub fn all_reduce_in_place<T: NcclElement>(
        &mut self,
        rank: usize,
        buffer: &'b mut impl GpuWrite<T>,
        op: Reduce,
    ) -> Result<(), PoolError> {
        let (ptr, n) = self.lend_mut(rank, buffer.view_mut())?;
        self.push::<T>(rank, Kind::AllReduce(op.raw()), n, ptr, ptr);
        Ok(())
    }

    /// `recv` on `rank` becomes every rank's `send`, in rank order (`ncclAllGather`): it holds
    /// `world_size` times `send`'s elements (`PoolError::ShapeMismatch` otherwise).
    pub fn all_gather<T: NcclElement>(
        &mut self,
        rank: usize,
        send: &'b impl GpuRead<T>,
        recv: &'b mut impl GpuWrite<T>,
    ) -> Result<(), PoolError> {
        let (src, n) = self.lend(rank, &send.view())?;
        let (dst, m) = self.lend_mut(rank, recv.view_mut())?;
        let whole = n.checked_mul(self.ranks.len());
        if whole != Some(m) {
            return Err(PoolError::ShapeMismatch {
                expected: m,
                actual: whole.unwrap_or(usize::MAX),
            });
        }
        self.push::<T>(rank, Kind::AllGather, n, src, dst);
        Ok(())
    }

    /// `buffer` on every rank becomes `root`'s `buffer` (`ncclBroadcast`, in place).
    pub fn broadcast<T: NcclElement>(
        &mut self,
        rank: usize,
        buffer: &'b mut impl GpuWrite<T>,
        root: usize,
    ) -> Result<(), PoolError> {
        let (ptr, n) = self.lend_mut(rank, buffer.view_mut())?;
        self.push::<T>(rank, Kind::Broadcast { root }, n, ptr, ptr);
        Ok(())
    }

    /// Sends `buffer` from `rank` to `peer` (`ncclSend`), which must receive it in the same group
    /// with a buffer of the same length and type.
    pub fn send<T: NcclElement>(
        &mut self,
        rank: usize,
        buffer: &'b impl GpuRead<T>,
        peer: usize,
    ) -> Result<(), PoolError> {
        let (ptr, n) = self.lend(rank, &buffer.view())?;
        self.push::<T>(rank, Kind::Send { peer }, n, ptr, 0);
        Ok(())
    }

    /// Receives into `buffer` on `rank` what `peer` sends in the same group (`ncclRecv`).
    pub fn recv<T: NcclElement>(
        &mut self,
        rank: usize,
        buffer: &'b mut impl GpuWrite<T>,
        peer: usize,
    ) -> Result<(), PoolError> {
        let (ptr, n) = self.lend_mut(rank, buffer.view_mut())?;
        self.push::<T>(rank, Kind::Recv { peer }, n, 0, ptr);
        Ok(())
    }

    /// Whether the group can be queued as it is: ranks and peers exist, every rank makes the
    /// same collectives in the same order (kind, count, type, reduction, root and, while the stacks
    /// are a symmetric window, the window offsets of its buffers), and the sends from each rank to
    /// each peer meet that peer's receives from it, in order, of the same count and type.
    fn check(&self, windows: Option<&[(DevPtr, usize)]>) -> Result<(), PoolError> {
        let world = self.ranks.len();
        // Where `ptr` lies in `rank`'s symmetric window: NCCL's symmetric kernels reach a peer's
        // buffer at the same offset in the peer's window, so the offsets must agree.
        let offset = |rank: usize, ptr: u64| {
            windows.and_then(|w| {
                let (base, bytes) = w[rank];
                (ptr >= base && ptr < base + bytes as DevPtr).then(|| ptr - base)
            })
        };
        let mismatch = |problem: String| Err(PoolError::NcclGroup { problem });
        for op in &self.ops {
            let named = match op.kind {
                Kind::Broadcast { root } => Some(root),
                Kind::Send { peer } | Kind::Recv { peer } => Some(peer),
                _ => None,
            };
            if let Some(n) = named.filter(|&n| n >= world) {
                return mismatch(format!("rank {} names rank {n} of {world}", op.rank));
            }
        }
        let collectives = |rank: usize| {
            self.ops
                .iter()
                .filter(move |o| o.rank == rank && o.kind.is_collective())
                .map(move |o| {
                    let at = windows.map(|_| (offset(rank, o.send), offset(rank, o.recv)));
                    (o.kind, o.count, o.dtype as u32, at)
                })
        };
        let first: Vec<_> = collectives(0).collect();
        for rank in 1..world {
            let theirs: Vec<_> = collectives(rank).collect();
            if theirs != first {
                return mismatch(format!(
                    "rank {rank} makes {} collective(s), rank 0 {}, and they differ in kind, \
                     count, type or window offset: {theirs:?} against {first:?}",
                    theirs.len(),
                    first.len()
                ));
            }
        }
        for from in 0..world {
            for to in 0..world {
                let sends = self
                    .ops
                    .iter()
                    .filter(|o| o.rank == from && o.kind == Kind::Send { peer: to });
                let recvs = self
                    .ops
                    .iter()
                    .filter(|o| o.rank == to && o.kind == Kind::Recv { peer: from });
                let sent: Vec<_> = sends.map(|o| (o.count, o.dtype as u32)).collect();
                let received: Vec<_> = recvs.map(|o| (o.count, o.dtype as u32)).collect();
                if sent != received {
                    return mismatch(format!(
                        "rank {from} sends {sent:?} (count, type) to rank {to}, which receives \
                         {received:?} from it"
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Stack memory from `ncclMemAlloc`, freed with `ncclMemFree`, on one device.
struct NcclMemory {
    ctx: Arc<CudaContext>,
}

impl StackMemory for NcclMemory {
    fn alloc(&self, bytes: usize) -> Result<DevPtr, PoolError> {
        let _bound = ContextGuard::bind(&self.ctx)?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: `ptr` receives the allocation, on the device bound above.
        unsafe { sys::ncclMemAlloc(&raw mut ptr, bytes) }
            .result()
            .map_err(failed("ncclMemAlloc"))?;
        Ok(ptr as DevPtr)
    }

    unsafe fn free(&self, ptr: DevPtr) -> Result<(), PoolError> {
        let _bound = ContextGuard::bind(&self.ctx)?;
        // SAFETY: `ptr` came from `ncclMemAlloc` above and is unused (the caller's contract).
        unsafe { sys::ncclMemFree(ptr as *mut c_void) }
            .result()
            .map(drop)
            .map_err(failed("ncclMemFree"))
    }
}

/// Makes `device`'s stacks come from `ncclMemAlloc` from now on, memory NCCL can register as a
/// symmetric window ([`Communicators::register_stacks`]): fixed stacks (the streams made from now
/// on get them, not growable ones), one arena in NCCL memory. Stack memory already allocated is
/// freed first, so call it before the device's first stream takes a buffer.
///
/// Errors: `NoCudaLibrary` without `libnccl`; `Unsupported` on the host backend or an NCCL
/// before 2.19; `ConfigInUse` while a stream holds a stack of the old memory;
/// `StackMemoryRegistered` while it is registered.
///
/// ```no_run
/// use gpu_pool_runtime::{Device, PoolError, nccl};
/// let gpu = Device::cuda(0)?;
/// nccl::use_nccl_memory(&gpu)?; // before the first stream
/// # Ok::<(), PoolError>(())
/// ```
pub fn use_nccl_memory(device: &Device) -> Result<(), PoolError> {
    if version()? < NCCL_REGISTER {
        return Err(PoolError::Unsupported {
            device: device.id(),
            what: "ncclMemAlloc before NCCL 2.19",
        });
    }
    let Some(ctx) = device.cuda_context() else {
        return Err(PoolError::Unsupported {
            device: device.id(),
            what: "NCCL memory on the host backend",
        });
    };
    device
        .inner
        .set_stack_memory(Some(Arc::new(NcclMemory { ctx: ctx.clone() })))?;
    // Only the fixed stacks' arena comes from NCCL: streams made from now on take those.
    device.set_growable_stacks(false)
}

/// Makes `device`'s stacks come from the driver (`cuMemAlloc`) again, as before
/// [`use_nccl_memory`]. Stack memory from NCCL is freed first if no stream holds a stack
/// (`ConfigInUse` otherwise; `StackMemoryRegistered` while registered).
///
/// ```no_run
/// use gpu_pool_runtime::{Device, PoolError, nccl};
/// let gpu = Device::cuda(0)?;
/// nccl::use_nccl_memory(&gpu)?;
/// nccl::use_driver_memory(&gpu)?;
/// # Ok::<(), PoolError>(())
/// ```
pub fn use_driver_memory(device: &Device) -> Result<(), PoolError> {
    device.inner.set_stack_memory(None)
}

/// A region narrower than its buffer would hand NCCL its neighbours' elements between rows, and a
/// padded 2D buffer its padding: NCCL takes runs of elements.
fn continuous(is: bool, rows: usize, cols: usize, step: usize) -> Result<(), PoolError> {
    if is {
        Ok(())
    } else {
        Err(PoolError::NotContinuous { rows, cols, step })
    }
}

/// Captures `work` with every stream of `streams` in its own capture, the first outermost; the
/// graphs land in `made`, innermost first.
fn nested_captures<'a>(
    streams: Vec<&'a Stream>,
    work: Box<dyn FnOnce() -> Result<(), PoolError> + 'a>,
    made: Rc<RefCell<Vec<Graph<'a>>>>,
) -> Result<(), PoolError> {
    let Some((&first, rest)) = streams.split_first() else {
        return work();
    };
    let rest = rest.to_vec();
    let inner = made.clone();
    let graph = first.capture(move |_| nested_captures(rest, work, inner))?;
    made.borrow_mut().push(graph);
    Ok(())
}

/// One graph per rank of a [`Communicators::capture`], replayed together so that the ranks stay
/// in step: each replay of one rank's graph meets the same replay of every other's.
pub struct RankGraphs<'a> {
    comms: &'a Communicators<'a>,
    graphs: Vec<Graph<'a>>,
}

impl std::fmt::Debug for RankGraphs<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankGraphs")
            .field("ranks", &self.graphs.len())
            .finish()
    }
}

impl RankGraphs<'_> {
    /// Queues one replay of every rank's graph, each on its rank's stream.
    ///
    /// Errors: `PoolError::NcclGroup` if an earlier replay failed part-way (the ranks may be out
    /// of step; the communicators refuse every group from then on); the driver's error if this
    /// one fails, which marks them so.
    pub fn launch(&self) -> Result<(), PoolError> {
        if self.comms.out_of_step.get() {
            return Err(PoolError::NcclGroup {
                problem: "a replay of these communicators failed part-way, so their ranks may be \
                          out of step; make new communicators"
                    .into(),
            });
        }
        // Every rank's checks (a refused shared-memory access among them) come before any rank
        // is queued: only a failure part-way puts the ranks out of step.
        Graph::launch_together(&self.graphs).map_err(|(i, e)| {
            if i > 0 {
                self.comms.out_of_step.set(true);
            }
            e
        })
    }

    /// Each rank's graph's nodes, rank order not guaranteed.
    pub fn nodes(&self) -> Result<Vec<GraphNodes>, PoolError> {
        self.graphs.iter().map(Graph::nodes).collect()
    }
}
