//! The user's `?` keeps its meaning: `PoolError` converts into the function's own error type.
use gpu_pool::prelude::*;

#[derive(Debug)]
enum AppError {
    Pool(PoolError),
}

impl From<PoolError> for AppError {
    fn from(e: PoolError) -> Self {
        AppError::Pool(e)
    }
}

#[pooled(stream)]
fn app(stream: &Stream, n: usize) -> Result<usize, AppError> {
    let b = buffer!(n, n; u64)?;
    Ok(b.len())
}

fn main() {
    let stream = Stream::new(&Device::host()).unwrap();
    assert_eq!(app(&stream, 3).unwrap(), 9);
    assert!(matches!(app(&stream, usize::MAX), Err(AppError::Pool(PoolError::SizeOverflow { .. }))));
}
