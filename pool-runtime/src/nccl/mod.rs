//! NCCL on pool streams (feature `nccl`): one communicator per pool stream, collectives and
//! point-to-point calls on pool buffers, and stacks in memory NCCL can register.
//!
//! One process drives every GPU: [`Communicators::new`] makes a rank of each pool stream (one per
//! device), and every NCCL call goes through [`Communicators::group`], which checks the whole
//! group before NCCL sees any of it: each rank's collectives in the same order with the same
//! count, type, reduction and root; each send matched by a receive of the same count and type on
//! its peer; each buffer continuous, of its rank's own stream, and (while the stacks are a
//! symmetric window) at the same window offset on every rank; every rank's stream eager, or every
//! one in [`Communicators::capture`]. Otherwise the group is refused (`NcclError::Group`) and
//! nothing is queued. Element types are NCCL's own ([`NcclElement`], sealed), so the count NCCL is
//! told is the buffer's. The buffers are borrowed for the whole group, so none is released (and
//! its stack memory handed out again) before NCCL has queued its work; and since that work is on
//! the buffer's own stream, the stack reuses the memory only after it.
//!
//! A graph of [`Communicators::capture`] replays every rank at once ([`RankGraphs::launch`]), so
//! the ranks cannot fall out of step.
//!
//! Ranks in other processes, on this host or others: rank 0 makes a [`UniqueId`] and hands it to
//! the others by the program's own channel (an environment variable, a file, a pipe, a socket:
//! it is 128 bytes, or 256 hex digits as text), and each process makes its rank with
//! [`Communicators::from_rank`]. Such communicators are the same type: groups, captures, rank
//! graphs and registration work as above, over the ranks this process holds. What a process
//! cannot see is checked on request, and always while the stacks are registered:
//! [`Communicators::set_verify_groups`] all-gathers a digest of each rank's group before the group
//! (so a rank whose counts differ is refused on every rank instead of hanging NCCL, or, through a
//! registration, reaching other buffers of a peer's stack), and [`Communicators::check_symmetric`]
//! compares every rank's stack layout the same way. Their NCCL runs in non-blocking mode: NCCL's
//! own waits for a peer give up at the communicator's timeout, after which it is aborted and
//! `NcclError::Timeout` says so. Wait for their work with [`Communicators::wait`] (it gives up
//! at the timeout), not with a stream's `synchronize`, which would wait forever for a collective
//! whose peer never comes; on an error path, drop (or [`abort`](Communicators::abort)) the
//! communicators before the buffers their collectives use (see [`Communicators::from_rank`] for
//! the waits the timeout does not bound).
//!
//! Never open an NCCL group of your own (`cudarc::nccl::result::group_start`) around
//! [`Communicators::group`]: NCCL nests groups, so the pool's `ncclGroupEnd` would not queue the
//! collectives, the group's buffers would be released (and their stack memory handed out again)
//! before NCCL ran on them, and the checks of the whole group would be bypassed. Put every call
//! of one NCCL group into one `Communicators::group`.
//!
//! `libnccl` is loaded at run time, like the driver: where it is missing every call returns
//! `PoolError::NoCudaLibrary`, never cudarc's panic.
//!
//! Symmetric stacks: ranks that run the same pooled work take the same offsets
//! ([`check_symmetric`](crate::core::symmetric::check_symmetric) proves it in debug builds). With
//! [`use_nccl_memory`] a device's stacks come from `ncclMemAlloc`, and
//! [`Communicators::register_stacks`] registers every rank's stacks with its communicator, as
//! NCCL buffers or as one symmetric window, so collectives on `buffer!` temporaries can skip
//! NCCL's staging copies.
//!
//! ```no_run
//! use gpu_pool::nccl::{Communicators, Reduce};
//! use gpu_pool::{compat::opencv::BufferPool, Device, GpuRead, GpuWrite, PoolError, Stream};
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
use std::ffi::{c_char, c_void};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytemuck::Pod;
use cudarc::driver::{CudaContext, DevicePtr, DevicePtrMut, DeviceSlice};
use cudarc::nccl::{result, sys};

use crate::base::error::PoolError;
pub use crate::base::error::{NcclError, NcclFailure};
use crate::core::access::{GpuRead, GpuWrite};
use crate::core::arena::StackMemory;
use crate::core::device::Device;
use crate::core::device::StackPin;
use crate::core::stream::Stream;
use crate::core::view::{GpuView, GpuViewMut};
use crate::graph::{Graph, GraphNodes};
use crate::storage::backend::DevPtr;
use crate::storage::backend::cuda::ContextGuard;

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

/// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`: every field NCCL's header leaves undefined is
/// undefined here too (`NCCL_CONFIG_UNDEF_INT`, null), so NCCL picks them. NCCL copies at most
/// the size it knows, so an older NCCL reads the fields it has.
fn nonblocking_config() -> sys::ncclConfig_t {
    const UNDEF: i32 = i32::MIN;
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        // The header these bindings were made from (2.28): the fields above are its.
        version: 22800,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
    }
}

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

/// `NcclError::Call` for a failed `call`.
fn failed(call: &'static str) -> impl Fn(result::NcclError) -> PoolError {
    move |e| {
        PoolError::Nccl(NcclError::Call {
            call,
            source: NcclFailure(e).into(),
        })
    }
}

/// The first NCCL with non-blocking communicators (`ncclConfig_t.blocking`), 2.14.
const NCCL_NONBLOCKING: i32 = 21400;

/// Bytes of an NCCL unique id.
pub const UNIQUE_ID_BYTES: usize = 128;

/// The id every rank of one communicator across processes is made from
/// ([`Communicators::from_rank`]): rank 0 makes it ([`UniqueId::new`]) and hands it to every other
/// rank by the program's own channel, as bytes ([`to_bytes`](Self::to_bytes)) or as text (its
/// `Display`, 256 lowercase hex digits, which `str::parse` reads back: fit for an environment
/// variable or a line of a file or pipe). It names rank 0's listening socket: make a new one for
/// every communicator.
///
/// ```
/// use gpu_pool::nccl::UniqueId;
/// let id = UniqueId::from_bytes([7; 128]); // rank 0 makes it with UniqueId::new()
/// let text = id.to_string(); // e.g. into an environment variable of the other ranks
/// assert_eq!(text.len(), 256);
/// let back: UniqueId = text.parse()?;
/// assert_eq!(back, id);
/// assert!("not an id".parse::<UniqueId>().is_err());
/// # Ok::<(), gpu_pool::PoolError>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UniqueId([u8; UNIQUE_ID_BYTES]);

impl UniqueId {
    /// A new id (`ncclGetUniqueId`), made by rank 0 only: it opens rank 0's bootstrap socket, to
    /// which every rank connects. `PoolError::NoCudaLibrary` without `libnccl`.
    pub fn new() -> Result<UniqueId, PoolError> {
        present()?;
        let id = result::get_uniqueid().map_err(failed("ncclGetUniqueId"))?;
        Ok(UniqueId(id.internal.map(|c| c as u8)))
    }

    /// The id from its bytes, as [`to_bytes`](Self::to_bytes) gave them on rank 0.
    #[must_use]
    pub fn from_bytes(bytes: [u8; UNIQUE_ID_BYTES]) -> UniqueId {
        UniqueId(bytes)
    }

    /// The id's bytes, to send to the other ranks.
    #[must_use]
    pub fn to_bytes(&self) -> [u8; UNIQUE_ID_BYTES] {
        self.0
    }

    fn raw(&self) -> sys::ncclUniqueId {
        sys::ncclUniqueId {
            internal: self.0.map(|b| b as c_char),
        }
    }
}

impl std::fmt::Display for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId({self})")
    }
}

impl std::str::FromStr for UniqueId {
    type Err = PoolError;

    /// Reads the text of `Display` back; whitespace around it (a line's end) is ignored.
    /// `NcclError::Id` for anything but 256 hex digits.
    fn from_str(text: &str) -> Result<UniqueId, PoolError> {
        let text = text.trim();
        if text.len() != 2 * UNIQUE_ID_BYTES {
            return Err(PoolError::Nccl(NcclError::Id {
                problem: format!(
                    "{} characters, {} expected",
                    text.chars().count(),
                    2 * UNIQUE_ID_BYTES
                ),
            }));
        }
        let mut bytes = [0; UNIQUE_ID_BYTES];
        for (i, byte) in bytes.iter_mut().enumerate() {
            let pair = text
                .get(2 * i..2 * i + 2)
                .filter(|p| p.bytes().all(|b| b.is_ascii_hexdigit()));
            *byte = pair
                .and_then(|p| u8::from_str_radix(p, 16).ok())
                .ok_or_else(|| {
                    PoolError::Nccl(NcclError::Id {
                        problem: format!("not a hex digit pair at character {}", 2 * i),
                    })
                })?;
        }
        Ok(UniqueId(bytes))
    }
}

/// The NCCL loaded, as `ncclGetVersion` encodes it (2.28.3 is 22803).
/// `PoolError::NoCudaLibrary` where `libnccl` cannot be loaded.
///
/// ```no_run
/// let version = gpu_pool::nccl::version()?;
/// println!("NCCL {}.{}.{}", version / 10000, version / 100 % 100, version % 100);
/// # Ok::<(), gpu_pool::PoolError>(())
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

/// NCCL ranks on pool streams: every rank in this process ([`new`](Self::new), rank `i` on
/// `streams[i]`, each on a device of its own), or this process's rank of a world spread over
/// processes ([`from_rank`](Self::from_rank)). See the [module](self) for what a group checks.
pub struct Communicators<'s> {
    /// The ranks this process holds, in rank order.
    ranks: Vec<Rank<'s>>,
    /// Ranks in all processes.
    world: usize,
    /// Ranks in other processes: NCCL's non-blocking mode and what goes with it.
    remote: Option<Remote>,
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
    /// Its rank in the world.
    rank: usize,
}

/// What communicators with ranks in other processes add: every wait for the peers gives up at
/// `timeout` (NCCL's non-blocking mode, polled), and the cross-process checks' device memory.
struct Remote {
    timeout: Cell<Duration>,
    /// Aborted (`ncclCommAbort`) after a timeout or a failure NCCL reported: the communicators
    /// are gone, every call is refused.
    aborted: Cell<bool>,
    /// Each group is checked against every other rank's first ([`Communicators::set_verify_groups`]).
    verify: Cell<bool>,
    /// Per local rank, on its device: one slot sent and `world` slots gathered.
    scratch: Vec<(Arc<CudaContext>, DevPtr)>,
}

/// Bytes each rank contributes to a check across processes: a tag word and three words.
const SLOT: usize = 32;
/// Tags of a slot: what the rank that sent it was checking.
const TAG_GROUP: u64 = 0x6770_2d67_726f_7570;
const TAG_REFUSED: u64 = 0x6770_2d72_6566_7573;
const TAG_LAYOUT: u64 = 0x6770_2d6c_6179_6f75;
const TAG_REGISTER: u64 = 0x6770_2d72_6567_6973;

/// FNV-1a over words: a digest that a change of any word, or of their order, changes.
fn fnv(words: impl IntoIterator<Item = u64>) -> u64 {
    words.into_iter().fold(0xcbf2_9ce4_8422_2325, |h, w| {
        w.to_le_bytes().iter().fold(h, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    })
}

fn slot(words: [u64; 4]) -> [u8; SLOT] {
    let mut out = [0; SLOT];
    for (chunk, w) in out.chunks_exact_mut(8).zip(words) {
        chunk.copy_from_slice(&w.to_le_bytes());
    }
    out
}

fn words(slot: &[u8; SLOT]) -> [u64; 4] {
    let mut out = [0; 4];
    for (w, chunk) in out.iter_mut().zip(slot.chunks_exact(8)) {
        let mut b = [0; 8];
        b.copy_from_slice(chunk);
        *w = u64::from_le_bytes(b);
    }
    out
}

/// Whether NCCL is done with the last call on `comm` (non-blocking mode): `Ok(false)` while it
/// is in progress, NCCL's error where it failed (a peer's failure among them).
fn settled(comm: sys::ncclComm_t) -> Result<bool, PoolError> {
    let mut raw: u32 = 0;
    // SAFETY: a live communicator; NCCL writes one `ncclResult_t` (a C enum, 4 bytes), read as
    // u32 so that a status newer than these bindings is no invalid Rust enum.
    unsafe { sys::ncclCommGetAsyncError(comm, (&raw mut raw).cast()) }
        .result()
        .map_err(failed("ncclCommGetAsyncError"))?;
    use sys::ncclResult_t as R;
    let status = match raw {
        0 => return Ok(true),
        7 => return Ok(false),
        1 => R::ncclUnhandledCudaError,
        2 => R::ncclSystemError,
        4 => R::ncclInvalidArgument,
        5 => R::ncclInvalidUsage,
        6 => R::ncclRemoteError,
        _ => R::ncclInternalError,
    };
    Err(PoolError::Nccl(NcclError::Call {
        call: "ncclCommGetAsyncError (NCCL's or a peer's failure)",
        source: NcclFailure(result::NcclError(status)).into(),
    }))
}

/// A pause while polling: short at first (an enqueue takes microseconds), longer later (a peer
/// that connects takes seconds), so neither latency nor a core is wasted.
fn pause(since: Instant) {
    if since.elapsed() < Duration::from_millis(2) {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(200));
    }
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
            .field("world", &self.world)
            .field(
                "ranks",
                &self.ranks.iter().map(|r| r.rank).collect::<Vec<_>>(),
            )
            .field("streams", &streams)
            .field("timeout", &self.timeout())
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
                device: crate::base::id::DeviceId::Host(0),
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
            .enumerate()
            .map(|(rank, (comm, stream))| Rank { comm, stream, rank })
            .collect();
        Ok(Communicators {
            ranks,
            world: streams.len(),
            remote: None,
            capturing: Cell::new(false),
            windows: RefCell::new(None),
            registered: Cell::new(false),
            out_of_step: Cell::new(false),
        })
    }

    /// Rank `rank` of a communicator of `world` ranks spread over processes (or hosts), on
    /// `stream` (`ncclCommInitRankConfig`, non-blocking): every process calls it with the same
    /// `id` (made by rank 0, [`UniqueId::new`]) and `world`, and a rank of its own. It returns
    /// once every rank has joined, or gives up after `timeout` (`NcclError::Timeout`): no
    /// wait of these communicators for their peers outlasts it (see [`wait`](Self::wait)).
    ///
    /// Groups name ranks by their number in the world; this process's calls name only its own
    /// rank, and the group checks what this process sees (its own buffers, peers that exist).
    /// Whether the other ranks make the same calls is checked with
    /// [`set_verify_groups`](Self::set_verify_groups), and always while the stacks are registered
    /// ([`register_stacks`](Self::register_stacks)).
    ///
    /// What the timeout bounds: the joining here, each group's hand-over to NCCL (and its check
    /// across processes), [`wait`](Self::wait), [`check_symmetric`](Self::check_symmetric),
    /// [`register_stacks`](Self::register_stacks) and its drop, and the drop of the
    /// communicators (its wait for their work, `ncclCommFinalize`): each such call gives up at
    /// one deadline, `timeout` after it began, aborts the communicators and returns
    /// `NcclTimeout` (or logs it, in a drop). Each call has a timeout of its own: a `group` and a
    /// `wait` after it may take up to two. What it does not bound, since it is no NCCL call:
    /// - a stream's `synchronize`, `to_vec` or any download or host copy on a stream whose
    ///   collective waits for a peer: they wait for the device, forever if the peer never comes
    ///   (call [`wait`](Self::wait) first);
    /// - freeing device memory: dropping a `GpuMat` (or other memory from the driver) waits for
    ///   the whole device (`cuMemFree`), so on an error path drop the communicators, or call
    ///   [`abort`](Self::abort), before the buffers their collectives use (declare the buffers
    ///   before the communicators, which then drop first);
    /// - a launch (a kernel, a copy, a graph replay, NCCL's own) into a stream whose queue is
    ///   full behind a collective that waits: the driver blocks the launching thread;
    /// - the final `synchronize` of the streams in the communicators' drop after an abort, which
    ///   waits for the work queued after the aborted collectives (not for a peer).
    ///
    /// Errors: `NcclRank` for a rank outside `0..world` or a world of no ranks (before anything
    /// else); `Unsupported` for a host stream or an NCCL before 2.14; `NoCudaLibrary` without
    /// `libnccl`; `Nccl` if NCCL fails; `NcclTimeout` if the other ranks did not join in time.
    /// The caller's current CUDA context is kept.
    ///
    /// ```no_run
    /// use gpu_pool::nccl::{Communicators, Reduce, UniqueId};
    /// use gpu_pool::{compat::opencv::BufferPool, Device, PoolError, Stream};
    /// use std::time::Duration;
    /// let rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
    /// let world: usize = std::env::var("WORLD_SIZE").unwrap().parse().unwrap();
    /// // Rank 0 made the id with UniqueId::new() and passed its text on.
    /// let id: UniqueId = std::env::var("GPU_POOL_NCCL_ID").unwrap().parse()?;
    /// let stream = Stream::new(&Device::cuda(rank)?)?;
    /// let ranks = Communicators::from_rank(&stream, &id, rank, world, Duration::from_secs(300))?;
    /// let mut grad = BufferPool::new(&stream).get_buffer_1d::<f32>(1024)?;
    /// ranks.group(|g| g.all_reduce_in_place(rank, &mut grad, Reduce::Sum))?;
    /// ranks.wait()?; // gives up (and aborts) if a peer never comes
    /// # Ok::<(), PoolError>(())
    /// ```
    pub fn from_rank(
        stream: &'s Stream,
        id: &UniqueId,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Communicators<'s>, PoolError> {
        let (Ok(nranks), Ok(me)) = (i32::try_from(world), i32::try_from(rank)) else {
            return Err(PoolError::Nccl(NcclError::Rank { rank, world }));
        };
        if rank >= world {
            return Err(PoolError::Nccl(NcclError::Rank { rank, world }));
        }
        let device = stream.device().id();
        let Some(cuda) = stream.cuda_stream() else {
            return Err(PoolError::Unsupported {
                device,
                what: "NCCL outside a CUDA device",
            });
        };
        if version()? < NCCL_NONBLOCKING {
            return Err(PoolError::Unsupported {
                device,
                what: "NCCL ranks across processes before NCCL 2.14 (no non-blocking mode)",
            });
        }
        let ctx = cuda.context().clone();
        // NCCL takes the rank's device from the current context.
        let _bound = ContextGuard::bind(&ctx)?;
        // Where the checks across processes meet: one slot sent, every rank's gathered.
        let bytes = SLOT * (world + 1);
        // SAFETY: an allocation of `bytes` on the bound device, freed in `Drop`.
        let scratch = unsafe { cudarc::driver::result::malloc_sync(bytes) }
            .map_err(|e| crate::storage::backend::cuda::driver_error("cuMemAlloc", e))?;
        let remote = Remote {
            timeout: Cell::new(timeout),
            aborted: Cell::new(false),
            verify: Cell::new(false),
            scratch: vec![(ctx, scratch)],
        };
        let mut config = nonblocking_config();
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` receives the communicator; `config` is a whole `ncclConfig_t` made as
        // NCCL_CONFIG_INITIALIZER makes it, which NCCL reads only during the call.
        let started = unsafe {
            sys::ncclCommInitRankConfig(&raw mut comm, nranks, id.raw(), me, &raw mut config)
        }
        .result();
        let comms = Communicators {
            ranks: vec![Rank { comm, stream, rank }],
            world,
            remote: Some(remote),
            capturing: Cell::new(false),
            windows: RefCell::new(None),
            registered: Cell::new(false),
            out_of_step: Cell::new(false),
        };
        if let Err(e) = started {
            // No communicator to wait for or abort when NCCL refused the call outright.
            if comm.is_null() {
                comms.remote.as_ref().expect("remote").aborted.set(true);
            } else {
                comms.abort();
            }
            return Err(failed("ncclCommInitRankConfig")(e));
        }
        // Every rank connects to rank 0's socket; a rank that never comes is the timeout.
        comms.settle("Communicators::from_rank", Instant::now())?;
        Ok(comms)
    }

    /// How many ranks, in every process.
    #[must_use]
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The ranks this process holds (all of them for [`new`](Self::new), one for
    /// [`from_rank`](Self::from_rank)).
    pub fn local_ranks(&self) -> impl Iterator<Item = usize> + '_ {
        self.ranks.iter().map(|r| r.rank)
    }

    /// The stream of rank `rank`, if this process holds such a rank.
    #[must_use]
    pub fn stream(&self, rank: usize) -> Option<&'s Stream> {
        self.ranks.iter().find(|r| r.rank == rank).map(|r| r.stream)
    }

    /// How long a wait for ranks in other processes lasts before it gives up (`None` for
    /// communicators of one process, whose NCCL calls block: their groups are checked whole).
    #[must_use]
    pub fn timeout(&self) -> Option<Duration> {
        self.remote.as_ref().map(|r| r.timeout.get())
    }

    /// Sets how long a wait for ranks in other processes lasts before it gives up and aborts the
    /// communicator: the first step's (NCCL connects then) and the longest step's time, with a
    /// margin. Nothing for communicators of one process.
    pub fn set_timeout(&self, timeout: Duration) {
        if let Some(remote) = &self.remote {
            remote.timeout.set(timeout);
        }
    }

    /// Checks every later eager group against the other processes' before NCCL sees it: each
    /// rank all-gathers a digest of its part of the group (its collectives' kinds, counts, types,
    /// reductions, roots and window offsets, and its sends and receives by peer), and a group on
    /// which the ranks disagree, or that a rank refused, is refused on every rank
    /// (`NcclError::Group`), none queues it, and they stay in step. It costs a small
    /// all-gather and a wait for the stream per group: a debug and bring-up aid. Every process
    /// must turn it on or off alike (a digest one rank sends and another does not await is the
    /// timeout). While the stacks are registered ([`register_stacks`](Self::register_stacks))
    /// every eager group is checked so whatever the setting: NCCL reaches a peer's buffers
    /// through the registration, so a group whose counts differ would reach other live buffers of
    /// the peer's stack. Groups inside [`capture`](Self::capture) are not checked (a capture cannot wait):
    /// run the step eagerly first, as NCCL wants anyway. Nothing for communicators of one process,
    /// whose groups are always checked whole.
    ///
    /// This rank's own refusals (a check of the group, a stream captured outside
    /// [`capture`](Self::capture)) are made before the exchange and sent as a refusal; a failure
    /// after it (NCCL refusing the call, or the exchange failing) aborts the communicators, so
    /// the peers fail or time out rather than meet another collective.
    pub fn set_verify_groups(&self, on: bool) {
        if let Some(remote) = &self.remote {
            remote.verify.set(on);
        }
    }

    /// Checks that every rank's stream laid its stack out alike (see
    /// [`check_symmetric`](crate::core::symmetric::check_symmetric)), in every process: each rank all-gathers its
    /// [`Stream::layout_trace`] through NCCL and compares every rank's with rank 0's, so every
    /// process gets the same answer. Call it on every rank at the same point of the program, as
    /// a collective, outside any capture. A debug check: in builds without debug assertions it
    /// returns `Ok(())` at once (every process must be built alike, or the debug ones time out).
    ///
    /// Errors: `PoolError::Asymmetric` naming the first rank that differs from rank 0;
    /// `NcclTimeout` where a rank never made this call; `Unsupported` inside a capture.
    pub fn check_symmetric(&self) -> Result<(), PoolError> {
        if !cfg!(debug_assertions) {
            return Ok(());
        }
        if self.remote.is_none() {
            let streams: Vec<&Stream> = self.ranks.iter().map(|r| r.stream).collect();
            return crate::core::symmetric::check_symmetric(&streams);
        }
        self.refuse_aborted()?;
        self.refuse_capture("Communicators::check_symmetric")?;
        let nothing = crate::core::stack::LayoutTrace::from_bytes([0; 24]);
        let mine: Vec<[u8; SLOT]> = self
            .ranks
            .iter()
            .map(|r| {
                let t = r.stream.layout_trace().unwrap_or(nothing);
                slot([TAG_LAYOUT, t.takes(), t.top(), t.digest()])
            })
            .collect();
        let all = self.exchange(&mine, "Communicators::check_symmetric")?;
        let traces: Vec<[u64; 4]> = all.iter().map(words).collect();
        if let Some(r) = traces.iter().position(|w| w[0] != TAG_LAYOUT) {
            return Err(PoolError::Nccl(NcclError::Group {
                problem: format!(
                    "rank {r} sent no layout trace to check_symmetric (it made another check at                      the same point: every rank must call check_symmetric together)"
                ),
            }));
        }
        match traces.iter().position(|w| w != &traces[0]) {
            None => Ok(()),
            Some(rank) => {
                let (t, t0) = (traces[rank], traces[0]);
                Err(PoolError::Asymmetric {
                    rank,
                    takes: t[1],
                    top: t[2],
                    digest: t[3],
                    takes0: t0[1],
                    top0: t0[2],
                    digest0: t0[3],
                })
            }
        }
    }

    /// Waits until the work queued on this process's ranks' streams is done. For ranks in other
    /// processes it gives up at the timeout (counted from this call): a collective whose peer
    /// never comes (it exited, hangs, or made a different call) would otherwise never finish.
    /// Then, and where NCCL reports a failure (a peer's among them), the communicator is aborted,
    /// which ends its kernels, and refuses every call from then on. It polls the stream and
    /// NCCL without blocking, so nothing in it waits past the deadline; the waits it cannot bound
    /// (a memory free, a full launch queue) are listed at [`from_rank`](Self::from_rank): after an
    /// error here, drop the communicators before the buffers their collectives used.
    ///
    /// Errors: `NcclTimeout`; `Nccl` for NCCL's failure; `NcclGroup` once aborted;
    /// `Unsupported` inside a capture (a capture cannot wait).
    pub fn wait(&self) -> Result<(), PoolError> {
        self.refuse_aborted()?;
        self.refuse_capture("Communicators::wait")?;
        self.wait_streams("Communicators::wait", Instant::now())
    }

    /// Refused once aborted: the communicators are gone.
    fn refuse_aborted(&self) -> Result<(), PoolError> {
        if self.remote.as_ref().is_some_and(|r| r.aborted.get()) {
            return Err(PoolError::Nccl(NcclError::Group {
                problem: "these communicators were aborted after a timeout or an NCCL failure;                           make new ones from a new UniqueId on every rank"
                    .into(),
            }));
        }
        Ok(())
    }

    /// Waits and host reads cannot happen inside a capture of the ranks' streams.
    fn refuse_capture(&self, what: &'static str) -> Result<(), PoolError> {
        if self.capturing.get() || self.ranks.iter().any(|r| r.stream.in_own_capture()) {
            return Err(PoolError::Unsupported {
                device: self.ranks[0].stream.device().id(),
                what: if what == "Communicators::wait" {
                    "Communicators::wait inside a capture (wait after it, or after a replay)"
                } else {
                    "Communicators::check_symmetric inside a capture (check after it)"
                },
            });
        }
        Ok(())
    }

    /// Waits for every local rank's stream: for ranks in other processes by polling, until the
    /// timeout after `start` (one deadline for every wait of one call), with NCCL's failures
    /// polled too.
    fn wait_streams(&self, what: &'static str, start: Instant) -> Result<(), PoolError> {
        let Some(remote) = &self.remote else {
            return self.ranks.iter().try_for_each(|r| r.stream.synchronize());
        };
        for rank in &self.ranks {
            let cuda = rank.cuda()?;
            let _bound = ContextGuard::bind(cuda.context())?;
            loop {
                use cudarc::driver::sys::CUresult;
                // SAFETY: a live stream; the query waits for nothing.
                match unsafe { cudarc::driver::sys::cuStreamQuery(cuda.cu_stream()) } {
                    CUresult::CUDA_SUCCESS => break,
                    CUresult::CUDA_ERROR_NOT_READY => {}
                    e => {
                        return Err(crate::storage::backend::cuda::driver_error(
                            "cuStreamQuery",
                            cudarc::driver::DriverError(e),
                        ));
                    }
                }
                if let Err(e) = settled(rank.comm) {
                    self.abort();
                    return Err(e);
                }
                if start.elapsed() >= remote.timeout.get() {
                    self.abort();
                    return Err(PoolError::Nccl(NcclError::Timeout {
                        what,
                        waited: start.elapsed(),
                    }));
                }
                pause(start);
            }
            // Done: the pool's own bookkeeping of a wait, at once.
            rank.stream.synchronize()?;
        }
        Ok(())
    }

    /// For ranks in other processes, waits until NCCL is done with the last call on every local
    /// communicator (non-blocking mode returns first), up to the timeout; aborts on the timeout
    /// and on a failure NCCL reports. Nothing for communicators of one process. The timeout counts
    /// from `start`: a call that settles and then waits gives up at one deadline, not two.
    fn settle(&self, what: &'static str, start: Instant) -> Result<(), PoolError> {
        let Some(remote) = &self.remote else {
            return Ok(());
        };
        for rank in &self.ranks {
            loop {
                match settled(rank.comm) {
                    Ok(true) => break,
                    Ok(false) => {}
                    Err(e) => {
                        self.abort();
                        return Err(e);
                    }
                }
                if start.elapsed() >= remote.timeout.get() {
                    self.abort();
                    return Err(PoolError::Nccl(NcclError::Timeout {
                        what,
                        waited: start.elapsed(),
                    }));
                }
                pause(start);
            }
        }
        Ok(())
    }

    /// Aborts this process's communicators now (`ncclCommAbort`, which ends their kernels), once:
    /// for an error path of ranks in other processes, before the buffers their collectives use
    /// are dropped (freeing device memory waits for the device, so a collective whose peer never
    /// comes would hang the drop). The peers' calls then fail or time out. Every later call is
    /// refused (`NcclError::Group`); dropping the communicators after it waits for nothing.
    /// Nothing for communicators of one process ([`new`](Self::new)): their NCCL calls block,
    /// so no collective of theirs is left waiting for a peer.
    pub fn abort(&self) {
        let Some(remote) = &self.remote else {
            return;
        };
        if remote.aborted.replace(true) {
            return;
        }
        let _restore = ContextGuard::keep_current().ok();
        for rank in &self.ranks {
            // SAFETY: our communicator, aborted once (`aborted` is set above); nothing uses it
            // after (every call checks `aborted` first).
            if let Err(e) = unsafe { result::comm_abort(rank.comm) } {
                crate::base::event::error!(error = %failed("ncclCommAbort")(e), "aborting an NCCL communicator failed");
            }
        }
    }

    /// Every rank's slot, in rank order, from `mine` (one slot per local rank): an NCCL
    /// all-gather on the local ranks' streams, waited for up to the timeout. Ranks in other
    /// processes only, outside captures. Any failure aborts the communicator: the peers' part of
    /// the all-gather may be queued already, and an abort is what they can see (they fail or time
    /// out instead of meeting this rank's next collective with their all-gather).
    fn exchange(
        &self,
        mine: &[[u8; SLOT]],
        what: &'static str,
    ) -> Result<Vec<[u8; SLOT]>, PoolError> {
        let all = self.exchange_once(mine, what, Instant::now());
        if all.is_err() {
            self.abort();
        }
        all
    }

    fn exchange_once(
        &self,
        mine: &[[u8; SLOT]],
        what: &'static str,
        start: Instant,
    ) -> Result<Vec<[u8; SLOT]>, PoolError> {
        let remote = self
            .remote
            .as_ref()
            .expect("exchange is for ranks in other processes");
        let driver = crate::storage::backend::cuda::driver_error;
        let _restore = ContextGuard::keep_current()?;
        for ((rank, slot), (ctx, scratch)) in self.ranks.iter().zip(mine).zip(&remote.scratch) {
            let _bound = ContextGuard::bind(ctx)?;
            // SAFETY: `scratch` holds `world + 1` slots on this device; a pageable source is
            // staged before the call returns, so `slot` may go after it.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    *scratch,
                    &slot[..],
                    rank.cuda()?.cu_stream(),
                )
            }
            .map_err(|e| driver("cuMemcpyHtoDAsync", e))?;
        }
        result::group_start().map_err(failed("ncclGroupStart"))?;
        let queued = self
            .ranks
            .iter()
            .zip(&remote.scratch)
            .try_for_each(|(rank, (_, scratch))| {
                let stream = rank.cuda()?.cu_stream() as sys::cudaStream_t;
                // SAFETY: the first slot is sent, the `world` after it receive every rank's, all
                // in this rank's scratch; the all-gather is queued on the rank's stream, which
                // is waited for before the slots are read.
                unsafe {
                    sys::ncclAllGather(
                        *scratch as *const c_void,
                        (*scratch + SLOT as DevPtr) as *mut c_void,
                        SLOT,
                        sys::ncclDataType_t::ncclUint8,
                        rank.comm,
                        stream,
                    )
                }
                .result()
                .map(drop)
                .map_err(failed("ncclAllGather"))
            });
        let ended = result::group_end().map_err(failed("ncclGroupEnd"));
        queued?;
        ended?;
        self.settle(what, start)?;
        // The stream is idle after this: the copy below (to pageable memory, which the driver
        // does before it returns) cannot wait on a collective that hangs.
        self.wait_streams(what, start)?;
        let mut all = vec![[0u8; SLOT]; self.world];
        let (ctx, scratch) = &remote.scratch[0];
        let _bound = ContextGuard::bind(ctx)?;
        let stream = self.ranks[0].cuda()?.cu_stream();
        // SAFETY: `scratch` holds `world` gathered slots after the first; `all` has room for them;
        // the stream is idle, so the copy is all it waits for.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                all.as_flattened_mut(),
                *scratch + SLOT as DevPtr,
                stream,
            )
        }
        .map_err(|e| driver("cuMemcpyDtoHAsync", e))?;
        self.ranks[0].stream.synchronize()?;
        Ok(all)
    }

    /// Runs `calls`, then checks the group they made and queues it as one NCCL group
    /// (`ncclGroupStart` .. `ncclGroupEnd`): one thread drives every rank without a deadlock.
    /// The buffers are borrowed until the group is queued, on their ranks' streams. Never call
    /// it inside an NCCL group of your own (`cudarc::nccl::result::group_start`): the pool's
    /// group end would then queue nothing, and the buffers would be released before NCCL ran on
    /// them (see the [module](self)).
    ///
    /// Errors: `calls`' own (nothing is queued); `NcclError::Group` for a group whose ranks
    /// disagree (nothing is queued); `Nccl` if NCCL refuses. Inside a [`Stream::capture`] of every
    /// rank's stream the group is captured, each rank's part into its own stream's graph.
    pub fn group<'b, R>(
        &'b self,
        calls: impl FnOnce(&mut Group<'b>) -> Result<R, PoolError>,
    ) -> Result<R, PoolError>
    where
        's: 'b,
    {
        self.refuse_aborted()?;
        let mut group = Group {
            ranks: &self.ranks,
            world: self.world,
            ops: Vec::new(),
        };
        let made = calls(&mut group);
        // Every check of this rank's own comes before the exchange below: a rank that refused
        // after its peers committed would leave them in the collective until the timeout.
        let capture_state = self.check_capture_state();
        let checked = made.and_then(|out| {
            self.check_local(&group)?;
            capture_state.clone()?;
            Ok(out)
        });
        if self.verifies_groups() {
            if let Err(e) = capture_state {
                // A stream captured by someone else's capture cannot carry the exchange (it
                // would be recorded, not run): the peers are waiting for it, so this rank
                // aborts, and they fail or time out instead of hanging.
                self.abort();
                return Err(e);
            }
            // With the other processes' before anything is queued: a rank that refused its
            // part says so to the others, which then refuse theirs, so that none waits for it.
            let digests = self.group_digests(&group, checked.is_err());
            let all = self.exchange(&digests, "a group's check across processes");
            let out = checked?;
            across(&all?)?;
            return self.queue(&group).map(|()| out);
        }
        let out = checked?;
        self.queue(&group).map(|()| out)
    }

    /// Whether eager groups are checked across processes: on request
    /// ([`set_verify_groups`](Self::set_verify_groups)), and always while the stacks are
    /// registered, whatever the setting: NCCL then reaches a peer's buffer through the peer's
    /// registration (at this rank's offset in the peer's window), so a group whose counts or
    /// order differ across the ranks would read and write other live buffers of the peer's stack.
    /// Groups inside [`capture`](Self::capture) are not (a capture cannot wait; registration and
    /// capture exclude each other).
    fn verifies_groups(&self) -> bool {
        self.remote
            .as_ref()
            .is_some_and(|r| r.verify.get() || self.registered.get())
            && !self.capturing.get()
    }

    /// What this process can check of a group: it is this communicators' own, they are in step,
    /// and the ranks it holds agree (see [`Group::check`]).
    fn check_local(&self, group: &Group<'_>) -> Result<(), PoolError> {
        if !std::ptr::eq(
            group.ranks.as_ptr().cast::<()>(),
            self.ranks.as_ptr().cast::<()>(),
        ) {
            // `std::mem::swap` of two groups: these calls were checked for other communicators.
            return Err(PoolError::Nccl(NcclError::Group {
                problem: "the group was swapped with a group of other communicators".into(),
            }));
        }
        if self.out_of_step.get() {
            return Err(PoolError::Nccl(NcclError::Group {
                problem: "a replay of these communicators failed part-way, so their ranks may be \
                          out of step; make new communicators"
                    .into(),
            }));
        }
        group.check(self.windows.borrow().as_deref())
    }

    /// Queues a checked group as one NCCL group; for ranks in other processes, waits (up to the
    /// timeout) until NCCL has queued it, so a capture under way records all of it. For ranks in
    /// other processes any failure here aborts the communicator: part of the group may be queued,
    /// and the peers have queued theirs, so only an abort leaves them a clean failure or timeout
    /// rather than a collective that meets the wrong one.
    fn queue(&self, group: &Group<'_>) -> Result<(), PoolError> {
        let queued = self.queue_once(group);
        if queued.is_err() {
            self.abort(); // nothing for communicators of one process
        }
        queued
    }

    fn queue_once(&self, group: &Group<'_>) -> Result<(), PoolError> {
        let _restore = ContextGuard::keep_current()?;
        result::group_start().map_err(failed("ncclGroupStart"))?;
        let queued = group
            .ops
            .iter()
            .try_for_each(|op| op.queue(&self.ranks[op.local]));
        // Ended whatever happened: an open group would swallow the next NCCL call.
        let ended = result::group_end().map_err(failed("ncclGroupEnd"));
        queued?;
        ended?;
        self.settle("an NCCL group", Instant::now())
    }

    /// Each local rank's slot of `group` for the check across processes: its collectives'
    /// digest, and the sums of its sends' and receives' digests keyed by (sender, receiver), which
    /// add up to the same total over all ranks exactly when every send meets its receive.
    fn group_digests(&self, group: &Group<'_>, refused: bool) -> Vec<[u8; SLOT]> {
        let held: Vec<usize> = self.ranks.iter().map(|r| r.rank).collect();
        let windows = self.windows.borrow();
        digests(&held, self.world, windows.as_deref(), &group.ops, refused)
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
                .map_err(|e| {
                    crate::storage::backend::cuda::driver_error("cuStreamIsCapturing", e)
                })?;
            let driver =
                status != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
            if driver {
                if !(self.capturing.get() && rank.stream.in_own_capture()) {
                    return Err(PoolError::Nccl(NcclError::Group {
                        problem: "a rank's stream is being captured outside \
                                  Communicators::capture (a graph of one rank would replay out of \
                                  step with the others)"
                            .into(),
                    }));
                }
                captured += 1;
            }
        }
        if captured != 0 && captured != self.ranks.len() {
            return Err(PoolError::Nccl(NcclError::Group {
                problem: "some ranks' streams are captured and some are not".into(),
            }));
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
    /// use gpu_pool::nccl::{Communicators, Reduce};
    /// use gpu_pool::{compat::opencv::BufferPool, Device, GpuWrite, PoolError, Stream};
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
        self.refuse_aborted()?;
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
    /// With ranks in other processes it is a collective: every rank calls it at the same point
    /// with the same `as_window`. Before NCCL sees anything, the ranks all-gather whether they
    /// register and how (a rank's own refusal is sent too) and their stack memory's size, and
    /// refuse on every rank alike if they disagree. While registered, every eager group is
    /// checked across processes (see [`set_verify_groups`](Self::set_verify_groups)).
    ///
    /// Errors: `Unsupported` for an NCCL too old, a second registration while one lives, a
    /// growable stack, or a window over memory not from [`use_nccl_memory`]; `InvalidConfig` for
    /// a window over stack memory that differs in size between ranks (in this process or
    /// across), or ranks that disagree on `as_window`; `NcclGroup` on every rank where one rank
    /// refused its part; `NcclTimeout` where a rank never called it; `Nccl` if NCCL refuses
    /// (nothing stays registered).
    ///
    /// ```no_run
    /// use gpu_pool::nccl::{Communicators, use_nccl_memory};
    /// use gpu_pool::{Device, PoolError, compat::opencv::set_buffer_pool_config, Stream};
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
        self.refuse_aborted()?;
        let mut registered = None;
        // This rank's own checks, then its stacks pinned: whatever fails, the peers hear of it
        // below before any registration, as a refusal.
        let local = self.may_register(as_window).and_then(|()| {
            let registered = registered.insert(Registered {
                comms: self,
                handles: Vec::with_capacity(self.ranks.len()),
                as_window,
            });
            let mut ranges = Vec::with_capacity(self.ranks.len());
            for rank in &self.ranks {
                let pin = rank.stream.device().pin_stacks()?;
                ranges.push(pin.range());
                registered.handles.push((pin, std::ptr::null_mut()));
            }
            Ok(ranges)
        });
        let ranges = if self.remote.is_some() && !self.capturing.get() {
            // Ranks in other processes: every rank's size before NCCL sees any registration, so
            // that a window of another size (whose symmetric kernels would reach past a peer's
            // memory) is refused on every rank alike.
            let mine: Vec<[u8; SLOT]> = match &local {
                Ok(ranges) => ranges
                    .iter()
                    .map(|r| slot([TAG_REGISTER, u64::from(as_window), r.1 as u64, 0]))
                    .collect(),
                Err(_) => self
                    .ranks
                    .iter()
                    .map(|r| slot([TAG_REFUSED, r.rank as u64, 0, 0]))
                    .collect(),
            };
            let all = self.exchange(&mine, "register_stacks' check across processes");
            let ranges = local?;
            registrations_agree(&all?.iter().map(words).collect::<Vec<_>>())?;
            ranges
        } else {
            local?
        };
        let Some(mut registered) = registered else {
            unreachable!("the stacks were pinned into a Registered");
        };
        if as_window && ranges.iter().any(|r| r.1 != ranges[0].1) {
            return Err(PoolError::InvalidConfig {
                reason: "a symmetric window needs the same stack memory size on every rank: \
                         give every device the same set_buffer_pool_config"
                    .into(),
            });
        }
        let _restore = ContextGuard::keep_current()?;
        let register = |handles: &mut Vec<(StackPin, *mut c_void)>| -> Result<(), PoolError> {
            for ((rank, (base, bytes)), handle) in self.ranks.iter().zip(&ranges).zip(handles) {
                let ptr = *base as *mut c_void;
                // SAFETY: `ptr..ptr + bytes` is the device's stack memory, pinned above: it stays
                // allocated until the handle is deregistered (`Registered::drop`). `handle.1`
                // receives the handle.
                let status = unsafe {
                    if as_window {
                        sys::ncclCommWindowRegister(
                            rank.comm,
                            ptr,
                            *bytes,
                            (&raw mut handle.1).cast(),
                            NCCL_WIN_COLL_SYMMETRIC,
                        )
                    } else {
                        sys::ncclCommRegister(rank.comm, ptr, *bytes, &raw mut handle.1)
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
        // Ranks in other processes: a window's registration meets theirs (up to the timeout).
        self.settle(
            if as_window {
                "ncclCommWindowRegister"
            } else {
                "ncclCommRegister"
            },
            Instant::now(),
        )?;
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

    /// What this rank checks before registering its stacks (see
    /// [`register_stacks`](Self::register_stacks)).
    fn may_register(&self, as_window: bool) -> Result<(), PoolError> {
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
                .find(|r| !r.stream.device().stack_source_is_external())
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
        Ok(())
    }
}

impl Drop for Communicators<'_> {
    fn drop(&mut self) {
        // NCCL switches devices as it tears down; the caller's context stays current.
        let _restore = ContextGuard::keep_current().ok();
        if let Some(remote) = &self.remote {
            self.drop_remote(remote);
            return;
        }
        for rank in &self.ranks {
            // Work NCCL queued must finish before its communicator goes.
            if let Err(e) = rank.stream.synchronize() {
                crate::base::event::error!(error = %e, "waiting for NCCL work before destroying its communicator failed");
            }
        }
        for rank in &self.ranks {
            // SAFETY: our communicator, its work done, destroyed once.
            if let Err(e) = unsafe { result::comm_destroy(rank.comm) } {
                crate::base::event::error!(error = %failed("ncclCommDestroy")(e), "destroying an NCCL communicator failed");
            }
        }
    }
}

impl Communicators<'_> {
    /// Tears down communicators with ranks in other processes without waiting past the timeout:
    /// their work, then `ncclCommFinalize` (which flushes what NCCL still sends), then
    /// `ncclCommDestroy`; an abort instead where any of it fails or times out. The scratch memory
    /// goes last, once no kernel can touch it.
    fn drop_remote(&self, remote: &Remote) {
        let finished = self
            .refuse_aborted()
            .and_then(|()| self.wait_streams("dropping Communicators", Instant::now()));
        if let Err(e) = finished {
            crate::base::event::error!(error = %e, "NCCL work of communicators being dropped did not finish; aborted");
        }
        if !remote.aborted.get() {
            let finalized = self.ranks.iter().try_for_each(|rank| {
                // SAFETY: our communicator, its work done, finalized once.
                unsafe { result::comm_finalize(rank.comm) }
                    .map(drop)
                    .map_err(failed("ncclCommFinalize"))
            });
            match finalized.and_then(|()| self.settle("ncclCommFinalize", Instant::now())) {
                Ok(()) => {
                    remote.aborted.set(true); // gone from here on, as after an abort
                    for rank in &self.ranks {
                        // SAFETY: our communicator, finalized above, destroyed once.
                        if let Err(e) = unsafe { result::comm_destroy(rank.comm) } {
                            crate::base::event::error!(error = %failed("ncclCommDestroy")(e), "destroying an NCCL communicator failed");
                        }
                    }
                }
                Err(e) => {
                    crate::base::event::error!(error = %e, "finalizing NCCL communicators failed; aborting them");
                    self.abort();
                }
            }
        }
        for ((ctx, scratch), rank) in remote.scratch.iter().zip(&self.ranks) {
            // The abort ended NCCL's kernels; what is left on the stream is ordinary work.
            let _ = rank.stream.synchronize();
            let Ok(_bound) = ContextGuard::bind(ctx) else {
                continue;
            };
            // SAFETY: our allocation; every kernel that used it is done (above), freed once.
            if let Err(e) = unsafe { cudarc::driver::result::free_sync(*scratch) } {
                crate::base::event::error!(error = %crate::storage::backend::cuda::driver_error("cuMemFree", e), "freeing NCCL check memory failed");
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
    /// Each rank's pinned stack memory (unpinned when dropped, after the deregistration in
    /// `drop`) and NCCL's handle (null: not registered).
    handles: Vec<(StackPin, *mut c_void)>,
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
        // NCCL may still read the memory for queued work (a wait that gives up at the timeout
        // for ranks in other processes: it aborts them, which ends that work).
        let start = Instant::now();
        let _ = self.comms.wait_streams("dropping Registered", start);
        if self.comms.refuse_aborted().is_err() {
            // Aborted: NCCL dropped its registrations with the communicators (the pins go with
            // `handles`).
            return;
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
                crate::base::event::error!(error = %failed("ncclCommDeregister")(e), "deregistering stack memory failed");
            }
        }
        if any && self.as_window {
            let _ = result::group_end();
        }
        if let Err(e) = self.comms.settle("ncclCommDeregister", start) {
            crate::base::event::error!(error = %e, "deregistering stack memory did not finish; aborted");
        }
        // The pins in `handles` go after this: the memory stays until deregistered.
    }
}

/// The NCCL calls of one group, checked as a whole before any is queued
/// ([`Communicators::group`]). `'b` is how long the buffers stay borrowed: past the group's end.
///
/// Each call names its rank and takes that rank's buffers: a `buffer!`, a `GpuMat`, a view or a
/// [`SharedMat`](crate::shared::SharedMat) access of the rank's own stream (`PoolError::Unsupported`
/// for memory of another stream, `NotContinuous` for a region narrower than its buffer).
pub struct Group<'b> {
    /// The ranks this process holds.
    ranks: &'b [Rank<'b>],
    world: usize,
    ops: Vec<Op>,
}

impl std::fmt::Debug for Group<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("world", &self.world)
            .field("calls", &self.ops.len())
            .finish()
    }
}

/// One call of a group: on which rank, what, and the memory it names (alive for the group's
/// `'b`).
struct Op {
    /// The rank in the world.
    rank: usize,
    /// Its place among the ranks this process holds.
    local: usize,
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

    /// The kind and its parameter as words, for a digest.
    fn words(self) -> (u64, u64) {
        match self {
            Kind::AllReduce(op) => (1, op as u64),
            Kind::AllGather => (2, 0),
            Kind::Broadcast { root } => (3, root as u64),
            Kind::Send { peer } => (4, peer as u64),
            Kind::Recv { peer } => (5, peer as u64),
        }
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
    /// Where `rank` is among the ranks this process holds, if it holds it and `stream` is its.
    fn rank_of(
        &self,
        rank: usize,
        stream: Option<&Stream>,
        device: crate::base::id::DeviceId,
    ) -> Result<usize, PoolError> {
        let Some(local) = self.ranks.iter().position(|r| r.rank == rank) else {
            return Err(PoolError::Nccl(NcclError::Group {
                problem: if rank < self.world {
                    format!(
                        "rank {rank} named, which another process holds: each process names only \
                         its own ranks ({:?})",
                        self.ranks.iter().map(|r| r.rank).collect::<Vec<_>>()
                    )
                } else {
                    format!("rank {rank} named, the communicator has {}", self.world)
                },
            }));
        };
        let r = &self.ranks[local];
        if stream.map(Stream::id) != Some(r.stream.id()) {
            return Err(PoolError::Unsupported {
                device,
                what: "an NCCL call on memory of another stream than its rank's (take the \
                       rank's buffers from its own stream)",
            });
        }
        Ok(local)
    }

    /// The address and elements of `view`, memory that `rank` may hand NCCL to read.
    fn lend<T: Pod>(
        &self,
        rank: usize,
        view: &GpuView<'_, T>,
    ) -> Result<(u64, usize, usize), PoolError> {
        let local = self.rank_of(rank, view.stream(), view.device)?;
        continuous(view.is_continuous(), view.rows(), view.cols(), view.step())?;
        let lent = view.as_cudarc()?;
        // The memory's own stream: no event, and a capture of someone else's is refused as for
        // any lent buffer.
        let (ptr, _same_stream) = lent.device_ptr(lent.stream());
        Ok((ptr, lent.len(), local))
    }

    /// The address and elements of `view`, memory that `rank` may hand NCCL to write: lent through
    /// the writable view, so only memory the caller may write is written.
    fn lend_mut<T: Pod>(
        &self,
        rank: usize,
        mut view: GpuViewMut<'_, T>,
    ) -> Result<(u64, usize, usize), PoolError> {
        let local = self.rank_of(rank, view.stream(), view.device)?;
        continuous(view.is_continuous(), view.rows(), view.cols(), view.step())?;
        let mut lent = view.as_cudarc_mut()?;
        let len = lent.len();
        let stream = lent.stream().clone();
        let (ptr, _same_stream) = lent.device_ptr_mut(&stream);
        Ok((ptr, len, local))
    }

    fn push<T: NcclElement>(
        &mut self,
        (rank, local): (usize, usize),
        kind: Kind,
        count: usize,
        send: u64,
        recv: u64,
    ) {
        self.ops.push(Op {
            rank,
            local,
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
        let (src, n, local) = self.lend(rank, &send.view())?;
        let (dst, m, _) = self.lend_mut(rank, recv.view_mut())?;
        if n != m {
            return Err(PoolError::ShapeMismatch {
                expected: m,
                actual: n,
            });
        }
        self.push::<T>((rank, local), Kind::AllReduce(op.raw()), n, src, dst);
        Ok(())
    }

    /// `buffer` on `rank` becomes the reduction of every rank's `buffer` (in place).
    pub fn all_reduce_in_place<T: NcclElement>(
        &mut self,
        rank: usize,
        buffer: &'b mut impl GpuWrite<T>,
        op: Reduce,
    ) -> Result<(), PoolError> {
        let (ptr, n, local) = self.lend_mut(rank, buffer.view_mut())?;
        self.push::<T>((rank, local), Kind::AllReduce(op.raw()), n, ptr, ptr);
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
        let (src, n, local) = self.lend(rank, &send.view())?;
        let (dst, m, _) = self.lend_mut(rank, recv.view_mut())?;
        let whole = n.checked_mul(self.world);
        if whole != Some(m) {
            return Err(PoolError::ShapeMismatch {
                expected: m,
                actual: whole.unwrap_or(usize::MAX),
            });
        }
        self.push::<T>((rank, local), Kind::AllGather, n, src, dst);
        Ok(())
    }

    /// `buffer` on every rank becomes `root`'s `buffer` (`ncclBroadcast`, in place).
    pub fn broadcast<T: NcclElement>(
        &mut self,
        rank: usize,
        buffer: &'b mut impl GpuWrite<T>,
        root: usize,
    ) -> Result<(), PoolError> {
        let (ptr, n, local) = self.lend_mut(rank, buffer.view_mut())?;
        self.push::<T>((rank, local), Kind::Broadcast { root }, n, ptr, ptr);
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
        let (ptr, n, local) = self.lend(rank, &buffer.view())?;
        self.push::<T>((rank, local), Kind::Send { peer }, n, ptr, 0);
        Ok(())
    }

    /// Receives into `buffer` on `rank` what `peer` sends in the same group (`ncclRecv`).
    pub fn recv<T: NcclElement>(
        &mut self,
        rank: usize,
        buffer: &'b mut impl GpuWrite<T>,
        peer: usize,
    ) -> Result<(), PoolError> {
        let (ptr, n, local) = self.lend_mut(rank, buffer.view_mut())?;
        self.push::<T>((rank, local), Kind::Recv { peer }, n, 0, ptr);
        Ok(())
    }

    /// Whether the group can be queued as it is, as far as this process sees it: ranks and
    /// peers exist, every rank it holds makes the same collectives in the same order (kind,
    /// count, type, reduction, root and, while the stacks are a symmetric window, the window
    /// offsets of its buffers), and the sends from each of its ranks to each other of its ranks
    /// meet that rank's receives, in order, of the same count and type. Ranks in other processes
    /// are not seen here (see [`Communicators::set_verify_groups`]).
    fn check(&self, windows: Option<&[(DevPtr, usize)]>) -> Result<(), PoolError> {
        let world = self.world;
        // Where `ptr` lies in a rank's symmetric window: NCCL's symmetric kernels reach a peer's
        // buffer at the same offset in the peer's window, so the offsets must agree.
        let offset = |local: usize, ptr: u64| {
            windows.and_then(|w| {
                let (base, bytes) = w[local];
                (ptr >= base && ptr < base + bytes as DevPtr).then(|| ptr - base)
            })
        };
        let mismatch = |problem: String| Err(PoolError::Nccl(NcclError::Group { problem }));
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
        let collectives = |local: usize| {
            self.ops
                .iter()
                .filter(move |o| o.local == local && o.kind.is_collective())
                .map(move |o| {
                    let at = windows.map(|_| (offset(local, o.send), offset(local, o.recv)));
                    (o.kind, o.count, o.dtype as u32, at)
                })
        };
        let first: Vec<_> = collectives(0).collect();
        for (local, held) in self.ranks.iter().enumerate().skip(1) {
            let theirs: Vec<_> = collectives(local).collect();
            if theirs != first {
                return mismatch(format!(
                    "rank {} makes {} collective(s), rank {} {}, and they differ in kind, \
                     count, type or window offset: {theirs:?} against {first:?}",
                    held.rank,
                    theirs.len(),
                    self.ranks[0].rank,
                    first.len()
                ));
            }
        }
        for from in self.ranks.iter().map(|r| r.rank) {
            for to in self.ranks.iter().map(|r| r.rank) {
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

/// The slots of [`Communicators::group_digests`], of the ranks `held` (world ranks, in local
/// order) with `windows` (per local rank, while registered as one) for `ops`.
fn digests(
    held: &[usize],
    world: usize,
    windows: Option<&[(DevPtr, usize)]>,
    ops: &[Op],
    refused: bool,
) -> Vec<[u8; SLOT]> {
    let offset = |local: usize, ptr: u64| {
        windows.map_or(u64::MAX - 1, |w| {
            let (base, bytes) = w[local];
            if ptr >= base && ptr < base + bytes as DevPtr {
                ptr - base
            } else {
                u64::MAX
            }
        })
    };
    let pair = |from: usize, to: usize, ops: &mut dyn Iterator<Item = &Op>| {
        let mut any = false;
        let h = fnv([from as u64, to as u64]
            .into_iter()
            .chain(ops.flat_map(|o| {
                any = true;
                [o.count as u64, o.dtype as u64]
            })));
        if any { h } else { 0 }
    };
    let mut out = Vec::with_capacity(held.len());
    for (local, &rank) in held.iter().enumerate() {
        if refused {
            out.push(slot([TAG_REFUSED, rank as u64, 0, 0]));
            continue;
        }
        let mine = || ops.iter().filter(move |o| o.local == local);
        let collectives = fnv(mine().filter(|o| o.kind.is_collective()).flat_map(|o| {
            let (kind, param) = o.kind.words();
            [
                kind,
                param,
                o.count as u64,
                o.dtype as u64,
                offset(local, o.send),
                offset(local, o.recv),
            ]
        }));
        let (mut sends, mut recvs) = (0u64, 0u64);
        for peer in 0..world {
            let mut to = mine().filter(|o| o.kind == Kind::Send { peer });
            sends = sends.wrapping_add(pair(rank, peer, &mut to));
            let mut from = mine().filter(|o| o.kind == Kind::Recv { peer });
            recvs = recvs.wrapping_add(pair(peer, rank, &mut from));
        }
        out.push(slot([TAG_GROUP, collectives, sends, recvs]));
    }
    out
}

/// Whether every rank's slot of a group's check across processes agrees (see
/// [`Communicators::set_verify_groups`]).
fn across(all: &[[u8; SLOT]]) -> Result<(), PoolError> {
    let slots: Vec<[u64; 4]> = all.iter().map(words).collect();
    let refuse = |problem: String| Err(PoolError::Nccl(NcclError::Group { problem }));
    if let Some(r) = slots.iter().position(|w| w[0] == TAG_REFUSED) {
        return refuse(format!(
            "rank {r} refused its part of this group (its own error says why), so no rank \
             queued it"
        ));
    }
    if let Some(r) = slots.iter().position(|w| w[0] != TAG_GROUP) {
        return refuse(format!(
            "rank {r} made another check at this point (check_symmetric, register_stacks, or a \
             group without set_verify_groups(true) or a registration): every rank must make the \
             same calls"
        ));
    }
    if let Some(r) = slots.iter().position(|w| w[1] != slots[0][1]) {
        return refuse(format!(
            "rank {r}'s collectives differ from rank 0's (in number, kind, count, type, \
             reduction, root or window offset)"
        ));
    }
    let total = |i: usize| slots.iter().fold(0u64, |t, w| t.wrapping_add(w[i]));
    if total(2) != total(3) {
        return refuse(
            "the sends and receives across ranks do not meet (a send without its receive, or one \
             of another count or type)"
                .into(),
        );
    }
    Ok(())
}

/// Whether every rank's slot of [`Communicators::register_stacks`]' check across processes
/// (`[TAG_REGISTER, as window, stack bytes, 0]`) agrees: all register, all alike, and a window of
/// the same size everywhere (NCCL's symmetric kernels reach a peer's buffer at this rank's offset
/// in the peer's window: a smaller window on the peer would be overrun). Buffers may differ in
/// size (NCCL exchanges their addresses).
fn registrations_agree(slots: &[[u64; 4]]) -> Result<(), PoolError> {
    if let Some(r) = slots.iter().position(|w| w[0] == TAG_REFUSED) {
        return Err(PoolError::Nccl(NcclError::Group {
            problem: format!(
                "rank {r} refused to register its stacks (its own error says why), so no rank \
                 registered"
            ),
        }));
    }
    if let Some(r) = slots.iter().position(|w| w[0] != TAG_REGISTER) {
        return Err(PoolError::Nccl(NcclError::Group {
            problem: format!(
                "rank {r} made another call at this point (every rank must call register_stacks \
                 together)"
            ),
        }));
    }
    let Some(first) = slots.first() else {
        return Ok(());
    };
    if let Some(r) = slots.iter().position(|w| w[1] != first[1]) {
        return Err(PoolError::InvalidConfig {
            reason: format!(
                "rank {r} registers its stacks as {}, rank 0 as {}: every rank must call \
                 register_stacks with the same as_window",
                if slots[r][1] == 1 {
                    "a window"
                } else {
                    "buffers"
                },
                if first[1] == 1 { "a window" } else { "buffers" },
            ),
        });
    }
    if first[1] == 1
        && let Some(r) = slots.iter().position(|w| w[2] != first[2])
    {
        return Err(PoolError::InvalidConfig {
            reason: format!(
                "a symmetric window needs the same stack memory size on every rank, and rank {r} \
                 has {} bytes against rank 0's {}: give every rank's device the same \
                 set_buffer_pool_config",
                slots[r][2], first[2]
            ),
        });
    }
    Ok(())
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
/// use gpu_pool::{Device, nccl, PoolError};
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
    device.set_stack_source(Some(Arc::new(NcclMemory { ctx: ctx.clone() })))?;
    // Only the fixed stacks' arena comes from NCCL: streams made from now on take those.
    device.set_growable_stacks(false)
}

/// Makes `device`'s stacks come from the driver (`cuMemAlloc`) again, as before
/// [`use_nccl_memory`]. Stack memory from NCCL is freed first if no stream holds a stack
/// (`ConfigInUse` otherwise; `StackMemoryRegistered` while registered).
///
/// ```no_run
/// use gpu_pool::{Device, nccl, PoolError};
/// let gpu = Device::cuda(0)?;
/// nccl::use_nccl_memory(&gpu)?;
/// nccl::use_driver_memory(&gpu)?;
/// # Ok::<(), PoolError>(())
/// ```
pub fn use_driver_memory(device: &Device) -> Result<(), PoolError> {
    device.set_stack_source(None)
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
    /// Errors: `NcclError::Group` if an earlier replay failed part-way (the ranks may be out
    /// of step; the communicators refuse every group from then on); the driver's error if this
    /// one fails, which marks them so.
    pub fn launch(&self) -> Result<(), PoolError> {
        // An aborted communicator's kernels would replay on freed state.
        self.comms.refuse_aborted()?;
        if self.comms.out_of_step.get() {
            return Err(PoolError::Nccl(NcclError::Group {
                problem: "a replay of these communicators failed part-way, so their ranks may be \
                          out of step; make new communicators"
                    .into(),
            }));
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

/// The checks across processes, on the host: what each rank would send, and what every rank
/// concludes from all of them (the NCCL all-gather between is the GPU suite's).
#[cfg(test)]
mod tests {
    use super::*;

    fn op(rank: usize, kind: Kind, count: usize, at: u64) -> Op {
        Op {
            rank,
            local: 0,
            kind,
            count,
            dtype: sys::ncclDataType_t::ncclFloat32,
            send: at,
            recv: at,
        }
    }

    const SUM: Kind = Kind::AllReduce(sys::ncclRedOp_t::ncclSum);

    /// Every rank's slot when each of `world` processes holds one rank and makes `ops(rank)`,
    /// with `windows(rank)` while registered as a window.
    fn gathered(
        world: usize,
        ops: impl Fn(usize) -> Vec<Op>,
        windows: impl Fn(usize) -> Option<Vec<(DevPtr, usize)>>,
    ) -> Vec<[u8; SLOT]> {
        (0..world)
            .flat_map(|r| digests(&[r], world, windows(r).as_deref(), &ops(r), false))
            .collect()
    }

    #[test]
    fn slots_carry_their_words_and_the_digest_sees_every_word_and_its_order() {
        let w = [TAG_GROUP, 1, u64::MAX, 0x0123_4567_89ab_cdef];
        assert_eq!(words(&slot(w)), w);
        assert_eq!(slot(w)[..8], TAG_GROUP.to_le_bytes());
        assert_ne!(fnv([1, 2]), fnv([2, 1]));
        assert_ne!(fnv([1]), fnv([1, 0]));
        assert_eq!(fnv([5, 6]), fnv([5, 6]));
    }

    #[test]
    fn the_nonblocking_config_is_nccls_initializer_with_blocking_off() {
        let c = nonblocking_config();
        assert_eq!(c.size, std::mem::size_of::<sys::ncclConfig_t>());
        assert_eq!(c.magic, 0xcafe_beef);
        assert_eq!(c.blocking, 0);
        assert_eq!(c.version, 22800, "the header the bindings were made from");
        assert_eq!(c.cgaClusterSize, i32::MIN);
        assert!(c.netName.is_null() && c.commName.is_null());
    }

    #[test]
    fn ranks_that_make_the_same_group_agree_and_any_difference_is_refused_on_every_rank() {
        let same = gathered(2, |r| vec![op(r, SUM, 1000, 0x10)], |_| None);
        assert_eq!(across(&same), Ok(()));
        let counts = gathered(2, |r| vec![op(r, SUM, 1000 - r, 0x10)], |_| None);
        let e = across(&counts).expect_err("counts 1000 and 999");
        assert!(e.to_string().contains("rank 1's collectives differ"), "{e}");
        let order = gathered(
            2,
            |r| {
                let (a, b) = (op(r, SUM, 10, 0x10), op(r, Kind::AllGather, 5, 0x10));
                if r == 0 { vec![a, b] } else { vec![b, a] }
            },
            |_| None,
        );
        assert!(across(&order).is_err(), "the same calls in another order");
        let mut refused = gathered(2, |r| vec![op(r, SUM, 10, 0x10)], |_| None);
        refused[1] = digests(&[1], 2, None, &[], true)[0];
        let e = across(&refused).expect_err("rank 1 refused");
        assert!(e.to_string().contains("rank 1 refused"), "{e}");
        let mut other = same.clone();
        other[0] = slot([TAG_LAYOUT, 0, 0, 0]);
        assert!(across(&other).is_err(), "a check_symmetric against a group");
    }

    #[test]
    fn while_registered_as_a_window_the_window_offsets_count_too() {
        let window = |r: usize| Some(vec![(0x1000 * (r as u64 + 1), 0x1000)]);
        // Each rank's buffer at offset 0x40 of its own window: agreed.
        let same = gathered(
            2,
            |r| vec![op(r, SUM, 8, 0x1000 * (r as u64 + 1) + 0x40)],
            window,
        );
        assert_eq!(across(&same), Ok(()));
        // Rank 1's temporary sits 0x80 into its window: its peer would be reached at 0x40.
        let moved = gathered(
            2,
            |r| {
                vec![op(
                    r,
                    SUM,
                    8,
                    0x1000 * (r as u64 + 1) + 0x40 * (r as u64 + 1),
                )]
            },
            window,
        );
        assert!(across(&moved).is_err(), "offsets 0x40 and 0x80");
    }

    #[test]
    fn sends_meet_receives_across_processes_only_with_the_same_count_and_type() {
        let pair = |count1: usize| {
            move |r: usize| {
                if r == 0 {
                    vec![op(0, Kind::Send { peer: 1 }, 64, 0x10)]
                } else {
                    vec![op(1, Kind::Recv { peer: 0 }, count1, 0x10)]
                }
            }
        };
        assert_eq!(across(&gathered(2, pair(64), |_| None)), Ok(()));
        let e = across(&gathered(2, pair(63), |_| None)).expect_err("64 sent, 63 received");
        assert!(e.to_string().contains("do not meet"), "{e}");
        // A send to rank 1 with no receive there at all.
        let lone = gathered(
            2,
            |r| {
                if r == 0 {
                    vec![op(0, Kind::Send { peer: 1 }, 64, 0x10)]
                } else {
                    vec![]
                }
            },
            |_| None,
        );
        assert!(across(&lone).is_err());
    }

    fn registering(as_window: bool, bytes: &[u64]) -> Vec<[u64; 4]> {
        bytes
            .iter()
            .map(|&b| [TAG_REGISTER, u64::from(as_window), b, 0])
            .collect()
    }

    #[test]
    fn a_window_of_another_size_on_any_rank_is_refused_before_nccl_registers_it() {
        assert_eq!(
            registrations_agree(&registering(true, &[64, 64, 64])),
            Ok(())
        );
        let e = registrations_agree(&registering(true, &[64, 64, 32])).expect_err("sizes");
        assert!(
            matches!(&e, PoolError::InvalidConfig { reason } if reason.contains("rank 2 has 32 bytes against rank 0's 64")),
            "{e}"
        );
        // Buffers may differ in size: NCCL exchanges their addresses.
        assert_eq!(registrations_agree(&registering(false, &[64, 32])), Ok(()));
        let mut mixed = registering(true, &[64, 64]);
        mixed[1][1] = 0;
        assert!(matches!(
            registrations_agree(&mixed),
            Err(PoolError::InvalidConfig { .. })
        ));
        let mut refused = registering(true, &[64, 64]);
        refused[1] = [TAG_REFUSED, 1, 0, 0];
        let e = registrations_agree(&refused).expect_err("rank 1 refused");
        assert!(matches!(e, PoolError::Nccl(NcclError::Group { .. })), "{e}");
        let mut other = registering(true, &[64, 64]);
        other[0][0] = TAG_GROUP;
        assert!(registrations_agree(&other).is_err());
    }
}
