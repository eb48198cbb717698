//! Work queued on a stream for its buffers (copies and fills), and the ordering between streams
//! that memory crossing them needs: the checks that keep that work out of a foreign capture, and
//! the waits a release must issue for other streams' use of the memory (`record_stream`).

use crate::base::error::CaptureError;
use crate::base::error::PoolError;
use crate::storage::backend::{RawEvent, RawStream, Region};

use super::Stream;

impl Stream {
    /// The backend stream for pool work named `what`: `CaptureError::Elsewhere` if the
    /// CUDA stream is being captured by anything but this stream's own
    /// [`capture`](Stream::capture), whose graph would replay it on memory the pool does not
    /// reserve.
    pub(crate) fn work_stream(&self, what: &'static str) -> Result<&RawStream, PoolError> {
        if !self.in_own_capture() && self.device.backend().is_capturing(&self.raw)? {
            return Err(crate::core::graph_key::refusal(CaptureError::Elsewhere {
                what,
                stream: self.id(),
            }));
        }
        Ok(&self.raw)
    }

    /// Makes later work on this stream wait for `event` (on the GPU; the event stays the
    /// caller's).
    pub(crate) fn wait_for(&self, event: &RawEvent) -> Result<(), PoolError> {
        self.device.backend().wait_for(&self.raw, event)
    }

    /// `CaptureError::CrossStream` if this stream or `other` is capturing: an event between
    /// them would join one to the other's capture or make a capture wait on outside work.
    pub(crate) fn check_cross_stream(
        &self,
        other: &Stream,
        what: &'static str,
    ) -> Result<(), PoolError> {
        let backend = self.device.backend();
        for s in [self, other] {
            if s.in_own_capture() || backend.is_capturing(&s.raw)? {
                return Err(crate::core::graph_key::refusal(CaptureError::CrossStream {
                    what,
                }));
            }
        }
        Ok(())
    }

    /// Copies `data` (rows of `region.width` bytes, back to back) into `region`, and returns once
    /// `data` has been read: from pageable memory, as soon as the driver has staged it, with the
    /// copy queued like any other work (no wait for the stream, as cudarc's `memcpy_htod`).
    ///
    /// # Safety
    /// `region` is live memory of this stream's device, not written by other work meanwhile.
    pub(crate) unsafe fn upload(&self, region: Region, data: &[u8]) -> Result<(), PoolError> {
        self.refuse_host_copy_in_capture("upload")?;
        let stream = self.work_stream("upload")?;
        // SAFETY: the caller's region; the backend returns once `data` may be reused.
        unsafe {
            self.device
                .backend()
                .upload(region, data, region.width, stream)
        }
    }

    /// Copies `region` into `out` (rows of `region.width` bytes, back to back) and waits for it.
    /// The work queued before it is then done too: its clock says so, as a synchronize's would.
    ///
    /// # Safety
    /// `region` is live memory of this stream's device.
    pub(crate) unsafe fn download(&self, region: Region, out: &mut [u8]) -> Result<(), PoolError> {
        self.refuse_host_copy_in_capture("download")?;
        let stream = self.work_stream("download")?;
        let issued = self.clock.issued();
        // SAFETY: the caller's region; the backend waits for the copy before returning.
        unsafe {
            self.device
                .backend()
                .download(region, out, region.width, stream)
        }?;
        self.clock.cover(issued);
        Ok(())
    }

    /// `CaptureError::HostCopy` inside this stream's own capture: the copy would not run now
    /// (the driver records it, from pageable memory too) and would run at each replay, on a slice
    /// long gone. (Another capture of the stream is `work_stream`'s refusal.)
    fn refuse_host_copy_in_capture(&self, what: &'static str) -> Result<(), PoolError> {
        if self.in_own_capture() {
            return Err(crate::core::graph_key::refusal(CaptureError::HostCopy {
                what,
            }));
        }
        Ok(())
    }

    /// Fills `region` with `pattern`, on this stream.
    ///
    /// # Safety
    /// `region` is live memory of this stream's device, its rows' width a multiple of `pattern`'s.
    pub(crate) unsafe fn fill(&self, region: Region, pattern: &[u8]) -> Result<(), PoolError> {
        let stream = self.work_stream("set_to")?;
        // SAFETY: the caller's region and pattern.
        unsafe { self.device.backend().fill(region, pattern, stream) }
    }

    /// Copies `src`, memory queued on `src_stream`, into `dst` on this stream. Across streams the
    /// copy first waits for the work queued on `src_stream` so far, and the source is not reused
    /// by `src_stream` (a pool buffer) or touched by its later work (`src_shared` memory, whose
    /// access `src_stream` orders) before the copy is done.
    ///
    /// # Safety
    /// Both regions are live memory of this device, of one shape, not overlapping.
    pub(crate) unsafe fn copy(
        &self,
        dst: Region,
        src: Region,
        src_stream: &Stream,
        src_shared: bool,
    ) -> Result<(), PoolError> {
        let cross_stream = !std::ptr::eq(src_stream, self);
        if cross_stream {
            self.check_cross_stream(src_stream, "copy_from")?;
        }
        let stream = self.work_stream("copy_from")?;
        let backend = self.device.backend();
        if cross_stream && let Some(written) = backend.record_event(&src_stream.raw)? {
            backend.wait_event(stream, written)?;
        }
        // SAFETY: the caller's regions.
        unsafe { backend.copy(dst, src, stream) }?;
        match (cross_stream, src_shared) {
            (false, _) => Ok(()),
            (true, false) => src_stream.defer_wait_for(self),
            // Shared memory is ordered on the stream its access names: that stream waits for the
            // copy, so its later work, and the event that ends the access, come after it.
            (true, true) => match backend.record_event(stream)? {
                Some(copied) => backend.wait_event(&src_stream.raw, copied),
                None => Ok(()),
            },
        }
    }

    /// Records that work queued on `user` so far uses memory of this stream: before that memory is
    /// handed out again, this stream waits for that work.
    pub(crate) fn defer_wait_for(&self, user: &Stream) -> Result<(), PoolError> {
        self.check_cross_stream(user, "record_stream")?;
        if let Some(event) = self.device.backend().record_event(&user.raw)? {
            self.before_reuse(event);
        }
        Ok(())
    }
}
