// A future suspended inside a scope would hold its buffers: dropped or forgotten meanwhile, other
// code on the stream would release out of order or find the stack held for good.
use gpu_pool::prelude::*;

async fn tick() {}

async fn step(stream: &Stream) -> Result<usize, PoolError> {
    gpu_scope!(stream, {
        let a = buffer!(64; u8)?;
        tick().await;
        Ok(a.len())
    })
}

fn main() {
    let _ = step;
}
