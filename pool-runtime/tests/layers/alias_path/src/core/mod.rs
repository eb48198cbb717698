pub(crate) mod stream;
