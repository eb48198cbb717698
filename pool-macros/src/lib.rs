//! The procedural macros of gpu-pool. Use them through the `gpu-pool` crate, which documents them
//! with runnable examples.
//!
//! Each entry point is one line; parsing is in `args`, the body rewrite in `rewrite`, generation in
//! `expand`, all on `proc_macro2` so they are unit-tested and snapshot-tested.

mod args;
mod derive;
mod drops;
mod error;
mod expand;
mod rewrite;
mod walk;

#[cfg(test)]
mod snapshots;

use proc_macro::TokenStream;

/// Rewrites a function so that each `let name = buffer!(..)?;` takes its buffer from a stream's
/// stack and gives it back, in reverse order, when `name` goes out of scope.
///
/// `#[pooled(EXPR)]` names the stream: a parameter (`Stream`, `&Stream`, `&mut Stream`, or a `Box`,
/// `Rc` or `Arc` of one) or a field path that starts at one, such as `self.stream`.
///
/// ```
/// use gpu_pool::prelude::*;
///
/// #[pooled(stream)]
/// fn blur_rows(stream: &Stream, src: &DeviceMat<'_, u8>) -> Result<usize, PoolError> {
///     let mut tmp = buffer!(src.rows(), src.cols(); u8)?;   // 2D, pitched, from the stack
///     let sums = buffer!(src.rows(); f32)?;                 // 1D, contiguous
///     tmp.copy_from(src)?;
///     Ok(tmp.step() + sums.len())
/// }   // sums, then tmp, go back to the stack
///
/// let stream = Stream::new(&Device::host())?;
/// let src = DeviceMat::<u8>::new(&stream, 4, 100)?;
/// assert_eq!(blur_rows(&stream, &src)?, 512 + 4);
/// assert_eq!(stream.stats().stack_in_use, 0);
/// # Ok::<(), PoolError>(())
/// ```
///
/// The body is rewritten to (the `__gpu_pool_` names are hygienic: user code cannot name them):
///
/// ```text
/// fn blur_rows(stream: &Stream, src: &DeviceMat<'_, u8>) -> Result<usize, PoolError> {
///     let __gpu_pool_scope = ::gpu_pool::__private::scope(&*stream);
///     let mut tmp = {
///         let __gpu_pool_size_0: usize = src.rows();   // sizes first: their temporaries are
///         let __gpu_pool_size_1: usize = src.cols();   // gone before the buffer is taken
///         ::gpu_pool::__private::take::<u8>(
///             &__gpu_pool_scope, __gpu_pool_size_0, __gpu_pool_size_1, "tmp",
///         )
///     }?;
///     let mut tmp = ::gpu_pool::__private::handle(&mut tmp); // the handle shadows its owner
///     let mut sums = {
///         let __gpu_pool_size_0: usize = src.rows();
///         ::gpu_pool::__private::take_1d::<f32>(&__gpu_pool_scope, __gpu_pool_size_0, "sums")
///     }?;
///     let sums = ::gpu_pool::__private::handle(&mut sums);
///     tmp.copy_from(src)?;
///     Ok(tmp.step() + sums.len())
/// }
/// ```
///
/// Each owner is a local declared where the user's `let` stands, so Rust drops the owners in reverse
/// order on every way out: the end of a block or loop iteration, `return`, `?`, `break`, and
/// unwinding. Attributes on the `let` (`#[cfg(..)]`, lints) apply to the owner and the handle alike,
/// and a block that holds buffers drops its tail's temporaries before them, in every edition. The
/// handle (`Pooled`) borrows its owner and offers no `&mut GpuMat`, so a buffer can neither escape
/// its scope nor be swapped into another owner.
///
/// A buffer goes back at the end of the block that declared it, never earlier. To end one early,
/// declare it in an inner block: `{ let tmp = buffer!(..)?; .. }`. `drop(name)` of a handle would
/// release nothing (the handle only borrows the owner), so it is a compile error that says so,
/// spelled `drop`, `mem::drop`, `std::mem::drop` or `core::mem::drop`, wherever `name` still
/// names the buffer: in inner blocks, closures and nested `gpu_scope!`s, not once a later `let`,
/// a closure parameter or a pattern shadows it, nor in a block with an item of that name (`const`,
/// `static`, `fn`, `use`, declared before or after the call). Where it cannot tell, it does not
/// refuse: after another macro given the name (`pin_mut!(name)` rebinds it), and in a block with a
/// glob `use`. `std::mem::forget(name)` and `let _ = name;` are harmless: the owner still gives
/// the memory back.
///
/// ```compile_fail
/// use gpu_pool::prelude::*;
/// #[pooled(stream)]
/// fn early(stream: &Stream) -> Result<(), PoolError> {
///     let tmp = buffer!(8; u8)?;
///     drop(tmp); // error: `drop(tmp)` does not release a `buffer!`: .. declare it in an inner block
///     Ok(())
/// }
/// ```
///
/// `buffer!` works at any depth of the body (blocks, `if`, `match`, loops, closures) but not in
/// nested functions or inside other macros' arguments; neither it nor `gpu_scope!` may stand in an
/// `async` block or closure, or in a constant (`const { .. }`, an array length, a const generic
/// argument). Refused at compile time: `async fn`, `const fn`, items that are no function, and a
/// stream that names no parameter.
///
/// `#[pooled(stream, graph)]` (or `graph(cap = N)`, graphs kept per stream, 16 by default) makes
/// the function replay itself: the first call with a new key (every parameter's
/// [`GraphKey`](../gpu_pool/graph/trait.GraphKey.html) words and the stream's stack top) is
/// captured into a CUDA graph, later calls with that key launch it, and what cannot be captured
/// runs eagerly with its reason counted. It returns a `Result` of `()`, a `Temp` taken first in
/// the body, or a tuple of them (the guide's "Graphs by shape").
///
/// ```
/// use gpu_pool::prelude::*;
///
/// #[pooled(stream, graph)]
/// fn doubled<'s>(stream: &'s Stream, x: &Temp<'_, f32>) -> Result<Temp<'s, f32>, PoolError> {
///     let mut y = stream.temp::<f32>(x.rows(), x.cols())?; // the output, taken first
///     let mut tmp = buffer!(x.rows(), x.cols(); f32)?;    // scratch
///     tmp.copy_from(x)?;                                   // ... kernels ...
///     y.copy_from(&tmp)?;
///     Ok(y)
/// }
/// let stream = Stream::new(&Device::host())?;
/// let x = stream.temp::<f32>(2, 2)?;
/// assert_eq!(doubled(&stream, &x)?.rows(), 2); // on the host backend: eagerly
/// # Ok::<(), PoolError>(())
/// ```
///
/// Only gpu-pool's macros are rewritten: `buffer!` and `gpu_scope!` as the prelude imports them, or
/// called by a path into gpu-pool (`gpu_pool::buffer!`, `gpu_pool::prelude::buffer!`, either with a
/// leading `::`). A macro of your own called by another path (`bytes::buffer![1, 2, 3]`) is left
/// as written.
#[proc_macro_attribute]
pub fn pooled(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand::pooled(attr.into(), item.into()).into()
}

/// Opens a scope on a stream for one block: `gpu_scope!(stream, { .. })`, usable in any function
/// (with or without `#[pooled]`) and in closures. The block's `buffer!`s come from that stream and
/// are given back, in reverse order, when the block ends; the block's value is the macro's value.
/// Buffers of an enclosing scope stay usable inside. An `.await` inside the block (macro arguments
/// included) is a compile error: a future suspended there would hold the buffers while other code
/// takes more from the stream. Close the scope, then await. As in `#[pooled]`, a buffer goes back at
/// the end of the block that declared it, and `drop(name)` of a handle, which would release
/// nothing, is a compile error: declare the buffer in an inner block to end it early.
///
/// The one known limit: an `.await` that only appears once another macro is expanded (a
/// `macro_rules!` of yours, `tokio::join!`, `select!`) is not in the tokens this macro is given, so
/// it is not refused. Dropped while suspended there, such a future releases its buffers in reverse
/// order; only if other code took buffers from the same stream meanwhile is the release out of
/// order, which the pool survives: it is counted in `lifo_violations` and the memory is reclaimed
/// once the buffers above are gone, never handed out twice. Do not await inside a scope.
///
/// ```
/// use gpu_pool::prelude::*;
///
/// fn two_streams(a: &Stream, b: &Stream) -> Result<u8, PoolError> {
///     gpu_scope!(a, {
///         let mut x = buffer!(16; u8)?;
///         x.set_to(3)?;
///         let doubled = gpu_scope!(b, {
///             let mut y = buffer!(16; u8)?;   // from b's stack
///             y.copy_from(&x)?;                // x, from a's stack, is still usable
///             y.to_vec()?[0] * 2
///         });                                  // y goes back to b
///         Ok(doubled)
///     })                                       // x goes back to a
/// }
/// let device = Device::host();
/// let (a, b) = (Stream::new(&device)?, Stream::new(&device)?);
/// assert_eq!(two_streams(&a, &b)?, 6);
/// # Ok::<(), PoolError>(())
/// ```
///
/// expands to
///
/// ```text
/// {
///     let __gpu_pool_stream = &(a);
///     let __gpu_pool_scope = ::gpu_pool::__private::scope(__gpu_pool_stream);
///     let mut x = {
///         let __gpu_pool_size_0: usize = 16;
///         ::gpu_pool::__private::take_1d::<u8>(&__gpu_pool_scope, __gpu_pool_size_0, "x")
///     }?;
///     let mut x = ::gpu_pool::__private::handle(&mut x);
///     ...
/// }
/// ```
#[proc_macro]
pub fn gpu_scope(input: TokenStream) -> TokenStream {
    expand::gpu_scope(input.into()).into()
}

/// Takes a temporary buffer from the enclosing scope's stream: `let name = buffer!(rows, cols; T)?;`
/// (2D, pitched as OpenCV's `BufferPool`) or `let name = buffer!(len; T)?;` (contiguous), in a
/// `#[pooled]` function or a `gpu_scope!` block. `T` is plain data (`bytemuck::Pod`). The `?` (or
/// `.unwrap()`, `.expect(..)`) handles the `PoolError` of a failed allocation; `name` binds a
/// `Pooled` handle. Anywhere else `buffer!` is a compile error that says so:
///
/// ```compile_fail
/// use gpu_pool::prelude::*;
/// fn not_pooled() -> Result<(), PoolError> {
///     let x = buffer!(8; u8)?; // error: `buffer!` only works as `let name = buffer!(..)?;` in ..
///     Ok(())
/// }
/// ```
#[proc_macro]
pub fn buffer(_input: TokenStream) -> TokenStream {
    expand::misplaced_buffer().into()
}

/// Derives [`GraphKey`](../gpu_pool/graph/trait.GraphKey.html) for a struct or enum of your own:
/// its key is every field's key, in order, so a graphed method (`#[pooled(self.stream, graph)]`)
/// replays only while every buffer, scalar and kernel in `self` is what its capture saw. Every
/// field's type must be a `GraphKey`.
///
/// ```
/// use gpu_pool::prelude::*;
///
/// #[derive(GraphKey)]
/// struct Model {
///     w: SharedMat<f32>,
///     scale: f32,
/// }
/// ```
#[proc_macro_derive(GraphKey)]
pub fn derive_graph_key(input: TokenStream) -> TokenStream {
    derive::graph_key(input.into()).into()
}
