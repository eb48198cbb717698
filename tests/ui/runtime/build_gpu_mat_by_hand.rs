// A buffer's address, shape and origin are what unsafe code trusts: none can be set from outside.
use gpu_pool::prelude::*;
use gpu_pool::compat::opencv::GpuMat;

fn main() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::host())?;
    let mut mat = GpuMat::<u8>::new(&stream, 2, 2)?;
    mat.ptr = 0x1000;
    Ok(())
}
