//! Configuration: one [`DeviceConfig`] value per device, and OpenCV's global switch.
//!
//! Precedence, highest first: what the program set ([`Device::configure`](crate::Device::configure),
//! or one of the setters that wrap it, such as
//! [`set_buffer_pool_config`](crate::compat::opencv::set_buffer_pool_config)), then the `GPU_POOL_CONF`
//! environment variable (read once, at first use), then the device's defaults
//! ([`Device::config`](crate::Device::config) says which apply). Pooling on or off
//! ([`set_buffer_pool_usage`], the `usage` key) is process-wide, as in OpenCV.

use std::fmt;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::base::error::PoolError;
use crate::base::layout::align_up;

/// The environment variable read at first use, e.g.
/// `GPU_POOL_CONF="stack_size=64MiB,stack_count=2,fallback=stream_ordered"`.
///
/// Keys: `stack_size` (bytes, or with a `KiB`/`MiB`/`GiB` suffix), `stack_count`, `growable`
/// (`on`/`off`: see [`Stacks`]; with `on`, `stack_size` is what is mapped at a stream's start and
/// `stack_count` is refused), `fallback` (`driver`, `stream_ordered`, `caching`, `error`), `usage`
/// (`on`/`off`, process-wide), `strict_lifo` (`on`/`off`), `record` (events per stream to record,
/// for the timeline), `packing` (`cuda`/`opencv`, see [`Packing`]), `exact_live_peak`
/// (`on`/`off`), `memory_limit` (a size, or `none`). Every key but `usage` is a field of
/// [`DeviceConfig`] ([`DeviceConfig::from_env`]).
pub const ENV_VAR: &str = "GPU_POOL_CONF";

const MIB: usize = 1 << 20;

/// The size and number of the stacks of one device (OpenCV's `setBufferPoolConfig` arguments).
///
/// ```
/// use gpu_pool::config::PoolConfig;
/// let config = PoolConfig::new(64 << 20, 2)?;
/// assert_eq!(config.total_bytes(), 128 << 20);
/// assert_eq!(PoolConfig::default(), PoolConfig::new(10 << 20, 5)?);
/// # Ok::<(), gpu_pool::PoolError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PoolConfig {
    stack_size: usize,
    stack_count: usize,
}

impl PoolConfig {
    /// The alignment a stack size is rounded up to. Every stack starts on this boundary, a multiple
    /// of the texture alignment of every CUDA device to date; in a stack, a 2D buffer starts on the
    /// texture alignment and a row or column at the end of the block below it, rounded up to 256
    /// bytes, or to 64 as in OpenCV with [`Packing::OpenCv`] (and to `align_of::<T>()` where that
    /// is more).
    pub const STACK_ALIGN: usize = 4096;

    /// Validates a config: both numbers must be non-zero, and `stack_size` is rounded **up** to a
    /// multiple of [`PoolConfig::STACK_ALIGN`] (so a config never holds less than asked).
    pub fn new(stack_size: usize, stack_count: usize) -> Result<PoolConfig, PoolError> {
        let invalid = |reason: String| PoolError::InvalidConfig { reason };
        if stack_size == 0 {
            return Err(invalid(
                "stack_size is 0; give each stack at least one byte (the default is 10 MiB)".into(),
            ));
        }
        if stack_count == 0 {
            return Err(invalid(
                "stack_count is 0; use set_buffer_pool_usage(false) to turn pooling off".into(),
            ));
        }
        let stack_size = align_up(stack_size, Self::STACK_ALIGN)
            .filter(|size| size.checked_mul(stack_count).is_some())
            .ok_or_else(|| {
                invalid(format!(
                    "{stack_count} stacks of {stack_size} bytes overflow the address space; use \
                     fewer or smaller stacks"
                ))
            })?;
        Ok(PoolConfig {
            stack_size,
            stack_count,
        })
    }

    /// Bytes of each stack.
    #[must_use]
    pub fn stack_size(&self) -> usize {
        self.stack_size
    }

    /// Number of stacks, so the number of streams that can pool at once.
    #[must_use]
    pub fn stack_count(&self) -> usize {
        self.stack_count
    }

    /// Bytes of the one allocation that holds every stack.
    #[must_use]
    pub fn total_bytes(&self) -> usize {
        // Cannot overflow: checked in `new`.
        self.stack_size * self.stack_count
    }

    /// This config as a `GPU_POOL_CONF` value, which parses back to it.
    ///
    /// ```
    /// use gpu_pool::{config::{EnvConfig, PoolConfig}};
    /// let config = PoolConfig::new(12 << 20, 3)?;
    /// assert_eq!(config.env_value(), "stack_size=12MiB,stack_count=3");
    /// let parsed = EnvConfig::parse(&config.env_value())?;
    /// assert_eq!((parsed.stack_size, parsed.stack_count), (Some(12 << 20), Some(3)));
    /// # Ok::<(), gpu_pool::PoolError>(())
    /// ```
    #[must_use]
    pub fn env_value(&self) -> String {
        let size = match self.stack_size {
            s if s % (1 << 20) == 0 => format!("{}MiB", s >> 20),
            s => format!("{}KiB", s >> 10), // a multiple of STACK_ALIGN
        };
        format!("stack_size={size},stack_count={}", self.stack_count)
    }
}

impl Default for PoolConfig {
    /// OpenCV's default: 5 stacks of 10 MiB.
    fn default() -> Self {
        PoolConfig {
            stack_size: 10 * MIB,
            stack_count: 5,
        }
    }
}

/// Where a buffer comes from when the stack cannot serve it (OpenCV's "default allocator").
///
/// ```
/// use gpu_pool::{config::Fallback, Device};
/// let device = Device::private_host();
/// let mut config = device.config()?;
/// config.fallback = Fallback::Error;
/// device.configure(config)?;
/// assert_eq!(device.fallback()?, Fallback::Error);
/// # Ok::<(), gpu_pool::PoolError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Fallback {
    /// `cuMemAlloc`/`cuMemAllocPitch` and `cuMemFree`, as OpenCV's `DefaultAllocator`. The free
    /// synchronizes the device.
    Driver,
    /// `cuMemAllocFromPoolAsync`/`cuMemFreeAsync` on the buffer's stream, from a memory pool of our
    /// own with its release threshold raised. The default where the device supports it.
    StreamOrdered,
    /// The device's binned [`CachingPool`](crate::alloc::CachingPool): freed blocks are held and reused by
    /// requests of the same size bin, with no driver call.
    Caching,
    /// No fallback: a request the stack cannot serve is `PoolError::StackExhausted`.
    Error,
}

impl Fallback {
    fn parse(text: &str) -> Option<Fallback> {
        match text {
            "driver" => Some(Fallback::Driver),
            "stream_ordered" => Some(Fallback::StreamOrdered),
            "caching" => Some(Fallback::Caching),
            "error" => Some(Fallback::Error),
            _ => None,
        }
    }
}

/// Where a row or column block starts on a stack: on 256 bytes, as every `cudaMalloc` and RMM
/// allocation does (the default), or packed on 64 bytes, as OpenCV's `StackAllocator` packs them.
///
/// A 2D block starts on the device's texture alignment (512 bytes on current GPUs and on the host
/// backend) either way. Libraries that assume `cudaMalloc`'s alignment (vectorized loads, TMA
/// descriptors, RMM's own tests) need [`Packing::Cuda`]; [`Packing::OpenCv`] saves up to 192
/// bytes of padding per row or column that follows a block ending off a 256-byte boundary (none
/// of the examples' stacks is smaller for it: BENCHMARKS.md, section P).
///
/// ```
/// use gpu_pool::{compat::opencv::BufferPool, Device, GpuRead, PoolError, Stream, config::Packing};
/// let device = Device::private_host();
/// assert_eq!(device.packing()?, Packing::Cuda);
/// let stream = Stream::new(&device)?;
/// let pool = BufferPool::new(&stream);
/// let (a, b) = (pool.get_buffer_1d::<u8>(10)?, pool.get_buffer_1d::<u8>(10)?);
/// assert_eq!(b.device_ptr() - a.device_ptr(), 256);
/// # drop((b, a));
/// let mut config = device.config()?;
/// config.packing = Packing::OpenCv;
/// device.configure(config)?; // for streams made from now on
/// let stream = Stream::new(&device)?;
/// let pool = BufferPool::new(&stream);
/// let (a, b) = (pool.get_buffer_1d::<u8>(10)?, pool.get_buffer_1d::<u8>(10)?);
/// assert_eq!(b.device_ptr() - a.device_ptr(), 64);
/// # drop((b, a));
/// # Ok::<(), PoolError>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Packing {
    /// Every block starts on a multiple of 256 bytes, `cudaMalloc`'s guarantee. The default.
    #[default]
    Cuda,
    /// Rows and columns pack on 64 bytes, as in OpenCV (`GPU_POOL_CONF=packing=opencv`).
    OpenCv,
}

impl Packing {
    /// The multiple of which a row or column block starts (a 2D block starts on the larger of
    /// this and the texture alignment): 256 or 64.
    #[must_use]
    pub const fn block_align(self) -> usize {
        match self {
            Packing::Cuda => 256,
            Packing::OpenCv => 64,
        }
    }

    fn parse(text: &str) -> Option<Packing> {
        match text {
            "cuda" => Some(Packing::Cuda),
            "opencv" => Some(Packing::OpenCv),
            _ => None,
        }
    }
}

/// What `GPU_POOL_CONF` says; unset keys are `None`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EnvConfig {
    /// `stack_size=`.
    pub stack_size: Option<usize>,
    /// `stack_count=`.
    pub stack_count: Option<usize>,
    /// `fallback=`.
    pub fallback: Option<Fallback>,
    /// `usage=`.
    pub usage: Option<bool>,
    /// `strict_lifo=`.
    pub strict_lifo: Option<bool>,
    /// `record=`: events per stream to record (see
    /// [`Device::set_recording`](crate::Device::set_recording)).
    pub record: Option<usize>,
    /// `packing=`: `cuda` or `opencv` (see [`Packing`]).
    pub packing: Option<Packing>,
    /// `growable=`: growable stacks (`on`) or fixed ones (`off`); see [`Stacks`].
    pub growable: Option<bool>,
    /// `exact_live_peak=` (see [`DeviceConfig::exact_live_peak`]).
    pub exact_live_peak: Option<bool>,
    /// `memory_limit=`: a size, or `none` (`Some(None)`); see [`DeviceConfig::memory_limit`].
    pub memory_limit: Option<Option<usize>>,
}

impl EnvConfig {
    /// Parses a `GPU_POOL_CONF` value: comma-separated `key=value` pairs, spaces allowed around
    /// them. Unknown keys, repeated keys and bad values are errors, never ignored.
    ///
    /// ```
    /// use gpu_pool::{config::{EnvConfig, Fallback}};
    /// let conf = EnvConfig::parse("stack_size=64MiB, stack_count=2, fallback=stream_ordered")?;
    /// assert_eq!(conf.stack_size, Some(64 << 20));
    /// assert_eq!(conf.fallback, Some(Fallback::StreamOrdered));
    /// assert!(EnvConfig::parse("stack_size=lots").is_err());
    /// # Ok::<(), gpu_pool::PoolError>(())
    /// ```
    pub fn parse(value: &str) -> Result<EnvConfig, PoolError> {
        let fail = |reason: String| PoolError::InvalidEnvConfig {
            value: value.to_owned(),
            reason,
        };
        let mut conf = EnvConfig::default();
        for item in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, val) = item
                .split_once('=')
                .map(|(k, v)| (k.trim(), v.trim()))
                .ok_or_else(|| fail(format!("`{item}` is not key=value")))?;
            let bad = |what: &str| fail(format!("`{key}={val}`: {what}"));
            let duplicate = || fail(format!("`{key}` is given twice"));
            match key {
                "stack_size" => {
                    let size = parse_size(val).ok_or_else(|| {
                        bad("expected a size such as 67108864, 64MiB, 512KiB or 1GiB")
                    })?;
                    conf.stack_size
                        .replace(size)
                        .map_or(Ok(()), |_| Err(duplicate()))?;
                }
                "stack_count" => {
                    let count = val.parse().map_err(|_| bad("expected a whole number"))?;
                    conf.stack_count
                        .replace(count)
                        .map_or(Ok(()), |_| Err(duplicate()))?;
                }
                "fallback" => {
                    let fallback = Fallback::parse(val)
                        .ok_or_else(|| bad("expected driver, stream_ordered, caching or error"))?;
                    conf.fallback
                        .replace(fallback)
                        .map_or(Ok(()), |_| Err(duplicate()))?;
                }
                "record" => {
                    let events = val
                        .parse()
                        .map_err(|_| bad("expected a whole number of events"))?;
                    conf.record
                        .replace(events)
                        .map_or(Ok(()), |_| Err(duplicate()))?;
                }
                "packing" => {
                    let packing =
                        Packing::parse(val).ok_or_else(|| bad("expected cuda or opencv"))?;
                    conf.packing
                        .replace(packing)
                        .map_or(Ok(()), |_| Err(duplicate()))?;
                }
                "memory_limit" => {
                    let limit = match val {
                        "none" => None,
                        _ => Some(parse_size(val).ok_or_else(|| {
                            bad("expected a size such as 8GiB or 512MiB, or none")
                        })?),
                    };
                    conf.memory_limit
                        .replace(limit)
                        .map_or(Ok(()), |_| Err(duplicate()))?;
                }
                "usage" | "strict_lifo" | "growable" | "exact_live_peak" => {
                    let on = parse_switch(val).ok_or_else(|| bad("expected on or off"))?;
                    let slot = match key {
                        "usage" => &mut conf.usage,
                        "strict_lifo" => &mut conf.strict_lifo,
                        "growable" => &mut conf.growable,
                        _ => &mut conf.exact_live_peak,
                    };
                    slot.replace(on).map_or(Ok(()), |_| Err(duplicate()))?;
                }
                _ => {
                    return Err(fail(format!(
                        "unknown key `{key}`; expected one of stack_size, stack_count, growable, \
                         fallback, usage, strict_lifo, record, packing, exact_live_peak, \
                         memory_limit"
                    )));
                }
            }
        }
        if conf.growable == Some(true) && conf.stack_count.is_some() {
            return Err(fail(
                "growable=on gives every stream a stack of its own: drop stack_count (stack_size \
                 is what is mapped at a stream's start)"
                    .into(),
            ));
        }
        if let (Some(size), Some(count)) = (conf.stack_size, conf.stack_count) {
            PoolConfig::new(size, count).map_err(|e| fail(e.to_string()))?;
        } else if conf.stack_size == Some(0) || conf.stack_count == Some(0) {
            return Err(fail("stack_size and stack_count must not be 0".into()));
        }
        Ok(conf)
    }

    /// The configuration this environment asks for: `base` with every key the variable sets
    /// replaced (all but `usage`, which is process-wide). A stack size or count without
    /// `growable=on` means fixed stacks, with the other number from `base` (its fixed stacks', or
    /// the default's).
    ///
    /// ```
    /// use gpu_pool::{config::DeviceConfig, config::EnvConfig, config::Fallback, config::Stacks};
    /// let base = DeviceConfig::default();
    /// let conf = EnvConfig::parse("growable=on, stack_size=4MiB, fallback=driver")?.over(base)?;
    /// assert_eq!(conf.stacks, Stacks::Growable { mapped: 4 << 20 });
    /// assert_eq!(conf.fallback, Fallback::Driver);
    /// # Ok::<(), gpu_pool::PoolError>(())
    /// ```
    pub fn over(&self, base: DeviceConfig) -> Result<DeviceConfig, PoolError> {
        let fixed = match base.stacks {
            Stacks::Fixed(config) => config,
            Stacks::Growable { .. } => PoolConfig::default(),
        };
        let sized = self.stack_size.is_some() || self.stack_count.is_some();
        let stacks = match (self.growable, base.stacks) {
            (Some(true), Stacks::Growable { mapped }) => Stacks::Growable {
                mapped: self.stack_size.unwrap_or(mapped),
            },
            (Some(true), Stacks::Fixed(config)) => Stacks::Growable {
                mapped: self.stack_size.unwrap_or(config.stack_size),
            },
            (Some(false), _) | (None, _) if sized || self.growable == Some(false) => {
                Stacks::Fixed(PoolConfig::new(
                    self.stack_size.unwrap_or(fixed.stack_size),
                    self.stack_count.unwrap_or(fixed.stack_count),
                )?)
            }
            (_, stacks) => stacks,
        };
        Ok(DeviceConfig {
            stacks,
            fallback: self.fallback.unwrap_or(base.fallback),
            strict_lifo: self.strict_lifo.unwrap_or(base.strict_lifo),
            packing: self.packing.unwrap_or(base.packing),
            record: self.record.unwrap_or(base.record),
            exact_live_peak: self.exact_live_peak.unwrap_or(base.exact_live_peak),
            memory_limit: self.memory_limit.unwrap_or(base.memory_limit),
        })
    }
}

/// The stacks a device's streams get.
///
/// ```
/// use gpu_pool::{config::PoolConfig, config::Stacks};
/// let fixed = Stacks::Fixed(PoolConfig::new(64 << 20, 2)?);
/// assert_eq!(fixed.to_string(), "64.00 MiB x 2 stacks");
/// assert_eq!(Stacks::Growable { mapped: 8 << 20 }.to_string(), "growable stacks, 8.00 MiB mapped at a stream's start");
/// # Ok::<(), gpu_pool::PoolError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Stacks {
    /// OpenCV's: this many stacks of this size, in one allocation made when a stream first needs
    /// a stack; a stream without a free one falls back until one is given back.
    Fixed(PoolConfig),
    /// A stack of its own for every stream: a reservation as large as the device's memory, of
    /// which `mapped` bytes are mapped when the stream gets it and more in granules (2 MiB on the
    /// H100) only when the top passes the mapped end. Below it a take is the same bump as on a
    /// fixed stack; buffers never move; there is no count of stacks. Memory stays mapped until
    /// [`Stream::trim`](crate::Stream::trim), the stream's drop, or an out-of-memory elsewhere on
    /// the device ([`Device::reclaim_idle`](crate::Device::reclaim_idle)). Needs virtual memory
    /// management (`PoolError::Unsupported` without it; the host backend models it): the default
    /// on CUDA devices that have it.
    Growable {
        /// Bytes mapped when a stream gets its stack (0: all on demand).
        mapped: usize,
    },
}

impl Stacks {
    /// The stack size and count this stands for: a fixed config, or for growable stacks the
    /// bytes mapped at a stream's start (at least [`PoolConfig::STACK_ALIGN`]) with the default
    /// count, as the sizing report and recordings show them.
    pub(crate) fn pool_config(self) -> PoolConfig {
        match self {
            Stacks::Fixed(config) => config,
            Stacks::Growable { mapped } => {
                PoolConfig::new(mapped.max(1), PoolConfig::default().stack_count)
                    .unwrap_or_default()
            }
        }
    }
}

impl fmt::Display for Stacks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |bytes: usize| bytes as f64 / MIB as f64;
        match self {
            Stacks::Fixed(c) => {
                write!(f, "{:.2} MiB x {} stacks", mib(c.stack_size), c.stack_count)
            }
            Stacks::Growable { mapped } => write!(
                f,
                "growable stacks, {:.2} MiB mapped at a stream's start",
                mib(*mapped)
            ),
        }
    }
}

/// Everything a device is configured with, as one value: what
/// [`Device::config`](crate::Device::config) reads and
/// [`Device::configure`](crate::Device::configure) applies at once.
///
/// [`Device::configure`](crate::Device::configure) is the one rule for streams that exist: **a stream keeps what it was made
/// with** (its fallback, packing, strict LIFO, recording, exact peak counting, and the stack it
/// holds); the new value holds for streams made from then on, and for a stream made earlier that
/// takes its first stack later (it gets the stacks configured then). Two settings are the
/// device's own and so reach every stream at once: the [`memory_limit`](Self::memory_limit), and
/// fixed stacks' memory, which is one allocation: changing their size or count frees it, so it is
/// refused with `PoolError::ConfigInUse` (and nothing changes) while a stream holds one of them.
///
/// ```
/// use gpu_pool::{Device, config::DeviceConfig, config::Fallback, config::PoolConfig, config::Stacks, Stream};
/// let device = Device::private_host();
/// let mut config = device.config()?;
/// config.stacks = Stacks::Fixed(PoolConfig::new(4 << 20, 2)?);
/// config.fallback = Fallback::Error;
/// device.configure(config.clone())?;
/// assert_eq!(device.config()?, config);
/// let stream = Stream::new(&device)?; // made with Fallback::Error
/// # Ok::<(), gpu_pool::PoolError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceConfig {
    /// The stacks streams get. Default: growable on a CUDA device with virtual memory management
    /// (10 MiB mapped at a stream's start), else OpenCV's 5 fixed stacks of 10 MiB.
    pub stacks: Stacks,
    /// Where a buffer the stack cannot serve comes from. Default: [`Fallback::StreamOrdered`]
    /// where the device supports it, else [`Fallback::Driver`].
    pub fallback: Fallback,
    /// A stack buffer released out of LIFO order makes its explicit release return
    /// `PoolError::LifoViolation` (the memory is still reclaimed correctly). Default: off.
    pub strict_lifo: bool,
    /// Where row and column blocks start on a stack (see [`Packing`]). Default: [`Packing::Cuda`].
    pub packing: Packing,
    /// Takes and releases each stream records, for the timeline and
    /// [`Device::recordings`](crate::Device::recordings) (0: none, the default).
    pub record: usize,
    /// Every take and release of the streams made from now on adds to one device-wide atomic
    /// total, so [`DeviceStats::peak_live_bytes`](crate::observe::DeviceStats::peak_live_bytes) misses no
    /// moment when several streams held more together. Default: off, as the shared atomic costs
    /// every take and release (BENCHMARKS Q); the default samples the sum when a stream passes its
    /// own high and at every stats read.
    pub exact_live_peak: bool,
    /// A cap on what the device's pools may hold at once (CuPy's `set_limit`): every driver
    /// allocation through them counts (stack memory, mapped growable stacks, fallbacks, the
    /// caching pool's blocks, `GpuMat::new`, `SharedMat`, the stream-ordered pool's reserve); a
    /// request past it gives idle memory back and tries once more, then is
    /// `PoolError::OutOfMemory`. The device's own: it holds for existing streams at once. Memory
    /// already held stays. Default: none.
    pub memory_limit: Option<usize>,
}

impl Default for DeviceConfig {
    /// The defaults of a device without stream-ordered allocation or virtual memory management
    /// but for the fallback ([`Fallback::StreamOrdered`], which acts as [`Fallback::Driver`] where
    /// unsupported): 5 fixed stacks of 10 MiB, every switch off, no limit.
    fn default() -> Self {
        DeviceConfig {
            stacks: Stacks::Fixed(PoolConfig::default()),
            fallback: Fallback::StreamOrdered,
            strict_lifo: false,
            packing: Packing::Cuda,
            record: 0,
            exact_live_peak: false,
            memory_limit: None,
        }
    }
}

impl DeviceConfig {
    /// What `GPU_POOL_CONF` says, over [`DeviceConfig::default`]: the variable is read once per
    /// process; a malformed one is `PoolError::InvalidEnvConfig`. A device starts from its own
    /// defaults under the variable instead ([`Device::config`](crate::Device::config)), and what
    /// [`Device::configure`](crate::Device::configure) sets wins over both.
    pub fn from_env() -> Result<DeviceConfig, PoolError> {
        env_config()?.over(DeviceConfig::default())
    }

    /// As [`from_env`](Self::from_env), for a given `GPU_POOL_CONF` value.
    ///
    /// ```
    /// use gpu_pool::{config::DeviceConfig, config::Packing, PoolError, config::Stacks};
    /// let config = DeviceConfig::from_env_value("stack_size=64MiB,stack_count=2,packing=opencv")?;
    /// assert_eq!(config.stacks.to_string(), "64.00 MiB x 2 stacks");
    /// assert_eq!(config.packing, Packing::OpenCv);
    /// let err = DeviceConfig::from_env_value("growable=maybe").unwrap_err();
    /// assert!(matches!(err, PoolError::InvalidEnvConfig { .. }));
    /// # Ok::<(), PoolError>(())
    /// ```
    pub fn from_env_value(value: &str) -> Result<DeviceConfig, PoolError> {
        EnvConfig::parse(value)?.over(DeviceConfig::default())
    }
}

fn parse_size(text: &str) -> Option<usize> {
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let number: usize = digits.parse().ok()?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        _ => return None,
    };
    number.checked_mul(1 << shift)
}

fn parse_switch(text: &str) -> Option<bool> {
    match text {
        "on" | "true" | "1" => Some(true),
        "off" | "false" | "0" => Some(false),
        _ => None,
    }
}

/// `GPU_POOL_CONF`, read and parsed once for the whole process.
pub fn env_config() -> Result<&'static EnvConfig, PoolError> {
    static ENV: OnceLock<Result<EnvConfig, PoolError>> = OnceLock::new();
    ENV.get_or_init(|| match std::env::var(ENV_VAR) {
        Ok(value) => EnvConfig::parse(&value),
        Err(std::env::VarError::NotPresent) => Ok(EnvConfig::default()),
        Err(std::env::VarError::NotUnicode(raw)) => Err(PoolError::InvalidEnvConfig {
            value: raw.to_string_lossy().into_owned(),
            reason: "not valid UTF-8".into(),
        }),
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// The one order every setting is looked up in: what the program set, else `GPU_POOL_CONF`, else
/// the default. A malformed variable is an error only where nothing explicit overrides it.
pub(crate) fn setting<T>(
    explicit: Option<T>,
    from_env: impl FnOnce(&EnvConfig) -> Result<Option<T>, PoolError>,
    default: impl FnOnce() -> T,
) -> Result<T, PoolError> {
    match explicit {
        Some(value) => Ok(value),
        None => Ok(from_env(env_config()?)?.unwrap_or_else(default)),
    }
}

const UNSET: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;
static USAGE: AtomicU8 = AtomicU8::new(UNSET);

/// Turns stack pooling on or off for streams made from now on (OpenCV's `setBufferPoolUsage`).
///
/// Unlike OpenCV, pooling is **on by default**: stack memory is allocated only when a stream first
/// needs it, so being on costs nothing until used. A stream made while pooling was off takes a stack
/// at its first request after pooling is turned on, so OpenCV's "NG" ordering (streams declared
/// before the call) pools too.
///
/// ```
/// gpu_pool::compat::opencv::set_buffer_pool_usage(true);
/// assert!(gpu_pool::compat::opencv::buffer_pool_usage()?);
/// # Ok::<(), gpu_pool::PoolError>(())
/// ```
pub fn set_buffer_pool_usage(on: bool) {
    USAGE.store(if on { ON } else { OFF }, Ordering::Relaxed);
}

/// Whether stack pooling is on: the last [`set_buffer_pool_usage`], else `GPU_POOL_CONF`'s
/// `usage`, else on. Fails only if `GPU_POOL_CONF` is malformed.
pub fn buffer_pool_usage() -> Result<bool, PoolError> {
    let explicit = match USAGE.load(Ordering::Relaxed) {
        ON => Some(true),
        OFF => Some(false),
        _ => None,
    };
    setting(explicit, |env| Ok(env.usage), || true)
}
