//! What the harness-less GPU benches share: their run-length arguments and the driver they ran on.

use gpu_pool::interop::cudarc::driver::sys;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// The `n`th number among the arguments (flags such as cargo's `--bench` skipped), else `$var`,
/// else `default`.
pub(crate) fn count(n: usize, var: &str, default: usize) -> usize {
    let arg = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .nth(n);
    arg.or_else(|| std::env::var(var).ok())
        .and_then(|s| s.parse().ok())
        .filter(|&c| c > 0)
        .unwrap_or(default)
}

/// The CUDA driver's version, as `major.minor`.
pub(crate) fn driver_version() -> Res<String> {
    let mut v = 0;
    // SAFETY: writes one int.
    unsafe { sys::cuDriverGetVersion(&mut v) }.result()?;
    Ok(format!("{}.{}", v / 1000, v % 1000 / 10))
}
