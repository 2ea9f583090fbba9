//! Buffers passed from Python: a torch tensor (pointer and size come from torch) or, for memory
//! ramtorch allocated, a bare address, which must lie inside a live arena or shared region. Either
//! way the result holds what keeps the memory alive while the engine or a kernel uses it, so no
//! Python call can make ramtorch read or write memory it is not entitled to.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyInt, PyString};

use ramtorch_core::arena::{HostSlice, Lease};
use ramtorch_core::optim::Dtype;
use ramtorch_core::Error;

use crate::arena;

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

/// `e` with `what` in front of an invalid-argument message.
pub(crate) fn named(what: &str, e: Error) -> Error {
    match e {
        Error::InvalidArgument(m) => invalid(format!("{what}: {m}")),
        e => e,
    }
}

fn py_err(what: &str, e: PyErr) -> Error {
    invalid(format!("{what}: {e}"))
}

/// `torch.Tensor` (imported once).
pub(crate) fn torch_tensor_type(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    static TENSOR: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    TENSOR.import(py, "torch", "Tensor")
}

/// torch's dtype object for `d` (imported once).
fn torch_dtype(py: Python<'_>, d: Dtype) -> PyResult<&Bound<'_, PyAny>> {
    static F32: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    static BF16: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    static F16: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let (cell, name) = match d {
        Dtype::F32 => (&F32, "float32"),
        Dtype::BF16 => (&BF16, "bfloat16"),
        Dtype::F16 => (&F16, "float16"),
    };
    cell.import(py, "torch", name)
}

/// What a tensor says about its memory.
pub(crate) struct TensorMemory {
    /// `data_ptr()`.
    pub addr: usize,
    /// `numel() * element_size()`.
    pub nbytes: usize,
}

/// Whether `obj` is a Python int (an address), as opposed to a tensor.
pub(crate) fn is_address(obj: &Bound<'_, PyAny>) -> bool {
    obj.is_instance_of::<PyInt>()
}

/// What a tensor argument must hold.
#[derive(Clone, Copy)]
pub(crate) enum Expect {
    /// At least this many bytes, of any dtype.
    Bytes(usize),
    /// Exactly this many elements of this dtype.
    Elements(Dtype, usize),
}

/// Where a tensor argument must live.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place {
    /// Host memory (`is_cpu`).
    Host,
    /// Anywhere (device memory, whose address cannot be checked further).
    Any,
}

/// Pointer and size of `t`, checked to be a contiguous `torch.Tensor` in `place` holding what
/// `expect` says. Attribute names are interned and `torch.Tensor` is imported once, so this costs
/// a handful of attribute lookups.
pub(crate) fn tensor_memory<'py>(
    what: &str,
    t: &Bound<'py, PyAny>,
    place: Place,
    expect: Expect,
) -> Result<TensorMemory, Error> {
    let py = t.py();
    let not_tensor = || {
        invalid(format!(
            "{what} must be a torch tensor or an int address, got {}",
            t.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_else(|_| "?".into())
        ))
    };
    let tensor_type = torch_tensor_type(py).map_err(|e| py_err(what, e))?;
    if !t.is_instance(tensor_type).map_err(|_| not_tensor())? {
        return Err(not_tensor());
    }
    if let Expect::Elements(want, _) = expect {
        let got = t.getattr(intern!(py, "dtype")).map_err(|_| not_tensor())?;
        if !got.is(torch_dtype(py, want).map_err(|e| py_err(what, e))?) {
            return Err(invalid(format!("{what} is {got}, expected {want}")));
        }
    }
    if place == Place::Host {
        let is_cpu = t
            .getattr(intern!(py, "is_cpu"))
            .and_then(|v| v.extract::<bool>())
            .map_err(|_| not_tensor())?;
        if !is_cpu {
            let dev = t
                .getattr(intern!(py, "device"))
                .map(|d| d.to_string())
                .unwrap_or_default();
            return Err(invalid(format!(
                "{what} must be a CPU tensor, got one on {dev}"
            )));
        }
    }
    let call = |m: &Bound<'py, PyString>| -> Result<Bound<'py, PyAny>, Error> {
        t.call_method0(m).map_err(|e| py_err(what, e))
    };
    let usize_of = |v: Bound<'_, PyAny>| v.extract::<usize>().map_err(|e| py_err(what, e));
    let addr = usize_of(call(intern!(py, "data_ptr"))?)?;
    let numel = usize_of(call(intern!(py, "numel"))?)?;
    let nbytes = match expect {
        Expect::Elements(want, n) => {
            if numel != n {
                return Err(invalid(format!(
                    "{what} has {numel} elements, expected {n}"
                )));
            }
            numel.checked_mul(want.size())
        }
        Expect::Bytes(_) => numel.checked_mul(usize_of(call(intern!(py, "element_size"))?)?),
    }
    .ok_or_else(|| invalid(format!("{what}: size overflows")))?;
    let contiguous = call(intern!(py, "is_contiguous"))?
        .extract::<bool>()
        .map_err(|e| py_err(what, e))?;
    if !contiguous {
        return Err(invalid(format!("{what} must be a contiguous tensor")));
    }
    if let Expect::Bytes(want) = expect {
        if nbytes < want {
            return Err(invalid(format!(
                "{what}: the tensor holds {nbytes} bytes, {want} asked for"
            )));
        }
    }
    Ok(TensorMemory { addr, nbytes })
}

/// A checked host buffer: its address, and what keeps it alive during a call where it is ramtorch
/// memory (other memory is a torch tensor the caller's reference keeps alive for the call).
pub(crate) struct HostBuffer {
    /// Start of the buffer.
    pub addr: usize,
    /// The lease on ramtorch memory, if the buffer is inside an arena or shared region.
    pub lease: Option<Lease>,
}

/// Resolves `obj` to `nbytes` of host memory that may be read and written: a contiguous CPU
/// `torch.Tensor` holding what `expect` says (its pointer from torch; leased when it lies in
/// ramtorch memory), or an int address, which must lie inside a live arena or shared region (and is
/// leased). An address is not checked for null or alignment here: callers that need those check
/// them first, with their own messages.
pub(crate) fn host_buffer(
    what: &str,
    obj: &Bound<'_, PyAny>,
    expect: Expect,
) -> Result<HostBuffer, Error> {
    let nbytes_of = |e: Expect| match e {
        Expect::Bytes(n) => Some(n),
        Expect::Elements(d, n) => n.checked_mul(d.size()),
    };
    if is_address(obj) {
        let addr = obj.extract::<usize>().map_err(|e| py_err(what, e))?;
        let nbytes = nbytes_of(expect).ok_or_else(|| invalid(format!("{what}: size overflows")))?;
        if nbytes == 0 {
            return Ok(HostBuffer { addr, lease: None });
        }
        let s = arena()?.slice(addr, nbytes).map_err(|e| {
            named(
                what,
                match e {
                    Error::InvalidArgument(m) => Error::InvalidArgument(format!(
                        "{m}; pass the tensor itself for memory torch allocated"
                    )),
                    e => e,
                },
            )
        })?;
        return Ok(HostBuffer {
            addr,
            lease: Some(s.lease()),
        });
    }
    let m = tensor_memory(what, obj, Place::Host, expect)?;
    let want = nbytes_of(expect).unwrap_or(m.nbytes);
    let lease = if want > 0 {
        // Memory ramtorch allocated is held by a lease; other memory belongs to the real torch
        // tensor checked above, whose storage the caller's reference keeps alive for the call.
        arena()?.slice(m.addr, want).ok().map(|s| s.lease())
    } else {
        None
    };
    Ok(HostBuffer {
        addr: m.addr,
        lease,
    })
}

/// The first `nbytes` of host memory ramtorch allocated, given as a tensor over it or its address;
/// the slice keeps the memory alive (an engine copy holds it until the copy has retired).
pub(crate) fn host_slice(
    what: &str,
    obj: &Bound<'_, PyAny>,
    nbytes: usize,
) -> Result<HostSlice, Error> {
    if nbytes == 0 {
        return Ok(HostSlice::empty());
    }
    let addr = if is_address(obj) {
        obj.extract::<usize>().map_err(|e| py_err(what, e))?
    } else {
        tensor_memory(what, obj, Place::Host, Expect::Bytes(nbytes))?.addr
    };
    arena()?.slice(addr, nbytes).map_err(|e| named(what, e))
}

/// A device address given as a tensor on the device or as an int, checked as far as it can be:
/// non-null for a non-empty range, and for a tensor, at least `nbytes` long. The address of device
/// memory cannot be checked further (torch's allocator owns it).
pub(crate) fn device_address(
    what: &str,
    obj: &Bound<'_, PyAny>,
    nbytes: usize,
) -> Result<u64, Error> {
    let addr = if is_address(obj) {
        obj.extract::<u64>().map_err(|e| py_err(what, e))?
    } else {
        tensor_memory(what, obj, Place::Any, Expect::Bytes(nbytes))?.addr as u64
    };
    if addr == 0 && nbytes > 0 {
        return Err(invalid(format!("{what}: null address for {nbytes} bytes")));
    }
    if addr.checked_add(nbytes as u64).is_none() {
        return Err(invalid(format!("{what}: address range overflows")));
    }
    Ok(addr)
}
