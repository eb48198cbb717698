//! Vocabulary every layer speaks: errors, ids, where memory came from, the lock.

pub(crate) mod counters;
pub(crate) mod error;
pub(crate) mod event;
pub(crate) mod holders;
pub(crate) mod id;
pub(crate) mod layout;
pub(crate) mod source;
pub(crate) mod sync;
pub(crate) mod unique;
