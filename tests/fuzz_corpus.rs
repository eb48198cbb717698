//! Replays the fuzzer's corpus (`fuzz/corpus/pool_ops`) on stable, so every input the fuzzer kept
//! stays a regression test, checked by the shared model: every outcome as predicted, no panic, no
//! overwritten buffer, no leak.

mod fuzz_ops;

#[test]
fn every_corpus_input_runs_clean() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/pool_ops");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        println!("no corpus at {}: nothing to replay", dir.display());
        return;
    };
    let (mut inputs, mut ops, mut errors) = (0, 0, 0);
    for entry in entries {
        let path = entry.expect("readable corpus").path();
        let data = match std::fs::read(&path) {
            Ok(data) => data,
            // A fuzzer running beside the test may have just replaced it with a smaller input.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => panic!("cannot read {}: {e}", path.display()),
        };
        let outcome = fuzz_ops::run(&data);
        inputs += 1;
        ops += outcome.ops;
        errors += outcome.errors;
    }
    println!("{inputs} corpus inputs: {ops} operations, {errors} predicted PoolErrors, no panic");
    assert!(inputs > 0, "the corpus is checked in");
}
