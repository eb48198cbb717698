//! `drop(name)` compiles where `name` may no longer be a buffer's handle, as the check cannot tell:
//! after a macro given the name (`pin_mut!` and `tokio::pin!` rebind it), and in a block where an
//! item declares the name (an item is visible in its whole block, before its declaration too).
#![allow(dropping_copy_types, non_upper_case_globals, dead_code)]
use std::pin::Pin;

use gpu_pool::prelude::*;

/// `futures::pin_mut!`, as written there (with `Pin::new` for its `unsafe`): the name now holds
/// a pinned reference to the handle.
macro_rules! pin_mut {
    ($($x:ident),* $(,)?) => { $(
        let mut $x = $x;
        #[allow(unused_mut)]
        let mut $x = Pin::new(&mut $x);
    )* }
}

/// Binds the name to something else.
macro_rules! rebind {
    ($x:ident) => {
        let $x = vec![7u8];
    };
}

/// Declares an item of the name, visible in the whole block.
macro_rules! declare {
    ($x:ident) => {
        fn $x() {}
    };
}

/// A pattern that binds the name.
macro_rules! some {
    ($x:ident) => {
        Some($x)
    };
}

mod values {
    pub const x: u32 = 5;
}

#[pooled(stream)]
fn macros(stream: &Stream) -> Result<usize, PoolError> {
    let x = buffer!(8; u8)?;
    let n = x.len();
    pin_mut!(x);
    assert_eq!(x.len(), 8);
    drop(x); // the pinned reference
    let y = buffer!(8; u8)?;
    let m = y.len();
    rebind!(y);
    assert_eq!(y, [7]);
    drop(y); // the vec
    let z = buffer!(8; u8)?;
    if let some!(z) = Some(String::from("s")) {
        drop(z); // the string
    }
    let _ = z.len();
    Ok(n + m)
}

#[pooled(stream)]
fn items(stream: &Stream) -> Result<usize, PoolError> {
    let x = buffer!(8; u8)?;
    {
        const x: u32 = 3;
        drop(x);
    }
    {
        static x: u32 = 4;
        drop(x);
    }
    {
        drop(x); // the function, declared after
        fn x() {}
    }
    {
        drop(x); // the function the macro declares, after
        declare!(x);
    }
    {
        use values::*;
        drop(x);
    }
    Ok(x.len())
}

fn main() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::host())?;
    assert_eq!(macros(&stream)?, 16);
    assert_eq!(items(&stream)?, 8);
    let m = gpu_scope!(stream, {
        let y = buffer!(8; u8)?;
        let len = y.len();
        {
            drop(y);
            fn y() {}
        }
        rebind!(y);
        drop(y);
        Ok::<_, PoolError>(len)
    })?;
    assert_eq!(m, 8);
    assert_eq!(stream.stats().stack_in_use, 0);
    Ok(())
}
