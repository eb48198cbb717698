//! A walk over the syntax of a function body, written by hand for the few node kinds the DSL can
//! stand in, in place of syn's `visit-mut`: syn's generic walk, instantiated for each of our
//! visitors, was a fifth of this crate's compiled code, and the feature itself a part of syn's own
//! build (issue 34).
//!
//! It reaches every expression, block, statement, pattern, type and macro of a body, in the order
//! syn's `VisitMut` visits them, attributes included (the value of `#[name = value]` is an
//! expression). It does not enter nested items: their bodies run in calls of their own, and each
//! of our visitors leaves them alone. Macros are reached, never their tokens, which are not Rust
//! yet.
//!
//! A visitor overrides the hooks of [`Walk`] it needs, and calls the `walk_*` function of a hook
//! to go on below the node as the default would.

use syn::punctuated::{Pair, Punctuated};
use syn::{
    AngleBracketedGenericArguments, Arm, Attribute, Block, BoundLifetimes, Expr, ExprConst,
    ExprPath, ExprRange, GenericArgument, GenericParam, Local, Macro, Meta, Pat, Path,
    PathArguments, ReturnType, Stmt, Type, TypeParamBound,
};

/// The hooks of a walk; each defaults to walking the node's children.
pub(crate) trait Walk: AsWalk {
    fn block(&mut self, block: &mut Block) {
        walk_block(self.as_walk(), block);
    }

    fn stmt(&mut self, stmt: &mut Stmt) {
        walk_stmt(self.as_walk(), stmt);
    }

    fn local(&mut self, local: &mut Local) {
        walk_local(self.as_walk(), local);
    }

    fn expr(&mut self, expr: &mut Expr) {
        walk_expr(self.as_walk(), expr);
    }

    /// A `const { .. }` block, as an expression or as a pattern.
    fn expr_const(&mut self, expr: &mut ExprConst) {
        walk_attrs(self.as_walk(), &mut expr.attrs);
        self.block(&mut expr.block);
    }

    fn arm(&mut self, arm: &mut Arm) {
        walk_attrs(self.as_walk(), &mut arm.attrs);
        walk_pat(self.as_walk(), &mut arm.pat);
        if let Some((_, guard)) = &mut arm.guard {
            self.expr(guard);
        }
        self.expr(&mut arm.body);
    }

    fn ty(&mut self, ty: &mut Type) {
        walk_type(self.as_walk(), ty);
    }

    fn generic_argument(&mut self, arg: &mut GenericArgument) {
        walk_generic_argument(self.as_walk(), arg);
    }

    /// A macro call, in any position: expression, statement, pattern or type.
    fn mac(&mut self, _mac: &mut Macro) {}
}

/// The walk functions take any visitor as `&mut dyn Walk`: one copy of the walk is compiled, not
/// one per visitor.
pub(crate) trait AsWalk {
    fn as_walk(&mut self) -> &mut dyn Walk;
}

impl<W: Walk> AsWalk for W {
    fn as_walk(&mut self) -> &mut dyn Walk {
        self
    }
}

pub(crate) fn walk_block(w: &mut dyn Walk, block: &mut Block) {
    for stmt in &mut block.stmts {
        w.stmt(stmt);
    }
}

pub(crate) fn walk_stmt(w: &mut dyn Walk, stmt: &mut Stmt) {
    match stmt {
        Stmt::Local(local) => w.local(local),
        // A nested item runs in its own call: none of our visitors enters it.
        Stmt::Item(_) => {}
        Stmt::Expr(expr, _) => w.expr(expr),
        Stmt::Macro(m) => {
            walk_attrs(w, &mut m.attrs);
            w.mac(&mut m.mac);
        }
    }
}

pub(crate) fn walk_local(w: &mut dyn Walk, local: &mut Local) {
    walk_attrs(w, &mut local.attrs);
    walk_pat(w, &mut local.pat);
    if let Some(init) = &mut local.init {
        w.expr(&mut init.expr);
        if let Some((_, diverge)) = &mut init.diverge {
            w.expr(diverge);
        }
    }
}

/// The value of each `#[name = value]`, and the generic arguments of attribute paths.
pub(crate) fn walk_attrs(w: &mut dyn Walk, attrs: &mut [Attribute]) {
    for attr in attrs {
        match &mut attr.meta {
            Meta::Path(path) => walk_path(w, path),
            Meta::List(list) => walk_path(w, &mut list.path),
            Meta::NameValue(nv) => {
                walk_path(w, &mut nv.path);
                w.expr(&mut nv.value);
            }
        }
    }
}

pub(crate) fn walk_expr(w: &mut dyn Walk, expr: &mut Expr) {
    match expr {
        Expr::Array(syn::ExprArray { attrs, elems, .. })
        | Expr::Tuple(syn::ExprTuple { attrs, elems, .. }) => {
            walk_attrs(w, attrs);
            walk_exprs(w, elems);
        }
        Expr::Assign(syn::ExprAssign {
            attrs, left, right, ..
        })
        | Expr::Binary(syn::ExprBinary {
            attrs, left, right, ..
        })
        | Expr::Index(syn::ExprIndex {
            attrs,
            expr: left,
            index: right,
            ..
        }) => {
            walk_attrs(w, attrs);
            w.expr(left);
            w.expr(right);
        }
        Expr::Async(syn::ExprAsync { attrs, block, .. })
        | Expr::Block(syn::ExprBlock { attrs, block, .. })
        | Expr::Loop(syn::ExprLoop {
            attrs, body: block, ..
        })
        | Expr::TryBlock(syn::ExprTryBlock { attrs, block, .. })
        | Expr::Unsafe(syn::ExprUnsafe { attrs, block, .. }) => {
            walk_attrs(w, attrs);
            w.block(block);
        }
        Expr::Await(syn::ExprAwait {
            attrs, base: inner, ..
        })
        | Expr::Field(syn::ExprField {
            attrs, base: inner, ..
        })
        | Expr::Group(syn::ExprGroup {
            attrs, expr: inner, ..
        })
        | Expr::Paren(syn::ExprParen {
            attrs, expr: inner, ..
        })
        | Expr::RawAddr(syn::ExprRawAddr {
            attrs, expr: inner, ..
        })
        | Expr::Reference(syn::ExprReference {
            attrs, expr: inner, ..
        })
        | Expr::Try(syn::ExprTry {
            attrs, expr: inner, ..
        })
        | Expr::Unary(syn::ExprUnary {
            attrs, expr: inner, ..
        }) => {
            walk_attrs(w, attrs);
            w.expr(inner);
        }
        Expr::Break(syn::ExprBreak { attrs, expr, .. })
        | Expr::Return(syn::ExprReturn { attrs, expr, .. })
        | Expr::Yield(syn::ExprYield { attrs, expr, .. }) => {
            walk_attrs(w, attrs);
            if let Some(expr) = expr {
                w.expr(expr);
            }
        }
        Expr::Continue(syn::ExprContinue { attrs, .. })
        | Expr::Infer(syn::ExprInfer { attrs, .. })
        | Expr::Lit(syn::ExprLit { attrs, .. }) => walk_attrs(w, attrs),
        Expr::Call(e) => {
            walk_attrs(w, &mut e.attrs);
            w.expr(&mut e.func);
            walk_exprs(w, &mut e.args);
        }
        Expr::Cast(e) => {
            walk_attrs(w, &mut e.attrs);
            w.expr(&mut e.expr);
            w.ty(&mut e.ty);
        }
        Expr::Closure(e) => {
            walk_attrs(w, &mut e.attrs);
            if let Some(lifetimes) = &mut e.lifetimes {
                walk_bound_lifetimes(w, lifetimes);
            }
            for input in each(&mut e.inputs) {
                walk_pat(w, input);
            }
            walk_return_type(w, &mut e.output);
            w.expr(&mut e.body);
        }
        Expr::Const(e) => w.expr_const(e),
        Expr::ForLoop(e) => {
            walk_attrs(w, &mut e.attrs);
            walk_pat(w, &mut e.pat);
            w.expr(&mut e.expr);
            w.block(&mut e.body);
        }
        Expr::If(e) => {
            walk_attrs(w, &mut e.attrs);
            w.expr(&mut e.cond);
            w.block(&mut e.then_branch);
            if let Some((_, otherwise)) = &mut e.else_branch {
                w.expr(otherwise);
            }
        }
        Expr::Let(e) => {
            walk_attrs(w, &mut e.attrs);
            walk_pat(w, &mut e.pat);
            w.expr(&mut e.expr);
        }
        Expr::Macro(e) => {
            walk_attrs(w, &mut e.attrs);
            w.mac(&mut e.mac);
        }
        Expr::Match(e) => {
            walk_attrs(w, &mut e.attrs);
            w.expr(&mut e.expr);
            for arm in &mut e.arms {
                w.arm(arm);
            }
        }
        Expr::MethodCall(e) => {
            walk_attrs(w, &mut e.attrs);
            w.expr(&mut e.receiver);
            if let Some(turbofish) = &mut e.turbofish {
                walk_angle_bracketed(w, turbofish);
            }
            walk_exprs(w, &mut e.args);
        }
        Expr::Path(e) => walk_expr_path(w, e),
        Expr::Range(e) => walk_expr_range(w, e),
        Expr::Repeat(e) => {
            walk_attrs(w, &mut e.attrs);
            w.expr(&mut e.expr);
            w.expr(&mut e.len);
        }
        Expr::Struct(e) => {
            walk_attrs(w, &mut e.attrs);
            if let Some(qself) = &mut e.qself {
                w.ty(&mut qself.ty);
            }
            walk_path(w, &mut e.path);
            for field in each(&mut e.fields) {
                walk_attrs(w, &mut field.attrs);
                w.expr(&mut field.expr);
            }
            if let Some(rest) = &mut e.rest {
                w.expr(rest);
            }
        }
        Expr::While(e) => {
            walk_attrs(w, &mut e.attrs);
            w.expr(&mut e.cond);
            w.block(&mut e.body);
        }
        // `Verbatim`: tokens syn could not read as Rust.
        _ => {}
    }
}

fn walk_exprs<P>(w: &mut dyn Walk, exprs: &mut Punctuated<Expr, P>) {
    for expr in each(exprs) {
        w.expr(expr);
    }
}

fn walk_expr_path(w: &mut dyn Walk, expr: &mut ExprPath) {
    walk_attrs(w, &mut expr.attrs);
    if let Some(qself) = &mut expr.qself {
        w.ty(&mut qself.ty);
    }
    walk_path(w, &mut expr.path);
}

fn walk_expr_range(w: &mut dyn Walk, expr: &mut ExprRange) {
    walk_attrs(w, &mut expr.attrs);
    if let Some(start) = &mut expr.start {
        w.expr(start);
    }
    if let Some(end) = &mut expr.end {
        w.expr(end);
    }
}

pub(crate) fn walk_pat(w: &mut dyn Walk, pat: &mut Pat) {
    match pat {
        Pat::Const(p) => w.expr_const(p),
        Pat::Ident(p) => {
            walk_attrs(w, &mut p.attrs);
            if let Some((_, sub)) = &mut p.subpat {
                walk_pat(w, sub);
            }
        }
        Pat::Lit(syn::ExprLit { attrs, .. })
        | Pat::Rest(syn::PatRest { attrs, .. })
        | Pat::Wild(syn::PatWild { attrs, .. }) => walk_attrs(w, attrs),
        Pat::Macro(p) => {
            walk_attrs(w, &mut p.attrs);
            w.mac(&mut p.mac);
        }
        Pat::Or(p) => {
            walk_attrs(w, &mut p.attrs);
            each(&mut p.cases).for_each(|p| walk_pat(w, p));
        }
        Pat::Paren(syn::PatParen { attrs, pat, .. })
        | Pat::Reference(syn::PatReference { attrs, pat, .. }) => {
            walk_attrs(w, attrs);
            walk_pat(w, pat);
        }
        Pat::Path(p) => walk_expr_path(w, p),
        Pat::Range(p) => walk_expr_range(w, p),
        Pat::Slice(syn::PatSlice { attrs, elems, .. })
        | Pat::Tuple(syn::PatTuple { attrs, elems, .. }) => {
            walk_attrs(w, attrs);
            each(elems).for_each(|p| walk_pat(w, p));
        }
        Pat::Struct(p) => {
            walk_attrs(w, &mut p.attrs);
            if let Some(qself) = &mut p.qself {
                w.ty(&mut qself.ty);
            }
            walk_path(w, &mut p.path);
            for field in each(&mut p.fields) {
                walk_attrs(w, &mut field.attrs);
                walk_pat(w, &mut field.pat);
            }
            if let Some(rest) = &mut p.rest {
                walk_attrs(w, &mut rest.attrs);
            }
        }
        Pat::TupleStruct(p) => {
            walk_attrs(w, &mut p.attrs);
            if let Some(qself) = &mut p.qself {
                w.ty(&mut qself.ty);
            }
            walk_path(w, &mut p.path);
            each(&mut p.elems).for_each(|p| walk_pat(w, p));
        }
        Pat::Type(p) => {
            walk_attrs(w, &mut p.attrs);
            walk_pat(w, &mut p.pat);
            w.ty(&mut p.ty);
        }
        _ => {}
    }
}

pub(crate) fn walk_type(w: &mut dyn Walk, ty: &mut Type) {
    match ty {
        Type::Array(t) => {
            w.ty(&mut t.elem);
            w.expr(&mut t.len);
        }
        Type::BareFn(t) => {
            if let Some(lifetimes) = &mut t.lifetimes {
                walk_bound_lifetimes(w, lifetimes);
            }
            for input in each(&mut t.inputs) {
                walk_attrs(w, &mut input.attrs);
                w.ty(&mut input.ty);
            }
            if let Some(variadic) = &mut t.variadic {
                walk_attrs(w, &mut variadic.attrs);
            }
            walk_return_type(w, &mut t.output);
        }
        Type::Group(syn::TypeGroup { elem, .. })
        | Type::Paren(syn::TypeParen { elem, .. })
        | Type::Ptr(syn::TypePtr { elem, .. })
        | Type::Reference(syn::TypeReference { elem, .. })
        | Type::Slice(syn::TypeSlice { elem, .. }) => w.ty(elem),
        Type::ImplTrait(syn::TypeImplTrait { bounds, .. })
        | Type::TraitObject(syn::TypeTraitObject { bounds, .. }) => walk_bounds(w, bounds),
        Type::Macro(t) => w.mac(&mut t.mac),
        Type::Path(t) => {
            if let Some(qself) = &mut t.qself {
                w.ty(&mut qself.ty);
            }
            walk_path(w, &mut t.path);
        }
        Type::Tuple(t) => each(&mut t.elems).for_each(|t| w.ty(t)),
        _ => {}
    }
}

fn walk_return_type(w: &mut dyn Walk, output: &mut ReturnType) {
    if let ReturnType::Type(_, ty) = output {
        w.ty(ty);
    }
}

pub(crate) fn walk_path(w: &mut dyn Walk, path: &mut Path) {
    for segment in each(&mut path.segments) {
        match &mut segment.arguments {
            PathArguments::None => {}
            PathArguments::AngleBracketed(args) => walk_angle_bracketed(w, args),
            PathArguments::Parenthesized(args) => {
                each(&mut args.inputs).for_each(|t| w.ty(t));
                walk_return_type(w, &mut args.output);
            }
        }
    }
}

fn walk_angle_bracketed(w: &mut dyn Walk, args: &mut AngleBracketedGenericArguments) {
    for arg in each(&mut args.args) {
        w.generic_argument(arg);
    }
}

pub(crate) fn walk_generic_argument(w: &mut dyn Walk, arg: &mut GenericArgument) {
    match arg {
        GenericArgument::Type(t) => w.ty(t),
        GenericArgument::Const(e) => w.expr(e),
        GenericArgument::AssocType(a) => {
            if let Some(generics) = &mut a.generics {
                walk_angle_bracketed(w, generics);
            }
            w.ty(&mut a.ty);
        }
        GenericArgument::AssocConst(a) => {
            if let Some(generics) = &mut a.generics {
                walk_angle_bracketed(w, generics);
            }
            w.expr(&mut a.value);
        }
        GenericArgument::Constraint(c) => {
            if let Some(generics) = &mut c.generics {
                walk_angle_bracketed(w, generics);
            }
            walk_bounds(w, &mut c.bounds);
        }
        // Lifetimes.
        _ => {}
    }
}

fn walk_bounds<P>(w: &mut dyn Walk, bounds: &mut Punctuated<TypeParamBound, P>) {
    for bound in each(bounds) {
        if let TypeParamBound::Trait(t) = bound {
            if let Some(lifetimes) = &mut t.lifetimes {
                walk_bound_lifetimes(w, lifetimes);
            }
            walk_path(w, &mut t.path);
        }
    }
}

/// `for<..>`: lifetimes on stable Rust, types and constants too where a nightly feature allows.
fn walk_bound_lifetimes(w: &mut dyn Walk, lifetimes: &mut BoundLifetimes) {
    for param in each(&mut lifetimes.lifetimes) {
        match param {
            GenericParam::Lifetime(p) => walk_attrs(w, &mut p.attrs),
            GenericParam::Type(p) => {
                walk_attrs(w, &mut p.attrs);
                walk_bounds(w, &mut p.bounds);
                if let Some(default) = &mut p.default {
                    w.ty(default);
                }
            }
            GenericParam::Const(p) => {
                walk_attrs(w, &mut p.attrs);
                w.ty(&mut p.ty);
                if let Some(default) = &mut p.default {
                    w.expr(default);
                }
            }
        }
    }
}

/// The elements of `list`, in order. Not `Punctuated::iter_mut`: that is a boxed iterator, whose
/// vtable, compiled for each element type, is more code than the walk itself.
fn each<T, P>(list: &mut Punctuated<T, P>) -> impl Iterator<Item = &mut T> {
    list.pairs_mut().map(Pair::into_value)
}
