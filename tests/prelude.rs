//! `use gpu_pool::prelude::*;` is all a newcomer imports: the README's first example and the
//! guide's sections up to the kernel arguments name nothing of gpu-pool beyond it. Both are
//! doctests (the README through `ReadmeDoctests`, the guide through `gpu_pool::guide`), so they
//! compile with the prelude alone; this test keeps them from growing other imports.

/// The Rust code blocks of `markdown`'s text before the first line starting with `stop`.
fn rust_blocks(markdown: &str, stop: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in markdown.lines() {
        if current.is_none() && line.starts_with(stop) {
            break;
        }
        match (&mut current, line.trim_start().strip_prefix("```")) {
            // A fence with no language is Rust to rustdoc.
            (None, Some(info))
                if (info.is_empty() || info.starts_with("rust"))
                    && !info.contains("compile_fail") =>
            {
                current = Some(String::new());
            }
            (Some(block), Some(_)) => {
                blocks.push(std::mem::take(block));
                current = None;
            }
            (Some(block), None) => {
                block.push_str(line);
                block.push('\n');
            }
            (None, _) => {}
        }
    }
    blocks
}

/// The `use gpu_pool...` lines of a block that are not the prelude.
fn other_imports(block: &str) -> Vec<&str> {
    block
        .lines()
        .map(|l| l.trim_start_matches('#').trim())
        .filter(|l| l.starts_with("use gpu_pool") && *l != "use gpu_pool::prelude::*;")
        .collect()
}

#[test]
fn the_readme_and_the_guides_first_sections_need_only_the_prelude() {
    let readme = include_str!("../README.md");
    let guide = include_str!("../docs/guide.md");
    let readme_first = rust_blocks(readme, "## ").into_iter().take(1);
    let guide_first = rust_blocks(guide, "## Kernel arguments");
    let blocks: Vec<String> = readme_first.chain(guide_first).collect();
    assert!(
        blocks.len() >= 4,
        "found {} blocks: the README's example and the guide's first sections",
        blocks.len()
    );
    for block in &blocks {
        assert!(
            block.contains("use gpu_pool::prelude::*;"),
            "a block without the prelude:\n{block}"
        );
        assert_eq!(
            other_imports(block),
            Vec::<&str>::new(),
            "imports beyond the prelude in:\n{block}"
        );
    }
}

/// The crate docs (docs.rs's first page) open with the README's example, word for word, so the two
/// cannot drift apart.
#[test]
fn the_crate_docs_open_with_the_readmes_example() {
    let readme = include_str!("../README.md");
    let lib = include_str!("../src/lib.rs");
    let crate_docs: String = lib
        .lines()
        .filter_map(|l| l.strip_prefix("//!"))
        .map(|l| format!("{}\n", l.strip_prefix(' ').unwrap_or(l)))
        .collect();
    let readme_example = rust_blocks(readme, "## ").into_iter().next();
    let docs_first = rust_blocks(&crate_docs, "# Where").into_iter().next();
    assert!(readme_example.is_some(), "the README has an example");
    assert_eq!(docs_first, readme_example);
}
