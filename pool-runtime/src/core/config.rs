//! Global and per-device configuration, with OpenCV's names.
//!
//! Precedence, highest first: explicit calls ([`set_buffer_pool_usage`],
//! [`set_buffer_pool_config`](crate::set_buffer_pool_config), [`Device::set_fallback`](crate::Device::set_fallback), ...), then the
//! `GPU_POOL_CONF` environment variable (read once, at first use), then the defaults.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::error::PoolError;
use crate::layout::align_up;

/// The environment variable read at first use, e.g.
/// `GPU_POOL_CONF="stack_size=64MiB,stack_count=2,fallback=stream_ordered"`.
///
/// Keys: `stack_size` (bytes, or with a `KiB`/`MiB`/`GiB` suffix), `stack_count`, `fallback`
/// (`driver`, `stream_ordered`, `caching`, `error`), `usage` (`on`/`off`), `strict_lifo` (`on`/`off`),
/// `record` (events per stream to record, for `timeline`), `packing` (`cuda`/`opencv`, see
/// [`Packing`]).
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
/// device.set_fallback(Fallback::Error);
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
/// use gpu_pool::{BufferPool, Device, GpuRead, PoolError, Stream, config::Packing};
/// let device = Device::private_host();
/// assert_eq!(device.packing()?, Packing::Cuda);
/// let stream = Stream::new(&device)?;
/// let pool = BufferPool::new(&stream);
/// let (a, b) = (pool.get_buffer_1d::<u8>(10)?, pool.get_buffer_1d::<u8>(10)?);
/// assert_eq!(b.device_ptr() - a.device_ptr(), 256);
/// # drop((b, a));
/// device.set_packing(Packing::OpenCv); // streams made from now on
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
                "usage" | "strict_lifo" => {
                    let on = parse_switch(val).ok_or_else(|| bad("expected on or off"))?;
                    let slot = if key == "usage" {
                        &mut conf.usage
                    } else {
                        &mut conf.strict_lifo
                    };
                    slot.replace(on).map_or(Ok(()), |_| Err(duplicate()))?;
                }
                _ => {
                    return Err(fail(format!(
                        "unknown key `{key}`; expected one of stack_size, stack_count, fallback, \
                         usage, strict_lifo, record, packing"
                    )));
                }
            }
        }
        if let (Some(size), Some(count)) = (conf.stack_size, conf.stack_count) {
            PoolConfig::new(size, count).map_err(|e| fail(e.to_string()))?;
        } else if conf.stack_size == Some(0) || conf.stack_count == Some(0) {
            return Err(fail("stack_size and stack_count must not be 0".into()));
        }
        Ok(conf)
    }

    /// The pool config this environment asks for, over `base`.
    pub(crate) fn pool_config(&self, base: PoolConfig) -> Result<PoolConfig, PoolError> {
        PoolConfig::new(
            self.stack_size.unwrap_or(base.stack_size),
            self.stack_count.unwrap_or(base.stack_count),
        )
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
/// gpu_pool::config::set_buffer_pool_usage(true);
/// assert!(gpu_pool::config::buffer_pool_usage()?);
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
