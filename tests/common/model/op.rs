//! The operations: the union of what the proptest models, the fuzzer and the stress run do.
//!
//! Streams, buffers and the `MixMemory` are named by position, taken modulo how many there are,
//! so any generated value means something; an operation on nothing (no stream, no live buffer)
//! does nothing.

use gpu_pool::{config::Fallback, config::Packing};

/// One step of a randomized test.
#[derive(Clone, Debug)]
pub enum Op {
    /// A stream. Buffers borrow their stream, so this (and `DropStream`) first releases every
    /// live buffer, newest first, checking each.
    NewStream(StreamKind),
    /// Drops a stream.
    DropStream(usize),
    /// A buffer on a stream, filled at once.
    Take {
        stream: usize,
        shape: Shape,
        elem: Elem,
        fill: Fill,
    },
    /// Checks a live buffer's contents, then releases it: in or out of LIFO order.
    Release(Pick),
    /// Checks a live buffer's contents.
    Check(Pick),
    /// Releases every live buffer, newest first, checking each.
    ReleaseAll,
    /// `set_buffer_pool_config`.
    Config {
        stack_size: usize,
        stack_count: usize,
    },
    /// `set_buffer_pool_usage`: process-wide, so only for a test with a process of its own.
    Usage(bool),
    /// `Device::set_fallback`, for streams made from now on.
    Fallback(Fallback),
    /// `Device::set_strict_lifo`, for streams made from now on.
    StrictLifo(bool),
    /// `Device::set_packing`, for streams made from now on.
    Packing(Packing),
    /// `EnvConfig::parse`: a config or `InvalidEnvConfig`, never a panic.
    ParseEnv(String),
    /// `free_held` of the caching pool behind `StreamKind::Cached` streams.
    FreeHeld,
    /// `MixMemory::cpu::<u8>(n)`.
    MixCpu(usize),
    /// `MixMemory::gpu::<T>(len)`.
    MixGpu { len: usize, elem: Elem },
    /// Writes the whole host side.
    MixWrite(Fill),
    /// `copy_to_gpu_async` or `copy_to_cpu_async` on a stream.
    MixCopy { stream: usize, to_gpu: bool },
    /// `release_cpu` or `release_gpu`.
    MixRelease { cpu: bool },
}

impl Op {
    /// Whether it changes the set of streams, which no buffer may borrow then.
    pub(super) fn changes_streams(&self) -> bool {
        matches!(self, Op::NewStream(_) | Op::DropStream(_))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamKind {
    /// `Stream::new`: a stack of the device, with the device's fallback behind it.
    Stack,
    /// `Stream::with_allocator` on the run's caching pool: no stack.
    Cached,
}

#[derive(Clone, Copy, Debug)]
pub enum Shape {
    /// `get_buffer(rows, cols)`.
    Mat { rows: usize, cols: usize },
    /// `get_buffer_1d(len)`.
    Row(usize),
}

impl Shape {
    pub(super) fn dims(self) -> (usize, usize) {
        match self {
            Shape::Mat { rows, cols } => (rows, cols),
            Shape::Row(len) => (1, len),
        }
    }
}

/// The element types: sizes 1, 3, 4 and 8, alignments 1, 4 and 8.
#[derive(Clone, Copy, Debug)]
pub enum Elem {
    U8,
    U32,
    Bgr,
    F64,
}

impl Elem {
    pub(super) fn size(self) -> usize {
        match self {
            Elem::U8 => 1,
            Elem::Bgr => 3,
            Elem::U32 => 4,
            Elem::F64 => 8,
        }
    }

    pub(super) fn align(self) -> usize {
        match self {
            Elem::U8 | Elem::Bgr => 1,
            Elem::U32 => 4,
            Elem::F64 => 8,
        }
    }
}

/// What is written into a new buffer or the host side of the `MixMemory`.
#[derive(Clone, Copy, Debug)]
pub enum Fill {
    /// `set_to` one byte, from the step's position: 1 to 251, never the 0 of fresh memory, and
    /// rarely the same as a neighbour's.
    Uniform,
    /// An upload whose every byte depends on its position and the seed, so memory shifted or
    /// shared with another buffer shows.
    Pattern(u64),
}

/// Which live buffer an operation means.
#[derive(Clone, Copy, Debug)]
pub enum Pick {
    /// The nth of all, oldest first.
    Any(usize),
    /// The newest of a stream: a release in LIFO order.
    Newest(usize),
    /// The nth of a stream, oldest first.
    OfStream(usize, usize),
}
