// Two DSL mistakes and a type error of the user's: one build reports all three, and nothing else.
use gpu_pool::prelude::*;

fn f(stream: &Stream) -> Result<usize, PoolError> {
    let total = gpu_scope!(stream, {
        let a = buffer!(8; u8); // no `?`
        let b = buffer!(8; u8)?;
        drop(b); // releases nothing
        let n: u32 = "eight";
        a.len() + b.len() + n as usize
    });
    Ok(total)
}

fn main() {
    let stream = Stream::new(&Device::host()).unwrap();
    let _: usize = f(&stream).unwrap();
}
