use gpu_pool::prelude::*;

#[pooled(strm)]
async fn f(stream: &Stream) -> Result<(), PoolError> {
    let a = buffer!(8)?;
    buffer!(8; u8);
    Ok(())
}

fn main() {}
