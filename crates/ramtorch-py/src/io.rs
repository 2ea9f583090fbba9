//! Bindings of the safetensors reader (`ramtorch_core::io`): `SafetensorsFile(path)` maps and
//! validates a file; `copy_into` copies one tensor to a caller's address (converting among F32,
//! BF16 and F16) without the GIL. A file that cannot be opened raises `OSError`; a file that is not
//! valid safetensors raises `ValueError`, naming the path (and the tensor).

use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use ramtorch_core::io::{self, OpenError};
use ramtorch_core::Error;

use crate::guard;

/// A memory-mapped, validated `.safetensors` file.
#[pyclass(module = "ramtorch._core", frozen)]
struct SafetensorsFile {
    inner: io::SafetensorsFile,
}

#[pymethods]
impl SafetensorsFile {
    /// Maps `path` and validates its header (offsets in range, no overlaps, sizes consistent).
    #[new]
    fn new(py: Python<'_>, path: std::path::PathBuf) -> PyResult<Self> {
        let op = "SafetensorsFile";
        let r = py.detach(|| {
            catch_unwind(AssertUnwindSafe(|| io::SafetensorsFile::open(&path)))
                .map_err(|_| format!("internal error while opening {}", path.display()))
        });
        match r {
            Ok(Ok(inner)) => Ok(Self { inner }),
            Ok(Err(OpenError::Io { path, source })) => {
                let msg = format!("{op}: cannot open {}: {source}", path.display());
                Err(match source.raw_os_error() {
                    // OSError(errno, strerror, filename) picks the matching subclass
                    // (FileNotFoundError, PermissionError, ...).
                    Some(code) => PyOSError::new_err((code, msg, path.display().to_string())),
                    None => PyOSError::new_err(msg),
                })
            }
            Ok(Err(OpenError::Invalid(Error::InvalidArgument(m)))) => {
                Err(PyValueError::new_err(format!("{op}: {m}")))
            }
            Ok(Err(OpenError::Invalid(e))) => Err(PyRuntimeError::new_err(format!("{op}: {e}"))),
            Err(m) => Err(PyRuntimeError::new_err(format!("{op}: {m}"))),
        }
    }

    /// The file's path.
    #[getter]
    fn path(&self) -> String {
        self.inner.path().display().to_string()
    }

    /// `[(name, dtype, shape)]` in file order; dtype as in the header (`"F32"`, `"BF16"`, ...).
    fn tensors(&self) -> Vec<(String, String, Vec<usize>)> {
        self.inner
            .tensors()
            .iter()
            .map(|t| (t.name.clone(), t.dtype.to_string(), t.shape.clone()))
            .collect()
    }

    /// The `__metadata__` dict, or None.
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(m) = self.inner.metadata() else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        for (k, v) in m {
            d.set_item(k, v)?;
        }
        Ok(Some(d))
    }

    /// Bytes of tensor `name` in the file.
    fn nbytes(&self, name: &str) -> PyResult<usize> {
        guard("nbytes", || Ok(self.inner.info(name)?.nbytes()))
    }

    /// Copies tensor `name` to `dst_nbytes` bytes at host address `dst_ptr`, converted to
    /// `dst_dtype` (the tensor's own dtype, or among F32/BF16/F16). The GIL is released.
    ///
    /// The caller promises that `dst_ptr` is the start of a live, writable host buffer of
    /// `dst_nbytes` bytes that nothing else uses during the call.
    fn copy_into(
        &self,
        py: Python<'_>,
        name: &str,
        dst_ptr: usize,
        dst_nbytes: usize,
        dst_dtype: &str,
    ) -> PyResult<()> {
        py.detach(|| {
            guard("copy_into", || {
                let dtype = io::parse_dtype(dst_dtype)?;
                if dst_nbytes > 0 && dst_ptr == 0 {
                    return Err(Error::InvalidArgument(format!(
                        "null destination address for {dst_nbytes} bytes"
                    )));
                }
                if dst_ptr.checked_add(dst_nbytes).is_none() || dst_nbytes > isize::MAX as usize {
                    return Err(Error::InvalidArgument("destination range overflows".into()));
                }
                let dst: &mut [u8] = if dst_nbytes == 0 {
                    &mut []
                } else {
                    // SAFETY: the caller promises a live, writable, unaliased buffer (see above);
                    // u8 has no alignment requirement.
                    unsafe { std::slice::from_raw_parts_mut(dst_ptr as *mut u8, dst_nbytes) }
                };
                self.inner.copy_tensor(name, dst, dtype)
            })
        })
    }

    fn __len__(&self) -> usize {
        self.inner.tensors().len()
    }

    fn __repr__(&self) -> String {
        format!(
            "SafetensorsFile({:?}, {} tensors)",
            self.inner.path().display().to_string(),
            self.inner.tensors().len()
        )
    }
}

/// Adds the safetensors reader to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<SafetensorsFile>()?;
    Ok(())
}
