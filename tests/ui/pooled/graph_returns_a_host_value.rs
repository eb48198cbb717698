// A replay runs no host code: a graphed function cannot hand back a value computed on the host.
use gpu_pool::prelude::*;

#[pooled(stream, graph)]
fn count(stream: &Stream, n: usize) -> Result<usize, PoolError> {
    let x = buffer!(n; f32)?;
    Ok(x.len())
}

fn main() {}
