//! # gpu-pool
//!
//! Allocation-free GPU temporaries: every stream owns a pre-allocated stack, and temporary buffers
//! are bump-allocated from it and released in reverse order (OpenCV's `cv::cuda::BufferPool`, made
//! safe).
//!
//! ```
//! use gpu_pool::prelude::*;
//!
//! let stream = Stream::new(&Device::host())?;
//! let pool = BufferPool::new(&stream);
//! let gray = pool.get_buffer::<u8>(480, 640)?;
//! let sums = pool.get_buffer_1d::<f32>(480)?;
//! assert_eq!((gray.source(), sums.source()), (Source::Stack, Source::Stack));
//! # Ok::<(), PoolError>(())
//! ```

pub use pool_runtime::*;

/// The names most code needs.
pub mod prelude {
    pub use pool_runtime::{BufferPool, Device, GpuMat, PoolError, Source, Stream};
}
