// A constant is evaluated at compile time; buffers are taken at run time.
use gpu_pool::prelude::*;

#[pooled(stream)]
fn f(stream: &Stream) -> Result<usize, PoolError> {
    let n = const {
        let b = buffer!(8; u8).unwrap();
        b.len()
    };
    Ok(n)
}

fn main() {}
