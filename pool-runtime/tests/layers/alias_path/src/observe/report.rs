pub(crate) fn ok() -> bool {
    true
}
