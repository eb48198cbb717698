mod base;
mod core;
mod observe;

// The paths from before the move into layer folders.
use self::core::stream;
use observe::report;
pub use stream::Stream;
