// A method pooling on a field, and a nested gpu_scope! on another stream.
impl Filter {
    #[pooled(self.stream)]
    fn run(&mut self, other: &Stream) -> Result<u32, PoolError> {
        let x = buffer!(16; u32)?;
        let y = gpu_scope!(other, {
            let mut y = buffer!(16; u32)?;
            y.copy_from(&x)?;
            y.len() as u32
        });
        Ok(y)
    }
}
