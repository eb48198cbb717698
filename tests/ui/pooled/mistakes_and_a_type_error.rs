// Two DSL mistakes and a type error of the user's: one build reports all three, and nothing else.
use gpu_pool::prelude::*;

#[pooled(stream)]
fn f(stream: &Stream) -> Result<usize, PoolError> {
    let a = buffer!(8)?; // no element type
    let b = buffer!(8; u8)?;
    drop(b); // releases nothing
    let n: u32 = "eight";
    Ok(a.len() + b.len() + n as usize)
}

fn main() {
    let stream = Stream::new(&Device::host()).unwrap();
    let _: usize = f(&stream).unwrap();
}
