use gpu_pool::prelude::*;

#[pooled(stream)]
const fn f(stream: &Stream) -> usize {
    0
}

fn main() {}
