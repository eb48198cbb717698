//! The seed APIs as thin layers over the pool: OpenCV's `GpuMat` and `BufferPool`, ppl.cv's memory
//! pool, TensorRT-style `MixMemory`.

pub mod mix;
pub mod opencv;
pub mod pplcv;
