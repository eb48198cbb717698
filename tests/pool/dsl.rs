//! The DSL at run time: every way out of a scope gives the buffers back in LIFO order. Each test runs
//! on a private host device and again on the GPU where there is one; after each, every stack is
//! empty and no LIFO violation was counted.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::{Pin, pin};
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use crate::common::each_device;
use gpu_pool::compat::opencv::BufferPool;
use gpu_pool::prelude::*;
use gpu_pool::{FallbackReason, compat::opencv::set_buffer_pool_config, config::Fallback};

/// Stack use is back to zero and nothing was released out of order.
fn clean(stream: &Stream) {
    let stats = stream.stats();
    assert_eq!(stats.stack_in_use, 0, "stack use back to zero");
    assert_eq!(stats.lifo_violations, 0, "no LIFO violation");
}

#[pooled(stream)]
fn nested_blocks(stream: &Stream) -> Result<Vec<u64>, PoolError> {
    let a = buffer!(64, 64; u8)?;
    let mut tops = vec![stream.stats().stack_in_use as u64];
    {
        let b = buffer!(1000; f32)?;
        tops.push(stream.stats().stack_in_use as u64);
        if b.len() == 1000 {
            let c = buffer!(3, 3; u16)?;
            tops.push(stream.stats().stack_in_use as u64);
            assert!(c.device_ptr() > b.device_ptr() && b.device_ptr() > a.device_ptr());
        }
        tops.push(stream.stats().stack_in_use as u64);
    }
    tops.push(stream.stats().stack_in_use as u64);
    Ok(tops)
}

#[test]
fn nested_blocks_release_at_their_ends() -> Result<(), PoolError> {
    each_device("dsl_nested", |device| {
        let stream = Stream::new(device)?;
        let tops = nested_blocks(&stream)?;
        assert!(tops[0] < tops[1] && tops[1] < tops[2], "{tops:?}");
        assert_eq!(tops[3], tops[1], "c released at the end of the if");
        assert_eq!(tops[4], tops[0], "b released at the end of its block");
        clean(&stream);
        Ok(())
    })
}

#[pooled(stream)]
fn in_a_loop(stream: &Stream, n: usize) -> Result<usize, PoolError> {
    let mut same_address = 0;
    let mut first = None;
    for i in 0..n {
        let mut t = buffer!(256, 256; u8)?;
        t.set_to(i as u8)?;
        if *first.get_or_insert(t.device_ptr()) == t.device_ptr() {
            same_address += 1;
        }
        if i % 3 == 0 {
            continue;
        }
        let _u = buffer!(i + 1; f64)?;
    }
    Ok(same_address)
}

#[test]
fn a_loop_body_releases_every_iteration() -> Result<(), PoolError> {
    each_device("dsl_loop", |device| {
        let stream = Stream::new(device)?;
        assert_eq!(
            in_a_loop(&stream, 20)?,
            20,
            "each iteration reuses the same memory"
        );
        assert_eq!(stream.stats().stack_allocations, 20 + 13);
        clean(&stream);
        Ok(())
    })
}

#[derive(Debug, PartialEq)]
enum Exit {
    Early,
    Labeled,
    Normal,
}

#[pooled(stream)]
#[allow(
    clippy::never_loop,
    reason = "the loop exists to be left by `break` and `return` (clippy may not see it: the \
              loop's block holds a buffer, so its braces come from the macro)"
)]
fn early_exits(stream: &Stream, how: u8) -> Result<Exit, PoolError> {
    let _outer = buffer!(128; u32)?;
    'scan: for _ in 0..3 {
        let _inner = buffer!(16, 16; f32)?;
        loop {
            let _deeper = buffer!(8; u8)?;
            match how {
                0 => return Ok(Exit::Early),
                1 => break 'scan,
                _ => break,
            }
        }
    }
    if how == 1 {
        return Ok(Exit::Labeled);
    }
    Ok(Exit::Normal)
}

#[pooled(stream)]
fn fails_midway(stream: &Stream, big: usize) -> Result<(), PoolError> {
    let _a = buffer!(1024; u8)?;
    let _b = buffer!(big, big; u64)?; // overflows: the `?` returns with `_a` live
    unreachable!("the request above cannot succeed");
}

#[test]
fn return_break_and_question_mark_release_everything() -> Result<(), PoolError> {
    each_device("dsl_exits", |device| {
        let stream = Stream::new(device)?;
        assert_eq!(early_exits(&stream, 0)?, Exit::Early);
        clean(&stream);
        assert_eq!(early_exits(&stream, 1)?, Exit::Labeled);
        clean(&stream);
        assert_eq!(early_exits(&stream, 2)?, Exit::Normal);
        clean(&stream);
        let err = fails_midway(&stream, usize::MAX / 2).unwrap_err();
        assert!(matches!(err, PoolError::SizeOverflow { .. }), "{err}");
        clean(&stream);
        Ok(())
    })
}

#[pooled(stream)]
fn panics_with_buffers(stream: &Stream) -> Result<(), PoolError> {
    let mut a = buffer!(32, 32; u8)?;
    a.set_to(1)?;
    gpu_scope!(stream, {
        let _b = buffer!(100; u16)?;
        panic!("a kernel launch went wrong");
    })
}

#[test]
fn panics_unwind_through_scopes_and_release_in_order() -> Result<(), PoolError> {
    each_device("dsl_panic", |device| {
        let stream = Stream::new(device)?;
        let caught = catch_unwind(AssertUnwindSafe(|| panics_with_buffers(&stream)));
        assert!(caught.is_err(), "the panic reached us");
        clean(&stream);
        // The pool is consistent: the next buffers start at the bottom again.
        let first = BufferPool::new(&stream)
            .get_buffer_1d::<u8>(1)?
            .device_ptr();
        assert_eq!(Some(first), stream.stack_range().map(|r| r.start));
        Ok(())
    })
}

#[pooled(a)]
fn interleaved(a: &Stream, b: &Stream) -> Result<(u64, u64), PoolError> {
    let mut x = buffer!(8, 8; u32)?;
    x.set_to(7)?;
    let sums = gpu_scope!(b, {
        let mut y = buffer!(8, 8; u32)?;
        y.copy_from(&x)?;
        let z = gpu_scope!(a, {
            let mut z = buffer!(64; u32)?; // a's stack again, above x
            z.set_to(1)?;
            z.to_vec()?.iter().map(|&v| u64::from(v)).sum::<u64>()
        });
        (y.to_vec()?.iter().map(|&v| u64::from(v)).sum::<u64>(), z)
    });
    let _after = buffer!(4; u8)?;
    Ok(sums)
}

#[test]
fn two_streams_interleave_and_each_stays_lifo() -> Result<(), PoolError> {
    each_device("dsl_two_streams", |device| {
        let (a, b) = (Stream::new(device)?, Stream::new(device)?);
        assert_eq!(interleaved(&a, &b)?, (7 * 64, 64));
        clean(&a);
        clean(&b);
        assert_eq!(a.stats().stack_allocations, 3);
        assert_eq!(b.stats().stack_allocations, 1);
        Ok(())
    })
}

#[test]
fn gpu_scope_works_in_plain_functions_and_closures() -> Result<(), PoolError> {
    each_device("dsl_closures", |device| {
        let stream = Stream::new(device)?;
        let square_sum = |n: usize| -> Result<f32, PoolError> {
            gpu_scope!(&stream, {
                let mut v = buffer!(n; f32)?;
                v.upload(&(0..n).map(|i| i as f32).collect::<Vec<_>>())?;
                Ok(v.to_vec()?.iter().map(|x| x * x).sum())
            })
        };
        assert_eq!(square_sum(4)?, 14.0);
        assert_eq!(square_sum(3)?, 5.0);
        clean(&stream);
        Ok(())
    })
}

#[pooled(stream)]
fn closure_inside_pooled(stream: &Stream) -> Result<usize, PoolError> {
    let _base = buffer!(10; u8)?;
    let temp = |len: usize| -> Result<usize, PoolError> {
        let t = buffer!(len; u8)?; // from the function's scope, released when the closure returns
        Ok(t.len())
    };
    Ok(temp(5)? + temp(6)?)
}

#[test]
fn buffers_in_closures_of_a_pooled_function() -> Result<(), PoolError> {
    each_device("dsl_closure_in_fn", |device| {
        let stream = Stream::new(device)?;
        assert_eq!(closure_inside_pooled(&stream)?, 11);
        clean(&stream);
        Ok(())
    })
}

/// Generics, a where clause, doc comments, other attributes and a `self` field path are kept.
struct Pipeline<S> {
    stream: S,
    calls: usize,
}

impl<S: gpu_pool::AsStream> Pipeline<S> {
    /// Doubles every element.
    #[pooled(self.stream)]
    #[inline(never)]
    fn double<T>(&mut self, input: &[T]) -> Result<Vec<T>, PoolError>
    where
        T: bytemuck::Pod + std::ops::Add<Output = T>,
    {
        self.calls += 1;
        let mut x = buffer!(input.len(); T)?;
        x.upload(input)?;
        Ok(x.to_vec()?.into_iter().map(|v| v + v).collect())
    }
}

#[test]
#[expect(
    clippy::arc_with_non_send_sync,
    reason = "an `Arc<Stream>` parameter is part of what the attribute accepts"
)]
fn methods_generics_and_smart_pointer_streams() -> Result<(), PoolError> {
    each_device("dsl_methods", |device| {
        let mut by_value = Pipeline {
            stream: Stream::new(device)?,
            calls: 0,
        };
        assert_eq!(by_value.double(&[1u32, 2, 3])?, [2, 4, 6]);
        let mut arc = Pipeline {
            stream: Arc::new(Stream::new(device)?),
            calls: 0,
        };
        assert_eq!(arc.double(&[1.5f64])?, [3.0]);
        let mut rc = Pipeline {
            stream: Rc::new(Stream::new(device)?),
            calls: 0,
        };
        assert_eq!(rc.double(&[7i8])?, [14]);
        assert_eq!(by_value.calls + arc.calls + rc.calls, 3);
        clean(&by_value.stream);
        clean(&arc.stream);
        clean(&rc.stream);
        Ok(())
    })
}

#[pooled(stream)]
fn swap_handles(stream: &mut Stream) -> Result<(u64, u64), PoolError> {
    let mut a = buffer!(100; u8)?;
    let mut b = buffer!(100; u8)?;
    let (pa, pb) = (a.device_ptr(), b.device_ptr());
    // Handles can be swapped (they are references); the memory stays with its owner.
    std::mem::swap(&mut a, &mut b);
    a.set_to(1)?;
    b.set_to(2)?;
    // Forgetting a handle forgets a reference: the owner still releases, at the end of the scope.
    // (`drop(a)` is refused at compile time: it would look like a release and be none.)
    #[expect(
        clippy::forget_non_drop,
        reason = "shows that forgetting a handle is harmless"
    )]
    std::mem::forget(a);
    let _ = b; // binds nothing: `b` stays usable
    b.set_to(3)?;
    Ok((pa, pb))
}

#[test]
fn swapping_or_forgetting_handles_keeps_release_order_lifo() -> Result<(), PoolError> {
    each_device("dsl_swap_handles", |device| {
        let mut stream = Stream::new(device)?;
        let (pa, pb) = swap_handles(&mut stream)?;
        assert!(pb > pa);
        clean(&stream);
        Ok(())
    })
}

#[pooled(stream)]
fn falls_back_inside_the_dsl(stream: &Stream) -> Result<gpu_pool::Source, PoolError> {
    let _fits = buffer!(512, 1024; u8)?;
    let over = buffer!(1024, 1024; u8)?; // 1 MiB stack: this one falls back
    Ok(over.source())
}

#[test]
fn the_dsl_falls_back_like_the_runtime() -> Result<(), PoolError> {
    each_device("dsl_fallback", |device| {
        device.set_fallback(Fallback::Driver);
        set_buffer_pool_config(device, 1 << 20, 2)?;
        let stream = Stream::new(device)?;
        assert_eq!(
            falls_back_inside_the_dsl(&stream)?,
            gpu_pool::Source::Fallback(FallbackReason::StackFull)
        );
        clean(&stream);
        drop(stream);
        set_buffer_pool_config(device, 10 << 20, 5)?;
        Ok(())
    })
}

#[pooled(stream)]
fn attributes_apply_to_the_whole_buffer(stream: &Stream) -> Result<usize, PoolError> {
    #[cfg(any())]
    let never = buffer!(1 << 20; u8)?;
    #[cfg(test)]
    let always = buffer!(16; u8)?;
    #[allow(unused_mut)]
    let mut quiet = buffer!(2, 2; u8)?;
    Ok(always.len() + quiet.len())
}

#[test]
fn a_buffer_disabled_by_cfg_is_not_taken() -> Result<(), PoolError> {
    each_device("dsl_cfg", |device| {
        let stream = Stream::new(device)?;
        assert_eq!(attributes_apply_to_the_whole_buffer(&stream)?, 16 + 4);
        assert_eq!(
            stream.stats().stack_allocations,
            2,
            "only the two enabled buffers"
        );
        clean(&stream);
        Ok(())
    })
}

#[pooled(stream)]
fn raw_names(stream: &Stream) -> Result<usize, PoolError> {
    let r#type = buffer!(8; u8)?;
    let mut r#loop = buffer!(2, 3; u16)?;
    r#loop.set_to(5)?;
    let r#async = gpu_scope!(stream, {
        let r#fn = buffer!(4; u32)?;
        r#fn.len()
    });
    Ok(r#type.len()
        + r#loop
            .to_vec()?
            .iter()
            .map(|&v| usize::from(v))
            .sum::<usize>()
        + r#async)
}

#[test]
fn raw_identifiers_stay_raw() -> Result<(), PoolError> {
    each_device("dsl_raw", |device| {
        let stream = Stream::new(device)?;
        assert_eq!(raw_names(&stream)?, 8 + 6 * 5 + 4);
        clean(&stream);
        Ok(())
    })
}

#[pooled(stream)]
fn temporaries_around_dsl_lines(stream: &Stream) -> Result<usize, PoolError> {
    let pool = BufferPool::new(stream);
    // A runtime-API temporary in a size: taken and released before `a` is taken.
    let a = buffer!(pool.get_buffer_1d::<u8>(7)?.len(), pool.get_buffer::<u8>(2, 2)?.rows(); u8)?;
    // A temporary in a block's tail: released before the block's own buffers.
    let inner = {
        let b = buffer!(5; u8)?;
        b.len() + pool.get_buffer_1d::<u8>(3)?.len()
    };
    let scoped = gpu_scope!(stream, {
        let c = buffer!(9; u8)?;
        c.len() + pool.get_buffer_1d::<u16>(3)?.len()
    });
    Ok(a.len() + inner + scoped)
}

#[test]
fn temporaries_in_dsl_lines_keep_lifo_order() -> Result<(), PoolError> {
    each_device("dsl_temporaries", |device| {
        let stream = Stream::new(device)?;
        assert_eq!(temporaries_around_dsl_lines(&stream)?, 7 * 2 + 8 + 12);
        clean(&stream);
        Ok(())
    })
}

/// Aligned above what device memory guarantees.
#[derive(Clone, Copy, bytemuck::Zeroable, bytemuck::Pod)]
#[repr(C, align(512))]
struct Wide([u8; 512]);

#[pooled(stream)]
fn over_aligned(stream: &Stream) -> Result<usize, PoolError> {
    let w = buffer!(4, 4; Wide)?;
    Ok(w.len())
}

#[test]
fn an_over_aligned_element_is_an_error_through_the_dsl_too() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::private_host())?;
    let err = over_aligned(&stream).unwrap_err();
    assert!(
        matches!(err, PoolError::UnsupportedAlignment { align: 512, .. }),
        "{err}"
    );
    clean(&stream);
    Ok(())
}

/// A user's own `buffer!`, called by a path: not gpu-pool's, so `#[pooled]` and `gpu_scope!` leave
/// it alone.
mod bytes {
    macro_rules! buffer {
        ($($byte:expr),* $(,)?) => { vec![$($byte as u8),*] };
    }
    pub(crate) use buffer;
}

/// Another one, written and handled as gpu-pool's is (`let name = ..::buffer!(len; T)?;`).
mod checked {
    macro_rules! buffer {
        ($len:expr; $elem:ty) => {
            Ok::<Vec<$elem>, PoolError>(vec![<$elem>::default(); $len])
        };
    }
    pub(crate) use buffer;
}

#[pooled(stream)]
fn users_own_buffer_macros(stream: &Stream) -> Result<usize, PoolError> {
    let ours = buffer!(4; u8)?;
    let theirs = bytes::buffer![1, 2, 3];
    let zeros: Vec<u16> = checked::buffer!(5; u16)?;
    let later = async { self::bytes::buffer![7] };
    let scoped = gpu_scope!(stream, {
        let mine = gpu_pool::prelude::buffer!(2; u8)?;
        let more = crate::dsl::checked::buffer!(1; u8)?;
        mine.len() + more.len() + bytes::buffer![4, 5].len()
    });
    let later = block_on(later);
    Ok(ours.len()
        + theirs.iter().map(|&b| usize::from(b)).sum::<usize>()
        + zeros.len() * 10
        + scoped * 100
        + usize::from(later[0]) * 1000)
}

#[test]
fn macros_of_the_users_own_named_buffer_are_left_alone() -> Result<(), PoolError> {
    each_device("dsl_users_buffer", |device| {
        let stream = Stream::new(device)?;
        assert_eq!(users_own_buffer_macros(&stream)?, 4 + 6 + 50 + 500 + 7000);
        assert_eq!(
            stream.stats().stack_allocations,
            2,
            "only gpu-pool's `buffer!`s take from the stack"
        );
        clean(&stream);
        Ok(())
    })
}

/// Polls `future` once, with a waker that does nothing.
fn poll_once<F: Future>(future: Pin<&mut F>) -> Poll<F::Output> {
    future.poll(&mut Context::from_waker(Waker::noop()))
}

/// Polls `future` until it is ready (for futures that wake themselves at once).
fn block_on<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    loop {
        if let Poll::Ready(output) = poll_once(future.as_mut()) {
            return output;
        }
    }
}

/// Suspends once.
struct Pause(bool);

impl Future for Pause {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
        if std::mem::replace(&mut self.0, true) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

/// An `.await` that a user's `macro_rules!` produces, as `tokio::join!` and `select!` do: the
/// tokens `gpu_scope!` is given hold none, so it cannot refuse it.
macro_rules! pause {
    () => {
        Pause(false).await
    };
}

async fn holds_a_buffer_across_a_hidden_await(stream: &Stream) -> Result<u64, PoolError> {
    gpu_scope!(stream, {
        let mut a = buffer!(64; u8)?;
        a.set_to(1)?;
        pause!();
        Ok(a.device_ptr())
    })
}

/// The one known limit of the DSL (RELIABILITY.md): a future dropped while suspended at such an
/// `.await` releases its buffer out of order if other code took a buffer from the stream meanwhile.
/// The pool survives it: the release is counted, the bytes are reclaimed once the buffers above
/// are gone, and no live memory is handed out twice.
#[test]
fn a_future_dropped_at_a_hidden_await_leaves_the_pool_consistent() -> Result<(), PoolError> {
    each_device("dsl_hidden_await", |device| {
        let stream = Stream::new(device)?;
        let pool = BufferPool::new(&stream);

        // Driven to the end, the scope is LIFO like any other.
        let mut future = pin!(holds_a_buffer_across_a_hidden_await(&stream));
        assert!(poll_once(future.as_mut()).is_pending());
        assert!(
            stream.stats().stack_in_use >= 64,
            "the buffer is held across the `.await`"
        );
        let Poll::Ready(bottom) = poll_once(future.as_mut()) else {
            panic!("ready after one pause")
        };
        let bottom = bottom?;
        assert_eq!(Some(bottom), stream.stack_range().map(|r| r.start));
        clean(&stream);

        // Dropped while suspended, with nothing taken meanwhile: its buffer goes back in order.
        let mut future = Box::pin(holds_a_buffer_across_a_hidden_await(&stream));
        assert!(poll_once(future.as_mut()).is_pending());
        drop(future);
        clean(&stream);

        // Dropped while suspended, under a buffer taken meanwhile: out of order, survived.
        let mut future = Box::pin(holds_a_buffer_across_a_hidden_await(&stream));
        assert!(poll_once(future.as_mut()).is_pending());
        let above = pool.get_buffer_1d::<u8>(32)?;
        assert_eq!(above.source(), Source::Stack);
        assert!(
            above.device_ptr() >= bottom + 64,
            "above the suspended future's buffer"
        );
        let in_use = stream.stats().stack_in_use;
        drop(future);
        let stats = stream.stats();
        assert_eq!(
            stats.lifo_violations, 1,
            "the out-of-order release is counted"
        );
        assert_eq!(
            stats.stack_in_use, in_use,
            "its bytes stay reserved while `above` lives"
        );
        let next = pool.get_buffer_1d::<u8>(16)?;
        assert_eq!(
            next.source(),
            Source::Stack,
            "later buffers still come from the stack"
        );
        assert!(
            next.device_ptr() >= above.device_ptr() + 32,
            "and overlap nothing live"
        );
        drop(next);
        drop(above);
        let stats = stream.stats();
        assert_eq!(
            stats.stack_in_use, 0,
            "everything reclaimed once `above` is gone"
        );
        assert_eq!(stats.lifo_violations, 1);
        assert_eq!(
            stats.stack_allocations, 5,
            "3 from the scope, 2 from the runtime API"
        );
        let first = pool.get_buffer_1d::<u8>(1)?;
        assert_eq!(
            Some(first.device_ptr()),
            stream.stack_range().map(|r| r.start),
            "the next buffer starts at the bottom again"
        );
        Ok(())
    })
}
