//! The refusal where no macro was given the name and no item of the block declares it.
#![allow(unused_macros)]
use gpu_pool::prelude::*;

macro_rules! rebind {
    ($x:ident) => {
        let $x = vec![7u8];
    };
}

#[pooled(stream)]
fn early(stream: &Stream) -> Result<(), PoolError> {
    let a = buffer!(8; u8)?;
    println!("done");
    rebind!(other);
    drop(a); // no macro was given `a`: refused
    let b = buffer!(8; u8)?;
    drop(b); // refused: the macro comes after
    rebind!(b);
    let c = buffer!(8; u8)?;
    {
        rebind!(c);
        const d: u32 = 3;
    }
    drop(c); // refused: what the block declared ended with it
    let d = buffer!(8; u8)?;
    fn d() {}
    drop(d); // refused: a `let` wins over an item of its own block
    Ok(())
}

fn main() {}
