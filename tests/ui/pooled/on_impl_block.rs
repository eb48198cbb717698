use gpu_pool::prelude::*;

struct Filter {
    stream: Stream,
}

#[pooled(self.stream)]
impl Filter {
    fn run(&self) {}
}

fn main() {}
