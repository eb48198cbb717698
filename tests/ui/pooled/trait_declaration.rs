use gpu_pool::prelude::*;

trait Filter {
    #[pooled(stream)]
    fn run(&self, stream: &Stream) -> Result<(), PoolError>;
}

fn main() {}
