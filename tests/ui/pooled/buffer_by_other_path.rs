// Only `buffer!` as the prelude imports it, or a path into gpu-pool, is rewritten: any other path
// may name a macro of the user's. Through a re-export, gpu-pool's `buffer!` says how to call it.
use gpu_pool::prelude::*;

mod dsl {
    pub(crate) use gpu_pool::buffer;
}

#[pooled(stream)]
fn f(stream: &Stream) -> Result<usize, PoolError> {
    let a = dsl::buffer!(8; u8)?;
    Ok(a.len())
}

fn main() {}
