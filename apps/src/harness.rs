//! What every app shares: interleaved rounds of two twins, their percentiles and ratio, and the
//! line count of each twin's source.

use std::time::Duration;

/// One twin's samples: the time of one unit of work (a request, a frame, a step) in each round.
#[derive(Debug, Clone, Default)]
pub struct Samples {
    /// Microseconds per unit, one entry a round.
    pub us: Vec<f64>,
}

impl Samples {
    /// The `q`-quantile (0.0..=1.0) of the samples, nearest rank; NaN when there are none.
    ///
    /// ```
    /// let s = gpu_pool_apps::harness::Samples { us: vec![3.0, 1.0, 2.0] };
    /// assert_eq!(s.quantile(0.5), 2.0);
    /// ```
    pub fn quantile(&self, q: f64) -> f64 {
        if self.us.is_empty() {
            return f64::NAN;
        }
        let mut sorted = self.us.clone();
        sorted.sort_by(f64::total_cmp);
        let rank = (q * (sorted.len() - 1) as f64).round() as usize;
        sorted[rank.min(sorted.len() - 1)]
    }
}

/// Runs `rounds` rounds of both twins, the first of each round alternating, and returns their
/// samples: `(pooled, plain)`. Each call returns the time its twin took and how many units it did.
pub fn interleave<E>(
    rounds: usize,
    mut pooled: impl FnMut() -> Result<(Duration, usize), E>,
    mut plain: impl FnMut() -> Result<(Duration, usize), E>,
) -> Result<(Samples, Samples), E> {
    let (mut a, mut b) = (Samples::default(), Samples::default());
    let per_unit = |(t, n): (Duration, usize)| t.as_secs_f64() * 1e6 / n.max(1) as f64;
    for round in 0..rounds {
        if round % 2 == 0 {
            a.us.push(per_unit(pooled()?));
            b.us.push(per_unit(plain()?));
        } else {
            b.us.push(per_unit(plain()?));
            a.us.push(per_unit(pooled()?));
        }
    }
    Ok((a, b))
}

/// Lines of code in a twin's source: neither blank nor only a comment.
///
/// ```
/// assert_eq!(gpu_pool_apps::harness::code_lines("// a\n\nlet x = 1;\n  /// b\n"), 1);
/// ```
pub fn code_lines(source: &str) -> usize {
    source
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("//"))
        .count()
}

/// Prints the app's result as one markdown row of the suite's table:
/// `| app | unit | gpu-pool p10/median/p90 | cudarc p10/median/p90 | ratio | lines |`, after a
/// plain-text summary. `ratio` is gpu-pool's median over cudarc's.
pub fn report(
    app: &str,
    unit: &str,
    (pooled, plain): (&Samples, &Samples),
    (pooled_src, plain_src): (&str, &str),
) {
    let ratio = pooled.quantile(0.5) / plain.quantile(0.5);
    // Each round's pair ran back to back: the median of their ratios is steadier than the ratio
    // of the medians where the machine's speed drifts between rounds.
    let paired = Samples {
        us: pooled
            .us
            .iter()
            .zip(&plain.us)
            .map(|(a, b)| a / b)
            .collect(),
    };
    let q = |s: &Samples| {
        format!(
            "{:.2} / {:.2} / {:.2}",
            s.quantile(0.1),
            s.quantile(0.5),
            s.quantile(0.9)
        )
    };
    println!(
        "{app}: gpu-pool {:.2} µs/{unit}, cudarc {:.2} µs/{unit} (medians of {} interleaved rounds): {ratio:.3}x; median of the rounds' ratios {:.3}x (p10 {:.3}x, p90 {:.3}x)",
        pooled.quantile(0.5),
        plain.quantile(0.5),
        pooled.us.len(),
        paired.quantile(0.5),
        paired.quantile(0.1),
        paired.quantile(0.9)
    );
    println!(
        "| app | µs per | gpu-pool p10 / median / p90 | cudarc p10 / median / p90 | ratio | lines (gpu-pool / cudarc) |"
    );
    println!("|---|---|---|---|---:|---|");
    println!(
        "| {app} | {unit} | {} | {} | {ratio:.3}x | {} / {} |",
        q(pooled),
        q(plain),
        code_lines(pooled_src),
        code_lines(plain_src)
    );
}

/// Prints the pool's driver calls per unit of work, by kind (what the gpu-pool twin asked of the
/// driver besides its kernels, cuBLAS calls and the copies cudarc made for it).
pub fn print_calls_per_unit(calls: gpu_pool::observe::DriverCalls, units: usize, unit: &str) {
    let per = |n: u64| n as f64 / units.max(1) as f64;
    println!(
        "gpu-pool's own driver calls per {unit}: {:.2} in all ({:.2} event records, {:.2} GPU \
         waits, {:.2} host waits, {:.2} capture queries, {:.2} copies and fills, {:.2} memory, \
         {:.2} other)",
        per(calls.total()),
        per(calls.event_records),
        per(calls.stream_waits),
        per(calls.host_waits),
        per(calls.capture_queries),
        per(calls.copies),
        per(calls.memory),
        per(calls.other)
    );
}

/// The first command-line argument as a number of rounds, else `default`.
pub fn rounds_arg(default: usize) -> usize {
    std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

/// What a good cudarc programmer does before allocating per request with `stream.alloc`: the
/// device's default memory pool keeps freed memory instead of giving it back to the system at
/// each synchronize (its release threshold, 0 by default, raised to the top, as NVIDIA's guide to
/// stream-ordered allocation advises). cudarc has no safe call for it. Called for the cudarc
/// twins; gpu-pool's stacks do not use the pool.
pub fn keep_freed_pool_memory(
    ctx: &gpu_pool::interop::cudarc::driver::CudaContext,
) -> Result<(), gpu_pool::interop::cudarc::driver::DriverError> {
    use gpu_pool::interop::cudarc::driver::sys;
    ctx.bind_to_thread()?;
    let mut pool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: the context's device ordinal and an out-parameter for its pool; then the pool's
    // attribute, which `CU_MEMPOOL_ATTR_RELEASE_THRESHOLD` reads as a u64.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result()?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&raw mut threshold).cast(),
        )
        .result()
    }
}
