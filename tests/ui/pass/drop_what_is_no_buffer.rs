//! `drop(name)` of a buffer's handle is refused, but only while `name` is that handle: a later
//! `let`, a closure parameter or a pattern shadows it, and a buffer declared in an inner block ends
//! with the block. Forgetting a handle, or `let _ = handle;`, is harmless: the owner still releases.
use gpu_pool::prelude::*;

#[pooled(stream)]
fn shadowed(stream: &Stream) -> Result<usize, PoolError> {
    let v = vec![1u8, 2];
    {
        let v = buffer!(8; u8)?; // the early release: its block ends here
        assert_eq!(v.len(), 8);
    }
    drop(v); // the vec
    let x = buffer!(8; u8)?;
    let n = x.len();
    let _ = x;
    let take = |x: Vec<u8>| drop(x);
    take(vec![3]);
    if let Some(x) = Some(String::from("s")) {
        drop(x);
    }
    std::mem::forget(x);
    let x = vec![4u8];
    drop(x);
    Ok(n)
}

fn main() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::host())?;
    assert_eq!(shadowed(&stream)?, 8);
    let m = gpu_scope!(stream, {
        let y = buffer!(8; u8)?;
        let len = y.len();
        std::mem::forget(y);
        let y = vec![len];
        drop(y);
        Ok::<_, PoolError>(len)
    })?;
    assert_eq!(m, 8);
    assert_eq!(stream.stats().stack_in_use, 0);
    Ok(())
}
