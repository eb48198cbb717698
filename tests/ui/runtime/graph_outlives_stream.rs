// A graph replays on its stream's stack: the stream outlives it.
use gpu_pool::prelude::*;

fn main() -> Result<(), PoolError> {
    let graph = {
        let stream = Stream::new(&Device::host())?;
        stream.capture(|_| Ok(()))?
    };
    graph.launch()
}
