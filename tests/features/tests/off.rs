//! Code that needs a feature the build left off fails with one error naming the feature; code
//! that needs none builds.

#[test]
fn features_left_off() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("ui/*.rs");
    cases.pass("pass/*.rs");
}
