use gpu_pool::prelude::*;

fn main() -> Result<(), PoolError> {
    let device = Device::host();
    gpu_scope!(device, {
        let _b = buffer!(8; u8)?;
    });
    Ok(())
}
