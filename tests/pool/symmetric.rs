//! Symmetric stacks on the host backend: the layout trace and `check_symmetric`, and NCCL's entry
//! points answering with typed errors where there is no GPU or no `libnccl`.

use gpu_pool::compat::opencv::BufferPool;
use gpu_pool::prelude::*;
use gpu_pool::{observe::LayoutTrace, observe::check_symmetric};

/// The same takes and releases, with one more buffer where `extra` says so.
fn work(stream: &Stream, extra: bool) -> Result<(), PoolError> {
    gpu_scope!(stream, {
        let _a = buffer!(33, 70; f32)?;
        let _b = buffer!(1000; u8)?;
        if extra {
            let _c = buffer!(1; u64)?;
        }
    });
    Ok(())
}

fn two_ranks() -> Result<[Stream; 2], PoolError> {
    Ok([
        Stream::new(&Device::private_host())?,
        Stream::new(&Device::private_host())?,
    ])
}

#[test]
fn ranks_that_run_the_same_work_take_the_same_offsets() -> Result<(), PoolError> {
    let ranks = two_ranks()?;
    let both = [&ranks[0], &ranks[1]];
    check_symmetric(&both)?; // nothing taken on either
    for _ in 0..3 {
        work(&ranks[0], false)?;
        work(&ranks[1], false)?;
    }
    check_symmetric(&both)?;
    if let (Some(a), Some(b)) = (ranks[0].layout_trace(), ranks[1].layout_trace()) {
        assert_eq!(a, b);
        assert_eq!(a.takes(), 6);
        assert_eq!(a.top(), 0, "every buffer released");
        assert_eq!(LayoutTrace::from_bytes(a.to_bytes()), a);
    } else {
        assert_eq!(
            ranks[0].layout_trace(),
            None,
            "release builds trace nothing"
        );
    }
    Ok(())
}

#[test]
fn a_rank_that_took_one_buffer_more_or_none_is_named() -> Result<(), PoolError> {
    if !cfg!(debug_assertions) {
        return Ok(()); // release builds record nothing: the check passes by design
    }
    let ranks = two_ranks()?;
    work(&ranks[0], false)?;
    work(&ranks[1], true)?;
    let err = check_symmetric(&[&ranks[0], &ranks[1]]).unwrap_err();
    assert!(
        matches!(
            err,
            PoolError::Asymmetric {
                rank: 1,
                takes: 3,
                takes0: 2,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("same pooled work in the same order"),
        "{err}"
    );

    // A rank that took nothing against one that did.
    let fresh = Stream::new(&Device::private_host())?;
    let err = check_symmetric(&[&ranks[0], &fresh]).unwrap_err();
    assert!(
        matches!(
            err,
            PoolError::Asymmetric {
                rank: 1,
                takes: 0,
                ..
            }
        ),
        "{err}"
    );

    // The same takes in another order differ too (the digest follows the order).
    let (x, y) = (
        Stream::new(&Device::private_host())?,
        Stream::new(&Device::private_host())?,
    );
    let take = |s: &Stream, first: usize, second: usize| -> Result<(), PoolError> {
        let pool = BufferPool::new(s);
        let a = pool.get_buffer_1d::<u8>(first)?;
        let b = pool.get_buffer_1d::<u8>(second)?;
        drop((b, a));
        Ok(())
    };
    take(&x, 100, 5000)?;
    take(&y, 5000, 100)?;
    assert!(matches!(
        check_symmetric(&[&x, &y]),
        Err(PoolError::Asymmetric { .. })
    ));
    Ok(())
}

#[cfg(feature = "nccl")]
#[test]
fn nccl_without_a_gpu_or_its_library_is_a_typed_error() -> Result<(), PoolError> {
    use gpu_pool::nccl::{Communicators, use_nccl_memory};
    let host = Stream::new(&Device::host())?;
    let expected = |e: &PoolError| {
        matches!(
            e,
            PoolError::NoCudaLibrary { library: "nccl" } | PoolError::Unsupported { .. }
        )
    };
    let made = Communicators::new(&[&host]);
    assert!(made.as_ref().is_err_and(expected), "{made:?}");
    let none = Communicators::new(&[]);
    assert!(none.as_ref().is_err_and(expected), "{none:?}");
    let memory = use_nccl_memory(&Device::host());
    assert!(memory.as_ref().is_err_and(expected), "{memory:?}");
    // The host's stacks still work after the refusals.
    work(&host, false)?;
    Ok(())
}
