//! The gpu-pool twin: `mlp_eager`'s forward pass as a graphed pooled function. Each step uploads
//! its input into a `buffer!` and calls `forward`, which captures itself the first time a batch
//! is seen and replays that graph after; its output is a temporary the caller downloads.

use gpu_pool::interop::Blas;
use gpu_pool::prelude::*;

use crate::mlp_eager::pooled::{Model, forward as eager_forward};
use crate::mlp_eager::{CLASSES, IN, Kernels};

/// `softmax(relu(x W1 + b1) W2 + b2)`, one graph per batch (the key: `x`'s shape and address,
/// the model's weights, the handles and the stack's top).
#[pooled(stream, graph(cap = 64))]
pub fn forward<'s>(
    stream: &'s Stream,
    blas: &Blas,
    k: &Kernels,
    model: &Model,
    x: &impl GpuRead<f32>,
) -> Result<Temp<'s, f32>, PoolError> {
    let mut probs = stream.temp_packed::<f32>(x.rows(), CLASSES)?; // the output, taken first
    eager_forward(stream, Some((blas, k)), model, x, &mut probs)?;
    Ok(probs)
}

/// One step: uploads `input` (`batch x IN`), runs `forward`, downloads the probabilities.
#[pooled(stream)]
pub fn step(
    stream: &Stream,
    (blas, k): (&Blas, &Kernels),
    model: &Model,
    input: &[f32],
    probs_out: &mut [f32],
) -> Result<(), PoolError> {
    let mut x = buffer!(input.len() / IN, IN; f32, packed)?;
    x.upload(input)?;
    let probs = forward(stream, blas, k, model, &x)?;
    probs.download(probs_out)
}
