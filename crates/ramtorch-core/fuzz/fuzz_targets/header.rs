//! Fuzzes the safetensors header parser on arbitrary bytes: it must return `Ok` or
//! `Err(InvalidArgument)`, never panic, and every accepted tensor must lie inside the input.
//!
//! Run with `RUSTC_BOOTSTRAP=1 cargo fuzz run header` from `crates/ramtorch-core` (see README.md).
#![no_main]

use libfuzzer_sys::fuzz_target;
use ramtorch_core::io::parse;
use ramtorch_core::Error;

fuzz_target!(|data: &[u8]| {
    match parse(data, "fuzz") {
        Ok(h) => {
            for t in &h.tensors {
                assert!(t.start <= t.end && t.end <= data.len());
                assert!(t.start >= h.data_start);
            }
        }
        Err(Error::InvalidArgument(_)) => {}
        Err(e) => panic!("unexpected error kind: {e}"),
    }
});
