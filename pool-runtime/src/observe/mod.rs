//! What the pool reports: counters and stats, every device's report, the opt-in recordings of
//! takes and releases (exported as a trace and a chart with `timeline`), what a piece of work took
//! of a stack ([`Sizing`]), and the symmetric-stack check across ranks.

pub(crate) mod recordings;
pub(crate) mod report;
#[cfg(feature = "timeline")]
pub mod timeline;

pub use crate::core::record::{RecordEntry, RecordKind, StreamRecording};
pub use crate::core::stack::LayoutTrace;
pub use crate::core::stats::{DeviceStats, FallbackCounts, SiteFallbacks, StreamStats};
pub use crate::core::stream::Sizing;
pub use crate::core::symmetric::check_symmetric;
pub use crate::storage::backend::calls::DriverCalls;
pub use report::{Report, report};
