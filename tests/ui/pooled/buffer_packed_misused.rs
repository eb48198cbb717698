use gpu_pool::prelude::*;

#[pooled(stream)]
fn shapes(stream: &Stream) -> Result<(), PoolError> {
    let a = buffer!(16; f32, packed)?; // 1D: nothing to pack
    let b = buffer!(4, 4; f32, pakced)?; // a misspelt option
    Ok(())
}

fn main() {}
