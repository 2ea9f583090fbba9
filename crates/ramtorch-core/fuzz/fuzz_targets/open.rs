//! Fuzzes the file reader on arbitrary bytes: the input is written to a file, opened with
//! [`SafetensorsFile::open`] (header read with positioned reads, never mapped) and, when accepted,
//! every tensor is read back and copied (to its own dtype, and converted to F32 when it is a
//! float). Checks: open never panics and decides exactly as [`parse`] on the same bytes (same
//! tensors, or an `Invalid` error for an invalid file, never an I/O error for a regular file);
//! every read returns the tensor's bytes from the input; every copy succeeds and agrees with the
//! read.
//!
//! Run with `RUSTC_BOOTSTRAP=1 cargo fuzz run open` from `crates/ramtorch-core` (see README.md).
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use ramtorch_core::io::{parse, CopyJob, Dtype, OpenError, SafetensorsFile};

/// One file per fuzzing process, overwritten by every input.
fn path() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        std::env::temp_dir().join(format!(
            "ramtorch-fuzz-open-{}.safetensors",
            std::process::id()
        ))
    })
}

fuzz_target!(|data: &[u8]| {
    let p = path();
    std::fs::write(p, data).expect("cannot write the fuzz input file");
    let parsed = parse(data, "fuzz");
    let opened = SafetensorsFile::open(p);
    // The open handle keeps the data readable; nothing is left behind in the temp directory.
    let _ = std::fs::remove_file(p);
    let f = match (parsed, opened) {
        (Ok(h), Ok(f)) => {
            assert_eq!(
                h.tensors,
                f.tensors(),
                "parse and open disagree on the tensors"
            );
            assert_eq!(h.metadata.as_ref(), f.metadata());
            f
        }
        (Err(_), Err(OpenError::Invalid(_))) => return,
        (Ok(_), Err(e)) => panic!("parse accepts, open refuses: {e}"),
        (Err(e), Ok(_)) => panic!("parse refuses ({e}), open accepts"),
        (Err(_), Err(e)) => panic!("an I/O error on a regular file: {e}"),
    };
    for t in f.tensors() {
        let raw = f.read(&t.name).expect("read of an accepted tensor failed");
        assert_eq!(raw, &data[t.start..t.end]);
        let mut same = vec![0u8; raw.len()];
        f.copy_tensor(&t.name, &mut same, t.dtype)
            .expect("plain copy of an accepted tensor failed");
        assert_eq!(same, raw);
        if matches!(t.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
            let mut wide = vec![0u8; t.numel * 4];
            f.copy_many(vec![CopyJob {
                name: &t.name,
                dst: &mut wide,
                dtype: Dtype::F32,
            }])
            .expect("conversion of an accepted float tensor to F32 failed");
        }
    }
    // A destination of the wrong size is refused, not written past.
    if let Some(t) = f.tensors().first() {
        let mut short = vec![0u8; t.nbytes().saturating_sub(1)];
        if t.nbytes() > 0 {
            assert!(f.copy_tensor(&t.name, &mut short, t.dtype).is_err());
        }
    }
});
