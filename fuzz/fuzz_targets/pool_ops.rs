//! Sequences of pool operations, config changes and bad sizes, decoded from the fuzzer's bytes.
//!
//! `cargo +nightly fuzz run pool_ops fuzz/corpus/pool_ops -- -max_total_time=300`
#![no_main]

#[path = "../../tests/fuzz_ops/mod.rs"]
mod fuzz_ops;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fuzz_ops::run(data);
});
