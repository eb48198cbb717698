//! The seed APIs as thin layers over the pool: OpenCV's `GpuMat` and `BufferPool`, ppl.cv's memory
//! pool (feature `pplcv`), TensorRT-style `MixMemory` (feature `mix`).

#[cfg(feature = "mix")]
#[cfg_attr(docsrs, doc(cfg(feature = "mix")))]
pub mod mix;
pub mod opencv;
#[cfg(feature = "pplcv")]
#[cfg_attr(docsrs, doc(cfg(feature = "pplcv")))]
pub mod pplcv;
