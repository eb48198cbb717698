use gpu_pool::prelude::*;

fn main() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::host())?;
    gpu_scope!(stream);
    Ok(())
}
