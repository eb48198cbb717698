//! Refuses `drop(name)` of a `buffer!` handle: the handle only borrows the hidden owner, so dropping
//! it releases nothing, and the buffer would look released while it still holds its stack memory.
//! The memory goes back where the owner goes out of scope, at the end of the block that declared
//! the buffer; to release it earlier, the user declares it in an inner block.
//!
//! It reads the body as the user wrote it, before [`Rewriter`] turns it into owners and handles,
//! and replaces each such call's argument with a `compile_error!` spanned on the user's call: an
//! expression of rustc's error type, so the handle is not moved and the rest of the body checks as
//! written.
//!
//! Names are resolved as Rust does for locals, closely enough never to refuse a call that drops
//! something else: a `let` (or a closure parameter, a `match` arm, an `if let`/`while let`/`for`
//! pattern) shadows a buffer's name, and a name bound in a block ends with the block. An item of a
//! block (`const`, `static`, `fn`, a `use`, any item) hides a buffer of an enclosing block in the
//! whole block, before its declaration too; a `let` of the block itself still wins over it, as in
//! Rust. A glob `use` may bring in any name, so it hides every buffer of enclosing blocks.
//!
//! Where the check cannot tell, it does not refuse. Another macro given a name may bind it: a
//! `macro_rules!` such as `pin_mut!(x)` expands to `let x = ..;`, one in statement position may
//! also expand to an item. So after a macro whose tokens mention a name, that name is not known to
//! be a buffer in the macro's scope, nor anywhere in the block of a statement macro (as for an
//! item). A macro that does not mention the name (`println!("done")`) changes nothing.
//!
//! The walk goes where [`Rewriter`] goes, so into closures, and also into the body of a nested
//! `gpu_scope!`, where a drop of an enclosing macro's buffer is reported (and replaced in the
//! nested macro's tokens) by the macro that declared the buffer: each macro reports the drops of
//! its own buffers, at any depth, so each is reported once, and all in one build. It stops at
//! nested items, which cannot name the body's locals, and at other macros, whose tokens it cannot
//! read as Rust.
//!
//! [`Rewriter`]: crate::rewrite::Rewriter

use proc_macro2::{TokenStream, TokenTree};
use quote::quote;
use syn::{Block, Expr, ExprCall, Ident, Item, Macro, Pat, Stmt, UseTree};

use crate::args::ScopeArgs;
use crate::error::{Errors, error_expr};
use crate::rewrite::{declares_buffer, is_buffer, is_gpu_scope};
use crate::walk::{Walk, walk_attrs, walk_block, walk_expr};

/// Replaces every `drop(NAME)` in `block` whose `NAME` is a `buffer!` handle declared by this
/// expansion with its `compile_error!`; returns those errors.
pub(crate) fn check(block: &mut Block) -> Errors {
    let mut check = DropCheck {
        scopes: Vec::new(),
        nested: 0,
        replaced: 0,
        errors: Errors::default(),
    };
    check.block(block);
    check.errors
}

struct Binding {
    /// Unraw, so `r#type` and `type` are one name; `None` for every name (a glob `use`).
    name: Option<String>,
    /// Declared by `let name = buffer!(..)?;` of this expansion (not of a nested `gpu_scope!`, which
    /// checks its own), or moved from such a handle.
    buffer: bool,
}

struct DropCheck {
    /// The bindings in scope, innermost scope last, each in declaration order.
    scopes: Vec<Vec<Binding>>,
    /// How many nested `gpu_scope!`s the walk is in.
    nested: usize,
    /// How many calls were replaced so far.
    replaced: usize,
    errors: Errors,
}

impl DropCheck {
    fn scoped(&mut self, f: impl FnOnce(&mut DropCheck)) {
        self.scopes.push(Vec::new());
        f(self);
        self.scopes.pop();
    }

    /// Binds every name of `pat` in the innermost scope. A name that is in fact a constant or a
    /// unit struct (`None`) is bound too: it can only hide a buffer, never make one up. So is every
    /// name given to a macro in the pattern, which may bind it.
    fn bind(&mut self, pat: &Pat, buffer: bool) {
        let mut names = Vec::new();
        pattern_names(pat, &mut names);
        self.bind_names(names.into_iter().map(Some), buffer);
    }

    fn bind_names(&mut self, names: impl IntoIterator<Item = Option<String>>, buffer: bool) {
        if self.scopes.is_empty() {
            self.scopes.push(Vec::new());
        }
        let scope = self.scopes.last_mut().expect("a scope is open");
        scope.extend(names.into_iter().map(|name| Binding { name, buffer }));
    }

    /// Binds what the items of a block declare, before its first statement: an item is visible
    /// in its whole block, but the block's own `let`s, bound after, still win over it. A macro in
    /// statement position may expand to items, so the names it is given count as declared too.
    fn declare_items(&mut self, stmts: &[Stmt]) {
        let mut names = Vec::new();
        for stmt in stmts {
            match stmt {
                Stmt::Item(item) => item_names(item, &mut names),
                Stmt::Macro(m) => macro_names(&m.mac, &mut names),
                Stmt::Expr(Expr::Macro(m), _) => macro_names(&m.mac, &mut names),
                Stmt::Local(_) | Stmt::Expr(..) => {}
            }
        }
        self.bind_names(names, false);
    }

    /// The binding `name` refers to here, if the body declares it.
    fn resolve(&self, name: &Ident) -> Option<&Binding> {
        let name = unraw(name);
        self.scopes
            .iter()
            .rev()
            .flat_map(|scope| scope.iter().rev())
            .find(|b| b.name.as_ref().is_none_or(|n| *n == name))
    }

    /// The error for `call` if it drops a handle of this expansion.
    fn check_call(&self, call: &ExprCall) -> Option<syn::Error> {
        let callee = drop_fn(&call.func)?;
        // A `drop` or `mem` bound in the body (`fn drop`, `let drop = |..| ..`) is the user's own.
        if let Expr::Path(p) = &*call.func
            && p.path.leading_colon.is_none()
            && self.resolve(&p.path.segments[0].ident).is_some()
        {
            return None;
        }
        let [arg] = call.args.iter().collect::<Vec<_>>()[..] else {
            return None;
        };
        let name = plain_name(arg)?;
        if !self.resolve(name).is_some_and(|b| b.buffer) {
            return None;
        }
        let name = unraw(name);
        Some(syn::Error::new_spanned(
            call,
            format!(
                "`{callee}({name})` does not release a `buffer!`: `{name}` is a handle, and the \
                 memory goes back at the end of the block that declared it; to release it \
                 earlier, declare it in an inner block: `{{ let {name} = buffer!(..)?; .. }}`"
            ),
        ))
    }

    /// Walks a nested `gpu_scope!`'s body; where a drop was replaced, its tokens are rewritten, so
    /// the nested macro expands the replacement.
    fn nested_scope(&mut self, mac: &mut Macro) {
        // A `gpu_scope!` that does not parse reports itself when it expands.
        let Ok(mut args) = mac.parse_body::<ScopeArgs>() else {
            return;
        };
        let before = self.replaced;
        self.nested += 1;
        self.block(&mut args.body);
        self.nested -= 1;
        if self.replaced != before {
            let (stream, body) = (&args.stream, &args.body);
            mac.tokens = quote!(#stream, #body);
        }
    }
}

impl Walk for DropCheck {
    fn block(&mut self, block: &mut Block) {
        self.scoped(|this| {
            this.declare_items(&block.stmts);
            walk_block(this, block);
        });
    }

    fn local(&mut self, local: &mut syn::Local) {
        // The initializer (and `else`) run before the new names exist.
        walk_attrs(self, &mut local.attrs);
        if let Some(init) = &mut local.init {
            self.expr(&mut init.expr);
            if let Some((_, diverge)) = &mut init.diverge {
                self.expr(diverge);
            }
        }
        // `let y = x;` moves a handle to a new name, which is then a handle too.
        let moves_a_handle = local.init.as_ref().is_some_and(|init| {
            init.diverge.is_none()
                && plain_name(&init.expr)
                    .and_then(|name| self.resolve(name))
                    .is_some_and(|b| b.buffer)
        });
        let own_buffer = self.nested == 0 && declares_buffer(local);
        self.bind(&local.pat, own_buffer || moves_a_handle);
    }

    fn expr(&mut self, expr: &mut Expr) {
        match expr {
            Expr::Call(call) => {
                let Some(error) = self.check_call(call) else {
                    return walk_expr(self, expr);
                };
                // The argument becomes the error, spanned on the whole call: the handle is not
                // moved, and the user's `drop` or `mem` stays used, so no lint reports its import.
                let arg = syn::parse2(error_expr(error.clone())).expect("an expression");
                call.args = std::iter::once::<Expr>(arg).collect();
                self.errors.push(error);
                self.replaced += 1;
            }
            Expr::Closure(closure) => self.scoped(|this| {
                for input in &closure.inputs {
                    this.bind(input, false);
                }
                this.expr(&mut closure.body);
            }),
            // An `if let`/`while let` binds in the rest of its condition and in the branch it
            // guards.
            Expr::If(expr) => {
                self.scoped(|this| {
                    this.expr(&mut expr.cond);
                    this.block(&mut expr.then_branch);
                });
                if let Some((_, otherwise)) = &mut expr.else_branch {
                    self.expr(otherwise);
                }
            }
            Expr::While(expr) => self.scoped(|this| {
                this.expr(&mut expr.cond);
                this.block(&mut expr.body);
            }),
            Expr::Let(expr) => {
                self.expr(&mut expr.expr);
                self.bind(&expr.pat, false);
            }
            Expr::ForLoop(expr) => {
                self.expr(&mut expr.expr);
                self.scoped(|this| {
                    this.bind(&expr.pat, false);
                    this.block(&mut expr.body);
                });
            }
            _ => walk_expr(self, expr),
        }
    }

    fn arm(&mut self, arm: &mut syn::Arm) {
        self.scoped(|this| {
            this.bind(&arm.pat, false);
            if let Some((_, guard)) = &mut arm.guard {
                this.expr(guard);
            }
            this.expr(&mut arm.body);
        });
    }

    fn mac(&mut self, mac: &mut Macro) {
        if is_gpu_scope(mac) {
            self.nested_scope(mac);
        } else if !is_buffer(mac) {
            // `pin_mut!(x)` expands to `let x = ..;`: after it, `x` may be something else.
            let mut names = Vec::new();
            mentioned(mac.tokens.clone(), &mut names);
            self.bind_names(names.into_iter().map(Some), false);
        }
    }

    // Nested items are skipped by the walk: they cannot name the body's locals.
}

/// Every name a block item declares, in any namespace: one that is a type or a module cannot be
/// what `drop(x)` drops, but counting it keeps the rule simple and costs nothing a program would
/// write. `None` stands for every name, for what cannot be read: a glob `use`, an item given as
/// tokens.
fn item_names(item: &Item, out: &mut Vec<Option<String>>) {
    let ident = match item {
        Item::Const(i) => &i.ident,
        Item::Enum(i) => &i.ident,
        Item::ExternCrate(i) => i.rename.as_ref().map_or(&i.ident, |(_, rename)| rename),
        Item::Fn(i) => &i.sig.ident,
        Item::Mod(i) => &i.ident,
        Item::Static(i) => &i.ident,
        Item::Struct(i) => &i.ident,
        Item::Trait(i) => &i.ident,
        Item::TraitAlias(i) => &i.ident,
        Item::Type(i) => &i.ident,
        Item::Union(i) => &i.ident,
        Item::ForeignMod(m) => {
            for item in &m.items {
                match item {
                    syn::ForeignItem::Fn(f) => out.push(Some(unraw(&f.sig.ident))),
                    syn::ForeignItem::Static(s) => out.push(Some(unraw(&s.ident))),
                    syn::ForeignItem::Type(t) => out.push(Some(unraw(&t.ident))),
                    syn::ForeignItem::Macro(m) => macro_names(&m.mac, out),
                    _ => out.push(None),
                }
            }
            return;
        }
        Item::Use(u) => return use_names(&u.tree, &mut Vec::new(), out),
        // `macro_rules! name` declares a macro, which `drop(name)` cannot name.
        Item::Macro(m) if m.ident.is_some() => return,
        Item::Macro(m) => return macro_names(&m.mac, out),
        // An `impl` declares nothing in the block's scope.
        Item::Impl(_) => return,
        _ => return out.push(None),
    };
    out.push(Some(unraw(ident)));
}

/// The names a `use` brings into scope. Importing gpu-pool's own spelling of `drop` (`use
/// std::mem;`, `use core::mem::drop;`) hides nothing: `drop(x)` and `mem::drop(x)` still mean it.
fn use_names(tree: &UseTree, path: &mut Vec<String>, out: &mut Vec<Option<String>>) {
    let std_drop = |path: &[String], leaf: &str| {
        let mut full: Vec<&str> = path.iter().map(String::as_str).collect();
        full.push(leaf);
        matches!(
            full[..],
            ["std" | "core", "mem"] | ["std" | "core", "mem", "drop"]
        )
    };
    match tree {
        UseTree::Path(p) => {
            path.push(unraw(&p.ident));
            use_names(&p.tree, path, out);
            path.pop();
        }
        // `use a::b::{self}` brings in `b`.
        UseTree::Name(n) if n.ident == "self" => {
            if let Some((leaf, prefix)) = path.split_last()
                && !std_drop(prefix, leaf)
            {
                out.push(Some(leaf.clone()));
            }
        }
        UseTree::Name(n) if std_drop(path, &unraw(&n.ident)) => {}
        UseTree::Name(n) => out.push(Some(unraw(&n.ident))),
        UseTree::Rename(r) if r.rename == "_" => {}
        UseTree::Rename(r) if std_drop(path, &unraw(&r.ident)) && r.rename == r.ident => {}
        UseTree::Rename(r) => out.push(Some(unraw(&r.rename))),
        UseTree::Glob(_) => out.push(None),
        UseTree::Group(g) => g.items.iter().for_each(|tree| use_names(tree, path, out)),
    }
}

/// What a macro other than gpu-pool's own may declare: every name it is given.
fn macro_names(mac: &Macro, out: &mut Vec<Option<String>>) {
    if is_buffer(mac) || is_gpu_scope(mac) {
        return;
    }
    let mut names = Vec::new();
    mentioned(mac.tokens.clone(), &mut names);
    out.extend(names.into_iter().map(Some));
}

/// Every identifier in `tokens`, unraw, in groups too.
/// Every name `pat` binds, and every name given to a macro in it (`m!(name)` may bind `name`).
/// Walked by hand rather than with syn's `Visit`, whose generic walk was a fifth of this crate's
/// compiled code (issue 34).
fn pattern_names(pat: &Pat, out: &mut Vec<String>) {
    use quote::ToTokens;
    match pat {
        Pat::Ident(p) => {
            out.push(unraw(&p.ident));
            if let Some((_, sub)) = &p.subpat {
                pattern_names(sub, out);
            }
        }
        Pat::Or(p) => p.cases.iter().for_each(|p| pattern_names(p, out)),
        Pat::Paren(p) => pattern_names(&p.pat, out),
        Pat::Reference(p) => pattern_names(&p.pat, out),
        Pat::Slice(p) => p.elems.iter().for_each(|p| pattern_names(p, out)),
        Pat::Tuple(p) => p.elems.iter().for_each(|p| pattern_names(p, out)),
        Pat::TupleStruct(p) => {
            called_macro_names(p.path.to_token_stream(), out);
            p.elems.iter().for_each(|p| pattern_names(p, out));
        }
        Pat::Struct(p) => {
            called_macro_names(p.path.to_token_stream(), out);
            p.fields.iter().for_each(|f| pattern_names(&f.pat, out));
        }
        Pat::Type(p) => {
            pattern_names(&p.pat, out);
            called_macro_names(p.ty.to_token_stream(), out);
        }
        Pat::Macro(p) => mentioned(p.mac.tokens.clone(), out),
        // Literals, ranges, paths, `const` blocks, `_` and `..` bind nothing; a macro in them may.
        other => called_macro_names(other.to_token_stream(), out),
    }
}

/// The names given to each macro called in `tokens` (`m!(..)`, `m![..]`, `m!{..}`); outside
/// them, nothing.
fn called_macro_names(tokens: TokenStream, out: &mut Vec<String>) {
    let tokens: Vec<TokenTree> = tokens.into_iter().collect();
    for (at, token) in tokens.iter().enumerate() {
        match (token, at.checked_sub(1).map(|before| &tokens[before])) {
            (TokenTree::Group(group), Some(TokenTree::Punct(bang))) if bang.as_char() == '!' => {
                let called = at >= 2 && matches!(tokens[at - 2], TokenTree::Ident(_));
                if called {
                    mentioned(group.stream(), out);
                } else {
                    called_macro_names(group.stream(), out);
                }
            }
            (TokenTree::Group(group), _) => called_macro_names(group.stream(), out),
            _ => {}
        }
    }
}

fn mentioned(tokens: TokenStream, out: &mut Vec<String>) {
    for token in tokens {
        match token {
            TokenTree::Ident(ident) => out.push(unraw(&ident)),
            TokenTree::Group(group) => mentioned(group.stream(), out),
            TokenTree::Punct(_) | TokenTree::Literal(_) => {}
        }
    }
}

/// The path as written when `func` names `drop`: `drop`, `mem::drop`, or `std::mem::drop` and
/// `core::mem::drop`, either with a leading `::`.
fn drop_fn(func: &Expr) -> Option<String> {
    let Expr::Path(path) = func else {
        return None;
    };
    if path.qself.is_some() {
        return None;
    }
    let path = &path.path;
    if path.segments.iter().any(|s| !s.arguments.is_none()) {
        return None;
    }
    let idents: Vec<String> = path.segments.iter().map(|s| unraw(&s.ident)).collect();
    let idents: Vec<&str> = idents.iter().map(String::as_str).collect();
    let ok = match idents[..] {
        ["drop"] | ["mem", "drop"] => path.leading_colon.is_none(),
        ["std" | "core", "mem", "drop"] => true,
        _ => false,
    };
    ok.then(|| {
        let written = idents.join("::");
        if path.leading_colon.is_some() {
            format!("::{written}")
        } else {
            written
        }
    })
}

/// `NAME` in `NAME`, `(NAME)`: a single identifier.
fn plain_name(expr: &Expr) -> Option<&Ident> {
    match expr {
        Expr::Path(p) if p.qself.is_none() && p.attrs.is_empty() => p.path.get_ident(),
        Expr::Paren(p) => plain_name(&p.expr),
        Expr::Group(g) => plain_name(&g.expr),
        _ => None,
    }
}

fn unraw(ident: &Ident) -> String {
    syn::ext::IdentExt::unraw(ident).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pattern_binds_its_names_and_those_given_to_its_macros() {
        let names = |pat: proc_macro2::TokenStream| {
            let Ok(Stmt::Local(local)) = syn::parse2(quote!(let #pat = 0;)) else {
                panic!("a let");
            };
            let mut names = Vec::new();
            pattern_names(&local.pat, &mut names);
            names
        };
        assert_eq!(
            names(quote!(
                (a, ref mut b @ Some(c), S { d, e: [f, ..], .. }, &(g | g), None)
            )),
            ["a", "b", "c", "d", "f", "g", "g", "None"]
        );
        // Every name given to a macro, in the pattern or in its type; not the macro's own path,
        // nor the names of a path, a literal or a `!=` in a constant.
        assert_eq!(names(quote!(m!(h, i::j))), ["h", "i", "j"]);
        assert_eq!(
            names(quote!((k, l): (ty!(x), Vec<n!{y}>))),
            ["k", "l", "x", "y"]
        );
        assert_eq!(names(quote!(T::<z!(w)> { v })), ["w", "v"]);
        assert_eq!(names(quote!(const { A != B })), Vec::<String>::new());
        assert_eq!(names(quote!(r#type)), ["type"]);
    }

    fn messages(body: proc_macro2::TokenStream) -> Vec<String> {
        let mut block: Block = syn::parse2(body).expect("a block");
        match check(&mut block).finish() {
            Ok(()) => Vec::new(),
            Err(e) => e.into_iter().map(|e| e.to_string()).collect(),
        }
    }

    fn refused(body: proc_macro2::TokenStream) -> Vec<String> {
        messages(body)
            .iter()
            .map(|m| m.split(' ').next().unwrap_or_default().to_owned())
            .collect()
    }

    #[test]
    fn every_spelling_of_drop_is_refused() {
        let found = refused(quote::quote!({
            let x = buffer!(8; u8)?;
            drop(x);
            std::mem::drop(x);
            core::mem::drop(x);
            ::std::mem::drop(x);
            mem::drop((x));
            drop(r#x);
        }));
        assert_eq!(
            found,
            [
                "`drop(x)`",
                "`std::mem::drop(x)`",
                "`core::mem::drop(x)`",
                "`::std::mem::drop(x)`",
                "`mem::drop(x)`",
                "`drop(x)`",
            ]
        );
    }

    #[test]
    fn a_handle_moved_to_another_name_is_still_a_handle() {
        let found = refused(quote::quote!({
            let x = buffer!(8; u8)?;
            let y = x;
            let mut z = (y);
            drop(z);
            let v = vec![1];
            let w = v;
            drop(w);
        }));
        assert_eq!(found, ["`drop(z)`"]);
    }

    #[test]
    fn the_message_says_how_to_end_a_buffer_early() {
        let found = messages(quote::quote!({
            let t = buffer!(8; u8).unwrap();
            drop(t);
        }));
        assert_eq!(
            found,
            [
                "`drop(t)` does not release a `buffer!`: `t` is a handle, and the memory goes back at \
              the end of the block that declared it; to release it earlier, declare it in an inner \
              block: `{ let t = buffer!(..)?; .. }`"
            ]
        );
    }

    #[test]
    fn outer_buffers_are_seen_in_inner_blocks_closures_and_nested_scopes() {
        let found = refused(quote::quote!({
            let x = buffer!(8; u8)?;
            {
                drop(x);
            }
            let f = || drop(x);
            if ok {
                match y {
                    _ => drop(x),
                }
            }
            gpu_scope!(other, {
                drop(x);
                let z = buffer!(8; u8)?;
                drop(z); // the nested scope's own: it reports this one when it expands
                let w = x;
                drop(w);
            });
        }));
        assert_eq!(found.len(), 5, "{found:?}");
    }

    #[test]
    fn each_refused_drop_is_replaced_where_it_stands() {
        let mut block: Block = syn::parse2(quote::quote!({
            let x = buffer!(8; u8)?;
            drop(x);
            gpu_scope!(other, {
                let z = buffer!(8; u8)?;
                drop(x);
                drop(z);
            });
            x.len()
        }))
        .expect("a block");
        let errors = check(&mut block).finish().expect_err("two refused drops");
        assert_eq!(errors.into_iter().count(), 2);
        let text = quote::ToTokens::to_token_stream(&block).to_string();
        assert_eq!(
            text.matches("drop (:: core :: compile_error !").count(),
            2,
            "{text}"
        );
        assert!(!text.contains("drop (x)"), "{text}");
        // The nested scope keeps its own drop, which it reports when it expands.
        assert!(text.contains("drop (z)"), "{text}");
        assert!(text.ends_with("x . len () }"), "{text}");
    }

    #[test]
    fn shadowed_and_ended_names_are_not_buffers() {
        let found = messages(quote::quote!({
            let v = vec![1];
            {
                let v = buffer!(8; u8)?;
            }
            drop(v); // the vec: the buffer ended with its block
            let x = buffer!(8; u8)?;
            let g = |x: Vec<u8>| drop(x);
            if let Some(x) = opt {
                drop(x);
            }
            match opt {
                Some(x) => drop(x),
                None => {}
            }
            for x in xs {
                drop(x);
            }
            while let Some(x) = it.next() {
                drop(x);
            }
            fn nested(x: Vec<u8>) {
                drop(x);
            }
            drop(x.clone());
            drop(other::drop);
            my::drop(x);
            std::mem::forget(x);
            let x = vec![2];
            drop(x);
        }));
        assert!(found.is_empty(), "{found:?}");
    }

    #[test]
    fn a_buffer_that_does_not_expand_is_not_a_buffer() {
        let found = messages(quote::quote!({
            let x = buffer!(8; u8);
            drop(x);
            let Some(y) = buffer!(8; u8)? else { return };
            drop(y);
        }));
        assert!(found.is_empty(), "{found:?}");
    }

    #[test]
    fn a_macro_given_the_name_may_rebind_it_from_there_on() {
        let found = messages(quote::quote!({
            let x = buffer!(8; u8)?;
            rebind!(x); // `let x = something_else;`, as `pin_mut!` expands
            drop(x);
            let y = buffer!(8; u8)?;
            let n = format!("{}", other);
            println!("done");
            drop(y); // refused: no macro was given `y`
            let z = buffer!(8; u8)?;
            drop(z); // refused: the macro comes after, and a `let` of this block beats its items
            pin_mut!(z);
            let w = buffer!(8; u8)?;
            {
                rebind!(w);
            }
            drop(w); // refused: what the macro bound ended with its block
            let v = buffer!(8; u8)?;
            let len = take!(v.len());
            drop(v);
            let u = buffer!(8; u8)?;
            if let some!(u) = opt {
                drop(u); // `some!(u)` may bind `u`
            }
        }));
        let refused: Vec<_> = found.iter().map(|m| &m[..9]).collect();
        assert_eq!(
            refused,
            ["`drop(y)`", "`drop(z)`", "`drop(w)`"],
            "{found:?}"
        );
    }

    #[test]
    fn an_item_of_a_block_hides_outer_buffers_in_the_whole_block() {
        let found = messages(quote::quote!({
            let x = buffer!(8; u8)?;
            {
                const x: u32 = 3;
                drop(x);
            }
            {
                static r#x: u32 = 3;
                drop(x);
            }
            {
                drop(x);
                fn x() {}
            }
            {
                drop(x);
                declare!(x); // may expand to `fn x() {}`
            }
            {
                use values::*;
                drop(x);
            }
            {
                use values::{other, y as x};
                drop(x);
            }
            {
                extern "C" {
                    fn x();
                }
                drop(x);
            }
            {
                fn drop<T>(_: T) {}
                drop(x); // the user's own `drop`
            }
            {
                use std::mem::{self, drop};
                drop(x); // refused: still std's
                mem::drop(x); // refused
            }
            drop(x); // refused: every item ended with its block
            let y = buffer!(8; u8)?;
            fn y() {}
            drop(y); // refused: a `let` beats an item of its own block
        }));
        let refused: Vec<_> = found.iter().map(|m| m.split(' ').next().unwrap()).collect();
        assert_eq!(
            refused,
            ["`drop(x)`", "`mem::drop(x)`", "`drop(x)`", "`drop(y)`"],
            "{found:?}"
        );
    }
}
