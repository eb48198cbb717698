//! Keeps the runtime's layering one-way. The `# Layers` table of `lib.rs`'s module doc gives every
//! module file a rank, and a module may import only modules of a lower rank. This test reads every
//! file under `src/` and resolves every path into the crate written there: `use` trees (grouped,
//! nested, over several lines), `crate::`, `super::` and `self::` paths and paths through child
//! modules anywhere in the code, and names re-exported by `lib.rs` or by another module
//! (`crate::LentSlice` leads to `device_memory`). Comments, doc comments and strings are skipped,
//! and so are `#[cfg(test)] mod` blocks and files: tests may look anywhere.
//!
//! A file the table does not name belongs to its nearest named parent (`stream::lease` is part of
//! `stream` unless the table ranks it): a directory module is one unit, whose files may use each
//! other, and whose imports from outside are its own.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module's path in the crate: `[]` is the root, `["backend", "host"]` is `backend::host`.
type ModPath = Vec<String>;

fn show(module: &[String]) -> String {
    if module.is_empty() {
        "crate".to_string()
    } else {
        module.join("::")
    }
}

/// The module a source file holds: `lib.rs` is the root, `a/mod.rs` and `a.rs` are `a`, `a/b.rs`
/// is `a::b`.
fn module_of(file: &Path) -> ModPath {
    let mut parts: ModPath = file
        .with_extension("")
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") || parts == ["lib"] {
        parts.pop();
    }
    parts
}

// ---------------------------------------------------------------------------------------------
// Tokens

/// An identifier, `::` or one punctuation character, with its line. Comments, strings, character
/// literals, lifetimes and numbers make no token.
#[derive(Clone, Debug)]
struct Token {
    text: String,
    line: usize,
}

fn is_ident_start(c: char) -> bool {
    c.is_alphabetic() || c == '_'
}

fn is_ident(text: &str) -> bool {
    text.starts_with(is_ident_start)
}

fn lex(source: &str) -> Vec<Token> {
    let c: Vec<char> = source.chars().collect();
    let at = |i: usize| c.get(i).copied().unwrap_or('\0');
    let mut tokens = Vec::new();
    let (mut i, mut line) = (0, 1);
    // Skips a string body from just after its opening quote; a raw string (`Some(hashes)`) ends at
    // a quote followed by its hashes.
    let skip_string = |mut i: usize, line: &mut usize, raw: Option<usize>| -> usize {
        while i < c.len() {
            match c[i] {
                '\\' if raw.is_none() => {
                    *line += usize::from(at(i + 1) == '\n');
                    i += 2;
                    continue;
                }
                '"' if raw.is_none_or(|n| (1..=n).all(|k| at(i + k) == '#')) => {
                    return i + 1 + raw.unwrap_or(0);
                }
                '\n' => *line += 1,
                _ => {}
            }
            i += 1;
        }
        i
    };
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < c.len() {
                if at(i) == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if at(i) == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    line += usize::from(c[i] == '\n');
                    i += 1;
                }
            }
        } else if ch == '"' {
            i = skip_string(i + 1, &mut line, None);
        } else if ch == '\'' {
            if at(i + 1) == '\\' {
                i += 3; // `'\n'`, `'\''`, `'\u{..}'`
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3; // `'a'`
            } else {
                i += 1; // a lifetime or a label
                while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                    i += 1;
                }
            }
        } else if is_ident_start(ch) {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            let hashes = (i..).take_while(|&k| at(k) == '#').count();
            if matches!(word.as_str(), "r" | "br" | "cr") && at(i + hashes) == '"' {
                i = skip_string(i + hashes + 1, &mut line, Some(hashes));
            } else if matches!(word.as_str(), "b" | "c") && at(i) == '"' {
                i = skip_string(i + 1, &mut line, None);
            } else if word == "b" && at(i) == '\'' {
                // A byte literal: the quote is read next as a character literal.
            } else if word == "r" && hashes == 1 && is_ident_start(at(i + 1)) {
                i += 1; // a raw identifier: `r#type` is `type`
            } else {
                tokens.push(Token { text: word, line });
            }
        } else if ch.is_ascii_digit() {
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
        } else if ch == ':' && at(i + 1) == ':' {
            tokens.push(Token {
                text: "::".to_string(),
                line,
            });
            i += 2;
        } else {
            tokens.push(Token {
                text: ch.to_string(),
                line,
            });
            i += 1;
        }
    }
    tokens
}

/// The index just past the bracket that closes the one at `open`.
fn past_close(tokens: &[Token], open: usize) -> usize {
    let mut depth = 0usize;
    for (i, t) in tokens.iter().enumerate().skip(open) {
        match t.text.as_str() {
            "(" | "[" | "{" => depth += 1,
            ")" | "]" | "}" => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
    }
    tokens.len()
}

// ---------------------------------------------------------------------------------------------
// What a file says

/// A path written in a module: `segments` read from `scope` (the file's module, or an inline
/// module in it), at `line`.
#[derive(Clone, Debug)]
struct Written {
    scope: ModPath,
    segments: Vec<String>,
    line: usize,
}

/// What one module file says about the crate's modules.
#[derive(Debug, Default)]
struct Module {
    /// The file, from the crate's directory (`src/buffer.rs`).
    file: String,
    /// Every path that may lead into the crate, `use` trees included, outside test modules.
    paths: Vec<Written>,
    /// Names the file's `use` declarations bind at the module's top: name -> what they name.
    bindings: BTreeMap<String, Written>,
    /// The targets of its glob imports.
    globs: Vec<Written>,
    /// Names of the items it defines.
    items: BTreeSet<String>,
    /// Children declared `#[cfg(test)] mod name;`: test files.
    test_children: BTreeSet<String>,
}

/// One path a `use` tree imports, and the name it binds (`None` for a glob or `as _`).
struct Leaf {
    segments: Vec<(String, usize)>,
    name: Option<String>,
    glob: bool,
}

/// Reads the `use` tree starting at `i` under `prefix`; returns the index past it.
fn use_tree(
    tokens: &[Token],
    mut i: usize,
    prefix: &mut Vec<(String, usize)>,
    leaves: &mut Vec<Leaf>,
) -> usize {
    let text = |i: usize| tokens.get(i).map_or("", |t| t.text.as_str());
    let base = prefix.len();
    if text(i) == "::" {
        i += 1;
    }
    loop {
        match text(i) {
            "{" => {
                i += 1;
                while !matches!(text(i), "}" | "") {
                    i = use_tree(tokens, i, prefix, leaves);
                    if text(i) == "," {
                        i += 1;
                    }
                }
                i += 1;
                break;
            }
            "*" => {
                leaves.push(Leaf {
                    segments: prefix.clone(),
                    name: None,
                    glob: true,
                });
                i += 1;
                break;
            }
            word if is_ident(word) => {
                prefix.push((word.to_string(), tokens[i].line));
                i += 1;
                if text(i) == "::" {
                    i += 1;
                    continue;
                }
                let mut name = prefix
                    .iter()
                    .rev()
                    .map(|s| s.0.clone())
                    .find(|s| s != "self");
                if text(i) == "as" {
                    name = Some(text(i + 1).to_string()).filter(|n| n != "_");
                    i += 2;
                }
                leaves.push(Leaf {
                    segments: prefix.clone(),
                    name,
                    glob: false,
                });
                break;
            }
            _ => break, // not Rust this test knows: the compiler will say so
        }
    }
    prefix.truncate(base);
    i
}

/// Whether `tokens[i..]` is `#[cfg(test)]`.
fn is_cfg_test(tokens: &[Token], i: usize) -> bool {
    let want = ["#", "[", "cfg", "(", "test", ")", "]"];
    tokens.len() >= i + want.len() && want.iter().zip(&tokens[i..]).all(|(w, t)| t.text == *w)
}

/// Reads one module file.
fn read_module(file: String, module: &ModPath, source: &str) -> Module {
    let tokens = lex(source);
    let text = |i: usize| tokens.get(i).map_or("", |t| t.text.as_str());
    let mut found = Module {
        file,
        ..Module::default()
    };
    // Inline modules open around `i`, with the brace depth inside each.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth: usize = 0;
    let mut i = 0;
    while i < tokens.len() {
        let scope = || {
            let mut scope = module.clone();
            scope.extend(inline.iter().map(|m| m.0.clone()));
            scope
        };
        let at_top = inline.is_empty() && depth == 0;
        if is_cfg_test(&tokens, i) {
            // Other attributes and a visibility may stand between the `cfg` and the `mod`.
            let mut j = i + 7;
            while text(j) == "#" && text(j + 1) == "[" {
                j = past_close(&tokens, j + 1);
            }
            if text(j) == "pub" {
                j += 1;
                if text(j) == "(" {
                    j = past_close(&tokens, j);
                }
            }
            if text(j) == "mod" && text(j + 2) == ";" {
                if at_top {
                    found.test_children.insert(text(j + 1).to_string());
                }
                i = j + 3;
                continue;
            }
            if text(j) == "mod" && text(j + 2) == "{" {
                i = past_close(&tokens, j + 2);
                continue;
            }
        }
        let word = text(i);
        match word {
            "{" => depth += 1,
            "}" => {
                if inline.last().is_some_and(|m| m.1 == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
            }
            "mod" if is_ident(text(i + 1)) && text(i + 2) == "{" => {
                if at_top {
                    found.items.insert(text(i + 1).to_string());
                }
                inline.push((text(i + 1).to_string(), depth + 1));
                i += 2; // the brace is counted next
                continue;
            }
            "use" => {
                let mut leaves = Vec::new();
                i = use_tree(&tokens, i + 1, &mut Vec::new(), &mut leaves);
                for leaf in leaves.into_iter().filter(|l| !l.segments.is_empty()) {
                    let written = Written {
                        scope: scope(),
                        line: leaf.segments.last().map_or(0, |s| s.1),
                        segments: leaf.segments.into_iter().map(|s| s.0).collect(),
                    };
                    if inline.is_empty() {
                        if leaf.glob {
                            found.globs.push(written.clone());
                        } else if let Some(name) = leaf.name {
                            found.bindings.insert(name, written.clone());
                        }
                    }
                    found.paths.push(written);
                }
                continue;
            }
            "fn" | "struct" | "enum" | "union" | "trait" | "type" | "const" | "static" | "mod"
                if at_top && is_ident(text(i + 1)) =>
            {
                found.items.insert(text(i + 1).to_string());
            }
            "macro_rules" if at_top && text(i + 1) == "!" => {
                found.items.insert(text(i + 2).to_string());
            }
            _ if is_ident(word)
                && text(i + 1) == "::"
                && (i == 0 || text(i - 1) != "::")
                && !(i >= 2 && text(i - 1) == "in" && text(i - 2) == "(") =>
            {
                // The start of a path (`pub(in crate::a)` names an ancestor, not an import).
                let line = tokens[i].line;
                let mut segments = vec![word.to_string()];
                let mut j = i;
                while text(j + 1) == "::" && is_ident(text(j + 2)) {
                    segments.push(text(j + 2).to_string());
                    j += 2;
                }
                found.paths.push(Written {
                    scope: scope(),
                    segments,
                    line,
                });
                i = j + 1;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    found
}

// ---------------------------------------------------------------------------------------------
// The crate

struct Crate {
    modules: BTreeMap<ModPath, Module>,
    /// Module files only tests compile (`#[cfg(test)] mod name;` and what is under them).
    test_only: BTreeSet<ModPath>,
}

impl Crate {
    /// Reads `files` (path under `src/` -> text).
    fn read(files: &BTreeMap<PathBuf, String>) -> Crate {
        let modules: BTreeMap<ModPath, Module> = files
            .iter()
            .map(|(file, text)| {
                let module = module_of(file);
                let shown = Path::new("src").join(file).display().to_string();
                let found = read_module(shown, &module, text);
                (module, found)
            })
            .collect();
        let test_roots: Vec<ModPath> = modules
            .iter()
            .flat_map(|(m, found)| {
                found.test_children.iter().map(move |c| {
                    let mut child = m.clone();
                    child.push(c.clone());
                    child
                })
            })
            .collect();
        let test_only = modules
            .keys()
            .filter(|m| test_roots.iter().any(|t| m.starts_with(t)))
            .cloned()
            .collect();
        Crate { modules, test_only }
    }

    /// The nearest module with a file of its own at or above `module` (an inline module's file).
    fn file_module(&self, mut module: ModPath) -> ModPath {
        while !module.is_empty() && !self.modules.contains_key(&module) {
            module.pop();
        }
        module
    }

    /// The module file a written path leads to; `None` for a path out of the crate (`std::..`,
    /// a local enum's variant).
    fn resolve(&self, path: &Written, hops: usize) -> Option<ModPath> {
        if hops > 16 {
            return None; // a loop of re-exports: the compiler refuses it anyway
        }
        let segments = &path.segments;
        let (mut at, rest) = match segments[0].as_str() {
            "crate" => (ModPath::new(), &segments[1..]),
            "self" => (path.scope.clone(), &segments[1..]),
            "super" => {
                let mut at = path.scope.clone();
                let ups = segments.iter().take_while(|s| *s == "super").count();
                for _ in 0..ups {
                    at.pop()?;
                }
                (at, &segments[ups..])
            }
            first => {
                // Relative: only a child module of the scope leads into the crate.
                let mut child = path.scope.clone();
                child.push(first.to_string());
                if !self.modules.contains_key(&child) {
                    return None;
                }
                (path.scope.clone(), &segments[..])
            }
        };
        for segment in rest.iter().filter(|s| *s != "self") {
            let mut next = at.clone();
            next.push(segment.clone());
            if self.modules.contains_key(&next) {
                at = next;
                continue;
            }
            let at = self.file_module(at);
            return Some(self.name_in(&at, segment, hops).unwrap_or(at));
        }
        Some(self.file_module(at))
    }

    /// Where `name`, named in `module`, is defined, if `module` imports it from elsewhere.
    fn name_in(&self, module: &ModPath, name: &str, hops: usize) -> Option<ModPath> {
        let found = &self.modules[module];
        if let Some(bound) = found.bindings.get(name) {
            return self.resolve(bound, hops + 1);
        }
        if found.items.contains(name) {
            return None;
        }
        found
            .globs
            .iter()
            .filter_map(|glob| self.resolve(glob, hops + 1))
            .find(|target| {
                let t = &self.modules[target];
                t.items.contains(name) || t.bindings.contains_key(name)
            })
            .map(|target| self.name_in(&target, name, hops + 1).unwrap_or(target))
    }

    /// Every module file but the root and test files, with the modules it imports and where.
    fn imports(&self) -> BTreeMap<ModPath, BTreeMap<ModPath, Vec<usize>>> {
        let mut all = BTreeMap::new();
        for (module, found) in &self.modules {
            if module.is_empty() || self.test_only.contains(module) {
                continue;
            }
            let mut imports: BTreeMap<ModPath, Vec<usize>> = BTreeMap::new();
            for path in &found.paths {
                if let Some(target) = self.resolve(path, 0)
                    && !target.is_empty()
                    && target != *module
                {
                    let lines = imports.entry(target).or_default();
                    if !lines.contains(&path.line) {
                        lines.push(path.line);
                    }
                }
            }
            all.insert(module.clone(), imports);
        }
        all
    }
}

// ---------------------------------------------------------------------------------------------
// The rank table

/// The rank of each module the `# Layers` table of `lib.rs` names, or what is wrong with it.
fn rank_table(lib: &str) -> Result<BTreeMap<ModPath, usize>, Vec<String>> {
    let doc = lib
        .lines()
        .enumerate()
        .map_while(|(n, l)| Some((n + 1, l.trim_start().strip_prefix("//!")?.trim())));
    let section = doc
        .skip_while(|(_, l)| *l != "# Layers")
        .skip(1)
        .take_while(|(_, l)| !l.starts_with('#'));
    let (mut ranks, mut problems) = (BTreeMap::new(), Vec::new());
    let mut last = 0;
    for (n, row) in section.filter(|(_, l)| l.starts_with('|')) {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let Ok(rank) = cells.get(1).unwrap_or(&"").parse::<usize>() else {
            continue; // the header and the rule under it
        };
        if rank <= last {
            problems.push(format!("src/lib.rs:{n}: rank {rank} follows rank {last}"));
        }
        last = rank;
        let names: Vec<&str> = cells
            .get(2)
            .unwrap_or(&"")
            .split('`')
            .skip(1)
            .step_by(2)
            .collect();
        if names.is_empty() {
            problems.push(format!("src/lib.rs:{n}: rank {rank} names no module"));
        }
        for name in names {
            let module: ModPath = name.split("::").map(str::to_string).collect();
            if let Some(before) = ranks.insert(module, rank) {
                problems.push(format!(
                    "src/lib.rs:{n}: `{name}` is in ranks {before} and {rank}"
                ));
            }
        }
    }
    if ranks.is_empty() {
        problems.push("src/lib.rs: no `# Layers` table of `| rank | modules |` rows".to_string());
    }
    if problems.is_empty() {
        Ok(ranks)
    } else {
        Err(problems)
    }
}

/// The module of the table that `module` belongs to: itself, else its nearest ranked parent.
fn unit(ranks: &BTreeMap<ModPath, usize>, module: &ModPath) -> Option<ModPath> {
    (1..=module.len())
        .rev()
        .map(|n| module[..n].to_vec())
        .find(|m| ranks.contains_key(m))
}

/// The imports between units of the table (see [`unit`]), without those inside a unit.
fn unit_imports(
    krate: &Crate,
    ranks: &BTreeMap<ModPath, usize>,
) -> BTreeMap<ModPath, BTreeMap<ModPath, Vec<(String, usize)>>> {
    let mut units: BTreeMap<ModPath, BTreeMap<ModPath, Vec<(String, usize)>>> = BTreeMap::new();
    for (module, imports) in krate.imports() {
        let Some(from) = unit(ranks, &module) else {
            continue;
        };
        for (target, lines) in imports {
            let Some(to) = unit(ranks, &target) else {
                continue;
            };
            if to != from {
                let file = &krate.modules[&module].file;
                let at = lines.into_iter().map(|line| (file.clone(), line));
                units
                    .entry(from.clone())
                    .or_default()
                    .entry(to)
                    .or_default()
                    .extend(at);
            }
        }
    }
    units
}

/// Every table problem and every import of a module of the same or a higher rank.
fn violations(files: &BTreeMap<PathBuf, String>) -> Vec<String> {
    let krate = Crate::read(files);
    let ranks = match rank_table(&files[Path::new("lib.rs")]) {
        Ok(ranks) => ranks,
        Err(problems) => return problems,
    };
    let mut found = Vec::new();
    for (module, file) in &krate.modules {
        if !module.is_empty() && !krate.test_only.contains(module) && unit(&ranks, module).is_none()
        {
            found.push(format!(
                "{} ({}) is in no rank of the table in src/lib.rs",
                show(module),
                file.file
            ));
        }
    }
    for module in ranks.keys() {
        if !krate.modules.contains_key(module) {
            found.push(format!(
                "the table in src/lib.rs ranks {}, which has no file under src/",
                show(module)
            ));
        }
    }
    let mut upward = Vec::new();
    for (module, imports) in unit_imports(&krate, &ranks) {
        let rank = ranks[&module];
        for (target, lines) in imports {
            let target_rank = ranks[&target];
            if target_rank >= rank {
                for (file, line) in lines {
                    let text = format!(
                        "{} (rank {rank}) imports {} (rank {target_rank}) at {file}:{line}",
                        show(&module),
                        show(&target),
                    );
                    upward.push((file, line, text));
                }
            }
        }
    }
    upward.sort();
    found.extend(upward.into_iter().map(|u| u.2));
    found
}

/// A cycle of imports, if there is one.
fn cycle<L>(imports: &BTreeMap<ModPath, BTreeMap<ModPath, L>>) -> Option<Vec<String>> {
    fn walk<L>(
        at: &ModPath,
        imports: &BTreeMap<ModPath, BTreeMap<ModPath, L>>,
        path: &mut Vec<ModPath>,
        done: &mut BTreeSet<ModPath>,
    ) -> Option<Vec<String>> {
        if let Some(start) = path.iter().position(|m| m == at) {
            let mut cycle: Vec<String> = path[start..].iter().map(|m| show(m)).collect();
            cycle.push(show(at));
            return Some(cycle);
        }
        if !done.insert(at.clone()) {
            return None;
        }
        path.push(at.clone());
        for next in imports.get(at).into_iter().flat_map(BTreeMap::keys) {
            if let Some(cycle) = walk(next, imports, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    imports
        .keys()
        .find_map(|m| walk(m, imports, &mut Vec::new(), &mut done))
}

/// Every `.rs` file under `src/`, by its path there; `None` where the sources are not at hand (a
/// test binary carried to another machine).
fn sources() -> Option<BTreeMap<PathBuf, String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    if !src.is_dir() {
        eprintln!("layers: skipped: no sources at {}", src.display());
        return None;
    }
    let mut files = BTreeMap::new();
    let mut dirs = vec![src.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("src is readable") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).expect("a source file");
                files.insert(path.strip_prefix(&src).unwrap().to_path_buf(), text);
            }
        }
    }
    Some(files)
}

#[test]
fn every_import_goes_down_the_rank_table() {
    let Some(files) = sources() else { return };
    let krate = Crate::read(&files);
    assert!(krate.modules.len() > 20, "the source files were found");
    let device = &krate.imports()[&vec!["device".to_string()]];
    assert!(
        device.contains_key(&vec!["storage".to_string()]),
        "the scan sees imports"
    );
    let found = violations(&files);
    assert!(
        found.is_empty(),
        "{} layering violations (see `# Layers` in src/lib.rs):\n{}",
        found.len(),
        found.join("\n")
    );
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    let Some(files) = sources() else { return };
    let ranks = rank_table(&files[Path::new("lib.rs")]).expect("the table is well-formed");
    if let Some(cycle) = cycle(&unit_imports(&Crate::read(&files), &ranks)) {
        panic!("import cycle: {}", cycle.join(" -> "));
    }
}

/// The scan itself, on a crate made up for it: every form of path is seen, and nothing else.
#[test]
fn the_scan_resolves_every_form_of_path_and_skips_comments_strings_and_tests() {
    let files: BTreeMap<PathBuf, String> = [
        (
            "lib.rs",
            "//! # Layers\n\
             //! | rank | modules |\n\
             //! |---|---|\n\
             //! | 1 | `low`, `other` |\n\
             //! | 2 | `dir`, `mid` |\n\
             //! | 3 | `dir::child` |\n\
             //! | 5 | `high` |\n\
             //!\n\
             //! # Next\n\
             //! | 9 | `ignored` |\n\
             mod dir;\nmod high;\nmod low;\nmod mid;\nmod other;\n\
             pub use high::{\n    High,\n    Other as Renamed,\n};\npub use mid::*;\n",
        ),
        (
            "low.rs",
            "// crate::high::High, in a comment\n\
             /// [`High`](crate::High), in a doc comment\n\
             const S: &str = \"crate::high::High\"; const R: &str = r#\"crate::High\"#;\n\
             const C: char = '\"'; fn l<'a>(x: &'a u8) -> &'a u8 { x }\n\
             pub(crate) fn low() -> crate::Renamed { todo!() }\n\
             use crate::{other::O,\n    mid::{self, Mid}};\n\
             #[cfg(test)]\n#[allow(unused)]\nmod tests {\n    use crate::high::High;\n}\n\
             #[cfg(test)]\nmod more_tests;\n",
        ),
        ("low/more_tests.rs", "use crate::high::High;\n"),
        ("other.rs", "pub struct O;\n"),
        (
            "mid.rs",
            "pub struct Mid;\npub(in crate::mid) fn m() -> crate::MidFn { crate::Mid }\n\
             fn d() { crate::dir::D; }\npub struct MidFn;\n",
        ),
        (
            "dir/mod.rs",
            "mod child;\npub(crate) struct D;\n\
             fn f() { child::c() }\n",
        ),
        (
            "dir/child.rs",
            "use super::D;\nfn c() { super::super::low::low(); self::x(); }\n\
             mod inner { fn i() { super::super::D; crate::High; } }\n",
        ),
        ("high.rs", "pub struct High;\npub struct Other;\n"),
    ]
    .into_iter()
    .map(|(file, text)| (PathBuf::from(file), text.to_string()))
    .collect();
    let krate = Crate::read(&files);
    let imports = krate.imports();
    let of = |m: &str| -> BTreeMap<String, Vec<usize>> {
        let key: ModPath = m.split("::").map(str::to_string).collect();
        imports[&key]
            .iter()
            .map(|(t, l)| (show(t), l.clone()))
            .collect()
    };
    let expect = |pairs: &[(&str, &[usize])]| -> BTreeMap<String, Vec<usize>> {
        pairs
            .iter()
            .map(|(m, l)| (m.to_string(), l.to_vec()))
            .collect()
    };
    assert_eq!(
        of("low"),
        expect(&[("high", &[5]), ("mid", &[7]), ("other", &[6])])
    );
    assert_eq!(of("mid"), expect(&[("dir", &[3])]));
    assert_eq!(of("dir"), expect(&[("dir::child", &[3])]));
    assert_eq!(
        of("dir::child"),
        expect(&[("dir", &[1, 3]), ("high", &[3]), ("low", &[2])])
    );
    assert!(!imports.contains_key(&vec!["low".into(), "more_tests".into()]));
    assert_eq!(
        violations(&files),
        [
            "dir::child (rank 3) imports high (rank 5) at src/dir/child.rs:3",
            "dir (rank 2) imports dir::child (rank 3) at src/dir/mod.rs:3",
            "low (rank 1) imports high (rank 5) at src/low.rs:5",
            "low (rank 1) imports other (rank 1) at src/low.rs:6",
            "low (rank 1) imports mid (rank 2) at src/low.rs:7",
            "mid (rank 2) imports dir (rank 2) at src/mid.rs:3",
        ]
    );
    assert_eq!(
        cycle(&imports).map(|c| c.join(" -> ")).as_deref(),
        Some("dir -> dir::child -> dir")
    );

    // A file the table misses, a name with no file, and ranks out of order.
    let mut files = files;
    let lib = files.get_mut(Path::new("lib.rs")).unwrap();
    *lib = lib.replace("`low`, `other`", "`low`, `ghost`");
    *lib = lib.replace("| 5 | `high` |", "| 2 | `high` |");
    assert_eq!(violations(&files), ["src/lib.rs:7: rank 2 follows rank 3"]);
    let lib = files.get_mut(Path::new("lib.rs")).unwrap();
    *lib = lib.replace("| 2 | `high` |", "| 5 | `high` |");
    assert_eq!(
        violations(&files)[..2],
        [
            "other (src/other.rs) is in no rank of the table in src/lib.rs",
            "the table in src/lib.rs ranks ghost, which has no file under src/",
        ]
    );
}

/// A file the table does not name is part of its nearest named parent: a directory module's files
/// use each other freely, and what they import from outside is checked as the parent's.
#[test]
fn an_unranked_file_belongs_to_its_parent() {
    let files: BTreeMap<PathBuf, String> = [
        (
            "lib.rs",
            "//! # Layers\n//! | rank | modules |\n//! |---|---|\n\
             //! | 1 | `low` |\n//! | 2 | `dir` |\n//! | 3 | `high` |\n\
             mod low; mod dir; mod high;\n",
        ),
        ("low.rs", "pub(crate) struct L;\n"),
        ("high.rs", "pub(crate) struct H;\n"),
        (
            "dir/mod.rs",
            "mod child;\npub(crate) struct D(child::C);\nuse crate::low::L;\n",
        ),
        (
            "dir/child.rs",
            "pub(crate) struct C;\nimpl super::D {}\nfn f() -> crate::high::H { todo!() }\n",
        ),
    ]
    .into_iter()
    .map(|(p, t)| (PathBuf::from(p), t.to_string()))
    .collect();
    assert_eq!(
        violations(&files),
        ["dir (rank 2) imports high (rank 3) at src/dir/child.rs:3"]
    );
    let ranks = rank_table(&files[Path::new("lib.rs")]).unwrap();
    assert_eq!(cycle(&unit_imports(&Crate::read(&files), &ranks)), None);
}
