//! The host arena: exact sizes, the pool, pinning and its fallback.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use common::{Counting, CountingPinner, Refuse};
use ramtorch_core::arena::Arena;

/// Regions at least this large are faulted in by several threads (as the arena does).
const PARALLEL_TOUCH_BYTES: usize = 64 << 20;

fn page_size() -> usize {
    Arena::new(None).page_size()
}

#[test]
fn exact_sizes_and_page_rounding() {
    let a = Arena::new(None);
    let r = a.alloc(10_000, true).expect("alloc");
    assert_eq!(r.len(), 10_000);
    let s = a.stats();
    assert_eq!(s.in_use_bytes, 10_000);
    assert_eq!(
        s.reserved_bytes,
        10_000usize.div_ceil(page_size()) * page_size()
    );
    assert_eq!(s.pinned_bytes, 0);
    assert!(unsafe { r.as_slice() }.iter().all(|&b| b == 0));
}

#[test]
fn pool_recycles_and_zeroes_on_request() {
    let a = Arena::new(None);
    let r = a.alloc(5000, false).expect("alloc");
    let p = r.as_ptr();
    // SAFETY: the region is 5000 writable bytes owned here.
    unsafe { std::ptr::write_bytes(p, 7, 5000) };
    drop(r);
    assert_eq!(a.stats().in_use_bytes, 0);
    assert!(a.stats().pooled_bytes > 0);
    let r2 = a.alloc(5000, true).expect("alloc");
    assert_eq!(
        r2.as_ptr(),
        p,
        "same-size allocation reuses the pooled mapping"
    );
    assert!(unsafe { r2.as_slice() }.iter().all(|&b| b == 0));
    drop(r2);
    a.empty_cache();
    let s = a.stats();
    assert_eq!((s.reserved_bytes, s.pooled_bytes), (0, 0));
}

#[test]
fn pinned_memory_stays_pinned_in_the_pool() {
    let c = Arc::new(Counting::default());
    let a = Arena::new(Some(Box::new(CountingPinner(c.clone()))));
    for _ in 0..5 {
        let r = a.alloc(1 << 20, false).expect("alloc");
        assert!(r.is_pinned());
    }
    assert_eq!(c.pins.load(Ordering::Relaxed), 1);
    assert_eq!(a.stats().pinned_bytes, 1 << 20);
    a.empty_cache();
    assert_eq!(c.unpins.load(Ordering::Relaxed), 1);
    assert_eq!(a.stats().pinned_bytes, 0);
}

/// Memory asked for unpinned is never pinned, and pinned and unpinned mappings of one size
/// are pooled apart: neither kind is handed out for the other.
#[test]
fn unpinned_regions_stay_unpinned_and_pool_apart() {
    let c = Arc::new(Counting::default());
    let a = Arena::new(Some(Box::new(CountingPinner(c.clone()))));
    let r = a.alloc_with(1 << 20, true, false).expect("alloc");
    assert!(!r.is_pinned());
    drop(r);
    assert_eq!(c.pins.load(Ordering::Relaxed), 0);
    let p = a.alloc(1 << 20, false).expect("alloc");
    assert!(
        p.is_pinned(),
        "the pooled unpinned mapping was handed out as pinned memory"
    );
    assert_eq!(c.pins.load(Ordering::Relaxed), 1);
    let u = a.alloc_with(1 << 20, false, false).expect("alloc");
    assert!(!u.is_pinned());
    assert_eq!(
        c.pins.load(Ordering::Relaxed),
        1,
        "the unpinned mapping was reused, not pinned"
    );
    let s = a.stats();
    assert_eq!((s.pinned_bytes, s.pageable_bytes), (1 << 20, 1 << 20));
    drop((p, u));
    a.empty_cache();
    assert_eq!(c.unpins.load(Ordering::Relaxed), 1);
}

#[test]
fn refused_pinning_falls_back_once_with_a_reason() {
    let a = Arena::new(Some(Box::new(Refuse)));
    let r = a.alloc(1 << 16, true).expect("pageable fallback");
    assert!(!r.is_pinned());
    assert!(!a.pins());
    let w = a.take_pin_warning().expect("a warning");
    assert!(
        w.contains("pageable") && w.contains("CUDA_ERROR_OUT_OF_MEMORY"),
        "{w}"
    );
    assert!(a.take_pin_warning().is_none(), "warned once");
    let s = a.stats();
    assert_eq!(s.pageable_bytes, s.reserved_bytes);
}

#[test]
fn big_regions_are_touched_in_parallel_and_zero() {
    let a = Arena::new(None);
    let r = a.alloc(PARALLEL_TOUCH_BYTES + 123, true).expect("alloc");
    let s = unsafe { r.as_slice() };
    assert!(s.iter().step_by(4096).all(|&b| b == 0));
}
