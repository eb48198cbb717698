// What the soundness fixes must keep compiling: raw names, attributes on buffers, sizes that are
// any expression, and scopes in async code that hold no buffer across an `.await`.
#![deny(warnings)]

use gpu_pool::prelude::*;

#[pooled(stream)]
fn raw_names(stream: &Stream) -> Result<usize, PoolError> {
    let r#type = buffer!(8; u8)?;
    let mut r#match = buffer!(2, 2; f32)?;
    r#match.set_to(1.0)?;
    #[allow(unused_mut)]
    let mut quiet = buffer!(3; u8)?;
    #[cfg(any())]
    let never = buffer!(1 << 40; u8)?;
    Ok(r#type.len() + r#match.len() + quiet.len())
}

#[pooled(stream)]
fn diverging_tail(stream: &Stream, fail: bool) -> Result<(), PoolError> {
    let _a = buffer!(8; u8)?;
    if fail {
        let _b = buffer!(8; u8)?;
        return Err(PoolError::InvalidConfig {
            reason: "asked to".into(),
        });
    }
    Ok(())
}

async fn tick() {}

async fn scope_then_await(stream: &Stream) -> Result<usize, PoolError> {
    let n = gpu_scope!(stream, {
        let a = buffer!(16; u8)?;
        a.len()
    });
    tick().await;
    Ok(n)
}

fn main() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::host())?;
    assert_eq!(raw_names(&stream)?, 8 + 4 + 3);
    assert!(diverging_tail(&stream, true).is_err());
    let _future = scope_then_await(&stream);
    assert_eq!(stream.stats().stack_allocations, 5, "3 + 2: the `cfg`-disabled buffer is not taken");
    Ok(())
}
