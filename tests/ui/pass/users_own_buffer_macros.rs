// Only gpu-pool's `buffer!` and `gpu_scope!` are rewritten: a bare name (as the prelude imports it)
// or a path to gpu-pool (`gpu_pool::`, `::gpu_pool::`, `gpu_pool::prelude::`). A user's own macros
// of those names, called by any other path, are left alone, in async blocks too.
#![deny(warnings)]

use gpu_pool::prelude::*;

mod bytes {
    macro_rules! buffer {
        ($($byte:expr),* $(,)?) => { vec![$($byte as u8),*] };
    }
    pub(crate) use buffer;

    macro_rules! gpu_scope {
        ($stream:expr, $body:block) => {
            $body
        };
    }
    pub(crate) use gpu_scope;
}

#[pooled(stream)]
fn paths(stream: &Stream) -> Result<usize, PoolError> {
    let a = buffer!(1; u8)?;
    let b = gpu_pool::buffer!(2; u8)?;
    let c = ::gpu_pool::buffer!(3; u8)?;
    let d = gpu_pool::prelude::buffer!(4; u8)?;
    let e = ::gpu_pool::prelude::buffer!(5; u8)?;
    let theirs = bytes::buffer![1, 2, 3];
    let also_theirs = crate::bytes::buffer![4];
    bytes::buffer![5, 6];
    let scoped = gpu_pool::gpu_scope!(stream, {
        let f = buffer!(6; u8)?;
        let mine = self::bytes::buffer![7, 8];
        f.len() + mine.len()
    });
    let not_a_scope = bytes::gpu_scope!(stream, { bytes::buffer![9].len() });
    let later = async {
        let v = bytes::buffer![1, 2];
        bytes::gpu_scope!(stream, { v.len() })
    };
    let _ = later;
    Ok(a.len()
        + b.len()
        + c.len()
        + d.len()
        + e.len()
        + theirs.len()
        + also_theirs.len()
        + scoped
        + not_a_scope)
}

fn main() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::host())?;
    assert_eq!(paths(&stream)?, 15 + 3 + 1 + 8 + 1);
    assert_eq!(stream.stats().stack_allocations, 6);
    assert_eq!(stream.stats().stack_in_use, 0);
    Ok(())
}
