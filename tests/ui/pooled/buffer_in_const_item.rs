// A `const` or `static` item in the body has no scope: `buffer!` there reports itself.
use gpu_pool::prelude::*;

#[pooled(stream)]
fn f(stream: &Stream) -> Result<usize, PoolError> {
    const N: usize = {
        let b = buffer!(8; u8).unwrap();
        b.len()
    };
    let a = buffer!(N; u8)?;
    Ok(a.len())
}

fn main() {}
