//! What a CUDA graph capture asks of every stream, not only of the one capturing.
//!
//! A capture records work instead of running it, and replays it later on the same addresses. So
//! whatever the recorded work touches must stay reserved for the graph's life, and nothing may
//! slip into a capture that the pool cannot reserve for. Three rules keep that true:
//! - one pool stream per CUDA stream ([`Wrapped`]): two pool streams over one CUDA stream would
//!   have two stacks whose work one capture records as one;
//! - while a pool capture is under way on a thread ([`ThreadCapture`]), no driver allocation or
//!   free runs on that thread (the captured work may use the memory, and an allocation would
//!   land in the graph), so memory released meanwhile is kept (`stream/capture.rs`); and memory allocated before a
//!   capture began stays kept, once released, while that capture's graph lives (its replays may
//!   write it);
//! - work that crosses streams, and pool work on a CUDA stream captured by anyone but its own
//!   pool stream, is refused (the checks live on `Stream`, which knows both sides).

use std::cell::Cell;

thread_local! {
    /// Pool captures under way on this thread.
    static CAPTURES: Cell<u32> = const { Cell::new(0) };
    /// A lent buffer was refused to cudarc during a pool capture on this thread: the capture
    /// fails. A flag of the pool's own: cudarc's context keeps one error for every thread, and
    /// any cudarc call clears it.
    static REFUSED: Cell<bool> = const { Cell::new(false) };
}

/// Marks the pool capture under way on this thread (if any) as failed by a refused cudarc call.
#[cfg(feature = "cuda")]
pub(crate) fn note_refused() {
    if on_this_thread() {
        REFUSED.with(|r| r.set(true));
    }
}

/// Whether a cudarc call was refused since the last call; clears the mark.
#[cfg(feature = "cuda")]
pub(crate) fn take_refused() -> bool {
    REFUSED.with(|r| r.replace(false))
}

/// Marks a pool capture under way on this thread for as long as it lives. Only CUDA captures.
#[cfg(feature = "cuda")]
pub(crate) struct ThreadCapture(());

#[cfg(feature = "cuda")]
impl ThreadCapture {
    pub(crate) fn begin() -> ThreadCapture {
        CAPTURES.with(|c| c.set(c.get() + 1));
        ThreadCapture(())
    }
}

#[cfg(feature = "cuda")]
impl Drop for ThreadCapture {
    fn drop(&mut self) {
        CAPTURES.with(|c| c.set(c.get() - 1));
        if !on_this_thread() {
            crate::core::deferred::captures_ended();
        }
    }
}

/// Whether a pool capture is under way on this thread.
pub(crate) fn on_this_thread() -> bool {
    CAPTURES.with(|c| c.get() > 0)
}

#[cfg(feature = "cuda")]
pub(crate) use wrapped::Wrapped;

#[cfg(feature = "cuda")]
mod wrapped {
    use std::sync::Mutex;

    use crate::base::error::PoolError;
    use crate::base::sync::lock;
    use crate::storage::backend::RawStream;

    /// `(context, stream, pool stream id)` of every CUDA stream a pool stream wraps.
    static WRAPPED: Mutex<Vec<(usize, usize, u64)>> = Mutex::new(Vec::new());

    /// A CUDA stream claimed by one pool stream until this is dropped.
    #[derive(Debug)]
    pub(crate) struct Wrapped {
        key: (usize, usize),
    }

    impl Wrapped {
        /// Claims `raw` for the pool stream `id`: `StreamAlreadyWrapped` if another holds it.
        /// `None` for a host stream, which has nothing to share.
        pub(crate) fn claim(raw: &RawStream, id: u64) -> Result<Option<Wrapped>, PoolError> {
            let RawStream::Cuda(s) = raw else {
                return Ok(None);
            };
            // The legacy default stream is null in every context, so the context is part of
            // the key.
            let key = (s.context().cu_ctx() as usize, s.cu_stream() as usize);
            let mut wrapped = lock(&WRAPPED);
            if let Some(&(_, _, existing)) = wrapped.iter().find(|w| (w.0, w.1) == key) {
                return Err(PoolError::StreamAlreadyWrapped { existing });
            }
            wrapped.push((key.0, key.1, id));
            Ok(Some(Wrapped { key }))
        }
    }

    impl Drop for Wrapped {
        fn drop(&mut self) {
            lock(&WRAPPED).retain(|w| (w.0, w.1) != self.key);
        }
    }
}
