//! What a graphed function's replay depends on: the seam between the graph feature's graphs by
//! shape (`graph/shapes.rs`) and every type a graphed function can take. The graph feature keys a
//! call by these words; a type says which words stand for it (its value, or a buffer's address and
//! shape), wherever the type lives, without either side naming the other.

use std::rc::Rc;
use std::sync::Arc;

use bytemuck::Pod;

use crate::core::access::GpuRead;
use crate::core::scope::Pooled;
use crate::core::stream::Stream;
use crate::core::view::{GpuView, GpuViewMut};

/// What a replay of a graphed function (`#[pooled(stream, graph)]`) depends on, written as words
/// into a [`GraphKeys`]: a call replays a graph only if its parameters write the same words as the
/// call that captured it.
///
/// Implemented for numbers, `bool`, `char`, strings, references, `Box`/`Rc`/`Arc`, `Option`,
/// tuples, arrays, slices and `Vec`s of keyed types, and for every gpu-pool buffer (its address and
/// shape: a replay reads and writes the addresses it was captured with, so another buffer is
/// another key). For a struct of your own (a model whose weights a method reads), derive it:
/// `#[derive(GraphKey)]` keys every field.
///
/// # Safety
/// The words must cover everything the graphed function's GPU work depends on through this value:
/// every device address it reaches (a buffer's, a field's), every shape and every scalar that
/// reaches a kernel or a copy. A replay queues the captured work unchanged, so a value whose words
/// stayed the same while its device memory moved would have the replay write memory that is no
/// longer its own. The derive and the implementations here keep that; a hand-written
/// implementation must key every field, and its type too where values of several types can
/// stand behind one parameter (`&dyn Trait`): [`GraphKeys::type_of`]. A kernel is keyed through
/// its own `GraphKey` (which holds it while a graph of the key lives), never as a raw handle.
///
/// ```
/// use gpu_pool::graph::{GraphKey, GraphKeys};
/// use gpu_pool::prelude::*;
///
/// #[derive(GraphKey)]
/// struct Layer<'s> {
///     weights: DeviceMat<'s, f32>,
///     scale: f32,
/// }
///
/// let stream = Stream::new(&Device::host())?;
/// let layer = Layer { weights: DeviceMat::new(&stream, 4, 4)?, scale: 0.5 };
/// let (mut a, mut b) = (GraphKeys::default(), GraphKeys::default());
/// layer.graph_key(&mut a);
/// Layer { scale: 0.25, ..layer }.graph_key(&mut b);
/// assert_ne!(a, b); // another scalar: another graph
/// # Ok::<(), PoolError>(())
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a graph key",
    label = "a graphed function keys every parameter (`self` included) by what its replay depends on",
    note = "derive it for a struct of your own: `#[derive(GraphKey)]` (every field must be a key); \
            buffers, numbers, strings, options, tuples, slices, streams and kernels are keys already"
)]
pub unsafe trait GraphKey {
    /// Writes the words that stand for `self`.
    fn graph_key(&self, keys: &mut GraphKeys);
}

thread_local! {
    /// While a graphed function is captured on this thread: the device memory its buffers' views
    /// reached, as `(address, bytes)`, for the capture to check against what its key names.
    static TOUCHED: std::cell::RefCell<Vec<(u64, u64)>> = const { std::cell::RefCell::new(Vec::new()) };
    static RECORDING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// The first operation the pool refused during that capture (the body may have swallowed
    /// the error, or wrapped it in a type of its own: the capture still knows why it failed).
    static REFUSED: std::cell::RefCell<Option<crate::base::error::CaptureError>> =
        const { std::cell::RefCell::new(None) };
}

/// The error of an operation a capture refuses; noted while a graphed capture records, so that a
/// body that swallows it gets no graph.
pub(crate) fn refusal(error: crate::base::error::CaptureError) -> crate::base::error::PoolError {
    if recording() {
        REFUSED.with(|r| {
            r.borrow_mut().get_or_insert_with(|| error.clone());
        });
    }
    crate::base::error::PoolError::Capture(error)
}

/// Whether a graphed function's capture records the memory its views reach.
#[inline]
pub(crate) fn recording() -> bool {
    RECORDING.with(std::cell::Cell::get)
}

/// Notes that a view of `bytes` at `ptr` was made (kept only while a graphed capture records).
#[inline]
pub(crate) fn touched(ptr: u64, bytes: u64) {
    if recording() {
        TOUCHED.with(|t| t.borrow_mut().push((ptr, bytes)));
    }
}

/// Records the memory views reach until the guard is dropped, then hands it over
/// ([`Touched::take`]).
#[cfg(feature = "cuda")]
pub(crate) struct Touched(());

#[cfg(feature = "cuda")]
impl Touched {
    pub(crate) fn record() -> Touched {
        TOUCHED.with(|t| t.borrow_mut().clear());
        REFUSED.with(|r| r.borrow_mut().take());
        RECORDING.with(|r| r.set(true));
        Touched(())
    }

    /// What views reached since [`record`](Self::record), and the first operation refused.
    pub(crate) fn take(self) -> (Vec<(u64, u64)>, Option<crate::base::error::CaptureError>) {
        RECORDING.with(|r| r.set(false));
        let reached = TOUCHED.with(|t| std::mem::take(&mut *t.borrow_mut()));
        (reached, REFUSED.with(|r| r.borrow_mut().take()))
    }
}

#[cfg(feature = "cuda")]
impl Drop for Touched {
    fn drop(&mut self) {
        RECORDING.with(|r| r.set(false));
    }
}

/// Words kept inline: the key of a call with a few buffers, a model and scalars allocates nothing.
const INLINE: usize = 48;

/// The key of one call of a graphed function: the words its parameters wrote ([`GraphKey`]).
pub struct GraphKeys {
    inline: [u64; INLINE],
    len: usize,
    /// Every word, once there are more than fit inline.
    spilled: Vec<u64>,
    /// A hash of the words, compared before them.
    hash: u64,
    /// Which instance of a generic function is called ([`instance`](Self::instance)).
    instance: Option<std::any::TypeId>,
    /// The device memory the keyed values name, where asked for (a capture's check).
    ranges: Option<Vec<(u64, u64)>>,
    /// Kernels keyed by their handle, held while a graph of the key lives: their module stays
    /// loaded, so no other kernel can get the handle a graph launches. Inline up to a few, so a
    /// call's key allocates nothing.
    #[cfg(feature = "cuda")]
    kernels: [Option<cudarc::driver::CudaFunction>; KERNELS],
    #[cfg(feature = "cuda")]
    more_kernels: Vec<cudarc::driver::CudaFunction>,
}

/// Kernels held inline.
#[cfg(feature = "cuda")]
const KERNELS: usize = 8;

impl Default for GraphKeys {
    fn default() -> Self {
        GraphKeys {
            inline: [0; INLINE],
            len: 0,
            spilled: Vec::new(),
            hash: 0,
            instance: None,
            ranges: None,
            #[cfg(feature = "cuda")]
            kernels: Default::default(),
            #[cfg(feature = "cuda")]
            more_kernels: Vec::new(),
        }
    }
}

impl GraphKeys {
    /// Adds one word.
    #[inline]
    pub fn word(&mut self, word: u64) {
        // FxHash's step: a multiply and a rotate a word.
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        if self.len < INLINE {
            self.inline[self.len] = word;
        } else {
            if self.len == INLINE {
                self.spilled.extend_from_slice(&self.inline);
            }
            self.spilled.push(word);
        }
        self.len += 1;
    }

    /// Adds what `value` writes.
    #[inline]
    pub fn key<K: GraphKey + ?Sized>(&mut self, value: &K) {
        value.graph_key(self);
    }

    /// Adds a buffer: its address, shape, row step and element size.
    #[inline]
    pub fn buffer<T: Pod>(&mut self, buffer: &(impl GpuRead<T> + ?Sized)) {
        let (ptr, rows, step) = (buffer.device_ptr(), buffer.rows(), buffer.step());
        self.word(ptr);
        self.word(rows as u64);
        self.word(buffer.cols() as u64);
        self.word(step as u64);
        self.word(size_of::<T>() as u64);
        self.names_memory(ptr, (rows * step) as u64);
    }

    /// Says that the keyed value names `bytes` of device memory at `ptr` (what its words stand
    /// for): a capture checks that its work reaches no other memory.
    #[inline]
    pub(crate) fn names_memory(&mut self, ptr: u64, bytes: u64) {
        if let Some(ranges) = &mut self.ranges {
            ranges.push((ptr, bytes));
        }
    }

    /// Keys that also collect the memory the keyed values name ([`names`](Self::names)) and hold
    /// the kernels they name ([`kernels`](Self::kernels)): the key a graph keeps.
    #[cfg(feature = "cuda")]
    pub(crate) fn naming_memory() -> GraphKeys {
        GraphKeys {
            ranges: Some(Vec::new()),
            ..GraphKeys::default()
        }
    }

    /// The memory the keyed values name, for keys made with `naming_memory`.
    #[cfg(feature = "cuda")]
    pub(crate) fn names(&self) -> &[(u64, u64)] {
        self.ranges.as_deref().unwrap_or(&[])
    }

    /// The words' hash.
    #[cfg(feature = "cuda")]
    pub(crate) fn hash(&self) -> u64 {
        self.hash
    }

    /// The instance of the function called, if it said.
    #[cfg(feature = "cuda")]
    pub(crate) fn instance_id(&self) -> Option<std::any::TypeId> {
        self.instance
    }

    /// The kernels keyed, for a graph to hold.
    #[cfg(feature = "cuda")]
    pub(crate) fn kernels(&mut self) -> Vec<cudarc::driver::CudaFunction> {
        let inline = self.kernels.iter_mut().filter_map(Option::take);
        inline.chain(self.more_kernels.drain(..)).collect()
    }

    /// The words so far.
    #[must_use]
    pub fn words(&self) -> &[u64] {
        if self.len <= INLINE {
            &self.inline[..self.len]
        } else {
            &self.spilled
        }
    }

    /// Says which instance of a generic function (or of a method of a generic impl) is called:
    /// `marker` is a closure made in its body, whose type is one per instance, whatever types and
    /// consts it was made with (the function's, its impl's, an `impl Trait` parameter's). One
    /// `static` site serves every instance, so this keeps their graphs apart. Compared exactly
    /// (its `TypeId`, lifetimes aside), not by name: two types can share a name.
    #[doc(hidden)]
    #[inline]
    pub fn instance<C>(&mut self, _marker: &C) {
        // Only graphed functions (feature `graph`) make keys, so only they need `typeid`.
        #[cfg(feature = "graph")]
        {
            self.instance = Some(typeid::of::<C>());
        }
    }

    /// Adds a word for the type `T` (64 bits of its `TypeId`): what `#[derive(GraphKey)]` writes
    /// first, so values of two types that write the same words (two unit structs behind one
    /// `&dyn Trait` parameter) are two keys. A hand-written `GraphKey` of a type that can stand
    /// behind `dyn` writes it too.
    ///
    /// ```
    /// use gpu_pool::graph::{GraphKey, GraphKeys};
    ///
    /// struct Relu;
    /// // SAFETY: `Relu` has no fields; its type is all it is.
    /// unsafe impl GraphKey for Relu {
    ///     fn graph_key(&self, keys: &mut GraphKeys) {
    ///         keys.type_of::<Self>();
    ///     }
    /// }
    /// let (mut a, b) = (GraphKeys::default(), GraphKeys::default());
    /// Relu.graph_key(&mut a);
    /// assert_ne!(a, b);
    /// ```
    #[inline]
    pub fn type_of<T: ?Sized>(&mut self) {
        // Only graphed functions (feature `graph`) make keys: a derived `GraphKey` in a build
        // without them writes nothing, and the build has no `typeid`.
        #[cfg(feature = "graph")]
        self.type_word::<T>();
    }

    #[cfg(feature = "graph")]
    fn type_word<T: ?Sized>(&mut self) {
        use std::hash::{Hash, Hasher};
        /// Takes what `TypeId` hashes (already a hash: 64 of its bits) as it is, not through
        /// SipHash: this runs for every derived value of every call.
        struct Bits(u64);
        impl Hasher for Bits {
            fn write(&mut self, bytes: &[u8]) {
                for &byte in bytes {
                    self.0 = (self.0.rotate_left(8)) ^ u64::from(byte);
                }
            }
            fn write_u64(&mut self, bits: u64) {
                self.0 ^= bits;
            }
            fn finish(&self) -> u64 {
                self.0
            }
        }
        let mut bits = Bits(0);
        typeid::of::<T>().hash(&mut bits);
        self.word(bits.finish());
    }
}

impl PartialEq for GraphKeys {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash && self.instance == other.instance && self.words() == other.words()
    }
}

impl Eq for GraphKeys {}

impl std::fmt::Debug for GraphKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraphKeys")
            .field("instance", &self.instance)
            .field("words", &self.words())
            .finish()
    }
}

// SAFETY: the kernel's handle, with the kernel held (and so its module loaded) while a graph of
// the key lives: the handle names this kernel for as long as a replay could launch it.
#[cfg(feature = "cuda")]
unsafe impl GraphKey for cudarc::driver::CudaFunction {
    fn graph_key(&self, keys: &mut GraphKeys) {
        keys.word(self.cu_function() as u64);
        // Only a key a graph keeps holds its kernels: a call's lookup clones none.
        if keys.ranges.is_none() {
            return;
        }
        match keys.kernels.iter_mut().find(|k| k.is_none()) {
            Some(slot) => *slot = Some(self.clone()),
            None => keys.more_kernels.push(self.clone()),
        }
    }
}

macro_rules! key_as_u64 {
    ($($t:ty),*) => {$(
        // SAFETY: the value is the whole of what it is.
        unsafe impl GraphKey for $t {
            #[inline]
            fn graph_key(&self, keys: &mut GraphKeys) {
                keys.word(*self as u64);
            }
        }
    )*};
}
key_as_u64!(
    u8, u16, u32, u64, usize, i8, i16, i32, i64, isize, bool, char
);

// SAFETY: the value, in two words.
unsafe impl GraphKey for u128 {
    fn graph_key(&self, keys: &mut GraphKeys) {
        keys.word(*self as u64);
        keys.word((*self >> 64) as u64);
    }
}

// SAFETY: as `u128`.
unsafe impl GraphKey for i128 {
    fn graph_key(&self, keys: &mut GraphKeys) {
        keys.word(*self as u64);
        keys.word((*self as u128 >> 64) as u64);
    }
}

// SAFETY: the bits: a kernel given the float sees exactly these.
unsafe impl GraphKey for f32 {
    #[inline]
    fn graph_key(&self, keys: &mut GraphKeys) {
        keys.word(u64::from(self.to_bits()));
    }
}

// SAFETY: as `f32`.
unsafe impl GraphKey for f64 {
    #[inline]
    fn graph_key(&self, keys: &mut GraphKeys) {
        keys.word(self.to_bits());
    }
}

// SAFETY: nothing to depend on.
unsafe impl GraphKey for () {
    fn graph_key(&self, _: &mut GraphKeys) {}
}

// SAFETY: the length, then every byte.
unsafe impl GraphKey for str {
    fn graph_key(&self, keys: &mut GraphKeys) {
        self.as_bytes().graph_key(keys);
    }
}

// SAFETY: as `str`.
unsafe impl GraphKey for String {
    fn graph_key(&self, keys: &mut GraphKeys) {
        self.as_str().graph_key(keys);
    }
}

// SAFETY: the length, then every element's words.
unsafe impl<K: GraphKey> GraphKey for [K] {
    fn graph_key(&self, keys: &mut GraphKeys) {
        keys.word(self.len() as u64);
        self.iter().for_each(|k| k.graph_key(keys));
    }
}

// SAFETY: as a slice.
unsafe impl<K: GraphKey, const N: usize> GraphKey for [K; N] {
    fn graph_key(&self, keys: &mut GraphKeys) {
        self.as_slice().graph_key(keys);
    }
}

// SAFETY: as a slice.
unsafe impl<K: GraphKey> GraphKey for Vec<K> {
    fn graph_key(&self, keys: &mut GraphKeys) {
        self.as_slice().graph_key(keys);
    }
}

// SAFETY: which variant, then its value.
unsafe impl<K: GraphKey> GraphKey for Option<K> {
    fn graph_key(&self, keys: &mut GraphKeys) {
        match self {
            None => keys.word(0),
            Some(k) => {
                keys.word(1);
                k.graph_key(keys);
            }
        }
    }
}

macro_rules! key_through_pointer {
    ($($ptr:ty),*) => {$(
        // SAFETY: what it points at is all it is.
        unsafe impl<K: GraphKey + ?Sized> GraphKey for $ptr {
            #[inline]
            fn graph_key(&self, keys: &mut GraphKeys) {
                (**self).graph_key(keys);
            }
        }
    )*};
}
key_through_pointer!(&K, &mut K, Box<K>, Rc<K>, Arc<K>);

macro_rules! key_tuple {
    ($($name:ident),+) => {
        // SAFETY: every element's words, in order.
        unsafe impl<$($name: GraphKey),+> GraphKey for ($($name,)+) {
            #[allow(non_snake_case)]
            fn graph_key(&self, keys: &mut GraphKeys) {
                let ($($name,)+) = self;
                $($name.graph_key(keys);)+
            }
        }
    };
}
key_tuple!(A);
key_tuple!(A, B);
key_tuple!(A, B, C);
key_tuple!(A, B, C, D);
key_tuple!(A, B, C, D, E);
key_tuple!(A, B, C, D, E, F);

// SAFETY: a stream's work goes where its id says (ids are never reused).
unsafe impl GraphKey for Stream {
    #[inline]
    fn graph_key(&self, keys: &mut GraphKeys) {
        keys.word(self.id());
    }
}

macro_rules! key_buffer {
    ($($buffer:ident),*) => {$(
        // SAFETY: a buffer is its memory (address, shape, step, element) and nothing else.
        unsafe impl<T: Pod> GraphKey for $buffer<'_, T> {
            #[inline]
            fn graph_key(&self, keys: &mut GraphKeys) {
                keys.buffer(self);
            }
        }
    )*};
}
key_buffer!(GpuView, GpuViewMut);

// SAFETY: as the buffer it lends.
unsafe impl<T: Pod> GraphKey for Pooled<'_, '_, T> {
    #[inline]
    fn graph_key(&self, keys: &mut GraphKeys) {
        keys.buffer(self);
    }
}
