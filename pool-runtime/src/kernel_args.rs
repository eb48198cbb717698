//! Pool buffers as arguments of cudarc kernel launches: `stream.launch_builder(&f).arg(&mat)`.
//!
//! A buffer is passed as its device address (a `u64`, what a kernel's `T*` parameter receives).
//! cudarc cannot build its own views from raw pointers, so the buffers implement its
//! `PushKernelArg` instead.
//!
//! A 2D kernel takes a buffer with its shape as one parameter: [`Pitched`] (read-only, from
//! `.pitched()`) or [`PitchedMut`] (from `.pitched_mut()`, for outputs) carry the address, the step
//! and the rows and columns, laid out as the `Pitched<T>` of [`PITCHED_H`], a CUDA header to put in
//! front of nvrtc sources. [`grid_2d`] makes the launch configuration of a kernel with one thread
//! an element. See the `Pitched` example below the first one.
//!
//! ```no_run
//! use gpu_pool_runtime::{BufferPool, Device, GpuRead, GpuWrite, Stream};
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
//!
//! With the shape in the argument:
//!
//! ```no_run
//! use gpu_pool_runtime::{BufferPool, Device, GpuRead, GpuWrite, PITCHED_H, Stream, grid_2d};
//! use gpu_pool_runtime::cudarc::driver::PushKernelArg;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let gpu = Device::cuda(0)?;
//! let stream = Stream::new(&gpu)?;
//! let src = format!("{PITCHED_H}{}", r#"
//! extern "C" __global__ void index(Pitched<float> m) {
//!     unsigned c = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y * blockDim.y + threadIdx.y;
//!     if (r < m.rows && c < m.cols) m(r, c) = r * 1000.0f + c;
//! }"#);
//! let ptx = gpu_pool_runtime::cudarc::nvrtc::compile_ptx(src)?;
//! let f = gpu.cuda_context().unwrap().load_module(ptx)?.load_function("index")?;
//! let mut m = BufferPool::new(&stream).get_buffer::<f32>(30, 70)?;
//! let grid = grid_2d(m.rows(), m.cols())?;
//! let arg = m.pitched_mut();
//! // SAFETY: `index` takes one `Pitched<float>` and writes only inside its rows and columns.
//! unsafe { stream.cuda_stream().unwrap().launch_builder(&f).arg(&arg).launch(grid)? };
//! assert_eq!(m.to_vec()?[70 + 3], 1003.0);
//! # Ok(()) }
//! ```

use std::marker::PhantomData;

use cudarc::driver::{DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg};

use crate::error::PoolError;
use crate::view::Window;

use crate::buffer::GpuMat;
use crate::frame::Pooled;
use crate::shared::{SharedRead, SharedWrite};
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

/// A CUDA C++ header declaring `Pitched<T>`, the device side of [`Pitched`] and [`PitchedMut`]:
/// prepend it to an nvrtc source (`format!("{PITCHED_H}{source}")`). A kernel takes
/// `Pitched<const T>` for a [`Pitched`] and `Pitched<T>` for a [`PitchedMut`], and reads
/// `m.rows`, `m.cols`, `m.row(r)` (a `T*`) or `m(r, c)` (a `T&`). Its `static_assert`s pin the
/// layout the Rust types have (a unit test checks the two against each other).
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

/// The fields of [`Pitched`] and [`PitchedMut`], in the header's order.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Shape {
    ptr: u64,
    step: u64,
    rows: u64,
    cols: u64,
}

impl Shape {
    fn of(window: &Window) -> Shape {
        // usize is at most 64 bits on every target cudarc builds for.
        Shape {
            ptr: window.ptr,
            step: window.pitch as u64,
            rows: window.rows as u64,
            cols: window.cols as u64,
        }
    }
}

macro_rules! pitched {
    ($(#[$doc:meta])* $name:ident, $borrow:ty) => {
        $(#[$doc])*
        #[repr(transparent)]
        #[must_use = "a kernel argument does nothing unless pushed"]
        pub struct $name<'a, T> {
            shape: Shape,
            _borrow: PhantomData<$borrow>,
        }

        impl<'a, T> $name<'a, T> {
            /// A kernel argument for memory that is not a pool buffer (a driver allocation,
            /// another library's pool): `rows x cols` elements of `T`, `step` bytes apart.
            ///
            /// # Safety
            /// The memory stays allocated, and is not written by anything else (nor, for
            /// [`PitchedMut`], read) while `'a` lasts and until the kernels it is passed to have
            /// run; the kernels' accesses through it stay inside its rows and columns.
            pub unsafe fn from_raw_parts(ptr: u64, step: usize, rows: usize, cols: usize) -> Self {
                Self::of(&Window { ptr, rows, cols, pitch: step, owns_gaps: false })
            }

            fn of(window: &Window) -> Self {
                Self { shape: Shape::of(window), _borrow: PhantomData }
            }

            /// The device address of row 0 (0 for an empty buffer).
            #[must_use]
            pub fn device_ptr(&self) -> u64 {
                self.shape.ptr
            }

            /// Bytes between rows.
            #[must_use]
            pub fn step(&self) -> usize {
                self.shape.step as usize
            }

            /// Rows.
            #[must_use]
            pub fn rows(&self) -> usize {
                self.shape.rows as usize
            }

            /// Columns (elements of `T` a row).
            #[must_use]
            pub fn cols(&self) -> usize {
                self.shape.cols as usize
            }
        }

        impl<T> std::fmt::Debug for $name<'_, T> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name))
                    .field("ptr", &format_args!("{:#x}", self.shape.ptr))
                    .field("step", &self.shape.step)
                    .field("rows", &self.shape.rows)
                    .field("cols", &self.shape.cols)
                    .finish()
            }
        }

        // SAFETY: a `repr(transparent)` wrapper of `Shape`: four `u64`s in `repr(C)`, 32 bytes
        // aligned to 8, the layout of the header's `Pitched<T>` (its `static_assert`s, and the
        // test `the_header_declares_the_rust_layout`, pin it). Every bit pattern is valid. The
        // borrow it carries keeps the memory alive while the value, and so the launch builder it
        // is pushed into, lives.
        unsafe impl<T> DeviceRepr for $name<'_, T> {}
    };
}

pitched!(
    /// A read-only 2D kernel argument: a buffer's (or a region's) address, step, rows and
    /// columns, pushed as one parameter with `.arg(&p)`; the kernel takes a `Pitched<const T>`
    /// of [`PITCHED_H`]. Made by `.pitched()` on [`GpuMat`], [`GpuView`] and (through `Deref`)
    /// [`Pooled`]; it borrows the buffer, so the buffer outlives the launch.
    Pitched, &'a T
);

impl<T> Clone for Pitched<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

// Not derived: that would ask `T: Copy`.
impl<T> Copy for Pitched<'_, T> {}

pitched!(
    /// A writable 2D kernel argument, the output counterpart of [`Pitched`]: made by
    /// `.pitched_mut()` from a `&mut` [`GpuMat`], [`GpuViewMut`] or [`Pooled`], and taken by the
    /// kernel as a `Pitched<T>` of [`PITCHED_H`]. While it lives, nothing else reads or writes the
    /// buffer from the host side.
    PitchedMut, &'a mut T
);

impl<T> PitchedMut<'_, T> {
    /// A shorter-lived copy, to pass the same output to several launches.
    pub fn reborrow(&mut self) -> PitchedMut<'_, T> {
        PitchedMut {
            shape: self.shape,
            _borrow: PhantomData,
        }
    }

    /// The same memory as a read-only argument, for a later kernel that reads what an earlier
    /// one wrote.
    pub fn as_const(&self) -> Pitched<'_, T> {
        Pitched {
            shape: self.shape,
            _borrow: PhantomData,
        }
    }
}

impl<'a, T> GpuView<'a, T> {
    /// The view as a read-only 2D kernel argument; a region's address is its first element's,
    /// its step the parent's.
    pub fn pitched(&self) -> Pitched<'a, T> {
        Pitched::of(&self.window)
    }
}

impl<'a, T> GpuViewMut<'a, T> {
    /// The view as a writable 2D kernel argument, keeping the view's borrow (what
    /// [`GpuWrite::pitched_mut`](crate::GpuWrite::pitched_mut) returns through a temporary view).
    pub(crate) fn into_pitched_mut(self) -> PitchedMut<'a, T> {
        PitchedMut::of(&self.window)
    }

    /// The view as a read-only 2D kernel argument.
    pub fn pitched(&self) -> Pitched<'_, T> {
        Pitched::of(&self.window)
    }

    /// The view as a writable 2D kernel argument.
    pub fn pitched_mut(&mut self) -> PitchedMut<'_, T> {
        PitchedMut::of(&self.window)
    }
}

/// Threads a block of [`grid_2d`]: 32 along a row (a warp, so a row's loads coalesce) by 8 rows.
pub const BLOCK_2D: (u32, u32) = (32, 8);

/// The launch configuration of a 2D kernel with one thread per element of `rows x cols`: blocks of
/// [`BLOCK_2D`] threads, enough of them to cover every element (the kernel checks its bounds, as
/// with `Pitched::contains`). A kernel that handles `n` elements of a row a thread launches
/// `grid_2d(rows, cols.div_ceil(n))`.
///
/// # Errors
/// [`PoolError::SizeOverflow`] (with an element size of 1) when the grid is larger than CUDA's
/// limits: 2^31 - 1 blocks along x, 65535 along y.
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
    use crate::{GpuRead, GpuWrite};

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
    fn pitched_arguments_carry_the_buffers_address_step_and_shape() -> Result<(), PoolError> {
        use crate::__private::{handle, scope, take};
        use crate::{BufferPool, Device, Stream};
        let stream = Stream::new(&Device::host())?;
        let expect = |p: (u64, usize, usize, usize), ptr, step, rows, cols| {
            assert_eq!(p, (ptr, step, rows, cols));
        };
        let of = |p: Pitched<'_, u16>| (p.device_ptr(), p.step(), p.rows(), p.cols());

        let mut mat = BufferPool::new(&stream).get_buffer::<u16>(5, 7)?;
        let (ptr, step) = (mat.device_ptr(), mat.step());
        assert!(ptr != 0 && step >= 14);
        expect(of(mat.pitched()), ptr, step, 5, 7);
        let out = mat.pitched_mut();
        expect(
            (out.device_ptr(), out.step(), out.rows(), out.cols()),
            ptr,
            step,
            5,
            7,
        );
        // A region: its first element, the parent's step.
        let at = ptr + 2 * step as u64 + 3 * 2;
        expect(of(mat.roi(2..4, 3..7)?.pitched()), at, step, 2, 4);
        let mut region = mat.roi_mut(2..4, 3..7)?;
        expect(of(region.pitched()), at, step, 2, 4);
        let out = region.pitched_mut();
        expect(
            (out.device_ptr(), out.step(), out.rows(), out.cols()),
            at,
            step,
            2,
            4,
        );
        expect(of(mat.view().pitched()), ptr, step, 5, 7);
        drop(mat);

        // A `buffer!` handle.
        let scope = scope(&stream);
        let mut owner = take::<u16>(&scope, 3, 9, "h")?;
        let mut h = handle(&mut owner);
        let (ptr, step) = (h.device_ptr(), h.step());
        expect(of(h.pitched()), ptr, step, 3, 9);
        let out = h.pitched_mut();
        expect(
            (out.device_ptr(), out.step(), out.rows(), out.cols()),
            ptr,
            step,
            3,
            9,
        );
        // SAFETY: the values are only read back, never passed to a kernel.
        let raw = unsafe { Pitched::<u16>::from_raw_parts(ptr, step, 1, 2) };
        expect(of(raw), ptr, step, 1, 2);
        Ok(())
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
