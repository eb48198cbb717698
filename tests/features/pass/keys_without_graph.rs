// A type can be a graph key in a build without the `graph` feature (a library's model, say): the
// derive needs nothing the feature adds. And pooled code without graphs builds as ever.
use gpu_pool::prelude::*;

#[derive(GraphKey)]
struct Model {
    scale: f32,
    rows: usize,
}

#[pooled(stream)]
fn scaled(stream: &Stream, model: &Model) -> Result<Vec<f32>, PoolError> {
    let mut x = buffer!(model.rows; f32)?;
    x.set_to(model.scale)?;
    x.to_vec()
}

fn main() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::host())?;
    let model = Model { scale: 0.5, rows: 4 };
    assert_eq!(scaled(&stream, &model)?, vec![0.5; 4]);
    Ok(())
}
