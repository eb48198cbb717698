//! The `mlp_shapes` app: `mlp_eager`'s MLP with a batch from 1 to 64 a step, its forward pass a
//! graphed pooled function (captured per shape, replayed), beside eager gpu-pool, eager cudarc and
//! cudarc graphs captured by hand per batch.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    gpu_pool_apps::mlp_shapes::main()
}
