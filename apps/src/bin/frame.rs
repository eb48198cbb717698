//! The `frame` app: a BGR -> grey -> box blur -> threshold frame pipeline, on gpu-pool and on
//! plain cudarc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    gpu_pool_apps::frame::main()
}
