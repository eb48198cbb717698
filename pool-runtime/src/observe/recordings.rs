//! The reader of recordings: what each stream's sink recorded (`core/sink.rs`), live and dropped.

use crate::base::sync;
use crate::core::device::Device;
use crate::core::record::StreamRecording;

impl Device {
    /// The data: the recordings of this device's live streams and of its last dropped ones, oldest
    /// first.
    ///
    /// ```
    /// use gpu_pool::{compat::opencv::BufferPool, Device, PoolError, Stream};
    /// let device = Device::private_host();
    /// let mut config = device.config()?;
    /// config.record = 100;
    /// device.configure(config)?;
    /// let stream = Stream::new(&device)?;
    /// drop(BufferPool::new(&stream).get_buffer_1d::<u8>(64)?);
    /// drop(stream);
    /// let recording = &device.recordings()[0];
    /// assert_eq!(recording.events.len(), 2); // the take and the release
    /// # Ok::<(), PoolError>(())
    /// ```
    #[must_use]
    pub fn recordings(&self) -> Vec<StreamRecording> {
        let (mut all, live, stack_size) = self.recording_sources();
        for ledger in live {
            if let Some(r) = &ledger.recorder {
                all.push(StreamRecording::of(self.id(), ledger.id, &sync::lock(r)));
            }
        }
        for r in &mut all {
            r.stack_size = stack_size;
        }
        all
    }
}
