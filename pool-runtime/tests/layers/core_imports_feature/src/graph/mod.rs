pub struct Graph;

fn the_feature_may_import_the_core() {
    use crate::core::x;
}
