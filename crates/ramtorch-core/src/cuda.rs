//! Safe wrappers over the few CUDA driver calls the engine makes.
//!
//! The driver library is loaded at run time (cudarc's `dynamic-loading`), so this crate builds and
//! runs on machines without CUDA. [`driver_present`] must be checked before any other call: cudarc
//! panics when it cannot find `libcuda`. Every handle type releases itself on drop, and every call
//! first makes the device's primary context (the one torch uses) current on the calling thread.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;
use cudarc::driver::CudaContext;

use crate::error::{Error, Result};

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library; touches no CUDA state.
    unsafe { sys::is_culib_present() }
}

fn cuda_err(op: &'static str, e: DriverError) -> Error {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned());
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned());
    let detail = match (name, text) {
        (Ok(n), Ok(t)) => format!("{n}: {t}"),
        _ => format!("CUresult {:?}", e.0),
    };
    Error::Cuda { op, detail }
}

fn check(op: &'static str, r: sys::CUresult) -> Result<()> {
    r.result().map_err(|e| cuda_err(op, e))
}

/// Number of CUDA devices, or 0 when there is no driver.
pub fn device_count() -> Result<usize> {
    if !driver_present() {
        return Ok(0);
    }
    match CudaContext::device_count() {
        Ok(n) => Ok(usize::try_from(n).unwrap_or(0)),
        // No device, or the driver refuses to initialise: no CUDA here.
        Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE => Ok(0),
        Err(e) => Err(cuda_err("cuInit", e)),
    }
}

/// The primary context of one device: shared with torch, made current before each call.
#[derive(Clone)]
pub struct Context {
    ctx: Arc<CudaContext>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Context(cuda:{})", self.ctx.ordinal())
    }
}

impl Context {
    /// Retains the primary context of device `ordinal`.
    pub fn new(ordinal: usize) -> Result<Self> {
        if !driver_present() {
            return Err(Error::CudaUnavailable(
                "the CUDA driver library (libcuda.so) was not found".into(),
            ));
        }
        let n = device_count()?;
        if ordinal >= n {
            return Err(Error::CudaUnavailable(format!(
                "device cuda:{ordinal} does not exist ({n} CUDA device(s) visible)"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_err("cuDevicePrimaryCtxRetain", e))?;
        Ok(Self { ctx })
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Makes this context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("cuCtxSetCurrent", e))
    }

    /// Page-locks `len` bytes at `ptr` for every context (`CU_MEMHOSTREGISTER_PORTABLE`), mapped
    /// into the devices' address space (`CU_MEMHOSTREGISTER_DEVICEMAP`: kernels may read it in
    /// place, see [`Context::device_pointer`]).
    ///
    /// # Safety
    /// `ptr..ptr+len` must be a live, page-aligned host allocation that stays mapped until
    /// [`Context::unregister_host`] is called on it.
    pub unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<()> {
        self.bind()?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the caller guarantees the range is a live mapping.
        let r = unsafe { sys::cuMemHostRegister_v2(ptr as *mut c_void, len, flags) };
        check("cuMemHostRegister", r)
    }

    /// The address at which this context's kernels read the page-locked host byte at `ptr`
    /// (`cuMemHostGetDevicePointer`); an error for memory that is not page-locked and mapped.
    pub fn device_pointer(&self, ptr: *const u8) -> Result<u64> {
        self.bind()?;
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: the driver only looks the address up in its registrations and writes `d`.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, ptr as *mut c_void, 0) };
        check("cuMemHostGetDevicePointer", r)?;
        Ok(d)
    }

    /// Undoes [`Context::register_host`].
    ///
    /// # Safety
    /// `ptr` must have been registered with [`Context::register_host`] and not unregistered since.
    pub unsafe fn unregister_host(&self, ptr: *mut u8) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller guarantees `ptr` is a registered range.
        check("cuMemHostUnregister", unsafe {
            sys::cuMemHostUnregister(ptr as *mut c_void)
        })
    }
}

/// A stream the engine owns (non-blocking with respect to the legacy default stream).
pub struct Stream {
    ctx: Context,
    raw: sys::CUstream,
}

// SAFETY: a CUstream handle may be used from any thread once its context is current, which every
// method here ensures.
unsafe impl Send for Stream {}
// SAFETY: as above; the driver serialises calls on one stream internally.
unsafe impl Sync for Stream {}

impl Stream {
    /// Creates a non-blocking stream on `ctx`.
    pub fn new(ctx: &Context) -> Result<Self> {
        ctx.bind()?;
        let mut raw: sys::CUstream = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the context is current.
        let r = unsafe {
            sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        };
        check("cuStreamCreate", r)?;
        Ok(Self {
            ctx: ctx.clone(),
            raw,
        })
    }

    /// The raw handle, as torch's `ExternalStream` takes it.
    pub fn raw(&self) -> u64 {
        self.raw as u64
    }

    /// Blocks the host until all work on the stream is done. The thread sleeps rather than spins
    /// (an event with blocking sync recorded at the stream's end; `cuStreamSynchronize` would spin
    /// under the default scheduling).
    pub fn synchronize(&self) -> Result<()> {
        let ev = Event::new(&self.ctx)?;
        ev.record(self.raw())?;
        ev.synchronize()
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: the stream was created by us and is destroyed once; pending work completes first.
            unsafe {
                let _ = sys::cuStreamSynchronize(self.raw);
                let _ = sys::cuStreamDestroy_v2(self.raw);
            }
        }
    }
}

/// A CUDA event: without timing (the cheapest kind) to order streams, or timed for telemetry.
pub struct Event {
    ctx: Context,
    raw: sys::CUevent,
}

// SAFETY: event handles are usable from any thread with the context current (ensured per call).
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

/// Events the host may wait for are created with `CU_EVENT_BLOCKING_SYNC`: a host thread waiting
/// on one sleeps instead of spinning. With one context and more cores than that, CUDA's default is
/// to spin, and a spinning waiter takes a core from the CPU optimizer, whose speed is bound by how
/// many cores load from memory: under a step-like load of copies and compute, one update took
/// 123 ms with spinning waits and 84 ms with sleeping ones, against 53 ms alone
/// (`bench/contention.py`).
const BLOCKING: u32 = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32;

impl Event {
    /// Creates an event with timing disabled.
    pub fn new(ctx: &Context) -> Result<Self> {
        Self::with_flags(
            ctx,
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32 | BLOCKING,
        )
    }

    /// Creates an event that streams wait for and the host never does: without timing and without
    /// `CU_EVENT_BLOCKING_SYNC`. Recording a blocking-sync event costs more, and with about fifty
    /// of them pending on an H200 the next record blocked the host until earlier ones completed:
    /// a copy queued in 72 parts, an event after each, held the host 6.2 ms alone and 29.6 ms
    /// behind another copy, against 0.16 ms in 10 parts; with these events, 0.31 and 0.20 ms
    /// (`bench/parts_issue.py`).
    pub fn new_stream_only(ctx: &Context) -> Result<Self> {
        Self::with_flags(ctx, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
    }

    /// Creates an event that records a timestamp (see [`Event::elapsed_ms`]). The host only
    /// queries these (the engine times each copy with two of them, for its counters and traces),
    /// so they are without `CU_EVENT_BLOCKING_SYNC`, as lane events are: a backward records two per
    /// gradient, hundreds pending, and blocking-sync ones made each record wait on the device. In a
    /// `torch.profiler` trace of an offloaded ResNet forward+backward on an H200, queueing one
    /// gradient's copy held the host 60 µs at the median and 153 µs at the 90th percentile, and the
    /// compute stream was busy 84 ms of the pass's 185 (`bench/profile_arch.py --arch resnet
    /// --layers 50 --torch-trace`).
    pub fn new_timed(ctx: &Context) -> Result<Self> {
        Self::with_flags(ctx, sys::CUevent_flags::CU_EVENT_DEFAULT as u32)
    }

    fn with_flags(ctx: &Context, flags: u32) -> Result<Self> {
        ctx.bind()?;
        let mut raw: sys::CUevent = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the context is current.
        let r = unsafe { sys::cuEventCreate(&mut raw, flags) };
        check("cuEventCreate", r)?;
        Ok(Self {
            ctx: ctx.clone(),
            raw,
        })
    }

    /// Milliseconds between two completed timed events.
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        self.ctx.bind()?;
        let mut ms = 0f32;
        // SAFETY: both events are live; `ms` is a valid out-pointer.
        check("cuEventElapsedTime", unsafe {
            sys::cuEventElapsedTime_v2(&mut ms, self.raw, end.raw)
        })?;
        Ok(ms)
    }

    /// Records the event on `stream` (a raw handle: ours or torch's).
    pub fn record(&self, stream: u64) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: `raw` is live; `stream` is a stream handle of this context supplied by the caller.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw, stream as sys::CUstream)
        })
    }

    /// Makes `stream` wait (on the device) for the work captured by the last `record`.
    pub fn wait_on(&self, stream: u64) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: as in `record`.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(stream as sys::CUstream, self.raw, 0)
        })
    }

    /// Blocks the host until the recorded work is done.
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: `raw` is a live event.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(self.raw)
        })
    }

    /// Whether the recorded work is done, without blocking.
    pub fn is_complete(&self) -> Result<bool> {
        self.ctx.bind()?;
        // SAFETY: `raw` is a live event.
        let r = unsafe { sys::cuEventQuery(self.raw) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check("cuEventQuery", r).map(|()| true)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: created by us, destroyed once; the driver defers the release until it completes.
            unsafe {
                let _ = sys::cuEventDestroy_v2(self.raw);
            }
        }
    }
}

impl Context {
    /// Lets copies issued in this context reach `peer`'s memory directly (NVLink or PCIe
    /// peer-to-peer). `false` when the two devices cannot: copies between them still work, staged
    /// through host memory by the driver.
    pub fn enable_peer_access(&self, peer: &Context) -> Result<bool> {
        let mut can: std::ffi::c_int = 0;
        // SAFETY: `can` is a valid out-pointer; both devices are live handles of retained contexts.
        check("cuDeviceCanAccessPeer", unsafe {
            sys::cuDeviceCanAccessPeer(&mut can, self.ctx.cu_device(), peer.ctx.cu_device())
        })?;
        if can == 0 {
            return Ok(false);
        }
        self.bind()?;
        // SAFETY: `peer`'s context is retained by `peer` for the duration of the call.
        let r = unsafe { sys::cuCtxEnablePeerAccess(peer.ctx.cu_ctx(), 0) };
        if r == sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            return Ok(true);
        }
        check("cuCtxEnablePeerAccess", r).map(|()| true)
    }
}

/// Device memory allocated in one context, freed on drop.
pub struct DeviceBuffer {
    ctx: Context,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceBuffer(cuda:{}, {} bytes)",
            self.ctx.ordinal(),
            self.len
        )
    }
}

impl DeviceBuffer {
    /// `len` bytes of device memory in `ctx`.
    pub fn new(ctx: &Context, len: usize) -> Result<Self> {
        ctx.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the context is current.
        check("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&mut ptr, len.max(1))
        })?;
        Ok(Self {
            ctx: ctx.clone(),
            ptr,
            len,
        })
    }

    /// The device address.
    pub fn address(&self) -> u64 {
        self.ptr
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: `ptr` was allocated in this context and is freed once, here. Its users
            // (copies queued by `Links`) are done: the owner synchronizes before dropping it.
            unsafe {
                let _ = sys::cuMemFree_v2(self.ptr);
            }
        }
    }
}

/// Copies `n` bytes from `src` (memory of `src_ctx`'s device) to `dst` (memory of `dst_ctx`'s
/// device) on `stream`, a stream of `stream_ctx` (one of the two).
///
/// # Safety
/// Both ranges must stay valid until the copy completes on `stream`.
pub unsafe fn copy_peer(
    dst_ctx: &Context,
    dst: u64,
    src_ctx: &Context,
    src: u64,
    n: usize,
    stream_ctx: &Context,
    stream: u64,
) -> Result<()> {
    stream_ctx.bind()?;
    // SAFETY: the caller guarantees both ranges are valid until the stream reaches the copy;
    // both contexts are retained by their owners.
    let r = unsafe {
        sys::cuMemcpyPeerAsync(
            dst as sys::CUdeviceptr,
            dst_ctx.ctx.cu_ctx(),
            src as sys::CUdeviceptr,
            src_ctx.ctx.cu_ctx(),
            n,
            stream as sys::CUstream,
        )
    };
    check("cuMemcpyPeerAsync", r)
}

/// Copies `n` bytes host→device on `stream`.
///
/// # Safety
/// `src` must stay readable and `dst` writable until the copy completes on `stream`.
pub unsafe fn copy_h2d(
    ctx: &Context,
    dst: u64,
    src: *const u8,
    n: usize,
    stream: u64,
) -> Result<()> {
    ctx.bind()?;
    // SAFETY: the caller guarantees both ranges are valid until the stream reaches the copy.
    let r = unsafe {
        sys::cuMemcpyHtoDAsync_v2(
            dst as sys::CUdeviceptr,
            src as *const c_void,
            n,
            stream as sys::CUstream,
        )
    };
    check("cuMemcpyHtoDAsync", r)
}

/// Copies `n` bytes device→host on `stream`.
///
/// # Safety
/// As for [`copy_h2d`], in the other direction.
pub unsafe fn copy_d2h(ctx: &Context, dst: *mut u8, src: u64, n: usize, stream: u64) -> Result<()> {
    ctx.bind()?;
    // SAFETY: the caller guarantees both ranges are valid until the stream reaches the copy.
    let r = unsafe {
        sys::cuMemcpyDtoHAsync_v2(
            dst as *mut c_void,
            src as sys::CUdeviceptr,
            n,
            stream as sys::CUstream,
        )
    };
    check("cuMemcpyDtoHAsync", r)
}
