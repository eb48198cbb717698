use gpu_pool::prelude::*;

#[pooled(stream)]
fn early(stream: &Stream, n: usize) -> Result<(), PoolError> {
    let outer = buffer!(8; u8)?;
    for _ in 0..n {
        let inner = buffer!(8; u8)?;
        drop(outer); // the outer buffer is still a buffer here
        let _ = inner.len();
    }
    let f = || drop(outer); // and in a closure
    f();
    Ok(())
}

fn main() {}
