//! Rewrites `let NAME = buffer!(..)?;` statements of a body into an owner and a handle.
//!
//! Each block is rewritten statement by statement, so an owner is declared exactly where the user's
//! `let` stands and dropped where the user's name would go out of scope: at the end of its block, of
//! each loop iteration, or on any early exit. The walk descends into every expression that runs in
//! the same call (blocks, `if`, `match`, loops, closures) and stops at nested items, whose bodies
//! run elsewhere, and at macro calls, whose tokens are not Rust yet (a nested `gpu_scope!` rewrites
//! its own body).

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::visit_mut::{self, VisitMut};
use syn::{Block, Expr, Ident, Local, Macro, Stmt};

use crate::args::BufferArgs;
use crate::error::Errors;

/// The name of a frame's hidden local; mixed-site hygiene keeps user code from naming it.
pub(crate) fn frame_ident() -> Ident {
    Ident::new("__gpu_pool_frame", Span::mixed_site())
}

pub(crate) struct Rewriter {
    frame: Ident,
    next_owner: usize,
    pub(crate) errors: Errors,
}

impl Rewriter {
    pub(crate) fn new() -> Rewriter {
        Rewriter {
            frame: frame_ident(),
            next_owner: 0,
            errors: Errors::default(),
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
        let span = Span::mixed_site().located_at(mac.span());
        let owner = match &local.pat {
            syn::Pat::Ident(p) if p.subpat.is_none() => Ident::new(&p.ident.to_string(), span),
            _ => format_ident!("__gpu_pool_owner_{}", self.next_owner, span = span),
        };
        self.next_owner += 1;
        let frame = &self.frame;
        let elem = &args.elem;
        // Spanned on the user's `buffer!`, so a bad size or element type is reported there.
        let take = match args.sizes.as_slice() {
            [len] => quote_spanned!(mac.span()=> #frame.take_1d::<#elem>(#len)),
            [rows, cols] => quote_spanned!(mac.span()=> #frame.take::<#elem>(#rows, #cols)),
            _ => unreachable!("BufferArgs holds one or two sizes"),
        };
        let postfix = postfix.tokens();
        let attrs = &local.attrs;
        let pat = &local.pat;
        let owner_stmt: Stmt =
            syn::parse2(quote_spanned! {mac.span()=> let mut #owner = #take #postfix; })?;
        // Spanned on `buffer!` too: a borrow error about the handle points at the user's line.
        let handle = quote_spanned!(mac.span()=> #owner.handle());
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

/// `buffer!`, `gpu_pool::buffer!` or `::gpu_pool::buffer!`.
fn is_buffer(mac: &Macro) -> bool {
    mac.path
        .segments
        .last()
        .is_some_and(|s| s.ident == "buffer")
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

const NOT_A_LET: &str = "`buffer!` must be the whole initializer of a `let`: write \
                         `let name = buffer!(..)?;` so the buffer lives exactly as long as `name`";

impl VisitMut for Rewriter {
    fn visit_block_mut(&mut self, block: &mut Block) {
        let stmts = std::mem::take(&mut block.stmts);
        for mut stmt in stmts {
            if let Stmt::Local(local) = &stmt
                && let Some(init) = &local.init
                && let Some(split) = split_init(&init.expr)
            {
                match split {
                    _ if init.diverge.is_some() => self.errors.push_at(
                        &init.expr,
                        "`buffer!` cannot be used in `let .. else`: write `let name = buffer!(..)?;`",
                    ),
                    Ok((mac, postfix)) => match self.expand_let(local, mac, &postfix) {
                        Ok(pair) => {
                            block.stmts.extend(pair);
                            continue;
                        }
                        Err(e) => self.errors.push(e),
                    },
                    Err(mac) => self.errors.push_at(
                        mac,
                        "`buffer!` returns `Result<_, PoolError>`: handle the error where the buffer is \
                         taken, `let name = buffer!(..)?;` (or `.unwrap()` / `.expect(..)`)",
                    ),
                }
                continue;
            }
            self.visit_stmt_mut(&mut stmt);
            block.stmts.push(stmt);
        }
    }

    fn visit_expr_mut(&mut self, expr: &mut Expr) {
        match expr {
            Expr::Macro(m) if is_buffer(&m.mac) => self.errors.push_at(&m.mac, NOT_A_LET),
            Expr::Async(a) => {
                if let Some(mac) = find_buffer(&a.block) {
                    self.errors.push_at(
                        mac,
                        "`buffer!` cannot be used inside an `async` block: a future can be dropped at \
                         any time, so its buffers would not be released in order",
                    );
                }
            }
            Expr::Closure(c) if c.asyncness.is_some() => {
                if let Some(mac) = find_buffer_in_expr(&c.body) {
                    self.errors.push_at(
                        mac,
                        "`buffer!` cannot be used inside an `async` closure: its future can be dropped \
                         at any time, so its buffers would not be released in order",
                    );
                }
            }
            _ => visit_mut::visit_expr_mut(self, expr),
        }
    }

    fn visit_stmt_macro_mut(&mut self, stmt: &mut syn::StmtMacro) {
        if is_buffer(&stmt.mac) {
            self.errors.push_at(&stmt.mac, NOT_A_LET);
        }
    }

    fn visit_item_mut(&mut self, _: &mut syn::Item) {
        // A nested item runs in its own call, with no frame: `buffer!` there reports itself.
    }
}

/// The first `buffer!` in a block that will not be rewritten (for a precise error).
fn find_buffer(block: &Block) -> Option<&Macro> {
    struct Find<'a>(Option<&'a Macro>);
    impl<'a> syn::visit::Visit<'a> for Find<'a> {
        fn visit_macro(&mut self, mac: &'a Macro) {
            if self.0.is_none() && is_buffer(mac) {
                self.0 = Some(mac);
            }
        }
        fn visit_item(&mut self, _: &'a syn::Item) {}
    }
    let mut find = Find(None);
    syn::visit::Visit::visit_block(&mut find, block);
    find.0
}

fn find_buffer_in_expr(expr: &Expr) -> Option<&Macro> {
    match expr {
        Expr::Block(b) => find_buffer(&b.block),
        other => as_buffer(other),
    }
}
