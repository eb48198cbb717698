//! Tests of gpu-pool built with its default features only (`tests/off.rs`): its UI cases are
//! compiled by trybuild in a project of their own, where no other package of the workspace turns
//! a feature on.
