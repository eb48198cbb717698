// PyTorch's "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run",
// made a compile error. A graphed call's output is the caller's own `Temp`: while it lives, the
// next call finds the stack's top above it and writes elsewhere. The one way to read memory a later
// replay wrote over is a view of an output kept past the output's drop: a frame loop that keeps a
// view of the last frame's output. It does not compile. Keep the output itself (`last = Some(y)`),
// or copy it out (`y.to_vec()?`) before the next call.
use gpu_pool::prelude::*;

#[pooled(stream, graph)]
fn blur<'s>(stream: &'s Stream, x: &Temp<'_, f32>) -> Result<Temp<'s, f32>, PoolError> {
    let mut y = stream.temp::<f32>(x.rows(), x.cols())?;
    y.copy_from(x)?;
    Ok(y)
}

fn main() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::host())?;
    let frame = stream.temp::<f32>(4, 4)?;
    let mut last: Option<GpuView<'_, f32>> = None;
    for _ in 0..3 {
        let y = blur(&stream, &frame)?;
        if let Some(previous) = &last {
            let _ = previous.to_vec()?; // the last frame's output, which this call's replay wrote over
        }
        last = Some(y.view());
    }
    Ok(())
}
