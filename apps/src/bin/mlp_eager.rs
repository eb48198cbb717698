//! The `mlp_eager` app: a 2-layer MLP served eagerly at a changing batch, on gpu-pool and on plain
//! cudarc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    gpu_pool_apps::mlp_eager::main()
}
