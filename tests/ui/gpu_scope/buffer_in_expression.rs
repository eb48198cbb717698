use gpu_pool::prelude::*;

fn main() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::host())?;
    let n = gpu_scope!(stream, { buffer!(8; u8)?.len() });
    println!("{n}");
    Ok(())
}
