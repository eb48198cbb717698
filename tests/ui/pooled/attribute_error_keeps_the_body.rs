// A stream that names no parameter: the body is still checked, its buffers take from a placeholder,
// so the type error below is reported in the same build, and nothing else.
use gpu_pool::prelude::*;

#[pooled(strm)]
fn f(stream: &Stream) -> Result<usize, PoolError> {
    let mut a = buffer!(8; u8)?;
    a.set_to(1)?;
    let n: u32 = "eight";
    Ok(a.len() + n as usize)
}

fn main() {
    let stream = Stream::new(&Device::host()).unwrap();
    let _: usize = f(&stream).unwrap();
}
