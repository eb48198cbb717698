//! Rewrites `let NAME = buffer!(..)?;` statements of a body into an owner and a handle.
//!
//! Each block is rewritten statement by statement, so an owner is declared exactly where the user's
//! `let` stands and dropped where the user's name would go out of scope: at the end of its block, of
//! each loop iteration, or on any early exit. The walk descends into every expression that runs in
//! the same call (blocks, `if`, `match`, loops, closures) and stops at nested items, whose bodies
//! run elsewhere, and at macro calls, whose tokens are not Rust yet (a nested `gpu_scope!` rewrites
//! its own body). Async code and constants (`const { .. }`, array lengths, const generic arguments)
//! are not rewritten: the DSL there is refused on the user's tokens.
//!
//! Only gpu-pool's macros are touched: `buffer!` and `gpu_scope!` by their bare names or by a path
//! into gpu-pool ([`is_ours`]). A user's own macro of the same name, called by another path, is
//! left as written.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Block, Expr, Ident, Local, Macro, Stmt};

use crate::args::BufferArgs;
use crate::error::error_expr;
use crate::walk::{Walk, walk_expr, walk_generic_argument, walk_stmt, walk_type};

/// The name of a scope's hidden local; mixed-site hygiene keeps user code from naming it.
pub(crate) fn scope_ident() -> Ident {
    Ident::new("__gpu_pool_scope", Span::mixed_site())
}

/// Rewrites the DSL of one body in place. A `buffer!` that cannot be rewritten is replaced, where
/// it stands, by its `compile_error!`: an expression of rustc's error type, so the user's code
/// around it is kept and checked, and every mistake of the body is reported in one build.
pub(crate) struct Rewriter {
    scope: Ident,
    next_owner: usize,
}

impl Rewriter {
    pub(crate) fn new() -> Rewriter {
        Rewriter {
            scope: scope_ident(),
            next_owner: 0,
        }
    }

    /// The owner and handle statements for `let PAT = buffer!(ARGS) POSTFIX;`.
    fn expand_let(
        &mut self,
        local: &Local,
        mac: &Macro,
        postfix: &Postfix,
    ) -> syn::Result<[Stmt; 2]> {
        let args: BufferArgs = mac.parse_body()?;
        // The owner takes the user's name where there is one, shadowed at once by the handle: a
        // borrow error then reads "`name` does not live long enough" at the user's `buffer!`.
        // Cloned, not rebuilt from its text, so a raw name (`r#type`) stays raw.
        let span = Span::mixed_site().located_at(mac.span());
        let owner = match &local.pat {
            syn::Pat::Ident(p) if p.subpat.is_none() => {
                let mut owner = p.ident.clone();
                owner.set_span(span);
                owner
            }
            _ => format_ident!("__gpu_pool_owner_{}", self.next_owner, span = span),
        };
        self.next_owner += 1;
        let scope = &self.scope;
        let elem = &args.elem;
        // The sizes are evaluated, and their temporaries dropped, before the buffer is taken: a
        // temporary buffer in a size expression would otherwise be released after this one, out of
        // LIFO order. Typed `usize`, so a size of another type is reported on the user's tokens.
        let sizes: Vec<Ident> = (0..args.sizes.len())
            .map(|i| format_ident!("__gpu_pool_size_{}", i, span = span))
            .collect();
        let size_exprs = &args.sizes;
        // The name reports and errors give the buffer (`r#type` reads `type`); `_` for a pattern.
        let name = match &local.pat {
            syn::Pat::Ident(p) => syn::ext::IdentExt::unraw(&p.ident).to_string(),
            _ => "_".to_string(),
        };
        // Spanned on the user's `buffer!`, so a bad element type is reported there, and so the
        // call's `#[track_caller]` location is the user's line.
        let take = match sizes.as_slice() {
            [len] => quote_spanned!(mac.span()=>
                ::gpu_pool::__private::take_1d::<#elem>(&#scope, #len, #name)
            ),
            [rows, cols] if args.packed => quote_spanned!(mac.span()=>
                ::gpu_pool::__private::take_packed::<#elem>(&#scope, #rows, #cols, #name)
            ),
            [rows, cols] => quote_spanned!(mac.span()=>
                ::gpu_pool::__private::take::<#elem>(&#scope, #rows, #cols, #name)
            ),
            _ => unreachable!("BufferArgs holds one or two sizes"),
        };
        let postfix = postfix.tokens();
        // The user's attributes (`#[cfg(..)]`, lints) apply to the whole buffer: the owner that
        // takes it and the handle alike, so a buffer disabled by `cfg` is not taken.
        let attrs = &local.attrs;
        let pat = &local.pat;
        let owner_stmt: Stmt = syn::parse2(quote_spanned! {mac.span()=>
            #(#attrs)*
            let mut #owner = {
                #(let #sizes: usize = #size_exprs;)*
                #take
            } #postfix;
        })?;
        // Spanned on `buffer!` too: a borrow error about the handle points at the user's line.
        let handle = quote_spanned!(mac.span()=> ::gpu_pool::__private::handle(&mut #owner));
        let handle_stmt: Stmt = syn::parse2(quote! { #(#attrs)* let #pat = #handle; })?;
        Ok([owner_stmt, handle_stmt])
    }
}

/// What follows `buffer!(..)` in its `let`: the user's own error handling, kept as written.
enum Postfix {
    Try(syn::Token![?]),
    Method(syn::ExprMethodCall),
}

impl Postfix {
    fn tokens(&self) -> TokenStream {
        match self {
            Postfix::Try(q) => quote!(#q),
            Postfix::Method(m) => {
                let (dot, method, paren_args) = (&m.dot_token, &m.method, &m.args);
                quote!(#dot #method (#paren_args))
            }
        }
    }
}

/// gpu-pool's `buffer!` (see [`is_ours`]).
pub(crate) fn is_buffer(mac: &Macro) -> bool {
    is_ours(mac, "buffer")
}

/// Whether `mac` calls gpu-pool's macro `name`: by its bare name, as `use gpu_pool::buffer` and the
/// prelude import it, or by a path into gpu-pool (`gpu_pool::NAME`, `gpu_pool::prelude::NAME`,
/// either with a leading `::`). Any other path that ends in `name` (`bytes::buffer!`,
/// `crate::util::buffer!`) calls a macro of the user's: it is left alone, to expand as written.
fn is_ours(mac: &Macro, name: &str) -> bool {
    let path = &mac.path;
    let idents: Vec<&Ident> = path.segments.iter().map(|s| &s.ident).collect();
    match idents.as_slice() {
        [last] => path.leading_colon.is_none() && *last == name,
        [krate, last] => *krate == "gpu_pool" && *last == name,
        [krate, module, last] => *krate == "gpu_pool" && *module == "prelude" && *last == name,
        _ => false,
    }
}

fn as_buffer(expr: &Expr) -> Option<&Macro> {
    match expr {
        Expr::Macro(m) if is_buffer(&m.mac) => Some(&m.mac),
        _ => None,
    }
}

/// Splits a `let` initializer into `buffer!` and what follows it; `Some(Err)` for a `buffer!` in a
/// form that cannot be rewritten.
fn split_init(init: &Expr) -> Option<Result<(&Macro, Postfix), &Macro>> {
    match init {
        Expr::Try(t) => as_buffer(&t.expr).map(|m| Ok((m, Postfix::Try(t.question_token)))),
        Expr::MethodCall(m) if m.method == "unwrap" || m.method == "expect" => {
            as_buffer(&m.receiver).map(|mac| Ok((mac, Postfix::Method(m.clone()))))
        }
        other => as_buffer(other).map(Err),
    }
}

/// Whether `local` is a `let` this rewriter turns into an owner and a handle: its names then bind
/// the handle.
pub(crate) fn declares_buffer(local: &Local) -> bool {
    local
        .init
        .as_ref()
        .is_some_and(|init| init.diverge.is_none() && matches!(split_init(&init.expr), Some(Ok(_))))
}

const NOT_A_LET: &str = "`buffer!` must be the whole initializer of a `let`: write \
                         `let name = buffer!(..)?;` so the buffer lives exactly as long as `name`";

const LET_ELSE: &str =
    "`buffer!` cannot be used in `let .. else`: write `let name = buffer!(..)?;`";

const UNHANDLED: &str = "`buffer!` returns `Result<_, PoolError>`: handle the error where the \
                         buffer is taken, `let name = buffer!(..)?;` (or `.unwrap()` / \
                         `.expect(..)`)";

/// Turns `mac` into `::core::compile_error!(message)`, spanned as the user wrote it.
fn into_compile_error(mac: &mut Macro, message: &str) {
    let span = mac.path.span();
    mac.path = syn::parse_quote_spanned!(span=> ::core::compile_error);
    mac.tokens = quote_spanned!(mac.delimiter.span().join()=> #message);
}

impl Walk for Rewriter {
    fn block(&mut self, block: &mut Block) {
        let stmts = std::mem::take(&mut block.stmts);
        let mut owners = false;
        for mut stmt in stmts {
            if let Stmt::Local(local) = &mut stmt
                && let Some(init) = &local.init
                && let Some(split) = split_init(&init.expr)
            {
                let error = match split {
                    _ if init.diverge.is_some() => syn::Error::new_spanned(&init.expr, LET_ELSE),
                    Ok((mac, postfix)) => match self.expand_let(local, mac, &postfix) {
                        Ok(pair) => {
                            block.stmts.extend(pair);
                            owners = true;
                            continue;
                        }
                        Err(e) => e,
                    },
                    Err(mac) => syn::Error::new_spanned(mac, UNHANDLED),
                };
                // The user's `let` stays, its names bound to the error, which reports nothing
                // further where they are used.
                if let Some(init) = &mut local.init {
                    *init.expr = syn::parse2(error_expr(error)).expect("an expression");
                }
            }
            self.stmt(&mut stmt);
            block.stmts.push(stmt);
        }
        if owners {
            drop_tail_temporaries_first(block);
        }
    }

    fn stmt(&mut self, stmt: &mut Stmt) {
        match stmt {
            Stmt::Macro(m) => {
                if is_buffer(&m.mac) {
                    into_compile_error(&mut m.mac, NOT_A_LET);
                }
            }
            // Nested items are skipped by the walk: a nested item runs in its own call, with no
            // scope, and a `buffer!` there reports itself.
            _ => walk_stmt(self, stmt),
        }
    }

    fn expr(&mut self, expr: &mut Expr) {
        match expr {
            Expr::Macro(m) if is_buffer(&m.mac) => into_compile_error(&mut m.mac, NOT_A_LET),
            // Reported in place, so the rest of the function still expands: a stub body could not
            // stand in for a function that returns the future (`impl Future`).
            Expr::Async(a) => refuse_dsl_in(&mut a.block, Refusal::Async("an `async` block")),
            Expr::Closure(c) if c.asyncness.is_some() => {
                refuse_dsl_in_expr(&mut c.body, Refusal::Async("an `async` closure"));
            }
            Expr::Repeat(r) => {
                self.expr(&mut r.expr);
                refuse_dsl_in_expr(&mut r.len, Refusal::Const("an array length"));
            }
            _ => walk_expr(self, expr),
        }
    }

    // Constants in the body are evaluated at compile time, where the scope, a local, does not
    // exist: rewritten, their `buffer!`s would fail with rustc's E0435 on the attribute. Each is
    // refused on the user's tokens instead (an array length above, too). Constant *items* are
    // nested items, which the walk skips.

    fn expr_const(&mut self, c: &mut syn::ExprConst) {
        refuse_dsl_in(&mut c.block, Refusal::Const("a `const` block"));
    }

    fn ty(&mut self, ty: &mut syn::Type) {
        match ty {
            syn::Type::Array(t) => {
                self.ty(&mut t.elem);
                refuse_dsl_in_expr(&mut t.len, Refusal::Const("an array length"));
            }
            _ => walk_type(self, ty),
        }
    }

    fn generic_argument(&mut self, arg: &mut syn::GenericArgument) {
        let why = Refusal::Const("a const generic argument");
        match arg {
            syn::GenericArgument::Const(e) => refuse_dsl_in_expr(e, why),
            syn::GenericArgument::AssocConst(a) => refuse_dsl_in_expr(&mut a.value, why),
            _ => walk_generic_argument(self, arg),
        }
    }

    // Other macros are left as written: their tokens are not Rust yet, and a nested `gpu_scope!`
    // rewrites its own body.
}

/// Gives a block edition 2024's drop order for its tail: the tail's temporaries are dropped before
/// the block's locals. Under edition 2021 (decided by the span of the block's braces) they outlive
/// the locals, so a temporary buffer in the tail would be released after the owners declared in
/// the block, out of LIFO order. The braces keep their place, so diagnostics still point at them;
/// only their hygiene, and with it their edition, becomes this crate's. Unlike binding the tail to
/// a local, this adds no code after a tail that diverges, so no `unreachable_code` warning. (Lints
/// that skip macro output, such as clippy's `never_loop`, then skip such a block too.)
fn drop_tail_temporaries_first(block: &mut Block) {
    let braces = block.brace_token.span.join();
    block.brace_token = syn::token::Brace(Span::mixed_site().located_at(braces));
}

/// gpu-pool's `gpu_scope!` (see [`is_ours`]).
pub(crate) fn is_gpu_scope(mac: &Macro) -> bool {
    is_ours(mac, "gpu_scope")
}

/// Where in a rewritten body the DSL cannot stand, and why.
#[derive(Clone, Copy)]
enum Refusal {
    /// Async code, named: "an `async` block".
    Async(&'static str),
    /// A constant, named: "a `const` block", "an array length".
    Const(&'static str),
}

impl Refusal {
    fn message(self, mac: &Macro) -> String {
        let name = if is_buffer(mac) {
            "buffer!"
        } else {
            "gpu_scope!"
        };
        match self {
            Refusal::Async(context) => format!(
                "`{name}` cannot be used inside {context}: a future can be suspended, dropped or \
                 forgotten at any `.await`, so its buffers would not be released in order; take \
                 buffers in the synchronous code around it"
            ),
            Refusal::Const(context) => format!(
                "`{name}` cannot be used inside {context}: a constant is evaluated at compile time, \
                 and buffers are taken from a stream at run time; take buffers in the code around it"
            ),
        }
    }
}

/// Turns every `buffer!` and `gpu_scope!` in `block` (outside nested items) into a
/// `compile_error!` on the user's tokens saying why it cannot be used there.
fn refuse_dsl_in(block: &mut Block, why: Refusal) {
    Refuse(why).block(block);
}

/// [`refuse_dsl_in`] for an expression.
fn refuse_dsl_in_expr(expr: &mut Expr, why: Refusal) {
    Refuse(why).expr(expr);
}

/// Refuses every macro of ours it reaches: in expressions, statements, patterns and types alike.
struct Refuse(Refusal);

impl Walk for Refuse {
    fn mac(&mut self, mac: &mut Macro) {
        if is_buffer(mac) || is_gpu_scope(mac) {
            let message = self.0.message(mac);
            into_compile_error(mac, &message);
        }
    }
}

/// The first `.await` in `tokens`, at any depth, macro arguments included: inside a scope it would
/// suspend a future that holds the scope's buffers.
pub(crate) fn find_await(tokens: TokenStream) -> Option<TokenStream> {
    let mut previous: Option<proc_macro2::Punct> = None;
    for token in tokens {
        match &token {
            proc_macro2::TokenTree::Ident(ident) if ident == "await" => {
                if let Some(dot) = previous.take().filter(|p| p.as_char() == '.') {
                    return Some(quote!(#dot #ident));
                }
            }
            proc_macro2::TokenTree::Group(group) => {
                if let Some(found) = find_await(group.stream()) {
                    return Some(found);
                }
            }
            _ => {}
        }
        previous = match token {
            proc_macro2::TokenTree::Punct(p) => Some(p),
            _ => None,
        };
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::walk::Walk;

    fn rewritten(body: TokenStream) -> String {
        let mut block: Block = syn::parse2(body).expect("a block");
        Rewriter::new().block(&mut block);
        quote::ToTokens::to_token_stream(&block).to_string()
    }

    // Pins where the walk goes in types, patterns and attributes, which no UI test compiles.
    #[test]
    fn constants_are_refused_wherever_they_stand_and_other_macros_are_left() {
        let text = rewritten(quote!({
            let a: [u8; buffer!(1; u8)] = x;
            let b = x as Foo<{ gpu_scope!(s, {}) }>;
            let c = f::<[u8; buffer!(2; u8)]>();
            let d = |x: [u8; buffer!(3; u8)]| x;
            match x {
                const { buffer!(4; u8) } => {}
                _ => {}
            }
            let e: ty!(buffer!(5; u8)) = x;
            let f: Vec<buffer!(6; u8)> = x;
            let buffer!(7; u8) = x;
            #[doc = buffer!(8; u8)]
            let g = 1;
            fn nested() {
                let h: [u8; buffer!(9; u8)] = x;
            }
        }));
        let count = |what: &str| text.matches(what).count();
        assert_eq!(count("`buffer!` cannot be used inside an array length"), 3);
        assert_eq!(
            count("`gpu_scope!` cannot be used inside a const generic"),
            1
        );
        assert_eq!(count("`buffer!` cannot be used inside a `const` block"), 1);
        assert_eq!(count("must be the whole initializer"), 1, "{text}");
        // Another macro's tokens, a type or pattern macro, a nested item: left as written.
        for left in ["(5 ; u8)", "(6 ; u8)", "(7 ; u8)", "(9 ; u8)"] {
            assert!(text.contains(&format!("buffer ! {left}")), "{left}: {text}");
        }
    }
}
