//! Buffers passed from Python: a `torch.Tensor` or `torch.nn.Parameter` (not a subclass, whose
//! methods could lie; pointer and size read through torch's C type) or, for memory ramtorch
//! allocated, a bare address, which must lie inside a live arena or shared region. Either way the
//! result holds what keeps ramtorch's memory alive while the engine or a kernel uses it, so no
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

/// `torch.nn.Parameter` (imported once).
fn torch_parameter_type(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    static PARAMETER: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    PARAMETER.import(py, "torch.nn", "Parameter")
}

/// `torch._C.TensorBase`, the C type whose methods report a tensor's memory (imported once). Its
/// methods are called on the tensor from here, so an attribute of the instance cannot stand in
/// for them; the type itself is immutable.
fn tensor_base(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    static BASE: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    BASE.import(py, "torch._C", "TensorBase")
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

/// `torch.uint8` (imported once).
fn torch_uint8(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    static U8: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    U8.import(py, "torch", "uint8")
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
    /// Exactly this many `uint8` elements (the codes of a quantized state).
    Codes(usize),
}

/// Where a tensor argument must live.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place {
    /// Host memory (`is_cpu`).
    Host,
    /// The memory of CUDA device `index` (whose addresses cannot be checked further).
    Cuda(usize),
}

/// The name of `t`'s type, for messages.
fn type_name(t: &Bound<'_, PyAny>) -> String {
    t.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// Pointer and size of `t`, checked to be a contiguous tensor in `place` holding what `expect`
/// says. Only `torch.Tensor` and `torch.nn.Parameter` themselves are trusted: a subclass can make
/// `data_ptr()` or `numel()` say anything (through an override or `__torch_function__`), so it is
/// refused, and the sizes are read through `torch._C.TensorBase`'s methods, not the instance's
/// attributes. `ints`: whether the caller also takes int addresses (named in the message).
/// Attribute names are interned and the types are imported once, so this costs a handful of
/// attribute lookups.
pub(crate) fn tensor_memory<'py>(
    what: &str,
    t: &Bound<'py, PyAny>,
    place: Place,
    expect: Expect,
    ints: bool,
) -> Result<TensorMemory, Error> {
    let py = t.py();
    let or_int = if ints { " or an int address" } else { "" };
    let tensor_type = torch_tensor_type(py).map_err(|e| py_err(what, e))?;
    let ty = t.get_type();
    if !ty.is(tensor_type) && !ty.is(torch_parameter_type(py).map_err(|e| py_err(what, e))?) {
        let is_tensor = t.is_instance(tensor_type).unwrap_or(false);
        return Err(invalid(if is_tensor {
            format!(
                "{what} must be a torch.Tensor or torch.nn.Parameter, not the subclass {}, whose \
                 data_ptr() and numel() cannot be trusted (pass t.as_subclass(torch.Tensor))",
                type_name(t)
            )
        } else {
            format!(
                "{what} must be a torch tensor{or_int}, got {}",
                type_name(t)
            )
        }));
    }
    let base = tensor_base(py).map_err(|e| py_err(what, e))?;
    let call = |m: &Bound<'py, PyString>| -> Result<Bound<'py, PyAny>, Error> {
        base.getattr(m)
            .and_then(|f| f.call1((t,)))
            .map_err(|e| py_err(what, e))
    };
    // Data descriptors of the C type: an instance attribute cannot shadow them.
    if let Expect::Elements(want, _) = expect {
        let got = t
            .getattr(intern!(py, "dtype"))
            .map_err(|e| py_err(what, e))?;
        if !got.is(torch_dtype(py, want).map_err(|e| py_err(what, e))?) {
            return Err(invalid(format!("{what} is {got}, expected {want}")));
        }
    }
    if let Expect::Codes(_) = expect {
        let got = t
            .getattr(intern!(py, "dtype"))
            .map_err(|e| py_err(what, e))?;
        if !got.is(torch_uint8(py).map_err(|e| py_err(what, e))?) {
            return Err(invalid(format!("{what} is {got}, expected uint8")));
        }
    }
    let device = || {
        t.getattr(intern!(py, "device"))
            .map(|d| d.to_string())
            .unwrap_or_default()
    };
    let flag = |name: &Bound<'py, PyString>| -> Result<bool, Error> {
        t.getattr(name)
            .and_then(|v| v.extract::<bool>())
            .map_err(|e| py_err(what, e))
    };
    match place {
        Place::Host => {
            if !flag(intern!(py, "is_cpu"))? {
                return Err(invalid(format!(
                    "{what} must be a CPU tensor, got one on {}",
                    device()
                )));
            }
        }
        Place::Cuda(index) => {
            let on = flag(intern!(py, "is_cuda"))?
                && call(intern!(py, "get_device"))?
                    .extract::<i64>()
                    .map_err(|e| py_err(what, e))?
                    == index as i64;
            if !on {
                return Err(invalid(format!(
                    "{what} must be a tensor on cuda:{index}, got one on {}",
                    device()
                )));
            }
        }
    }
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
        Expect::Codes(n) => {
            if numel != n {
                return Err(invalid(format!(
                    "{what} has {numel} elements, expected {n}"
                )));
            }
            Some(numel)
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
        Expect::Bytes(n) | Expect::Codes(n) => Some(n),
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
    let m = tensor_memory(what, obj, Place::Host, expect, true)?;
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
        tensor_memory(what, obj, Place::Host, Expect::Bytes(nbytes), true)?.addr
    };
    arena()?.slice(addr, nbytes).map_err(|e| named(what, e))
}

/// The address of `nbytes` of device memory given as a tensor in `place` (the engine's device:
/// host memory on the host device). Int addresses are refused: nothing can tell whether one names
/// memory the caller may write, and on the host device it would name any byte of the process.
/// Beyond that, device memory cannot be checked (torch's allocator owns it): the caller keeps the
/// tensor's storage alive while the engine uses it.
pub(crate) fn device_address(
    what: &str,
    obj: &Bound<'_, PyAny>,
    place: Place,
    nbytes: usize,
) -> Result<u64, Error> {
    if is_address(obj) {
        return Err(invalid(format!(
            "{what} must be a tensor, not an int address (an address cannot be checked)"
        )));
    }
    let addr = tensor_memory(what, obj, place, Expect::Bytes(nbytes), false)?.addr as u64;
    if addr == 0 && nbytes > 0 {
        return Err(invalid(format!("{what}: null address for {nbytes} bytes")));
    }
    if addr.checked_add(nbytes as u64).is_none() {
        return Err(invalid(format!("{what}: address range overflows")));
    }
    Ok(addr)
}
