use crate::stream::Stream;

fn f(_: &crate::Stream) {
    assert!(super::report::ok());
}
