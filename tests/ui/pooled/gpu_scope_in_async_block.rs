// A `#[pooled]` function that returns a future: the scope inside its async block is refused even
// without an `.await`, as `buffer!` is.
use gpu_pool::prelude::*;

#[pooled(stream)]
fn make(stream: &Stream) -> impl std::future::Future<Output = Result<usize, PoolError>> + '_ {
    async move {
        gpu_scope!(stream, {
            let a = buffer!(8; u8)?;
            Ok(a.len())
        })
    }
}

fn main() {
    let _ = make;
}
