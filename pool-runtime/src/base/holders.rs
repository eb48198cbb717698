//! Idle memory and who holds it: the seam through which every holder of a device's memory that no
//! buffer uses (a growable stack above its top, the caching pool's freed blocks, the stream-ordered
//! pool's reserve) answers to the device.
//!
//! A holder (`storage::IdleMemory`) registers with the device's storage as a weak handle; the
//! storage asks each one what it holds idle (for the stats and the report) and, after an
//! out-of-memory, to give it back (`Storage::reclaim`); the
//! request that failed is then tried once more, from whichever thread ran out. A holder never gives
//! back memory in use or in flight: a growable stack used on another thread gives back what lies
//! above its top once its stream's work is done (a handshake with the stream's lock-free take, in
//! `core/stack/growable.rs`, keeps every block handed out mapped); what it cannot give back safely now (a stack
//! whose stream is being captured: the capture's work may use memory above the top) it is asked
//! to give back at its next chance, and says so.

use std::fmt;

/// What one holder gave back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct GaveBack {
    /// Bytes given back now.
    pub(crate) bytes: usize,
    /// Whether idle memory that could not be given back from here was asked to go back later.
    pub(crate) deferred: bool,
}

/// Idle memory of one holder: what [`DeviceStats::idle_holders`](crate::observe::DeviceStats::idle_holders)
/// lists.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct IdleHolding {
    /// Who holds it: "the caching pool", "stream 3's stack", "the stream-ordered pool".
    pub holder: String,
    /// Bytes it holds that no buffer uses.
    pub idle_bytes: usize,
}

/// What one holder held and gave back when the device reclaimed idle memory after an
/// out-of-memory.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReclaimedFrom {
    /// Who held it (as in [`IdleHolding::holder`]).
    pub holder: String,
    /// Bytes it held idle before.
    pub held: usize,
    /// Bytes it gave back.
    pub given_back: usize,
    /// Whether it was asked to give back the rest at its next chance (a stream's stack being
    /// captured: at that stream's next `synchronize` or `trim` once the capture is over).
    pub deferred: bool,
}

/// What the device held idle, and gave back, before an out-of-memory was final: carried by
/// [`PoolError::OutOfMemory`](crate::PoolError::OutOfMemory) and printed in its message.
///
/// ```
/// use gpu_pool::{config::Fallback, Device, compat::opencv::GpuMat, PoolError, Stream};
/// let device = Device::host_with_limit(8 << 20);
/// device.set_fallback(Fallback::Driver);
/// let stream = Stream::new(&device)?;
/// let err = GpuMat::<u8>::new(&stream, 1, 64 << 20).unwrap_err();
/// let PoolError::OutOfMemory { reclaimed: Some(reclaimed), .. } = &err else { panic!("{err}") };
/// assert_eq!(reclaimed.given_back(), 0); // nothing was idle
/// assert!(err.to_string().contains("gave back"), "{err}");
/// # Ok::<(), PoolError>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Reclaimed {
    /// Every holder asked, with what it held and gave back.
    pub holders: Vec<ReclaimedFrom>,
    /// The device's memory limit ([`Device::set_memory_limit`](crate::Device::set_memory_limit)),
    /// if one is set, and the bytes counted against it when the request failed.
    pub limit: Option<(usize, usize)>,
    /// Whether the request was tried again after the holders gave back (not inside a capture,
    /// nor where nothing could be given back).
    pub retried: bool,
}

impl Reclaimed {
    /// Bytes given back in all.
    #[must_use]
    pub fn given_back(&self) -> usize {
        self.holders.iter().map(|h| h.given_back).sum()
    }

    /// Bytes held idle before, in all.
    #[must_use]
    pub fn held(&self) -> usize {
        self.holders.iter().map(|h| h.held).sum()
    }
}

impl fmt::Display for Reclaimed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some((limit, counted)) = self.limit {
            write!(
                f,
                "; the device's memory limit is {limit} bytes, {counted} counted against it"
            )?;
        }
        if self.holders.is_empty() && !self.retried {
            // Nothing was asked: the request was refused where it stood.
            return Ok(());
        }
        write!(f, "; idle memory held: ")?;
        let held: Vec<&ReclaimedFrom> = self.holders.iter().filter(|h| h.held > 0).collect();
        if held.is_empty() {
            write!(f, "none")?;
        }
        for (i, h) in held.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            write!(f, "{sep}{} {} bytes", h.holder, h.held)?;
            if h.deferred {
                write!(
                    f,
                    " (its stream is being captured: asked to give it back at its next \
                     synchronize, or call Stream::trim once the capture is over)"
                )?;
            }
        }
        write!(f, "; gave back {} bytes", self.given_back())?;
        if self.retried {
            write!(f, " and retried once")?;
        }
        Ok(())
    }
}
