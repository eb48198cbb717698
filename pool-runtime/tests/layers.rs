//! Keeps the runtime's layers one-way (ARCHITECTURE.md, "Layers"). A file's layer is the first
//! folder under `src/`; it may import its own layer and lower ones, never a higher layer, and a
//! feature imports no other feature unless [`DECLARED`] says so. The check parses every file with
//! `syn` and resolves every path into the crate: `use` trees, `crate::`, `super::` and `self::`
//! paths anywhere (macro arguments included, read as tokens), and the crate-private aliases and
//! re-exports of `lib.rs` (`crate::stream::Stream` is `core::stream`, `crate::HostMem` is
//! `host_mem`). `lib.rs` is the root and exempt; so are `#[cfg(test)]` items and files. Doc
//! comments are not imports. Not seen: a glob `use` in `lib.rs` (there is none) and paths that
//! do not start at `crate`, `super` or `self` (a local name's own `use` is checked).
//!
//! Adding a module: put its file in its layer's folder and declare it there (`mod name;`). A new
//! layer is a folder, a `mod` in `lib.rs` and a row of [`LAYERS`].

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use proc_macro2::{TokenStream, TokenTree};
use syn::visit::{self, Visit};
use syn::{Attribute, ImplItem, Item, Meta, UseTree};

/// The layers, low to high: a file may import its own layer and those of the rows above it.
const LAYERS: &[&[&str]] = &[
    &["base"],
    &["storage"],
    &["allocators"],
    &["core"],
    &["graph", "shared", "host_mem", "nccl"], // the features: none imports another
    &["interop"],
    &["compat"],
    &["observe"],
];

/// Imports between two features that are part of the design: NCCL records collectives in graphs.
const DECLARED: &[(&str, &str)] = &[("nccl", "graph")];

/// Violations present when the files moved into layer folders, as `"file under src/ -> module it
/// imports: the issue 31 package fixing it: how"`. The test fails when one is gone, so the list
/// only shrinks: delete an entry with the change that fixes it.
const KNOWN: &[&str] = &[];

/// A path in a layer's file that leads into another layer.
#[derive(Debug)]
struct Import {
    /// The file, from the crate's directory (`src/core/access.rs`).
    file: String,
    line: usize,
    from: String,
    to: String,
    /// The module it leads to in that layer (`core::layout`), whatever alias it goes through.
    target: String,
    /// The path as written (`crate::graph::Graph`).
    path: String,
}

impl Import {
    fn allowed(&self) -> bool {
        let rank = |layer: &str| LAYERS.iter().position(|row| row.contains(&layer));
        match (rank(&self.from), rank(&self.to)) {
            (Some(from), Some(to)) => to < from || DECLARED.contains(&(&*self.from, &*self.to)),
            _ => true, // a folder the table lacks: `strays` reports it
        }
    }
}

impl std::fmt::Display for Import {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (file, line, from, to, path) =
            (&self.file, self.line, &self.from, &self.target, &self.path);
        write!(f, "{file}:{line}: {from} -> {to}: {path}")
    }
}

/// A module's path in the crate: `[]` is the root, `["core", "stream"]` is `core::stream`.
type ModPath = Vec<String>;

/// The module a file under `src/` holds: `lib.rs` is the root, `a/mod.rs` is `a`, `a/b.rs` `a::b`.
fn module_of(file: &Path) -> ModPath {
    let mut parts: ModPath = file
        .with_extension("")
        .iter()
        .map(|p| p.to_string_lossy().into())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") || parts == ["lib"] {
        parts.pop();
    }
    parts
}

/// Whether the attributes hold `#[cfg(test)]` or `#[cfg(all(test, ...))]`.
fn is_test(attrs: &[Attribute]) -> bool {
    fn test(meta: &Meta) -> bool {
        match meta {
            Meta::Path(p) => p.is_ident("test"),
            Meta::List(l) if l.path.is_ident("all") => l
                .parse_args_with(
                    syn::punctuated::Punctuated::<Meta, syn::Token![,]>::parse_terminated,
                )
                .is_ok_and(|all| all.iter().any(test)),
            _ => false,
        }
    }
    attrs
        .iter()
        .any(|a| a.path().is_ident("cfg") && a.parse_args::<Meta>().is_ok_and(|m| test(&m)))
}

fn item_attrs(item: &Item) -> &[Attribute] {
    match item {
        Item::Const(i) => &i.attrs,
        Item::Enum(i) => &i.attrs,
        Item::ExternCrate(i) => &i.attrs,
        Item::Fn(i) => &i.attrs,
        Item::ForeignMod(i) => &i.attrs,
        Item::Impl(i) => &i.attrs,
        Item::Macro(i) => &i.attrs,
        Item::Mod(i) => &i.attrs,
        Item::Static(i) => &i.attrs,
        Item::Struct(i) => &i.attrs,
        Item::Trait(i) => &i.attrs,
        Item::TraitAlias(i) => &i.attrs,
        Item::Type(i) => &i.attrs,
        Item::Union(i) => &i.attrs,
        Item::Use(i) => &i.attrs,
        _ => &[],
    }
}

/// What one file says: the paths it writes from the crate's root (`super` and `self` resolved),
/// with their lines and text, the `mod name;` files it declares (true: `#[cfg(test)]`), and what
/// the `use` items at the root bind (name -> path as written).
#[derive(Default)]
struct Scan {
    module: ModPath,
    paths: Vec<(ModPath, usize, String)>,
    mods: Vec<(ModPath, bool)>,
    bindings: Vec<(String, ModPath)>,
}

impl Scan {
    /// Records a path written as `segments` if it starts at `crate`, `super` or `self`.
    fn path(&mut self, segments: Vec<String>, line: usize) {
        let text = segments.join("::");
        let mut at = self.module.clone();
        let mut rest = segments.into_iter().peekable();
        match rest.peek().map(String::as_str) {
            Some("crate") => at.clear(),
            Some("self") => {}
            Some("super") => {}
            _ => return, // a local name, whose `use` is checked, or another crate
        }
        while let Some(head) = rest.next_if(|s| matches!(s.as_str(), "crate" | "self" | "super")) {
            if head == "super" && at.pop().is_none() {
                return; // past the root: rustc says so
            }
        }
        at.extend(rest);
        self.paths.push((at, line, text));
    }

    fn use_tree(&mut self, tree: &UseTree, prefix: &mut Vec<String>) {
        let leaf = |scan: &mut Self, prefix: &[String], last: &syn::Ident, name: &syn::Ident| {
            let mut segments = prefix.to_vec();
            segments.extend(Some(last.to_string()).filter(|i| i != "self"));
            let name = Some(name.to_string()).filter(|n| n != "self");
            if let Some(name) = name.or_else(|| prefix.last().cloned())
                && scan.module.is_empty()
            {
                scan.bindings.push((name, segments.clone()));
            }
            scan.path(segments, last.span().start().line);
        };
        match tree {
            UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(&p.tree, prefix);
                prefix.pop();
            }
            UseTree::Name(n) => leaf(self, prefix, &n.ident, &n.ident),
            UseTree::Rename(r) => leaf(self, prefix, &r.ident, &r.rename),
            UseTree::Glob(g) => {
                let line = g.star_token.span.start().line;
                self.path(prefix.clone(), line);
            }
            UseTree::Group(g) => g.items.iter().for_each(|t| self.use_tree(t, prefix)),
        }
    }

    /// Best effort for macro arguments: every `crate ::`, `super ::` or `self ::` run of tokens.
    fn tokens(&mut self, tokens: TokenStream) {
        let tokens: Vec<TokenTree> = tokens.into_iter().collect();
        let colon =
            |i: usize| matches!(tokens.get(i), Some(TokenTree::Punct(p)) if p.as_char() == ':');
        let colons = |i: usize| colon(i) && colon(i + 1);
        let mut i = 0;
        while i < tokens.len() {
            match &tokens[i] {
                TokenTree::Group(g) => self.tokens(g.stream()),
                TokenTree::Ident(start)
                    if matches!(start.to_string().as_str(), "crate" | "super" | "self")
                        && colons(i + 1) =>
                {
                    let mut segments = vec![start.to_string()];
                    while colons(i + 1)
                        && let Some(TokenTree::Ident(next)) = tokens.get(i + 3)
                    {
                        segments.push(next.to_string());
                        i += 3;
                    }
                    self.path(segments, start.span().start().line);
                }
                _ => {}
            }
            i += 1;
        }
    }
}

impl Visit<'_> for Scan {
    fn visit_item(&mut self, item: &Item) {
        if is_test(item_attrs(item)) {
            if let Item::Mod(m) = item {
                self.mods
                    .push(([&self.module[..], &[m.ident.to_string()]].concat(), true));
            }
            return;
        }
        match item {
            Item::Mod(m) => {
                self.module.push(m.ident.to_string());
                if m.content.is_none() {
                    // `#[path = "observe/testing.rs"]` in lib.rs: the file's own place is its module.
                    let moved = m.attrs.iter().find_map(|a| match &a.meta {
                        syn::Meta::NameValue(nv) if nv.path.is_ident("path") => match &nv.value {
                            syn::Expr::Lit(syn::ExprLit {
                                lit: syn::Lit::Str(s),
                                ..
                            }) => Some(module_of(Path::new(&s.value()))),
                            _ => None,
                        },
                        _ => None,
                    });
                    self.mods
                        .push((moved.unwrap_or_else(|| self.module.clone()), false));
                }
                visit::visit_item_mod(self, m);
                self.module.pop();
            }
            Item::Use(u) => self.use_tree(&u.tree, &mut Vec::new()),
            _ => visit::visit_item(self, item),
        }
    }

    fn visit_impl_item(&mut self, item: &ImplItem) {
        let attrs = match item {
            ImplItem::Const(i) => &i.attrs,
            ImplItem::Fn(i) => &i.attrs,
            ImplItem::Type(i) => &i.attrs,
            ImplItem::Macro(i) => &i.attrs,
            _ => &Vec::new(),
        };
        if !is_test(attrs) {
            visit::visit_impl_item(self, item);
        }
    }

    fn visit_path(&mut self, path: &syn::Path) {
        if path.leading_colon.is_none()
            && let Some(first) = path.segments.first()
        {
            let line = first.ident.span().start().line;
            self.path(
                path.segments.iter().map(|s| s.ident.to_string()).collect(),
                line,
            );
        }
        visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &syn::Macro) {
        visit::visit_macro(self, mac);
        self.tokens(mac.tokens.clone());
    }
}

/// The crate under `src`: every file by its path there, and what it says.
struct Crate {
    files: BTreeMap<PathBuf, Scan>,
    /// `lib.rs`'s `use` items: the name each binds -> the path it names, from the root.
    aliases: BTreeMap<String, ModPath>,
    /// The modules `lib.rs` declares: the layers.
    layers: BTreeSet<String>,
}

impl Crate {
    fn read(src: &Path) -> Crate {
        let mut files = BTreeMap::new();
        let mut dirs = vec![src.to_path_buf()];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).expect("src is readable") {
                let path = entry.expect("a directory entry").path();
                if path.is_dir() {
                    dirs.push(path);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    let text = std::fs::read_to_string(&path).expect("a source file");
                    let file = syn::parse_file(&text)
                        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                    let rel = path.strip_prefix(src).unwrap().to_path_buf();
                    let mut scan = Scan {
                        module: module_of(&rel),
                        ..Scan::default()
                    };
                    scan.visit_file(&file);
                    files.insert(rel, scan);
                }
            }
        }
        let lib = &files[Path::new("lib.rs")];
        let root = |s: &String| matches!(s.as_str(), "crate" | "self");
        let aliases = lib.bindings.iter().map(|(name, to)| {
            (
                name.clone(),
                to.iter().skip_while(|s| root(s)).cloned().collect(),
            )
        });
        let layers = lib
            .mods
            .iter()
            .filter(|m| m.0.len() == 1 && !m.1)
            .map(|m| m.0[0].clone());
        Crate {
            aliases: aliases.collect(),
            layers: layers.collect(),
            files,
        }
    }

    /// Where a path from the root leads, from its layer on, through `lib.rs`'s aliases
    /// (`stream::Stream` is `core::stream::Stream`); `None` for the root's items and other crates.
    fn resolve(&self, path: &[String], hops: usize) -> Option<ModPath> {
        let first = path.first()?;
        if self.layers.contains(first) {
            return Some(path.to_vec());
        }
        let target = self.aliases.get(first).filter(|_| hops < 8)?;
        self.resolve(&[&target[..], &path[1..]].concat(), hops + 1)
    }

    /// Every path from a layer's file into another layer, outside tests.
    fn imports(&self) -> Vec<Import> {
        let tests: Vec<&ModPath> = self
            .files
            .values()
            .flat_map(|f| &f.mods)
            .filter(|m| m.1)
            .map(|m| &m.0)
            .collect();
        let mut all = Vec::new();
        for (file, scan) in &self.files {
            let module = module_of(file);
            let Some(from) = module.first() else { continue }; // the root
            if tests.iter().any(|t| module.starts_with(t)) {
                continue;
            }
            for (path, line, text) in &scan.paths {
                if let Some(to) = self.resolve(path, 0).filter(|to| to[0] != *from) {
                    all.push(Import {
                        file: format!("src/{}", file.display()),
                        line: *line,
                        from: from.clone(),
                        to: to[0].clone(),
                        target: to[..to.len().min(2)].join("::"),
                        path: text.clone(),
                    });
                }
            }
        }
        all
    }

    /// Files no `mod` declares, and files in no layer of [`LAYERS`].
    fn strays(&self) -> Vec<String> {
        let declared: BTreeSet<&ModPath> = self
            .files
            .values()
            .flat_map(|f| &f.mods)
            .map(|m| &m.0)
            .collect();
        let mut found = Vec::new();
        for file in self.files.keys() {
            let module = module_of(file);
            if !module.is_empty() && !declared.contains(&module) {
                found.push(format!("src/{}: no `mod` declares it", file.display()));
            }
            if module
                .first()
                .is_some_and(|m| !LAYERS.concat().contains(&&**m))
            {
                found.push(format!("src/{}: in no layer of LAYERS", file.display()));
            }
        }
        found
    }
}

/// The imports the layers forbid.
fn violations(src: &Path) -> Vec<String> {
    let imports = Crate::read(src).imports();
    imports
        .iter()
        .filter(|i| !i.allowed())
        .map(ToString::to_string)
        .collect()
}

/// The crate's `src/`; `None` where the sources are not at hand (a test binary carried elsewhere).
fn sources() -> Option<PathBuf> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    src.is_dir().then_some(src).or_else(|| {
        eprintln!("layers: skipped: no sources");
        None
    })
}

#[test]
fn every_import_goes_down_the_layers() {
    let Some(src) = sources() else { return };
    let krate = Crate::read(&src);
    assert!(krate.files.len() > 40, "the source files were found");
    let imports = krate.imports();
    assert!(
        imports
            .iter()
            .any(|i| i.from == "core" && i.to == "storage" && i.allowed()),
        "the scan sees imports"
    );
    let (mut unexpected, mut seen) = (Vec::new(), BTreeSet::new());
    for import in imports.iter().filter(|i| !i.allowed()) {
        let key = format!("{} -> {}: ", &import.file["src/".len()..], import.target);
        match KNOWN.iter().find(|k| k.starts_with(&key)) {
            Some(known) => drop(seen.insert(known)),
            None => unexpected.push(import.to_string()),
        }
    }
    let gone: Vec<&str> = KNOWN
        .iter()
        .copied()
        .filter(|k| !seen.contains(k))
        .collect();
    assert!(
        unexpected.is_empty() && gone.is_empty(),
        "imports against the layers (ARCHITECTURE.md):\n{}\nin KNOWN but fixed, so remove them:\n{}",
        unexpected.join("\n"),
        gone.join("\n")
    );
}

#[test]
fn every_file_is_a_declared_module_of_a_layer() {
    let Some(src) = sources() else { return };
    let krate = Crate::read(&src);
    assert_eq!(krate.strays(), Vec::<String>::new());
    let folders: BTreeSet<&str> = LAYERS.concat().into_iter().collect();
    let declared: BTreeSet<&str> = krate.layers.iter().map(String::as_str).collect();
    assert_eq!(
        folders, declared,
        "LAYERS names the modules lib.rs declares"
    );
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/layers")
        .join(name)
        .join("src")
}

/// The check fails where it should: a core file names a feature. The same path in a doc comment
/// and in a `#[cfg(test)]` module, and the feature importing the core, are fine.
#[test]
fn the_core_importing_a_feature_fails() {
    let Some(src) = sources().map(|_| fixture("core_imports_feature")) else {
        return;
    };
    assert_eq!(
        violations(&src),
        ["src/core/x.rs:2: core -> graph::Graph: crate::graph::Graph"]
    );
}

/// One feature naming another fails (through `super::`); the declared `nccl -> graph` does not.
#[test]
fn a_feature_importing_another_fails() {
    let Some(src) = sources().map(|_| fixture("feature_imports_feature")) else {
        return;
    };
    assert_eq!(
        violations(&src),
        ["src/shared/mod.rs:3: shared -> graph::Graph: super::graph::Graph"]
    );
}

/// Paths through `lib.rs`'s aliases and re-exports, and inside a macro's arguments, lead to the
/// layer the alias names.
#[test]
fn an_alias_path_resolves_to_its_layer() {
    let Some(src) = sources().map(|_| fixture("alias_path")) else {
        return;
    };
    assert_eq!(
        violations(&src),
        [
            "src/base/mod.rs:1: base -> core::stream: crate::stream::Stream",
            "src/base/mod.rs:3: base -> core::stream: crate::Stream",
            "src/base/mod.rs:4: base -> observe::report: super::report::ok",
        ]
    );
}

/// A file no `mod` declares, and a folder that is no layer, are reported.
#[test]
fn a_stray_file_fails() {
    let Some(src) = sources().map(|_| fixture("stray_files")) else {
        return;
    };
    assert_eq!(
        Crate::read(&src).strays(),
        [
            "src/core/orphan.rs: no `mod` declares it",
            "src/tools.rs: in no layer of LAYERS",
        ]
    );
}
