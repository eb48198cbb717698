//! The reference model: what the pool should do, worked out from its documented rules alone
//! (OpenCV's layouts and stack order, the fallback chain, the caching pool's bins, `MixMemory`'s
//! growth) and the host backend's accounting (a block of `n` bytes holds `max(n, 1)`, against the
//! device's limit). It never calls the pool, except `PoolConfig::new` and `CachingPool::bin_of`,
//! pure functions with tests of their own.

use std::collections::BTreeMap;

use gpu_pool::{
    FallbackReason, PoolError, Source, alloc::CachingPool, alloc::CachingStats, config::Fallback,
    config::Packing, config::PoolConfig, observe::FallbackCounts,
};

use super::op::{Elem, Pick, Shape, StreamKind};

/// The caching pool of `StreamKind::Cached` streams.
pub(super) const RUN_CACHE: usize = 0;
/// The device's own, behind `Fallback::Caching`.
pub(super) const DEVICE_CACHE: usize = 1;

/// The host backend aligns every block to this, and refuses one that would pass `isize::MAX`.
const HOST_ALIGN: usize = 512;

/// Every reason a fallback is counted under.
pub(super) const REASONS: [FallbackReason; 5] = [
    FallbackReason::StackFull,
    FallbackReason::NoStack,
    FallbackReason::TooLarge,
    FallbackReason::Disabled,
    FallbackReason::NoStackMemory,
];

/// The pool as the model sees it; generators read it to choose their next operation.
pub struct Model {
    pub(super) device: DeviceModel,
    pub(super) streams: Vec<StreamModel>,
    /// In the order of taking, as the checker's buffers.
    pub(super) live: Vec<BufModel>,
    /// `RUN_CACHE` and `DEVICE_CACHE`.
    pub(super) caches: [CacheModel; 2],
    pub(super) mix: MixModel,
}

pub(super) struct DeviceModel {
    pub texture: usize,
    pub host: bool,
    pub stream_ordered: bool,
    /// Other threads use the device: which stack a stream gets is seen, not predicted, and the
    /// device's memory and counters are not this model's.
    pub shared: bool,
    /// Bytes the backend may hand out; `usize::MAX` for no limit.
    pub limit: usize,
    /// The config the next stack memory gets.
    pub config: PoolConfig,
    /// The stack memory, where allocated, and which stacks are held (not known when shared).
    pub stacks: Option<Stacks>,
    pub usage: bool,
    pub fallback: Fallback,
    pub strict: bool,
    /// Where new streams start row and column blocks.
    pub packing: Packing,
    /// Device bytes and pinned bytes this run holds, as the host backend counts them.
    pub bytes: usize,
    pub pinned: usize,
    pub alloc_calls: u64,
    pub free_calls: u64,
    /// Allocation calls that failed: counted, and never freed.
    pub failed_allocs: u64,
    /// The counts of dropped streams, which the device keeps.
    pub retired: Counts,
}

pub(super) struct Stacks {
    pub config: PoolConfig,
    pub held: Vec<bool>,
}

impl Stacks {
    pub(super) fn held_count(&self) -> usize {
        self.held.iter().filter(|&&h| h).count()
    }
}

/// The counts a stream keeps, and its device over all its streams.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Counts {
    pub stack: u64,
    /// By reason, in the order of `REASONS`.
    pub fallback: [u64; REASONS.len()],
    pub violations: u64,
}

impl Counts {
    pub(super) fn of(stack: u64, fallback: &FallbackCounts, violations: u64) -> Counts {
        Counts {
            stack,
            fallback: REASONS.map(|r| fallback.get(r)),
            violations,
        }
    }

    pub(super) fn add(&mut self, other: &Counts) {
        self.stack += other.stack;
        self.violations += other.violations;
        for (a, b) in self.fallback.iter_mut().zip(other.fallback) {
            *a += b;
        }
    }
}

/// What serves a stream's buffers when its stack does not.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Allocator {
    Driver,
    StreamOrdered,
    Cache(usize),
    /// `Fallback::Error`.
    Refuse,
}

pub(super) struct StreamModel {
    pub allocator: Allocator,
    /// Made with an allocator of its own: never takes a stack.
    pub custom: bool,
    pub strict: bool,
    /// The device's packing when the stream was made, as a block alignment.
    pub packing: usize,
    pub wants_stack: bool,
    pub no_stack_memory: bool,
    pub stack: Option<StackModel>,
    pub counts: Counts,
    pub high_water: usize,
    pub peak_demand: usize,
    pub driver_allocs: u64,
    pub driver_frees: u64,
}

impl StreamModel {
    /// Whether its driver calls are this run's alone: not so for a caching pool other threads
    /// share, whose hits and misses depend on them.
    pub(super) fn calls_known(&self, shared: bool) -> bool {
        !shared || !matches!(self.allocator, Allocator::Cache(_))
    }

    pub(super) fn top(&self) -> usize {
        self.stack.as_ref().map_or(0, |s| s.top)
    }
}

impl Model {
    /// Bytes and number of stream `s`'s live buffers, as `StreamStats::live_bytes` counts them: a
    /// stack block with its padding, a fallback buffer's layout bytes.
    pub(super) fn live_of(&self, s: usize) -> (usize, u64) {
        self.live
            .iter()
            .filter(|b| b.stream == s)
            .filter_map(|b| match (b.source, b.memory) {
                (Source::Stack, Memory::Stack { from, end, .. }) => Some(end - from),
                (Source::Fallback(_), _) => Some(b.layout.bytes),
                _ => None,
            })
            .fold((0, 0), |(bytes, n), b| (bytes + b, n + 1))
    }
}

pub(super) struct StackModel {
    pub index: usize,
    pub size: usize,
    /// The end of the highest live block: blocks released out of order below it wait for it.
    pub top: usize,
}

/// How a request becomes bytes: OpenCV's rule, as `layout.rs` documents it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Layout {
    pub rows: usize,
    pub cols: usize,
    pub elem: Elem,
    pub width: usize,
    pub pitch: usize,
    pub bytes: usize,
    /// Where a stack block may start: a multiple of this.
    pub align: usize,
    pub pitched: bool,
    pub empty: bool,
}

impl Layout {
    /// `None` where a step overflows. More than one row and column: pitched to the texture
    /// alignment, starting on it (or on `packing`, if larger). Otherwise contiguous, rounded up to
    /// 64 bytes, starting on `packing` (256, or OpenCV's 64), or on the element's alignment, if
    /// larger.
    fn of(shape: Shape, elem: Elem, texture: usize, packing: usize) -> Option<Layout> {
        let (rows, cols) = shape.dims();
        rows.checked_mul(cols)?;
        let width = cols.checked_mul(elem.size())?;
        let pitched = rows > 1 && cols > 1;
        let (pitch, bytes, align) = if pitched {
            let pitch = width.checked_next_multiple_of(texture)?;
            let align = texture.max(packing).max(elem.align());
            (pitch, pitch.checked_mul(rows)?, align)
        } else {
            let bytes = width.checked_mul(rows)?.checked_next_multiple_of(64)?;
            let pitch = if cols == 1 { elem.size() } else { width };
            (pitch, bytes, packing.max(elem.align()))
        };
        Some(Layout {
            rows,
            cols,
            elem,
            width,
            pitch,
            bytes,
            align,
            pitched,
            empty: width == 0 || rows == 0,
        })
    }
}

/// What a buffer holds, written when it was taken.
#[derive(Clone, Copy, Debug)]
pub(super) enum Content {
    Uniform(u8),
    Pattern(u64),
}

impl Content {
    /// The first `len` bytes. Built whole, so comparing is one `memcmp` even in a debug build.
    pub(super) fn bytes(self, len: usize) -> Vec<u8> {
        match self {
            Content::Uniform(b) => vec![b; len],
            Content::Pattern(seed) => (0..len as u64)
                .map(|i| (seed.wrapping_mul(31).wrapping_add(i.wrapping_mul(7)) >> 3) as u8)
                .collect(),
        }
    }
}

/// Where a live buffer's memory came from, and what giving it back does.
#[derive(Clone, Copy, Debug)]
pub(super) enum Memory {
    None,
    Stack {
        /// The top when it was taken: the block holds `from..end`, its padding included.
        from: usize,
        offset: usize,
        end: usize,
    },
    Driver {
        bytes: usize,
    },
    Cache {
        cache: usize,
        bin: u64,
        size: usize,
        requested: usize,
    },
}

pub(super) struct BufModel {
    pub stream: usize,
    pub layout: Layout,
    pub source: Source,
    pub memory: Memory,
    /// `None` where the driver chooses it (a pitched driver allocation on a GPU).
    pub pitch: Option<usize>,
    pub content: Content,
    /// Where its block ends on the stack its stream would have with unlimited room, which the
    /// demand is measured on: every buffer a stack would hold, fallbacks too, placed by the
    /// stack's rule on top of the highest live one. `None` for an empty buffer and for a stream
    /// that uses no stack by choice.
    pub demand_end: Option<usize>,
}

#[derive(Default)]
pub(super) struct CacheModel {
    /// Held blocks by bin: their size and how many.
    pub held: BTreeMap<u64, (usize, usize)>,
    pub stats: CachingStats,
}

/// Both sides of the `MixMemory` as plain vectors: their length is the capacity.
#[derive(Default)]
pub(super) struct MixModel {
    pub host: Vec<u8>,
    pub gpu: Vec<u8>,
    pub reallocations: u64,
}

/// An error the model predicts, with the fields the pool's rules decide.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    SizeOverflow,
    OutOfMemory,
    StackExhausted {
        requested: usize,
        available: usize,
        stack_size: usize,
        reason: FallbackReason,
    },
    InvalidConfig,
    ConfigInUse {
        held: usize,
    },
    LifoViolation {
        offset: usize,
    },
    InvalidEnvConfig,
}

impl Refusal {
    pub(super) fn matches(&self, e: &PoolError) -> bool {
        match (self, e) {
            (Refusal::SizeOverflow, PoolError::SizeOverflow { .. })
            | (Refusal::OutOfMemory, PoolError::OutOfMemory { .. })
            | (Refusal::InvalidConfig, PoolError::InvalidConfig { .. })
            | (Refusal::InvalidEnvConfig, PoolError::InvalidEnvConfig { .. }) => true,
            (
                Refusal::StackExhausted {
                    requested,
                    available,
                    stack_size,
                    reason,
                },
                PoolError::StackExhausted {
                    requested: r,
                    available: a,
                    stack_size: s,
                    reason: why,
                    ..
                },
            ) => (requested, available, stack_size, reason) == (r, a, s, why),
            (Refusal::ConfigInUse { held }, PoolError::ConfigInUse { held: h, .. }) => held == h,
            (Refusal::LifoViolation { offset }, PoolError::LifoViolation { offset: o, .. }) => {
                offset == o
            }
            _ => false,
        }
    }
}

impl DeviceModel {
    /// The config the device reports: the stack memory's, else the next one's.
    pub(super) fn effective_config(&self) -> PoolConfig {
        self.stacks.as_ref().map_or(self.config, |s| s.config)
    }

    /// A counted allocation call; whether the backend has the memory.
    fn alloc(&mut self, bytes: usize) -> bool {
        self.alloc_calls += 1;
        let size = bytes.max(1);
        let fits = size
            .checked_next_multiple_of(HOST_ALIGN)
            .is_some_and(|s| s <= isize::MAX as usize)
            && self
                .bytes
                .checked_add(size)
                .is_some_and(|t| t <= self.limit);
        if fits {
            self.bytes += size;
        } else {
            self.failed_allocs += 1;
        }
        fits
    }

    /// A pitched allocation call: the bytes it took, on the host backend's pitch.
    fn alloc_pitch(&mut self, width: usize, rows: usize) -> Option<usize> {
        let bytes = width
            .max(1)
            .checked_next_multiple_of(HOST_ALIGN)
            .and_then(|pitch| pitch.checked_mul(rows));
        let Some(bytes) = bytes else {
            self.alloc_calls += 1;
            self.failed_allocs += 1;
            return None;
        };
        self.alloc(bytes).then_some(bytes)
    }

    fn free(&mut self, bytes: usize) {
        self.free_calls += 1;
        self.bytes -= bytes.max(1);
    }

    /// A free stack, allocating the stack memory first if there is none: `Err` without memory.
    fn claim(&mut self) -> Result<Option<StackModel>, ()> {
        if self.stacks.is_none() {
            let config = self.config;
            if !self.alloc(config.total_bytes()) {
                return Err(());
            }
            let held = vec![false; config.stack_count()];
            self.stacks = Some(Stacks { config, held });
        }
        let stacks = self.stacks.as_mut().expect("allocated above");
        let Some(index) = stacks.held.iter().position(|&h| !h) else {
            return Ok(None);
        };
        stacks.held[index] = true;
        let size = stacks.config.stack_size();
        Ok(Some(StackModel {
            index,
            size,
            top: 0,
        }))
    }
}

impl CacheModel {
    fn activate(&mut self, requested: usize, size: usize) {
        let s = &mut self.stats;
        s.active_blocks += 1;
        s.active_requested_bytes += requested;
        s.active_rounded_bytes += size;
        s.peak_active_requested_bytes = s.peak_active_requested_bytes.max(s.active_requested_bytes);
        s.peak_active_rounded_bytes = s.peak_active_rounded_bytes.max(s.active_rounded_bytes);
    }

    /// A held block of `bin`, if any. On the host backend no work is pending, so any serves (on
    /// a GPU a block freed by another stream waits for its event: not modelled).
    fn take_held(&mut self, bin: u64) -> bool {
        let Some((size, n)) = self.held.get_mut(&bin) else {
            return false;
        };
        let size = *size;
        *n -= 1;
        if *n == 0 {
            self.held.remove(&bin);
        }
        self.stats.held_blocks -= 1;
        self.stats.held_bytes -= size;
        true
    }
}

impl Model {
    pub(super) fn new(device: DeviceModel, caches: [CachingStats; 2]) -> Model {
        Model {
            device,
            streams: Vec::new(),
            live: Vec::new(),
            caches: caches.map(|stats| CacheModel {
                held: BTreeMap::new(),
                stats,
            }),
            mix: MixModel::default(),
        }
    }

    /// Live buffers of stream `stream` (modulo the number of streams).
    pub fn live_on(&self, stream: usize) -> usize {
        let Some(s) = self.stream_index(stream) else {
            return 0;
        };
        self.live.iter().filter(|b| b.stream == s).count()
    }

    pub(super) fn stream_index(&self, n: usize) -> Option<usize> {
        (!self.streams.is_empty()).then(|| n % self.streams.len())
    }

    /// The position of the live buffer `pick` means, if there is one.
    pub(super) fn pick(&self, pick: Pick) -> Option<usize> {
        match pick {
            Pick::Any(n) => (!self.live.is_empty()).then(|| n % self.live.len()),
            Pick::Newest(s) => {
                let s = self.stream_index(s)?;
                self.live.iter().rposition(|b| b.stream == s)
            }
            Pick::OfStream(s, n) => {
                let s = self.stream_index(s)?;
                let of: Vec<usize> = (0..self.live.len())
                    .filter(|&i| self.live[i].stream == s)
                    .collect();
                (!of.is_empty()).then(|| of[n % of.len()])
            }
        }
    }

    /// `Stream::new` or `Stream::with_allocator`; `seen` is the stack the stream holds after it.
    pub(super) fn new_stream(&mut self, kind: StreamKind, seen: Option<usize>) {
        let d = &self.device;
        let allocator = match (kind, d.fallback) {
            (StreamKind::Cached, _) => Allocator::Cache(RUN_CACHE),
            (_, Fallback::StreamOrdered) if d.stream_ordered => Allocator::StreamOrdered,
            (_, Fallback::Driver | Fallback::StreamOrdered) => Allocator::Driver,
            (_, Fallback::Caching) => Allocator::Cache(DEVICE_CACHE),
            (_, Fallback::Error) => Allocator::Refuse,
            (_, other) => unreachable!("the model does not know {other:?}"),
        };
        self.streams.push(StreamModel {
            allocator,
            custom: kind == StreamKind::Cached,
            strict: d.strict,
            packing: d.packing.block_align(),
            wants_stack: false,
            no_stack_memory: false,
            stack: None,
            counts: Counts::default(),
            high_water: 0,
            peak_demand: 0,
            driver_allocs: 0,
            driver_frees: 0,
        });
        self.claim(self.streams.len() - 1, seen);
    }

    /// A stream's claim on a stack, made when it is made and at each take while it has none.
    fn claim(&mut self, s: usize, seen: Option<usize>) {
        let st = &self.streams[s];
        if st.stack.is_some() || st.custom || st.no_stack_memory || !self.device.usage {
            return;
        }
        self.streams[s].wants_stack = true;
        let stack = if self.device.shared {
            let size = self.device.config.stack_size();
            seen.map(|index| StackModel {
                index,
                size,
                top: 0,
            })
        } else if self
            .device
            .stacks
            .as_ref()
            .is_some_and(|s| !s.held.contains(&false))
        {
            None
        } else {
            // Out of memory, the device's idle memory (the caching pools' held blocks) goes back
            // and the claim is tried once more.
            let claimed = self.device.claim().or_else(|()| {
                self.reclaim();
                self.device.claim()
            });
            match claimed {
                Ok(stack) => stack,
                // OpenCV's rule: no memory for the stacks is no error; the buffers fall back.
                Err(()) => {
                    self.streams[s].no_stack_memory = true;
                    None
                }
            }
        };
        self.streams[s].stack = stack;
    }

    /// Dropping a stream (none of its buffers is live): its stack goes back, its counts stay.
    pub(super) fn drop_stream(&mut self, s: usize) {
        let st = self.streams.remove(s);
        if let (Some(stack), Some(stacks)) = (&st.stack, &mut self.device.stacks) {
            stacks.held[stack.index] = false;
        }
        self.device.retired.add(&st.counts);
    }

    /// A take: the new buffer is the last live one.
    pub(super) fn take(
        &mut self,
        s: usize,
        shape: Shape,
        elem: Elem,
        content: Content,
        seen: Option<usize>,
    ) -> Result<(), Refusal> {
        let packing = self.streams[s].packing;
        let layout =
            Layout::of(shape, elem, self.device.texture, packing).ok_or(Refusal::SizeOverflow)?;
        let (source, memory) = if layout.empty {
            (Source::Empty, Memory::None)
        } else {
            self.place(s, &layout, seen)?
        };
        let driver_pitch = self.streams[s].allocator == Allocator::Driver
            && matches!(source, Source::Fallback(_))
            && layout.pitched;
        let stack_would_hold = match source {
            Source::Stack => true,
            Source::Fallback(reason) => reason != FallbackReason::Disabled,
            _ => false,
        };
        let demand_end = stack_would_hold.then(|| self.demand_take(s, &layout));
        self.live.push(BufModel {
            stream: s,
            layout,
            source,
            memory,
            pitch: (!driver_pitch || self.device.host).then_some(layout.pitch),
            content,
            demand_end,
        });
        Ok(())
    }

    /// A block for `l` on stream `s`'s unlimited stack, above its highest live one: its end.
    fn demand_take(&mut self, s: usize, l: &Layout) -> usize {
        let top = self
            .live
            .iter()
            .filter(|b| b.stream == s)
            .filter_map(|b| b.demand_end)
            .max()
            .unwrap_or(0);
        let end = top
            .checked_next_multiple_of(l.align)
            .and_then(|offset| offset.checked_add(l.bytes))
            .unwrap_or(usize::MAX);
        let st = &mut self.streams[s];
        st.peak_demand = st.peak_demand.max(end);
        end
    }

    /// The stack when the block fits above its top, else the stream's allocator.
    fn place(
        &mut self,
        s: usize,
        l: &Layout,
        seen: Option<usize>,
    ) -> Result<(Source, Memory), Refusal> {
        if self.streams[s].stack.is_none() {
            self.claim(s, seen);
        }
        let st = &mut self.streams[s];
        let reason = match &mut st.stack {
            Some(stack) => {
                let offset = stack.top.next_multiple_of(l.align);
                match offset.checked_add(l.bytes).filter(|&end| end <= stack.size) {
                    Some(end) => {
                        let from = stack.top;
                        stack.top = end;
                        st.counts.stack += 1;
                        st.high_water = st.high_water.max(end);
                        return Ok((Source::Stack, Memory::Stack { from, offset, end }));
                    }
                    None if l.bytes > stack.size => FallbackReason::TooLarge,
                    None => FallbackReason::StackFull,
                }
            }
            None if st.no_stack_memory => FallbackReason::NoStackMemory,
            None if st.wants_stack => FallbackReason::NoStack,
            None => FallbackReason::Disabled,
        };
        let memory = self.fallback(s, l, reason)?;
        let st = &mut self.streams[s];
        st.counts.fallback[reason_index(reason)] += 1;
        Ok((Source::Fallback(reason), memory))
    }

    /// The fallback, tried once more after the device's idle memory (every caching pool's held
    /// blocks) went back, where it runs out of memory.
    fn fallback(
        &mut self,
        s: usize,
        l: &Layout,
        reason: FallbackReason,
    ) -> Result<Memory, Refusal> {
        match self.fallback_once(s, l, reason) {
            Err(Refusal::OutOfMemory) => {
                self.reclaim();
                self.fallback_once(s, l, reason)
            }
            other => other,
        }
    }

    /// What `Device::reclaim_idle` gives back on the host backend with fixed stacks: every caching
    /// pool's held blocks.
    fn reclaim(&mut self) {
        for c in 0..self.caches.len() {
            self.free_held(c);
        }
    }

    fn fallback_once(
        &mut self,
        s: usize,
        l: &Layout,
        reason: FallbackReason,
    ) -> Result<Memory, Refusal> {
        let st = &mut self.streams[s];
        let d = &mut self.device;
        match st.allocator {
            Allocator::Refuse => {
                let (available, stack_size) = st
                    .stack
                    .as_ref()
                    .map_or((0, 0), |k| (k.size - k.top, k.size));
                Err(Refusal::StackExhausted {
                    requested: l.bytes,
                    available,
                    stack_size,
                    reason,
                })
            }
            Allocator::Driver if l.pitched => {
                st.driver_allocs += 1;
                let bytes = d.alloc_pitch(l.width, l.rows).ok_or(Refusal::OutOfMemory)?;
                Ok(Memory::Driver { bytes })
            }
            Allocator::Driver | Allocator::StreamOrdered => {
                st.driver_allocs += 1;
                d.alloc(l.bytes)
                    .then_some(Memory::Driver { bytes: l.bytes })
                    .ok_or(Refusal::OutOfMemory)
            }
            Allocator::Cache(c) => self.cache_alloc(c, s, l.bytes),
        }
    }

    /// The caching pool: a held block of the request's bin, else a new one of the bin's size
    /// (after freeing every held block, once, if the device is out of memory).
    fn cache_alloc(&mut self, c: usize, s: usize, requested: usize) -> Result<Memory, Refusal> {
        let (bin, size) = CachingPool::bin_of(requested, CachingPool::DEFAULT_LEADING_BITS);
        if self.caches[c].take_held(bin) {
            self.caches[c].stats.hits += 1;
        } else {
            self.caches[c].stats.misses += 1;
            self.streams[s].driver_allocs += 1;
            if !self.device.alloc(size) {
                if self.caches[c].stats.held_blocks == 0 {
                    return Err(Refusal::OutOfMemory);
                }
                self.caches[c].stats.oom_retries += 1;
                self.free_held(c);
                self.streams[s].driver_allocs += 1;
                if !self.device.alloc(size) {
                    return Err(Refusal::OutOfMemory);
                }
            }
        }
        self.caches[c].activate(requested, size);
        Ok(Memory::Cache {
            cache: c,
            bin,
            size,
            requested,
        })
    }

    /// `free_held`: the bytes freed.
    pub(super) fn free_held(&mut self, c: usize) -> usize {
        let cache = &mut self.caches[c];
        let mut freed = 0;
        for (size, n) in std::mem::take(&mut cache.held).into_values() {
            for _ in 0..n {
                self.device.free(size);
            }
            freed += size * n;
        }
        cache.stats.held_blocks = 0;
        cache.stats.held_bytes = 0;
        freed
    }

    /// Releasing live buffer `i`. A stack block is in LIFO order when it is the top one; out of
    /// order it waits for the blocks above, counted as a violation, an error in strict mode.
    pub(super) fn release(&mut self, i: usize) -> Result<(), Refusal> {
        let b = self.live.remove(i);
        let s = b.stream;
        let top = self
            .live
            .iter()
            .filter_map(|l| match l.memory {
                Memory::Stack { end, .. } if l.stream == s => Some(end),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        let st = &mut self.streams[s];
        match b.memory {
            Memory::None => {}
            Memory::Stack { offset, end, .. } => {
                let stack = st.stack.as_mut().expect("a stack block has its stack");
                let in_order = end == stack.top;
                stack.top = top;
                if !in_order {
                    st.counts.violations += 1;
                    if st.strict {
                        return Err(Refusal::LifoViolation { offset });
                    }
                }
            }
            Memory::Driver { bytes } => {
                st.driver_frees += 1;
                self.device.free(bytes);
            }
            Memory::Cache {
                cache,
                bin,
                size,
                requested,
            } => {
                let c = &mut self.caches[cache];
                c.stats.active_blocks -= 1;
                c.stats.active_requested_bytes -= requested;
                c.stats.active_rounded_bytes -= size;
                c.stats.held_blocks += 1;
                c.stats.held_bytes += size;
                c.held.entry(bin).or_insert((size, 0)).1 += 1;
            }
        }
        Ok(())
    }

    /// `set_buffer_pool_config`: refused while a stream holds a stack; frees the stack memory.
    pub(super) fn config(&mut self, size: usize, count: usize) -> Result<(), Refusal> {
        let config = PoolConfig::new(size, count).map_err(|_| Refusal::InvalidConfig)?;
        if let Some(stacks) = &self.device.stacks {
            let held = stacks.held_count();
            if held > 0 {
                return Err(Refusal::ConfigInUse { held });
            }
            let bytes = stacks.config.total_bytes();
            self.device.free(bytes);
            self.device.stacks = None;
        }
        self.device.config = config;
        Ok(())
    }

    /// `MixMemory::cpu(n)`: a new, zeroed host side when more is asked.
    pub(super) fn mix_cpu(&mut self, n: usize) -> Result<(), Refusal> {
        if self.mix.host.len() >= n {
            return Ok(());
        }
        self.mix_release(true);
        // Pinned memory is not held against the limit, only against the address space.
        if n.checked_next_multiple_of(HOST_ALIGN)
            .is_none_or(|s| s > isize::MAX as usize)
        {
            return Err(Refusal::OutOfMemory);
        }
        self.device.pinned += n;
        self.mix.host = vec![0; n];
        self.mix.reallocations += 1;
        Ok(())
    }

    /// `MixMemory::gpu::<T>(len)`: a new, zeroed device side when more is asked (the old one is
    /// freed first, so a failed allocation leaves none).
    pub(super) fn mix_gpu(&mut self, len: usize, elem: Elem) -> Result<(), Refusal> {
        let bytes = len.checked_mul(elem.size()).ok_or(Refusal::SizeOverflow)?;
        if self.mix.gpu.len() >= bytes {
            return Ok(());
        }
        self.mix_release(false);
        if !self.device.alloc(bytes) {
            return Err(Refusal::OutOfMemory);
        }
        self.mix.gpu = vec![0; bytes];
        self.mix.reallocations += 1;
        Ok(())
    }

    /// A copy of as many bytes as both sides hold.
    pub(super) fn mix_copy(&mut self, to_gpu: bool) {
        let n = self.mix.host.len().min(self.mix.gpu.len());
        let MixModel { host, gpu, .. } = &mut self.mix;
        if to_gpu {
            gpu[..n].copy_from_slice(&host[..n]);
        } else {
            host[..n].copy_from_slice(&gpu[..n]);
        }
    }

    pub(super) fn mix_release(&mut self, cpu: bool) {
        if cpu {
            self.device.pinned -= self.mix.host.len();
            self.mix.host = Vec::new();
        } else if !self.mix.gpu.is_empty() {
            self.device.free(self.mix.gpu.len());
            self.mix.gpu = Vec::new();
        }
    }

    /// Every count of the device: its dropped streams' and its live ones'.
    pub(super) fn device_counts(&self) -> Counts {
        let mut all = self.device.retired;
        for s in &self.streams {
            all.add(&s.counts);
        }
        all
    }
}

pub(super) fn reason_index(reason: FallbackReason) -> usize {
    REASONS
        .iter()
        .position(|&r| r == reason)
        .expect("every reason is listed")
}
