use gpu_pool::prelude::*;

#[pooled(stream)]
fn early(stream: &Stream) -> Result<(), PoolError> {
    use std::mem;
    let a = buffer!(8; u8)?;
    let b = buffer!(8; u8)?;
    let c = buffer!(4, 4; f32)?;
    std::mem::drop(a);
    ::core::mem::drop(b);
    mem::drop(c);
    Ok(())
}

fn main() {}
