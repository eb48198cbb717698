//! What the DSL expands to: a scope (the stream of one `#[pooled]` body or `gpu_scope!`),
//! buffers owned by hidden locals, and the handles user code sees.
//!
//! `#[pooled(stream)]` and `gpu_scope!` open the scope first,
//! `let __gpu_pool_scope = ::gpu_pool::__private::scope(&*stream);`, then turn
//! `let x = buffer!(rows, cols; T)?;` into
//!
//! ```text
//! let mut x = {
//!     let __gpu_pool_size_0: usize = rows;
//!     let __gpu_pool_size_1: usize = cols;
//!     ::gpu_pool::__private::take::<T>(&__gpu_pool_scope, __gpu_pool_size_0, __gpu_pool_size_1, "x")
//! }?;
//! let x = ::gpu_pool::__private::handle(&mut x); // the handle shadows its hidden owner
//! ```
//!
//! The owner is a local the user cannot name (mixed-site hygiene), so Rust drops it, and so gives its
//! memory back, in reverse order of declaration on every exit path. The handle borrows the owner, so
//! it cannot outlive it; and it gives no `&mut Temp`, so the memory cannot be swapped into another
//! owner (which would release it out of order, or while a handle still points at it).

use std::ops::Deref;
use std::rc::Rc;
use std::sync::Arc;

use bytemuck::Pod;

use crate::base::error::PoolError;
use crate::base::source::CallSite;
use crate::core::buffer::Temp;
use crate::core::stream::Stream;

/// Something that names a [`Stream`]: what `#[pooled(EXPR)]` and `gpu_scope!(EXPR, ..)` accept.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a gpu-pool stream",
    label = "expected a `Stream`, a reference to one, or a `Box`/`Rc`/`Arc` of one",
    note = "`#[pooled(EXPR)]` and `gpu_scope!(EXPR, {{ .. }})` take the stream that buffers come from"
)]
pub trait AsStream {
    /// The stream.
    fn as_stream(&self) -> &Stream;
}

impl AsStream for Stream {
    fn as_stream(&self) -> &Stream {
        self
    }
}

macro_rules! forward_as_stream {
    ($($ptr:ty),*) => {$(
        impl<S: AsStream + ?Sized> AsStream for $ptr {
            fn as_stream(&self) -> &Stream {
                (**self).as_stream()
            }
        }
    )*};
}
forward_as_stream!(&S, &mut S, Box<S>, Rc<S>, Arc<S>);

/// An element type a buffer can hold: plain data, any bit pattern valid (`bytemuck::Pod`).
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be an element of a GPU buffer",
    label = "not plain data",
    note = "buffer elements are copied as bytes to and from the device, so they must implement `bytemuck::Pod` (numbers, arrays of them, `#[repr(C)]` structs deriving `Pod`)"
)]
pub trait Element: Pod {}

impl<T: Pod> Element for T {}

/// Opens a scope on `stream`: the pool every `buffer!` of one `#[pooled]` function or
/// `gpu_scope!` block takes from.
#[doc(hidden)]
#[inline]
pub fn scope<S: AsStream + ?Sized>(stream: &S) -> &Stream {
    stream.as_stream()
}

/// `let name = buffer!(rows, cols; T)?`: the buffer, owned by a hidden local of the caller; the
/// caller's line and `name` are its call site.
// Always inlined, as `Stream::temp` is, for the same reason.
#[doc(hidden)]
#[inline(always)]
#[track_caller]
pub fn take<'s, T: Element>(
    scope: &&'s Stream,
    rows: usize,
    cols: usize,
    name: &'static str,
) -> Result<Temp<'s, T>, PoolError> {
    scope.temp_at(rows, cols, CallSite::here(name))
}

/// `let name = buffer!(len; T)?`.
#[doc(hidden)]
#[inline(always)]
#[track_caller]
pub fn take_1d<'s, T: Element>(
    scope: &&'s Stream,
    len: usize,
    name: &'static str,
) -> Result<Temp<'s, T>, PoolError> {
    scope.temp_at(1, len, CallSite::here(name))
}

/// `let name = buffer!(rows, cols; T, packed)?`: rows with no padding between them.
#[doc(hidden)]
#[inline(always)]
#[track_caller]
pub fn take_packed<'s, T: Element>(
    scope: &&'s Stream,
    rows: usize,
    cols: usize,
    name: &'static str,
) -> Result<Temp<'s, T>, PoolError> {
    scope.temp_packed_at(rows, cols, CallSite::here(name))
}

/// The handle the user's name binds, borrowing the hidden owner.
#[doc(hidden)]
#[inline]
pub fn handle<'a, 's, T>(owner: &'a mut Temp<'s, T>) -> Pooled<'a, 's, T> {
    Pooled { mat: owner }
}

/// A buffer taken with `buffer!`: a [`GpuRead`](crate::GpuRead) and
/// [`GpuWrite`](crate::GpuWrite) like every buffer, so it is passed as `&x` or `&mut x` to
/// functions taking `&impl GpuRead<T>` or `&mut impl GpuWrite<T>`, and reads the rest of
/// [`Temp`] (its source, its stream) through `Deref`. It borrows the hidden owner that gives the
/// memory back at the end of the scope, so it cannot escape the scope; it offers no
/// `&mut Temp`, so the memory cannot be swapped out of its owner.
///
/// `let mut x = buffer!(4, 4; f32)?;` in a `#[pooled(stream)]` function expands to the two lines
/// below (with a hidden owner name no user code can write):
///
/// ```
/// # use gpu_pool::{Device, GpuRead, GpuWrite, PoolError, Stream, __private::{handle, scope, take}};
/// # let stream = Stream::new(&Device::host())?;
/// # let scope = scope(&stream);
/// let mut owner = take::<f32>(&scope, 4, 4, "x")?; // "x": the name, for reports and errors
/// let mut x = handle(&mut owner);
/// x.set_to(0.5)?;
/// assert_eq!(x.to_vec()?, vec![0.5; 16]);
/// # Ok::<(), PoolError>(())
/// ```
#[derive(Debug)]
pub struct Pooled<'a, 's, T> {
    mat: &'a mut Temp<'s, T>,
}

impl<'s, T> Deref for Pooled<'_, 's, T> {
    type Target = Temp<'s, T>;

    #[inline]
    fn deref(&self) -> &Temp<'s, T> {
        self.mat
    }
}

impl<'s, T> Pooled<'_, 's, T> {
    /// The address field kernel arguments point at.
    pub(crate) fn ptr_field(&self) -> &u64 {
        self.mat.ptr_field()
    }

    /// The buffer, for the writable views the handle lends ([`GpuWrite`](crate::GpuWrite)).
    pub(crate) fn mat_mut(&mut self) -> &mut Temp<'s, T> {
        self.mat
    }
}
