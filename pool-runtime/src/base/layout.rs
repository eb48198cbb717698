//! How a `rows x cols` request becomes bytes: OpenCV's `StackAllocator::allocate` rules, with every
//! step checked so that no input can wrap, and where on a stack its block may start.
//!
//! OpenCV's `MemoryStack::requestMemory` hands out `tip` and moves it by the block's size, so blocks
//! follow each other with no gap: 64-byte multiples for rows and columns, pitch x rows for 2D. Here
//! the sizes are OpenCV's, but a row or column block starts where the previous block ended, rounded
//! up to the device's [`Packing`](crate::core::config::Packing): 256 bytes by default (`cudaMalloc`'s and RMM's
//! guarantee, which vectorized loads and TMA descriptors assume), or 64 as in OpenCV with
//! `Packing::OpenCv` (ten 64-byte rows then take 640 bytes), and to `align_of::<T>()` where that is
//! more. A 2D block starts on the texture alignment, as its rows do, which OpenCV leaves to chance.

use crate::base::error::PoolError;

/// What the size of a single-row or single-column buffer is rounded up to (OpenCV's 64).
pub(crate) const CONTIGUOUS_ALIGN: usize = 64;

/// The strictest element alignment a buffer supports: what every source of memory guarantees.
/// CUDA aligns every allocation to at least 256 bytes; a stack block starts on a multiple of
/// `max(packing, align_of::<T>())` (a row or a column; the packing is 256, or 64 with
/// `Packing::OpenCv`) or of the texture alignment (2D, 512 on current GPUs and on the host
/// backend), and 2D pitches are multiples of the texture alignment. An element
/// type aligned more strictly (`#[repr(align(512))]` and up) gets
/// `PoolError::UnsupportedAlignment`.
pub const MAX_ELEMENT_ALIGN: usize = 256;

/// What a buffer of one shape takes of a stack: the numbers the pool lays it out with, for sizing
/// stacks before a run ([`Device::footprint`](crate::Device::footprint)).
///
/// A stack holding several buffers needs, for each, `bytes` plus up to `align - 1` bytes of
/// padding before it (blocks start on `align`: 256 bytes for rows and columns, or 64 as OpenCV packs
/// them with [`Packing::OpenCv`](crate::core::config::Packing::OpenCv)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Footprint {
    /// Bytes the block holds: `step * rows` for 2D, a row or column rounded up to 64.
    pub bytes: usize,
    /// Bytes from one row to the next ([`crate::GpuRead::step`](crate::GpuRead::step)).
    pub step: usize,
    /// Where the block may start: a multiple of this.
    pub align: usize,
}

impl Footprint {
    /// The footprint of `layout`.
    pub(crate) fn of(layout: &Layout) -> Footprint {
        Footprint {
            bytes: layout.bytes,
            step: layout.pitch,
            align: layout.block_align,
        }
    }
}

/// `rows * cols`, the elements of a packed 2D buffer (taken as one row of them), checked with its
/// bytes.
pub(crate) fn packed_len<T>(rows: usize, cols: usize) -> Result<usize, PoolError> {
    rows.checked_mul(cols)
        .filter(|n| n.checked_mul(size_of::<T>()).is_some())
        .ok_or(PoolError::SizeOverflow {
            rows,
            cols,
            elem_size: size_of::<T>(),
        })
}

/// The memory a buffer of `rows x cols` elements needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    /// Bytes from one row to the next.
    pub(crate) pitch: usize,
    /// Bytes of one row that hold elements (`cols * size_of::<T>()`).
    pub(crate) width_bytes: usize,
    /// Bytes to reserve: `pitch * rows` for 2D, rounded to 64 for a row or a column.
    pub(crate) bytes: usize,
    /// `align_of::<T>()`: the address and the pitch of any memory for it must be multiples of it.
    pub(crate) elem_align: usize,
    /// Where a stack block for it may start: a multiple of this (a power of two). The texture
    /// alignment for 2D (or the packing, if larger); for a row or a column, the packing (256, or 64
    /// with `Packing::OpenCv`, so blocks pack as in OpenCV), or `align_of::<T>()` where that is
    /// larger. Never above `max(texture alignment, MAX_ELEMENT_ALIGN)`.
    pub(crate) block_align: usize,
}

impl Layout {
    /// The layout of `rows x cols` elements of `T`: [`Layout::new`], after checking that `T`'s
    /// alignment is one every source of memory guarantees (a constant test, folded away for every
    /// `T` that passes).
    #[inline]
    pub(crate) fn of<T>(
        rows: usize,
        cols: usize,
        alignment: usize,
        packing: usize,
    ) -> Result<Layout, PoolError> {
        if align_of::<T>() > MAX_ELEMENT_ALIGN {
            return Err(PoolError::UnsupportedAlignment {
                type_name: std::any::type_name::<T>(),
                align: align_of::<T>(),
                max: MAX_ELEMENT_ALIGN,
            });
        }
        let mut layout = Layout::new(rows, cols, size_of::<T>(), alignment, packing)?;
        layout.elem_align = align_of::<T>();
        layout.block_align = layout.block_align.max(align_of::<T>());
        Ok(layout)
    }

    /// OpenCV's rule: with more than one row and more than one column the pitch is
    /// `align_up(cols * elem_size, alignment)` and the block starts on `alignment`; a single row or
    /// column is contiguous and its size is rounded up to 64 bytes. Its block starts on `packing`
    /// (`Packing::block_align`: 256, or OpenCV's 64), as does a 2D block if `packing` is more than
    /// `alignment`.
    #[inline]
    pub(crate) fn new(
        rows: usize,
        cols: usize,
        elem_size: usize,
        alignment: usize,
        packing: usize,
    ) -> Result<Layout, PoolError> {
        debug_assert!(packing.is_power_of_two() && packing <= MAX_ELEMENT_ALIGN);
        // Built only on failure: this runs on every allocation.
        let overflow = || PoolError::SizeOverflow {
            rows,
            cols,
            elem_size,
        };
        // The element count must fit too, even where no byte is needed (zero-sized elements):
        // `len()` and every copy of the buffer rely on it.
        rows.checked_mul(cols).ok_or_else(overflow)?;
        let width_bytes = cols.checked_mul(elem_size).ok_or_else(overflow)?;
        let (pitch, bytes, block_align) = if rows > 1 && cols > 1 {
            // The one place the rule is written; `is_pitched` reads it back.
            let pitch = align_up(width_bytes, alignment).ok_or_else(overflow)?;
            (
                pitch,
                pitch.checked_mul(rows).ok_or_else(overflow)?,
                alignment.max(packing),
            )
        } else {
            let total = width_bytes.checked_mul(rows).ok_or_else(overflow)?;
            // A column is stored one element per row, so its pitch is the element size.
            let pitch = if cols == 1 { elem_size } else { width_bytes };
            (
                pitch,
                align_up(total, CONTIGUOUS_ALIGN).ok_or_else(overflow)?,
                packing,
            )
        };
        Ok(Layout {
            rows,
            cols,
            pitch,
            width_bytes,
            bytes,
            elem_align: 1,
            block_align,
        })
    }

    /// Whether memory at `ptr` with rows `pitch` apart suits the elements: both are multiples of
    /// their alignment. Host slices of rows are built on such memory.
    #[inline]
    pub(crate) fn is_aligned(&self, ptr: u64, pitch: usize) -> bool {
        is_aligned(ptr, pitch, self.elem_align)
    }

    /// Whether the buffer is pitched: more than one row and more than one column. A single row or
    /// column is contiguous.
    #[inline]
    pub(crate) fn is_pitched(&self) -> bool {
        self.rows > 1 && self.cols > 1
    }

    /// Whether the buffer has no elements (then it takes no memory at all).
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.width_bytes == 0 || self.rows == 0
    }
}

/// Whether memory at `ptr` with rows `pitch` apart holds elements aligned to `align`.
#[inline]
pub(crate) fn is_aligned(ptr: u64, pitch: usize, align: usize) -> bool {
    ptr.is_multiple_of(align as u64) && pitch.is_multiple_of(align)
}

#[inline]
/// Rounds `value` up to a multiple of `align` (a power of two), or `None` if that wraps.
pub(crate) fn align_up(value: usize, align: usize) -> Option<usize> {
    debug_assert!(align.is_power_of_two());
    Some(value.checked_add(align - 1)? & !(align - 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_d_is_pitched_to_the_texture_alignment() {
        let l = Layout::new(4096, 4096, 3, 512, 64).unwrap();
        assert_eq!((l.pitch, l.bytes), (12288, 48 << 20));
        let l = Layout::new(3, 100, 4, 512, 64).unwrap();
        assert_eq!((l.pitch, l.width_bytes, l.bytes), (512, 400, 1536));
    }

    #[test]
    fn a_row_or_a_column_is_contiguous_and_rounded_to_64() {
        let row = Layout::new(1, 10, 4, 512, 64).unwrap();
        assert_eq!((row.pitch, row.bytes), (40, 64));
        let col = Layout::new(10, 1, 4, 512, 64).unwrap();
        assert_eq!((col.pitch, col.bytes), (4, 64));
    }

    #[test]
    fn blocks_start_on_256_for_rows_and_columns_by_default_and_on_the_texture_alignment_for_2d() {
        assert_eq!(Layout::new(1, 10, 4, 512, 256).unwrap().block_align, 256);
        assert_eq!(Layout::new(10, 1, 4, 512, 256).unwrap().block_align, 256);
        assert_eq!(
            Layout::new(1, 10, 4, 512, 256).unwrap().bytes,
            64,
            "sizes stay OpenCV's"
        );
        assert_eq!(Layout::new(3, 100, 4, 512, 256).unwrap().block_align, 512);
        assert_eq!(Layout::new(3, 100, 4, 128, 256).unwrap().block_align, 256);
    }

    #[test]
    fn with_opencv_packing_blocks_start_on_64_for_rows_and_columns() {
        assert_eq!(Layout::new(1, 10, 4, 512, 64).unwrap().block_align, 64);
        assert_eq!(Layout::new(10, 1, 4, 512, 64).unwrap().block_align, 64);
        assert_eq!(Layout::new(3, 100, 4, 512, 64).unwrap().block_align, 512);
        assert_eq!(Layout::of::<f64>(1, 3, 512, 64).unwrap().block_align, 64);
        #[repr(C, align(256))]
        struct Widest([u8; 256]);
        assert_eq!(
            Layout::of::<Widest>(1, 3, 512, 64).unwrap().block_align,
            256
        );
        assert_eq!(
            Layout::of::<Widest>(3, 3, 512, 64).unwrap().block_align,
            512
        );
        assert_eq!(
            Layout::of::<Widest>(3, 3, 128, 64).unwrap().block_align,
            256
        );
    }

    #[test]
    fn over_aligned_elements_are_refused() {
        #[repr(C, align(512))]
        struct Wide([u8; 512]);
        assert!(matches!(
            Layout::of::<Wide>(2, 2, 512, 256),
            Err(PoolError::UnsupportedAlignment {
                align: 512,
                max: 256,
                ..
            })
        ));
        #[repr(C, align(256))]
        struct Widest([u8; 256]);
        assert_eq!(Layout::of::<Widest>(2, 2, 512, 64).unwrap().elem_align, 256);
    }

    #[test]
    fn zero_sized_elements_still_count_their_elements() {
        assert!(
            Layout::new(usize::MAX, 2, 0, 512, 256).is_err(),
            "rows * cols overflows"
        );
        assert!(Layout::new(usize::MAX, 1, 0, 512, 64).unwrap().is_empty());
    }

    #[test]
    fn empty_and_overflowing_requests() {
        assert!(Layout::new(0, 5, 4, 512, 64).unwrap().is_empty());
        assert!(Layout::new(5, 0, 4, 512, 64).unwrap().is_empty());
        assert_eq!(Layout::new(5, 5, 0, 512, 64).unwrap().bytes, 0);
        for (r, c, e) in [
            (usize::MAX, 2, 1),
            (2, usize::MAX, 1),
            (1, usize::MAX, 2),
            (2, usize::MAX / 2, 1),
            (usize::MAX, 1, 1),
        ] {
            assert!(
                matches!(
                    Layout::new(r, c, e, 512, 256),
                    Err(PoolError::SizeOverflow { .. })
                ),
                "{r}x{c}x{e}"
            );
        }
    }
}
