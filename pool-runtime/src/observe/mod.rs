//! What the pool reports: counters and stats, every device's report, the opt-in recordings of
//! takes and releases (exported as a trace and a chart with `timeline`), what a piece of work took
//! of a stack ([`Sizing`]), and the symmetric-stack check across ranks.

pub(crate) mod recordings;
pub(crate) mod report;
#[cfg(feature = "timeline")]
pub mod timeline;

pub use crate::backend::calls::DriverCalls;
pub use crate::record::{RecordEntry, RecordKind, StreamRecording};
pub use crate::stack::LayoutTrace;
pub use crate::stats::{DeviceStats, FallbackCounts, SiteFallbacks, StreamStats};
pub use crate::stream::Sizing;
pub use crate::symmetric::check_symmetric;
pub use report::{Report, report};
