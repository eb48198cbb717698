// A graphed method takes `self` by reference; `graph`'s one option is `cap`, at least 1; and a
// graphed function returns a `Result`.
use gpu_pool::prelude::*;

#[derive(GraphKey)]
struct Model<'s> {
    stream: &'s Stream,
}

impl Model<'_> {
    #[pooled(self.stream, graph)]
    fn consume(self) -> Result<(), PoolError> {
        Ok(())
    }
}

#[pooled(stream, graph(cap = 0))]
fn none_kept(stream: &Stream) -> Result<(), PoolError> {
    Ok(())
}

#[pooled(stream, graph(size = 4))]
fn unknown(stream: &Stream) -> Result<(), PoolError> {
    Ok(())
}

#[pooled(stream, graphs)]
fn misspelt(stream: &Stream) -> Result<(), PoolError> {
    Ok(())
}

#[pooled(stream, graph)]
fn no_result(stream: &Stream) {}

fn main() {}
