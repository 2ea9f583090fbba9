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
//! Slot memory belongs to the caller (torch's caching allocator, so torch's memory accounting sees
//! it); the engine only holds its addresses.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use crate::device::{Device, Lane};
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
}

struct Slot<E> {
    ptr: u64,
    free: E,
    held: bool,
}

struct State<E> {
    slots: Vec<Slot<E>>,
    slot_bytes: usize,
    next: usize,
    h2d: VecDeque<E>,
    d2h: VecDeque<E>,
    h2d_spare: Vec<E>,
    d2h_spare: Vec<E>,
    compute_mark: Option<E>,
    stats: EngineStats,
}

/// The engine of one device.
pub struct Engine<D: Device> {
    dev: D,
    state: Mutex<State<D::Event>>,
}

impl<D: Device> Engine<D> {
    /// An engine with no slots yet (see [`Engine::set_slots`]).
    pub fn new(dev: D) -> Self {
        Self {
            dev,
            state: Mutex::new(State {
                slots: Vec::new(),
                slot_bytes: 0,
                next: 0,
                h2d: VecDeque::new(),
                d2h: VecDeque::new(),
                h2d_spare: Vec::new(),
                d2h_spare: Vec::new(),
                compute_mark: None,
                stats: EngineStats::default(),
            }),
        }
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
    /// before it frees them.
    pub fn set_slots(&self, ptrs: &[u64], bytes: usize) -> Result<()> {
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
                held: false,
            });
        }
        let spent: Vec<_> = s.h2d.drain(..).collect();
        s.h2d_spare.extend(spent);
        s.slots = slots;
        s.slot_bytes = bytes;
        s.next = 0;
        Ok(())
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
        compute: u64,
    ) -> Result<(usize, u64)> {
        let max_inflight = validate_max_inflight(max_inflight)?;
        let mut guard = self.lock()?;
        let s = &mut *guard;
        if n > s.slot_bytes {
            return Err(Error::InvalidArgument(format!(
                "a unit of {n} bytes does not fit the {} byte device slots",
                s.slot_bytes
            )));
        }
        let count = s.slots.len();
        let index = (0..count)
            .map(|k| (s.next + k) % count.max(1))
            .find(|&i| !s.slots[i].held)
            .ok_or(Error::SlotsExhausted { slots: count })?;

        // Throttle: retire finished copies, then block on the oldest while too many are in flight.
        while let Some(front) = s.h2d.front() {
            if !self.dev.is_complete(front)? {
                break;
            }
            let ev = s.h2d.pop_front().ok_or(Error::Worker("h2d queue".into()))?;
            s.h2d_spare.push(ev);
        }
        if s.h2d.len() >= max_inflight {
            let t = Instant::now();
            while s.h2d.len() >= max_inflight {
                let ev = s.h2d.pop_front().ok_or(Error::Worker("h2d queue".into()))?;
                self.dev.synchronize(&ev)?;
                s.h2d_spare.push(ev);
            }
            s.stats.throttle_waits += 1;
            s.stats.throttle_wait_seconds += t.elapsed().as_secs_f64();
        }

        let slot_ptr = s.slots[index].ptr;
        let copied = match s.h2d_spare.pop() {
            Some(e) => e,
            None => self.dev.new_event()?,
        };
        self.dev.wait(Lane::Transfer, &s.slots[index].free)?;
        if n > 0 {
            // SAFETY: the caller keeps `src` readable; the slot holds `slot_bytes >= n` bytes and is
            // not rewritten before its free event, which orders this copy after earlier readers.
            unsafe { self.dev.copy_to_device(Lane::Transfer, slot_ptr, src, n)? };
        }
        self.dev.record(&copied, Lane::Transfer)?;
        self.dev.wait(Lane::Compute(compute), &copied)?;
        s.h2d.push_back(copied);
        s.slots[index].held = true;
        s.next = (index + 1) % count;
        s.stats.h2d_bytes += n as u64;
        s.stats.h2d_copies += 1;
        Ok((index, slot_ptr))
    }

    /// Gives slot `index` back once the work queued so far on `compute` is done.
    pub fn release(&self, index: usize, compute: u64) -> Result<()> {
        let mut s = self.lock()?;
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
        Ok(())
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
        compute: u64,
    ) -> Result<usize> {
        let max_inflight = validate_max_inflight(max_inflight)?;
        let mut guard = self.lock()?;
        let s = &mut *guard;
        let mut retired = 0;
        while let Some(front) = s.d2h.front() {
            if !self.dev.is_complete(front)? {
                break;
            }
            let ev = s.d2h.pop_front().ok_or(Error::Worker("d2h queue".into()))?;
            s.d2h_spare.push(ev);
            retired += 1;
        }
        if s.d2h.len() >= max_inflight {
            let t = Instant::now();
            while s.d2h.len() >= max_inflight {
                let ev = s.d2h.pop_front().ok_or(Error::Worker("d2h queue".into()))?;
                self.dev.synchronize(&ev)?;
                s.d2h_spare.push(ev);
                retired += 1;
            }
            s.stats.throttle_waits += 1;
            s.stats.throttle_wait_seconds += t.elapsed().as_secs_f64();
        }
        if s.compute_mark.is_none() {
            s.compute_mark = Some(self.dev.new_event()?);
        }
        let mark = s
            .compute_mark
            .as_ref()
            .ok_or(Error::Worker("compute mark".into()))?;
        self.dev.record(mark, Lane::Compute(compute))?;
        self.dev.wait(Lane::Gradient, mark)?;
        if n > 0 {
            // SAFETY: forwarded from the caller's contract.
            unsafe { self.dev.copy_to_host(Lane::Gradient, dst, src, n)? };
        }
        let done = match s.d2h_spare.pop() {
            Some(e) => e,
            None => self.dev.new_event()?,
        };
        self.dev.record(&done, Lane::Gradient)?;
        s.d2h.push_back(done);
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
        let h: Vec<_> = s.h2d.drain(..).collect();
        s.h2d_spare.extend(h);
        let d: Vec<_> = s.d2h.drain(..).collect();
        let retired = d.len();
        s.d2h_spare.extend(d);
        Ok(retired)
    }

    /// Copies in flight each way (host→device, device→host), as last seen by the host.
    pub fn in_flight(&self) -> Result<(usize, usize)> {
        let s = self.lock()?;
        Ok((s.h2d.len(), s.d2h.len()))
    }

    /// Counters so far.
    pub fn stats(&self) -> Result<EngineStats> {
        Ok(self.lock()?.stats)
    }
}

impl<D: Device> Drop for Engine<D> {
    fn drop(&mut self) {
        // Copies may still read host regions or write slots: let them finish.
        let _ = self.dev.synchronize_lane(Lane::Transfer);
        let _ = self.dev.synchronize_lane(Lane::Gradient);
    }
}
