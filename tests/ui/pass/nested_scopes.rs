//! gpu_scope! nests, names other streams, works in closures and plain functions, and outer buffers
//! stay usable inside.
use gpu_pool::prelude::*;

fn main() -> Result<(), PoolError> {
    let device = Device::host();
    let (a, b) = (Stream::new(&device)?, Stream::new(&device)?);
    let total = gpu_scope!(a, {
        let mut x = buffer!(8; u32)?;
        x.set_to(1)?;
        let inner = gpu_scope!(&b, {
            let mut y = buffer!(8; u32)?;
            y.copy_from(&x)?;
            let f = |n: usize| gpu_scope!(a, {
                let z = buffer!(n; u8)?;
                Ok::<_, PoolError>(z.len())
            });
            f(3)? + y.to_vec()?.iter().sum::<u32>() as usize
        });
        inner + x.len()
    });
    assert_eq!(total, 3 + 8 + 8);
    assert_eq!(a.stats().stack_in_use + b.stats().stack_in_use, 0);
    Ok(())
}
