//! Configuration, fallbacks, errors and statistics: on private host devices, and on the GPU where
//! there is one (`each_device`). None changes the process-wide usage flag (`tests/usage.rs` does).

mod buffers;
mod device_config;
mod fallbacks;
mod stacks;
mod stats;

use gpu_pool::{Device, config::Fallback};

const MIB: usize = 1 << 20;

fn private(fallback: Fallback) -> Device {
    let device = Device::private_host();
    device.set_fallback(fallback);
    device
}
