// A function with a 2D and a 1D buffer, as in the README.
#[pooled(stream)]
fn gray_threshold(stream: &Stream, src: &GpuMat<[u8; 3]>) -> Result<(), PoolError> {
    let mut gray = buffer!(src.rows(), src.cols(); u8)?;
    let sums = buffer!(src.rows(); f32)?;
    gray.set_to(0)?;
    Ok(())
}
