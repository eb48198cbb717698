//! Locks and atomics. The device's stack hand-out and a stack's bounds (its top, its limit and its
//! mappings, which a reclaim on another thread trims), which the loom tests model, use loom's types
//! under `--cfg loom` and std's otherwise; process-wide registries and the pools' own state stay on std
//! (loom has no `const` constructors, and nothing there races with the hand-out).
//!
//! Every lock in the crate is taken through [`lock`], which ignores poison: each critical section
//! leaves its data consistent before any step that can panic, so a panic elsewhere while a lock
//! was held leaves nothing half-updated to protect.

#[cfg(loom)]
pub(crate) use loom::sync::{
    Mutex, MutexGuard,
    atomic::{AtomicUsize, fence},
};
#[cfg(not(loom))]
pub(crate) use std::sync::{
    Mutex, MutexGuard,
    atomic::{AtomicUsize, fence},
};

/// A mutex that [`lock`] can take.
pub(crate) trait Lock {
    type Guard<'a>
    where
        Self: 'a;
    fn lock_ignoring_poison(&self) -> Self::Guard<'_>;
}

impl<T> Lock for std::sync::Mutex<T> {
    type Guard<'a>
        = std::sync::MutexGuard<'a, T>
    where
        T: 'a;
    fn lock_ignoring_poison(&self) -> Self::Guard<'_> {
        self.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(loom)]
impl<T> Lock for loom::sync::Mutex<T> {
    type Guard<'a>
        = loom::sync::MutexGuard<'a, T>
    where
        T: 'a;
    fn lock_ignoring_poison(&self) -> Self::Guard<'_> {
        self.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Locks `m`, ignoring poison (see the module doc).
pub(crate) fn lock<M: Lock>(m: &M) -> M::Guard<'_> {
    m.lock_ignoring_poison()
}
