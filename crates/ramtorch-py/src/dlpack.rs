//! Host memory handed to torch as DLPack capsules: a 1-D `uint8` CPU tensor over an arena region
//! or a shared region, which the capsule (then torch's tensor) keeps alive, or a contiguous tensor
//! of a given dtype and shape over it ([`Typed`]: one call instead of a byte tensor and two
//! views, where the front end makes a tensor for every gradient); or, for page-locked memory
//! mapped into a GPU's address space, a CUDA tensor over the same bytes (kernels read them over
//! the link in place).

use std::ffi::{c_char, c_void, CStr};

use pyo3::prelude::*;

use ramtorch_core::arena::{HostSlice, Region};
use ramtorch_core::disk::DiskStore;
use ramtorch_core::shared::SharedRegion;

#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}
#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}
#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}
#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// Host memory a capsule keeps alive: an arena region, a region shared between processes, a byte
/// range inside one of those (which keeps its region alive), or the mapping of a disk store.
pub(crate) enum Memory {
    Arena(Region),
    Shared(SharedRegion),
    Slice(HostSlice),
    Disk(DiskStore),
}

impl Memory {
    fn as_ptr(&self) -> *mut u8 {
        match self {
            Memory::Arena(r) => r.as_ptr(),
            Memory::Shared(r) => r.as_ptr(),
            Memory::Slice(r) => r.as_ptr(),
            Memory::Disk(r) => r.as_ptr(),
        }
    }
    fn len(&self) -> usize {
        match self {
            Memory::Arena(r) => r.len(),
            Memory::Shared(r) => r.len(),
            Memory::Slice(r) => r.len(),
            Memory::Disk(r) => r.len(),
        }
    }
}

/// What a capsule owns: the memory and the shape array the DLTensor points into.
struct Export {
    _memory: Memory,
    shape: Vec<i64>,
}

/// The dtype and shape of a contiguous tensor over a capsule's whole memory: DLPack's type code
/// (0 int, 1 uint, 2 float, 4 bfloat, 6 bool) and width in bits, and the sizes.
pub(crate) struct Typed {
    pub code: u8,
    pub bits: u8,
    pub shape: Vec<i64>,
}

impl Typed {
    /// Checks that the type is one torch reads from DLPack and that the shape covers exactly
    /// `nbytes` bytes.
    pub(crate) fn check(&self, nbytes: usize) -> PyResult<()> {
        let known = matches!(
            (self.code, self.bits),
            (0, 8 | 16 | 32 | 64) | (1, 8 | 16 | 32 | 64) | (2, 16 | 32 | 64) | (4, 16) | (6, 8)
        );
        if !known {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "DLPack type (code {}, {} bits) is not one ramtorch exports",
                self.code, self.bits
            )));
        }
        let mut elems: usize = 1;
        for &d in &self.shape {
            let d = usize::try_from(d).map_err(|_| {
                pyo3::exceptions::PyValueError::new_err(format!("negative size {d} in a shape"))
            })?;
            elems = elems.checked_mul(d).ok_or_else(|| {
                pyo3::exceptions::PyValueError::new_err("a shape whose size overflows")
            })?;
        }
        let want = elems.checked_mul(usize::from(self.bits) / 8);
        if want != Some(nbytes) {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "shape {:?} of {}-bit elements does not cover the {nbytes} bytes it views",
                self.shape, self.bits
            )));
        }
        Ok(())
    }
}

const DLTENSOR: &CStr = c"dltensor";
const K_DL_CPU: i32 = 1;
const K_DL_UINT: u8 = 1;

unsafe extern "C" fn dl_deleter(m: *mut DLManagedTensor) {
    if m.is_null() || ramtorch_core::fork::in_forked_child() {
        // (In a child forked from a process using ramtorch, every region is the parent's: its
        // pool's lock may have been held by a thread that is not in the child. Left mapped.)
        return;
    }
    // SAFETY: `m` and its context were made by `Box::into_raw` in `export` and are released once,
    // by whoever owns the tensor last (torch, or the capsule destructor if never consumed). Dropping
    // the Region is plain Rust and needs no GIL.
    unsafe {
        let m = Box::from_raw(m);
        drop(Box::from_raw(m.manager_ctx as *mut Export));
    }
}

unsafe extern "C" fn capsule_destructor(cap: *mut pyo3::ffi::PyObject) {
    // SAFETY: called by Python with a live capsule. A consumed capsule was renamed by its consumer
    // ("used_dltensor") and must not be freed here.
    unsafe {
        if pyo3::ffi::PyCapsule_IsValid(cap, DLTENSOR.as_ptr()) == 1 {
            let m = pyo3::ffi::PyCapsule_GetPointer(cap, DLTENSOR.as_ptr()) as *mut DLManagedTensor;
            dl_deleter(m);
        }
    }
}

const K_DL_CUDA: i32 = 2;

/// A DLPack capsule of a 1-D uint8 CPU tensor over `memory`, which it keeps alive.
pub(crate) fn export(py: Python<'_>, memory: Memory) -> PyResult<Py<PyAny>> {
    export_at(py, memory, None, None)
}

/// A DLPack capsule of a contiguous CPU tensor of `typed`'s dtype and shape over `memory` (all of
/// it: [`Typed::check`] first), or of a 1-D uint8 one without `typed`, which keeps it alive.
pub(crate) fn export_typed(
    py: Python<'_>,
    memory: Memory,
    typed: Option<Typed>,
) -> PyResult<Py<PyAny>> {
    if let Some(t) = &typed {
        t.check(memory.len())?;
    }
    export_at(py, memory, None, typed)
}

/// A DLPack capsule of a 1-D uint8 tensor over the page-locked host `memory` as CUDA device
/// `device` reads it in place (mapped host memory: its device address is its host address,
/// which the caller has checked), keeping `memory` alive as [`export`] does.
pub(crate) fn export_mapped(py: Python<'_>, memory: Memory, device: usize) -> PyResult<Py<PyAny>> {
    export_at(py, memory, Some(device), None)
}

fn export_at(
    py: Python<'_>,
    memory: Memory,
    cuda: Option<usize>,
    typed: Option<Typed>,
) -> PyResult<Py<PyAny>> {
    let (device_type, device_id) = match cuda {
        None => (K_DL_CPU, 0),
        Some(d) => (
            K_DL_CUDA,
            i32::try_from(d).map_err(|_| {
                pyo3::exceptions::PyValueError::new_err(format!("device index {d} is too large"))
            })?,
        ),
    };
    let ptr = memory.as_ptr();
    let (code, bits, shape) = match typed {
        Some(t) => (t.code, t.bits, t.shape),
        None => (K_DL_UINT, 8, vec![memory.len() as i64]),
    };
    let ndim = i32::try_from(shape.len())
        .map_err(|_| pyo3::exceptions::PyValueError::new_err("too many dimensions"))?;
    let mut ctx = Box::new(Export {
        shape,
        _memory: memory,
    });
    let shape = ctx.shape.as_mut_ptr();
    let managed = Box::new(DLManagedTensor {
        dl_tensor: DLTensor {
            data: ptr as *mut c_void,
            device: DLDevice {
                device_type,
                device_id,
            },
            ndim,
            dtype: DLDataType {
                code,
                bits,
                lanes: 1,
            },
            shape,
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        },
        manager_ctx: Box::into_raw(ctx) as *mut c_void,
        deleter: Some(dl_deleter),
    });
    let raw = Box::into_raw(managed);
    // SAFETY: `raw` is a valid DLManagedTensor; the capsule owns it until a consumer renames it.
    let cap = unsafe {
        pyo3::ffi::PyCapsule_New(
            raw as *mut c_void,
            DLTENSOR.as_ptr() as *const c_char,
            Some(capsule_destructor),
        )
    };
    if cap.is_null() {
        // SAFETY: the capsule was not created, so we still own `raw`.
        unsafe { dl_deleter(raw) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: `cap` is a new, owned reference.
    Ok(unsafe { Bound::from_owned_ptr(py, cap) }.unbind())
}
