use gpu_pool::prelude::*;

#[pooled(strem)]
fn f(stream: &Stream, len: usize) -> Result<(), PoolError> {
    let _b = buffer!(len; u8)?;
    Ok(())
}

fn main() {}
