pub struct Graph;

fn capture(_: &crate::core::Stream) {}
