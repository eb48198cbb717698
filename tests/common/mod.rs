//! Shared by the integration tests: run a test on every device there is, the CUDA kernels the GPU
//! tests launch, and the model the randomized tests check the pool against.
#![allow(
    dead_code,
    unreachable_pub,
    reason = "each test binary uses a different part; a test helper module is not API"
)]

use std::sync::{Mutex, MutexGuard};

use gpu_pool::{Device, PoolError, config::Fallback};

#[cfg(feature = "cuda")]
#[path = "../../examples/support/kernels.rs"]
pub mod kernels;

#[cfg(feature = "cublas")]
#[path = "../../examples/support/dense.rs"]
pub mod dense;

/// The model of the pool that the randomized tests check it against.
pub mod model;

/// The GPU is one device shared by every test of a binary: its settings and stacks are global, so
/// tests that use it take this lock.
static GPU: Mutex<()> = Mutex::new(());

/// The GPU lock. Dropping it also gives the device's stack memory and cached blocks back and
/// restores the default stack config, so every test leaves the GPU as it found it and
/// compute-sanitizer's leak check sees everything freed.
pub struct GpuLock {
    device: Device,
    _guard: MutexGuard<'static, ()>,
}

impl Drop for GpuLock {
    fn drop(&mut self) {
        // A test that keeps a stream past its lock keeps its stack memory too: nothing to free.
        let _ = self.device.release_stack_memory();
        // The blocks `Fallback::Caching` holds for reuse live as long as the device, the process.
        let _ = self.device.caching_pool().free_held();
        // The device is one for the whole binary: the next test gets the default stacks, whatever
        // this one configured (refused only if a stream outlived its test, which keeps its stack).
        let _ = self
            .device
            .set_pool_config(gpu_pool::config::PoolConfig::default());
    }
}

/// CUDA device 0 with its lock, reset to the settings the tests assume; `None` (and a line saying
/// the GPU part was skipped) where there is no driver or no device.
pub fn gpu(test: &str) -> Option<(Device, GpuLock)> {
    let guard = GPU.lock().unwrap_or_else(|e| e.into_inner());
    match Device::cuda(0) {
        Ok(device) => {
            device.set_fallback(Fallback::Driver);
            device.set_strict_lifo(false);
            device.set_packing(gpu_pool::config::Packing::Cuda);
            // The tests assume OpenCV's fixed stacks unless they ask for growable ones (the CUDA
            // default where the device can map memory).
            let _ = device.set_growable_stacks(false);
            let lock = GpuLock {
                device: device.clone(),
                _guard: guard,
            };
            Some((device, lock))
        }
        Err(e) => {
            skipped(&format!("{test}: GPU part skipped: {e}"));
            None
        }
    }
}

/// ppl.cv's pool is one per process: every test that activates it holds this lock.
static PPL_POOL: Mutex<()> = Mutex::new(());

/// The ppl.cv pool's lock.
pub fn ppl_pool_lock() -> MutexGuard<'static, ()> {
    PPL_POOL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Says so on stderr past libtest's capture, so every run's log shows what did not run.
pub fn skipped(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Runs `body` on a fresh private host device, then on CUDA device 0 if there is one.
pub fn each_device(
    test: &str,
    body: impl Fn(&Device) -> Result<(), PoolError>,
) -> Result<(), PoolError> {
    let host = Device::private_host();
    host.set_fallback(Fallback::Driver);
    body(&host)?;
    if let Some((gpu, _guard)) = gpu(test) {
        body(&gpu).inspect_err(|e| println!("{test} on {}: {e}", gpu.id()))?;
        println!("{test}: ran on {} too", gpu.id());
    }
    Ok(())
}
