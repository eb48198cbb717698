//! A 2D buffer with its shape as one kernel argument: [`Pitched`] (read-only) and [`PitchedMut`]
//! (for outputs), the address, the step, the rows and the columns, laid out as the `Pitched<T>` of
//! [`PITCHED_H`](crate::interop::PITCHED_H). Plain data made from a view; pushing them into a
//! launch (cudarc's `DeviceRepr`, [`LaunchArgsExt`](crate::interop::LaunchArgsExt)) is
//! `interop::kernel_args`'s.

use std::marker::PhantomData;

use crate::core::view::{GpuView, GpuViewMut, Window};

/// The fields of [`Pitched`] and [`PitchedMut`], in the order of the header's `Pitched<T>`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shape {
    pub(crate) ptr: u64,
    pub(crate) step: u64,
    pub(crate) rows: u64,
    pub(crate) cols: u64,
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
        #[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
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
    };
}

pitched!(
    /// A read-only 2D kernel argument: a buffer's (or a region's) address, step, rows and
    /// columns, pushed as one parameter with `.arg(&p)`; the kernel takes a `Pitched<const T>`
    /// of [`PITCHED_H`](crate::interop::PITCHED_H). Made by `.pitched()` on
    /// [`Temp`](crate::Temp), [`DeviceMat`](crate::DeviceMat), [`GpuView`] and (through `Deref`)
    /// [`Pooled`](crate::Pooled); it borrows the buffer, so the buffer outlives the launch.
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
    /// `.pitched_mut()` from a `&mut` [`Temp`](crate::Temp), [`DeviceMat`](crate::DeviceMat),
    /// [`GpuViewMut`] or [`Pooled`](crate::Pooled), and taken by the kernel as a `Pitched<T>` of
    /// [`PITCHED_H`](crate::interop::PITCHED_H). While it lives, nothing else reads or writes the
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
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
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
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
    pub fn pitched(&self) -> Pitched<'_, T> {
        Pitched::of(&self.window)
    }

    /// The view as a writable 2D kernel argument.
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
    pub fn pitched_mut(&mut self) -> PitchedMut<'_, T> {
        PitchedMut::of(&self.window)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::error::PoolError;
    use crate::{GpuRead, GpuWrite};

    #[test]
    fn pitched_arguments_carry_the_buffers_address_step_and_shape() -> Result<(), PoolError> {
        use crate::__private::{handle, scope, take};
        use crate::compat::opencv::BufferPool;
        use crate::{Device, Stream};
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
}
