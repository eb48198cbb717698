//! How a `rows x cols` request becomes bytes: OpenCV's `StackAllocator::allocate` rules, with every
//! step checked so that no input can wrap.

use crate::error::PoolError;

/// Alignment of single-row and single-column buffers (OpenCV rounds their size to 64).
pub(crate) const CONTIGUOUS_ALIGN: usize = 64;

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
}

impl Layout {
    /// OpenCV's rule: with more than one row and more than one column the pitch is
    /// `align_up(cols * elem_size, alignment)`; a single row or column is contiguous and its size
    /// is rounded up to 64 bytes.
    #[inline]
    pub(crate) fn new(
        rows: usize,
        cols: usize,
        elem_size: usize,
        alignment: usize,
    ) -> Result<Layout, PoolError> {
        // Built only on failure: this runs on every allocation.
        let overflow = || PoolError::SizeOverflow {
            rows,
            cols,
            elem_size,
        };
        let width_bytes = cols.checked_mul(elem_size).ok_or_else(overflow)?;
        let (pitch, bytes) = if rows > 1 && cols > 1 {
            let pitch = align_up(width_bytes, alignment).ok_or_else(overflow)?;
            (pitch, pitch.checked_mul(rows).ok_or_else(overflow)?)
        } else {
            let total = width_bytes.checked_mul(rows).ok_or_else(overflow)?;
            // A column is stored one element per row, so its pitch is the element size.
            let pitch = if cols == 1 { elem_size } else { width_bytes };
            (
                pitch,
                align_up(total, CONTIGUOUS_ALIGN).ok_or_else(overflow)?,
            )
        };
        Ok(Layout {
            rows,
            cols,
            pitch,
            width_bytes,
            bytes,
        })
    }

    /// Whether the buffer has no elements (then it takes no memory at all).
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.width_bytes == 0 || self.rows == 0
    }
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
        let l = Layout::new(4096, 4096, 3, 512).unwrap();
        assert_eq!((l.pitch, l.bytes), (12288, 48 << 20));
        let l = Layout::new(3, 100, 4, 512).unwrap();
        assert_eq!((l.pitch, l.width_bytes, l.bytes), (512, 400, 1536));
    }

    #[test]
    fn a_row_or_a_column_is_contiguous_and_rounded_to_64() {
        let row = Layout::new(1, 10, 4, 512).unwrap();
        assert_eq!((row.pitch, row.bytes), (40, 64));
        let col = Layout::new(10, 1, 4, 512).unwrap();
        assert_eq!((col.pitch, col.bytes), (4, 64));
    }

    #[test]
    fn empty_and_overflowing_requests() {
        assert!(Layout::new(0, 5, 4, 512).unwrap().is_empty());
        assert!(Layout::new(5, 0, 4, 512).unwrap().is_empty());
        assert_eq!(Layout::new(5, 5, 0, 512).unwrap().bytes, 0);
        for (r, c, e) in [
            (usize::MAX, 2, 1),
            (2, usize::MAX, 1),
            (1, usize::MAX, 2),
            (2, usize::MAX / 2, 1),
            (usize::MAX, 1, 1),
        ] {
            assert!(
                matches!(
                    Layout::new(r, c, e, 512),
                    Err(PoolError::SizeOverflow { .. })
                ),
                "{r}x{c}x{e}"
            );
        }
    }
}
