//! Host memory shared by the processes of a node: creation, attachment, sealing, pinning.

use std::io::Write;
use std::sync::atomic::Ordering;
use std::sync::Arc;

mod common;

use std::os::fd::AsRawFd;

use common::{Counting, CountingPinner, Refuse};
use ramtorch_core::arena::Arena;
use ramtorch_core::shared::SharedRegion;
use ramtorch_core::Error;

fn is_invalid(e: &Error, needle: &str) -> bool {
    matches!(e, Error::InvalidArgument(m) if m.contains(needle))
}

#[test]
fn create_attach_and_see_writes_both_ways() {
    let a = Arena::new(None);
    let len = 3 * 4096 + 17;
    let r = SharedRegion::create(&a, len).expect("create");
    assert_eq!(r.len(), len);
    assert!(!r.is_pinned());
    assert!(r
        .name()
        .starts_with(&format!("/proc/{}/fd/", std::process::id())));
    // SAFETY: nobody writes while the slice lives.
    assert!(unsafe { r.as_slice() }.iter().all(|&b| b == 0));
    // SAFETY: `len` writable bytes; no slice of the region is alive.
    unsafe { std::ptr::write_bytes(r.as_ptr(), 7, len) };

    let b = SharedRegion::attach(&a, r.name(), len).expect("attach");
    assert_ne!(b.as_ptr(), r.as_ptr(), "a second mapping");
    // SAFETY: nobody writes while the slice lives.
    assert!(unsafe { b.as_slice() }.iter().all(|&x| x == 7));
    // SAFETY: the last byte is inside the region; no slice is alive.
    unsafe { *b.as_ptr().add(len - 1) = 42 };
    // SAFETY: as above.
    unsafe { *r.as_ptr() = 9 };
    // SAFETY: nobody writes while the slices live.
    let (rs, bs) = unsafe { (r.as_slice(), b.as_slice()) };
    assert_eq!((rs[len - 1], bs[0]), (42, 9));

    // The region outlives its creator's handle while an attached one lives.
    drop(r);
    // SAFETY: nobody writes while the slice lives.
    assert_eq!(unsafe { b.as_slice() }[len - 1], 42);
}

#[test]
fn big_regions_are_touched_in_parallel() {
    let a = Arena::new(None);
    let len = 3 * (16 << 20) + 5; // several chunks of the parallel fault-in
    let r = SharedRegion::create(&a, len).expect("create");
    let b = SharedRegion::attach(&a, r.name(), len).expect("attach");
    // SAFETY: nobody writes while the slice lives.
    assert!(unsafe { b.as_slice() }
        .iter()
        .step_by(4096)
        .all(|&x| x == 0));
}

#[test]
fn size_mismatch_is_a_clear_error() {
    let a = Arena::new(None);
    let r = SharedRegion::create(&a, 10_000).expect("create");
    let e = SharedRegion::attach(&a, r.name(), 10_001).expect_err("wrong size");
    assert!(is_invalid(&e, "holds 10000 bytes, expected 10001"), "{e}");
}

#[test]
fn bad_names_are_clear_errors() {
    let a = Arena::new(None);
    for name in [
        "",
        "/dev/shm/x",
        "/proc/self/fd/3",
        "/proc/1/fd/",
        "/proc/1/fd/3/x",
    ] {
        let e = SharedRegion::attach(&a, name, 10).expect_err(name);
        assert!(is_invalid(&e, "is not a shared region name"), "{e}");
    }
    let gone = format!("/proc/{}/fd/999999", std::process::id());
    let e = SharedRegion::attach(&a, &gone, 10).expect_err("no such fd");
    assert!(is_invalid(&e, "cannot open shared region"), "{e}");

    // An ordinary file is refused even at the right size.
    let path = std::env::temp_dir().join(format!("ramtorch-shared-test-{}", std::process::id()));
    let mut f = std::fs::File::create(&path).expect("temp file");
    f.write_all(&[0u8; 10]).expect("write");
    let name = format!("/proc/{}/fd/{}", std::process::id(), f.as_raw_fd());
    let e = SharedRegion::attach(&a, &name, 10).expect_err("not a memfd");
    drop(f);
    let _ = std::fs::remove_file(&path);
    assert!(is_invalid(&e, "not a ramtorch shared region"), "{e}");

    let e = SharedRegion::create(&a, 0).expect_err("empty");
    assert!(is_invalid(&e, "at least one byte"), "{e}");
}

#[test]
fn each_mapping_is_pinned_and_unpinned() {
    let c = Arc::new(Counting::default());
    let a = Arena::new(Some(Box::new(CountingPinner(c.clone()))));
    let r = SharedRegion::create(&a, 5000).expect("create");
    let b = SharedRegion::attach(&a, r.name(), 5000).expect("attach");
    assert!(r.is_pinned() && b.is_pinned());
    assert_eq!(c.pins.load(Ordering::Relaxed), 2);
    drop((r, b));
    assert_eq!(c.unpins.load(Ordering::Relaxed), 2);
    assert_eq!(a.stats().reserved_bytes, 0, "arena counts untouched");
}

#[test]
fn refused_pinning_falls_back_once_with_a_reason() {
    let a = Arena::new(Some(Box::new(Refuse)));
    let r = SharedRegion::create(&a, 4096).expect("pageable fallback");
    assert!(!r.is_pinned() && !a.pins());
    let w = a.take_pin_warning().expect("a warning");
    assert!(
        w.contains("pageable") && w.contains("CUDA_ERROR_OUT_OF_MEMORY"),
        "{w}"
    );
    let b = SharedRegion::attach(&a, r.name(), 4096).expect("attach");
    assert!(!b.is_pinned());
    assert!(a.take_pin_warning().is_none(), "warned once");
}
