// Array lengths and const generic arguments are constants too, and each misuse is reported.
use gpu_pool::prelude::*;

fn zeros<const N: usize>() -> [u8; N] {
    [0; N]
}

#[pooled(stream)]
fn f(stream: &Stream) -> Result<usize, PoolError> {
    let repeated = [0u8; {
        let b = buffer!(8; u8).unwrap();
        4
    }];
    let typed: [u8; {
        let c = buffer!(2, 2; u8).unwrap();
        4
    }] = repeated;
    let generic = zeros::<
        {
            let d = buffer!(8; u8).unwrap();
            4
        },
    >();
    Ok(typed.len() + generic.len())
}

fn main() {}
