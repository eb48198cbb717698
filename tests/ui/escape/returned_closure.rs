use gpu_pool::prelude::*;

#[pooled(stream)]
fn later<'s>(stream: &'s Stream) -> Result<Box<dyn Fn() -> usize + 's>, PoolError> {
    let b = buffer!(8; u32)?;
    Ok(Box::new(move || b.len()))
}

fn main() {}
