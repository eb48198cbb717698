use gpu_pool::prelude::*;

fn main() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::host())?;
    let escaped;
    gpu_scope!(stream, {
        let b = buffer!(8; u8)?;
        escaped = b;
    });
    println!("{}", escaped.len());
    Ok(())
}
