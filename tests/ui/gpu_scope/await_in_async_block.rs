// In an async block as in an async fn.
use gpu_pool::prelude::*;

async fn tick() {}

fn make(stream: &Stream) -> impl std::future::Future<Output = Result<(), PoolError>> + '_ {
    async move {
        gpu_scope!(stream, {
            let _a = buffer!(8; u8)?;
            tick().await;
            Ok(())
        })
    }
}

fn main() {
    let _ = make;
}
