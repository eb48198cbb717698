// cudarc's `.arg(src)` on a generic `&impl GpuRead<T>`: cudarc takes concrete types only, and its
// error asks for `DeviceRepr`. What the code means is `.buf(src)` (`LaunchArgsExt`, in the
// prelude), which the second function shows compiling.
use gpu_pool::interop::cudarc::driver::{CudaFunction, CudaStream, PushKernelArg};
use gpu_pool::prelude::*;

fn with_arg(cuda: &CudaStream, f: &CudaFunction, src: &impl GpuRead<f32>) {
    let mut args = cuda.launch_builder(f);
    args.arg(src);
}

fn with_buf(cuda: &CudaStream, f: &CudaFunction, src: &impl GpuRead<f32>) {
    let mut args = cuda.launch_builder(f);
    args.buf(src).arg(&1u32);
}

fn main() {}
