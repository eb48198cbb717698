//! A build without the `graph` feature. What `#[pooled(stream, graph)]` expands to still resolves,
//! to stand-ins whose one bound no type meets: the build fails with a single message that names
//! the feature to turn on, where a missing item would give a list of unresolved paths.

use crate::core::graph_key::GraphKeys;
use crate::core::stream::Stream;

/// Met by no type: a graphed function in a build without the `graph` feature.
#[diagnostic::on_unimplemented(
    message = "`#[pooled(stream, graph)]` needs gpu-pool's `graph` feature",
    label = "a graphed function",
    note = "turn it on: `gpu-pool = {{ version = \"0.1\", features = [\"graph\"] }}`"
)]
pub trait GraphFeature {
    /// Never called: no type implements the trait.
    fn off(&self) -> !;
}

/// The stand-in for a graphed function's site.
#[derive(Debug)]
pub struct GraphSite;

impl GraphSite {
    /// A site that keeps nothing.
    #[must_use]
    pub const fn new(_name: &'static str, _cap: usize) -> GraphSite {
        GraphSite
    }
}

/// The stand-in for `graphed`: no call of it compiles, `S` never being a `GraphFeature`.
pub fn graphed<S, R, E>(
    site: &'static S,
    _stream: &Stream,
    _call: &mut impl FnMut(Option<&mut GraphKeys>) -> Option<Result<R, E>>,
) -> Result<R, E>
where
    S: GraphFeature,
{
    site.off()
}
