//! Everything around the body is kept: generics, where clauses, lifetimes, receivers, attributes,
//! doc comments, visibility, `unsafe`, return types, labels.
use gpu_pool::prelude::*;
use std::sync::Arc;

/// A filter with a stream of its own.
pub struct Filter<S> {
    stream: S,
}

impl<S> Filter<S>
where
    S: gpu_pool::AsStream,
{
    /// Doc comments stay.
    #[pooled(self.stream)]
    #[must_use = "the result says whether it worked"]
    pub fn run<'a, T: bytemuck::Pod>(&'a self, data: &[T]) -> Result<usize, PoolError>
    where
        T: Copy + 'static,
    {
        let mut x = buffer!(data.len(); T)?;
        x.upload(data)?;
        'outer: for _ in 0..2 {
            let _y = buffer!(2, 2; T).expect("small");
            break 'outer;
        }
        Ok(x.len())
    }

    #[pooled(self.stream)]
    fn by_mut(&mut self) -> Result<(), PoolError> {
        let _z = buffer!(1; u8).unwrap();
        Ok(())
    }
}

#[pooled(stream)]
unsafe fn unsafe_is_kept(stream: Stream) -> Result<Stream, PoolError> {
    {
        let _a = buffer!(4; u8)?;
    }
    Ok(stream)
}

#[pooled(stream)]
fn arc_stream(stream: Arc<Stream>) -> Result<(), PoolError> {
    let _a = buffer!(4; u8)?;
    Ok(())
}

#[pooled(stream)]
fn mut_ref(stream: &mut Stream) -> Result<(), PoolError> {
    let _a = buffer!(4; u8)?;
    Ok(())
}

#[pooled(ctx.1)]
fn tuple_field(ctx: (u8, Stream)) -> Result<(), PoolError> {
    let _a = buffer!(4; u8)?;
    Ok(())
}

#[pooled(stream)]
fn no_buffers(stream: &Stream) -> usize {
    stream.id() as usize
}

fn main() -> Result<(), PoolError> {
    let device = Device::host();
    let mut filter = Filter { stream: Stream::new(&device)? };
    assert_eq!(filter.run(&[1u8, 2, 3])?, 3);
    filter.by_mut()?;
    // SAFETY: the function has no safety requirement; `unsafe` is only kept.
    let stream = unsafe { unsafe_is_kept(Stream::new(&device)?)? };
    arc_stream(Arc::new(stream))?;
    mut_ref(&mut Stream::new(&device)?)?;
    tuple_field((0, Stream::new(&device)?))?;
    no_buffers(&Stream::new(&device)?);
    Ok(())
}
