use gpu_pool::prelude::*;

fn main() {
    gpu_scope!();
}
