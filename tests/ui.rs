//! Compile-time guarantees of the DSL, pinned with trybuild (toolchain pinned in
//! rust-toolchain.toml so the messages stay stable). `TRYBUILD=overwrite` rewrites the `.stderr`
//! files; review them before committing.
//!
//! - `ui/escape`: no safe code lets a buffer outlive its scope or leave its owner (guarantees 1, 2);
//! - `ui/pooled`, `ui/gpu_scope`: misuse is an error on the user's tokens saying how to fix it;
//! - `ui/runtime`: what unsafe code trusts cannot be forged by safe code;
//! - `ui/interop`: what cudarc says where `.buf` is meant (pinned so a better message is noticed);
//! - `ui/pass`: what must keep compiling.

#[test]
fn ui() {
    // trybuild runs cargo; a test binary carried to the GPU machine has none there.
    if std::env::var_os("CARGO").is_none() {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "ui: skipped: not run by cargo (trybuild needs it)"
        );
        return;
    }
    let t = trybuild::TestCases::new();
    t.compile_fail("ui/escape/*.rs");
    t.compile_fail("ui/pooled/*.rs");
    t.compile_fail("ui/gpu_scope/*.rs");
    t.compile_fail("ui/runtime/*.rs");
    #[cfg(feature = "cuda")]
    t.compile_fail("ui/interop/*.rs");
    t.pass("ui/pass/*.rs");
}
