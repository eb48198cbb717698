// A graph writes its outputs on every replay: they stay borrowed while it lives.
use gpu_pool::prelude::*;
use gpu_pool::compat::opencv::GpuMat;

fn main() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::host())?;
    let mut out = GpuMat::<u8>::new(&stream, 4, 4)?;
    let graph = stream.capture(|_| {
        let _ = &out;
        Ok(())
    })?;
    out.set_to(1)?; // error: `out` is borrowed by the graph
    drop(out); // error: moved while borrowed
    graph.launch()
}
