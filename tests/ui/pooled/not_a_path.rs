use gpu_pool::prelude::*;

#[pooled(streams[0])]
fn f(streams: &[Stream]) -> Result<(), PoolError> {
    Ok(())
}

fn main() {}
