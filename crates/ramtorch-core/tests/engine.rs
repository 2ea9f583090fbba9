//! The engine's scheduling, on the host device and on a scripted device whose copies complete
//! only when the test says so.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use ramtorch_core::arena::Arena;
use ramtorch_core::device::{ComputeStream, Device, HostDevice, Lane};
use ramtorch_core::engine::Engine;
use ramtorch_core::Error;

/// The methods of a test device that copies nothing back, has no lane handles, and is named
/// `$name`.
macro_rules! no_copies_back_and_named {
    ($name:literal) => {
        unsafe fn copy_to_host(
            &self,
            _: Lane,
            _: *mut u8,
            _: u64,
            _: usize,
        ) -> ramtorch_core::Result<()> {
            Ok(())
        }
        fn lane_handle(&self, _: Lane) -> u64 {
            0
        }
        fn name(&self) -> String {
            $name.into()
        }
    };
}

/// The default compute stream (on the host device, the calling thread).
const S: ComputeStream = ComputeStream::DEFAULT;

fn host_engine(slots: usize, bytes: usize) -> (Engine<HostDevice>, Vec<Vec<u8>>) {
    let e = Engine::new(HostDevice::new().expect("host device"));
    let mut mem = vec![vec![0u8; bytes]; slots];
    let ptrs: Vec<u64> = mem.iter_mut().map(|s| s.as_mut_ptr() as u64).collect();
    // SAFETY: the slot buffers outlive the engine's use of them.
    unsafe { e.set_slots(&ptrs, bytes) }.expect("slots");
    (e, mem)
}

#[test]
fn acquire_puts_each_units_bytes_in_its_slot() {
    let arena = Arena::new(None);
    let (e, mem) = host_engine(3, 4096);
    let units: Vec<_> = (0..7u8)
        .map(|k| {
            let r = arena.alloc(1000 + k as usize, false).expect("alloc");
            // SAFETY: the region is writable and owned here.
            unsafe { std::ptr::write_bytes(r.as_ptr(), k + 1, r.len()) };
            r
        })
        .collect();
    for (k, u) in units.iter().enumerate() {
        // SAFETY: `u` lives until the end of the test.
        let (slot, ptr) = unsafe { e.acquire(u.as_ptr(), u.len(), 2, S) }.expect("acquire");
        assert_eq!(ptr, mem[slot].as_ptr() as u64);
        // The compute lane (this thread) has waited for the copy: the bytes are there.
        assert!(
            mem[slot][..u.len()].iter().all(|&b| b == k as u8 + 1),
            "unit {k}"
        );
        e.release(slot, S).expect("release");
    }
    let st = e.stats().expect("stats");
    assert_eq!(st.h2d_copies, 7);
    assert_eq!(st.h2d_bytes, (0..7).map(|k| 1000 + k).sum::<u64>());
}

#[test]
fn gradients_come_back_and_are_retired_in_order() {
    let (e, _mem) = host_engine(3, 64);
    let src: Vec<Vec<u8>> = (0..5u8).map(|k| vec![k; 64]).collect();
    let mut dst = vec![vec![0u8; 64]; 5];
    let mut retired = 0;
    for k in 0..5 {
        // SAFETY: both buffers live until synchronize below.
        retired += unsafe { e.copy_to_host(dst[k].as_mut_ptr(), src[k].as_ptr() as u64, 64, 2, S) }
            .expect("d2h");
        assert!(e.in_flight().expect("in flight").1 <= 2);
    }
    retired += e.synchronize().expect("sync");
    assert_eq!(retired, 5, "every copy is reported complete exactly once");
    assert_eq!(dst, src);
}

#[test]
fn holding_every_slot_is_an_error_not_a_hang() {
    let arena = Arena::new(None);
    let r = arena.alloc(8, true).expect("alloc");
    let (e, _mem) = host_engine(2, 8);
    for _ in 0..2 {
        // SAFETY: `r` outlives the engine's use.
        unsafe { e.acquire(r.as_ptr(), 8, 1, S) }.expect("acquire");
    }
    // SAFETY: as above.
    let err = unsafe { e.acquire(r.as_ptr(), 8, 1, S) }.expect_err("no free slot");
    assert!(matches!(err, Error::SlotsExhausted { slots: 2 }), "{err}");
    assert!(
        // SAFETY: the slot buffers outlive the engine's use of them.
        unsafe { e.set_slots(&[], 0) }.is_err(),
        "slots cannot be swapped while held"
    );
    e.release(0, S).expect("release");
    assert!(e.release(0, S).is_err(), "double release is reported");
}

#[test]
fn bad_arguments_are_errors() {
    let arena = Arena::new(None);
    let r = arena.alloc(100, true).expect("alloc");
    let (e, _mem) = host_engine(3, 64);
    // SAFETY: nothing is copied: the calls fail validation.
    let too_big = unsafe { e.acquire(r.as_ptr(), 100, 2, S) }.expect_err("too big");
    assert!(too_big.to_string().contains("does not fit"), "{too_big}");
    // SAFETY: as above.
    let zero = unsafe { e.acquire(r.as_ptr(), 10, 0, S) }.expect_err("max_inflight 0");
    assert!(zero.to_string().contains("max_inflight"), "{zero}");
}

// ---- a scripted device: copies complete only when the test completes them ----

#[derive(Default)]
struct Ev {
    done: AtomicBool,
}

#[derive(Default)]
struct Script {
    pending: Mutex<Vec<Arc<Ev>>>,
    host_blocks: AtomicUsize,
    max_pending_copies: AtomicUsize,
    copies_pending: AtomicUsize,
}

struct Scripted(Arc<Script>);

impl Device for Scripted {
    type Event = Arc<Ev>;
    fn new_event(&self) -> ramtorch_core::Result<Arc<Ev>> {
        Ok(Arc::new(Ev {
            done: AtomicBool::new(true),
        }))
    }
    fn record(&self, ev: &Arc<Ev>, lane: Lane) -> ramtorch_core::Result<()> {
        if lane == Lane::Transfer {
            ev.done.store(false, Ordering::SeqCst);
            self.0.pending.lock().expect("lock").push(ev.clone());
        }
        Ok(())
    }
    fn wait(&self, _: Lane, _: &Arc<Ev>) -> ramtorch_core::Result<()> {
        Ok(())
    }
    fn synchronize(&self, ev: &Arc<Ev>) -> ramtorch_core::Result<()> {
        if !ev.done.swap(true, Ordering::SeqCst) {
            self.0.host_blocks.fetch_add(1, Ordering::SeqCst);
            self.0.copies_pending.fetch_sub(1, Ordering::SeqCst);
        }
        Ok(())
    }
    fn is_complete(&self, ev: &Arc<Ev>) -> ramtorch_core::Result<bool> {
        Ok(ev.done.load(Ordering::SeqCst))
    }
    fn synchronize_lane(&self, _: Lane) -> ramtorch_core::Result<()> {
        for ev in self.0.pending.lock().expect("lock").drain(..) {
            if !ev.done.swap(true, Ordering::SeqCst) {
                self.0.copies_pending.fetch_sub(1, Ordering::SeqCst);
            }
        }
        Ok(())
    }
    unsafe fn copy_to_device(
        &self,
        _: Lane,
        _: u64,
        _: *const u8,
        _: usize,
    ) -> ramtorch_core::Result<()> {
        let now = self.0.copies_pending.fetch_add(1, Ordering::SeqCst) + 1;
        self.0.max_pending_copies.fetch_max(now, Ordering::SeqCst);
        Ok(())
    }
    no_copies_back_and_named!("scripted");
}

#[test]
fn throttle_bounds_copies_in_flight_and_blocks_only_when_needed() {
    for max_inflight in [1usize, 2, 4] {
        let script = Arc::new(Script::default());
        let e = Engine::new(Scripted(script.clone()));
        let ptrs: Vec<u64> = (0..=max_inflight as u64)
            .map(|i| 0x1000 * (i + 1))
            .collect();
        // SAFETY: the slot buffers outlive the engine's use of them.
        unsafe { e.set_slots(&ptrs, 64) }.expect("slots");
        let src = [0u8; 64];
        for _ in 0..20 {
            // SAFETY: the scripted device never touches memory.
            let (slot, _) =
                unsafe { e.acquire(src.as_ptr(), 64, max_inflight, S) }.expect("acquire");
            e.release(slot, S).expect("release");
            assert!(e.in_flight().expect("in flight").0 <= max_inflight);
        }
        assert_eq!(
            script.max_pending_copies.load(Ordering::SeqCst),
            max_inflight,
            "never more than MAX_INFLIGHT copies"
        );
        // The first `max_inflight` copies go out without blocking; each later one waits for one.
        assert_eq!(script.host_blocks.load(Ordering::SeqCst), 20 - max_inflight);
        assert_eq!(
            e.stats().expect("stats").throttle_waits,
            (20 - max_inflight) as u64
        );
    }
}

#[test]
fn finished_copies_do_not_block() {
    let script = Arc::new(Script::default());
    let e = Engine::new(Scripted(script.clone()));
    // SAFETY: the slot buffers outlive the engine's use of them.
    unsafe { e.set_slots(&[0x1000, 0x2000, 0x3000], 64) }.expect("slots");
    let src = [0u8; 64];
    for _ in 0..10 {
        // SAFETY: the scripted device never touches memory.
        let (slot, _) = unsafe { e.acquire(src.as_ptr(), 64, 2, S) }.expect("acquire");
        e.release(slot, S).expect("release");
        e.device()
            .synchronize_lane(Lane::Transfer)
            .expect("device catches up");
    }
    assert_eq!(script.host_blocks.load(Ordering::SeqCst), 0);
}

#[test]
fn slots_round_robin_skipping_held_ones() {
    let script = Arc::new(Script::default());
    let e = Engine::new(Scripted(script));
    // SAFETY: the slot buffers outlive the engine's use of them.
    unsafe { e.set_slots(&[0x1000, 0x2000, 0x3000], 64) }.expect("slots");
    let src = [0u8; 64];
    // SAFETY: the scripted device never touches memory.
    let a = unsafe { e.acquire(src.as_ptr(), 64, 2, S) }.expect("a").0;
    // SAFETY: as above.
    let b = unsafe { e.acquire(src.as_ptr(), 64, 2, S) }.expect("b").0;
    e.release(b, S).expect("release b");
    // SAFETY: as above.
    let c = unsafe { e.acquire(src.as_ptr(), 64, 2, S) }.expect("c").0;
    // SAFETY: as above.
    let d = unsafe { e.acquire(src.as_ptr(), 64, 2, S) }.expect("d").0;
    assert_eq!((a, b, c), (0, 1, 2));
    assert_eq!(d, 1, "slot 0 is still held, slot 1 was released");
}

#[test]
fn prefetch_then_claim_and_keyed_slots_are_reused_without_a_copy() {
    let (e, mem) = host_engine(3, 64);
    let units: Vec<Vec<u8>> = (0..4u8).map(|k| vec![k + 10; 64]).collect();
    // Prefetch two units ahead, claim them later.
    // SAFETY: the unit buffers live until the end of the test.
    let (a, _, copied_a) =
        unsafe { e.prefetch(Some(1), units[0].as_ptr(), 64, 2, &[], 1) }.expect("a");
    // SAFETY: as above.
    let (b, _, copied_b) =
        unsafe { e.prefetch(Some(2), units[1].as_ptr(), 64, 2, &[], 2) }.expect("b");
    assert!(copied_a && copied_b && a != b);
    e.claim(a, S, 1).expect("claim a");
    assert!(mem[a].iter().all(|&x| x == 10));
    e.claim(b, S, 2).expect("claim b");
    assert!(mem[b].iter().all(|&x| x == 11));
    e.release(a, S).expect("release a");
    e.release(b, S).expect("release b");
    // Same key again: the slot still holds it, no copy.
    // SAFETY: as above.
    let (b2, _, copied) =
        unsafe { e.prefetch(Some(2), units[1].as_ptr(), 64, 2, &[], 2) }.expect("b2");
    assert_eq!((b2, copied), (b, false));
    // A key already held is an error, not a second copy.
    // SAFETY: as above.
    let err = unsafe { e.prefetch(Some(2), units[1].as_ptr(), 64, 2, &[], 2) };
    assert!(matches!(err, Err(Error::InvalidArgument(_))));
    e.release(b2, S).expect("release b2");
    let st = e.stats().expect("stats");
    assert_eq!((st.h2d_copies, st.reuses, st.reused_bytes), (2, 1, 64));
    // After invalidate the key is copied again.
    e.invalidate().expect("invalidate");
    // SAFETY: as above.
    let (_, _, copied) =
        unsafe { e.prefetch(Some(2), units[1].as_ptr(), 64, 2, &[], 2) }.expect("b3");
    assert!(copied);
    // The slots and units are freed after this: the copies must be done.
    e.synchronize().expect("sync");
}

#[test]
fn eviction_prefers_empty_slots_then_keys_not_kept() {
    let (e, _mem) = host_engine(3, 16);
    let u = [7u8; 16];
    let mut slot_of = std::collections::HashMap::new();
    for key in [1u64, 2, 3] {
        // SAFETY: `u` lives until the end of the test.
        let (i, _, _) =
            unsafe { e.prefetch(Some(key), u.as_ptr(), 16, 2, &[], 0) }.expect("prefetch");
        e.release(i, S).expect("release");
        slot_of.insert(key, i);
    }
    // Key 1 is the least recently used, but it is kept: key 2's slot goes instead.
    // SAFETY: as above.
    let (i, _, copied) = unsafe { e.prefetch(Some(4), u.as_ptr(), 16, 2, &[1, 3], 0) }.expect("4");
    assert!(copied);
    assert_eq!(i, slot_of[&2]);
    e.release(i, S).expect("release");
    // Without a keep list the least recently used goes: key 1.
    // SAFETY: as above.
    let (i, _, _) = unsafe { e.prefetch(Some(5), u.as_ptr(), 16, 2, &[], 0) }.expect("5");
    assert_eq!(i, slot_of[&1]);
    e.synchronize().expect("sync");
}

#[test]
fn copies_and_waits_are_timed_and_traced() {
    let (e, _mem) = host_engine(3, 1 << 20);
    let u = vec![1u8; 1 << 20];
    let mut back = vec![0u8; 1 << 20];
    e.trace_start(S).expect("trace");
    for tag in 1..=4u64 {
        // SAFETY: `u` lives until the end of the test.
        let (i, ptr) = unsafe { e.acquire(u.as_ptr(), u.len(), 2, S) }.expect("acquire");
        e.mark(S, tag, 7).expect("mark");
        // SAFETY: `back` lives until synchronize below; the slot is held.
        unsafe { e.copy_to_host_tagged(back.as_mut_ptr(), ptr, 1 << 20, 2, S, tag) }.expect("d2h");
        e.release(i, S).expect("release");
    }
    e.synchronize().expect("sync");
    let recs = e.trace_stop().expect("trace stop");
    let st = e.stats().expect("stats");
    assert_eq!(st.h2d_timed_bytes, 4 << 20);
    assert_eq!(st.d2h_timed_bytes, 4 << 20);
    assert!(st.h2d_seconds > 0.0 && st.d2h_seconds > 0.0);
    assert_eq!(st.claims, 4);
    let count = |k: &str| recs.iter().filter(|r| r.kind == k).count();
    assert_eq!(
        (count("h2d"), count("d2h"), count("wait"), count("mark")),
        (4, 4, 4, 4)
    );
    assert!(recs
        .iter()
        .all(|r| r.end_ms >= r.start_ms && r.start_ms >= 0.0));
    assert!(recs
        .iter()
        .filter(|r| r.kind == "mark")
        .all(|r| r.code == 7));
    assert_eq!(back, u);
}

#[test]
fn markers_wait_for_the_copies_queued_before_them() {
    let (e, _mem) = host_engine(3, 1 << 16);
    let src = vec![3u8; 1 << 16];
    let mut dst = vec![0u8; 1 << 16];
    let (i, ptr) = {
        // SAFETY: `src` lives until the end of the test.
        unsafe { e.acquire(src.as_ptr(), src.len(), 2, S) }.expect("acquire")
    };
    // SAFETY: `dst` lives until the marker below has been waited for.
    unsafe { e.copy_to_host(dst.as_mut_ptr(), ptr, 1 << 16, 2, S) }.expect("d2h");
    let m = e.marker().expect("marker");
    // Polled until done (the host device's copy thread finishes it), then waited for.
    let t = std::time::Instant::now();
    while !e.marker_done(m).expect("query") {
        assert!(t.elapsed().as_secs() < 10, "marker never done");
        std::thread::yield_now();
    }
    e.wait_marker(m).expect("wait");
    assert_eq!(dst, src);
    assert!(matches!(e.wait_marker(m), Err(Error::InvalidArgument(_))));
    assert!(matches!(e.marker_done(m), Err(Error::InvalidArgument(_))));
    e.release(i, S).expect("release");
    e.synchronize().expect("sync");
}

// ---- a copy in parts: each part's event, and claims that wait for a prefix only ----

/// A device that logs its copies (offset into the slot, length), the events recorded after
/// them, and the events the compute lane waits for; events are numbered as recorded.
#[derive(Default)]
struct Log {
    ops: Mutex<Vec<String>>,
    next: AtomicUsize,
}

struct Logging(Arc<Log>, u64);

impl Device for Logging {
    type Event = Arc<AtomicUsize>;
    fn new_event(&self) -> ramtorch_core::Result<Arc<AtomicUsize>> {
        Ok(Arc::new(AtomicUsize::new(usize::MAX)))
    }
    fn record(&self, ev: &Arc<AtomicUsize>, lane: Lane) -> ramtorch_core::Result<()> {
        if lane == Lane::Transfer {
            let n = self.0.next.fetch_add(1, Ordering::SeqCst);
            ev.store(n, Ordering::SeqCst);
            self.0.ops.lock().expect("lock").push(format!("record {n}"));
        }
        Ok(())
    }
    fn wait(&self, lane: Lane, ev: &Arc<AtomicUsize>) -> ramtorch_core::Result<()> {
        if lane != Lane::Transfer {
            let n = ev.load(Ordering::SeqCst);
            self.0.ops.lock().expect("lock").push(format!("wait {n}"));
        }
        Ok(())
    }
    fn synchronize(&self, _: &Arc<AtomicUsize>) -> ramtorch_core::Result<()> {
        Ok(())
    }
    fn is_complete(&self, _: &Arc<AtomicUsize>) -> ramtorch_core::Result<bool> {
        Ok(true)
    }
    fn synchronize_lane(&self, _: Lane) -> ramtorch_core::Result<()> {
        Ok(())
    }
    unsafe fn copy_to_device(
        &self,
        _: Lane,
        dst: u64,
        _: *const u8,
        n: usize,
    ) -> ramtorch_core::Result<()> {
        let at = dst - self.1;
        self.0
            .ops
            .lock()
            .expect("lock")
            .push(format!("copy {at}+{n}"));
        Ok(())
    }
    no_copies_back_and_named!("logging");
}

#[test]
fn a_copy_in_parts_lets_a_claim_wait_for_a_prefix_only() {
    let log = Arc::new(Log::default());
    let e = Engine::new(Logging(log.clone(), 0x1000));
    // SAFETY: the logging device never touches memory.
    unsafe { e.set_slots(&[0x1000], 100) }.expect("slots");
    let arena = Arena::new(None);
    let r = arena.alloc(100, false).expect("alloc");
    let src = r.slice(0, 100).expect("slice");
    let (slot, _, copied) = e
        .prefetch_parts(Some(7), &src, 2, &[], 0, &[30, 60])
        .expect("prefetch");
    assert!(copied);
    for upto in [1, 30, 31, 60, 61, 100, 1000] {
        e.claim_part(slot, S, upto, 0).expect("claim part");
    }
    e.claim(slot, S, 0).expect("claim");
    let ops = std::mem::take(&mut *log.ops.lock().expect("lock"));
    // Three pieces, an event after each of the first two; a prefix waits for the first part
    // that covers it, and a prefix past the last part for the whole copy (the event recorded
    // last), as a claim does.
    let copies: Vec<&str> = ops
        .iter()
        .filter(|o| o.starts_with("copy"))
        .map(|o| o.as_str())
        .collect();
    assert_eq!(copies, ["copy 0+30", "copy 30+30", "copy 60+40"]);
    let after = |c: &str| {
        let i = ops.iter().position(|o| o == c).expect("copied");
        ops[i + 1].replace("record", "wait")
    };
    let (p0, p1) = (after("copy 0+30"), after("copy 30+30"));
    let whole = ops
        .iter()
        .rfind(|o| o.starts_with("record"))
        .expect("recorded")
        .replace("record", "wait");
    let waits: Vec<String> = ops
        .iter()
        .filter(|o| o.starts_with("wait"))
        .cloned()
        .collect();
    assert_eq!(
        waits,
        [p0.as_str(), &p0, &p1, &p1, &whole, &whole, &whole, &whole]
    );
    // Reused without a copy: the parts still describe the slot's bytes.
    e.release(slot, S).expect("release");
    let (again, _, copied) = e
        .prefetch_parts(Some(7), &src, 2, &[], 0, &[])
        .expect("reuse");
    assert!(!copied);
    e.claim_part(again, S, 10, 0).expect("claim part");
    assert_eq!(log.ops.lock().expect("lock").as_slice(), [p0]);
    // A new copy without parts: a claim of a prefix waits for the whole copy.
    e.release(again, S).expect("release");
    e.invalidate().expect("invalidate");
    log.ops.lock().expect("lock").clear();
    let (slot, _, _) = e
        .prefetch_parts(Some(7), &src, 2, &[], 0, &[])
        .expect("copy");
    e.claim_part(slot, S, 10, 0).expect("claim part");
    let ops = std::mem::take(&mut *log.ops.lock().expect("lock"));
    let whole = ops
        .iter()
        .rfind(|o| o.starts_with("record"))
        .expect("recorded")
        .replace("record", "wait");
    assert_eq!(ops.iter().filter(|o| o.starts_with("copy")).count(), 1);
    assert_eq!(ops.last(), Some(&whole));
    e.release(slot, S).expect("release");
}

#[test]
fn copy_parts_out_of_order_or_outside_the_copy_are_errors() {
    let (e, _mem) = host_engine(2, 64);
    let arena = Arena::new(None);
    let r = arena.alloc(64, false).expect("alloc");
    let src = r.slice(0, 64).expect("slice");
    for parts in [&[20usize, 20][..], &[30, 10], &[0], &[64], &[10, 100]] {
        let err = e
            .prefetch_parts(None, &src, 2, &[], 0, parts)
            .expect_err("bad parts");
        assert!(matches!(err, Error::InvalidArgument(_)), "{parts:?}: {err}");
    }
    // Nothing was taken: both slots are free.
    for _ in 0..2 {
        e.prefetch_parts(None, &src, 2, &[], 0, &[])
            .expect("prefetch");
    }
    let held = e.claim_part(5, S, 1, 0).expect_err("no such slot");
    assert!(held.to_string().contains("no device slot 5"), "{held}");
    e.synchronize().expect("sync");
}

#[test]
fn a_copy_in_parts_on_the_host_device_puts_every_byte_in_place() {
    let (e, mem) = host_engine(1, 256);
    let arena = Arena::new(None);
    let r = arena.alloc(200, false).expect("alloc");
    // SAFETY: the region is writable and owned here.
    unsafe {
        std::ptr::copy_nonoverlapping((0..200u8).collect::<Vec<_>>().as_ptr(), r.as_ptr(), 200)
    };
    let src = r.slice(0, 200).expect("slice");
    let (slot, _, _) = e
        .prefetch_parts(None, &src, 2, &[], 0, &[1, 77, 199])
        .expect("prefetch");
    e.claim_part(slot, S, 77, 0).expect("claim part");
    e.claim(slot, S, 0).expect("claim");
    assert_eq!(&mem[slot][..200], (0..200u8).collect::<Vec<_>>().as_slice());
    e.release(slot, S).expect("release");
    e.synchronize().expect("sync");
}

// ---- gradient copies: lane events, polled by the throttle ----

/// A device whose gradient copies complete on another thread some time after they are queued;
/// it counts the lane events made, the host's blocking waits and its queries of events.
#[derive(Default)]
struct Slow {
    lane_events: AtomicUsize,
    blocking_waits: AtomicUsize,
    queries: AtomicUsize,
}

struct Delayed(Arc<Slow>, std::time::Duration);

impl Device for Delayed {
    type Event = Arc<AtomicBool>;
    fn new_event(&self) -> ramtorch_core::Result<Arc<AtomicBool>> {
        Ok(Arc::new(AtomicBool::new(true)))
    }
    fn new_lane_event(&self) -> ramtorch_core::Result<Arc<AtomicBool>> {
        self.0.lane_events.fetch_add(1, Ordering::SeqCst);
        self.new_event()
    }
    fn record(&self, ev: &Arc<AtomicBool>, lane: Lane) -> ramtorch_core::Result<()> {
        if lane == Lane::Gradient {
            ev.store(false, Ordering::SeqCst);
            let (ev, delay) = (ev.clone(), self.1);
            std::thread::spawn(move || {
                std::thread::sleep(delay);
                ev.store(true, Ordering::SeqCst);
            });
        }
        Ok(())
    }
    fn wait(&self, _: Lane, _: &Arc<AtomicBool>) -> ramtorch_core::Result<()> {
        Ok(())
    }
    fn synchronize(&self, ev: &Arc<AtomicBool>) -> ramtorch_core::Result<()> {
        self.0.blocking_waits.fetch_add(1, Ordering::SeqCst);
        while !ev.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        Ok(())
    }
    fn is_complete(&self, ev: &Arc<AtomicBool>) -> ramtorch_core::Result<bool> {
        self.0.queries.fetch_add(1, Ordering::SeqCst);
        Ok(ev.load(Ordering::SeqCst))
    }
    fn synchronize_lane(&self, _: Lane) -> ramtorch_core::Result<()> {
        Ok(())
    }
    unsafe fn copy_to_device(
        &self,
        _: Lane,
        _: u64,
        _: *const u8,
        _: usize,
    ) -> ramtorch_core::Result<()> {
        Ok(())
    }
    no_copies_back_and_named!("delayed");
}

#[test]
fn the_throttle_polls_gradient_copies_until_they_complete() {
    let delay = std::time::Duration::from_millis(20);
    let slow = Arc::new(Slow::default());
    let e = Engine::new(Delayed(slow.clone(), delay));
    let src = [0u8; 64];
    let mut dst = [0u8; 64];
    let t = std::time::Instant::now();
    for _ in 0..3 {
        // SAFETY: the delayed device never touches memory.
        unsafe { e.copy_to_host(dst.as_mut_ptr(), src.as_ptr() as u64, 64, 1, S) }.expect("d2h");
    }
    // One copy in flight at most: the second and third each waited for the one before.
    assert!(t.elapsed() >= 2 * delay, "{:?}", t.elapsed());
    assert!(e.in_flight().expect("in flight").1 <= 1);
    // Polled, never a blocking wait; its events (and the compute mark) are lane events.
    assert_eq!(slow.blocking_waits.load(Ordering::SeqCst), 0);
    assert!(slow.lane_events.load(Ordering::SeqCst) >= 2);
    assert_eq!(e.stats().expect("stats").throttle_waits, 2);
}

#[test]
fn queueing_gradient_copies_asks_the_device_about_a_few_events_each_not_every_pending_one() {
    // The copies stay pending for the whole test: each asks about its own timing's and the
    // throttle's front events, not about the timings of every copy queued before it.
    let slow = Arc::new(Slow::default());
    let e = Engine::new(Delayed(slow.clone(), std::time::Duration::from_secs(2)));
    let src = [0u8; 64];
    let mut dst = [0u8; 64];
    let n = 48;
    for _ in 0..n {
        // SAFETY: the delayed device never touches memory.
        unsafe { e.copy_to_host(dst.as_mut_ptr(), src.as_ptr() as u64, 64, 64, S) }.expect("d2h");
    }
    assert_eq!(e.in_flight().expect("in flight").1, n);
    let queries = slow.queries.load(Ordering::SeqCst);
    // Scanning every pending timing on each copy asked about n * (n - 1) / 2 of them (1175
    // queries in all here).
    assert!(queries <= 4 * n, "{queries} queries for {n} copies");
}

#[test]
fn a_copys_part_events_are_lane_events() {
    let slow = Arc::new(Slow::default());
    let e = Engine::new(Delayed(slow.clone(), std::time::Duration::ZERO));
    // SAFETY: the delayed device never touches memory.
    unsafe { e.set_slots(&[0x1000], 100) }.expect("slots");
    let arena = Arena::new(None);
    let r = arena.alloc(100, false).expect("alloc");
    let src = r.slice(0, 100).expect("slice");
    let (slot, _, _) = e
        .prefetch_parts(Some(7), &src, 2, &[], 0, &[30, 60])
        .expect("prefetch");
    assert_eq!(
        slow.lane_events.load(Ordering::SeqCst),
        2,
        "one per part but the last"
    );
    e.claim_part(slot, S, 40, 0).expect("claim part");
    e.release(slot, S).expect("release");
}
