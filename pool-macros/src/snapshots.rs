//! Expansion snapshots: each `tests/expand/NAME.rs` at the workspace root is expanded (its
//! `#[pooled]` functions and `gpu_scope!` calls) and compared with `NAME.expanded.rs`. Set
//! `GPU_POOL_BLESS=1` to write the expected files after reviewing a change.

use std::path::PathBuf;

use crate::walk::{Walk, walk_expr, walk_stmt};
use proc_macro2::TokenStream;
use quote::ToTokens;

/// Expands the macros of one file, outermost first, as the compiler does. Items are reached in
/// modules, `impl` blocks and function bodies: where the snapshot inputs put them.
struct Expand;

impl Expand {
    fn item(&mut self, item: &mut syn::Item) {
        match item {
            syn::Item::Fn(f) => {
                if let Some(args) = take_pooled(&mut f.attrs) {
                    *f = expanded(args, &*f);
                }
                self.block(&mut f.block);
            }
            syn::Item::Impl(i) => {
                for item in &mut i.items {
                    if let syn::ImplItem::Fn(f) = item {
                        if let Some(args) = take_pooled(&mut f.attrs) {
                            *f = expanded(args, &*f);
                        }
                        self.block(&mut f.block);
                    }
                }
            }
            syn::Item::Mod(m) => {
                for item in m.content.iter_mut().flat_map(|(_, items)| items) {
                    self.item(item);
                }
            }
            _ => {}
        }
    }
}

impl Walk for Expand {
    fn expr(&mut self, e: &mut syn::Expr) {
        if let syn::Expr::Macro(m) = e
            && m.mac.path.is_ident("gpu_scope")
        {
            *e = syn::parse2(crate::expand::gpu_scope(m.mac.tokens.clone()))
                .expect("the expansion is a block");
        }
        walk_expr(self, e);
    }

    fn stmt(&mut self, s: &mut syn::Stmt) {
        if let syn::Stmt::Macro(m) = s
            && m.mac.path.is_ident("gpu_scope")
        {
            let block: syn::Expr = syn::parse2(crate::expand::gpu_scope(m.mac.tokens.clone()))
                .expect("the expansion is a block");
            *s = syn::Stmt::Expr(block, m.semi_token);
        }
        match s {
            syn::Stmt::Item(item) => self.item(item),
            _ => walk_stmt(self, s),
        }
    }
}

/// Removes `#[pooled(..)]` from `attrs`, returning its arguments.
fn take_pooled(attrs: &mut Vec<syn::Attribute>) -> Option<TokenStream> {
    let i = attrs.iter().position(|a| a.path().is_ident("pooled"))?;
    match attrs.remove(i).meta {
        syn::Meta::List(list) => Some(list.tokens),
        _ => Some(TokenStream::new()),
    }
}

/// What `#[pooled(args)]` makes of `f` (a function or a method).
fn expanded<F: ToTokens + syn::parse::Parse>(args: TokenStream, f: &F) -> F {
    syn::parse2(crate::expand::pooled(args, f.to_token_stream())).expect("the expansion parses")
}

#[test]
fn expansions_match_their_snapshots() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/expand");
    if std::env::var_os("CARGO").is_none() && !dir.exists() {
        eprintln!(
            "snapshots: skipped: {} is not here (test binary run outside its checkout)",
            dir.display()
        );
        return;
    }
    let bless = std::env::var_os("GPU_POOL_BLESS").is_some();
    let mut checked = 0;
    let mut entries: Vec<_> = std::fs::read_dir(&dir)
        .expect("tests/expand exists")
        .flatten()
        .collect();
    entries.sort_by_key(|e| e.path());
    for entry in entries {
        let path = entry.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_owned();
        if !name.ends_with(".rs") || name.ends_with(".expanded.rs") {
            continue;
        }
        let source = std::fs::read_to_string(&path).expect("readable");
        let mut file = syn::parse_file(&source).expect("the input parses");
        file.items.iter_mut().for_each(|item| Expand.item(item));
        let expanded = prettyplease::unparse(&file);
        let expected_path = path.with_extension("expanded.rs");
        if bless {
            std::fs::write(&expected_path, &expanded).expect("writable");
        } else {
            let expected = std::fs::read_to_string(&expected_path).unwrap_or_else(|_| {
                panic!(
                    "{} is missing: run with GPU_POOL_BLESS=1",
                    expected_path.display()
                )
            });
            assert_eq!(
                expanded, expected,
                "{name} expands differently; review, then GPU_POOL_BLESS=1"
            );
        }
        checked += 1;
    }
    assert!(
        checked >= 3,
        "expected the snapshot inputs in {}",
        dir.display()
    );
}
