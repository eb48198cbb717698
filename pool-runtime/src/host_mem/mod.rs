//! Page-locked host memory whose copies the library tracks ([`HostMem`]), so that an upload from
//! it or a download into it is asynchronous and still safe.
//!
//! A copy between page-locked memory and the device runs after the call returns, so the host
//! memory must not be written (for an upload) or read (for a download) or freed before the copy is
//! done. `HostMem` keeps a mark of each stream's last copy and waits for them wherever the host
//! touches the memory: [`HostMem::as_slice`], [`HostMem::as_mut_slice`] and its drop. A copy on
//! one stream is ordered after the others' copies of the same memory. Pageable slices keep the
//! waiting `upload` and `download`.
//!
//! A mark starts as a ticket of the stream's [`SyncClock`]: free to take, and answered without
//! the driver once the stream has been synchronized, as a frame loop does before it touches its
//! frames again. A wait that finds its ticket not yet covered synchronizes the whole stream, so
//! from then on that memory's copies are marked by an event each (`cuEventRecord`, 300-700 ns),
//! and a later wait is for the copy alone: a program that refills an upload's memory while the
//! kernels after the upload run keeps that overlap after its first frame.
//!
//! Inside a graph capture these copies are refused: every replay would reach the host memory, and
//! nothing could order the host's own use of it against a replay.
//!
//! Dropping a `HostMem` with a copy in flight does not wait for it: an event is recorded after the
//! copy (or the copy's own is kept), and the memory goes to its device's list of deferred frees
//! (`core/deferred.rs`'s `DeviceDeferred`, `After::Events`), freed once the events have fired: checked at the device's next
//! `HostMem::new`, at each `Stream::synchronize`, and waited for when the device is dropped. Where
//! no event can be made, the drop waits for the copy as before.

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Arc;

use bytemuck::Pod;

use crate::base::error::CaptureError;
use crate::base::error::PoolError;
use crate::base::layout::MAX_ELEMENT_ALIGN;
use crate::core::capturing;
use crate::core::deferred::{After, GiveBack};
use crate::core::device::Device;
use crate::core::stream::{Stream, SyncClock};
use crate::core::view::{GpuView, GpuViewMut};
use crate::storage::backend::{Backend, RawEvent, RawStream};

/// Page-locked host memory of `len` elements for asynchronous uploads and downloads
/// ([`GpuWrite::upload_async`](crate::GpuWrite::upload_async),
/// [`GpuRead::download_async`](crate::GpuRead::download_async)): OpenCV's `HostMem`, with the
/// copies in flight tracked, so the host can neither touch nor free the memory under them.
///
/// A copy costs no event while its stream is synchronized ([`Stream::synchronize`]) before the
/// memory is touched again; memory touched before that costs one wait for the whole stream, and
/// its later copies an event each (a wait for the copy alone). Touched or dropped while code
/// outside gpu-pool captures the stream of a copy nothing vouches for, it cannot wait: the touch
/// returns `CaptureError::Elsewhere`, and the drop leaks the memory (logged).
///
/// Dropped with a copy in flight, it does not block: the memory is freed once the copy is done
/// (an event after it says when), at the device's next `HostMem::new` or `Stream::synchronize`
/// that finds it done, or when the device is dropped. Only where no event can be recorded (the
/// driver refuses one) does the drop wait for the copy's stream.
///
/// ```
/// use gpu_pool::{compat::opencv::BufferPool, Device, GpuRead, GpuWrite, HostMem, PoolError, Stream};
/// let stream = Stream::new(&Device::host())?;
/// let mut frame = HostMem::<u8>::new(stream.device(), 640 * 480)?;
/// frame.as_mut_slice()?.fill(7); // waits for nothing: no copy is in flight
/// let mut gpu = BufferPool::new(&stream).get_buffer::<u8>(480, 640)?;
/// gpu.upload_async(&frame)?; // returns before the copy is done (on a GPU)
/// let mut out = HostMem::<u8>::new(stream.device(), 640 * 480)?;
/// gpu.download_async(&mut out)?;
/// assert!(out.as_slice()?.iter().all(|&v| v == 7)); // waits for the download
/// # Ok::<(), PoolError>(())
/// ```
pub struct HostMem<T: Pod> {
    device: Device,
    ptr: NonNull<T>,
    len: usize,
    /// Each stream's last copy of this memory that may still be in flight.
    in_flight: RefCell<Vec<InFlight>>,
    /// A wait found a copy its ticket could not vouch for: later copies are marked by events.
    events: Cell<bool>,
    /// A copy may be in flight that nothing marks (recording it failed, or another thread's
    /// capture took it): the memory is never handed out or freed again.
    lost: Cell<bool>,
    _owns: PhantomData<T>,
}

/// A stream's last copy of a `HostMem`, and what tells when it is done.
struct InFlight {
    /// The pool stream's id.
    stream: u64,
    mark: Mark,
}

enum Mark {
    /// Done once `clock` covers `ticket`; else done after a synchronize of `raw`, the stream the
    /// clock counts (held here: the `HostMem` may outlive the pool stream).
    Ticket {
        clock: Arc<SyncClock>,
        ticket: u64,
        raw: RawStream,
    },
    /// An event recorded right after the copy.
    Event(RawEvent),
}

// SAFETY: the memory is owned by this value alone (nothing else holds its address but copies in
// flight, which its methods wait for), so moving it to another thread moves the only handle; the
// events and streams are driver handles usable from any thread, and the clocks are atomics. Not
// `Sync`: `in_flight` is a `RefCell`.
unsafe impl<T: Pod + Send> Send for HostMem<T> {}

impl<T: Pod> std::fmt::Debug for HostMem<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostMem")
            .field("device", &self.device.id())
            .field("len", &self.len)
            .field("copies_in_flight", &self.in_flight.borrow().len())
            .finish()
    }
}

impl<T: Pod> HostMem<T> {
    /// `len` zeroed elements of page-locked memory (`cuMemHostAlloc`; plain host memory on the
    /// host backend) for copies with `device`.
    ///
    /// Errors: `UnsupportedAlignment` for an element aligned past `MAX_ELEMENT_ALIGN`;
    /// `SizeOverflow`; `OutOfMemory`.
    pub fn new(device: &Device, len: usize) -> Result<HostMem<T>, PoolError> {
        // Memory of earlier `HostMem`s whose copies are done goes back first.
        device.inner.deferred.give_back_done(&device.inner);
        if align_of::<T>() > MAX_ELEMENT_ALIGN {
            return Err(PoolError::UnsupportedAlignment {
                type_name: std::any::type_name::<T>(),
                align: align_of::<T>(),
                max: MAX_ELEMENT_ALIGN,
            });
        }
        let bytes = len
            .checked_mul(size_of::<T>())
            .ok_or(PoolError::SizeOverflow {
                rows: 1,
                cols: len,
                elem_size: size_of::<T>(),
            })?;
        if capturing::on_this_thread() {
            // The driver refuses an allocation from a capturing thread, and breaks the capture.
            return Err(crate::core::graph_key::refusal(CaptureError::Allocates {
                what: "HostMem::new",
                context: None,
            }));
        }
        let ptr = if bytes == 0 {
            NonNull::dangling()
        } else {
            // Page-locked memory is host memory, yet the driver may need device memory to map
            // it: the device's idle memory goes back first on a second try.
            let raw = device.or_reclaim(|| device.backend().alloc_pinned(bytes))?;
            if !(raw as usize).is_multiple_of(align_of::<T>()) {
                // SAFETY: allocated just above with this size, unused, freed once.
                let _ = unsafe { device.backend().free_pinned(raw, bytes) };
                return Err(PoolError::UnsupportedAlignment {
                    type_name: std::any::type_name::<T>(),
                    align: align_of::<T>(),
                    max: MAX_ELEMENT_ALIGN,
                });
            }
            NonNull::new(raw.cast::<T>()).ok_or(PoolError::OutOfMemory {
                device: device.id(),
                requested: bytes,
                context: None,
                reclaimed: None,
            })?
        };
        Ok(HostMem {
            device: device.clone(),
            ptr,
            len,
            in_flight: RefCell::new(Vec::new()),
            events: Cell::new(false),
            lost: Cell::new(false),
            _owns: PhantomData,
        })
    }

    /// Page-locked memory holding a copy of `data`.
    pub fn from_slice(device: &Device, data: &[T]) -> Result<HostMem<T>, PoolError> {
        let mut mem = HostMem::new(device, data.len())?;
        mem.as_mut_slice()?.copy_from_slice(data);
        Ok(mem)
    }

    /// Elements.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no element.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device its copies run on.
    #[must_use]
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The elements, once every copy in flight is done (a download into the memory, or an upload
    /// that a later download would race). The host waits only if one is not.
    pub fn as_slice(&self) -> Result<&[T], PoolError> {
        self.wait_all()?;
        // SAFETY: `len` initialised elements (zeroed at allocation, `T: Pod`) that no copy uses
        // now (waited for above) and none can start while the returned borrow of `self` lives
        // but an upload, which only reads.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) })
    }

    /// The elements for writing, once every copy in flight is done.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T], PoolError> {
        self.wait_all()?;
        // SAFETY: as `as_slice`; the exclusive borrow keeps every copy from starting meanwhile.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) })
    }

    /// Waits on the host for every copy in flight. On an error the marks stay, and the memory is
    /// treated as still in use.
    fn wait_all(&self) -> Result<(), PoolError> {
        if self.lost.get() {
            return Err(lost_error(self.device.id()));
        }
        let mut in_flight = self.in_flight.borrow_mut();
        let waited = wait_for_copies(&self.device, &mut in_flight);
        if waited.as_ref().map_or(true, |&whole_stream| whole_stream) {
            // The wait took a whole stream (or could not be made): mark copies precisely now.
            self.events.set(true);
        }
        waited.map(drop)
    }

    /// Makes `stream` wait for the other streams' copies of this memory, before a copy of its own:
    /// on the GPU for a copy an event marks, on the host for one a ticket marks (and the memory's
    /// copies are marked by events from then on).
    fn order_after_others(&self, stream: &Stream) -> Result<(), PoolError> {
        let backend = self.device.backend();
        for entry in self.in_flight.borrow().iter() {
            if entry.stream == stream.id() {
                continue;
            }
            match &entry.mark {
                Mark::Event(event) => stream.wait_for(event)?,
                Mark::Ticket { clock, ticket, raw } => {
                    if !clock.is_done(*ticket) {
                        self.events.set(true);
                        clock.synchronize_uncaptured(
                            backend,
                            raw,
                            entry.stream,
                            SyncClock::HOST_COPY,
                        )?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Notes the copy just queued on `stream` as that stream's copy in flight: by a ticket, or,
    /// once a wait needed more than a ticket could say, by an event after it. If the copy went
    /// into a capture someone else began, or no event can mark it, the stream is waited for
    /// instead, and failing that the memory is marked lost: never handed out or freed again.
    fn note_copy(&self, stream: &Stream, raw: &RawStream) -> Result<(), PoolError> {
        let backend = self.device.backend();
        let mut in_flight = self.in_flight.borrow_mut();
        let mine = in_flight
            .iter()
            .position(|entry| entry.stream == stream.id());
        let marked = if self.events.get() {
            // The stream's earlier copy comes before this one in its order: its event, recorded
            // again, marks both (a frame loop makes no new event per copy).
            match mine.map(|i| &in_flight[i].mark) {
                Some(Mark::Event(event)) => backend.rerecord(event, raw).map(|()| None),
                _ => backend
                    .record_event(raw)
                    .map(|event| event.map(Mark::Event)),
            }
        } else {
            let ticket = stream.clock().ticket();
            match mine.map(|i| &mut in_flight[i].mark) {
                Some(Mark::Ticket { ticket: t, .. }) => {
                    *t = ticket; // the same stream's clock: a later ticket covers the earlier
                    Ok(None)
                }
                _ => Ok(Some(Mark::Ticket {
                    clock: Arc::clone(stream.clock()),
                    ticket,
                    raw: raw.clone(),
                })),
            }
        };
        let captured = backend.is_capturing(raw).unwrap_or(true);
        match marked {
            Err(e) => {
                if stream.synchronize().is_err() {
                    self.lost.set(true);
                }
                return Err(e);
            }
            Ok(_) if captured => {
                self.lost.set(true);
                return Err(crate::core::graph_key::refusal(CaptureError::Elsewhere {
                    what: "an asynchronous host copy",
                    stream: stream.id(),
                }));
            }
            Ok(Some(mark)) => {
                let entry = InFlight {
                    stream: stream.id(),
                    mark,
                };
                match mine {
                    Some(i) => release_mark(backend, std::mem::replace(&mut in_flight[i], entry)),
                    None => in_flight.push(entry),
                }
            }
            Ok(None) => {} // marked again, or the host backend (the copy is done)
        }
        // Other streams' copies that are done need no mark any more.
        let mut i = 0;
        while i < in_flight.len() {
            let entry = &in_flight[i];
            let done = match &entry.mark {
                _ if entry.stream == stream.id() => false,
                Mark::Ticket { clock, ticket, .. } => clock.is_done(*ticket),
                Mark::Event(event) => backend.event_done(event).unwrap_or(false),
            };
            if done {
                release_mark(backend, in_flight.swap_remove(i));
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Whether copies are marked by events (`testing::host_mem_marks_copies_with_events`).
    #[cfg(feature = "testing")]
    pub(crate) fn marks_copies_with_events(&self) -> bool {
        self.events.get()
    }

    /// The memory as bytes, for the backend's copies.
    fn bytes(&self) -> *mut u8 {
        self.ptr.as_ptr().cast()
    }
}

impl<T: Pod> Drop for HostMem<T> {
    fn drop(&mut self) {
        let (device, lost, bytes) = (
            self.device.clone(),
            self.lost.get(),
            self.len * size_of::<T>(),
        );
        let mut in_flight = std::mem::take(self.in_flight.get_mut());
        let ptr = self.bytes();
        // Recording an event may join a capture and freeing is a driver call: inside a capture on
        // this thread either would break it, so both come after the captures (the memory stays).
        crate::core::deferred::after_captures(Box::new(move || {
            let marked = if lost {
                Err(lost_error(device.id()))
            } else {
                events_after_copies(&device, &mut in_flight)
            };
            let backend = device.backend();
            let after = match marked {
                Ok(after) => after,
                Err(e) => {
                    // A copy may still use the memory: leaked rather than freed under it.
                    crate::base::event::error!(error = %e, "waiting for copies of host memory failed: it is leaked");
                    in_flight
                        .into_iter()
                        .for_each(|entry| release_mark(backend, entry));
                    return;
                }
            };
            if bytes == 0 {
                after.into_iter().for_each(|e| backend.drop_event(e));
                return;
            }
            // SAFETY: allocated by this device's backend with `alloc_pinned(bytes)` (non-zero),
            // for this `HostMem`, which is gone; made once, and every copy of it is done once the
            // events after them have fired.
            let memory = unsafe { GiveBack::pinned(ptr, bytes) };
            // Freed now if every copy is done, else once their events have fired.
            device.inner.deferred.give_back_after(
                &device.inner,
                After::Events(after),
                memory,
                false,
            );
        }));
    }
}

/// Events that fire once every copy in `in_flight` is done (none for a copy known done), taking
/// the marks: a copy's own event, or one recorded now on the stream of a copy its ticket cannot
/// vouch for (it follows the copy). Where the driver makes no event, waits for that stream
/// instead. On an error the marks not taken stay in `in_flight`, and no event is returned.
fn events_after_copies(
    device: &Device,
    in_flight: &mut Vec<InFlight>,
) -> Result<Vec<RawEvent>, PoolError> {
    let backend = device.backend();
    let mut after = Vec::new();
    while let Some(entry) = in_flight.pop() {
        let marked = match &entry.mark {
            Mark::Ticket { clock, ticket, .. } if clock.is_done(*ticket) => Ok(None),
            Mark::Ticket { clock, raw, .. } => event_after(backend, clock, raw, entry.stream),
            // The copy's own event, taken out of the mark below.
            Mark::Event(_) => Ok(None),
        };
        match (marked, entry.mark) {
            (Err(e), mark) => {
                in_flight.push(InFlight {
                    stream: entry.stream,
                    mark,
                });
                after.into_iter().for_each(|e| backend.drop_event(e));
                return Err(e);
            }
            (Ok(Some(event)), mark) => {
                after.push(event);
                release_mark(
                    backend,
                    InFlight {
                        stream: entry.stream,
                        mark,
                    },
                );
            }
            (Ok(None), Mark::Event(event)) => match backend.event_done(&event) {
                Ok(true) => backend.drop_event(event),
                // Not done, or the query failed: the free waits for it.
                _ => after.push(event),
            },
            (Ok(None), mark) => release_mark(
                backend,
                InFlight {
                    stream: entry.stream,
                    mark,
                },
            ),
        }
    }
    Ok(after)
}

/// An event recorded on `raw` now, after the copy a ticket of `clock` marks; `None` on the host
/// (its copies are done when queued), or where no event could be made and the stream was waited
/// for instead. `CapturedElsewhere` while the stream is captured: an event there would join it.
fn event_after(
    backend: &dyn Backend,
    clock: &SyncClock,
    raw: &RawStream,
    stream_id: u64,
) -> Result<Option<RawEvent>, PoolError> {
    if backend.is_capturing(raw)? {
        // The wait's own error, which says to drop the memory after the capture.
        return clock
            .synchronize_uncaptured(backend, raw, stream_id, SyncClock::HOST_COPY)
            .map(|()| None);
    }
    match backend.record_event(raw) {
        Ok(event) => Ok(event),
        Err(e) => {
            crate::base::event::warn!(error = %e, "no event after a host copy: waiting for its stream to free the memory");
            clock.synchronize(backend, raw).map(|()| None)
        }
    }
}

/// Waits on the host for each copy in `in_flight`, removing it once done; whether a wait had to
/// synchronize a whole stream (a ticket its clock did not cover). On an error the copies not
/// waited for stay.
fn wait_for_copies(device: &Device, in_flight: &mut Vec<InFlight>) -> Result<bool, PoolError> {
    let backend = device.backend();
    let mut whole_stream = false;
    while let Some(entry) = in_flight.pop() {
        let waited = match &entry.mark {
            Mark::Ticket { clock, ticket, .. } if clock.is_done(*ticket) => Ok(()),
            Mark::Ticket { clock, raw, .. } => {
                whole_stream = true;
                clock.synchronize_uncaptured(backend, raw, entry.stream, SyncClock::HOST_COPY)
            }
            Mark::Event(event) => backend.wait_host(event),
        };
        if let Err(e) = waited {
            in_flight.push(entry);
            return Err(e);
        }
        release_mark(backend, entry);
    }
    Ok(whole_stream)
}

/// Gives a copy's event, or the stream handle its ticket holds, back to the backend: the last
/// handle of a CUDA stream binds its context to destroy it, and the caller's must stay current.
fn release_mark(backend: &dyn crate::storage::backend::Backend, entry: InFlight) {
    match entry.mark {
        Mark::Event(event) => backend.drop_event(event),
        Mark::Ticket { raw, .. } => backend.drop_stream(raw),
    }
}

fn lost_error(device: crate::base::id::DeviceId) -> PoolError {
    PoolError::Unsupported {
        device,
        what: "host memory with a copy in flight that could not be tracked (see the error of the \
               copy that lost it); it is kept, unused, until the process ends",
    }
}

/// The stream a copy between `view` memory and `mem` runs on: the view's, if it has one, the
/// devices agree, the lengths agree (or, for a `prefix` copy, the view is no longer than `mem`),
/// and no capture on this thread would record the copy.
fn copy_stream<'a, T: Pod>(
    keeper: Option<&'a Stream>,
    device: crate::base::id::DeviceId,
    len: usize,
    mem: &HostMem<T>,
    prefix: bool,
) -> Result<&'a Stream, PoolError> {
    if if prefix {
        len > mem.len
    } else {
        len != mem.len
    } {
        return Err(PoolError::ShapeMismatch {
            expected: len,
            actual: mem.len,
        });
    }
    if mem.device.id() != device {
        return Err(PoolError::DeviceMismatch {
            expected: device,
            actual: mem.device.id(),
        });
    }
    let Some(stream) = keeper else {
        return Err(PoolError::Unsupported {
            device,
            what: "an asynchronous copy with memory of no stream",
        });
    };
    if stream.in_own_capture() || capturing::on_this_thread() {
        return Err(PoolError::Unsupported {
            device,
            what: "an asynchronous host copy inside a graph capture (its replays would reach host \
                   memory the graph does not own: copy before or after capturing)",
        });
    }
    Ok(stream)
}

impl<T: Pod> GpuViewMut<'_, T> {
    /// Queues a copy of `src` into the view on its stream and returns without waiting; `src`
    /// cannot be written or freed until the copy is done ([`HostMem`]).
    pub(crate) fn upload_async(&mut self, src: &HostMem<T>) -> Result<(), PoolError> {
        self.upload_async_from(src, false)
    }

    /// [`upload_async`](Self::upload_async) of `src`'s first `self.len()` elements when
    /// `prefix` (`MixMemory`'s sides differ in size).
    pub(crate) fn upload_async_from(
        &mut self,
        src: &HostMem<T>,
        prefix: bool,
    ) -> Result<(), PoolError> {
        let stream = copy_stream(self.stream(), self.device, self.elems(), src, prefix)?;
        let raw = stream.work_stream("upload_async")?;
        if self.elems() == 0 || size_of::<T>() == 0 {
            return Ok(());
        }
        src.order_after_others(stream)?;
        let region = self.region();
        // SAFETY: the view's window is live memory of its stream's device, borrowed exclusively;
        // `src` holds at least the region's elements, one row of the region's width after another, and is not
        // written or freed until the copy noted below is done (`HostMem` waits for it, or keeps
        // the memory for good if it cannot tell).
        unsafe {
            stream
                .device()
                .backend()
                .upload_async(region, src.bytes(), region.width, raw)
        }?;
        src.note_copy(stream, raw)
    }
}

impl<T: Pod> GpuView<'_, T> {
    /// Queues a copy of the view into `dst` on its stream and returns without waiting; `dst`
    /// cannot be read or freed until the copy is done ([`HostMem`]).
    pub(crate) fn download_async(&self, dst: &mut HostMem<T>) -> Result<(), PoolError> {
        self.download_async_into(dst, false)
    }

    /// [`download_async`](Self::download_async) into `dst`'s first `self.len()` elements when
    /// `prefix`.
    pub(crate) fn download_async_into(
        &self,
        dst: &mut HostMem<T>,
        prefix: bool,
    ) -> Result<(), PoolError> {
        let stream = copy_stream(self.stream(), self.device, self.elems(), dst, prefix)?;
        let raw = stream.work_stream("download_async")?;
        if self.elems() == 0 || size_of::<T>() == 0 {
            return Ok(());
        }
        dst.order_after_others(stream)?;
        let region = self.region();
        // SAFETY: the view's window is live memory of its stream's device; `dst` has room for
        // every row back to back (at least the view's length) and is not read or freed until the copy noted below is done.
        unsafe {
            stream
                .device()
                .backend()
                .download_async(region, dst.bytes(), region.width, raw)
        }?;
        dst.note_copy(stream, raw)
    }
}

impl<T: Pod> crate::core::access::sealed::Sealed for HostMem<T> {}

impl<T: Pod> crate::core::access::PinnedHost<T> for HostMem<T> {
    fn download_from(&mut self, view: &GpuView<'_, T>) -> Result<(), PoolError> {
        view.download_async(self)
    }

    fn upload_into(&self, view: &mut GpuViewMut<'_, T>) -> Result<(), PoolError> {
        view.upload_async(self)
    }
}
