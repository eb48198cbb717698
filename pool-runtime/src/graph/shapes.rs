//! Graphs by shape: a `#[pooled(stream, graph)]` function captures itself the first time a call's
//! key is seen and replays that graph on every later call with the same key (PyTorch's
//! `reduce-overhead`).
//!
//! The key is everything a replay depends on ([`GraphKey`]): each parameter's words (a buffer's
//! address and shape, a scalar's value, a model's fields) and the stream's stack top at the call.
//! The capture packs its buffers from that top and reserves nothing: between calls the scratch is
//! free stack, so every recorded shape shares the same memory (the largest shape's, not the sum),
//! and a replay finds it again because its key says the top is where it was.
//!
//! Outputs are stack temporaries the function returns ([`Outputs`]): taken first, they are live
//! when the capture ends and are taken again, at the same addresses, before each replay. They are
//! the caller's own, so no later replay writes an output that is still live: a call made while it
//! lives finds the top above it, which is another key.
//!
//! What cannot be captured runs eagerly, never wrongly: a call whose capture fails (a host wait, a
//! pageable copy, a driver allocation, work on another stream, the host backend) runs the body
//! again without capture, its key is remembered as eager, and the reason is counted
//! ([`shape_stats`]) and logged once.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use crate::base::error::PoolError;
use crate::core::buffer::Temp;
use crate::core::stream::Stream;

pub use crate::core::graph_key::{GraphKey, GraphKeys};

/// What a graphed function returns: `()`, a [`Temp`] (taken first in the body, with
/// `stream.temp(..)`), or a tuple of them. A replay runs no host code, so it hands back exactly
/// these: the same temporaries, taken again at the addresses the capture wrote.
#[diagnostic::on_unimplemented(
    message = "a graphed function cannot return `{Self}`",
    label = "a replay runs no host code, so it cannot make this value",
    note = "return `()`, a `Temp` taken first in the body (`stream.temp(..)`), or a tuple of them; \
            read host values before the call or after it"
)]
pub trait Outputs<'s>: Sized {
    /// Writes each output's layout into `into`.
    #[doc(hidden)]
    fn layouts(&self, into: &mut Vec<OutputLayout>);
    /// Takes the outputs again from `stream`, in the order of `layouts`, from `at` on; `None`
    /// (nothing left taken) where one lands elsewhere than its layout says.
    #[doc(hidden)]
    fn retake(
        stream: &'s Stream,
        layouts: &[OutputLayout],
        at: &mut usize,
    ) -> Result<Option<Self>, PoolError>;
}

/// Where and how an output was taken.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutputLayout {
    ptr: u64,
    rows: usize,
    cols: usize,
    step: usize,
}

impl<'s> Outputs<'s> for () {
    fn layouts(&self, _: &mut Vec<OutputLayout>) {}
    fn retake(_: &'s Stream, _: &[OutputLayout], _: &mut usize) -> Result<Option<()>, PoolError> {
        Ok(Some(()))
    }
}

impl<'s, T: bytemuck::Pod> Outputs<'s> for Temp<'s, T> {
    fn layouts(&self, into: &mut Vec<OutputLayout>) {
        use crate::core::access::GpuRead;
        into.push(OutputLayout {
            ptr: self.device_ptr(),
            rows: self.rows(),
            cols: self.cols(),
            step: self.step(),
        });
    }

    fn retake(
        stream: &'s Stream,
        layouts: &[OutputLayout],
        at: &mut usize,
    ) -> Result<Option<Self>, PoolError> {
        use crate::core::access::GpuRead;
        let layout = layouts[*at];
        *at += 1;
        let site = crate::base::source::CallSite::here("graphed output");
        let temp = if layout.step == layout.cols * size_of::<T>() {
            stream.temp_packed_at::<T>(layout.rows, layout.cols, site)?
        } else {
            stream.temp_at::<T>(layout.rows, layout.cols, site)?
        };
        Ok((temp.device_ptr() == layout.ptr && temp.step() == layout.step).then_some(temp))
    }
}

macro_rules! outputs_tuple {
    ($($name:ident),+) => {
        impl<'s, $($name: Outputs<'s>),+> Outputs<'s> for ($($name,)+) {
            #[allow(non_snake_case)]
            fn layouts(&self, into: &mut Vec<OutputLayout>) {
                let ($($name,)+) = self;
                $($name.layouts(into);)+
            }
            fn retake(
                stream: &'s Stream,
                layouts: &[OutputLayout],
                at: &mut usize,
            ) -> Result<Option<Self>, PoolError> {
                // Those taken before one that moved are dropped on the way out, in reverse order.
                Ok(Some(($(match $name::retake(stream, layouts, at)? {
                    Some(taken) => taken,
                    None => return Ok(None),
                },)+)))
            }
        }
    };
}
outputs_tuple!(A);
outputs_tuple!(A, B);
outputs_tuple!(A, B, C);
outputs_tuple!(A, B, C, D);

/// A graphed function: its name and how many graphs it keeps per stream. One `static` per
/// function, made by `#[pooled(stream, graph)]`.
#[doc(hidden)]
#[derive(Debug)]
pub struct GraphSite {
    name: &'static str,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    cap: usize,
}

impl GraphSite {
    /// The site of the function `name`, keeping at most `cap` graphs per stream.
    #[must_use]
    pub const fn new(name: &'static str, cap: usize) -> GraphSite {
        GraphSite { name, cap }
    }

    fn id(&'static self) -> u64 {
        std::ptr::from_ref(self) as u64
    }
}

/// Calls that ran eagerly for one reason ([`ShapeStats::eager`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct EagerCalls {
    /// The graphed function.
    pub function: &'static str,
    /// Why its calls could not be captured.
    pub reason: String,
    /// How many calls ran eagerly for it.
    pub calls: u64,
}

/// What graphs by shape did on a stream ([`shape_stats`]), or in the process
/// ([`ShapeStats::process`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShapeStats {
    /// Calls captured into a new graph.
    pub captures: u64,
    /// Calls replayed from a graph.
    pub replays: u64,
    /// Calls run eagerly: inside another capture, or for a reason in `eager`.
    pub eager_calls: u64,
    /// Graphs dropped to stay under a function's cap.
    pub evictions: u64,
    /// Graphs held now.
    pub graphs: usize,
    /// Stack bytes the largest held graph's replays use above its call's top (outputs
    /// included): what all of them need, since they share it.
    pub scratch_largest: usize,
    /// Those bytes summed over the held graphs: what separate graphs would reserve.
    pub scratch_sum: usize,
    /// Why calls ran eagerly, by function.
    pub eager: Vec<EagerCalls>,
}

impl ShapeStats {
    /// Counts over every stream of the process since it started (`graphs` and the scratch sizes
    /// are not kept process-wide: 0).
    #[must_use]
    pub fn process() -> ShapeStats {
        ShapeStats {
            captures: PROCESS.captures.load(Relaxed),
            replays: PROCESS.replays.load(Relaxed),
            eager_calls: PROCESS.eager_calls.load(Relaxed),
            evictions: PROCESS.evictions.load(Relaxed),
            eager: crate::base::sync::lock(&PROCESS.reasons)
                .iter()
                .map(|r| r.counted(r.calls.load(Relaxed)))
                .filter(|e| e.calls > 0)
                .collect(),
            ..ShapeStats::default()
        }
    }
}

impl std::fmt::Display for ShapeStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "graphs by shape: {} captured, {} replayed, {} eager, {} evicted",
            self.captures, self.replays, self.eager_calls, self.evictions
        )?;
        for e in &self.eager {
            write!(
                f,
                "\n    {} ran eagerly {}x: {}",
                e.function, e.calls, e.reason
            )?;
        }
        Ok(())
    }
}

struct Process {
    captures: AtomicU64,
    replays: AtomicU64,
    eager_calls: AtomicU64,
    evictions: AtomicU64,
    /// Every function's reasons, each registered once (the first call it sends eagerly) and
    /// counted with no lock after.
    reasons: Mutex<Vec<Arc<Reason>>>,
}

static PROCESS: Process = Process {
    captures: AtomicU64::new(0),
    replays: AtomicU64::new(0),
    eager_calls: AtomicU64::new(0),
    evictions: AtomicU64::new(0),
    reasons: Mutex::new(Vec::new()),
};

/// What a reason is, for counting: one row per function and kind, whatever numbers its text
/// holds (a refusal's sizes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// One of this module's own reasons.
    Text(&'static str),
    /// A pool error, by its variant (and its capture error's).
    #[cfg(feature = "cuda")]
    Error(u64),
}

#[cfg(feature = "cuda")]
impl Kind {
    fn of(e: &PoolError) -> Kind {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::hash::DefaultHasher::new();
        std::mem::discriminant(e).hash(&mut hasher);
        match e {
            PoolError::Capture(c) => std::mem::discriminant(c).hash(&mut hasher),
            // A driver error by its code too: out of memory passes, a capture error lasts.
            PoolError::Driver { .. } => driver_code(e).hash(&mut hasher),
            _ => {}
        }
        Kind::Error(hasher.finish())
    }
}

/// The `CUresult` of a driver error.
#[cfg(feature = "cuda")]
fn driver_code(e: &PoolError) -> Option<cudarc::driver::sys::CUresult> {
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<cudarc::driver::DriverError>())
        .map(|d| d.0)
}

/// Why calls of one function run eagerly, counted process-wide.
struct Reason {
    /// The graphed function's site, and its name.
    site: u64,
    function: &'static str,
    kind: Kind,
    /// The text of the first call of its kind.
    text: Box<str>,
    calls: AtomicU64,
}

impl Reason {
    /// The one `Reason` of `site` for `kind`, registered (and logged, outside the lock) the
    /// first time.
    fn of(site: &'static GraphSite, kind: Kind, text: &str) -> Arc<Reason> {
        let mut reasons = crate::base::sync::lock(&PROCESS.reasons);
        if let Some(known) = reasons
            .iter()
            .find(|r| r.site == site.id() && r.kind == kind)
        {
            return Arc::clone(known);
        }
        let reason = Arc::new(Reason {
            site: site.id(),
            function: site.name,
            kind,
            text: text.into(),
            calls: AtomicU64::new(0),
        });
        reasons.push(Arc::clone(&reason));
        drop(reasons);
        if kind == Kind::Text(NO_CUDA) {
            // Every graphed call on the host backend: what it is for, not worth a warning.
            crate::base::event::debug!(
                function = site.name,
                reason = text,
                "a graphed call runs eagerly"
            );
        } else {
            crate::base::event::warn!(
                function = site.name,
                reason = text,
                "a graphed call runs eagerly"
            );
        }
        reason
    }

    fn counted(&self, calls: u64) -> EagerCalls {
        EagerCalls {
            function: self.function,
            reason: self.text.to_string(),
            calls,
        }
    }
}

/// What graphs by shape did on `stream` so far.
///
/// ```
/// use gpu_pool::prelude::*;
///
/// #[pooled(stream, graph)]
/// fn scaled<'s>(stream: &'s Stream, x: &Temp<'_, f32>, by: f32) -> Result<Temp<'s, f32>, PoolError> {
///     let mut y = stream.temp::<f32>(x.rows(), x.cols())?; // the output: taken first
///     y.copy_from(x)?; // ... a kernel scaling by `by` ...
///     Ok(y)
/// }
///
/// let stream = Stream::new(&Device::host())?;
/// let x = stream.temp::<f32>(4, 4)?;
/// let y = scaled(&stream, &x, 2.0)?;
/// drop(y);
/// let stats = gpu_pool::graph::shape_stats(&stream);
/// assert_eq!((stats.captures, stats.eager_calls), (0, 1)); // the host backend has no graphs
/// assert_eq!(stats.eager[0].reason, "CUDA graphs need a CUDA device: the host backend runs the calls");
/// # Ok::<(), PoolError>(())
/// ```
#[must_use]
pub fn shape_stats(stream: &Stream) -> ShapeStats {
    let slot = stream.capture_slot().borrow();
    let Some(shapes) = slot.as_ref().and_then(|s| s.downcast_ref::<Shapes>()) else {
        return ShapeStats::default();
    };
    #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
    let mut stats = shapes.stats.clone();
    stats.eager = shapes.eager.iter().map(|(r, n)| r.counted(*n)).collect();
    #[cfg(feature = "cuda")]
    {
        stats.graphs = shapes
            .entries
            .iter()
            .filter(|e| matches!(e.state, State::Graph(_)))
            .count();
        let scratch = shapes.entries.iter().filter_map(|e| match &e.state {
            State::Graph(g) => Some(g.peak - g.floor),
            State::Eager(_) => None,
        });
        stats.scratch_largest = scratch.clone().max().unwrap_or(0);
        stats.scratch_sum = scratch.sum();
    }
    stats
}

/// A stream's graphs by shape (held in its capture state, dropped with it).
#[derive(Default)]
struct Shapes {
    stats: ShapeStats,
    /// Why calls ran eagerly here, and how many for each.
    eager: Vec<(Arc<Reason>, u64)>,
    #[cfg(feature = "cuda")]
    entries: Vec<Entry>,
    /// Each function's calls so far (by site), for least-recently-used eviction.
    #[cfg(feature = "cuda")]
    clocks: Vec<(u64, u64)>,
}

#[cfg(feature = "cuda")]
struct Entry {
    site: u64,
    /// The stack's top at the call.
    top: usize,
    /// The instance, the parameters' words and their hash.
    instance: Option<std::any::TypeId>,
    words: Box<[u64]>,
    hash: u64,
    last_use: u64,
    state: State,
    /// The kernels the words name by handle, held so no other kernel gets their handles (after
    /// the graph that launches them: fields drop in order).
    _kernels: Vec<cudarc::driver::CudaFunction>,
}

#[cfg(feature = "cuda")]
enum State {
    Graph(Recorded),
    Eager(Eager),
}

/// A key whose calls run eagerly.
#[cfg(feature = "cuda")]
struct Eager {
    reason: Arc<Reason>,
    /// Eager calls left before its capture is tried again: `None` where the reason is the
    /// function's own (a host copy, a change of its parameters), which no retry changes.
    retry_in: Option<u32>,
    /// The wait this retry had, doubled at each failure.
    backoff: u32,
}

/// The first wait, in eager calls, before a capture that failed for a passing reason (a full
/// stack, an open shared-memory write, memory the device lacked) is tried again, and the longest
/// it doubles to: a retry costs a capture (and a second run of the body's host code).
#[cfg(feature = "cuda")]
const RETRY_WAIT: std::ops::RangeInclusive<u32> = 16..=65_536;

/// A capture at the stack's top: its graph, and where the stack stood.
#[cfg(feature = "cuda")]
struct Recorded {
    exec: super::Exec,
    replays: Option<Box<dyn crate::core::replay::ReplayHook>>,
    /// The stack's top at the call (part of the key).
    floor: usize,
    /// The highest offset the captured buffers reached.
    peak: usize,
    /// The top once the outputs were taken.
    top_after: usize,
    outputs: Vec<OutputLayout>,
}

/// Calls the graphed function `call` on `stream`: a replay of its graph for this call's key, a
/// capture of a new one, or, where neither can be, the function itself. `call(Some(keys))` writes
/// the parameters' words; `call(None)` runs the body. What `#[pooled(stream, graph)]` expands to.
#[doc(hidden)]
pub fn graphed<'s, R, E>(
    site: &'static GraphSite,
    stream: &'s Stream,
    call: &mut impl FnMut(Option<&mut GraphKeys>) -> Option<Result<R, E>>,
) -> Result<R, E>
where
    R: Outputs<'s>,
    E: From<PoolError> + 'static,
{
    #[cfg(feature = "cuda")]
    {
        cuda::call(site, stream, call)
    }
    #[cfg(not(feature = "cuda"))]
    {
        eager(site, stream, Kind::Text(NO_CUDA), NO_CUDA, call)
    }
}

#[cfg(feature = "cuda")]
const CHANGES_PARAMETERS: &str = "the function changes its parameters on the host (a `&mut` \
     parameter or `self`), which a replay would not: its calls run eagerly";

#[cfg(feature = "cuda")]
const UNNAMED_MEMORY: &str = "the function reaches device memory none of its parameters \
     names (a static's, a thread-local's), which a replay would reach even once it is another \
     buffer's: pass that buffer as a parameter, or its calls run eagerly";

#[cfg(feature = "cuda")]
const SWALLOWED: &str = "the function went on after the pool refused an operation inside the \
     capture (its error was not returned), so its graph would lack what an eager call does";

#[cfg(feature = "cuda")]
const OUTPUTS: &str = "its outputs must be temporaries taken in the call (`stream.temp(..)` first \
     in the body), and nothing else taken in it may outlive it";

#[cfg(feature = "cuda")]
const FAILED: &str = "the function failed while captured";

#[cfg(feature = "cuda")]
const NO_GRAPH: &str = "the driver made no graph of the call";

#[cfg(feature = "cuda")]
const OVER_CAP: &str = "more of its keys come and go than its cap holds (new buffers each call, or \
     more shapes than `graph(cap = N)`): a new key runs eagerly, where capturing it would cost \
     more than running it, until one of its graphs has gone unused a while";

const NO_CUDA: &str = "CUDA graphs need a CUDA device: the host backend runs the calls";

/// Runs the body of `call`.
fn run<R, E: From<PoolError>>(
    stream: &Stream,
    call: &mut impl FnMut(Option<&mut GraphKeys>) -> Option<Result<R, E>>,
) -> Result<R, E> {
    call(None).unwrap_or_else(|| {
        Err(PoolError::Unsupported {
            device: stream.device().id(),
            what: "a graphed call whose closure ran no body (not one `#[pooled(stream, graph)]` made)",
        }
        .into())
    })
}

/// The parameters' words now, with the device memory they name.
#[cfg(feature = "cuda")]
fn keys_naming<R, E>(
    call: &mut impl FnMut(Option<&mut GraphKeys>) -> Option<Result<R, E>>,
) -> GraphKeys {
    let mut keys = GraphKeys::naming_memory();
    drop(call(Some(&mut keys)));
    keys
}

/// Runs the body of `call` eagerly, counted for `kind`.
fn eager<R, E: From<PoolError>>(
    site: &'static GraphSite,
    stream: &Stream,
    kind: Kind,
    text: &str,
    call: &mut impl FnMut(Option<&mut GraphKeys>) -> Option<Result<R, E>>,
) -> Result<R, E> {
    count_eager(site, stream, kind, text);
    run(stream, call)
}

/// Counts a call of `site` run eagerly for `kind`: found in the stream's own list, else
/// registered process-wide (under its lock, logged) outside the stream's state, so no subscriber
/// of the log finds it borrowed.
fn count_eager(site: &'static GraphSite, stream: &Stream, kind: Kind, text: &str) {
    let known = with_shapes(stream, |shapes| {
        shapes
            .eager
            .iter()
            .find(|(r, _)| r.site == site.id() && r.kind == kind)
            .map(|(r, _)| Arc::clone(r))
    });
    let reason = known.unwrap_or_else(|| Reason::of(site, kind, text));
    with_shapes(stream, |shapes| shapes.count_eager(&reason));
}

impl Shapes {
    /// Counts a call run eagerly for `reason`, here and process-wide.
    fn count_eager(&mut self, reason: &Arc<Reason>) {
        self.stats.eager_calls += 1;
        PROCESS.eager_calls.fetch_add(1, Relaxed);
        reason.calls.fetch_add(1, Relaxed);
        match self.eager.iter_mut().find(|(r, _)| Arc::ptr_eq(r, reason)) {
            Some((_, calls)) => *calls += 1,
            None => self.eager.push((Arc::clone(reason), 1)),
        }
    }
}

/// `f` on the stream's graphs by shape (made on first use). No `f` runs user code, so none
/// re-enters.
fn with_shapes<T>(stream: &Stream, f: impl FnOnce(&mut Shapes) -> T) -> T {
    let mut slot = stream.capture_slot().borrow_mut();
    let any = slot.get_or_insert_with(|| Box::new(Shapes::default()));
    match any.downcast_mut::<Shapes>() {
        Some(shapes) => f(shapes),
        // The slot holds only this feature's state.
        None => unreachable!("the capture slot holds graphs by shape"),
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use crate::base::error::CaptureError;
    use crate::core::capturing;
    use crate::core::replay;

    /// What a call does, decided under the slot's borrow and done after it.
    enum Plan {
        Replay,
        /// Capture it; a failure waits `backoff` eager calls, doubled, before the next try.
        Capture {
            backoff: u32,
        },
        /// Run it eagerly (counted already).
        Eager,
        /// Run it eagerly: a new key while every graph of the function is in use.
        OverCap,
    }

    pub(super) fn call<'s, R, E>(
        site: &'static GraphSite,
        stream: &'s Stream,
        call: &mut impl FnMut(Option<&mut GraphKeys>) -> Option<Result<R, E>>,
    ) -> Result<R, E>
    where
        R: Outputs<'s>,
        E: From<PoolError> + 'static,
    {
        let Ok(cuda) = stream.cudarc() else {
            return eager(site, stream, Kind::Text(NO_CUDA), NO_CUDA, call);
        };
        let cu_stream = cuda.cu_stream();
        if stream.in_own_capture() || capturing::on_this_thread() {
            // Inside a capture (an outer graphed call's, say) the body is captured into it.
            with_shapes(stream, |s| s.stats.eager_calls += 1);
            PROCESS.eager_calls.fetch_add(1, Relaxed);
            return run(stream, call);
        }
        let key = Key {
            site: site.id(),
            top: stream.stack_top().unwrap_or(0),
            // No memory collected here: this is every call's key, which allocates nothing.
            keys: {
                let mut keys = GraphKeys::default();
                drop(call(Some(&mut keys)));
                keys
            },
        };
        let plan = with_shapes(stream, |shapes| {
            let clock = shapes.tick(site);
            let Some(entry) = shapes.entries.iter_mut().find(|e| key.is(e)) else {
                if shapes.thrashes(site) {
                    return Plan::OverCap;
                }
                return Plan::Capture { backoff: 0 };
            };
            entry.last_use = clock;
            let State::Eager(eager) = &mut entry.state else {
                return Plan::Replay;
            };
            match &mut eager.retry_in {
                Some(0) => Plan::Capture {
                    backoff: eager.backoff,
                },
                left => {
                    if let Some(left) = left {
                        *left -= 1;
                    }
                    let reason = Arc::clone(&eager.reason);
                    shapes.count_eager(&reason);
                    Plan::Eager
                }
            }
        });
        match plan {
            Plan::Replay => match replay(stream, &key, cu_stream) {
                Ok(outputs) => Ok(outputs),
                // The outputs landed elsewhere than captured: capture this key again.
                Err(None) => capture(site, stream, cu_stream, key, 0, call),
                Err(Some(e)) => Err(e.into()),
            },
            Plan::Capture { backoff } => capture(site, stream, cu_stream, key, backoff, call),
            Plan::Eager => run(stream, call),
            Plan::OverCap => eager(site, stream, Kind::Text(OVER_CAP), OVER_CAP, call),
        }
    }

    /// A call's key: the function, the stack's top and the parameters' words.
    struct Key {
        site: u64,
        top: usize,
        keys: GraphKeys,
    }

    impl Key {
        fn is(&self, entry: &Entry) -> bool {
            entry.hash == self.keys.hash()
                && entry.site == self.site
                && entry.top == self.top
                && entry.instance == self.keys.instance_id()
                && *entry.words == *self.keys.words()
        }
    }

    /// Replays the graph of `key`. `Err(None)`: it no longer fits (and is dropped).
    fn replay<'s, R: Outputs<'s>>(
        stream: &'s Stream,
        key: &Key,
        cu_stream: cudarc::driver::sys::CUstream,
    ) -> Result<R, Option<PoolError>> {
        stream.work_stream("a graphed call").map_err(Some)?;
        let slot = stream.capture_slot().borrow();
        let Some(shapes) = slot.as_ref().and_then(|s| s.downcast_ref::<Shapes>()) else {
            return Err(None);
        };
        let Some(State::Graph(rec)) = shapes.entries.iter().find(|e| key.is(e)).map(|e| &e.state)
        else {
            return Err(None);
        };
        let outputs = match R::retake(stream, &rec.outputs, &mut 0).map_err(Some)? {
            Some(outputs) if stream.stack_top() == Some(rec.top_after) => outputs,
            moved => {
                // Taken elsewhere than captured (the device was configured since).
                drop(moved);
                drop(slot);
                with_shapes(stream, |shapes| shapes.entries.retain(|e| !key.is(e)));
                return Err(None);
            }
        };
        // The scratch above the outputs is free stack: on a growable stack it is taken (mapped
        // again if a give-back unmapped it) until the replay is queued, so no give-back on
        // another thread unmaps it first. One stack take, no lock where it is mapped.
        let cover = match stream.stack() {
            Some(stack) if stack.is_growable() && rec.peak > rec.top_after => {
                let bytes = rec.peak - rec.top_after;
                let cover = stream.temp_1d::<u8>(bytes).map_err(Some)?;
                if cover.source() != crate::base::source::Source::Stack {
                    return Err(Some(PoolError::Capture(CaptureError::NeedsStack {
                        requested: bytes,
                        available: stack.free_bytes(),
                        context: None,
                    })));
                }
                Some(cover)
            }
            _ => None,
        };
        let parts = [(stream, rec.replays.as_deref())];
        let queued = replay::replay("a graphed call", &parts, &mut |_| {
            rec.exec.launch(cu_stream)
        });
        drop(cover);
        queued.map_err(|(_, e)| Some(e))?;
        drop(slot);
        with_shapes(stream, |s| s.stats.replays += 1);
        PROCESS.replays.fetch_add(1, Relaxed);
        Ok(outputs)
    }

    /// Captures the call at the stack's top; where that fails, runs it eagerly and remembers why
    /// (a passing reason for `backoff` eager calls, doubled).
    fn capture<'s, R, E>(
        site: &'static GraphSite,
        stream: &'s Stream,
        cu_stream: cudarc::driver::sys::CUstream,
        key: Key,
        backoff: u32,
        call: &mut impl FnMut(Option<&mut GraphKeys>) -> Option<Result<R, E>>,
    ) -> Result<R, E>
    where
        R: Outputs<'s>,
        E: From<PoolError> + 'static,
    {
        let mut capturing = match stream.begin_capture(None, true) {
            Ok(c) => c,
            Err(e) => {
                // Someone else's capture on the stream (cudarc's) passes when it ends.
                let passes =
                    !lasting(&e) || matches!(e, PoolError::Capture(CaptureError::Elsewhere { .. }));
                let wait = passes.then_some(backoff);
                return remember_eager(site, stream, key, Kind::of(&e), &e.to_string(), wait, call);
            }
        };
        let touched = crate::core::graph_key::Touched::record();
        let worked = run(stream, call);
        let (reached, refused) = touched.take();
        let ended = capturing.end();
        let peak = capturing.peak;
        let replays = capturing.replays.take();
        drop(capturing);
        let (outputs, exec) = match (worked, ended) {
            (Ok(outputs), Ok(Some(exec))) if refused.is_none() => (outputs, exec),
            (worked, ended) => {
                // Why: the pool's refusal (whatever the body made of it: returned, wrapped in an
                // error of its own, or swallowed), else the body's own error, else the driver's;
                // and whether it is the function's own, or may pass.
                let (kind, reason, lasts) = match (refused, &worked, ended) {
                    (Some(e), worked, _) => {
                        let e = PoolError::Capture(e);
                        let text = match worked {
                            Ok(_) => format!("{SWALLOWED} ({e})"),
                            Err(_) => e.to_string(),
                        };
                        (Kind::of(&e), text, lasting(&e))
                    }
                    (None, _, Err(e @ PoolError::Capture(CaptureError::CrossStream { .. }))) => {
                        (Kind::of(&e), e.to_string(), true)
                    }
                    (None, Err(e), ended) => {
                        match (e as &dyn std::any::Any).downcast_ref::<PoolError>() {
                            Some(e) => (Kind::of(e), e.to_string(), lasting(e)),
                            // An error of the body's own type, where the driver says why the
                            // capture failed (cudarc called directly): the driver's reason.
                            None => match ended {
                                Err(d) if lasting(&d) => (Kind::of(&d), d.to_string(), true),
                                _ => (Kind::Text(FAILED), FAILED.to_owned(), false),
                            },
                        }
                    }
                    (None, Ok(_), Err(e)) => (Kind::of(&e), e.to_string(), lasting(&e)),
                    (None, Ok(_), Ok(_)) => (Kind::Text(NO_GRAPH), NO_GRAPH.to_owned(), false),
                };
                let wait = (!lasts).then_some(backoff);
                // Nothing captured ran: the outputs are released before the call runs for real,
                // unless the body changed its parameters on the host: it ran once already.
                drop(worked);
                if keys_naming(call) != key.keys {
                    text_reason(site, stream, key, CHANGES_PARAMETERS);
                    return Err(E::from(PoolError::Unsupported {
                        device: stream.device().id(),
                        what: "a graphed call that changed its parameters on the host while its \
                               capture failed: it cannot run again (run it eagerly: its later \
                               calls do)",
                    }));
                }
                return remember_eager(site, stream, key, kind, &reason, wait, call);
            }
        };
        let mut layouts = Vec::new();
        outputs.layouts(&mut layouts);
        let floor = key.top;
        let top_after = stream.stack_top().unwrap_or(floor);
        let base = stream.stack_range().map_or(0, |r| r.start);
        let inside = layouts
            .iter()
            .all(|l| l.ptr >= base + floor as u64 && l.ptr < base + top_after as u64);
        if !inside {
            // An output that is no stack temporary of the capture (or a buffer kept past it)
            // cannot be taken again at its address: the graph would write memory of others.
            drop(outputs);
            return remember_eager(site, stream, key, Kind::Text(OUTPUTS), OUTPUTS, None, call);
        }
        // The capture queued nothing: the call's work runs now, as its first replay.
        let recorded = Recorded {
            exec,
            replays,
            floor,
            peak: peak.max(top_after),
            top_after,
            outputs: layouts,
        };
        let parts = [(stream, recorded.replays.as_deref())];
        replay::replay("a graphed call", &parts, &mut |_| {
            recorded.exec.launch(cu_stream)
        })
        .map_err(|(_, e)| E::from(e))?;
        let after = keys_naming(call);
        let scratch = (base + floor as u64, base + recorded.peak as u64);
        let named = |&(ptr, bytes): &(u64, u64)| {
            let inside = |(start, end): (u64, u64)| ptr >= start && ptr + bytes <= end;
            inside(scratch) || after.names().iter().any(|&(p, b)| inside((p, p + b)))
        };
        let why = if after != key.keys {
            // The body changed its parameters on the host (a swap of buffers, a counter in
            // `self`): this call's work is what was captured, but a replay would not change them.
            Some(CHANGES_PARAMETERS)
        } else if !reached.iter().all(named) {
            // Memory no parameter names (a static's, a thread-local's): a replay would reach it
            // even once it is another buffer's.
            Some(UNNAMED_MEMORY)
        } else {
            None
        };
        if let Some(why) = why {
            let reason = text_reason(site, stream, key, why);
            with_shapes(stream, |s| s.count_eager(&reason));
            return Ok(outputs);
        }
        let graph = Key { keys: after, ..key };
        insert(stream, site, graph, State::Graph(recorded));
        with_shapes(stream, |s| s.stats.captures += 1);
        PROCESS.captures.fetch_add(1, Relaxed);
        Ok(outputs)
    }

    impl Shapes {
        /// Counts a call of `site`: its clock, for least-recently-used eviction and the idle
        /// window (one per function, so other functions' calls on the stream age no graph).
        pub(super) fn tick(&mut self, site: &'static GraphSite) -> u64 {
            let id = site.id();
            match self.clocks.iter_mut().find(|(s, _)| *s == id) {
                Some((_, clock)) => {
                    *clock += 1;
                    *clock
                }
                None => {
                    self.clocks.push((id, 1));
                    1
                }
            }
        }

        /// The clock of `site`: its calls so far on this stream.
        pub(super) fn now(&self, site: &'static GraphSite) -> u64 {
            let id = site.id();
            self.clocks
                .iter()
                .find(|(s, _)| *s == id)
                .map_or(0, |&(_, c)| c)
        }

        /// Whether a new key of `site` should run eagerly rather than be captured: the function
        /// holds its cap of graphs and each was used within the last `IDLE_PER_GRAPH x cap`
        /// calls of it on the stream. Capturing it would evict a graph still in use: keys that come
        /// and go faster than the cap holds would capture on every call (a capture costs
        /// several eager calls), where this keeps the graphs in use replaying and runs the rest
        /// eagerly. A graph left unused that long makes room again, so a new working set is
        /// captured.
        /// The same holds for its eager keys: a function whose captures fail and whose keys
        /// come and go would otherwise try (and fail) a capture on every call.
        pub(super) fn thrashes(&self, site: &'static GraphSite) -> bool {
            const IDLE_PER_GRAPH: u64 = 4;
            let idle = (site.cap.max(1) as u64).saturating_mul(IDLE_PER_GRAPH);
            let full_and_in_use = |graphs: bool| {
                let mine = self.entries.iter().filter(|e| {
                    e.site == site.id() && matches!(e.state, State::Graph(_)) == graphs
                });
                mine.clone().count() >= site.cap.max(1)
                    && mine
                        .map(|e| e.last_use)
                        .min()
                        .is_some_and(|lru| self.now(site) - lru < idle)
            };
            full_and_in_use(true) || full_and_in_use(false)
        }
    }

    /// Keeps `state` for the key just built (in place of what it had), dropping the least
    /// recently used graph of the function if it has its cap.
    fn insert(stream: &Stream, site: &'static GraphSite, mut key: Key, state: State) {
        with_shapes(stream, |shapes| {
            shapes.entries.retain(|e| !key.is(e));
            // Graphs and eager keys are capped apart: an eager key never evicts a graph.
            let graph = matches!(state, State::Graph(_));
            let mine = shapes
                .entries
                .iter()
                .filter(|e| e.site == site.id() && matches!(e.state, State::Graph(_)) == graph);
            if mine.clone().count() >= site.cap.max(1) {
                let oldest = mine.min_by_key(|e| e.last_use).map(|e| e.last_use);
                if let Some(oldest) = oldest {
                    shapes.entries.retain(|e| {
                        !(e.site == site.id()
                            && e.last_use == oldest
                            && matches!(e.state, State::Graph(_)) == graph)
                    });
                    if graph {
                        shapes.stats.evictions += 1;
                        PROCESS.evictions.fetch_add(1, Relaxed);
                    }
                }
            }
            shapes.entries.push(Entry {
                site: key.site,
                top: key.top,
                instance: key.keys.instance_id(),
                words: key.keys.words().into(),
                hash: key.keys.hash(),
                last_use: shapes.now(site),
                state,
                _kernels: key.keys.kernels(),
            });
        });
    }

    /// Whether a capture's failure is the function's own (what it does, which every later
    /// capture meets again) rather than the moment's (a full stack, memory, an open write).
    fn lasting(e: &PoolError) -> bool {
        match e {
            PoolError::Capture(e) => matches!(
                e,
                CaptureError::HostCopy { .. }
                    | CaptureError::CrossStream { .. }
                    | CaptureError::Allocates { .. }
                    | CaptureError::KeptBuffers
                    | CaptureError::Elsewhere { .. }
                    | CaptureError::LegacyStream { .. }
            ),
            // The driver refused the capture: the body did what a capture cannot (a host wait,
            // a synchronization). Its other errors (memory to instantiate the graph) pass.
            PoolError::Driver { .. } => {
                use cudarc::driver::sys::CUresult as R;
                matches!(
                    driver_code(e),
                    Some(
                        R::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
                            | R::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
                            | R::CUDA_ERROR_STREAM_CAPTURE_MERGE
                            | R::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED
                            | R::CUDA_ERROR_STREAM_CAPTURE_UNJOINED
                            | R::CUDA_ERROR_STREAM_CAPTURE_ISOLATION
                            | R::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
                            | R::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD
                            | R::CUDA_ERROR_CAPTURED_EVENT
                            | R::CUDA_ERROR_NOT_PERMITTED
                    )
                )
            }
            PoolError::Unsupported { .. } => true,
            _ => false,
        }
    }

    /// Remembers the key as eager for `kind` (tried again after `wait` eager calls, doubled,
    /// where it is `Some`).
    fn remember(
        site: &'static GraphSite,
        stream: &Stream,
        key: Key,
        kind: Kind,
        text: &str,
        wait: Option<u32>,
    ) -> Arc<Reason> {
        let reason = Reason::of(site, kind, text);
        let backoff = wait.map_or(0, |w| {
            w.saturating_mul(2)
                .clamp(*RETRY_WAIT.start(), *RETRY_WAIT.end())
        });
        let eager = Eager {
            reason: Arc::clone(&reason),
            retry_in: wait.map(|_| backoff),
            backoff,
        };
        insert(stream, site, key, State::Eager(eager));
        reason
    }

    /// Remembers the key as eager for good, for one of this module's reasons.
    fn text_reason(
        site: &'static GraphSite,
        stream: &Stream,
        key: Key,
        text: &'static str,
    ) -> Arc<Reason> {
        remember(site, stream, key, Kind::Text(text), text, None)
    }

    /// Remembers the key as eager for `kind`, and runs the call.
    fn remember_eager<R, E: From<PoolError>>(
        site: &'static GraphSite,
        stream: &Stream,
        key: Key,
        kind: Kind,
        text: &str,
        wait: Option<u32>,
        call: &mut impl FnMut(Option<&mut GraphKeys>) -> Option<Result<R, E>>,
    ) -> Result<R, E> {
        let reason = remember(site, stream, key, kind, text, wait);
        with_shapes(stream, |s| s.count_eager(&reason));
        run(stream, call)
    }
}
