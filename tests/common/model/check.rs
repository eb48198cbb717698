//! The checker: does each operation to the real pool and to the model, and compares them after
//! every step.
//!
//! - An operation succeeds where the model says so, and otherwise fails with the error the model
//!   names (its kind, and the fields the pool's rules decide), with a message.
//! - A new buffer comes from where the model says (stack, fallback and why, or nothing), with the
//!   model's row step, at the model's offset in its stack: OpenCV's `tip`, on the stream's packing
//!   for a row or a column (256 bytes, or 64 with `Packing::OpenCv`), on the texture alignment for
//!   2D.
//! - Live buffers never overlap, and each keeps what was written into it: read back before every
//!   release, on `Check`, and after every step where the driver asks.
//! - Each stream's counters equal the model's: stack in use (the end of its highest live block),
//!   high-water mark, peak demand, live bytes and buffers, stack and fallback allocations by reason,
//!   LIFO violations, driver calls.
//! - Where the run owns the device, the device's counters, both caching pools' statistics and
//!   every byte the host backend handed out equal the model's too, and at the end only the stack
//!   memory is left.
//!
//! A run is sessions: buffers borrow their streams, so the buffers of a session live until an
//! operation changes the set of streams (or the run ends), and are then released, newest first.

use std::sync::Arc;

use gpu_pool::testing::host_live_bytes;
use gpu_pool::{
    Device, GpuRead, PoolError, Source, Stream, alloc::CachingPool, compat::mix::MixMemory,
    compat::opencv::BufferPool, compat::opencv::buffer_pool_usage,
    compat::opencv::set_buffer_pool_config, compat::opencv::set_buffer_pool_usage,
    config::EnvConfig, config::Fallback, config::Packing,
};

use super::buffer::Buf;
use super::op::{Elem, Fill, Op, Shape, StreamKind};
use super::reference::{
    Content, Counts, DEVICE_CACHE, DeviceModel, Memory, Model, REASONS, RUN_CACHE, Refusal, Stacks,
};

/// How a run starts, and what it may assume.
pub struct Setup {
    /// `set_buffer_pool_config` before the run.
    pub stacks: Option<(usize, usize)>,
    /// `Device::set_fallback` before the run.
    pub fallback: Option<Fallback>,
    /// `Device::set_packing` before the run.
    pub packing: Option<Packing>,
    /// The memory limit the host device was made with (`Device::host_with_limit`).
    pub limit: Option<usize>,
    /// The caching pool of `StreamKind::Cached` streams; a new one if `None`.
    pub cache: Option<Arc<CachingPool>>,
    /// Other threads use the device and the caching pool at the same time: which stack a stream
    /// gets is seen rather than predicted, and only this run's streams and buffers are checked.
    pub shared: bool,
    /// Takes beyond this many live buffers do nothing.
    pub max_live: usize,
    /// `NewStream` beyond this many streams does nothing.
    pub max_streams: usize,
    /// Reads back every live buffer after every step, not only before a release or on `Check`.
    pub contents_every_step: bool,
}

impl Default for Setup {
    fn default() -> Setup {
        Setup {
            stacks: None,
            fallback: None,
            packing: None,
            limit: None,
            cache: None,
            shared: false,
            max_live: usize::MAX,
            max_streams: usize::MAX,
            contents_every_step: false,
        }
    }
}

/// What a run did.
#[derive(Clone, Copy, Debug, Default)]
pub struct Tally {
    pub ops: u64,
    /// Buffers taken that hold memory.
    pub takes: u64,
    /// Buffers read back and compared.
    pub checks: u64,
    pub bytes_checked: u64,
    /// Errors the model predicted.
    pub errors: u64,
}

impl Tally {
    pub fn add(&mut self, other: Tally) {
        self.ops += other.ops;
        self.takes += other.takes;
        self.checks += other.checks;
        self.bytes_checked += other.bytes_checked;
        self.errors += other.errors;
    }
}

/// Where the pool and the model part.
pub struct Mismatch(pub String);

/// The message alone, as a test's `Err` prints it.
impl std::fmt::Debug for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Mismatch {}

/// Returns from the check with a message if the pool's value is not the model's.
macro_rules! same {
    ($what:expr, $pool:expr, $model:expr) => {{
        let (pool, model) = (&$pool, &$model);
        if pool != model {
            return Err(format!(
                "{}: the pool has {pool:?}, the model {model:?}",
                $what
            ));
        }
    }};
}

macro_rules! ensure {
    ($cond:expr, $($why:tt)+) => {
        if !$cond {
            return Err(format!($($why)+));
        }
    };
}

/// Runs the operations `next` gives (it sees the model, to choose) until it gives `None`, then
/// releases and drops everything and checks what is left.
pub fn run(
    device: &Device,
    setup: Setup,
    mut next: impl FnMut(&Model) -> Option<Op>,
) -> Result<Tally, Mismatch> {
    let mut checker = Checker::new(device, setup)?;
    let mut streams = Vec::new();
    let mut mix = None;
    while let Some(op) = checker.session(&streams, &mut mix, &mut next)? {
        checker.change_streams(&mut streams, &op)?;
    }
    checker.finish(streams, mix)
}

/// [`run`] over a list.
pub fn run_ops(
    device: &Device,
    setup: Setup,
    ops: impl IntoIterator<Item = Op>,
) -> Result<Tally, Mismatch> {
    let mut ops = ops.into_iter();
    run(device, setup, |_| ops.next())
}

/// What a device should look like once every stream, buffer and `MixMemory` of it is gone: no
/// stack held, no cached block in use, and once `caches` free what they hold, nothing of what the
/// host backend handed out but the stack memory (and the `before` bytes it held already).
pub fn settled(device: &Device, caches: &[&CachingPool], before: usize) -> Result<(), Mismatch> {
    let check = || -> Result<(), String> {
        let stats = device.stats();
        same!("stacks held at the end", stats.stacks_held, 0);
        for cache in caches {
            same!(
                "cached blocks in use at the end",
                cache.stats().active_blocks,
                0
            );
            cache.free_held().map_err(|e| format!("free_held: {e}"))?;
        }
        let stacks = match (&stats.config, stats.stacks_allocated) {
            (Ok(config), true) => config.total_bytes(),
            (Err(e), true) => return Err(format!("allocated stacks without a config: {e}")),
            (_, false) => 0,
        };
        if let Some(live) = host_live_bytes(device) {
            ensure!(
                live == before + stacks,
                "memory leaked or double-counted: {live} bytes live, {before} before and {stacks} \
                 of stacks"
            );
        }
        Ok(())
    };
    check().map_err(Mismatch)
}

/// The device's counters and memory before the run: the model counts from them.
struct Base {
    alloc_calls: u64,
    free_calls: u64,
    counts: Counts,
    live: Option<usize>,
}

/// A run in progress: the pool's side and the model's.
struct Checker {
    device: Device,
    cache: Arc<CachingPool>,
    setup: Setup,
    model: Model,
    base: Base,
    /// The usage flag before a `Usage` operation changed it, put back at the end.
    usage_before: Option<bool>,
    /// Operations so far, the session ends' releases not counted.
    steps: usize,
    tally: Tally,
}

impl Drop for Checker {
    fn drop(&mut self) {
        if let Some(usage) = self.usage_before {
            set_buffer_pool_usage(usage);
        }
    }
}

/// Where two byte strings part: one `memcmp` when they do not, which a debug build runs fast.
pub(super) fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    (a != b).then(|| {
        let n = a.len().min(b.len());
        (0..n).find(|&i| a[i] != b[i]).unwrap_or(n)
    })
}

fn err(what: &str) -> impl FnOnce(PoolError) -> String + '_ {
    move |e| format!("{what}: {e}")
}

impl Checker {
    fn new(device: &Device, setup: Setup) -> Result<Checker, Mismatch> {
        let start = || -> Result<Checker, String> {
            if let Some((size, count)) = setup.stacks {
                set_buffer_pool_config(device, size, count).map_err(err("configuring"))?;
            }
            if let Some(fallback) = setup.fallback {
                device.set_fallback(fallback);
            }
            if let Some(packing) = setup.packing {
                device.set_packing(packing);
            }
            let cache = (setup.cache.clone()).unwrap_or_else(|| Arc::new(CachingPool::new(device)));
            if !setup.shared {
                // The model starts with no stack memory and nothing held.
                device
                    .release_stack_memory()
                    .map_err(err("the device is in use"))?;
                cache.free_held().map_err(err("free_held"))?;
                device
                    .caching_pool()
                    .free_held()
                    .map_err(err("free_held"))?;
            }
            let stats = device.stats();
            let base = Base {
                alloc_calls: stats.driver_alloc_calls,
                free_calls: stats.driver_free_calls,
                counts: Counts::of(
                    stats.stack_allocations,
                    &stats.fallback_allocations,
                    stats.lifo_violations,
                ),
                live: host_live_bytes(device),
            };
            let model = Model::new(
                DeviceModel {
                    texture: device.texture_alignment(),
                    host: device.is_host(),
                    stream_ordered: device.supports_stream_ordered(),
                    shared: setup.shared,
                    limit: setup.limit.unwrap_or(usize::MAX),
                    config: device.pool_config().map_err(err("the config"))?,
                    stacks: None,
                    usage: buffer_pool_usage().map_err(err("the usage flag"))?,
                    fallback: device.fallback().map_err(err("the fallback"))?,
                    strict: device.strict_lifo().map_err(err("strict LIFO"))?,
                    packing: device.packing().map_err(err("the packing"))?,
                    bytes: 0,
                    pinned: 0,
                    alloc_calls: 0,
                    free_calls: 0,
                    failed_allocs: 0,
                    retired: Counts::default(),
                },
                [cache.stats(), device.caching_pool().stats()],
            );
            Ok(Checker {
                device: device.clone(),
                cache,
                setup,
                model,
                base,
                usage_before: None,
                steps: 0,
                tally: Tally::default(),
            })
        };
        start().map_err(|what| Mismatch(format!("setting up: {what}")))
    }

    fn at(&self, op: &Op, what: String) -> Mismatch {
        Mismatch(format!("step {} ({op:?}): {what}", self.steps))
    }

    /// Runs operations on `streams` until one changes them (returned) or there are no more.
    fn session(
        &mut self,
        streams: &[Stream],
        mix: &mut Option<MixMemory<'static>>,
        next: &mut impl FnMut(&Model) -> Option<Op>,
    ) -> Result<Option<Op>, Mismatch> {
        let mut live = Vec::new();
        let stop = loop {
            let Some(op) = next(&self.model) else {
                break None;
            };
            if op.changes_streams() {
                break Some(op);
            }
            self.steps += 1;
            self.tally.ops += 1;
            self.apply(streams, &mut live, mix, &op)
                .map_err(|what| self.at(&op, what))?;
        };
        let end = Op::ReleaseAll;
        self.apply(streams, &mut live, mix, &end)
            .map_err(|what| self.at(&end, format!("ending the session: {what}")))?;
        Ok(stop)
    }

    fn change_streams(&mut self, streams: &mut Vec<Stream>, op: &Op) -> Result<(), Mismatch> {
        self.steps += 1;
        self.tally.ops += 1;
        let mut change = || -> Result<(), String> {
            match *op {
                Op::NewStream(kind) if streams.len() < self.setup.max_streams => {
                    let made = match kind {
                        StreamKind::Stack => Stream::new(&self.device),
                        StreamKind::Cached => {
                            Stream::with_allocator(&self.device, self.cache.clone())
                        }
                    };
                    let made = made.map_err(err("making a stream"))?;
                    self.model.new_stream(kind, made.stack_index());
                    streams.push(made);
                }
                Op::DropStream(n) => {
                    if let Some(s) = self.model.stream_index(n) {
                        drop(streams.remove(s));
                        self.model.drop_stream(s);
                    }
                }
                _ => {}
            }
            self.check_state(streams, &[])
        };
        change().map_err(|what| self.at(op, what))
    }

    fn apply<'s>(
        &mut self,
        streams: &'s [Stream],
        live: &mut Vec<Buf<'s>>,
        mix: &mut Option<MixMemory<'static>>,
        op: &Op,
    ) -> Result<(), String> {
        match op {
            &Op::Take {
                stream,
                shape,
                elem,
                fill,
            } => self.take(streams, live, stream, (shape, elem), fill)?,
            &Op::Release(pick) => {
                if let Some(i) = self.model.pick(pick) {
                    self.release(live, i)?;
                }
            }
            &Op::Check(pick) => {
                if let Some(i) = self.model.pick(pick) {
                    self.verify(&live[i], i)?;
                }
            }
            Op::ReleaseAll => {
                for i in (0..live.len()).rev() {
                    self.release(live, i)?;
                }
            }
            &Op::Config {
                stack_size,
                stack_count,
            } => {
                ensure!(
                    !self.setup.shared,
                    "a shared run cannot predict a config change"
                );
                let done = set_buffer_pool_config(&self.device, stack_size, stack_count);
                let expected = self.model.config(stack_size, stack_count);
                self.outcome(done, expected)?;
            }
            &Op::Usage(on) => {
                self.usage_before.get_or_insert(self.model.device.usage);
                set_buffer_pool_usage(on);
                self.model.device.usage = on;
            }
            &Op::Fallback(fallback) => {
                self.device.set_fallback(fallback);
                self.model.device.fallback = fallback;
            }
            &Op::StrictLifo(on) => {
                self.device.set_strict_lifo(on);
                self.model.device.strict = on;
            }
            &Op::Packing(packing) => {
                self.device.set_packing(packing);
                self.model.device.packing = packing;
            }
            Op::ParseEnv(text) => {
                if let Err(e) = EnvConfig::parse(text) {
                    self.outcome(Err(e), Err(Refusal::InvalidEnvConfig))?;
                }
            }
            Op::FreeHeld => {
                let freed = self.cache.free_held().map_err(err("free_held"))?;
                let expected = self.model.free_held(RUN_CACHE);
                if !self.setup.shared {
                    same!("bytes free_held freed", freed, expected);
                }
            }
            Op::MixCpu(_)
            | Op::MixGpu { .. }
            | Op::MixWrite(_)
            | Op::MixCopy { .. }
            | Op::MixRelease { .. } => {
                if mix.is_none() {
                    *mix = Some(MixMemory::new(&self.device).map_err(err("MixMemory::new"))?);
                }
                let mix = mix.as_mut().expect("made above");
                self.mix(streams, mix, op)?;
                self.check_mix(mix)?;
            }
            Op::NewStream(_) | Op::DropStream(_) => unreachable!("ends the session"),
        }
        self.check_state(streams, live)
    }

    /// What `fill` writes at this step.
    fn content(&self, fill: Fill) -> Content {
        match fill {
            Fill::Uniform => Content::Uniform((self.steps % 251) as u8 + 1),
            Fill::Pattern(seed) => Content::Pattern(seed),
        }
    }

    /// An error where the model predicts it, with a message; success where it predicts success.
    fn outcome(
        &mut self,
        done: Result<(), PoolError>,
        expected: Result<(), Refusal>,
    ) -> Result<(), String> {
        match (done, expected) {
            (Ok(()), Ok(())) => Ok(()),
            (Err(e), Err(refusal)) if refusal.matches(&e) => {
                ensure!(!e.to_string().is_empty(), "{e:?} says nothing");
                self.tally.errors += 1;
                Ok(())
            }
            (done, expected) => Err(format!(
                "the pool gave {done:?}, the model expects {expected:?}"
            )),
        }
    }

    fn take<'s>(
        &mut self,
        streams: &'s [Stream],
        live: &mut Vec<Buf<'s>>,
        stream: usize,
        (shape, elem): (Shape, Elem),
        fill: Fill,
    ) -> Result<(), String> {
        let Some(s) = self.model.stream_index(stream) else {
            return Ok(());
        };
        if live.len() >= self.setup.max_live {
            return Ok(());
        }
        let content = self.content(fill);
        let taken = Buf::take(&BufferPool::new(&streams[s]), shape, elem);
        let expected = self
            .model
            .take(s, shape, elem, content, streams[s].stack_index());
        let mut buf = match (taken, expected) {
            (Ok(buf), Ok(())) => buf,
            (taken, expected) => return self.outcome(taken.map(drop), expected),
        };
        let m = self.model.live.last().expect("the model's new buffer");
        same!("source", buf.source(), m.source);
        let (rows, cols, step) = buf.shape();
        same!("shape", (rows, cols), (m.layout.rows, m.layout.cols));
        match m.pitch {
            Some(pitch) => same!("step", step, pitch),
            None => ensure!(step >= m.layout.width, "step {step} below the row's bytes"),
        }
        if let Memory::Stack { offset, .. } = m.memory {
            let base = streams[s]
                .stack_range()
                .ok_or("a stack buffer without a stack")?;
            same!("offset in the stack", buf.ptr() - base.start, offset as u64);
        }
        if m.source != Source::Empty {
            self.tally.takes += 1;
        }
        buf.fill(content).map_err(err("filling"))?;
        live.push(buf);
        Ok(())
    }

    /// Reads live buffer `i` back.
    fn verify(&mut self, buf: &Buf<'_>, i: usize) -> Result<(), String> {
        let m = &self.model.live[i];
        let (wrong, bytes) = buf.compare(m.content).map_err(err("reading back"))?;
        self.tally.checks += 1;
        self.tally.bytes_checked += bytes as u64;
        let l = &m.layout;
        same!("bytes read back", bytes, l.rows * l.cols * l.elem.size());
        if let Some(at) = wrong {
            return Err(format!(
                "live buffer {i} ({}x{} {:?}, {:?}) was overwritten at byte {at}",
                l.rows, l.cols, l.elem, m.source
            ));
        }
        Ok(())
    }

    fn release(&mut self, live: &mut Vec<Buf<'_>>, i: usize) -> Result<(), String> {
        self.verify(&live[i], i)?;
        let done = live.remove(i).release();
        let expected = self.model.release(i);
        self.outcome(done, expected)
    }

    fn mix(
        &mut self,
        streams: &[Stream],
        mix: &mut MixMemory<'static>,
        op: &Op,
    ) -> Result<(), String> {
        match *op {
            Op::MixCpu(n) => {
                let done = mix.cpu::<u8>(n).map(|host| host.len());
                if let Ok(len) = done {
                    same!("host elements handed out", len, n);
                }
                let expected = self.model.mix_cpu(n);
                self.outcome(done.map(drop), expected)
            }
            Op::MixGpu { len, elem } => {
                let done = match elem {
                    Elem::U8 => mix.gpu::<u8>(len).map(|v| v.device_ptr()),
                    Elem::U32 => mix.gpu::<u32>(len).map(|v| v.device_ptr()),
                    Elem::Bgr => mix.gpu::<[u8; 3]>(len).map(|v| v.device_ptr()),
                    Elem::F64 => mix.gpu::<f64>(len).map(|v| v.device_ptr()),
                };
                let expected = self.model.mix_gpu(len, elem);
                self.outcome(done.map(drop), expected)
            }
            Op::MixWrite(fill) => {
                let bytes = self.content(fill).bytes(self.model.mix.host.len());
                let host = mix.cpu::<u8>(bytes.len()).map_err(err("cpu"))?;
                host.copy_from_slice(&bytes);
                self.model.mix.host = bytes;
                Ok(())
            }
            Op::MixCopy { stream, to_gpu } => {
                let Some(s) = self.model.stream_index(stream) else {
                    return Ok(());
                };
                let done = if to_gpu {
                    mix.copy_to_gpu_async(&streams[s])
                } else {
                    mix.copy_to_cpu_async(&streams[s])
                };
                self.model.mix_copy(to_gpu);
                self.outcome(done, Ok(()))
            }
            Op::MixRelease { cpu } => {
                let done = if cpu {
                    mix.release_cpu()
                } else {
                    mix.release_gpu()
                };
                self.model.mix_release(cpu);
                self.outcome(done, Ok(()))
            }
            _ => unreachable!("not a MixMemory operation"),
        }
    }

    /// Both sides hold what the model's do.
    fn check_mix(&self, mix: &mut MixMemory<'static>) -> Result<(), String> {
        let m = &self.model.mix;
        same!(
            "MixMemory capacity",
            mix.capacity(),
            (m.host.len(), m.gpu.len())
        );
        same!(
            "MixMemory reallocations",
            mix.reallocations(),
            m.reallocations
        );
        let host = mix.cpu::<u8>(m.host.len()).map_err(err("cpu"))?;
        if let Some(at) = first_difference(host, &m.host) {
            return Err(format!("MixMemory's host side differs at byte {at}"));
        }
        if self.model.device.host {
            // The host backend's device memory reads as host memory.
            let view = mix.gpu_view::<u8>(m.gpu.len()).map_err(err("gpu_view"))?;
            let rows: Vec<&[u8]> = view.host_rows().map_err(err("host_rows"))?.collect();
            if let Some(at) = first_difference(&rows.concat(), &m.gpu) {
                return Err(format!("MixMemory's device side differs at byte {at}"));
            }
        }
        Ok(())
    }

    /// Everything but the contents of the `MixMemory`, which only its operations change.
    fn check_state(&mut self, streams: &[Stream], live: &[Buf<'_>]) -> Result<(), String> {
        let model = &self.model;
        let mut spans: Vec<_> = live
            .iter()
            .zip(&model.live)
            .map(|(b, m)| b.span(m.layout.elem.size()))
            .filter(|s| !s.is_empty())
            .collect();
        spans.sort_by_key(|s| s.start);
        for pair in spans.windows(2) {
            ensure!(
                pair[0].end <= pair[1].start,
                "live buffers overlap: {pair:?}"
            );
        }
        for (i, stream) in streams.iter().enumerate() {
            self.check_stream(i, stream)
                .map_err(|what| format!("stream {i}: {what}"))?;
        }
        if !self.setup.shared {
            self.check_device()?;
        }
        if self.setup.contents_every_step {
            for (i, buf) in live.iter().enumerate() {
                self.verify(buf, i)?;
            }
        }
        Ok(())
    }

    fn check_stream(&self, i: usize, stream: &Stream) -> Result<(), String> {
        let (stats, m) = (stream.stats(), &self.model.streams[i]);
        let size = stream.stack_range().map(|r| (r.end - r.start) as usize);
        let stack = m.stack.as_ref().map(|k| (k.index, k.size));
        same!("stack and its size", stats.stack_index.zip(size), stack);
        same!(
            "stack in use, high-water mark, peak demand",
            (
                stats.stack_in_use,
                stats.stack_high_water,
                stats.peak_demand
            ),
            (m.top(), m.high_water, m.peak_demand)
        );
        let counts = Counts::of(
            stats.stack_allocations,
            &stats.fallback_allocations,
            stats.lifo_violations,
        );
        same!("counts", counts, m.counts);
        same!(
            "live bytes and buffers",
            (stats.live_bytes, stats.live_buffers),
            self.model.live_of(i)
        );
        if m.calls_known(self.setup.shared) {
            same!(
                "driver allocations and frees",
                (stats.driver_alloc_calls, stats.driver_free_calls),
                (m.driver_allocs, m.driver_frees)
            );
        }
        Ok(())
    }

    /// The device's counters and memory, and both caching pools' statistics.
    fn check_device(&self) -> Result<(), String> {
        let stats = self.device.stats();
        let (d, base) = (&self.model.device, &self.base);
        let held = d.stacks.as_ref().map_or(0, Stacks::held_count);
        same!(
            "stacks held, stack memory allocated, config",
            (stats.stacks_held, stats.stacks_allocated, stats.config.ok()),
            (held, d.stacks.is_some(), Some(d.effective_config()))
        );
        let in_use: usize = self.model.streams.iter().map(|s| s.top()).sum();
        same!("stack in use, all streams", stats.stack_in_use, in_use);
        let counts = Counts::of(
            stats.stack_allocations,
            &stats.fallback_allocations,
            stats.lifo_violations,
        );
        let mut expected = base.counts;
        expected.add(&self.model.device_counts());
        same!("counts, all streams", counts, expected);
        same!(
            "driver allocations and frees",
            (stats.driver_alloc_calls, stats.driver_free_calls),
            (
                base.alloc_calls + d.alloc_calls,
                base.free_calls + d.free_calls
            )
        );
        if let (Some(live), Some(before)) = (host_live_bytes(&self.device), base.live) {
            same!("bytes handed out", live, before + d.bytes + d.pinned);
        }
        same!(
            "the run's caching pool",
            self.cache.stats(),
            self.model.caches[RUN_CACHE].stats
        );
        same!(
            "the device's caching pool",
            self.device.caching_pool().stats(),
            self.model.caches[DEVICE_CACHE].stats
        );
        Ok(())
    }

    /// Drops everything the run made, checking that every stack block came back and, where the
    /// run owns the device, that every allocation but the stack memory's was freed.
    fn finish(
        mut self,
        mut streams: Vec<Stream>,
        mix: Option<MixMemory<'static>>,
    ) -> Result<Tally, Mismatch> {
        let end = || -> Result<(), String> {
            for (i, s) in streams.iter().enumerate() {
                s.synchronize().map_err(err("synchronize"))?;
                same!(
                    format!("stream {i}: stack in use at the end"),
                    s.stats().stack_in_use,
                    0
                );
            }
            if let Some(mix) = mix {
                drop(mix);
                self.model.mix_release(true);
                self.model.mix_release(false);
            }
            while !streams.is_empty() {
                drop(streams.remove(0));
                self.model.drop_stream(0);
            }
            self.check_state(&[], &[])?;
            if self.setup.shared {
                return Ok(());
            }
            let device_cache = self.device.caching_pool();
            for (c, cache) in [(RUN_CACHE, &self.cache), (DEVICE_CACHE, &device_cache)] {
                let freed = cache.free_held().map_err(err("free_held"))?;
                same!("bytes free_held freed", freed, self.model.free_held(c));
            }
            self.check_state(&[], &[])?;
            // Every allocation that succeeded was freed, but the stack memory's.
            let stats = self.device.stats();
            same!(
                "driver allocations not freed",
                stats.driver_alloc_calls - self.base.alloc_calls - self.model.device.failed_allocs,
                stats.driver_free_calls - self.base.free_calls + u64::from(stats.stacks_allocated)
            );
            settled(
                &self.device,
                &[&self.cache, &device_cache],
                self.base.live.unwrap_or(0),
            )
            .map_err(|m| m.0)
        };
        end().map_err(|what| Mismatch(format!("at the end: {what}")))?;
        Ok(self.tally)
    }
}
