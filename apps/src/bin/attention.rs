//! The `attention` app: an attention-block inference server, on gpu-pool and on plain cudarc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    gpu_pool_apps::attention::main()
}
