//! Which device: the identity that errors, counters, recordings and backends share, below all of
//! them.

use std::fmt;

/// Which device an error or a statistic belongs to.
///
/// ```
/// use gpu_pool::DeviceId;
/// assert_eq!(DeviceId::Cuda(1).to_string(), "cuda:1");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceId {
    /// A host-backend device; the number tells host devices apart (`0` is [`crate::Device::host`])
    /// and is never given to two devices of one process.
    Host(u64),
    /// A CUDA device, by ordinal.
    Cuda(usize),
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceId::Host(0) => f.write_str("host"),
            DeviceId::Host(n) => write!(f, "host#{n}"),
            DeviceId::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}
