//! Process-wide numbers that never repeat: device, stream and ppl.cv block identities.
//!
//! Unsafe code trusts these to tell live objects apart, so a counter must never wrap. Like std's
//! `ThreadId`, each is a 64-bit counter whose increment is checked: wrapping would take 2^64
//! creations, centuries at one a nanosecond, and stops the process instead of reusing a number.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// A source of numbers, each handed out once. Starts at 1, so 0 can mean "none".
pub(crate) struct Counter(AtomicU64);

impl Counter {
    pub(crate) const fn new() -> Counter {
        Counter(AtomicU64::new(1))
    }

    /// A number no earlier call returned.
    pub(crate) fn next(&self) -> u64 {
        self.try_next().unwrap_or_else(|| exhausted())
    }

    /// A number no earlier call returned, or `None` once all are used.
    fn try_next(&self) -> Option<u64> {
        self.0
            .fetch_update(Relaxed, Relaxed, |n| n.checked_add(1))
            .ok()
    }
}

#[cold]
fn exhausted() -> ! {
    // Unreachable in practice (see the module doc); aborting keeps unsafe code from ever seeing a
    // repeated identity, which a panic caught by `catch_unwind` could allow.
    eprintln!("gpu-pool: a 64-bit id counter is exhausted; stopping rather than reusing an id");
    std::process::abort()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_distinct_and_never_zero() {
        let c = Counter::new();
        let (a, b) = (c.next(), c.next());
        assert!(a != 0 && b != 0 && a != b);
    }

    #[test]
    fn the_last_number_is_handed_out_once_then_none() {
        let c = Counter(AtomicU64::new(u64::MAX - 1));
        assert_eq!(c.try_next(), Some(u64::MAX - 1));
        assert_eq!(c.try_next(), None, "no wrap to 0 or 1");
        assert_eq!(c.try_next(), None);
    }
}
