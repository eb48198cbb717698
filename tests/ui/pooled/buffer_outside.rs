use gpu_pool::prelude::*;

fn plain(_stream: &Stream) -> Result<(), PoolError> {
    let _b = buffer!(8; u8)?;
    Ok(())
}

fn main() {}
