//! Collects every error of one expansion, so the user sees all bad sites in one build (serde's
//! `Ctxt`).

use proc_macro2::TokenStream;

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

    pub(crate) fn push_all(&mut self, other: Errors) {
        if let Some(e) = other.0 {
            self.push(e);
        }
    }

    /// `Err` with every error pushed, or `Ok`.
    pub(crate) fn finish(self) -> syn::Result<()> {
        self.0.map_or(Ok(()), Err)
    }
}

/// The `compile_error!`s for `error`.
pub(crate) fn to_compile_errors(error: syn::Error) -> TokenStream {
    error.into_compile_error()
}
