//! Host memory is reached through slices the arena hands out: a range outside a live region is
//! refused, and a queued copy keeps the memory it reads or writes mapped until it has retired.

use ramtorch_core::arena::{Arena, HostSlice};
use ramtorch_core::device::{ComputeStream, HostDevice};
use ramtorch_core::engine::Engine;

/// The default compute stream (on the host device, the calling thread).
const S: ComputeStream = ComputeStream::DEFAULT;
use ramtorch_core::shared::SharedRegion;
use ramtorch_core::Error;

fn host_engine(slots: usize, bytes: usize) -> (Engine<HostDevice>, Vec<Vec<u8>>) {
    let e = Engine::new(HostDevice::new().expect("host device"));
    let mut mem = vec![vec![0u8; bytes]; slots];
    let ptrs: Vec<u64> = mem.iter_mut().map(|s| s.as_mut_ptr() as u64).collect();
    // SAFETY: the slot buffers outlive the engine's use of them (the engine is dropped first).
    unsafe { e.set_slots(&ptrs, bytes) }.expect("slots");
    (e, mem)
}

fn refused(r: ramtorch_core::Result<impl std::fmt::Debug>) -> String {
    match r {
        Err(Error::InvalidArgument(m)) => m,
        other => panic!("expected an InvalidArgument, got {other:?}"),
    }
}

#[test]
fn slices_lie_inside_live_regions_only() {
    let a = Arena::new(None);
    let r = a.alloc(10_000, true).expect("alloc");
    let base = r.as_ptr() as usize;
    for (off, len) in [(0, 10_000), (1, 9_999), (5_000, 100), (10_000, 0)] {
        let s = a.slice(base + off, len).expect("inside");
        assert_eq!((s.as_ptr() as usize, s.len()), (base + off, len));
    }
    for (addr, len) in [
        (base, 10_001),
        (base + 9_999, 2),
        (base - 1, 2),
        (0, 8),
        (usize::MAX - 3, 8),
        (base + 10_000 + 4096, 1),
    ] {
        let m = refused(a.slice(addr, len));
        assert!(m.contains("not inside memory ramtorch allocated"), "{m}");
    }
    assert!(r.slice(9_000, 1_001).is_err());
    assert!(r.slice(usize::MAX, 2).is_err());
    drop(r);
    refused(a.slice(base, 1));
}

#[test]
fn shared_regions_are_known_while_alive() {
    let a = Arena::new(None);
    let s = SharedRegion::create(&a, 5000).expect("shared");
    let base = s.as_ptr() as usize;
    a.slice(base, 5000).expect("inside");
    refused(a.slice(base, 5001));
    drop(s);
    refused(a.slice(base, 1));
}

#[test]
fn a_lease_keeps_a_region_out_of_the_pool() {
    let a = Arena::new(None);
    let r = a.alloc(8192, false).expect("alloc");
    let lease = r.lease();
    drop(r);
    a.empty_cache();
    let s = a.stats();
    assert_eq!((s.regions, s.pooled_bytes), (1, 0), "still live");
    assert_eq!(s.reserved_bytes, 8192, "not returned to the OS");
    drop(lease);
    assert_eq!(a.stats().regions, 0);
    a.empty_cache();
    assert_eq!(a.stats().reserved_bytes, 0);
}

/// The source of a queued copy, dropped and trimmed by its owner right after the prefetch (what
/// `del model; empty_cache()` does after a pass that prefetched the next one), stays mapped until
/// the engine has seen the copy complete; its bytes arrive intact.
#[test]
fn a_queued_copy_keeps_its_source_mapped() {
    let a = Arena::new(None);
    let (e, mem) = host_engine(3, 4096);
    for round in 0..20u8 {
        let r = a.alloc(4096, false).expect("alloc");
        // SAFETY: the region is writable and owned here.
        unsafe { std::ptr::write_bytes(r.as_ptr(), round, 4096) };
        let src = r.slice(0, 4096).expect("slice");
        let (slot, _, copied) = e.prefetch_slice(None, &src, 2, &[], 0).expect("prefetch");
        assert!(copied);
        drop((src, r));
        a.empty_cache();
        assert_eq!(
            a.stats().reserved_bytes,
            4096,
            "the copy's source was unmapped while queued"
        );
        e.claim(slot, S, 0).expect("claim");
        assert!(mem[slot].iter().all(|&b| b == round), "round {round}");
        e.release(slot, S).expect("release");
        e.synchronize().expect("sync");
        a.empty_cache();
        assert_eq!(a.stats().reserved_bytes, 0, "retired copies let go");
    }
    drop(e);
}

#[test]
fn a_queued_gradient_copy_keeps_its_destination_mapped() {
    let a = Arena::new(None);
    let (e, _mem) = host_engine(2, 64);
    let grad: Vec<u8> = (0..64).collect();
    let r = a.alloc(64, true).expect("alloc");
    let dst = r.slice(0, 64).expect("slice");
    // SAFETY: `grad` (the device side) outlives the copy (synchronize below).
    unsafe { e.copy_to_host_slice(&dst, grad.as_ptr() as u64, 2, S, 0) }.expect("copy");
    let keep = r.lease();
    drop((dst, r));
    a.empty_cache();
    assert_eq!(a.stats().regions, 1);
    e.synchronize().expect("sync");
    drop(keep);
    a.empty_cache();
    assert_eq!(a.stats().reserved_bytes, 0);
}

#[test]
fn slots_must_be_distinct_and_non_null() {
    let e = Engine::new(HostDevice::new().expect("host device"));
    // SAFETY: refused before any use.
    let m = refused(unsafe { e.set_slots(&[0x1000, 0], 64) });
    assert!(m.contains("null"), "{m}");
    // SAFETY: as above.
    let m = refused(unsafe { e.set_slots(&[0x1000, 0x1020], 64) });
    assert!(m.contains("overlap"), "{m}");
    // SAFETY: as above.
    let m = refused(unsafe { e.set_slots(&[u64::MAX - 8], 64) });
    assert!(m.contains("overflows"), "{m}");
}

#[test]
fn a_slot_guard_releases_on_drop_even_on_an_early_exit() {
    let a = Arena::new(None);
    let (e, mem) = host_engine(2, 64);
    let r = a.alloc(64, false).expect("alloc");
    // SAFETY: the region is writable and owned here.
    unsafe { std::ptr::write_bytes(r.as_ptr(), 9, 64) };
    let src = r.slice(0, 64).expect("slice");
    let failing = || -> ramtorch_core::Result<()> {
        let g = e.borrow(&src, 1, S)?;
        assert!(mem[g.index()].iter().all(|&b| b == 9));
        assert_eq!(g.device_ptr(), mem[g.index()].as_ptr() as u64);
        Err(Error::InvalidArgument("the caller's work failed".into()))
    };
    for _ in 0..5 {
        assert!(failing().is_err());
    }
    let (g1, copied) = e.prefetch_guarded(Some(1), &src, 1, &[], S).expect("1");
    assert!(copied);
    let (g2, _) = e.prefetch_guarded(Some(2), &src, 1, &[], S).expect("2");
    g1.claim().expect("claim");
    let full = e.prefetch_guarded(Some(3), &src, 1, &[], S);
    assert!(matches!(full, Err(Error::SlotsExhausted { slots: 2 })));
    g2.release().expect("release");
    drop(g1);
    let (g1, copied) = e.prefetch_guarded(Some(1), &src, 1, &[], S).expect("again");
    assert!(!copied, "the released slot still holds unit 1");
    drop(g1);
    e.synchronize().expect("sync");
}

#[test]
fn an_empty_slice_copies_nothing() {
    let (e, _mem) = host_engine(2, 64);
    let (slot, _) = e.acquire_slice(&HostSlice::empty(), 2, S).expect("acquire");
    e.release(slot, S).expect("release");
    e.synchronize().expect("sync");
}
