//! The synchronization of the device's stack hand-out, which the loom tests model: loom's types
//! under `--cfg loom`, std's otherwise. Process-wide registries stay on std (loom has no `const`
//! constructors, and nothing there races with the hand-out).

#[cfg(loom)]
pub(crate) use loom::sync::{Mutex, MutexGuard, atomic::AtomicUsize};
#[cfg(not(loom))]
pub(crate) use std::sync::{Mutex, MutexGuard, atomic::AtomicUsize};

/// Locks ignoring poison: every critical section of the device leaves its data consistent before
/// any step that can panic.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
