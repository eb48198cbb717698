//! Generation: validate the item, open a frame, rewrite the body.

use proc_macro2::TokenStream;
use quote::{ToTokens, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::visit_mut::VisitMut;
use syn::{FnArg, Ident, ItemFn, Pat};

use crate::args::{ScopeArgs, StreamArg};
use crate::drops;
use crate::error::{Errors, to_compile_errors};
use crate::rewrite::{Rewriter, find_await, frame_ident};

/// `#[pooled(STREAM)]` on `item`.
pub(crate) fn pooled(attr: TokenStream, item: TokenStream) -> TokenStream {
    let mut function: ItemFn = match syn::parse2(item.clone()) {
        Ok(f) => f,
        Err(_) => return to_compile_errors(not_a_function(item)),
    };
    match expand_fn(attr, &mut function) {
        Ok(()) => function.into_token_stream(),
        // The user's signature stays, with a body that type-checks, so callers report no errors of
        // their own (thiserror's fallback).
        Err(e) => {
            let errors = to_compile_errors(e);
            let ItemFn {
                attrs, vis, sig, ..
            } = &mut function;
            // A refused `const` is not kept, or the stub's panic would be a second error.
            sig.constness = None;
            quote! {
                #errors
                #(#attrs)*
                #[allow(unused_variables, clippy::diverging_sub_expression)]
                #vis #sig {
                    ::core::unreachable!("#[pooled] failed to expand")
                }
            }
        }
    }
}

fn not_a_function(item: TokenStream) -> syn::Error {
    if let Ok(method) = syn::parse2::<syn::TraitItemFn>(item.clone())
        && method.default.is_none()
    {
        return syn::Error::new_spanned(
            &method.sig,
            "#[pooled] needs a function body: put it on the implementation, not the declaration",
        );
    }
    let what = match syn::parse2::<syn::Item>(item.clone()) {
        Ok(syn::Item::Struct(s)) => return item_error(s.struct_token, "a struct"),
        Ok(syn::Item::Enum(e)) => return item_error(e.enum_token, "an enum"),
        Ok(syn::Item::Impl(i)) => {
            return item_error(i.impl_token, "an impl block; put it on each method");
        }
        Ok(syn::Item::Mod(m)) => return item_error(m.mod_token, "a module"),
        Ok(other) => other.into_token_stream(),
        Err(_) => item,
    };
    syn::Error::new_spanned(what, "#[pooled] applies to functions and methods")
}

fn item_error(token: impl ToTokens, what: &str) -> syn::Error {
    syn::Error::new_spanned(
        token,
        format!("#[pooled] applies to functions and methods, not to {what}"),
    )
}

fn expand_fn(attr: TokenStream, function: &mut ItemFn) -> syn::Result<()> {
    let mut errors = Errors::default();
    let sig = &function.sig;
    if let Some(asyncness) = &sig.asyncness {
        errors.push_at(
            asyncness,
            "#[pooled] cannot be used on an `async fn`: a future can be dropped at any time, so its \
             buffers would not be released in order; use `gpu_scope!` around the synchronous parts",
        );
    }
    if let Some(constness) = &sig.constness {
        errors.push_at(
            constness,
            "#[pooled] cannot be used on a `const fn`: buffers are taken at run time",
        );
    }
    let stream = match StreamArg::parse_attr(attr) {
        Ok(stream) => Some(stream),
        Err(e) => {
            errors.push(e);
            None
        }
    };
    if let Some(stream) = &stream
        && !parameters(sig).contains(&stream.root)
    {
        let names = parameters(sig)
            .iter()
            .map(|p| format!("`{p}`"))
            .collect::<Vec<_>>()
            .join(", ");
        errors.push_at(
            &stream.expr,
            format!(
                "`{}` is not a parameter of `{}`; name the parameter that holds the stream{}",
                stream.root,
                sig.ident,
                if names.is_empty() {
                    String::new()
                } else {
                    format!(" (parameters: {names})")
                }
            ),
        );
    }
    errors.push_all(drops::check(&function.block));
    let mut rewriter = Rewriter::new();
    rewriter.visit_block_mut(&mut function.block);
    errors.push_all(rewriter.errors);
    errors.finish()?;

    let stream = stream.expect("no errors, so the stream parsed");
    let open = if is_shared_ref_param(&function.sig, &stream.expr) {
        // `&*stream` reborrows for the caller's lifetime, not for a borrow of the local `stream`.
        let expr = &stream.expr;
        let frame = frame_ident();
        let call = quote_spanned!(expr.span()=> ::gpu_pool::__private::frame(&*#expr));
        quote! { let #frame = #call; }
    } else {
        open_frame(&stream.expr)
    };
    prepend(&mut function.block, open)
}

/// Puts the frame's statements first in the user's own block, which keeps its braces' spans: a
/// borrow error then says the buffer is freed at the user's closing brace.
fn prepend(block: &mut syn::Block, open: TokenStream) -> syn::Result<()> {
    let opened: syn::Block = syn::parse2(quote!({ #open }))?;
    block.stmts.splice(0..0, opened.stmts);
    Ok(())
}

/// Whether the stream is a parameter declared as a shared reference (`stream: &Stream`).
fn is_shared_ref_param(sig: &syn::Signature, expr: &syn::Expr) -> bool {
    let syn::Expr::Path(path) = expr else {
        return false;
    };
    sig.inputs.iter().any(|input| match input {
        FnArg::Typed(t) => {
            matches!(&*t.pat, Pat::Ident(p) if path.path.is_ident(&p.ident))
                && matches!(&*t.ty, syn::Type::Reference(r) if r.mutability.is_none())
        }
        FnArg::Receiver(_) => false,
    })
}

/// Every name the function binds: `self`, and the identifiers of its parameter patterns.
fn parameters(sig: &syn::Signature) -> Vec<Ident> {
    fn idents(pat: &Pat, out: &mut Vec<Ident>) {
        match pat {
            Pat::Ident(p) => out.push(p.ident.clone()),
            Pat::Reference(r) => idents(&r.pat, out),
            Pat::Tuple(t) => t.elems.iter().for_each(|p| idents(p, out)),
            Pat::TupleStruct(t) => t.elems.iter().for_each(|p| idents(p, out)),
            Pat::Struct(s) => s.fields.iter().for_each(|f| idents(&f.pat, out)),
            Pat::Type(t) => idents(&t.pat, out),
            Pat::Paren(p) => idents(&p.pat, out),
            _ => {}
        }
    }
    let mut out = Vec::new();
    for input in &sig.inputs {
        match input {
            FnArg::Receiver(r) => out.push(Ident::new("self", r.self_token.span)),
            FnArg::Typed(t) => idents(&t.pat, &mut out),
        }
    }
    out
}

/// Opens the frame, spanned on the user's stream so that a value that is no stream is reported
/// there. `let x = &EXPR;` extends the life of a temporary `EXPR` (`gpu_scope!(&stream, ..)`) to
/// the block.
fn open_frame(stream: &syn::Expr) -> TokenStream {
    let frame = frame_ident();
    let named = syn::Ident::new("__gpu_pool_stream", proc_macro2::Span::mixed_site());
    let call = quote_spanned!(stream.span()=> ::gpu_pool::__private::frame(#named));
    quote! {
        let #named = &(#stream);
        let #frame = #call;
    }
}

/// `gpu_scope!(STREAM, { .. })`.
pub(crate) fn gpu_scope(input: TokenStream) -> TokenStream {
    let expanded = syn::parse2::<ScopeArgs>(input).and_then(|mut args| {
        let mut rewriter = Rewriter::new();
        if let Some(await_) = find_await(args.body.to_token_stream()) {
            rewriter.errors.push_at(
                await_,
                "`.await` cannot be used inside `gpu_scope!`: a future suspended here would hold \
                 the scope's buffers, and could be dropped or forgotten while other code takes \
                 buffers from the stream; close the scope before awaiting",
            );
        }
        rewriter.errors.push_all(drops::check(&args.body));
        rewriter.visit_block_mut(&mut args.body);
        rewriter.errors.finish()?;
        prepend(&mut args.body, open_frame(&args.stream))?;
        Ok(args.body.into_token_stream())
    });
    expanded.unwrap_or_else(|e| {
        let errors = to_compile_errors(e);
        quote! {{ #errors }}
    })
}

/// `buffer!` where no `#[pooled]` function or `gpu_scope!` rewrote it.
pub(crate) fn misplaced_buffer() -> TokenStream {
    to_compile_errors(syn::Error::new(
        proc_macro2::Span::call_site(),
        "`buffer!` only works as `let name = buffer!(..)?;` in the body of a `#[pooled(stream)]` \
         function or a `gpu_scope!(stream, { .. })` block (not in nested functions, constant items \
         or inside other macros), called as `buffer!` or by a path into gpu-pool \
         (`gpu_pool::buffer!`)",
    ))
}
