// A graphed function in a build without the `graph` feature: one error, on the function, that
// says which feature to turn on (not unresolved paths of the expansion).
use gpu_pool::prelude::*;

#[pooled(stream, graph)]
fn step(stream: &Stream, n: usize) -> Result<(), PoolError> {
    let mut x = buffer!(n; f32)?;
    x.set_to(1.0)
}

fn main() {}
