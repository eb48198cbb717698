//! The sizing report: every live device's stats, and the config that avoids every fallback.

use std::fmt;

use crate::base::source::FallbackReason;
use crate::core::config::{PoolConfig, Stacks};
use crate::core::device::all_devices;
use crate::core::stats::{DeviceStats, SiteFallbacks};
#[cfg(feature = "graph")]
use crate::graph::ShapeStats;

/// Devices' stats, which display as the sizing report: per device and per live stream, stack
/// use, fallbacks and driver calls, and the config that would have avoided every fallback.
#[derive(Clone, Debug)]
#[non_exhaustive]
#[must_use = "a report does nothing unless printed or read"]
pub struct Report {
    /// One entry per device.
    pub devices: Vec<DeviceStats>,
    /// What graphed functions did in the process: captures, replays, evictions, and why calls ran
    /// eagerly.
    #[cfg(feature = "graph")]
    pub graphs: ShapeStats,
}

impl Report {
    /// The report of the given devices' stats (for every live device, see [`report`]).
    ///
    /// ```
    /// use gpu_pool::{Device, observe::Report};
    /// let device = Device::private_host();
    /// let text = Report::new(vec![device.stats()]).to_string();
    /// assert!(text.contains(&format!("{}: config", device.id())), "{text}");
    /// ```
    pub fn new(devices: Vec<DeviceStats>) -> Report {
        Report {
            devices,
            #[cfg(feature = "graph")]
            graphs: ShapeStats::process(),
        }
    }
}

/// The report of every live device, in creation order. Printing it is the caller's choice: it
/// implements `Display`.
///
/// ```
/// let report = gpu_pool::observe::report();
/// assert!(report.to_string().contains("gpu-pool report"));
/// println!("{report}");
/// ```
pub fn report() -> Report {
    Report::new(all_devices().iter().map(|d| d.stats()).collect())
}

/// One line per call site that fell back.
fn write_sites(f: &mut fmt::Formatter<'_>, sites: &[SiteFallbacks]) -> fmt::Result {
    for s in sites {
        writeln!(
            f,
            "    fell back {}x at {} ({}), up to {} short",
            s.count,
            s.site,
            s.reason,
            mib(s.bytes_short)
        )?;
    }
    Ok(())
}

/// What the device is configured with, as it is: growable stacks say so (with what they have
/// mapped), fixed ones their size and count and whether their memory is allocated; fixed stacks
/// still allocated under growable ones (streams made before the switch) are said too.
fn configured(d: &DeviceStats) -> String {
    let fixed = |c: &PoolConfig| format!("{} x {} stacks", mib(c.stack_size()), c.stack_count());
    match (&d.stacks, &d.config) {
        (Ok(Stacks::Growable { mapped }), config) => {
            let mut text = format!(
                "growable stacks ({} mapped at a stream's start; {} held, {} mapped now)",
                mib(*mapped),
                d.stacks_held,
                mib(d.stack_mapped)
            );
            if let (true, Ok(c)) = (d.stacks_allocated, config) {
                text += &format!(", and fixed {} still allocated", fixed(c));
            }
            text
        }
        (Ok(_), Ok(c)) => format!(
            "{} ({} held, memory {})",
            fixed(c),
            d.stacks_held,
            if d.stacks_allocated {
                "allocated"
            } else {
                "not allocated"
            }
        ),
        (Err(e), _) | (_, Err(e)) => format!("unknown: {e}"),
    }
}

fn mib(bytes: usize) -> String {
    format!("{:.2} MiB", bytes as f64 / (1u64 << 20) as f64)
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "gpu-pool report")?;
        for d in &self.devices {
            writeln!(
                f,
                "{}: config {}, driver calls {} alloc / {} free",
                d.device,
                configured(d),
                d.driver_alloc_calls,
                d.driver_free_calls,
            )?;
            writeln!(
                f,
                "  buffers: {} from stacks, {} from the fallback; {} LIFO violations",
                d.stack_allocations,
                d.fallback_allocations.total(),
                d.lifo_violations
            )?;
            writeln!(
                f,
                "  live: {} in {} buffers now, peak {} (all streams at once)",
                mib(d.live_bytes),
                d.live_buffers,
                mib(d.peak_live_bytes),
            )?;
            for reason in FallbackReason::ALL {
                let n = d.fallback_allocations.get(reason);
                if n > 0 {
                    writeln!(f, "    {n} fell back: {reason}")?;
                }
            }
            for s in &d.streams {
                writeln!(
                    f,
                    "  stream {} (stack {}): peak stack use {}, peak demand {}, {} stack / {} fallback buffers; {} mapped, {} in use now, {} live in {} buffers",
                    s.stream,
                    s.stack_index.map_or("none".into(), |i| i.to_string()),
                    mib(s.stack_high_water),
                    mib(s.peak_demand),
                    s.stack_allocations,
                    s.fallback_allocations.total(),
                    mib(s.stack_mapped),
                    mib(s.stack_in_use),
                    mib(s.live_bytes),
                    s.live_buffers,
                )?;
                if let Some(peak) = s.peak_at {
                    writeln!(f, "    peak reached at {}:{}", peak.file(), peak.line())?;
                }
                write_sites(f, &s.fallback_sites)?;
            }
            if let Some(limit) = d.memory_limit {
                writeln!(
                    f,
                    "  memory limit {}: {} counted against it",
                    mib(limit),
                    mib(d.memory_counted)
                )?;
            }
            for h in &d.idle_holders {
                writeln!(
                    f,
                    "  idle: {} holds {} no buffer uses (given back on out-of-memory, or by \
                     Device::reclaim_idle)",
                    h.holder,
                    mib(h.idle_bytes)
                )?;
            }
            if !d.retired_fallback_sites.is_empty() {
                writeln!(f, "  dropped streams:")?;
                write_sites(f, &d.retired_fallback_sites)?;
            }
            match d.recommended_config() {
                Some(rec) if d.fallback_allocations.total() > 0 => writeln!(
                    f,
                    "  to avoid every fallback: stacks Stacks::Fixed(PoolConfig::new({} << 20, {})?) \
                     in device.configure(..), or GPU_POOL_CONF={}",
                    rec.stack_size() >> 20,
                    rec.stack_count(),
                    rec.env_value(),
                )?,
                Some(_) if d.stack_mapped > 0 => writeln!(
                    f,
                    "  no fallbacks: growable stacks, {} mapped in all (Stream::trim gives back \
                     what is above each top)",
                    mib(d.stack_mapped)
                )?,
                Some(_) => writeln!(f, "  no fallbacks: the config is large enough")?,
                None => writeln!(f, "  no buffers requested yet")?,
            }
        }
        #[cfg(feature = "graph")]
        {
            let g = &self.graphs;
            if g.captures + g.replays + g.eager_calls > 0 {
                writeln!(f, "{g}")?;
            }
        }
        Ok(())
    }
}
