use gpu_pool::prelude::*;

#[pooled(stream)]
fn f(stream: &Stream) -> Result<(), PoolError> {
    let _g = async || gpu_scope!(stream, { Ok::<_, PoolError>(()) });
    Ok(())
}

fn main() {}
