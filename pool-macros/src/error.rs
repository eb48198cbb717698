//! Errors of one expansion. Each DSL mistake is reported where it stands, by a
//! `::core::compile_error!` that replaces the bad site: in expression position rustc gives that
//! expression its error type, which unifies with anything and reports nothing further, so the rest
//! of the user's code still type-checks and every mistake shows in one build. Errors that replace
//! nothing (the item's signature) are collected here (serde's `Ctxt`).

use proc_macro2::{Delimiter, Group, TokenStream, TokenTree};
use quote::quote;

#[derive(Default)]
pub(crate) struct Errors(Option<syn::Error>);

impl Errors {
    pub(crate) fn push(&mut self, error: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(error),
            None => self.0 = Some(error),
        }
    }

    pub(crate) fn push_at(
        &mut self,
        tokens: impl quote::ToTokens,
        message: impl std::fmt::Display,
    ) {
        self.push(syn::Error::new_spanned(tokens, message));
    }

    /// `Err` with every error pushed, or `Ok`.
    pub(crate) fn finish(self) -> syn::Result<()> {
        self.0.map_or(Ok(()), Err)
    }
}

/// The `compile_error!`s for `error`, as items or statements.
pub(crate) fn to_compile_errors(error: syn::Error) -> TokenStream {
    error.into_compile_error()
}

/// `error` as one expression of rustc's error type, spanned on the user's tokens:
/// `::core::compile_error!("..")`, or a block of them for several messages.
pub(crate) fn error_expr(error: syn::Error) -> TokenStream {
    let mut calls: Vec<TokenStream> = error
        .into_iter()
        .map(|e| parenthesized(e.into_compile_error()))
        .collect();
    let last = calls.pop().expect("a syn::Error holds a message");
    if calls.is_empty() {
        last
    } else {
        quote!({ #(#calls;)* #last })
    }
}

/// `compile_error! { .. }` (syn's form, a statement) as `compile_error!( .. )`, an expression; the
/// group keeps its span, which ends the error's range.
fn parenthesized(call: TokenStream) -> TokenStream {
    call.into_iter()
        .map(|token| match token {
            TokenTree::Group(g) if g.delimiter() == Delimiter::Brace => {
                let mut group = Group::new(Delimiter::Parenthesis, g.stream());
                group.set_span(g.span());
                TokenTree::Group(group)
            }
            other => other,
        })
        .collect()
}
