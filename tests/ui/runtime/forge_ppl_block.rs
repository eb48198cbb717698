// The ppl.cv pool trusts a block's size and offset when it lends its bytes and frees it: safe code
// can read them, never write them.
use gpu_pool::compat::pplcv::GpuMemoryBlock;

fn main() {
    let mut block = GpuMemoryBlock::default();
    block.size = 1 << 30;
    block.offset = 4096;
    block.data = 0xdead_0000;
}
