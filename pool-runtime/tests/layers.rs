//! Keeps the runtime's layering one-way (see the module doc of `lib.rs`): reads every source file,
//! collects the modules each one names through `crate::`, and fails on any import cycle, printing
//! it. Test modules (`#[cfg(test)] mod tests`) may look anywhere and are left out.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module name -> modules of the crate it uses; `None` where the sources are not at hand (a test
/// binary carried to another machine).
fn dependencies() -> Option<BTreeMap<String, BTreeSet<String>>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    if !src.is_dir() {
        eprintln!("layers: skipped: no sources at {}", src.display());
        return None;
    }
    let mut files = Vec::new();
    for dir in [src.clone(), src.join("backend")] {
        for entry in std::fs::read_dir(&dir).expect("src is readable") {
            let path = entry.expect("a directory entry").path();
            if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    let mut modules = BTreeMap::new();
    for path in files {
        let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
        let name = match (path.parent() == Some(src.as_path()), stem.as_str()) {
            (true, "lib") => continue,
            (true, _) => stem,
            (false, "mod") => "backend".to_string(),
            (false, _) => format!("backend::{stem}"),
        };
        let text = std::fs::read_to_string(&path).expect("a source file");
        let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or("");
        let mut uses = BTreeSet::new();
        for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
            let mut rest = line;
            while let Some(at) = rest.find("crate::") {
                rest = &rest[at + "crate::".len()..];
                let head: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                    .collect();
                if let Some(sub) = rest.strip_prefix("backend::") {
                    let inner: String =
                        sub.chars().take_while(|c| c.is_ascii_lowercase()).collect();
                    if inner == "host" || inner == "cuda" {
                        uses.insert(format!("backend::{inner}"));
                        continue;
                    }
                }
                if !head.is_empty() {
                    uses.insert(head);
                }
            }
            if name.starts_with("backend::") && line.contains("super::") {
                uses.insert("backend".to_string());
            }
        }
        uses.remove(&name);
        modules.insert(name, uses);
    }
    let known: BTreeSet<String> = modules.keys().cloned().collect();
    for uses in modules.values_mut() {
        uses.retain(|m| known.contains(m));
    }
    Some(modules)
}

/// A cycle through `at`, if the walk from it finds one.
fn cycle_from(
    at: &str,
    deps: &BTreeMap<String, BTreeSet<String>>,
    path: &mut Vec<String>,
    done: &mut BTreeSet<String>,
) -> Option<Vec<String>> {
    if let Some(start) = path.iter().position(|m| m == at) {
        let mut cycle = path[start..].to_vec();
        cycle.push(at.to_string());
        return Some(cycle);
    }
    if done.contains(at) {
        return None;
    }
    path.push(at.to_string());
    for next in &deps[at] {
        if let Some(cycle) = cycle_from(next, deps, path, done) {
            return Some(cycle);
        }
    }
    path.pop();
    done.insert(at.to_string());
    None
}

#[test]
fn no_module_of_the_runtime_imports_one_that_imports_it_back() {
    let Some(deps) = dependencies() else { return };
    assert!(deps.len() > 20, "the source files were found: {deps:?}");
    assert!(deps["device"].contains("storage"), "the scan sees imports");
    let mut done = BTreeSet::new();
    for module in deps.keys() {
        if let Some(cycle) = cycle_from(module, &deps, &mut Vec::new(), &mut done) {
            panic!("import cycle: {}", cycle.join(" -> "));
        }
    }
}

#[test]
fn storage_and_the_pools_below_the_device_never_name_it() {
    let Some(deps) = dependencies() else { return };
    for low in [
        "source",
        "error",
        "layout",
        "config",
        "stats",
        "record",
        "storage",
        "stack",
        "allocator",
        "caching",
    ] {
        for high in ["device", "stream", "buffer", "report"] {
            assert!(
                !deps[low].contains(high),
                "`{low}` uses `{high}`, a layer above it"
            );
        }
    }
}
