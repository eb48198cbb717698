//! The pool: per-stream stacks, the take and give-back, the device that owns them.

pub(crate) mod access;
pub(crate) mod arena;
pub(crate) mod buffer;
// `capturing`, `fence`, `graph_key` and `replay` are seams graphs plug into: without `graph`
// (which `nccl` needs) nothing makes graphs, and their graph side is idle.
#[cfg_attr(not(feature = "graph"), allow(dead_code))]
pub(crate) mod capturing;
pub(crate) mod config;
pub(crate) mod deferred;
pub(crate) mod device;
#[cfg_attr(not(feature = "graph"), allow(dead_code))]
pub(crate) mod fence;
#[cfg_attr(not(feature = "graph"), allow(dead_code))]
pub(crate) mod graph_key;
pub(crate) mod ledger;
#[cfg(feature = "cuda")]
pub(crate) mod lent;
#[cfg(feature = "cuda")]
pub(crate) mod pitched;
pub(crate) mod record;
#[cfg_attr(not(feature = "graph"), allow(dead_code))]
pub(crate) mod replay;
pub(crate) mod scope;
pub(crate) mod sink;
pub(crate) mod stack;
pub(crate) mod stats;
pub(crate) mod stream;
pub(crate) mod symmetric;
pub(crate) mod view;
