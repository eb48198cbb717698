// Buffers at any depth: each owner is declared where its `let` stands.
#[pooled(stream)]
fn steps(stream: Stream, n: usize) -> Result<usize, PoolError> {
    let mut total = 0;
    for i in 0..n {
        let t = buffer!(i + 1; f32).expect("fits");
        if i % 2 == 0 {
            let _ = buffer!(8, 8; u8)?;
            continue;
        }
        total += t.len();
    }
    Ok(total)
}
