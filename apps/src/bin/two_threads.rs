//! The `two_threads` app: two threads, a stream each, loops of pooled steps of changing sizes, on
//! gpu-pool and on plain cudarc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    gpu_pool_apps::two_threads::main()
}
