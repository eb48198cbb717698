//! What the macros are given: the stream of `#[pooled(..)]` and `gpu_scope!`, and `buffer!`'s
//! size and element type.

use proc_macro2::TokenStream;
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::{Expr, Ident, Member, Token, Type};

/// `#[pooled(stream)]`, `#[pooled(self.stream)]`, `#[pooled(ctx.gpu.stream)]`: a parameter, or a
/// field path that starts at one.
pub(crate) struct StreamArg {
    pub(crate) expr: Expr,
    /// The parameter the path starts at (`self` for a receiver).
    pub(crate) root: Ident,
}

/// `#[pooled(STREAM)]`, `#[pooled(STREAM, graph)]` or `#[pooled(STREAM, graph(cap = N))]`.
pub(crate) struct PooledArgs {
    pub(crate) stream: StreamArg,
    /// `graph`: the function replays a graph per key.
    pub(crate) graph: Option<GraphArg>,
}

/// `graph` or `graph(cap = N)`.
pub(crate) struct GraphArg {
    pub(crate) word: Ident,
    /// Graphs kept per stream.
    pub(crate) cap: Option<syn::LitInt>,
}

const GRAPH_FORMS: &str = "`#[pooled(stream, graph)]` or `#[pooled(stream, graph(cap = 16))]`";

impl PooledArgs {
    pub(crate) fn parse_attr(args: TokenStream) -> syn::Result<PooledArgs> {
        if args.is_empty() {
            return Err(syn::Error::new(
                proc_macro2::Span::call_site(),
                "name the stream buffers come from: `#[pooled(stream)]`, where `stream` is a parameter \
                 (or `#[pooled(self.stream)]` for a field)",
            ));
        }
        syn::parse::Parser::parse2(
            |input: ParseStream<'_>| {
                let expr: Expr = input.parse()?;
                let stream = StreamArg::from_expr(expr)?;
                if input.is_empty() {
                    return Ok(PooledArgs {
                        stream,
                        graph: None,
                    });
                }
                input.parse::<Token![,]>()?;
                let word: Ident = input.parse()?;
                if word != "graph" {
                    return Err(syn::Error::new_spanned(
                        &word,
                        format!(
                            "unknown option `{word}`; the one option is `graph`: {GRAPH_FORMS}"
                        ),
                    ));
                }
                let cap = if input.peek(syn::token::Paren) {
                    let inner;
                    syn::parenthesized!(inner in input);
                    let key: Ident = inner.parse()?;
                    if key != "cap" {
                        return Err(syn::Error::new_spanned(
                            &key,
                            format!("unknown graph option `{key}`: {GRAPH_FORMS}"),
                        ));
                    }
                    inner.parse::<Token![=]>()?;
                    let cap: syn::LitInt = inner.parse()?;
                    if cap.base10_parse::<usize>()? == 0 {
                        return Err(syn::Error::new_spanned(
                            &cap,
                            "a graphed function keeps at least one graph: `cap` must be 1 or more",
                        ));
                    }
                    Some(cap)
                } else {
                    None
                };
                input.parse::<Option<Token![,]>>()?;
                if !input.is_empty() {
                    return Err(input.error(format!("unexpected tokens: {GRAPH_FORMS}")));
                }
                Ok(PooledArgs {
                    stream,
                    graph: Some(GraphArg { word, cap }),
                })
            },
            args,
        )
    }
}

impl StreamArg {
    fn from_expr(expr: Expr) -> syn::Result<StreamArg> {
        let root = root_of(&expr).ok_or_else(|| {
            syn::Error::new_spanned(
                &expr,
                "expected a parameter name or a field path such as `self.stream`",
            )
        })?;
        Ok(StreamArg { expr, root })
    }
}

/// The parameter a field path starts at.
fn root_of(expr: &Expr) -> Option<Ident> {
    match expr {
        Expr::Path(p) if p.qself.is_none() && p.path.segments.len() == 1 && p.attrs.is_empty() => {
            let segment = &p.path.segments[0];
            segment.arguments.is_none().then(|| segment.ident.clone())
        }
        Expr::Field(f) if matches!(f.member, Member::Named(_) | Member::Unnamed(_)) => {
            root_of(&f.base)
        }
        Expr::Paren(p) => root_of(&p.expr),
        _ => None,
    }
}

/// `gpu_scope!(STREAM, { .. })`.
pub(crate) struct ScopeArgs {
    pub(crate) stream: Expr,
    pub(crate) body: syn::Block,
}

impl Parse for ScopeArgs {
    fn parse(input: ParseStream<'_>) -> syn::Result<ScopeArgs> {
        if input.is_empty() {
            return Err(input.error("expected `gpu_scope!(stream, { .. })`"));
        }
        let stream: Expr = input.parse()?;
        input.parse::<Token![,]>().map_err(|e| {
            syn::Error::new(
                e.span(),
                "expected `,` and a block after the stream: `gpu_scope!(stream, { .. })`",
            )
        })?;
        if !input.peek(syn::token::Brace) {
            return Err(input.error("expected a block: `gpu_scope!(stream, { .. })`"));
        }
        let body = input.parse()?;
        input.parse::<Option<Token![,]>>()?;
        if !input.is_empty() {
            return Err(input.error("unexpected tokens after the block of `gpu_scope!`"));
        }
        Ok(ScopeArgs { stream, body })
    }
}

/// `buffer!(rows, cols; T)`, `buffer!(rows, cols; T, packed)` or `buffer!(len; T)`.
pub(crate) struct BufferArgs {
    pub(crate) sizes: Vec<Expr>,
    pub(crate) elem: Type,
    /// `, packed`: a 2D buffer with no padding between its rows.
    pub(crate) packed: bool,
}

const BUFFER_FORMS: &str =
    "`buffer!(rows, cols; T)`, `buffer!(rows, cols; T, packed)` or `buffer!(len; T)`";

impl Parse for BufferArgs {
    fn parse(input: ParseStream<'_>) -> syn::Result<BufferArgs> {
        if input.is_empty() {
            return Err(input.error(format!(
                "expected a size and an element type: {BUFFER_FORMS}"
            )));
        }
        let sizes: Punctuated<Expr, Token![,]> = Punctuated::parse_separated_nonempty(input)?;
        if !input.peek(Token![;]) {
            return Err(input.error(format!(
                "expected `; T` after the size, naming the element type: {BUFFER_FORMS}"
            )));
        }
        input.parse::<Token![;]>()?;
        if input.is_empty() {
            return Err(input.error(format!(
                "expected the element type after `;`: {BUFFER_FORMS}"
            )));
        }
        let elem: Type = input.parse()?;
        let packed = if input.peek(Token![,]) {
            input.parse::<Token![,]>()?;
            let option: Ident = input.parse().map_err(|e| {
                syn::Error::new(
                    e.span(),
                    format!("expected `packed` after `,`: {BUFFER_FORMS}"),
                )
            })?;
            if option != "packed" {
                return Err(syn::Error::new_spanned(
                    &option,
                    format!(
                        "unknown buffer option `{option}`; the one option is `packed`: {BUFFER_FORMS}"
                    ),
                ));
            }
            Some(option)
        } else {
            None
        };
        if !input.is_empty() {
            return Err(input.error(format!(
                "unexpected tokens after the element type: {BUFFER_FORMS}"
            )));
        }
        let sizes: Vec<Expr> = sizes.into_iter().collect();
        if sizes.len() > 2 {
            return Err(syn::Error::new_spanned(
                &sizes[2],
                format!("a buffer has one or two dimensions: {BUFFER_FORMS}"),
            ));
        }
        if let (Some(option), 1) = (&packed, sizes.len()) {
            return Err(syn::Error::new_spanned(
                option,
                "`packed` is for 2D buffers (`buffer!(rows, cols; T, packed)`): a 1D buffer has no \
                 padding to leave out",
            ));
        }
        Ok(BufferArgs {
            sizes,
            elem,
            packed: packed.is_some(),
        })
    }
}
