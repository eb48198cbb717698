// `.await` is found in other macros' arguments too.
use gpu_pool::prelude::*;

async fn answer() -> u32 {
    42
}

async fn step(stream: &Stream) -> Result<(), PoolError> {
    gpu_scope!(stream, {
        let _a = buffer!(64; u8)?;
        println!("{}", answer().await);
        Ok(())
    })
}

fn main() {
    let _ = step;
}
