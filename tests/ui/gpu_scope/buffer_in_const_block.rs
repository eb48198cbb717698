// A constant is evaluated at compile time; buffers are taken at run time.
use gpu_pool::prelude::*;

fn f(stream: &Stream) -> Result<usize, PoolError> {
    gpu_scope!(stream, {
        let a = buffer!(8; u8)?;
        let n = const {
            let b = buffer!(8; u8).unwrap();
            b.len()
        };
        Ok(a.len() + n)
    })
}

fn main() {}
