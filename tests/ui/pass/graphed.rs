// Graphed functions and methods as the guide writes them: outputs taken first and returned,
// parameters keyed (a model through `#[derive(GraphKey)]`), generic buffers.
use gpu_pool::prelude::*;

#[derive(GraphKey)]
struct Model<'s> {
    stream: &'s Stream,
    weights: SharedMat<f32>,
    scale: f32,
}

impl<'s> Model<'s> {
    #[pooled(self.stream, graph)]
    fn forward(&self, x: &impl GpuRead<f32>) -> Result<Temp<'s, f32>, PoolError> {
        let mut y = self.stream.temp::<f32>(x.rows(), x.cols())?;
        let w = self.weights.read(self.stream)?;
        let mut tmp = buffer!(x.rows(), x.cols(); f32)?;
        tmp.copy_from(x)?;
        y.copy_from(&tmp)?;
        let _ = (&w, self.scale);
        Ok(y)
    }
}

#[pooled(stream, graph(cap = 4))]
fn two_outputs<'s>(
    stream: &'s Stream,
    x: &Temp<'_, u8>,
) -> Result<(Temp<'s, u8>, Temp<'s, u8>), PoolError> {
    let mut a = stream.temp::<u8>(x.rows(), x.cols())?;
    let mut b = stream.temp::<u8>(x.rows(), x.cols())?;
    a.copy_from(x)?;
    b.copy_from(x)?;
    Ok((a, b))
}

fn main() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::host())?;
    let model = Model {
        stream: &stream,
        weights: SharedMat::new(stream.device(), 2, 2)?,
        scale: 1.0,
    };
    let x = stream.temp::<f32>(2, 2)?;
    let y = model.forward(&x)?;
    let z = model.forward(&x)?; // `y` stays the caller's: no replay writes it
    drop((z, y));
    let b = stream.temp::<u8>(1, 3)?;
    let (_c, _d) = two_outputs(&stream, &b)?;
    Ok(())
}
