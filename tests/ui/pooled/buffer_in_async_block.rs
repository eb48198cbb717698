use gpu_pool::prelude::*;

#[pooled(stream)]
fn f(stream: &Stream) -> Result<(), PoolError> {
    let _fut = async {
        let b = buffer!(8; u8)?;
        Ok::<_, PoolError>(b.len())
    };
    Ok(())
}

fn main() {}
