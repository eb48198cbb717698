//! A live buffer of any of the element types, so one list holds them all.

use bytemuck::Pod;
use gpu_pool::GpuRead;
use gpu_pool::GpuWrite;
use gpu_pool::{PoolError, Source, compat::opencv::BufferPool, compat::opencv::GpuMat};

use super::check::first_difference;
use super::op::{Elem, Shape};
use super::reference::Content;

pub(super) enum Buf<'s> {
    U8(GpuMat<'s, u8>),
    U32(GpuMat<'s, u32>),
    Bgr(GpuMat<'s, [u8; 3]>),
    F64(GpuMat<'s, f64>),
}

/// `$body` with `$m` bound to the `GpuMat`, whatever its element.
macro_rules! each {
    ($buf:expr, $m:ident => $body:expr) => {
        match $buf {
            Buf::U8($m) => $body,
            Buf::U32($m) => $body,
            Buf::Bgr($m) => $body,
            Buf::F64($m) => $body,
        }
    };
}

impl<'s> Buf<'s> {
    pub(super) fn take(pool: &BufferPool<'s>, shape: Shape, elem: Elem) -> Result<Self, PoolError> {
        fn get<'s, T: Pod>(
            pool: &BufferPool<'s>,
            shape: Shape,
        ) -> Result<GpuMat<'s, T>, PoolError> {
            match shape {
                Shape::Mat { rows, cols } => pool.get_buffer(rows, cols),
                Shape::Row(len) => pool.get_buffer_1d(len),
            }
        }
        Ok(match elem {
            Elem::U8 => Buf::U8(get(pool, shape)?),
            Elem::U32 => Buf::U32(get(pool, shape)?),
            Elem::Bgr => Buf::Bgr(get(pool, shape)?),
            Elem::F64 => Buf::F64(get(pool, shape)?),
        })
    }

    /// `set_to` for uniform contents, an upload for a pattern.
    pub(super) fn fill(&mut self, content: Content) -> Result<(), PoolError> {
        fn fill<T: Pod>(m: &mut GpuMat<'_, T>, content: Content) -> Result<(), PoolError> {
            match content {
                Content::Uniform(b) => {
                    let mut value = T::zeroed();
                    bytemuck::bytes_of_mut(&mut value).fill(b);
                    m.set_to(value)
                }
                Content::Pattern(_) => {
                    let mut data = vec![T::zeroed(); m.len()];
                    let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut data);
                    bytes.copy_from_slice(&content.bytes(bytes.len()));
                    m.upload(&data)
                }
            }
        }
        each!(self, m => fill(m, content))
    }

    /// The first byte (row-major, padding skipped) that differs from `content`, and how many
    /// bytes were read.
    pub(super) fn compare(&self, content: Content) -> Result<(Option<usize>, usize), PoolError> {
        fn compare<T: Pod>(
            m: &GpuMat<'_, T>,
            content: Content,
        ) -> Result<(Option<usize>, usize), PoolError> {
            let data = m.to_vec()?;
            let bytes: &[u8] = bytemuck::cast_slice(&data);
            let wrong = first_difference(bytes, &content.bytes(bytes.len()));
            Ok((wrong, bytes.len()))
        }
        each!(self, m => compare(m, content))
    }

    pub(super) fn release(self) -> Result<(), PoolError> {
        each!(self, m => m.release())
    }

    pub(super) fn source(&self) -> Source {
        each!(self, m => m.source())
    }

    pub(super) fn ptr(&self) -> u64 {
        each!(self, m => m.device_ptr())
    }

    /// Rows, columns and step.
    pub(super) fn shape(&self) -> (usize, usize, usize) {
        each!(self, m => (m.rows(), m.cols(), m.step()))
    }

    /// The addresses its elements span.
    pub(super) fn span(&self, elem_size: usize) -> std::ops::Range<u64> {
        let (rows, cols, step) = self.shape();
        let len = if rows == 0 || cols == 0 {
            0
        } else {
            step * (rows - 1) + cols * elem_size
        };
        self.ptr()..self.ptr() + len as u64
    }
}
