//! The seed APIs as thin layers over the pool: ppl.cv's memory pool, TensorRT-style `MixMemory`.

pub mod mix;
pub mod pplcv;
