//! The `mlp_graph` app: a 2-layer MLP's forward pass captured into a CUDA graph and replayed, on
//! gpu-pool and on plain cudarc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    gpu_pool_apps::mlp_graph::main()
}
