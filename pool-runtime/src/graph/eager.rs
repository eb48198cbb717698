//! CUDA graphs. This build has no CUDA: graphed functions (`#[pooled(stream, graph)]`) compile
//! and run eagerly, with their calls counted as [`shape_stats`] says.

#[path = "shapes.rs"]
mod shapes;

pub use shapes::{EagerCalls, GraphKey, GraphKeys, Outputs, ShapeStats, shape_stats};
#[doc(hidden)]
pub use shapes::{GraphSite, OutputLayout, graphed};
