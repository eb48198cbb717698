//! What the pool reports: every device's stats, recordings exported, test hooks.

pub(crate) mod recordings;
pub(crate) mod report;
#[cfg(feature = "testing")]
pub mod testing;
#[cfg(feature = "timeline")]
pub mod timeline;
