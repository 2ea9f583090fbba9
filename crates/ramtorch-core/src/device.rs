//! What the engine needs of a device: three lanes (transfer, gradient, the caller's compute
//! stream), events to order them, and copies. Two implementations: [`CudaDevice`] over the driver
//! API and [`HostDevice`], whose copies are memcpy on worker threads and whose events are
//! completion counters, so every scheduling path of the engine runs without a GPU.

use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::cuda;
use crate::error::{Error, Result};

/// A compute stream of the caller: a raw `CUstream` handle from torch on a CUDA device (0 is the
/// legacy default stream); on the host device, the calling thread whatever the value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ComputeStream(u64);

impl ComputeStream {
    /// The default stream (the legacy default stream on CUDA, the calling thread on the host).
    pub const DEFAULT: ComputeStream = ComputeStream(0);

    /// The stream with raw handle `raw` (a `CUstream` as torch's `cuda_stream` gives it).
    pub const fn from_raw(raw: u64) -> Self {
        Self(raw)
    }

    /// The raw handle.
    pub const fn raw(self) -> u64 {
        self.0
    }
}

/// Where an operation is queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// The engine's host→device stream.
    Transfer,
    /// The engine's device→host (gradient) stream.
    Gradient,
    /// The caller's compute stream. On the host device the compute lane is the calling thread.
    Compute(ComputeStream),
}

/// A device the engine can stream to.
pub trait Device: Send + Sync + 'static {
    /// Orders lanes: recorded on one, waited for on another or by the host.
    type Event: Send + Sync;
    /// A fresh event.
    fn new_event(&self) -> Result<Self::Event>;
    /// A fresh event that also records when it completes (see [`Device::elapsed_ms`]). Devices
    /// without timing return a plain event.
    fn new_timed_event(&self) -> Result<Self::Event> {
        self.new_event()
    }
    /// A fresh event that only lanes wait for, never the host: the cheapest kind to record
    /// (see [`cuda::Event::new_stream_only`]). Devices without such a kind return a plain event.
    fn new_lane_event(&self) -> Result<Self::Event> {
        self.new_event()
    }
    /// Milliseconds between two completed timed events, `None` where the device cannot tell.
    fn elapsed_ms(&self, _start: &Self::Event, _end: &Self::Event) -> Result<Option<f64>> {
        Ok(None)
    }
    /// Captures the work queued on `lane` so far.
    fn record(&self, ev: &Self::Event, lane: Lane) -> Result<()>;
    /// Makes `lane` wait for the work captured by the last `record` of `ev`.
    fn wait(&self, lane: Lane, ev: &Self::Event) -> Result<()>;
    /// Blocks the host until the work captured by `ev` is done.
    fn synchronize(&self, ev: &Self::Event) -> Result<()>;
    /// Whether the work captured by `ev` is done.
    fn is_complete(&self, ev: &Self::Event) -> Result<bool>;
    /// Blocks the host until `lane` (an engine lane) is idle.
    fn synchronize_lane(&self, lane: Lane) -> Result<()>;
    /// Queues a host→device copy.
    ///
    /// # Safety
    /// `src..src+n` must stay readable and `dst..dst+n` writable until the copy has run.
    unsafe fn copy_to_device(&self, lane: Lane, dst: u64, src: *const u8, n: usize) -> Result<()>;
    /// Queues a device→host copy.
    ///
    /// # Safety
    /// As for [`Device::copy_to_device`].
    unsafe fn copy_to_host(&self, lane: Lane, dst: *mut u8, src: u64, n: usize) -> Result<()>;
    /// Raw handle of an engine lane (the CUDA stream), 0 where there is none.
    fn lane_handle(&self, lane: Lane) -> u64;
    /// Human-readable name, e.g. `cuda:0`.
    fn name(&self) -> String;
}

// ---------------------------------------------------------------------------------------------
// CUDA

/// A CUDA device: its primary context and the engine's two streams.
pub struct CudaDevice {
    ctx: cuda::Context,
    transfer: cuda::Stream,
    gradient: cuda::Stream,
}

impl CudaDevice {
    /// Opens device `ordinal` (sharing torch's primary context) and creates the two streams.
    pub fn new(ordinal: usize) -> Result<Self> {
        let ctx = cuda::Context::new(ordinal)?;
        let transfer = cuda::Stream::new(&ctx)?;
        let gradient = cuda::Stream::new(&ctx)?;
        Ok(Self {
            ctx,
            transfer,
            gradient,
        })
    }

    /// The device's context.
    pub fn context(&self) -> &cuda::Context {
        &self.ctx
    }

    pub(crate) fn raw(&self, lane: Lane) -> u64 {
        match lane {
            Lane::Transfer => self.transfer.raw(),
            Lane::Gradient => self.gradient.raw(),
            Lane::Compute(s) => s.raw(),
        }
    }
}

impl Device for CudaDevice {
    type Event = cuda::Event;
    fn new_event(&self) -> Result<cuda::Event> {
        cuda::Event::new(&self.ctx)
    }
    fn new_timed_event(&self) -> Result<cuda::Event> {
        cuda::Event::new_timed(&self.ctx)
    }
    fn new_lane_event(&self) -> Result<cuda::Event> {
        cuda::Event::new_stream_only(&self.ctx)
    }
    fn elapsed_ms(&self, start: &cuda::Event, end: &cuda::Event) -> Result<Option<f64>> {
        start.elapsed_ms(end).map(|ms| Some(f64::from(ms)))
    }
    fn record(&self, ev: &cuda::Event, lane: Lane) -> Result<()> {
        ev.record(self.raw(lane))
    }
    fn wait(&self, lane: Lane, ev: &cuda::Event) -> Result<()> {
        ev.wait_on(self.raw(lane))
    }
    fn synchronize(&self, ev: &cuda::Event) -> Result<()> {
        ev.synchronize()
    }
    fn is_complete(&self, ev: &cuda::Event) -> Result<bool> {
        ev.is_complete()
    }
    fn synchronize_lane(&self, lane: Lane) -> Result<()> {
        match lane {
            Lane::Transfer => self.transfer.synchronize(),
            Lane::Gradient => self.gradient.synchronize(),
            Lane::Compute(_) => Err(Error::InvalidArgument(
                "the compute lane belongs to the caller".into(),
            )),
        }
    }
    unsafe fn copy_to_device(&self, lane: Lane, dst: u64, src: *const u8, n: usize) -> Result<()> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { cuda::copy_h2d(&self.ctx, dst, src, n, self.raw(lane)) }
    }
    unsafe fn copy_to_host(&self, lane: Lane, dst: *mut u8, src: u64, n: usize) -> Result<()> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { cuda::copy_d2h(&self.ctx, dst, src, n, self.raw(lane)) }
    }
    fn lane_handle(&self, lane: Lane) -> u64 {
        self.raw(lane)
    }
    fn name(&self) -> String {
        format!("cuda:{}", self.ctx.ordinal())
    }
}

// ---------------------------------------------------------------------------------------------
// Host

/// An event of the host device: how many times it was recorded, how many of those records the
/// lane that recorded it has reached, and when it last completed.
#[derive(Default)]
pub struct HostEvent {
    state: Mutex<(u64, u64)>,
    cv: Condvar,
    done_at: Mutex<Option<Instant>>,
}

impl HostEvent {
    fn recorded(&self) -> u64 {
        self.state.lock().map(|s| s.0).unwrap_or(u64::MAX)
    }
    fn next_generation(&self) -> u64 {
        match self.state.lock() {
            Ok(mut s) => {
                s.0 += 1;
                s.0
            }
            Err(_) => u64::MAX,
        }
    }
    fn complete(&self, generation: u64) {
        if let Ok(mut t) = self.done_at.lock() {
            *t = Some(Instant::now());
        }
        if let Ok(mut s) = self.state.lock() {
            s.1 = s.1.max(generation);
        }
        self.cv.notify_all();
    }
    fn completed_at(&self) -> Option<Instant> {
        self.done_at.lock().ok().and_then(|t| *t)
    }
    fn wait_for(&self, generation: u64) {
        let Ok(mut s) = self.state.lock() else { return };
        while s.1 < generation {
            s = match self.cv.wait(s) {
                Ok(s) => s,
                Err(_) => return,
            };
        }
    }
    fn reached(&self, generation: u64) -> bool {
        self.state.lock().map(|s| s.1 >= generation).unwrap_or(true)
    }
}

#[cfg(test)]
impl HostEvent {
    /// A record that no lane completes: lanes waiting on the event block until [`Self::fire`].
    pub(crate) fn arm(&self) -> u64 {
        self.next_generation()
    }
    /// Completes the record [`Self::arm`] made.
    pub(crate) fn fire(&self, generation: u64) {
        self.complete(generation)
    }
}

enum Op {
    Copy { dst: usize, src: usize, n: usize },
    Complete(Arc<HostEvent>, u64),
    Wait(Arc<HostEvent>, u64),
}

struct Worker {
    tx: Mutex<Option<Sender<Op>>>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    fn spawn(name: &str) -> Result<Self> {
        let (tx, rx) = channel::<Op>();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                for op in rx {
                    match op {
                        // SAFETY: `Device::copy_*`'s contract: both ranges stay valid until the op runs.
                        Op::Copy { dst, src, n } => unsafe {
                            std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, n)
                        },
                        Op::Complete(ev, g) => ev.complete(g),
                        Op::Wait(ev, g) => ev.wait_for(g),
                    }
                }
            })
            .map_err(|e| Error::Worker(e.to_string()))?;
        Ok(Self {
            tx: Mutex::new(Some(tx)),
            thread: Some(thread),
        })
    }

    fn send(&self, op: Op) -> Result<()> {
        let guard = self
            .tx
            .lock()
            .map_err(|_| Error::Worker("lane lock poisoned".into()))?;
        match guard.as_ref() {
            Some(tx) => tx
                .send(op)
                .map_err(|_| Error::Worker("lane thread has exited".into())),
            None => Err(Error::Worker("lane is shut down".into())),
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Ok(mut tx) = self.tx.lock() {
            tx.take(); // closes the channel: the thread drains its queue and exits
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The CPU stand-in for a GPU: "device memory" is host memory, each engine lane is a worker
/// thread running its queue in order, the compute lane is the calling thread.
pub struct HostDevice {
    transfer: Worker,
    gradient: Worker,
}

impl HostDevice {
    /// Starts the two lane threads.
    pub fn new() -> Result<Self> {
        Ok(Self {
            transfer: Worker::spawn("ramtorch-h2d")?,
            gradient: Worker::spawn("ramtorch-d2h")?,
        })
    }

    fn worker(&self, lane: Lane) -> Option<&Worker> {
        match lane {
            Lane::Transfer => Some(&self.transfer),
            Lane::Gradient => Some(&self.gradient),
            Lane::Compute(_) => None,
        }
    }

    pub(crate) fn copy(&self, lane: Lane, dst: usize, src: usize, n: usize) -> Result<()> {
        match self.worker(lane) {
            Some(w) => w.send(Op::Copy { dst, src, n }),
            None => {
                // SAFETY: the caller's contract; the compute lane runs the copy right away.
                unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, n) };
                Ok(())
            }
        }
    }
}

impl Device for HostDevice {
    type Event = Arc<HostEvent>;
    fn new_event(&self) -> Result<Arc<HostEvent>> {
        Ok(Arc::new(HostEvent::default()))
    }
    fn elapsed_ms(&self, start: &Arc<HostEvent>, end: &Arc<HostEvent>) -> Result<Option<f64>> {
        Ok(match (start.completed_at(), end.completed_at()) {
            (Some(a), Some(b)) => Some(match b.checked_duration_since(a) {
                Some(d) => d.as_secs_f64() * 1e3,
                None => -(a.duration_since(b).as_secs_f64() * 1e3),
            }),
            _ => None,
        })
    }
    fn record(&self, ev: &Arc<HostEvent>, lane: Lane) -> Result<()> {
        let g = ev.next_generation();
        match self.worker(lane) {
            Some(w) => w.send(Op::Complete(ev.clone(), g)),
            None => {
                ev.complete(g);
                Ok(())
            }
        }
    }
    fn wait(&self, lane: Lane, ev: &Arc<HostEvent>) -> Result<()> {
        let g = ev.recorded();
        match self.worker(lane) {
            Some(w) => w.send(Op::Wait(ev.clone(), g)),
            None => {
                ev.wait_for(g);
                Ok(())
            }
        }
    }
    fn synchronize(&self, ev: &Arc<HostEvent>) -> Result<()> {
        ev.wait_for(ev.recorded());
        Ok(())
    }
    fn is_complete(&self, ev: &Arc<HostEvent>) -> Result<bool> {
        Ok(ev.reached(ev.recorded()))
    }
    fn synchronize_lane(&self, lane: Lane) -> Result<()> {
        let ev = self.new_event()?;
        self.record(&ev, lane)?;
        self.synchronize(&ev)
    }
    unsafe fn copy_to_device(&self, lane: Lane, dst: u64, src: *const u8, n: usize) -> Result<()> {
        self.copy(lane, dst as usize, src as usize, n)
    }
    unsafe fn copy_to_host(&self, lane: Lane, dst: *mut u8, src: u64, n: usize) -> Result<()> {
        self.copy(lane, dst as usize, src as usize, n)
    }
    fn lane_handle(&self, _lane: Lane) -> u64 {
        0
    }
    fn name(&self) -> String {
        "cpu".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_lanes_run_in_order_and_events_order_them() {
        let d = HostDevice::new().expect("device");
        let src: Vec<u8> = (0..=255).collect();
        let mut mid = vec![0u8; 256];
        let mut dst = vec![0u8; 256];
        let ev = d.new_event().expect("event");
        // SAFETY: the buffers outlive the synchronisation below.
        unsafe { d.copy_to_device(Lane::Transfer, mid.as_mut_ptr() as u64, src.as_ptr(), 256) }
            .expect("copy");
        d.record(&ev, Lane::Transfer).expect("record");
        d.wait(Lane::Gradient, &ev).expect("wait");
        // SAFETY: as above.
        unsafe { d.copy_to_host(Lane::Gradient, dst.as_mut_ptr(), mid.as_ptr() as u64, 256) }
            .expect("copy");
        d.synchronize_lane(Lane::Gradient).expect("sync");
        assert_eq!(dst, src);
        assert!(d.is_complete(&ev).expect("query"));
    }

    #[test]
    fn waiting_on_a_never_recorded_event_does_not_block() {
        let d = HostDevice::new().expect("device");
        let ev = d.new_event().expect("event");
        d.wait(Lane::Transfer, &ev).expect("wait");
        d.wait(Lane::Compute(ComputeStream::DEFAULT), &ev)
            .expect("wait");
        d.synchronize_lane(Lane::Transfer).expect("sync");
    }
}
