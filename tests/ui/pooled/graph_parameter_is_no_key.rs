// Every parameter of a graphed function is part of its key: a type that says nothing of what a
// replay depends on is refused, with how to fix it.
use gpu_pool::prelude::*;

struct Settings {
    scale: f32,
}

#[pooled(stream, graph)]
fn scaled(stream: &Stream, settings: &Settings) -> Result<(), PoolError> {
    let mut x = buffer!(8; f32)?;
    x.set_to(settings.scale)
}

fn main() {}
