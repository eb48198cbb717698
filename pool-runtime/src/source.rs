//! Where a buffer's memory came from, and why it did not come from the stack: the vocabulary that
//! errors, counters and buffers share, below all of them.

use std::fmt;

/// Where a buffer's memory came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The stream's stack.
    Stack,
    /// The stream's fallback allocator, and why.
    Fallback(FallbackReason),
    /// A driver allocation of its own ([`GpuMat::new`](crate::GpuMat::new)): for long-lived data.
    Driver,
    /// Nothing: the buffer has no elements.
    Empty,
}

/// Why a request did not come from the stream's stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FallbackReason {
    /// The stack has a buffer-sized hole only after releases; it is too full now.
    StackFull,
    /// The stream holds no stack: every stack of the device is taken by other streams.
    NoStack,
    /// The request is larger than a whole stack.
    TooLarge,
    /// Pooling is off ([`crate::set_buffer_pool_usage`]`(false)`), or the stream has a custom allocator.
    Disabled,
}

impl FallbackReason {
    pub(crate) const ALL: [FallbackReason; 4] = [
        FallbackReason::StackFull,
        FallbackReason::NoStack,
        FallbackReason::TooLarge,
        FallbackReason::Disabled,
    ];
}

impl fmt::Display for FallbackReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FallbackReason::StackFull => "stack full",
            FallbackReason::NoStack => "no stack left for this stream",
            FallbackReason::TooLarge => "request larger than a stack",
            FallbackReason::Disabled => "pooling off for this stream",
        })
    }
}
