//! The DSL in an edition-2021 crate: a block's tail temporaries outlive the block's locals there,
//! so without care a temporary buffer in the tail of a scope would be released after the scope's
//! own buffers, out of LIFO order.

#[cfg(test)]
mod tests {
    use gpu_pool::compat::opencv::BufferPool;
    use gpu_pool::prelude::*;

    /// A tail expression with a temporary stack buffer, in each place the DSL opens a block.
    #[pooled(stream)]
    fn tails(stream: &Stream) -> Result<usize, PoolError> {
        let pool = BufferPool::new(stream);
        let inner = {
            let a = buffer!(5; u8)?;
            a.len() + pool.get_buffer_1d::<u8>(3)?.len()
        };
        let scoped = gpu_scope!(stream, {
            let b = buffer!(9; u8)?;
            b.len() + pool.get_buffer_1d::<u16>(3)?.len()
        });
        let c = buffer!(2; u8)?;
        Ok(inner + scoped + c.len() + pool.get_buffer_1d::<u8>(1)?.len())
    }

    #[test]
    fn tail_temporaries_are_released_before_the_blocks_buffers() -> Result<(), PoolError> {
        let stream = Stream::new(&Device::private_host())?;
        assert_eq!(tails(&stream)?, 8 + 12 + 3);
        let stats = stream.stats();
        assert_eq!(stats.stack_allocations, 6);
        assert_eq!(
            stats.lifo_violations, 0,
            "every buffer released in LIFO order"
        );
        assert_eq!(stats.stack_in_use, 0);
        Ok(())
    }
}
