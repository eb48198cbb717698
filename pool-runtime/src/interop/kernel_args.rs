//! Pool buffers as arguments of cudarc kernel launches: `.buf(&src).buf_mut(&mut dst)`
//! ([`LaunchArgsExt`]).
//!
//! A buffer is passed as its device address (a `u64`, what a kernel's `T*` parameter receives).
//! `.buf` / `.buf_mut` take any [`GpuRead`] / [`GpuWrite`]; the concrete buffer types also
//! implement cudarc's `PushKernelArg` (`.arg(&mat)`), which a generic `&impl GpuRead<T>` cannot.
//!
//! A 2D kernel takes a buffer with its shape as one parameter: [`Pitched`] (read-only, from
//! `.pitched()`) or [`PitchedMut`] (from `.pitched_mut()`, for outputs) carry the address, the step
//! and the rows and columns, laid out as the `Pitched<T>` of [`PITCHED_H`], a CUDA header to put in
//! front of nvrtc sources. [`grid_2d`] makes the launch configuration of a kernel with one thread
//! an element. See the `Pitched` example below the first one.
//!
//! ```no_run
//! use gpu_pool::{compat::opencv::BufferPool, Device, GpuRead, GpuWrite, Stream};
//! use gpu_pool::interop::LaunchArgsExt;
//! use gpu_pool::interop::cudarc::driver::{LaunchConfig, PushKernelArg};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let gpu = Device::cuda(0)?;
//! let stream = Stream::new(&gpu)?;
//! let ptx = gpu_pool::interop::cudarc::nvrtc::compile_ptx(
//!     r#"extern "C" __global__ void one(float* x, int n) { int i = threadIdx.x; if (i < n) x[i] = 1.0f; }"#,
//! )?;
//! let f = gpu.cudarc()?.load_module(ptx)?.load_function("one")?;
//! let mut x = BufferPool::new(&stream).get_buffer_1d::<f32>(256)?;
//! let n = 256i32;
//! // SAFETY: `one` takes (float*, int) and writes n floats, which `x` holds.
//! unsafe { stream.cudarc()?.launch_builder(&f).buf_mut(&mut x).arg(&n).launch(LaunchConfig::for_num_elems(256))? };
//! assert!(x.to_vec()?.iter().all(|&v| v == 1.0));
//! # Ok(()) }
//! ```
//!
//! With the shape in the argument:
//!
//! ```no_run
//! use gpu_pool::interop::{PITCHED_H, grid_2d};
//! use gpu_pool::{compat::opencv::BufferPool, Device, GpuRead, GpuWrite, Stream};
//! use gpu_pool::interop::LaunchArgsExt;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let gpu = Device::cuda(0)?;
//! let stream = Stream::new(&gpu)?;
//! let src = format!("{PITCHED_H}{}", r#"
//! extern "C" __global__ void index(Pitched<float> m) {
//!     unsigned c = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y * blockDim.y + threadIdx.y;
//!     if (r < m.rows && c < m.cols) m(r, c) = r * 1000.0f + c;
//! }"#);
//! let ptx = gpu_pool::interop::cudarc::nvrtc::compile_ptx(src)?;
//! let f = gpu.cudarc()?.load_module(ptx)?.load_function("index")?;
//! let mut m = BufferPool::new(&stream).get_buffer::<f32>(30, 70)?;
//! let grid = grid_2d(m.rows(), m.cols())?;
//! let arg = m.pitched_mut();
//! // SAFETY: `index` takes one `Pitched<float>` and writes only inside its rows and columns.
//! unsafe { stream.cudarc()?.launch_builder(&f).pitched(&arg).launch(grid)? };
//! assert_eq!(m.to_vec()?[70 + 3], 1003.0);
//! # Ok(()) }
//! ```

use cudarc::driver::{DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg};

use bytemuck::Pod;

use crate::base::error::PoolError;
use crate::core::access::{GpuRead, GpuWrite};
use crate::core::pitched::{Pitched, PitchedMut};

use crate::core::buffer::{DeviceMat, Temp};
use crate::core::scope::Pooled;
use crate::core::view::{GpuView, GpuViewMut};
#[cfg(feature = "shared")]
use crate::shared::{SharedRead, SharedWrite};

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
    &'b Temp<'s, T> => |buffer| buffer.ptr_field(),
    &'b mut Temp<'s, T> => |buffer| buffer.ptr_field(),
    &'b DeviceMat<'s, T> => |buffer| buffer.ptr_field(),
    &'b mut DeviceMat<'s, T> => |buffer| buffer.ptr_field(),
    &'b GpuView<'s, T> => |view| &view.window.ptr,
    &'b mut GpuViewMut<'s, T> => |view| &view.window.ptr,
);

#[cfg(feature = "shared")]
push_address!(
    &'b SharedRead<'s, T> => |access| access.ptr_field(),
    &'b SharedWrite<'s, T> => |access| access.ptr_field(),
    &'b mut SharedWrite<'s, T> => |access| access.ptr_field(),
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

/// Pool buffers as kernel arguments, by what the kernel takes: `.buf(&src)` for a `const T*`,
/// `.buf_mut(&mut dst)` for a `T*`, `.pitched(&p)` for a `Pitched<const T>` of [`PITCHED_H`]
/// (the 32-byte address, step, rows and columns, made by `src.pitched()`). Each takes anything that is [`GpuRead`] (or
/// [`GpuWrite`]): a `GpuMat`, a `buffer!` handle, a view or region, an access to shared memory, and
/// a function's `&impl GpuRead<T>` parameter.
///
/// cudarc's own `.arg(&x)` takes only concrete types: on a generic `src: &impl GpuRead<T>` it
/// fails with "the trait bound `impl GpuRead<f32>: DeviceRepr` is not satisfied", and cudarc
/// cannot be told otherwise (its trait is foreign, and so is the generic type). `.buf(src)` is
/// what that code means.
///
/// ```no_run
/// use gpu_pool::interop::LaunchArgsExt; // in `gpu_pool::prelude` too
/// use gpu_pool::interop::cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
/// use gpu_pool::{GpuRead, GpuWrite};
///
/// /// `dst = 2 * src` on `src`'s stream, for any kind of buffer.
/// fn double(
///     f: &CudaFunction,
///     src: &impl GpuRead<f32>,
///     dst: &mut impl GpuWrite<f32>,
/// ) -> Result<(), Box<dyn std::error::Error>> {
///     let n = src.len() as i32;
///     let stream = src.view().stream().ok_or("memory of no stream")?.cudarc()?;
///     let mut args = stream.launch_builder(f);
///     args.buf(src).buf_mut(dst).arg(&n);
///     // SAFETY: the kernel takes (const float*, float*, int) and touches n elements of each.
///     unsafe { args.launch(LaunchConfig::for_num_elems(n as u32))? };
///     Ok(())
/// }
/// ```
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub trait LaunchArgsExt<'a> {
    /// Pushes the device address of `buffer`'s first element, for a kernel's `const T*`
    /// parameter. The buffer stays borrowed while the builder lives.
    fn buf<T: Pod, S: GpuRead<T> + ?Sized>(&mut self, buffer: &'a S) -> &mut Self;

    /// Pushes the device address of `buffer`'s first element, for a kernel's `T*` parameter
    /// the kernel writes through. The buffer stays borrowed mutably while the builder lives.
    fn buf_mut<T: Pod, S: GpuWrite<T> + ?Sized>(&mut self, buffer: &'a mut S) -> &mut Self;

    /// Pushes a [`Pitched`] or [`PitchedMut`] (made by `.pitched()` / `.pitched_mut()`): the
    /// 32-byte `Pitched<T>` of [`PITCHED_H`] (address, step, rows and columns), for 2D kernels.
    /// What `.arg(&p)` does, named so that a struct is never pushed where an address was meant.
    /// cudarc keeps a pointer to the value until the launch, so the value lives outside the
    /// builder: `let p = src.pitched(); args.pitched(&p)`.
    fn pitched<P: PitchedArg>(&mut self, arg: &'a P) -> &mut Self;
}

/// A 2D kernel argument that [`LaunchArgsExt::pitched`] pushes: [`Pitched`] or [`PitchedMut`].
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub trait PitchedArg: DeviceRepr + sealed::Sealed {}

mod sealed {
    pub trait Sealed {}
}

impl<T> sealed::Sealed for Pitched<'_, T> {}
impl<T> PitchedArg for Pitched<'_, T> {}
impl<T> sealed::Sealed for PitchedMut<'_, T> {}
impl<T> PitchedArg for PitchedMut<'_, T> {}

impl<'a> LaunchArgsExt<'a> for LaunchArgs<'a> {
    #[inline(always)]
    fn buf<T: Pod, S: GpuRead<T> + ?Sized>(&mut self, buffer: &'a S) -> &mut Self {
        if crate::core::graph_key::recording() {
            let _ = buffer.view(); // the view notes its memory
        }
        <Self as PushKernelArg<&'a u64>>::arg(self, buffer.addr_ref())
    }

    #[inline(always)]
    fn buf_mut<T: Pod, S: GpuWrite<T> + ?Sized>(&mut self, buffer: &'a mut S) -> &mut Self {
        if crate::core::graph_key::recording() {
            let _ = buffer.view(); // the view notes its memory
        }
        <Self as PushKernelArg<&'a u64>>::arg(self, buffer.addr_mut())
    }

    #[inline(always)]
    fn pitched<P: PitchedArg>(&mut self, arg: &'a P) -> &mut Self {
        <Self as PushKernelArg<&'a P>>::arg(self, arg)
    }
}

/// A CUDA C++ header declaring `Pitched<T>`, the device side of [`Pitched`] and [`PitchedMut`]:
/// prepend it to an nvrtc source (`format!("{PITCHED_H}{source}")`). A kernel takes
/// `Pitched<const T>` for a [`Pitched`] and `Pitched<T>` for a [`PitchedMut`], and reads
/// `m.rows`, `m.cols`, `m.row(r)` (a `T*`) or `m(r, c)` (a `T&`). Its `static_assert`s pin the
/// layout the Rust types have (a unit test checks the two against each other).
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub const PITCHED_H: &str = r#"
#ifndef GPU_POOL_PITCHED_H
#define GPU_POOL_PITCHED_H
// gpu-pool's pitched kernel argument: a 2D buffer (or a region of one) with its shape.
template <typename T>
struct Pitched {
    T* ptr;                  // row 0, column 0
    unsigned long long step; // bytes between the starts of two rows
    unsigned long long rows;
    unsigned long long cols; // elements of T a row
    // Row r (no bounds check).
    __device__ __forceinline__ T* row(unsigned long long r) const {
        return (T*)((const char*)ptr + r * step);
    }
    // The element at (r, c) (no bounds check).
    __device__ __forceinline__ T& operator()(unsigned long long r, unsigned long long c) const {
        return row(r)[c];
    }
    // Whether (r, c) is inside.
    __device__ __forceinline__ bool contains(unsigned long long r, unsigned long long c) const {
        return r < rows && c < cols;
    }
};
// Four fields of 8 bytes, declared in order, in 32 bytes: no padding, so at offsets 0, 8, 16, 24.
// (nvrtc has no offsetof.)
static_assert(sizeof(char*) == 8, "Pitched: ptr");
static_assert(sizeof(unsigned long long) == 8, "Pitched: step, rows, cols");
static_assert(sizeof(Pitched<char>) == 32, "Pitched: size");
static_assert(alignof(Pitched<char>) == 8, "Pitched: align");
#endif
"#;

// SAFETY: `Pitched` and `PitchedMut` are `repr(transparent)` wrappers of `Shape`: four `u64`s in
// `repr(C)`, 32 bytes aligned to 8, the layout of the header's `Pitched<T>` (its `static_assert`s,
// and the test `the_header_declares_the_rust_layout`, pin it). Every bit pattern is valid. The
// borrow each carries keeps the memory alive while the value, and so the launch builder it is
// pushed into, lives.
unsafe impl<T> DeviceRepr for Pitched<'_, T> {}
// SAFETY: as above.
unsafe impl<T> DeviceRepr for PitchedMut<'_, T> {}

/// Threads a block of [`grid_2d`]: 32 along a row (a warp, so a row's loads coalesce) by 8 rows.
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub const BLOCK_2D: (u32, u32) = (32, 8);

/// The launch configuration of a 2D kernel with one thread per element of `rows x cols`: blocks of
/// [`BLOCK_2D`] threads, enough of them to cover every element (the kernel checks its bounds, as
/// with `Pitched::contains`). A kernel that handles `n` elements of a row a thread launches
/// `grid_2d(rows, cols.div_ceil(n))`.
///
/// # Errors
/// [`PoolError::SizeOverflow`] (with an element size of 1) when the grid is larger than CUDA's
/// limits: 2^31 - 1 blocks along x, 65535 along y.
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub fn grid_2d(rows: usize, cols: usize) -> Result<LaunchConfig, PoolError> {
    const MAX_X: usize = (1 << 31) - 1;
    const MAX_Y: usize = 65535;
    let (bx, by) = BLOCK_2D;
    let (gx, gy) = (cols.div_ceil(bx as usize), rows.div_ceil(by as usize));
    if gx > MAX_X || gy > MAX_Y {
        return Err(PoolError::SizeOverflow {
            rows,
            cols,
            elem_size: 1,
        });
    }
    Ok(LaunchConfig {
        // Both fit in u32: checked above. An empty shape launches one block that does nothing,
        // as CUDA refuses a grid of zero blocks.
        grid_dim: (gx.max(1) as u32, gy.max(1) as u32, 1),
        block_dim: (bx, by, 1),
        shared_mem_bytes: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::pitched::Shape;

    /// Every `static_assert(EXPR == N, ..)` of the header, as (EXPR, N).
    fn asserts() -> Vec<(String, usize)> {
        PITCHED_H
            .lines()
            .filter_map(|l| l.trim().strip_prefix("static_assert("))
            .map(|l| {
                let (expr, n) = l.split_once(", \"").unwrap().0.split_once(" == ").unwrap();
                (expr.to_string(), n.parse().unwrap())
            })
            .collect()
    }

    #[test]
    fn the_header_declares_the_rust_layout() {
        let rust = |expr: &str| match expr {
            "sizeof(char*)" | "sizeof(unsigned long long)" => size_of::<u64>(),
            "sizeof(Pitched<char>)" => size_of::<Pitched<'_, u8>>(),
            "alignof(Pitched<char>)" => align_of::<Pitched<'_, u8>>(),
            _ => panic!("unknown assertion {expr}"),
        };
        let asserts = asserts();
        assert_eq!(asserts.len(), 4, "field sizes, size and align");
        for (expr, n) in asserts {
            assert_eq!(rust(&expr), n, "{expr}");
        }
        // What the header's comment derives from them: the fields in order, without padding.
        let offsets = [
            std::mem::offset_of!(Shape, ptr),
            std::mem::offset_of!(Shape, step),
            std::mem::offset_of!(Shape, rows),
            std::mem::offset_of!(Shape, cols),
        ];
        assert_eq!(offsets, [0, 8, 16, 24]);
        assert_eq!(size_of::<PitchedMut<'_, [u8; 3]>>(), 32);
        assert_eq!(align_of::<PitchedMut<'_, f64>>(), 8);
    }

    #[test]
    fn grid_2d_covers_every_element_and_refuses_what_cuda_cannot_launch() {
        let dims = |rows, cols| grid_2d(rows, cols).map(|c| (c.grid_dim, c.block_dim));
        assert_eq!(dims(1, 1).unwrap(), ((1, 1, 1), (32, 8, 1)));
        assert_eq!(dims(8, 32).unwrap(), ((1, 1, 1), (32, 8, 1)));
        assert_eq!(dims(9, 33).unwrap(), ((2, 2, 1), (32, 8, 1)));
        assert_eq!(
            dims(0, 0).unwrap().0,
            (1, 1, 1),
            "never a grid of zero blocks"
        );
        assert_eq!(
            dims(65535 * 8, 32 * ((1 << 31) - 1)).unwrap().0,
            ((1 << 31) - 1, 65535, 1)
        );
        assert!(matches!(
            grid_2d(65535 * 8 + 1, 1),
            Err(PoolError::SizeOverflow {
                rows: 524_281,
                cols: 1,
                elem_size: 1
            })
        ));
        assert!(grid_2d(1, 32 * ((1 << 31) - 1) + 1).is_err());
        assert!(grid_2d(usize::MAX, usize::MAX).is_err());
    }
}
