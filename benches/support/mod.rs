//! What every bench shares: a criterion configured for a 2-core CI box and a GPU, and the markdown
//! table of medians and ratios read back from criterion's own estimates.

use std::path::{Path, PathBuf};
use std::time::Duration;

use criterion::Criterion;

/// Where criterion writes its estimates: `$CRITERION_HOME`, else the workspace's
/// `target/criterion` (criterion asks cargo for the target directory; a bench runs in `benches/`).
pub(crate) fn output_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return home.into();
    }
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(
            || Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"),
            PathBuf::from,
        )
        .join("criterion")
}

static RUN_START: std::sync::LazyLock<std::time::SystemTime> =
    std::sync::LazyLock::new(std::time::SystemTime::now);

pub(crate) fn criterion() -> Criterion {
    std::sync::LazyLock::force(&RUN_START);
    Criterion::default()
        .output_directory(&output_dir())
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args()
}

/// The median, in nanoseconds, that criterion estimated for `group/id` in this run (estimates left
/// by earlier runs are ignored).
pub(crate) fn median_ns(dir: &Path, group: &str, id: &str) -> Option<f64> {
    let path = dir.join(group).join(id).join("new/estimates.json");
    if std::fs::metadata(&path).ok()?.modified().ok()? < *RUN_START {
        return None;
    }
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()?;
    json["median"]["point_estimate"].as_f64()
}

/// The medians of `group`'s `ids` measured in this run, in order; missing ones left out.
pub(crate) fn medians(group: &str, ids: &[&str]) -> Vec<(String, f64)> {
    let dir = output_dir();
    ids.iter()
        .filter_map(|id| Some((id.to_string(), median_ns(&dir, group, id)?)))
        .collect()
}

/// Prints `| case | median | x baseline |` for the cases of `group` measured in this run.
pub(crate) fn print_table(title: &str, group: &str, baseline: &str, ids: &[&str]) {
    let Some(&(_, base)) = medians(group, &[baseline]).first() else {
        println!("\n{title}: no estimates for {group}/{baseline} (filtered out?)");
        return;
    };
    println!("\n### {title}\n\n| case | median | ratio to `{baseline}` |\n|---|---:|---:|");
    for (id, ns) in medians(group, ids) {
        println!("| `{id}` | {} | {:.2}x |", format_ns(ns), ns / base);
    }
}

pub(crate) fn format_ns(ns: f64) -> String {
    match ns {
        n if n < 1e3 => format!("{n:.2} ns"),
        n if n < 1e6 => format!("{:.2} µs", n / 1e3),
        n => format!("{:.2} ms", n / 1e6),
    }
}
