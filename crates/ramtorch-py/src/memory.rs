//! Buffers passed from Python: a torch tensor (pointer and size come from torch) or, for memory
//! ramtorch allocated, a bare address, which must lie inside a live arena or shared region. Either
//! way the result holds what keeps the memory alive while the engine or a kernel uses it, so no
//! Python call can make ramtorch read or write memory it is not entitled to.

use pyo3::prelude::*;
use pyo3::types::PyInt;

use ramtorch_core::arena::HostSlice;
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

/// Pointer and size of a contiguous tensor (anything with torch's tensor methods).
pub(crate) fn tensor_memory(what: &str, t: &Bound<'_, PyAny>) -> Result<TensorMemory, Error> {
    let call = |m: &str| -> Result<Bound<'_, PyAny>, Error> {
        t.call_method0(m).map_err(|_| {
            invalid(format!(
                "{what} must be a torch tensor or an int address, got {}",
                t.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_else(|_| "?".into())
            ))
        })
    };
    let usize_of = |v: Bound<'_, PyAny>| v.extract::<usize>().map_err(|e| py_err(what, e));
    let addr = usize_of(call("data_ptr")?)?;
    let numel = usize_of(call("numel")?)?;
    let elsize = usize_of(call("element_size")?)?;
    let contiguous = call("is_contiguous")?
        .extract::<bool>()
        .map_err(|e| py_err(what, e))?;
    if !contiguous {
        return Err(invalid(format!("{what} must be a contiguous tensor")));
    }
    let nbytes = numel
        .checked_mul(elsize)
        .ok_or_else(|| invalid(format!("{what}: size overflows")))?;
    Ok(TensorMemory { addr, nbytes })
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
        let m = tensor_memory(what, obj)?;
        if m.nbytes < nbytes {
            return Err(invalid(format!(
                "{what}: the tensor holds {} bytes, {nbytes} asked for",
                m.nbytes
            )));
        }
        m.addr
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
        let m = tensor_memory(what, obj)?;
        if m.nbytes < nbytes {
            return Err(invalid(format!(
                "{what}: the tensor holds {} bytes, {nbytes} asked for",
                m.nbytes
            )));
        }
        m.addr as u64
    };
    if addr == 0 && nbytes > 0 {
        return Err(invalid(format!("{what}: null address for {nbytes} bytes")));
    }
    if addr.checked_add(nbytes as u64).is_none() {
        return Err(invalid(format!("{what}: address range overflows")));
    }
    Ok(addr)
}
