//! `#[derive(GraphKey)]`: a type's graph key is its type, then every field's, in order (an enum's,
//! its variant's index first).

use proc_macro2::TokenStream;
use quote::{format_ident, quote};
use syn::spanned::Spanned;
use syn::{Data, DeriveInput, Fields};

use crate::error::to_compile_errors;

pub(crate) fn graph_key(input: TokenStream) -> TokenStream {
    match syn::parse2::<DeriveInput>(input) {
        Ok(input) => expand(&input).unwrap_or_else(to_compile_errors),
        Err(e) => to_compile_errors(e),
    }
}

fn expand(input: &DeriveInput) -> syn::Result<TokenStream> {
    let name = &input.ident;
    // Through `__private`, there in every build: a type can be a key (a library's model, say)
    // whether or not the build has the `graph` feature that uses keys.
    let key = quote!(::gpu_pool::__private::GraphKey);
    let keys = quote!(::gpu_pool::__private::GraphKeys);
    let mut bounds = Vec::new();
    let body = match &input.data {
        Data::Struct(s) => {
            bounds.extend(s.fields.iter().map(|f| f.ty.clone()));
            let (pattern, names) = destructure(&s.fields);
            quote! {
                let Self #pattern = self;
                #(#key::graph_key(#names, keys);)*
            }
        }
        Data::Enum(e) => {
            let arms = e.variants.iter().enumerate().map(|(i, v)| {
                bounds.extend(v.fields.iter().map(|f| f.ty.clone()));
                let variant = &v.ident;
                let (pattern, names) = destructure(&v.fields);
                let index = i as u64;
                quote! {
                    Self::#variant #pattern => {
                        keys.word(#index);
                        #(#key::graph_key(#names, keys);)*
                    }
                }
            });
            quote! {
                match self {
                    #(#arms)*
                }
            }
        }
        Data::Union(u) => {
            return Err(syn::Error::new(
                u.union_token.span(),
                "`GraphKey` cannot be derived for a union: which field is live is not known",
            ));
        }
    };
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let mut where_clause = where_clause
        .cloned()
        .unwrap_or_else(|| syn::parse_quote!(where));
    for ty in bounds {
        where_clause.predicates.push(syn::parse_quote!(#ty: #key));
    }
    Ok(quote! {
        // SAFETY: every field is keyed (and every field's type is a `GraphKey`, which keeps its
        // own contract), so the key covers all the value is.
        unsafe impl #impl_generics #key for #name #ty_generics #where_clause {
            fn graph_key(&self, keys: &mut #keys) {
                // The type too: two types that write the same words behind one `&dyn Trait`
                // parameter are two keys.
                keys.type_of::<Self>();
                #body
            }
        }
    })
}

/// A pattern binding every field, and the bindings' names.
fn destructure(fields: &Fields) -> (TokenStream, Vec<syn::Ident>) {
    match fields {
        Fields::Named(named) => {
            let names: Vec<_> = named
                .named
                .iter()
                .map(|f| f.ident.clone().expect("a named field"))
                .collect();
            (quote!({ #(#names),* }), names)
        }
        Fields::Unnamed(unnamed) => {
            let names: Vec<_> = (0..unnamed.unnamed.len())
                .map(|i| format_ident!("field_{}", i))
                .collect();
            (quote!(( #(#names),* )), names)
        }
        Fields::Unit => (quote!(), Vec::new()),
    }
}
