//! Pool buffers as arguments of cudarc kernel launches: `stream.launch_builder(&f).arg(&mat)`.
//!
//! A buffer is passed as its device address (a `u64`, what a kernel's `T*` parameter receives);
//! pass its step separately where the kernel needs it. cudarc cannot build its own views from raw
//! pointers, so the buffers implement its `PushKernelArg` instead.
//!
//! ```no_run
//! use gpu_pool_runtime::{BufferPool, Device, Stream};
//! use gpu_pool_runtime::cudarc::driver::{LaunchConfig, PushKernelArg};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let gpu = Device::cuda(0)?;
//! let stream = Stream::new(&gpu)?;
//! let ptx = gpu_pool_runtime::cudarc::nvrtc::compile_ptx(
//!     r#"extern "C" __global__ void one(float* x, int n) { int i = threadIdx.x; if (i < n) x[i] = 1.0f; }"#,
//! )?;
//! let f = gpu.cuda_context().unwrap().load_module(ptx)?.load_function("one")?;
//! let mut x = BufferPool::new(&stream).get_buffer_1d::<f32>(256)?;
//! let n = 256i32;
//! // SAFETY: `one` takes (float*, int) and writes n floats, which `x` holds.
//! unsafe { stream.cuda_stream().unwrap().launch_builder(&f).arg(&mut x).arg(&n).launch(LaunchConfig::for_num_elems(256))? };
//! assert!(x.to_vec()?.iter().all(|&v| v == 1.0));
//! # Ok(()) }
//! ```

use cudarc::driver::{LaunchArgs, PushKernelArg};

use crate::buffer::GpuMat;
use crate::frame::Pooled;
use crate::view::{GpuView, GpuViewMut};

macro_rules! push_address {
    ($($ty:ty => |$buffer:ident| $address:expr),* $(,)?) => {$(
        // SAFETY: pushes a pointer to the buffer's device address, a `u64` stored in the buffer
        // (or view), which is borrowed for 'b and so outlives the launch builder ('a). The driver
        // reads the argument at launch; the kernel receives the address by value.
        unsafe impl<'a, 'b: 'a, 's, T> PushKernelArg<$ty> for LaunchArgs<'a> {
            #[inline(always)]
            fn arg(&mut self, $buffer: $ty) -> &mut Self {
                <Self as PushKernelArg<&'b u64>>::arg(self, $address)
            }
        }
    )*};
}

push_address!(
    &'b GpuMat<'s, T> => |buffer| buffer.ptr_field(),
    &'b mut GpuMat<'s, T> => |buffer| buffer.ptr_field(),
    &'b GpuView<'s, T> => |view| &view.window.ptr,
    &'b mut GpuViewMut<'s, T> => |view| &view.window.ptr,
);

// SAFETY: as above; the address lives in the buffer the handle borrows for 'b.
unsafe impl<'a, 'b: 'a, 'h, 's, T> PushKernelArg<&'b Pooled<'h, 's, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, buffer: &'b Pooled<'h, 's, T>) -> &mut Self {
        <Self as PushKernelArg<&'b u64>>::arg(self, buffer.ptr_field())
    }
}

// SAFETY: as above.
unsafe impl<'a, 'b: 'a, 'h, 's, T> PushKernelArg<&'b mut Pooled<'h, 's, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, buffer: &'b mut Pooled<'h, 's, T>) -> &mut Self {
        <Self as PushKernelArg<&'b u64>>::arg(self, buffer.ptr_field())
    }
}
