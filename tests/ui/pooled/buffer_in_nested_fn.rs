use gpu_pool::prelude::*;

#[pooled(stream)]
fn f(stream: &Stream) -> Result<(), PoolError> {
    fn helper() -> Result<(), PoolError> {
        let _b = buffer!(8; u8)?;
        Ok(())
    }
    helper()
}

fn main() {}
