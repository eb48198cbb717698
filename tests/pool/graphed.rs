//! Graphs by shape (`#[pooled(stream, graph)]`): on the host backend every call runs eagerly with
//! the same results and its reason counted; on a GPU a key's first call is captured, later calls
//! replay, every shape shares one scratch, and what cannot be captured runs eagerly.

use gpu_pool::graph::{GraphKey, GraphKeys, shape_stats};
use gpu_pool::prelude::*;

/// `y = x * 2 + 1`, written with host-side fills so it runs on every backend.
#[pooled(stream, graph)]
fn twice_plus_one<'s>(
    stream: &'s Stream,
    x: &Temp<'_, f32>,
    rows: usize,
) -> Result<Temp<'s, f32>, PoolError> {
    let mut y = stream.temp::<f32>(rows, x.cols())?;
    let mut tmp = buffer!(rows, x.cols(); f32)?;
    tmp.copy_from(x)?;
    y.copy_from(&tmp)?;
    Ok(y)
}

#[derive(GraphKey)]
struct Filler<'s> {
    stream: &'s Stream,
    value: u8,
}

impl Filler<'_> {
    #[pooled(self.stream, graph(cap = 2))]
    fn fill(&self, out: &mut Temp<'_, u8>) -> Result<(), PoolError> {
        let mut tmp = buffer!(out.rows(), out.cols(); u8)?;
        tmp.set_to(self.value)?;
        out.copy_from(&tmp)
    }
}

#[test]
fn on_the_host_backend_a_graphed_function_runs_eagerly_with_the_same_results()
-> Result<(), PoolError> {
    let stream = Stream::new(&Device::private_host())?;
    let mut x = stream.temp::<f32>(3, 5)?;
    x.upload(&[1.5; 15])?;
    for _ in 0..3 {
        let y = twice_plus_one(&stream, &x, 3)?;
        assert_eq!(y.to_vec()?, vec![1.5; 15]);
    }
    let stats = shape_stats(&stream);
    assert_eq!(
        (stats.captures, stats.replays, stats.eager_calls),
        (0, 0, 3)
    );
    assert_eq!(stats.eager.len(), 1, "{stats}");
    assert!(
        stats.eager[0].function.ends_with("twice_plus_one"),
        "{stats}"
    );
    assert_eq!(stats.eager[0].calls, 3);
    assert!(stats.eager[0].reason.contains("host backend"), "{stats}");
    drop(x);
    assert_eq!(stream.stats().stack_in_use, 0);
    Ok(())
}

#[test]
fn a_graphed_method_keys_self_and_runs_on_the_host() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::private_host())?;
    let mut out = stream.temp::<u8>(2, 7)?;
    for value in [3, 4, 3] {
        Filler {
            stream: &stream,
            value,
        }
        .fill(&mut out)?;
        assert_eq!(out.to_vec()?, vec![value; 14]);
    }
    assert_eq!(shape_stats(&stream).eager_calls, 3);
    Ok(())
}

#[test]
fn a_key_changes_with_every_scalar_buffer_and_field() -> Result<(), PoolError> {
    let stream = Stream::new(&Device::private_host())?;
    let key = |f: &dyn Fn(&mut GraphKeys)| {
        let mut keys = GraphKeys::default();
        f(&mut keys);
        keys
    };
    let (a, b) = (stream.temp::<f32>(4, 4)?, stream.temp::<f32>(4, 4)?);
    assert_eq!(key(&|k| a.graph_key(k)), key(&|k| a.graph_key(k)));
    assert_ne!(
        key(&|k| a.graph_key(k)),
        key(&|k| b.graph_key(k)),
        "another address"
    );
    let c = stream.temp::<u32>(4, 4)?;
    let d = stream.temp::<u32>(2, 8)?;
    assert_ne!(
        key(&|k| c.graph_key(k)),
        key(&|k| d.graph_key(k)),
        "another shape"
    );
    let filler = |value| Filler {
        stream: &stream,
        value,
    };
    assert_ne!(
        key(&|k| filler(1).graph_key(k)),
        key(&|k| filler(2).graph_key(k)),
        "another field"
    );
    assert_ne!(
        key(&|k| 1.0f32.graph_key(k)),
        key(&|k| (-1.0f32).graph_key(k))
    );
    // Past the inline words: still every word.
    let long: Vec<u64> = (0..100).collect();
    let mut longer = long.clone();
    longer[99] = 7;
    assert_ne!(key(&|k| long.graph_key(k)), key(&|k| longer.graph_key(k)));
    assert_eq!(key(&|k| long.graph_key(k)).words().len(), 101);
    Ok(())
}
