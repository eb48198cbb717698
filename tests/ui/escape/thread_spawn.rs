use gpu_pool::prelude::*;

#[pooled(stream)]
fn send(stream: &Stream) -> Result<(), PoolError> {
    let b = buffer!(8; u32)?;
    std::thread::spawn(move || b.len()).join().unwrap();
    Ok(())
}

fn main() {}
