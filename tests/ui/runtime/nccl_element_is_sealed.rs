// An element type of one's own would let the count NCCL is told differ from the buffer's bytes:
// `NcclElement` is sealed.
use gpu_pool::nccl::NcclElement;

#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
struct Tiny(u8);

impl NcclElement for Tiny {
    const TYPE: gpu_pool::interop::cudarc::nccl::sys::ncclDataType_t =
        gpu_pool::interop::cudarc::nccl::sys::ncclDataType_t::ncclFloat64;
}

fn main() {}
