//! The streamer: device slots, the copy throttle and the gradient write-back of one device.
//!
//! The life of a unit's weights, all in this file:
//!
//! 1. **acquire** — pick the next slot nobody holds; the transfer lane waits until the compute
//!    lane has released that slot (a device-side wait, the host does not block), copies the unit's
//!    host region into it and records a copy event; the caller's compute lane waits for that event
//!    only. If `max_inflight` copies are already in flight, the host first blocks on the oldest
//!    (the throttle): at most `max_inflight` copies are queued, over `max_inflight + 1` slots.
//! 2. the caller launches its kernels on the slot's memory;
//! 3. **release** — records the slot's free event on the compute lane: the slot is rewritten only
//!    after the kernels queued so far have run.
//! 4. **copy_to_host** — a gradient leaves on the gradient lane after the compute lane's work so far
//!    (full duplex with the transfer lane), throttled the same way; the call reports how many earlier
//!    gradient copies have completed so the caller can free their device buffers in order.
//! 5. **synchronize** — end of backward: both engine lanes drained, every gradient is on the host.
//!
//! Acquire is two steps that a caller may split: **prefetch** issues the copy into a slot (the
//! slot is then held) and **claim** makes a compute lane wait for it. A caller that knows the
//! order of units (the itinerary) prefetches ahead and claims at the point of use, so the copy
//! overlaps the compute queued in between. A prefetch may name the unit by a key: a released slot
//! still holding that key's bytes is handed back without a copy (the last unit of a forward pass
//! is the first of the backward pass), and eviction skips the keys the caller says it needs soon.
//!
//! Copies and compute-lane waits are timed with device events, harvested lazily once complete:
//! achieved bandwidth and the time compute waited on copies come from them, and, while a trace is
//! on, per-unit records for a Chrome trace.
//!
//! Slot memory belongs to the caller (torch's caching allocator, so torch's memory accounting sees
//! it); the engine only holds its addresses.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::arena::{HostSlice, Lease};
use crate::device::{ComputeStream, Device, Lane};
use crate::error::{Error, Result};

/// Default of `MAX_INFLIGHT`: copies in flight per device.
pub const DEFAULT_MAX_INFLIGHT: usize = 2;
/// Upper bound accepted for `MAX_INFLIGHT` (each step of it costs one slot of device memory).
pub const MAX_MAX_INFLIGHT: usize = 64;

/// Checks a `MAX_INFLIGHT` value.
pub fn validate_max_inflight(n: usize) -> Result<usize> {
    if (1..=MAX_MAX_INFLIGHT).contains(&n) {
        Ok(n)
    } else {
        Err(Error::InvalidArgument(format!(
            "max_inflight must be between 1 and {MAX_MAX_INFLIGHT}, got {n}"
        )))
    }
}

/// A point in the engine's copy lanes captured by [`Engine::marker`], to wait for from any thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Marker(u64);

impl Marker {
    /// The marker with id `raw` (as [`Marker::raw`] gave it).
    pub const fn from_raw(raw: u64) -> Self {
        Self(raw)
    }

    /// The marker's id.
    pub const fn raw(self) -> u64 {
        self.0
    }
}

/// Counters of one engine, as `ramtorch.stats()` reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    /// Bytes copied host→device.
    pub h2d_bytes: u64,
    /// Host→device copies issued.
    pub h2d_copies: u64,
    /// Bytes copied device→host.
    pub d2h_bytes: u64,
    /// Device→host copies issued.
    pub d2h_copies: u64,
    /// Times the host blocked on the throttle.
    pub throttle_waits: u64,
    /// Seconds the host spent blocked on the throttle.
    pub throttle_wait_seconds: f64,
    /// Seconds the host spent in `synchronize`.
    pub sync_wait_seconds: f64,
    /// Device seconds spent in timed host→device copies (completed ones).
    pub h2d_seconds: f64,
    /// Bytes of the timed host→device copies counted in `h2d_seconds`.
    pub h2d_timed_bytes: u64,
    /// Device seconds spent in timed device→host copies.
    pub d2h_seconds: f64,
    /// Bytes of the timed device→host copies counted in `d2h_seconds`.
    pub d2h_timed_bytes: u64,
    /// Seconds compute lanes spent waiting for weight copies.
    pub stall_seconds: f64,
    /// Claims (compute-lane waits on a copy) issued.
    pub claims: u64,
    /// Prefetches served from a slot that still held the unit (no copy).
    pub reuses: u64,
    /// Bytes not copied thanks to those reuses.
    pub reused_bytes: u64,
}

/// One timed span or instant, in milliseconds since the trace started.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRecord {
    /// `"h2d"`, `"d2h"`, `"wait"` (a compute lane waiting for a copy) or `"mark"` (an instant on a
    /// compute lane; `code` says which).
    pub kind: &'static str,
    /// The caller's tag (a unit id).
    pub tag: u64,
    /// The caller's code of a mark; 0 otherwise.
    pub code: u64,
    /// Bytes moved (copies only).
    pub bytes: u64,
    /// Start, ms after the trace began.
    pub start_ms: f64,
    /// End, ms after the trace began.
    pub end_ms: f64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    H2d,
    D2h,
    Wait,
    Mark,
}

struct Timing<E> {
    kind: Kind,
    tag: u64,
    code: u64,
    bytes: u64,
    start: E,
    end: Option<E>,
}

struct Slot<E> {
    ptr: u64,
    free: E,
    ready: E,
    /// Events recorded after prefixes of the last copy into the slot, with each prefix's end in
    /// bytes (the first `nparts` are that copy's; the rest are kept for reuse).
    parts: Vec<(usize, E)>,
    nparts: usize,
    held: bool,
    owner: Option<u64>,
    used: u64,
}

struct State<E> {
    slots: Vec<Slot<E>>,
    slot_bytes: usize,
    tick: u64,
    /// Copies in flight each way: the event recorded after each, and what keeps its host memory
    /// mapped until the event has completed (the copy has retired).
    h2d: VecDeque<(E, Option<Lease>)>,
    d2h: VecDeque<(E, Option<Lease>)>,
    h2d_spare: Vec<E>,
    d2h_spare: Vec<E>,
    timed_spare: Vec<E>,
    timings: Vec<Timing<E>>,
    compute_mark: Option<E>,
    trace_base: Option<E>,
    trace: Vec<TraceRecord>,
    stats: EngineStats,
}

/// Most timed records kept while a trace is on (older ones are dropped beyond it).
const MAX_TRACE_RECORDS: usize = 1 << 20;
/// Most timings awaiting completion; beyond it new copies go untimed rather than grow memory.
const MAX_PENDING_TIMINGS: usize = 1 << 16;

/// The engine of one device.
pub struct Engine<D: Device> {
    dev: D,
    state: Mutex<State<D::Event>>,
    /// Markers handed out and not yet waited for (see [`Engine::marker`]).
    markers: Mutex<HashMap<Marker, Vec<D::Event>>>,
    next_marker: AtomicU64,
}

impl<D: Device> Engine<D> {
    /// An engine with no slots yet (see [`Engine::set_slots`]).
    pub fn new(dev: D) -> Self {
        Self {
            dev,
            state: Mutex::new(State {
                slots: Vec::new(),
                slot_bytes: 0,
                tick: 0,
                h2d: VecDeque::new(),
                d2h: VecDeque::new(),
                h2d_spare: Vec::new(),
                d2h_spare: Vec::new(),
                timed_spare: Vec::new(),
                timings: Vec::new(),
                compute_mark: None,
                trace_base: None,
                trace: Vec::new(),
                stats: EngineStats::default(),
            }),
            markers: Mutex::new(HashMap::new()),
            next_marker: AtomicU64::new(1),
        }
    }

    /// Captures the copies queued so far on both engine lanes; returns an id for
    /// [`Engine::wait_marker`]. A host thread waiting on it (a CPU optimizer about to update a
    /// unit whose gradients are on their way) blocks neither the engine nor its caller.
    pub fn marker(&self) -> Result<Marker> {
        let evs = vec![self.dev.new_event()?, self.dev.new_event()?];
        self.dev.record(&evs[0], Lane::Gradient)?;
        self.dev.record(&evs[1], Lane::Transfer)?;
        let id = Marker(self.next_marker.fetch_add(1, Ordering::Relaxed));
        self.markers
            .lock()
            .map_err(|_| Error::Worker("marker lock poisoned".into()))?
            .insert(id, evs);
        Ok(id)
    }

    /// Blocks until the copies captured by marker `id` are done, and forgets the marker.
    pub fn wait_marker(&self, id: Marker) -> Result<()> {
        let evs = self
            .markers
            .lock()
            .map_err(|_| Error::Worker("marker lock poisoned".into()))?
            .remove(&id)
            .ok_or_else(|| {
                Error::InvalidArgument(format!("no marker {} (already waited for?)", id.0))
            })?;
        for e in &evs {
            self.dev.synchronize(e)?;
        }
        Ok(())
    }

    /// Whether the copies captured by marker `id` are done, without blocking (the marker stays:
    /// [`wait_marker`](Self::wait_marker) forgets it). An unknown marker is an error.
    pub fn marker_done(&self, id: Marker) -> Result<bool> {
        let markers = self
            .markers
            .lock()
            .map_err(|_| Error::Worker("marker lock poisoned".into()))?;
        let evs = markers.get(&id).ok_or_else(|| {
            Error::InvalidArgument(format!("no marker {} (already waited for?)", id.0))
        })?;
        for e in evs {
            if !self.dev.is_complete(e)? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.dev
    }

    fn lock(&self) -> Result<MutexGuard<'_, State<D::Event>>> {
        self.state
            .lock()
            .map_err(|_| Error::Worker("engine state lock poisoned".into()))
    }

    /// Number of slots and bytes each.
    pub fn slots(&self) -> Result<(usize, usize)> {
        let s = self.lock()?;
        Ok((s.slots.len(), s.slot_bytes))
    }

    /// Replaces the slots by `ptrs`, each `bytes` long. No slot may be held. The transfer lane is
    /// drained first; the caller must also make sure its own kernels no longer read the old slots
    /// before it frees them. Null pointers and overlapping slots are refused.
    ///
    /// # Safety
    /// Each pointer must be the start of `bytes` of device memory (host memory on the host device)
    /// that stays writable until the slots are replaced again or the engine is dropped.
    pub unsafe fn set_slots(&self, ptrs: &[u64], bytes: usize) -> Result<()> {
        if bytes > 0 {
            for (i, &p) in ptrs.iter().enumerate() {
                if p == 0 {
                    return Err(Error::InvalidArgument(format!(
                        "device slot {i} has a null address"
                    )));
                }
                let end = p.checked_add(bytes as u64).ok_or_else(|| {
                    Error::InvalidArgument(format!("device slot {i}: address range overflows"))
                })?;
                if let Some(j) = ptrs[..i]
                    .iter()
                    .position(|&q| q < end && p < q.saturating_add(bytes as u64))
                {
                    return Err(Error::InvalidArgument(format!(
                        "device slots {j} and {i} overlap"
                    )));
                }
            }
        }
        let mut s = self.lock()?;
        if s.slots.iter().any(|x| x.held) {
            return Err(Error::InvalidArgument(
                "cannot replace device slots while one is held".into(),
            ));
        }
        self.dev.synchronize_lane(Lane::Transfer)?;
        let mut slots = Vec::with_capacity(ptrs.len());
        for &ptr in ptrs {
            slots.push(Slot {
                ptr,
                free: self.dev.new_event()?,
                ready: self.dev.new_event()?,
                parts: Vec::new(),
                nparts: 0,
                held: false,
                owner: None,
                used: 0,
            });
        }
        let s = &mut *s;
        s.h2d_spare.extend(s.h2d.drain(..).map(|(e, _)| e));
        s.slots = slots;
        s.slot_bytes = bytes;
        Ok(())
    }

    fn timed_event(&self, s: &mut State<D::Event>) -> Result<D::Event> {
        match s.timed_spare.pop() {
            Some(e) => Ok(e),
            None => self.dev.new_timed_event(),
        }
    }

    /// Moves completed timings into the counters (and the trace, while one is on), in the order
    /// they were recorded, up to the first not yet complete: a call looks at the completed ones and
    /// one more, not at every pending timing. A backward keeps hundreds pending (a copy per
    /// gradient), and a scan of them all on every copy made queueing a backward's copies quadratic
    /// in its gradients. A completed timing behind a pending one waits for a later call.
    fn harvest(&self, s: &mut State<D::Event>) -> Result<()> {
        if s.timings.is_empty() {
            return Ok(());
        }
        if let Some(b) = &s.trace_base {
            if !self.dev.is_complete(b)? {
                return Ok(());
            }
        }
        let mut done = 0;
        for t in &s.timings {
            let last = t.end.as_ref().unwrap_or(&t.start);
            if !self.dev.is_complete(last)? || !self.dev.is_complete(&t.start)? {
                break;
            }
            done += 1;
        }
        let ready: Vec<Timing<D::Event>> = s.timings.drain(..done).collect();
        for t in ready {
            let ms = match &t.end {
                Some(end) => self.dev.elapsed_ms(&t.start, end)?,
                None => Some(0.0),
            };
            if let Some(ms) = ms {
                let secs = ms.max(0.0) / 1e3;
                match t.kind {
                    Kind::H2d => {
                        s.stats.h2d_seconds += secs;
                        s.stats.h2d_timed_bytes += t.bytes;
                    }
                    Kind::D2h => {
                        s.stats.d2h_seconds += secs;
                        s.stats.d2h_timed_bytes += t.bytes;
                    }
                    Kind::Wait => s.stats.stall_seconds += secs,
                    Kind::Mark => {}
                }
            }
            if let Some(base) = &s.trace_base {
                let start = self.dev.elapsed_ms(base, &t.start)?;
                if let (Some(start), Some(ms)) = (start, ms) {
                    if s.trace.len() < MAX_TRACE_RECORDS {
                        s.trace.push(TraceRecord {
                            kind: match t.kind {
                                Kind::H2d => "h2d",
                                Kind::D2h => "d2h",
                                Kind::Wait => "wait",
                                Kind::Mark => "mark",
                            },
                            tag: t.tag,
                            code: t.code,
                            bytes: t.bytes,
                            start_ms: start,
                            end_ms: start + ms.max(0.0),
                        });
                    }
                }
            }
            s.timed_spare.push(t.start);
            if let Some(e) = t.end {
                s.timed_spare.push(e);
            }
        }
        Ok(())
    }

    /// Starts a timed span on `lane` (`None` when too many timings are pending).
    fn span_start(&self, s: &mut State<D::Event>, lane: Lane) -> Result<Option<D::Event>> {
        if s.timings.len() >= MAX_PENDING_TIMINGS {
            return Ok(None);
        }
        let e = self.timed_event(s)?;
        self.dev.record(&e, lane)?;
        Ok(Some(e))
    }

    fn span_end(
        &self,
        s: &mut State<D::Event>,
        start: Option<D::Event>,
        lane: Lane,
        kind: Kind,
        tag: u64,
        bytes: u64,
    ) -> Result<()> {
        if let Some(start) = start {
            let end = self.timed_event(s)?;
            self.dev.record(&end, lane)?;
            s.timings.push(Timing {
                kind,
                tag,
                code: 0,
                bytes,
                start,
                end: Some(end),
            });
        }
        Ok(())
    }

    /// Waits on the host for an event of the kind only lanes wait for ([`Device::new_lane_event`]),
    /// on which a blocking wait would spin: polls it, sleeping between polls (at most 50 µs).
    fn wait_polling(&self, ev: &D::Event) -> Result<()> {
        let mut pause = Duration::from_micros(5);
        while !self.dev.is_complete(ev)? {
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_micros(50));
        }
        Ok(())
    }

    /// Blocks the host while `max_inflight` or more copies of `queue` are in flight. Returns how
    /// many copies of the queue are known complete (in issue order).
    fn throttle(&self, s: &mut State<D::Event>, d2h: bool, max_inflight: usize) -> Result<usize> {
        let mut retired = 0;
        loop {
            let q = if d2h { &mut s.d2h } else { &mut s.h2d };
            let Some((front, _)) = q.front() else { break };
            if !self.dev.is_complete(front)? {
                break;
            }
            let (ev, _retired_lease) = q.pop_front().ok_or(Error::Worker("copy queue".into()))?;
            if d2h {
                s.d2h_spare.push(ev);
            } else {
                s.h2d_spare.push(ev);
            }
            retired += 1;
        }
        let len = if d2h { s.d2h.len() } else { s.h2d.len() };
        if len >= max_inflight {
            let t = Instant::now();
            loop {
                let q = if d2h { &mut s.d2h } else { &mut s.h2d };
                if q.len() < max_inflight {
                    break;
                }
                let (ev, lease) = q.pop_front().ok_or(Error::Worker("copy queue".into()))?;
                let waited = if d2h {
                    self.wait_polling(&ev)
                } else {
                    self.dev.synchronize(&ev)
                };
                if let Err(e) = waited {
                    // Not known complete: the copy may still use the memory, which stays leased.
                    std::mem::forget(lease);
                    return Err(e);
                }
                if d2h {
                    s.d2h_spare.push(ev);
                } else {
                    s.h2d_spare.push(ev);
                }
                retired += 1;
            }
            s.stats.throttle_waits += 1;
            s.stats.throttle_wait_seconds += t.elapsed().as_secs_f64();
        }
        Ok(retired)
    }

    /// Copies `n` bytes at `src` into a free slot and makes the compute lane `compute` wait for
    /// that copy. Returns the slot index and its device address.
    ///
    /// # Safety
    /// `src..src+n` must stay readable until the copy has run (see [`Engine::synchronize`]).
    pub unsafe fn acquire(
        &self,
        src: *const u8,
        n: usize,
        max_inflight: usize,
        compute: ComputeStream,
    ) -> Result<(usize, u64)> {
        // SAFETY: forwarded from the caller's contract.
        let (index, ptr, _) =
            unsafe { self.prefetch_inner(None, src, n, max_inflight, &[], 0, None, &[])? };
        self.claim_or_release(index, ptr, compute)
    }

    /// [`Engine::acquire`] of the bytes of `src`, which the engine keeps alive (its lease) until
    /// the copy has run: the memory may be dropped by the caller right after the call.
    pub fn acquire_slice(
        &self,
        src: &HostSlice,
        max_inflight: usize,
        compute: ComputeStream,
    ) -> Result<(usize, u64)> {
        // SAFETY: the slice's lease keeps its bytes readable until the copy retires (it travels
        // with the copy's event in the queue).
        let (index, ptr, _) = unsafe {
            self.prefetch_inner(
                None,
                src.as_ptr(),
                src.len(),
                max_inflight,
                &[],
                0,
                Some(src.lease()),
                &[],
            )?
        };
        self.claim_or_release(index, ptr, compute)
    }

    /// [`Engine::acquire_slice`] whose slot is owned by the returned guard: the slot is released
    /// (after the work queued on `compute` so far) when the guard is dropped.
    pub fn borrow(
        &self,
        src: &HostSlice,
        max_inflight: usize,
        compute: ComputeStream,
    ) -> Result<SlotGuard<'_, D>> {
        let (index, ptr) = self.acquire_slice(src, max_inflight, compute)?;
        Ok(SlotGuard {
            engine: self,
            index,
            ptr,
            compute,
        })
    }

    /// [`Engine::prefetch_slice`] whose slot is owned by the returned guard; the copy is not waited
    /// for until [`SlotGuard::claim`]. Returns the guard and whether a copy was issued.
    pub fn prefetch_guarded(
        &self,
        key: Option<u64>,
        src: &HostSlice,
        max_inflight: usize,
        keep: &[u64],
        compute: ComputeStream,
    ) -> Result<(SlotGuard<'_, D>, bool)> {
        let (index, ptr, copied) = self.prefetch_slice(key, src, max_inflight, keep, 0)?;
        Ok((
            SlotGuard {
                engine: self,
                index,
                ptr,
                compute,
            },
            copied,
        ))
    }

    fn claim_or_release(
        &self,
        index: usize,
        ptr: u64,
        compute: ComputeStream,
    ) -> Result<(usize, u64)> {
        if let Err(e) = self.claim(index, compute, 0) {
            let _ = self.release(index, compute);
            return Err(e);
        }
        Ok((index, ptr))
    }

    /// Issues the copy of `n` bytes at `src` into a free slot, which stays held until
    /// [`Engine::release`]; nothing waits for the copy until [`Engine::claim`]. With a `key`, a
    /// released slot whose last copy was that key's is handed back without copying (`false` in
    /// the result). The slot to overwrite is one holding no key, else one holding a key not in
    /// `keep`, least recently used first. Returns the slot index, its device address and whether
    /// a copy was issued.
    ///
    /// # Safety
    /// `src..src+n` must stay readable until the copy has run (see [`Engine::synchronize`]); a
    /// key must name the same bytes for as long as it is used.
    pub unsafe fn prefetch(
        &self,
        key: Option<u64>,
        src: *const u8,
        n: usize,
        max_inflight: usize,
        keep: &[u64],
        tag: u64,
    ) -> Result<(usize, u64, bool)> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.prefetch_inner(key, src, n, max_inflight, keep, tag, None, &[]) }
    }

    /// [`Engine::prefetch`] of the bytes of `src`, which the engine keeps alive (its lease) until
    /// the copy has run: the memory may be dropped by the caller right after the call.
    pub fn prefetch_slice(
        &self,
        key: Option<u64>,
        src: &HostSlice,
        max_inflight: usize,
        keep: &[u64],
        tag: u64,
    ) -> Result<(usize, u64, bool)> {
        self.prefetch_parts(key, src, max_inflight, keep, tag, &[])
    }

    /// [`Engine::prefetch_slice`] whose copy goes in pieces ending at the byte offsets `parts`
    /// (strictly increasing, each inside the copy), an event after each: [`Engine::claim_part`]
    /// then waits for a prefix of the copy only, and the compute that reads the first bytes
    /// starts before the last have landed.
    pub fn prefetch_parts(
        &self,
        key: Option<u64>,
        src: &HostSlice,
        max_inflight: usize,
        keep: &[u64],
        tag: u64,
        parts: &[usize],
    ) -> Result<(usize, u64, bool)> {
        // SAFETY: the slice's lease keeps its bytes readable until the copy retires (it travels
        // with the copy's event in the queue).
        unsafe {
            self.prefetch_inner(
                key,
                src.as_ptr(),
                src.len(),
                max_inflight,
                keep,
                tag,
                Some(src.lease()),
                parts,
            )
        }
    }

    /// The prefetch; `hold` (when given) stays with the copy until it has retired.
    ///
    /// # Safety
    /// As for [`Engine::prefetch`], where `hold` does not keep `src` alive.
    #[allow(clippy::too_many_arguments)]
    unsafe fn prefetch_inner(
        &self,
        key: Option<u64>,
        src: *const u8,
        n: usize,
        max_inflight: usize,
        keep: &[u64],
        tag: u64,
        hold: Option<Lease>,
        parts: &[usize],
    ) -> Result<(usize, u64, bool)> {
        let max_inflight = validate_max_inflight(max_inflight)?;
        if let Some(w) = parts.windows(2).find(|w| w[0] >= w[1]) {
            return Err(Error::InvalidArgument(format!(
                "copy parts must end at increasing offsets, got {} then {}",
                w[0], w[1]
            )));
        }
        if let Some(&end) = parts.iter().find(|&&end| end == 0 || end >= n) {
            return Err(Error::InvalidArgument(format!(
                "a copy part ends at byte {end}, outside the copy's 1..{n}"
            )));
        }
        let mut guard = self.lock()?;
        let s = &mut *guard;
        if n > s.slot_bytes {
            return Err(Error::InvalidArgument(format!(
                "a unit of {n} bytes does not fit the {} byte device slots",
                s.slot_bytes
            )));
        }
        self.harvest(s)?;
        s.tick += 1;
        let tick = s.tick;
        if let Some(k) = key {
            if let Some(i) = s.slots.iter().position(|x| x.owner == Some(k)) {
                if s.slots[i].held {
                    return Err(Error::InvalidArgument(format!(
                        "unit {k} is already held in device slot {i}"
                    )));
                }
                let slot = &mut s.slots[i];
                slot.held = true;
                slot.used = tick;
                let ptr = slot.ptr;
                s.stats.reuses += 1;
                s.stats.reused_bytes += n as u64;
                return Ok((i, ptr, false));
            }
        }
        let index = s
            .slots
            .iter()
            .enumerate()
            .filter(|(_, x)| !x.held)
            .min_by_key(|(_, x)| {
                let rank = match x.owner {
                    None => 0,
                    Some(o) if !keep.contains(&o) => 1,
                    Some(_) => 2,
                };
                (rank, x.used)
            })
            .map(|(i, _)| i)
            .ok_or(Error::SlotsExhausted {
                slots: s.slots.len(),
            })?;

        self.throttle(s, false, max_inflight)?;

        let slot_ptr = s.slots[index].ptr;
        let copied = match s.h2d_spare.pop() {
            Some(e) => e,
            None => self.dev.new_event()?,
        };
        self.dev.wait(Lane::Transfer, &s.slots[index].free)?;
        let t0 = self.span_start(s, Lane::Transfer)?;
        s.slots[index].nparts = 0; // the last copy's parts no longer describe the slot
        while s.slots[index].parts.len() < parts.len() {
            // Waited for by the compute lane only (claim_part): the cheap kind of event.
            let ev = self.dev.new_lane_event()?;
            s.slots[index].parts.push((0, ev));
        }
        let slot = &mut s.slots[index];
        let issued = (|| {
            let mut at = 0;
            for (k, &end) in parts.iter().chain(std::iter::once(&n)).enumerate() {
                if end > at {
                    // SAFETY: the caller keeps `src..src+n` readable and `at < end <= n` (checked
                    // above); the slot holds `slot_bytes >= n` bytes and is not rewritten before
                    // its free event, which orders this copy after earlier readers.
                    unsafe {
                        self.dev.copy_to_device(
                            Lane::Transfer,
                            slot_ptr + at as u64,
                            src.add(at),
                            end - at,
                        )?
                    };
                }
                if let Some(part) = slot.parts.get_mut(k).filter(|_| k < parts.len()) {
                    part.0 = end;
                    self.dev.record(&part.1, Lane::Transfer)?;
                }
                at = end;
            }
            slot.nparts = parts.len();
            Ok(())
        })();
        if let Err(e) = issued {
            // Some pieces may be queued: their memory is kept (as for an untracked copy below).
            std::mem::forget(hold);
            return Err(e);
        }
        let recorded = (|| {
            self.span_end(s, t0, Lane::Transfer, Kind::H2d, tag, n as u64)?;
            self.dev.record(&copied, Lane::Transfer)?;
            self.dev.record(&s.slots[index].ready, Lane::Transfer)
        })();
        if let Err(e) = recorded {
            // The copy is queued but cannot be tracked: keep its memory rather than free it under
            // the copy (a leak on a failing device, never a use after free).
            std::mem::forget(hold);
            return Err(e);
        }
        s.h2d.push_back((copied, hold));
        let slot = &mut s.slots[index];
        slot.held = true;
        slot.owner = key;
        slot.used = tick;
        s.stats.h2d_bytes += n as u64;
        s.stats.h2d_copies += 1;
        Ok((index, slot_ptr, true))
    }

    /// Makes the compute lane `compute` wait (on the device) for the copy into held slot `index`.
    pub fn claim(&self, index: usize, compute: ComputeStream, tag: u64) -> Result<()> {
        self.claim_upto(index, compute, None, tag)
    }

    /// Makes the compute lane `compute` wait for the first `upto` bytes of the copy into held
    /// slot `index`: for the first part of that copy that covers them (see
    /// [`Engine::prefetch_parts`]), else for the whole copy. Call [`Engine::claim`] before the
    /// slot's other bytes are read.
    pub fn claim_part(
        &self,
        index: usize,
        compute: ComputeStream,
        upto: usize,
        tag: u64,
    ) -> Result<()> {
        self.claim_upto(index, compute, Some(upto), tag)
    }

    /// [`Engine::claim`] (`upto` None: the whole copy, counted in the stats) and
    /// [`Engine::claim_part`].
    fn claim_upto(
        &self,
        index: usize,
        compute: ComputeStream,
        upto: Option<usize>,
        tag: u64,
    ) -> Result<()> {
        let mut guard = self.lock()?;
        let s = &mut *guard;
        match s.slots.get(index) {
            Some(x) if x.held => {}
            Some(_) => {
                return Err(Error::InvalidArgument(format!(
                    "device slot {index} is not held"
                )))
            }
            None => return Err(Error::InvalidArgument(format!("no device slot {index}"))),
        }
        let lane = Lane::Compute(compute);
        let t0 = self.span_start(s, lane)?;
        let slot = &s.slots[index];
        let part = upto.and_then(|upto| {
            slot.parts[..slot.nparts]
                .iter()
                .find(|(end, _)| *end >= upto)
        });
        self.dev
            .wait(lane, part.map_or(&slot.ready, |(_, ev)| ev))?;
        self.span_end(s, t0, lane, Kind::Wait, tag, 0)?;
        if upto.is_none() {
            s.stats.claims += 1;
        }
        Ok(())
    }

    /// Gives slot `index` back once the work queued so far on `compute` is done.
    pub fn release(&self, index: usize, compute: ComputeStream) -> Result<()> {
        let mut guard = self.lock()?;
        let s = &mut *guard;
        s.tick += 1;
        let tick = s.tick;
        let slot = s
            .slots
            .get_mut(index)
            .ok_or_else(|| Error::InvalidArgument(format!("no device slot {index}")))?;
        if !slot.held {
            return Err(Error::InvalidArgument(format!(
                "device slot {index} is not held"
            )));
        }
        self.dev.record(&slot.free, Lane::Compute(compute))?;
        slot.held = false;
        slot.used = tick;
        Ok(())
    }

    /// Forgets which unit each slot holds (their bytes are no longer trusted): the next prefetch
    /// of any key copies again.
    pub fn invalidate(&self) -> Result<()> {
        let mut s = self.lock()?;
        for slot in s.slots.iter_mut() {
            slot.owner = None;
        }
        Ok(())
    }

    /// Records an instant on `compute` for the trace (no effect while no trace is on).
    pub fn mark(&self, compute: ComputeStream, tag: u64, code: u64) -> Result<()> {
        let mut guard = self.lock()?;
        let s = &mut *guard;
        if s.trace_base.is_none() || s.timings.len() >= MAX_PENDING_TIMINGS {
            return Ok(());
        }
        let e = self.timed_event(s)?;
        self.dev.record(&e, Lane::Compute(compute))?;
        s.timings.push(Timing {
            kind: Kind::Mark,
            tag,
            code,
            bytes: 0,
            start: e,
            end: None,
        });
        Ok(())
    }

    /// Starts a trace: timed records from now on are kept, relative to this point on `compute`.
    pub fn trace_start(&self, compute: ComputeStream) -> Result<()> {
        let mut guard = self.lock()?;
        let s = &mut *guard;
        self.harvest(s)?;
        let base = self.timed_event(s)?;
        self.dev.record(&base, Lane::Compute(compute))?;
        s.trace_base = Some(base);
        s.trace.clear();
        Ok(())
    }

    /// Ends the trace and returns its records. The caller must first have drained its compute
    /// lanes; the engine drains its own.
    pub fn trace_stop(&self) -> Result<Vec<TraceRecord>> {
        let mut guard = self.lock()?;
        let s = &mut *guard;
        self.dev.synchronize_lane(Lane::Transfer)?;
        self.dev.synchronize_lane(Lane::Gradient)?;
        self.harvest(s)?;
        if let Some(b) = s.trace_base.take() {
            s.timed_spare.push(b);
        }
        Ok(std::mem::take(&mut s.trace))
    }

    /// Copies `n` device bytes at `src` to host `dst` on the gradient lane, after the work queued so
    /// far on `compute`. Returns how many earlier gradient copies are now known to be complete
    /// (in issue order), so the caller may free their sources.
    ///
    /// # Safety
    /// `dst..dst+n` must stay writable, and the device range readable, until the copy has run.
    pub unsafe fn copy_to_host(
        &self,
        dst: *mut u8,
        src: u64,
        n: usize,
        max_inflight: usize,
        compute: ComputeStream,
    ) -> Result<usize> {
        // SAFETY: forwarded.
        unsafe { self.copy_to_host_tagged(dst, src, n, max_inflight, compute, 0) }
    }

    /// [`Engine::copy_to_host`] with a trace tag.
    ///
    /// # Safety
    /// As for [`Engine::copy_to_host`].
    pub unsafe fn copy_to_host_tagged(
        &self,
        dst: *mut u8,
        src: u64,
        n: usize,
        max_inflight: usize,
        compute: ComputeStream,
        tag: u64,
    ) -> Result<usize> {
        // SAFETY: forwarded.
        unsafe { self.copy_to_host_inner(dst, src, n, max_inflight, compute, tag, None) }
    }

    /// [`Engine::copy_to_host_tagged`] into the bytes of `dst` (all of them), which the engine keeps
    /// alive (its lease) until the copy has run.
    ///
    /// # Safety
    /// The device range `src..src+dst.len()` must stay readable until the copy has run.
    pub unsafe fn copy_to_host_slice(
        &self,
        dst: &HostSlice,
        src: u64,
        max_inflight: usize,
        compute: ComputeStream,
        tag: u64,
    ) -> Result<usize> {
        // SAFETY: the host side is kept writable by the slice's lease, which travels with the
        // copy's event; the device side is the caller's contract.
        unsafe {
            self.copy_to_host_inner(
                dst.as_ptr(),
                src,
                dst.len(),
                max_inflight,
                compute,
                tag,
                Some(dst.lease()),
            )
        }
    }

    /// The device→host copy; `hold` (when given) stays with the copy until it has retired.
    ///
    /// # Safety
    /// As for [`Engine::copy_to_host`], where `hold` does not keep `dst` alive.
    #[allow(clippy::too_many_arguments)]
    unsafe fn copy_to_host_inner(
        &self,
        dst: *mut u8,
        src: u64,
        n: usize,
        max_inflight: usize,
        compute: ComputeStream,
        tag: u64,
        hold: Option<Lease>,
    ) -> Result<usize> {
        let max_inflight = validate_max_inflight(max_inflight)?;
        let mut guard = self.lock()?;
        let s = &mut *guard;
        self.harvest(s)?;
        let retired = self.throttle(s, true, max_inflight)?;
        if s.compute_mark.is_none() {
            // Waited for by the gradient lane only.
            s.compute_mark = Some(self.dev.new_lane_event()?);
        }
        let mark = s
            .compute_mark
            .as_ref()
            .ok_or(Error::Worker("compute mark".into()))?;
        self.dev.record(mark, Lane::Compute(compute))?;
        self.dev.wait(Lane::Gradient, mark)?;
        let t0 = self.span_start(s, Lane::Gradient)?;
        if n > 0 {
            // SAFETY: forwarded from the caller's contract.
            unsafe { self.dev.copy_to_host(Lane::Gradient, dst, src, n)? };
        }
        let recorded = (|| {
            self.span_end(s, t0, Lane::Gradient, Kind::D2h, tag, n as u64)?;
            // A gradient copy's event is of the kind only lanes wait for (the throttle polls it):
            // a backward queues hundreds of small copies, and with about fifty events of the
            // blocking kind pending the next record blocked the host until earlier ones completed
            // (`bench/parts_issue.py`: 64 small copies behind a large one, 24.0 ms against 1.1).
            let done = match s.d2h_spare.pop() {
                Some(e) => e,
                None => self.dev.new_lane_event()?,
            };
            self.dev.record(&done, Lane::Gradient)?;
            Ok(done)
        })();
        let done = match recorded {
            Ok(done) => done,
            Err(e) => {
                // As in `prefetch_inner`: an untracked copy keeps its memory.
                std::mem::forget(hold);
                return Err(e);
            }
        };
        s.d2h.push_back((done, hold));
        s.stats.d2h_bytes += n as u64;
        s.stats.d2h_copies += 1;
        Ok(retired)
    }

    /// Blocks until both engine lanes are idle. Returns how many gradient copies completed since
    /// the last report (all that were outstanding).
    pub fn synchronize(&self) -> Result<usize> {
        let mut guard = self.lock()?;
        let s = &mut *guard;
        let t = Instant::now();
        self.dev.synchronize_lane(Lane::Transfer)?;
        self.dev.synchronize_lane(Lane::Gradient)?;
        s.stats.sync_wait_seconds += t.elapsed().as_secs_f64();
        s.h2d_spare.extend(s.h2d.drain(..).map(|(e, _)| e));
        let retired = s.d2h.len();
        s.d2h_spare.extend(s.d2h.drain(..).map(|(e, _)| e));
        self.harvest(s)?;
        Ok(retired)
    }

    /// Copies in flight each way (host→device, device→host), as last seen by the host.
    pub fn in_flight(&self) -> Result<(usize, usize)> {
        let s = self.lock()?;
        Ok((s.h2d.len(), s.d2h.len()))
    }

    /// Counters so far (completed timings included).
    pub fn stats(&self) -> Result<EngineStats> {
        let mut guard = self.lock()?;
        self.harvest(&mut guard)?;
        Ok(guard.stats)
    }
}

/// A held device slot, released when dropped (after the work queued so far on its compute lane),
/// so that an early return or a panic cannot leave the slot held for good.
pub struct SlotGuard<'a, D: Device> {
    engine: &'a Engine<D>,
    index: usize,
    ptr: u64,
    compute: ComputeStream,
}

impl<D: Device> SlotGuard<'_, D> {
    /// Index of the slot.
    pub fn index(&self) -> usize {
        self.index
    }
    /// Device address of the slot's memory.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }
    /// Makes the compute lane wait (on the device) for the copy into the slot.
    pub fn claim(&self) -> Result<()> {
        self.engine.claim(self.index, self.compute, 0)
    }
    /// Releases the slot now, reporting an error that dropping would ignore.
    pub fn release(self) -> Result<()> {
        let r = self.engine.release(self.index, self.compute);
        std::mem::forget(self);
        r
    }
}

impl<D: Device> Drop for SlotGuard<'_, D> {
    fn drop(&mut self) {
        let _ = self.engine.release(self.index, self.compute);
    }
}

impl<D: Device> Drop for Engine<D> {
    fn drop(&mut self) {
        // Copies may still read host regions or write slots: let them finish.
        let t = self.dev.synchronize_lane(Lane::Transfer);
        let g = self.dev.synchronize_lane(Lane::Gradient);
        if t.is_err() || g.is_err() {
            // Not known complete: keep the memory of the copies mapped rather than free it under
            // them (a leak on a failing device, never a use after free).
            if let Ok(s) = self.state.get_mut() {
                std::mem::forget(std::mem::take(&mut s.h2d));
                std::mem::forget(std::mem::take(&mut s.d2h));
            }
        }
    }
}
