//! Where a buffer's memory came from, and why it did not come from the stack: the vocabulary that
//! errors, counters and buffers share, below all of them.

use std::fmt;

/// Where a buffer's memory came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Source {
    /// The stream's stack.
    Stack,
    /// The stream's fallback allocator, and why.
    Fallback(FallbackReason),
    /// A driver allocation of its own ([`GpuMat::new`](crate::compat::opencv::GpuMat::new)): for long-lived data.
    Driver,
    /// Nothing: the buffer has no elements.
    Empty,
}

/// Why a request did not come from the stream's stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FallbackReason {
    /// The stack has a buffer-sized hole only after releases; it is too full now.
    StackFull,
    /// The stream holds no stack: every stack of the device is taken by other streams.
    NoStack,
    /// The request is larger than a whole stack.
    TooLarge,
    /// Pooling is off ([`crate::compat::opencv::set_buffer_pool_usage`]`(false)`), or the stream has a custom allocator.
    Disabled,
    /// The device had no memory for the stacks when the stream was made (OpenCV makes the stream
    /// all the same and serves it from the default allocator; so does gpu-pool). Streams made
    /// later try again.
    NoStackMemory,
}

impl FallbackReason {
    pub(crate) const ALL: [FallbackReason; 5] = [
        FallbackReason::StackFull,
        FallbackReason::NoStack,
        FallbackReason::TooLarge,
        FallbackReason::Disabled,
        FallbackReason::NoStackMemory,
    ];
}

impl fmt::Display for FallbackReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FallbackReason::StackFull => "stack full",
            FallbackReason::NoStack => "no stack left for this stream",
            FallbackReason::TooLarge => "request larger than a stack",
            FallbackReason::Disabled => "pooling off for this stream",
            FallbackReason::NoStackMemory => "no device memory for the stacks",
        })
    }
}

/// Where in the program a buffer was asked for: the name a `buffer!` binds (none for the runtime
/// API) and the source location of the request. `buffer!` passes both as constants, and the
/// runtime API's `#[track_caller]` the location, so knowing them costs nothing until something
/// reads them: a fallback, an error, a recording.
///
/// ```
/// use gpu_pool::{compat::opencv::BufferPool, Device, PoolError, Stream};
/// let stream = Stream::new(&Device::host_with_limit(64 << 20))?;
/// let err = BufferPool::new(&stream).get_buffer_1d::<u8>(1 << 30).unwrap_err();
/// assert!(err.to_string().contains(file!()), "{err}"); // the line that asked
/// # Ok::<(), PoolError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CallSite {
    name: &'static str,
    location: &'static std::panic::Location<'static>,
}

impl CallSite {
    /// The caller's location (through every `#[track_caller]` function above), with `name` (empty
    /// for none).
    #[track_caller]
    #[inline(always)]
    #[must_use]
    pub fn here(name: &'static str) -> CallSite {
        CallSite {
            name,
            location: std::panic::Location::caller(),
        }
    }

    /// The name the `buffer!` binds; `None` for a runtime-API request.
    #[must_use]
    pub fn name(&self) -> Option<&'static str> {
        (!self.name.is_empty()).then_some(self.name)
    }

    /// The source file.
    #[must_use]
    pub fn file(&self) -> &'static str {
        self.location.file()
    }

    /// The line.
    #[must_use]
    pub fn line(&self) -> u32 {
        self.location.line()
    }

    /// The site of `location`, with no name.
    pub(crate) fn at(location: &'static std::panic::Location<'static>) -> CallSite {
        CallSite { name: "", location }
    }

    /// The location alone.
    pub(crate) fn location(&self) -> &'static std::panic::Location<'static> {
        self.location
    }
}

impl fmt::Display for CallSite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => write!(f, "`{name}` at {}:{}", self.file(), self.line()),
            None => write!(f, "{}:{}", self.file(), self.line()),
        }
    }
}
