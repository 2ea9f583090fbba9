//! `ramtorch._core`: the PyO3 layer over `ramtorch-core`. Argument conversion, GIL release, error
//! mapping and panic containment; no logic of its own.

mod disk;
mod dlpack;
mod io;
mod memory;
mod optim;
use std::mem::ManuallyDrop;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

use pyo3::create_exception;
use pyo3::exceptions::{PyMemoryError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use ramtorch_core::arena::{Arena, HostSlice};
use ramtorch_core::device::{ComputeStream, CudaDevice, Device, HostDevice, Lane};
use ramtorch_core::engine::{Engine as CoreEngine, EngineStats, Marker};
use ramtorch_core::links::{LinkStats, Links};
use ramtorch_core::shared::SharedRegion;
use ramtorch_core::{cuda, fork, Error};

use dlpack::{export, export_mapped, export_typed, Memory, Typed};

create_exception!(
    _core,
    CudaError,
    PyRuntimeError,
    "A CUDA driver call made by ramtorch failed."
);
create_exception!(
    _core,
    SlotsExhausted,
    PyRuntimeError,
    "Every device slot is held: nothing can be copied to the device until one is released."
);

fn to_py(op: &str, e: Error) -> PyErr {
    match e {
        Error::InvalidArgument(m) => PyValueError::new_err(format!("{op}: {m}")),
        Error::HostAlloc { .. } => PyMemoryError::new_err(format!("{op}: {e}")),
        Error::Cuda { .. } | Error::CudaUnavailable(_) => CudaError::new_err(format!("{op}: {e}")),
        Error::SlotsExhausted { .. } => SlotsExhausted::new_err(format!("{op}: {e}")),
        // OSError(errno, message) picks the matching subclass and keeps the errno (ENOSPC).
        Error::Disk { ref source, .. } => match source.raw_os_error() {
            Some(code) => PyOSError::new_err((code, format!("{op}: {e}"))),
            None => PyOSError::new_err(format!("{op}: {e}")),
        },
        _ => PyRuntimeError::new_err(format!("{op}: {e}")),
    }
}

/// Runs `f`, turning an engine error or a Rust panic into a Python exception naming `op`. In a
/// process forked after ramtorch started in its parent, `f` does not run: a clear error instead
/// of a wait for threads that are not there (see [`fork`]).
pub(crate) fn guard<T>(op: &str, f: impl FnOnce() -> Result<T, Error>) -> PyResult<T> {
    if let Err(e) = fork::enter() {
        return Err(to_py(op, e));
    }
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(to_py(op, e)),
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(PyRuntimeError::new_err(format!(
                "{op}: internal error in the ramtorch engine: {msg}"
            )))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The host arena, exported to torch as DLPack capsules (see `dlpack`).

/// The process-wide arena (see [`Arena::global`]).
pub(crate) fn arena() -> Result<&'static Arena, Error> {
    Arena::global()
}

/// `typed` of the bindings: a dtype as DLPack's (code, bits) and a shape, both given or neither.
fn typed_of(dtype: Option<(u8, u8)>, shape: Option<Vec<i64>>) -> PyResult<Option<Typed>> {
    match (dtype, shape) {
        (None, None) => Ok(None),
        (Some((code, bits)), Some(shape)) => Ok(Some(Typed { code, bits, shape })),
        _ => Err(pyo3::exceptions::PyValueError::new_err(
            "dtype and shape are given together or not at all",
        )),
    }
}

/// Allocates `nbytes` of host arena memory (page-locked when a GPU is present, unless `pin` is
/// false) and returns it as a DLPack capsule of a 1-D uint8 CPU tensor, or, given `dtype`
/// (DLPack's type code and bits) and `shape`, of a contiguous tensor of that dtype and shape over
/// all of it. The memory returns to the arena's pool when the last torch view of it dies.
#[pyfunction]
#[pyo3(signature = (nbytes, zeroed = false, pin = true, dtype = None, shape = None))]
fn arena_alloc(
    py: Python<'_>,
    nbytes: usize,
    zeroed: bool,
    pin: bool,
    dtype: Option<(u8, u8)>,
    shape: Option<Vec<i64>>,
) -> PyResult<Py<PyAny>> {
    let typed = typed_of(dtype, shape)?;
    if let Some(t) = &typed {
        t.check(nbytes)?; // before anything is allocated
    }
    let region = py.detach(|| guard("arena_alloc", || arena()?.alloc_with(nbytes, zeroed, pin)))?;
    export_typed(py, Memory::Arena(region), typed)
}

/// The `nbytes` bytes at `addr` inside a live arena or shared region, as a DLPack capsule of a 1-D
/// uint8 CPU tensor of their own (torch sees a storage of its own, aliasing the region), or of a
/// contiguous tensor of `dtype` and `shape` as in `arena_alloc`; the capsule keeps the region
/// alive. Anything outside memory ramtorch allocated is an error.
#[pyfunction]
#[pyo3(signature = (addr, nbytes, dtype = None, shape = None))]
fn arena_view(
    py: Python<'_>,
    addr: usize,
    nbytes: usize,
    dtype: Option<(u8, u8)>,
    shape: Option<Vec<i64>>,
) -> PyResult<Py<PyAny>> {
    let typed = typed_of(dtype, shape)?;
    let slice = guard("arena_view", || arena()?.slice(addr, nbytes))?;
    export_typed(py, Memory::Slice(slice), typed)
}

/// The `nbytes` bytes at `addr` inside a live arena or shared region, as CUDA device `device`'s
/// kernels read them in place: a DLPack capsule of a 1-D uint8 CUDA tensor over the same memory
/// (mapped page-locked host memory, whose device address must equal its host address), which
/// keeps the region alive. Memory that is not page-locked and mapped (pinning refused, a disk
/// store's mapping) is an error naming why, as is anything outside memory ramtorch allocated.
#[pyfunction]
fn arena_device_view(
    py: Python<'_>,
    addr: usize,
    nbytes: usize,
    device: usize,
) -> PyResult<Py<PyAny>> {
    let slice = guard("arena_device_view", || {
        let slice = arena()?.slice(addr, nbytes)?;
        let ctx = cuda::Context::new(device)?;
        let dptr = ctx.device_pointer(slice.as_ptr())?;
        if dptr != addr as u64 {
            return Err(Error::InvalidArgument(format!(
                "host memory at {addr:#x} is mapped at device address {dptr:#x} on cuda:{device}, \
                 not at its host address"
            )));
        }
        Ok(slice)
    })?;
    export_mapped(py, Memory::Slice(slice), device)
}

// ---------------------------------------------------------------------------------------------
// Host memory shared by the processes of one node, exported like arena regions.

/// Allocates `nbytes` (zero-filled) of host memory other local processes can map too (a memfd,
/// page-locked in this process when a GPU is present). Returns `(capsule, name)`: a DLPack capsule
/// of a 1-D uint8 CPU tensor, and the name (`/proc/<pid>/fd/<fd>`) to pass to `shared_attach` in
/// another process of the same user while this one keeps the region alive. The kernel frees the
/// memory once every process has dropped it (or exited, crashes included).
#[pyfunction]
fn shared_alloc(py: Python<'_>, nbytes: usize) -> PyResult<(Py<PyAny>, String)> {
    let region = py.detach(|| guard("shared_alloc", || SharedRegion::create(arena()?, nbytes)))?;
    let name = region.name().to_owned();
    Ok((export(py, Memory::Shared(region))?, name))
}

/// Maps the shared region `name` (from `shared_alloc` in a live local process), checking it holds
/// exactly `nbytes`; returns a DLPack capsule of a 1-D uint8 CPU tensor over it.
#[pyfunction]
fn shared_attach(py: Python<'_>, name: &str, nbytes: usize) -> PyResult<Py<PyAny>> {
    let region = py.detach(|| {
        guard("shared_attach", || {
            SharedRegion::attach(arena()?, name, nbytes)
        })
    })?;
    export(py, Memory::Shared(region))
}

/// Byte counts of the host arena.
#[pyfunction]
fn arena_stats(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let (s, pins) = guard("arena_stats", || arena().map(|a| (a.stats(), a.pins())))?;
    let d = PyDict::new(py);
    d.set_item("reserved_bytes", s.reserved_bytes)?;
    d.set_item("in_use_bytes", s.in_use_bytes)?;
    d.set_item("pinned_bytes", s.pinned_bytes)?;
    d.set_item("pageable_bytes", s.pageable_bytes)?;
    d.set_item("pooled_bytes", s.pooled_bytes)?;
    d.set_item("regions", s.regions)?;
    d.set_item("pinning", pins)?;
    Ok(d)
}

/// Returns the arena's pooled (free) memory to the OS.
#[pyfunction]
fn arena_empty_cache(py: Python<'_>) -> PyResult<()> {
    py.detach(|| guard("arena_empty_cache", || arena().map(Arena::empty_cache)))
}

/// Why pinning was refused, once, or None.
#[pyfunction]
fn take_pin_warning() -> PyResult<Option<String>> {
    guard("take_pin_warning", || Ok(arena()?.take_pin_warning()))
}

/// Number of CUDA devices the driver sees (0 without a driver).
#[pyfunction]
fn cuda_device_count() -> PyResult<usize> {
    guard("cuda_device_count", cuda::device_count)
}

// ---------------------------------------------------------------------------------------------
// The engine of one device.

enum AnyEngine {
    Cuda(CoreEngine<CudaDevice>),
    Host(CoreEngine<HostDevice>),
    /// A CUDA device fed by its own link and through peer devices.
    CudaLinks(CoreEngine<Links<CudaDevice>>),
    /// The host device with host-device "peers": the same split and relay logic, without a GPU.
    HostLinks(CoreEngine<Links<HostDevice>>),
}

macro_rules! with_engine {
    ($self:expr, $e:ident => $body:expr) => {
        match &*$self.inner {
            AnyEngine::Cuda($e) => $body,
            AnyEngine::Host($e) => $body,
            AnyEngine::CudaLinks($e) => $body,
            AnyEngine::HostLinks($e) => $body,
        }
    };
}

impl AnyEngine {
    /// Where the device's memory is.
    fn place(&self) -> memory::Place {
        match self {
            AnyEngine::Cuda(e) => memory::Place::Cuda(e.device().context().ordinal()),
            AnyEngine::CudaLinks(e) => memory::Place::Cuda(e.device().own().context().ordinal()),
            AnyEngine::Host(_) | AnyEngine::HostLinks(_) => memory::Place::Host,
        }
    }

    fn name(&self) -> String {
        match self {
            AnyEngine::Cuda(e) => e.device().name(),
            AnyEngine::Host(e) => e.device().name(),
            AnyEngine::CudaLinks(e) => e.device().name(),
            AnyEngine::HostLinks(e) => e.device().name(),
        }
    }

    fn link_stats(&self) -> Option<LinkStats> {
        match self {
            AnyEngine::CudaLinks(e) => Some(e.device().stats()),
            AnyEngine::HostLinks(e) => Some(e.device().stats()),
            AnyEngine::Cuda(_) | AnyEngine::Host(_) => None,
        }
    }
}

/// What keeps the device slots alive while they are the slots.
#[derive(Default)]
struct SlotMemory {
    /// The slot tensors given to `set_slots`.
    _tensors: Vec<Py<PyAny>>,
    /// On the host device, the arena ranges they lie in.
    host: Vec<HostSlice>,
}

/// The streamer of one device: slots, transfer and gradient streams, throttle.
#[pyclass(module = "ramtorch._core", frozen)]
struct Engine {
    /// Dropped unless this process is a forked child (see `Drop`).
    inner: ManuallyDrop<AnyEngine>,
    name: String,
    slots: Mutex<SlotMemory>,
}

impl Drop for Engine {
    fn drop(&mut self) {
        if fork::in_forked_child() {
            // The parent's engine: its lane threads are not in this process (joining them would
            // wait forever) and its memory may be guarded by a lock one of them held. Left as is.
            if let Ok(slots) = self.slots.get_mut() {
                std::mem::forget(std::mem::take(&mut slots.host));
            }
            return;
        }
        // SAFETY: `inner` is dropped once, here, and never used again.
        unsafe { ManuallyDrop::drop(&mut self.inner) };
    }
}

fn stats_dict<'py>(py: Python<'py>, s: EngineStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("h2d_bytes", s.h2d_bytes)?;
    d.set_item("h2d_copies", s.h2d_copies)?;
    d.set_item("d2h_bytes", s.d2h_bytes)?;
    d.set_item("d2h_copies", s.d2h_copies)?;
    d.set_item("throttle_waits", s.throttle_waits)?;
    d.set_item("throttle_wait_seconds", s.throttle_wait_seconds)?;
    d.set_item("sync_wait_seconds", s.sync_wait_seconds)?;
    d.set_item("h2d_seconds", s.h2d_seconds)?;
    d.set_item("h2d_timed_bytes", s.h2d_timed_bytes)?;
    d.set_item("d2h_seconds", s.d2h_seconds)?;
    d.set_item("d2h_timed_bytes", s.d2h_timed_bytes)?;
    d.set_item("stall_seconds", s.stall_seconds)?;
    d.set_item("claims", s.claims)?;
    d.set_item("reuses", s.reuses)?;
    d.set_item("reused_bytes", s.reused_bytes)?;
    Ok(d)
}

impl Engine {
    /// Checks that a unit of `nbytes` fits the slots, before its memory is looked up.
    fn fits(&self, nbytes: usize) -> Result<(), Error> {
        let (_, slot_bytes) = with_engine!(self, e => e.slots())?;
        if nbytes > slot_bytes {
            return Err(Error::InvalidArgument(format!(
                "a unit of {nbytes} bytes does not fit the {slot_bytes} byte device slots"
            )));
        }
        Ok(())
    }
}

#[pymethods]
impl Engine {
    /// `kind` is `"cpu"` (the host device: worker-thread copies) or `"cuda"` with its ordinal
    /// `index`. `relays` (CUDA ordinals; on the host device, one entry per host "peer") feed the
    /// device through peers as well as its own link, each copy split by `shares` (own link
    /// first; default equal) in pieces of at most `chunk` bytes; copies under `min_split` bytes
    /// take the own link only.
    #[new]
    #[pyo3(signature = (kind, index = 0, relays = None, shares = None, chunk = 64 << 20, min_split = 4 << 20))]
    fn new(
        py: Python<'_>,
        kind: &str,
        index: usize,
        relays: Option<Vec<usize>>,
        shares: Option<Vec<f64>>,
        chunk: usize,
        min_split: usize,
    ) -> PyResult<Self> {
        let op = "Engine()";
        let relays = relays.unwrap_or_default();
        let shares = shares.unwrap_or_else(|| vec![1.0; relays.len() + 1]);
        let inner = match (kind, relays.is_empty()) {
            ("cpu", true) => {
                AnyEngine::Host(CoreEngine::new(py.detach(|| guard(op, HostDevice::new))?))
            }
            ("cuda", true) => AnyEngine::Cuda(CoreEngine::new(
                py.detach(|| guard(op, || CudaDevice::new(index)))?,
            )),
            ("cpu", false) => AnyEngine::HostLinks(CoreEngine::new(py.detach(|| {
                guard(op, || {
                    let peers = relays
                        .iter()
                        .map(|_| HostDevice::new())
                        .collect::<Result<Vec<_>, _>>()?;
                    Links::new(HostDevice::new()?, peers, &shares, chunk, min_split)
                })
            })?)),
            ("cuda", false) => AnyEngine::CudaLinks(CoreEngine::new(py.detach(|| {
                guard(op, || {
                    if relays.contains(&index) {
                        return Err(Error::InvalidArgument(format!(
                            "cuda:{index} cannot relay to itself (relays {relays:?})"
                        )));
                    }
                    let peers = relays
                        .iter()
                        .map(|&i| CudaDevice::new(i))
                        .collect::<Result<Vec<_>, _>>()?;
                    Links::new(CudaDevice::new(index)?, peers, &shares, chunk, min_split)
                })
            })?)),
            (other, _) => {
                return Err(PyValueError::new_err(format!(
                    "{op}: unsupported device type {other:?}"
                )))
            }
        };
        let name = inner.name();
        Ok(Self {
            inner: ManuallyDrop::new(inner),
            name,
            slots: Mutex::new(SlotMemory::default()),
        })
    }

    /// Device name, e.g. `cuda:0`.
    #[getter]
    fn name(&self) -> String {
        self.name.clone()
    }

    /// `(count, bytes)` of the device slots.
    fn slots(&self) -> PyResult<(usize, usize)> {
        guard("slots", || with_engine!(self, e => e.slots()))
    }

    /// Uses `slots` (each at least `nbytes` long) as the device slots; the engine keeps them
    /// alive while they are its slots. On a CUDA device, contiguous tensors on that device; on the
    /// host device, host memory ramtorch allocated (a tensor over an arena region, or its
    /// address), which the engine then writes. Int addresses of device memory are refused: they
    /// cannot be checked.
    fn set_slots(
        &self,
        py: Python<'_>,
        slots: Vec<Bound<'_, PyAny>>,
        nbytes: usize,
    ) -> PyResult<()> {
        let op = "set_slots";
        let (ptrs, host) = guard(op, || {
            let mut ptrs = Vec::with_capacity(slots.len());
            let mut host = Vec::new();
            for (i, s) in slots.iter().enumerate() {
                let what = format!("slot {i}");
                match self.inner.place() {
                    place @ memory::Place::Cuda(_) => {
                        ptrs.push(memory::device_address(&what, s, place, nbytes)?);
                    }
                    memory::Place::Host => {
                        let slice = memory::host_slice(&what, s, nbytes)?;
                        ptrs.push(slice.as_ptr() as u64);
                        host.push(slice);
                    }
                }
            }
            Ok((ptrs, host))
        })?;
        let tensors: Vec<Py<PyAny>> = slots
            .iter()
            .filter(|s| !memory::is_address(s))
            .map(|s| s.clone().unbind())
            .collect();
        // SAFETY: on a CUDA device the slots are tensors on that device, kept alive below for as
        // long as they are the slots (their storage is the caller's to keep: device memory
        // cannot be checked further); on the host device they are arena ranges whose leases are
        // kept below.
        py.detach(|| {
            guard(
                op,
                || with_engine!(self, e => unsafe { e.set_slots(&ptrs, nbytes) }),
            )
        })?;
        let old = match self.slots.lock() {
            Ok(mut m) => std::mem::replace(
                &mut *m,
                SlotMemory {
                    _tensors: tensors,
                    host,
                },
            ),
            Err(_) => return Err(PyRuntimeError::new_err("set_slots: lock poisoned")),
        };
        drop(old);
        Ok(())
    }

    /// Copies the first `nbytes` of `src` (a tensor over arena memory, or its address) into a free
    /// slot; the compute stream `stream` waits for the copy. The engine keeps the memory alive
    /// until the copy has run. Returns `(slot index, slot device address)`.
    fn acquire(
        &self,
        py: Python<'_>,
        src: &Bound<'_, PyAny>,
        nbytes: usize,
        max_inflight: usize,
        stream: u64,
    ) -> PyResult<(usize, u64)> {
        let op = "acquire";
        let src = guard(op, || {
            self.fits(nbytes)?;
            memory::host_slice("src", src, nbytes)
        })?;
        py.detach(|| {
            guard(
                op,
                || with_engine!(self, e => e.acquire_slice(&src, max_inflight, ComputeStream::from_raw(stream))),
            )
        })
    }

    /// Issues the copy of a unit into a free slot (held until `release`) without making any
    /// stream wait for it; returns `(slot, device address, copied)`. With a `key`, a slot still
    /// holding that key is reused without a copy; eviction spares the keys in `keep`.
    /// `src` is as for `acquire`. With `parts` (increasing byte offsets inside the copy) the copy
    /// goes in pieces ending there, each with an event that `claim_part` waits for.
    #[pyo3(signature = (key, src, nbytes, max_inflight, keep, tag = 0, parts = Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn prefetch(
        &self,
        py: Python<'_>,
        key: Option<u64>,
        src: &Bound<'_, PyAny>,
        nbytes: usize,
        max_inflight: usize,
        keep: Vec<u64>,
        tag: u64,
        parts: Vec<usize>,
    ) -> PyResult<(usize, u64, bool)> {
        let op = "prefetch";
        let src = guard(op, || {
            self.fits(nbytes)?;
            memory::host_slice("src", src, nbytes)
        })?;
        py.detach(|| {
            guard(
                op,
                || with_engine!(self, e => e.prefetch_parts(key, &src, max_inflight, &keep, tag, &parts)),
            )
        })
    }

    /// Captures the copies queued so far on both engine streams; returns an id for `wait_marker`.
    fn marker(&self, py: Python<'_>) -> PyResult<u64> {
        py.detach(|| {
            guard(
                "marker",
                || with_engine!(self, e => e.marker().map(Marker::raw)),
            )
        })
    }

    /// Blocks (without the GIL) until the copies captured by `marker` are done.
    fn wait_marker(&self, py: Python<'_>, marker: u64) -> PyResult<()> {
        py.detach(|| {
            guard(
                "wait_marker",
                || with_engine!(self, e => e.wait_marker(Marker::from_raw(marker))),
            )
        })
    }

    /// Whether the copies captured by `marker` are done, without blocking.
    fn marker_done(&self, py: Python<'_>, marker: u64) -> PyResult<bool> {
        py.detach(|| {
            guard(
                "marker_done",
                || with_engine!(self, e => e.marker_done(Marker::from_raw(marker))),
            )
        })
    }

    /// Makes `stream` wait for the copy into held slot `slot`.
    #[pyo3(signature = (slot, stream, tag = 0))]
    fn claim(&self, py: Python<'_>, slot: usize, stream: u64, tag: u64) -> PyResult<()> {
        py.detach(|| {
            guard(
                "claim",
                || with_engine!(self, e => e.claim(slot, ComputeStream::from_raw(stream), tag)),
            )
        })
    }

    /// Makes `stream` wait for the first `upto` bytes of the copy into held slot `slot` (the
    /// part of a `prefetch` with `parts` that covers them, else the whole copy).
    #[pyo3(signature = (slot, stream, upto, tag = 0))]
    fn claim_part(
        &self,
        py: Python<'_>,
        slot: usize,
        stream: u64,
        upto: usize,
        tag: u64,
    ) -> PyResult<()> {
        py.detach(|| {
            guard(
                "claim_part",
                || with_engine!(self, e => e.claim_part(slot, ComputeStream::from_raw(stream), upto, tag)),
            )
        })
    }

    /// Forgets which unit each slot holds.
    fn invalidate(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| guard("invalidate", || with_engine!(self, e => e.invalidate())))
    }

    /// Records a trace instant on `stream` (nothing while no trace is on).
    fn mark(&self, py: Python<'_>, stream: u64, tag: u64, code: u64) -> PyResult<()> {
        py.detach(|| {
            guard(
                "mark",
                || with_engine!(self, e => e.mark(ComputeStream::from_raw(stream), tag, code)),
            )
        })
    }

    /// Starts keeping timed records, relative to this point on `stream`.
    fn trace_start(&self, py: Python<'_>, stream: u64) -> PyResult<()> {
        py.detach(|| {
            guard(
                "trace_start",
                || with_engine!(self, e => e.trace_start(ComputeStream::from_raw(stream))),
            )
        })
    }

    /// Ends the trace: a list of `(kind, tag, code, bytes, start_ms, end_ms)`.
    #[allow(clippy::type_complexity)]
    fn trace_stop(&self, py: Python<'_>) -> PyResult<Vec<(&'static str, u64, u64, u64, f64, f64)>> {
        let recs = py.detach(|| guard("trace_stop", || with_engine!(self, e => e.trace_stop())))?;
        Ok(recs
            .into_iter()
            .map(|r| (r.kind, r.tag, r.code, r.bytes, r.start_ms, r.end_ms))
            .collect())
    }

    /// Releases a slot after the work queued on `stream` so far.
    fn release(&self, py: Python<'_>, slot: usize, stream: u64) -> PyResult<()> {
        py.detach(|| {
            guard(
                "release",
                || with_engine!(self, e => e.release(slot, ComputeStream::from_raw(stream))),
            )
        })
    }

    /// Queues a device→host copy of `nbytes` on the gradient stream after the work queued on
    /// `stream`; returns how many earlier gradient copies have completed since the last report.
    /// `dst` is arena memory (a tensor over it, or its address), kept alive by the engine until
    /// the copy has run; `src` is a contiguous tensor on the engine's device (a CPU tensor on the
    /// host device; an int address is refused), which the caller keeps alive until the copy is
    /// reported complete.
    #[pyo3(signature = (dst, src, nbytes, max_inflight, stream, tag = 0))]
    #[allow(clippy::too_many_arguments)]
    fn copy_to_host(
        &self,
        py: Python<'_>,
        dst: &Bound<'_, PyAny>,
        src: &Bound<'_, PyAny>,
        nbytes: usize,
        max_inflight: usize,
        stream: u64,
        tag: u64,
    ) -> PyResult<usize> {
        let op = "copy_to_host";
        let (dst, src) = guard(op, || {
            let place = self.inner.place();
            Ok((
                memory::host_slice("dst", dst, nbytes)?,
                memory::device_address("src", src, place, nbytes)?,
            ))
        })?;
        // SAFETY: the host side is kept alive by the slice; the source is a tensor on this
        // engine's device at least `nbytes` long (checked above), which the front end keeps alive
        // until this engine reports the copy complete.
        py.detach(|| guard(op, || with_engine!(self, e => unsafe { e.copy_to_host_slice(&dst, src, max_inflight, ComputeStream::from_raw(stream), tag) })))
    }

    /// Waits for both engine streams; returns the number of gradient copies newly completed.
    fn synchronize(&self, py: Python<'_>) -> PyResult<usize> {
        py.detach(|| guard("synchronize", || with_engine!(self, e => e.synchronize())))
    }

    /// Copies in flight `(host→device, device→host)`.
    fn in_flight(&self) -> PyResult<(usize, usize)> {
        guard("in_flight", || with_engine!(self, e => e.in_flight()))
    }

    /// Raw handle of the transfer stream (0 on the host device).
    fn transfer_stream(&self) -> u64 {
        with_engine!(self, e => e.device().lane_handle(Lane::Transfer))
    }

    /// Raw handle of the gradient stream (0 on the host device).
    fn gradient_stream(&self) -> u64 {
        with_engine!(self, e => e.device().lane_handle(Lane::Gradient))
    }

    /// Counters of this engine.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = guard("stats", || with_engine!(self, e => e.stats()))?;
        stats_dict(py, s)
    }

    /// Bytes each link carried to the device (`own_bytes`, `relay_bytes`: one per peer) and from
    /// it (`own_down_bytes`, `relay_down_bytes`), and `direct` (whether each peer reaches the
    /// device directly), or `None` for an engine fed by its own link only.
    fn link_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(s) = self.inner.link_stats() else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("own_bytes", s.own_bytes)?;
        d.set_item("relay_bytes", s.relay_bytes)?;
        d.set_item("own_down_bytes", s.own_down_bytes)?;
        d.set_item("relay_down_bytes", s.relay_down_bytes)?;
        d.set_item("direct", s.direct)?;
        Ok(Some(d))
    }

    fn __repr__(&self) -> String {
        format!("Engine({})", self.name)
    }
}

/// ramtorch's engine, compiled.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("CudaError", m.py().get_type::<CudaError>())?;
    m.add("SlotsExhausted", m.py().get_type::<SlotsExhausted>())?;
    m.add(
        "DEFAULT_MAX_INFLIGHT",
        ramtorch_core::engine::DEFAULT_MAX_INFLIGHT,
    )?;
    m.add("MAX_MAX_INFLIGHT", ramtorch_core::engine::MAX_MAX_INFLIGHT)?;
    m.add_function(wrap_pyfunction!(arena_alloc, m)?)?;
    m.add_function(wrap_pyfunction!(arena_view, m)?)?;
    m.add_function(wrap_pyfunction!(arena_device_view, m)?)?;
    m.add_function(wrap_pyfunction!(arena_stats, m)?)?;
    m.add_function(wrap_pyfunction!(arena_empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(take_pin_warning, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_device_count, m)?)?;
    m.add_function(wrap_pyfunction!(shared_alloc, m)?)?;
    m.add_function(wrap_pyfunction!(shared_attach, m)?)?;
    m.add_class::<Engine>()?;
    optim::register(m)?;
    io::register(m)?;
    disk::register(m)?;
    Ok(())
}
