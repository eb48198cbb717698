//! The pool: per-stream stacks, the take and give-back, the device that owns them.

pub(crate) mod access;
pub(crate) mod arena;
pub(crate) mod buffer;
pub(crate) mod capturing;
pub(crate) mod config;
pub(crate) mod deferred;
pub(crate) mod device;
pub(crate) mod fence;
pub(crate) mod graph_key;
pub(crate) mod ledger;
#[cfg(feature = "cuda")]
pub(crate) mod lent;
#[cfg(feature = "cuda")]
pub(crate) mod pitched;
pub(crate) mod record;
pub(crate) mod replay;
pub(crate) mod scope;
pub(crate) mod sink;
pub(crate) mod stack;
pub(crate) mod stats;
pub(crate) mod stream;
pub(crate) mod symmetric;
pub(crate) mod view;
