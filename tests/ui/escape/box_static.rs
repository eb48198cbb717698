use gpu_pool::prelude::*;
use std::any::Any;

#[pooled(stream)]
fn erase(stream: &Stream) -> Result<Box<dyn Any>, PoolError> {
    let b = buffer!(8; u32)?;
    Ok(Box::new(b) as Box<dyn Any>)
}

fn main() {}
