use gpu_pool::prelude::*;

fn early(a: &Stream, b: &Stream) -> Result<(), PoolError> {
    gpu_scope!(a, {
        let x = buffer!(8; u8)?;
        drop(x);
        gpu_scope!(b, {
            let y = buffer!(8; u8)?;
            drop(x); // an enclosing scope's buffer
            drop(y); // and its own
        });
        Ok(())
    })
}

fn main() {}
