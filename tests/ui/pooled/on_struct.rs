use gpu_pool::prelude::*;

#[pooled(stream)]
struct Filter {
    stream: Stream,
}

fn main() {}
