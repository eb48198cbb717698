use gpu_pool::prelude::*;

#[pooled(stream)]
fn stash<'a, 's>(stream: &'s Stream, out: &mut Vec<Pooled<'a, 's, f32>>) -> Result<(), PoolError> {
    let b = buffer!(4, 4; f32)?;
    out.push(b);
    Ok(())
}

fn main() {}
