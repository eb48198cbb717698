//! Memory no stream owns ([`SharedMat`](crate::shared::SharedMat)): its allocation, and the order of the
//! work on it across streams. Each access goes through a stream: a read waits (on the GPU) for the
//! last write, a write for the last write and every read since. A write, when it ends, leaves an
//! event the next accesses wait on.
//!
//! A read, when it ends, takes a ticket of its stream's clock instead (no driver call): weights
//! that many streams read on every request and nobody writes cost their readers nothing but a
//! lock. A later write waits for nothing if each reader stream has synchronized (or downloaded)
//! since its read; otherwise it waits for that stream on the host, once, and from then on the
//! memory's reads record an event each, so writes that follow reads wait on the GPU. No other host
//! waits, except where a capture cannot hold an event wait: there the host waits before the
//! capture records the access.
//!
//! The borrow checker orders the host side: a write needs `&mut` of the memory, so no read (or
//! graph of one) is alive when a write begins. What remains is the GPU side, which the events
//! order.

use std::sync::Arc;

#[cfg(feature = "cuda")]
use crate::base::error::CaptureError;
use crate::base::error::PoolError;
use crate::base::sync::{Mutex, lock};
use crate::core::device::Device;
use crate::core::replay::ReplayHook;
use crate::core::stream::{Stream, SyncClock};
use crate::storage::backend::{DevPtr, RawEvent, RawStream};

/// Reads of this many streams since the last write: the finished ones are dropped.
const PRUNE_AT: usize = 8;

/// Streams remembered as having waited for the last write.
const WAITED_KEPT: usize = 16;

/// How an access uses the memory.
/// (`Read < Write`: a graph that does both makes the stronger access.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Access {
    Read,
    Write,
}

impl Access {
    /// For messages.
    #[cfg(feature = "cuda")]
    fn name(self) -> &'static str {
        match self {
            Access::Read => "read",
            Access::Write => "write",
        }
    }
}

/// One memory a graph accesses, and how.
pub(crate) type SharedUse = (Arc<SharedMemory>, Access);

/// The shared memory a graph's replays access, noted by its capture: each replay is an access,
/// ordered on the graph's stream like one outside a capture ([`SharedMemory::replay`]). The graph
/// holds it as the [`ReplayHook`] of its capture, without knowing it is SharedMat's.
#[derive(Default)]
pub(crate) struct SharedAccesses {
    /// What each replay accesses.
    replays: Vec<SharedUse>,
    /// Accesses begun before the capture and ended inside it: their work queued before the
    /// capture has no end mark yet (an event recorded inside would join the capture), so the
    /// capture's end marks it.
    unmarked: Vec<SharedUse>,
}

impl SharedAccesses {
    /// `stream`'s own capture accessed `memory`: each replay of its graph will be such an access.
    fn note(stream: &Stream, memory: &Arc<SharedMemory>, access: Access) {
        stream.note_for_replay(|notes: &mut SharedAccesses| {
            push_once(&mut notes.replays, memory, access);
        });
    }

    /// An access begun on `stream` before its own capture ended inside it: the capture's end
    /// marks the work the access queued before the capture.
    fn note_unmarked(stream: &Stream, memory: &Arc<SharedMemory>, access: Access) {
        stream.note_for_replay(|notes: &mut SharedAccesses| {
            push_once(&mut notes.unmarked, memory, access);
        });
    }
}

fn push_once(uses: &mut Vec<SharedUse>, memory: &Arc<SharedMemory>, access: Access) {
    if !uses
        .iter()
        .any(|(m, a)| Arc::ptr_eq(m, memory) && *a == access)
    {
        uses.push((Arc::clone(memory), access));
    }
}

impl ReplayHook for SharedAccesses {
    #[cfg(feature = "cuda")]
    fn capture_ended(&mut self, stream: &Stream) {
        // One access a memory, the stronger where the capture both read and wrote it.
        self.replays
            .sort_by_key(|(m, a)| (Arc::as_ptr(m), std::cmp::Reverse(*a)));
        self.replays
            .dedup_by(|later, first| Arc::ptr_eq(&later.0, &first.0));
        for (memory, access) in self.unmarked.drain(..) {
            memory.mark_after_capture(stream, access);
        }
    }

    #[cfg(feature = "cuda")]
    fn replay(
        &self,
        what: &'static str,
        parts: &[(&Stream, Option<&dyn ReplayHook>)],
        launch: &mut dyn FnMut(usize) -> Result<(), PoolError>,
    ) -> Result<(), (usize, PoolError)> {
        let parts: Vec<(&Stream, &[SharedUse])> = parts
            .iter()
            .map(|&(stream, hook)| {
                let hook: Option<&dyn std::any::Any> = hook.map(|h| h as &dyn std::any::Any);
                let accesses = hook.and_then(|h| h.downcast_ref::<SharedAccesses>());
                (stream, accesses.map_or(&[][..], |a| &a.replays[..]))
            })
            .collect();
        SharedMemory::replay(what, &parts, launch)
    }
}

/// A device allocation that no stream owns, and the events that order the work on it.
///
/// Freed when the last holder drops it (the `SharedMat` and the graphs that recorded an access),
/// after the host has waited for every access's event: nothing still queued can use it.
pub(crate) struct SharedMemory {
    device: Device,
    ptr: DevPtr,
    uses: Mutex<Uses>,
}

/// The events of the accesses that later ones must wait for.
#[derive(Default)]
struct Uses {
    /// The end of the last write, and its stream. Its event is recorded again by the next write
    /// rather than replaced: a wait already queued keeps the record it saw.
    write: Option<(u64, RawEvent)>,
    /// Streams that have waited, on the GPU, for that write since it was recorded: their later
    /// work runs after it already, so their next reads queue no wait (the last [`WAITED_KEPT`]
    /// to wait; one forgotten waits again, which is only slower).
    write_waited: Vec<u64>,
    /// The end of each stream's reads since that write (one mark a stream: a later one on the
    /// same stream covers the earlier ones).
    reads: Vec<(u64, ReadEnd)>,
    /// A write had to wait on the host for reads their streams had not synchronized since: reads
    /// are marked with events from then on ([`ReadEnd::Event`]), for later writes to wait on the
    /// GPU.
    read_events: bool,
    /// Accesses begun and not ended. The borrows make a live one impossible where it would
    /// conflict (a write needs `&mut` of the memory), so a conflicting one here is a guard that
    /// was forgotten (`mem::forget`) and will never record its end: its stream is waited for.
    open: Vec<Open>,
}

/// Where the work of a stream's reads ends.
enum ReadEnd {
    /// A ticket of the stream's clock, taken after the reads were queued: done once the stream
    /// has synchronized since. Costs no driver call; a write that finds it not done waits for the
    /// stream on the host.
    Ticket {
        clock: Arc<SyncClock>,
        raw: RawStream,
        ticket: u64,
    },
    /// An event recorded after the reads, for writes to wait on on the GPU.
    Event(RawEvent),
}

impl ReadEnd {
    /// Known done without a driver call.
    fn is_done(&self) -> bool {
        matches!(self, ReadEnd::Ticket { clock, ticket, .. } if clock.is_done(*ticket))
    }

    /// Waits on the host until the reads are done. A ticket waits for its whole stream:
    /// `CaptureError::Elsewhere` while that stream is captured (a synchronize would end the
    /// capture), which a later attempt, after the capture, gets past.
    fn wait_host(
        &self,
        backend: &dyn crate::storage::backend::Backend,
        stream: u64,
    ) -> Result<(), PoolError> {
        match self {
            ReadEnd::Ticket { clock, raw, ticket } if !clock.is_done(*ticket) => clock
                .synchronize_uncaptured(
                    backend,
                    raw,
                    stream,
                    "a write of shared memory waiting for a read on a stream being captured \
                     (write after that capture ends)",
                ),
            ReadEnd::Ticket { .. } => Ok(()),
            ReadEnd::Event(event) => backend.wait_host(event),
        }
    }

    /// The event to drop once unlocked, if any.
    fn into_event(self) -> Option<RawEvent> {
        match self {
            ReadEnd::Event(event) => Some(event),
            ReadEnd::Ticket { .. } => None,
        }
    }
}

/// An access under way on a stream (`count` guards of it).
struct Open {
    stream: u64,
    raw: RawStream,
    access: Access,
    /// Begun inside the stream's own capture: its work is the graph's, ordered at each replay.
    /// A guard's end finds its access by where it was begun, wherever it ends.
    in_capture: bool,
    /// Live guards.
    count: usize,
    /// A guard begun outside the stream's own capture ended inside it: the work it queued before
    /// the capture is marked when the capture ends ([`SharedAccesses::capture_ended`]); until
    /// then the access stays here, as an open one.
    unmarked: bool,
}

impl std::fmt::Debug for SharedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedMemory")
            .field("device", &self.device.id())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .finish_non_exhaustive()
    }
}

impl SharedMemory {
    /// Takes ownership of `ptr`, a counted driver allocation of `device` (0 for none).
    ///
    /// # Safety
    /// `ptr` is 0 or came from `device`'s storage (`alloc`/`alloc_pitch`), is owned by no one
    /// else, and nothing uses it yet: the `SharedMemory` frees it when dropped.
    pub(crate) unsafe fn adopt(device: &Device, ptr: DevPtr) -> SharedMemory {
        SharedMemory {
            device: device.clone(),
            ptr,
            uses: Mutex::new(Uses::default()),
        }
    }

    /// The device the memory is on.
    pub(crate) fn device(&self) -> &Device {
        &self.device
    }

    /// The address (0 for an empty allocation).
    pub(crate) fn ptr(&self) -> DevPtr {
        self.ptr
    }

    /// An access on `stream` begins: work queued on `stream` from now on runs after the accesses
    /// it conflicts with (the last write; for a write, also every read since).
    ///
    /// Inside `stream`'s own capture no event of outside work can be waited on, so the host waits
    /// for those accesses instead, and the capture notes the access: each replay of its graph is
    /// then ordered as an access of its own. Returns whether the access was begun inside that
    /// capture, for its [`end`](Self::end).
    pub(crate) fn begin(
        self: &Arc<Self>,
        stream: &Stream,
        access: Access,
    ) -> Result<bool, PoolError> {
        let backend = self.device.backend();
        let capturing = stream.in_own_capture();
        let me = stream.id();
        let mut uses = lock(&self.uses);
        // Forgotten accesses this one conflicts with (every open one, for a write; open writes,
        // for a read): nothing will mark their end, so the host waits for their streams.
        let mut i = 0;
        while i < uses.open.len() {
            let open = &uses.open[i];
            if access == Access::Read && open.access == Access::Read {
                i += 1;
                continue;
            }
            if open.stream != me {
                // Fails (and breaks that capture) if another thread is capturing the stream: a
                // forgotten guard leaves nothing better to wait on.
                backend.synchronize(&open.raw)?;
            }
            uses.open.swap_remove(i);
        }
        Self::wait_for_conflicts(&mut uses, stream, access, capturing)?;
        match uses
            .open
            .iter_mut()
            .find(|o| o.stream == me && o.access == access && o.in_capture == capturing)
        {
            Some(open) => open.count += 1,
            None => uses.open.push(Open {
                stream: me,
                raw: stream.raw().clone(),
                access,
                in_capture: capturing,
                count: 1,
                unmarked: false,
            }),
        }
        drop(uses);
        if capturing {
            SharedAccesses::note(stream, self, access);
        }
        Ok(capturing)
    }

    /// Queues replays of graphs, `launch(i)` for each of `parts` in order, where part `i` is the
    /// stream replay `i` is queued on and the accesses it makes: each replay is an access of each
    /// of its memories, ordered after the accesses it conflicts with (earlier parts included) and
    /// marked for later ones to wait on. The memories stay locked from the first check to the
    /// last mark, so no access can begin in between and miss a replay, and every refusal comes
    /// before anything is queued (what NCCL's rank graphs, replayed together, need to stay in
    /// step).
    ///
    /// A conflicting access still open on another stream is refused
    /// (`CaptureError::SharedAccessOpen`, for `what`): unlike an eager access, a replay borrows no
    /// `SharedMat`, so an open guard may be alive (another thread's, under an `RwLock`) with its
    /// work not all queued, and nothing can order the replay after that. Parts on a stream inside
    /// its own capture are noted for that capture's graph instead. An error comes with how many
    /// replays were queued before it.
    #[cfg(feature = "cuda")]
    pub(crate) fn replay(
        what: &'static str,
        parts: &[(&Stream, &[SharedUse])],
        launch: &mut dyn FnMut(usize) -> Result<(), PoolError>,
    ) -> Result<(), (usize, PoolError)> {
        if parts.iter().all(|(_, accesses)| accesses.is_empty()) {
            // Graphs of stream-owned memory only: nothing to order, nothing to allocate.
            return (0..parts.len()).try_for_each(|i| launch(i).map_err(|e| (i, e)));
        }
        let eager = |stream: &Stream| !stream.in_own_capture();
        // One lock a memory, taken in address order so that two replays cannot deadlock.
        let mut memories: Vec<&Arc<SharedMemory>> = parts
            .iter()
            .filter(|(stream, _)| eager(stream))
            .flat_map(|(_, accesses)| accesses.iter().map(|(m, _)| m))
            .collect();
        memories.sort_by_key(|m| Arc::as_ptr(m));
        memories.dedup_by(|a, b| Arc::ptr_eq(a, b));
        let mut locked: Vec<_> = memories.iter().map(|m| lock(&m.uses)).collect();
        let slot = |memory: &Arc<SharedMemory>| {
            memories
                .binary_search_by_key(&Arc::as_ptr(memory), |m| Arc::as_ptr(m))
                .expect("every memory of an eager part was locked")
        };
        for (stream, accesses) in parts.iter().filter(|(s, _)| eager(s)) {
            let me = stream.id();
            for (memory, access) in *accesses {
                let open = locked[slot(memory)].open.iter().find(|o| {
                    o.stream != me && (*access == Access::Write || o.access == Access::Write)
                });
                if let Some(open) = open {
                    let error = crate::core::graph_key::refusal(CaptureError::SharedAccessOpen {
                        what,
                        replay: access.name(),
                        open: open.access.name(),
                        stream: open.stream,
                    });
                    return Err((0, error));
                }
            }
        }
        let mut stale = Vec::new();
        let mut outcome = Ok(());
        for (i, (stream, accesses)) in parts.iter().enumerate() {
            if !eager(stream) {
                for (memory, access) in *accesses {
                    SharedAccesses::note(stream, memory, *access);
                }
                if let Err(e) = launch(i) {
                    outcome = Err((i, e));
                    break;
                }
                continue;
            }
            let waited = accesses.iter().try_for_each(|(memory, access)| {
                Self::wait_for_conflicts(&mut locked[slot(memory)], stream, *access, false)
            });
            if let Err(e) = waited.and_then(|()| launch(i)) {
                outcome = Err((i, e));
                break;
            }
            for (memory, access) in *accesses {
                let uses = &mut locked[slot(memory)];
                match memory.mark_end(uses, stream, *access) {
                    Ok(done) => stale.extend(done.into_iter().map(|e| (memory, e))),
                    Err(e) => {
                        // No event marks the replay: it stays open, so later accesses treat it
                        // as a forgotten guard's (an eager one waits for the stream).
                        crate::base::event::error!(stream = stream.id(), error = %e, "marking the end of a graph replay on shared memory failed; it stays open");
                        uses.open.push(Open {
                            stream: stream.id(),
                            raw: stream.raw().clone(),
                            access: *access,
                            in_capture: false,
                            count: 1,
                            unmarked: false,
                        });
                    }
                }
            }
        }
        drop(locked);
        for (memory, e) in stale {
            memory.device.backend().drop_event(e);
        }
        outcome
    }

    /// The last write, and for a write every read since, on streams other than `stream`: waited
    /// for by `stream` (or by the host, for a capture, which cannot wait on outside events). A
    /// stream that has waited for the last write on the GPU already does not wait for it again.
    fn wait_for_conflicts(
        uses: &mut Uses,
        stream: &Stream,
        access: Access,
        host: bool,
    ) -> Result<(), PoolError> {
        let backend = stream.device().backend();
        let me = stream.id();
        if let Some((on, event)) = &uses.write
            && *on != me
            && (host || !uses.write_waited.contains(&me))
        {
            if host {
                backend.wait_host(event)?;
            } else {
                backend.wait_for(stream.raw(), event)?;
                if uses.write_waited.len() == WAITED_KEPT {
                    // The longest remembered goes (streams come and go): the live ones wait once
                    // more and are remembered again, rather than wait at every read.
                    uses.write_waited.remove(0);
                }
                uses.write_waited.push(me);
            }
        }
        if access == Access::Write {
            for (on, end) in uses.reads.iter().filter(|(on, _)| *on != me) {
                match end {
                    ReadEnd::Event(event) if !host => backend.wait_for(stream.raw(), event)?,
                    _ if end.is_done() => {}
                    _ => {
                        if matches!(end, ReadEnd::Ticket { .. }) {
                            // This memory is written after reads still in flight: mark the next
                            // ones with events, which a write waits on without the host.
                            uses.read_events = true;
                        }
                        end.wait_host(backend, *on)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// An access on `stream`, begun inside its own capture or not (`begun_in_capture`, what
    /// [`begin`](Self::begin) returned), ends: later conflicting accesses wait for the work it
    /// queued. Inside `stream`'s own capture the graph's replays are ordered instead, and the
    /// work of an access begun before the capture is marked when the capture ends.
    ///
    /// The open access is closed and its end marked under one lock: an access or replay that
    /// begins meanwhile sees one or the other, never neither.
    pub(crate) fn end(
        self: &Arc<Self>,
        stream: &Stream,
        access: Access,
        begun_in_capture: bool,
    ) -> Result<(), PoolError> {
        let own_capture = stream.in_own_capture();
        let backend = self.device.backend();
        if !own_capture && backend.is_capturing(stream.raw())? {
            // Captured by someone else (cudarc): an event recorded now would join that capture.
            // The access stays open, and the next conflicting one waits for the stream.
            return Ok(());
        }
        let me = stream.id();
        let mut uses = lock(&self.uses);
        // Found where it was begun: an access begun outside the capture and ended inside it (or the
        // other way round) must not be left open for good, or replays would be refused for it.
        let open = uses
            .open
            .iter()
            .position(|o| o.stream == me && o.access == access && o.in_capture == begun_in_capture);
        let mut stale = Vec::new();
        if own_capture {
            // The capture's work is ordered at each replay of its graph.
            SharedAccesses::note(stream, self, access);
            if !begun_in_capture && let Some(i) = open {
                uses.open[i].unmarked = true;
                SharedAccesses::note_unmarked(stream, self, access);
            }
        } else {
            match self.mark_end(&mut uses, stream, access) {
                Ok(done) => stale = done,
                // No event marks the work: the host waits for it, still under the lock, or the
                // access stays open for later ones to treat as forgotten.
                Err(e) => backend.synchronize(stream.raw()).map_err(|_| e)?,
            }
        }
        if let Some(i) = open {
            uses.open[i].count -= 1;
            if uses.open[i].count == 0 && !uses.open[i].unmarked {
                uses.open.swap_remove(i);
            }
        }
        drop(uses);
        for e in stale {
            backend.drop_event(e);
        }
        Ok(())
    }

    /// `stream`'s own capture ended, inside which an access begun before it ended: the work that
    /// access queued before the capture is marked now, on the stream no longer captured (a live
    /// guard of the same access marks it at its own end). If it cannot be, the access stays open,
    /// and later accesses treat it as a forgotten guard's.
    #[cfg(feature = "cuda")]
    fn mark_after_capture(&self, stream: &Stream, access: Access) {
        let backend = self.device.backend();
        if backend.is_capturing(stream.raw()).unwrap_or(true) {
            return;
        }
        let me = stream.id();
        let mut uses = lock(&self.uses);
        let Some(i) = uses
            .open
            .iter()
            .position(|o| o.stream == me && o.access == access && !o.in_capture && o.unmarked)
        else {
            return;
        };
        uses.open[i].unmarked = false;
        if uses.open[i].count > 0 {
            return;
        }
        let stale = match self.mark_end(&mut uses, stream, access) {
            Ok(stale) => stale,
            Err(e) => {
                uses.open[i].unmarked = true;
                crate::base::event::error!(stream = me, error = %e, "marking a shared-memory access that ended inside a capture failed; it stays open");
                return;
            }
        };
        uses.open.swap_remove(i);
        drop(uses);
        for e in stale {
            backend.drop_event(e);
        }
    }

    /// Marks in `uses` (this memory's, locked) the end of an access whose work is queued on
    /// `stream`; returns the events it makes stale, for the caller to drop once unlocked.
    fn mark_end(
        &self,
        uses: &mut Uses,
        stream: &Stream,
        access: Access,
    ) -> Result<Vec<RawEvent>, PoolError> {
        let backend = self.device.backend();
        let me = stream.id();
        let mut stale = Vec::new();
        match access {
            Access::Write => {
                // The last write's event is recorded again (no event made or destroyed a write).
                match &mut uses.write {
                    Some((on, event)) => {
                        backend.rerecord(event, stream.raw())?;
                        *on = me;
                    }
                    None => uses.write = backend.record_event(stream.raw())?.map(|e| (me, e)),
                }
                uses.write_waited.clear();
                // Every read since the last write was waited for when this write began: none was
                // on another stream while the write was open (eager reads need the `&SharedMat` the
                // write borrows mutably; replays are refused), and this stream's are before it.
                stale.extend(uses.reads.drain(..).filter_map(|(_, e)| e.into_event()));
            }
            Access::Read => {
                let mine = uses.reads.iter_mut().find(|(on, _)| *on == me);
                if !uses.read_events {
                    // A later ticket of the stream covers its earlier reads.
                    let ticket = ReadEnd::Ticket {
                        clock: Arc::clone(stream.clock()),
                        raw: stream.raw().clone(),
                        ticket: stream.clock().ticket(),
                    };
                    match mine {
                        Some((_, end)) => stale.extend(std::mem::replace(end, ticket).into_event()),
                        None => {
                            stale.extend(self.prune_reads(uses));
                            uses.reads.push((me, ticket));
                        }
                    }
                    return Ok(stale);
                }
                if let Some((_, ReadEnd::Event(event))) = mine {
                    // This stream's read event, recorded again: it covers its earlier reads.
                    backend.rerecord(event, stream.raw())?;
                    return Ok(stale);
                }
                let Some(event) = backend.record_event(stream.raw())? else {
                    return Ok(stale);
                };
                match uses.reads.iter_mut().find(|(on, _)| *on == me) {
                    Some((_, end)) => *end = ReadEnd::Event(event),
                    None => {
                        stale.extend(self.prune_reads(uses));
                        uses.reads.push((me, ReadEnd::Event(event)));
                    }
                }
            }
        }
        Ok(stale)
    }

    /// Streams come and go (one a request, say): past [`PRUNE_AT`] of them, reads that are done
    /// are forgotten, rather than pile up until the next write. Returns their events.
    fn prune_reads(&self, uses: &mut Uses) -> Vec<RawEvent> {
        if uses.reads.len() < PRUNE_AT {
            return Vec::new();
        }
        let backend = self.device.backend();
        let (done, pending) = std::mem::take(&mut uses.reads)
            .into_iter()
            .partition(|(_, end)| match end {
                ReadEnd::Event(e) => backend.event_done(e).unwrap_or(false),
                ticket => ticket.is_done(),
            });
        uses.reads = pending;
        done.into_iter()
            .filter_map(|(_, end): (u64, ReadEnd)| end.into_event())
            .collect()
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        let uses = std::mem::take(&mut *lock(&self.uses));
        let (device, ptr) = (self.device.clone(), self.ptr);
        // Not inside a capture on this thread, where a driver free would break it.
        crate::core::deferred::after_captures(Box::new(move || free(&device, ptr, uses)));
    }
}

/// Waits for every access to `ptr`'s memory, then frees it.
fn free(device: &Device, ptr: DevPtr, uses: Uses) {
    let backend = device.backend();
    // Forgotten guards' work never recorded an event: their streams are waited for whole.
    let mut waited = uses
        .open
        .iter()
        .try_for_each(|open| backend.synchronize(&open.raw));
    for (stream, end) in uses.reads {
        waited = waited.and(end.wait_host(backend, stream));
        if let Some(event) = end.into_event() {
            backend.drop_event(event);
        }
    }
    if let Some((_, event)) = uses.write {
        waited = waited.and(backend.wait_host(&event));
        backend.drop_event(event);
    }
    if let Err(e) = waited {
        // Work queued on it may still run: leaking the memory is the safe outcome.
        crate::base::event::error!(error = %e, "waiting for the work on shared memory failed; its memory is leaked");
        return;
    }
    if ptr != 0 {
        // SAFETY: `adopt`'s contract: the allocation is this device's and the dropped
        // `SharedMemory`'s alone, and every access's work is done (waited for above); called once,
        // from that drop.
        if let Err(e) = unsafe { device.storage().free(ptr, None) } {
            crate::base::event::error!(error = %e, "freeing shared memory failed");
        }
    }
}
