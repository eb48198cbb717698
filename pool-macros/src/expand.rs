//! Generation: validate the item, open a scope, rewrite the body.
//!
//! The user's code is always emitted. A mistake in the body is replaced where it stands (see
//! [`Rewriter`]); a mistake in the signature or the attribute (`async fn`, a stream that is no
//! parameter) leaves the scope unusable, so the scope's hidden local is bound to that error
//! instead: the body's `buffer!`s take from it, type-check against it, and report nothing more.

use proc_macro2::{TokenStream, TokenTree};
use quote::{ToTokens, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{FnArg, Ident, ItemFn, Pat};

use crate::args::{GraphArg, PooledArgs, ScopeArgs};
use crate::drops;
use crate::error::{Errors, error_expr, to_compile_errors};
use crate::rewrite::{Rewriter, find_await, scope_ident};
use crate::walk::Walk;

/// `#[pooled(STREAM)]` on `item`.
pub(crate) fn pooled(attr: TokenStream, item: TokenStream) -> TokenStream {
    match syn::parse2::<ItemFn>(item.clone()) {
        Ok(mut function) => {
            expand_fn(attr, &mut function);
            function.into_token_stream()
        }
        // The item stays as written, so code that uses it reports no errors of its own.
        Err(_) => {
            let errors = to_compile_errors(not_a_function(item.clone()));
            quote!(#errors #item)
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

fn expand_fn(attr: TokenStream, function: &mut ItemFn) {
    // What leaves the scope unusable: the scope's local is bound to these errors.
    let mut refused = Errors::default();
    let sig = &function.sig;
    if let Some(asyncness) = &sig.asyncness {
        refused.push_at(
            asyncness,
            "#[pooled] cannot be used on an `async fn`: a future can be dropped at any time, so its \
             buffers would not be released in order; use `gpu_scope!` around the synchronous parts",
        );
    }
    if let Some(constness) = &sig.constness {
        refused.push_at(
            constness,
            "#[pooled] cannot be used on a `const fn`: buffers are taken at run time",
        );
    }
    let (stream, graph) = match PooledArgs::parse_attr(attr) {
        Ok(args) => (Some(args.stream), args.graph),
        Err(e) => {
            refused.push(e);
            (None, None)
        }
    };
    if let Some(graph) = &graph {
        check_graphed(sig, graph, &mut refused);
    }
    if let Some(stream) = &stream
        && !parameters(sig).contains(&stream.root)
    {
        let names = parameters(sig)
            .iter()
            .map(|p| format!("`{p}`"))
            .collect::<Vec<_>>()
            .join(", ");
        refused.push_at(
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
    drops::check(&mut function.block);
    Rewriter::new().block(&mut function.block);

    let refusal = refused.finish();
    let graphed = match (&refusal, &stream, &graph) {
        (Ok(()), Some(stream), Some(graph)) => Some((stream.expr.clone(), graph)),
        _ => None,
    };
    let open = match (refusal, stream) {
        (Err(e), _) => refused_scope(e),
        (Ok(()), Some(stream)) if is_shared_ref_param(&function.sig, &stream.expr) => {
            // `&*stream` reborrows for the caller's lifetime, not for a borrow of the local `stream`.
            let expr = &stream.expr;
            let scope = scope_ident();
            let call = quote_spanned!(expr.span()=> ::gpu_pool::__private::scope(&*#expr));
            quote! { let #scope = #call; }
        }
        (Ok(()), Some(stream)) => open_scope(&stream.expr),
        (Ok(()), None) => unreachable!("a stream that does not parse is refused"),
    };
    prepend(&mut function.block, open);
    if let Some((stream, graph)) = graphed {
        graph_body(function, &stream, graph);
    }
}

/// What a graphed function cannot be: a method taking `self` by value (a replay cannot give it
/// back), and `async`/`const` are refused already.
fn check_graphed(sig: &syn::Signature, graph: &GraphArg, refused: &mut Errors) {
    if let Some(FnArg::Receiver(r)) = sig.inputs.first()
        && r.reference.is_none()
    {
        refused.push_at(
            r.self_token,
            "a graphed method takes `&self` or `&mut self`: its calls may run twice (a capture, \
             then eagerly) and a replay runs none of its code",
        );
    }
    if let syn::ReturnType::Default = sig.output {
        refused.push_at(
            &graph.word,
            "a graphed function returns a `Result` (`Result<(), PoolError>`, or outputs taken in \
             it): a capture can fail, and its call then runs eagerly",
        );
    }
}

/// Wraps the (already rewritten) body of a graphed function: its parameters' keys, then the call
/// through `graphed`, which replays, captures, or runs the body as a closure.
fn graph_body(function: &mut ItemFn, stream: &syn::Expr, graph: &GraphArg) {
    let sig = &function.sig;
    let name = sig.ident.to_string();
    let cap = graph
        .cap
        .as_ref()
        .map_or_else(|| quote!(16), ToTokens::to_token_stream);
    let site = Ident::new("__GPU_POOL_GRAPH", proc_macro2::Span::mixed_site());
    let keys = Ident::new("__gpu_pool_keys", proc_macro2::Span::mixed_site());
    let call = Ident::new("__gpu_pool_call", proc_macro2::Span::mixed_site());
    // One `static` serves every instance of a generic function, and of a method of a generic impl
    // (which the attribute cannot see): a closure made in the body names the instance in its
    // type (`Layer<f32>::forward::{{closure}}`), so it is part of the key.
    let key_each = parameters(sig).into_iter().map(|p| {
        quote_spanned! {p.span()=>
            ::gpu_pool::__private::GraphKey::graph_key(&#p, #keys);
        }
    });
    let by_value = is_by_value_param(sig, stream);
    let stream_ref = if by_value {
        quote_spanned!(stream.span()=> ::gpu_pool::__private::scope(&#stream))
    } else {
        quote_spanned!(stream.span()=> ::gpu_pool::__private::scope(&*#stream))
    };
    let (ret, call_ret) = match &sig.output {
        syn::ReturnType::Type(_, ty) if !has_impl_trait(ty) => {
            (quote!(-> #ty), quote!(-> ::core::option::Option<#ty>))
        }
        _ => (quote!(), quote!()),
    };
    // What the function returns is checked by `graphed`'s bounds: reported on the return type.
    let graphed = quote_spanned!(sig.output.span()=> ::gpu_pool::__private::graphed);
    let body = &function.block;
    // One closure both keys the parameters (given the keys: before the call, and again after a
    // capture, to see whether the body changed them on the host) and runs the body (given none):
    // one closure, so the body may borrow its parameters mutably.
    let wrapped = quote! {{
        static #site: ::gpu_pool::__private::GraphSite =
            ::gpu_pool::__private::GraphSite::new(concat!(module_path!(), "::", #name), #cap);
        let mut #call = |#keys: ::core::option::Option<&mut ::gpu_pool::__private::GraphKeys>| #call_ret {
            if let ::core::option::Option::Some(#keys) = #keys {
                #keys.instance(&|| ());
                #(#key_each)*
                return ::core::option::Option::None;
            }
            ::core::option::Option::Some((|| #ret #body)())
        };
        #graphed(&#site, #stream_ref, &mut #call)
    }};
    *function.block = syn::parse2(wrapped).expect("a block");
}

/// Whether `ty` holds an `impl Trait` anywhere: an `impl` token at any depth. Read on the tokens
/// rather than with syn's `Visit`, whose generic walk was a fifth of this crate's compiled code
/// (issue 34); an `impl` in a macro's tokens or in an array length's block counts too, which only
/// leaves the type to inference.
fn has_impl_trait(ty: &syn::Type) -> bool {
    fn any_impl(tokens: TokenStream) -> bool {
        tokens.into_iter().any(|token| match token {
            TokenTree::Ident(ident) => ident == "impl",
            TokenTree::Group(group) => any_impl(group.stream()),
            TokenTree::Punct(_) | TokenTree::Literal(_) => false,
        })
    }
    any_impl(ty.to_token_stream())
}

/// Whether the stream is a parameter taken by value (`stream: Stream`), which `&*` cannot reach.
fn is_by_value_param(sig: &syn::Signature, expr: &syn::Expr) -> bool {
    let syn::Expr::Path(path) = expr else {
        return false;
    };
    sig.inputs.iter().any(|input| match input {
        FnArg::Typed(t) => {
            matches!(&*t.pat, Pat::Ident(p) if path.path.is_ident(&p.ident))
                && matches!(&*t.ty, syn::Type::Path(_))
        }
        FnArg::Receiver(_) => false,
    })
}

/// The scope's local bound to `error`, for a scope that cannot be opened.
fn refused_scope(error: syn::Error) -> TokenStream {
    let scope = scope_ident();
    let error = error_expr(error);
    quote! { let #scope = #error; }
}

/// Puts the scope's statements first in the user's own block, which keeps its braces' spans: a
/// borrow error then says the buffer is freed at the user's closing brace.
fn prepend(block: &mut syn::Block, open: TokenStream) {
    let opened: syn::Block = syn::parse2(quote!({ #open })).expect("statements");
    block.stmts.splice(0..0, opened.stmts);
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
    let mut out = Vec::new();
    for input in &sig.inputs {
        match input {
            FnArg::Receiver(r) => out.push(Ident::new("self", r.self_token.span)),
            FnArg::Typed(t) => pattern_idents(&t.pat, &mut out),
        }
    }
    out
}

/// The identifiers a parameter pattern binds.
fn pattern_idents(pat: &Pat, out: &mut Vec<Ident>) {
    match pat {
        Pat::Ident(p) => out.push(p.ident.clone()),
        Pat::Reference(r) => pattern_idents(&r.pat, out),
        Pat::Tuple(t) => t.elems.iter().for_each(|p| pattern_idents(p, out)),
        Pat::TupleStruct(t) => t.elems.iter().for_each(|p| pattern_idents(p, out)),
        Pat::Struct(s) => s.fields.iter().for_each(|f| pattern_idents(&f.pat, out)),
        Pat::Type(t) => pattern_idents(&t.pat, out),
        Pat::Paren(p) => pattern_idents(&p.pat, out),
        _ => {}
    }
}

/// Opens the scope, spanned on the user's stream so that a value that is no stream is reported
/// there. `let x = &EXPR;` extends the life of a temporary `EXPR` (`gpu_scope!(&stream, ..)`) to
/// the block.
fn open_scope(stream: &syn::Expr) -> TokenStream {
    let scope = scope_ident();
    let named = syn::Ident::new("__gpu_pool_stream", proc_macro2::Span::mixed_site());
    let call = quote_spanned!(stream.span()=> ::gpu_pool::__private::scope(#named));
    quote! {
        let #named = &(#stream);
        let #scope = #call;
    }
}

/// `gpu_scope!(STREAM, { .. })`. Arguments that do not parse leave no block to keep: the macro is
/// then its error, an expression of rustc's error type.
pub(crate) fn gpu_scope(input: TokenStream) -> TokenStream {
    let mut args = match syn::parse2::<ScopeArgs>(input) {
        Ok(args) => args,
        Err(e) => return error_expr(e),
    };
    let refused = find_await(args.body.to_token_stream()).map(|await_| {
        syn::Error::new_spanned(
            await_,
            "`.await` cannot be used inside `gpu_scope!`: a future suspended here would hold \
             the scope's buffers, and could be dropped or forgotten while other code takes \
             buffers from the stream; close the scope before awaiting",
        )
    });
    drops::check(&mut args.body);
    Rewriter::new().block(&mut args.body);
    let open = match refused {
        Some(e) => refused_scope(e),
        None => open_scope(&args.stream),
    };
    prepend(&mut args.body, open);
    args.body.into_token_stream()
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
