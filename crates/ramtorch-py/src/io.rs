//! Bindings of the safetensors reader (`ramtorch_core::io`): `SafetensorsFile(path)` opens a file
//! once (never mapping it) and validates its header; `copy_into` copies one tensor into a torch
//! CPU tensor or into ramtorch memory (an address checked against the arena), and `copy_many` several
//! at once on all cores (converting among F32, BF16 and F16), without the GIL. A file that cannot
//! be opened raises `OSError`; a file that is not valid safetensors raises `ValueError`, naming the
//! path (and the tensor).

use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use ramtorch_core::io::{self, OpenError};
use ramtorch_core::Error;

use crate::{guard, memory};

/// A validated `.safetensors` file, open for positioned reads (never mapped).
#[pyclass(module = "ramtorch._core", frozen)]
struct SafetensorsFile {
    inner: io::SafetensorsFile,
}

#[pymethods]
impl SafetensorsFile {
    /// Opens `path` (a regular file; anything else is a `ValueError`) and validates its header
    /// (offsets in range, no overlaps, sizes consistent).
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

    /// Copies tensor `name` into the first `dst_nbytes` bytes of `dst`, converted to `dst_dtype`
    /// (the tensor's own dtype, or among F32/BF16/F16). `dst` is a contiguous CPU torch tensor of
    /// at least `dst_nbytes` bytes, or the int address of host memory ramtorch allocated (checked
    /// to lie inside a live arena or shared region). The GIL is released.
    ///
    /// The caller promises only that nothing else uses the destination during the call.
    fn copy_into(
        &self,
        py: Python<'_>,
        name: String,
        dst: Bound<'_, PyAny>,
        dst_nbytes: usize,
        dst_dtype: String,
    ) -> PyResult<()> {
        self.copy_many(py, vec![(name, dst, dst_nbytes, dst_dtype)])
    }

    /// Copies several tensors in one call, each as `copy_into`: a list of `(name, dst,
    /// dst_nbytes, dst_dtype)`. All cores share the work of all of them. Every entry is checked
    /// before anything is written; destinations must not overlap (checked). The GIL is released.
    fn copy_many(
        &self,
        py: Python<'_>,
        items: Vec<(String, Bound<'_, PyAny>, usize, String)>,
    ) -> PyResult<()> {
        // Resolved under the GIL: each destination's address, and the lease that keeps ramtorch
        // memory alive; a tensor destination is kept alive by `items` (the caller's references)
        // until this call returns.
        let dsts = guard("copy_many", || {
            items
                .iter()
                .map(|(name, dst, nbytes, _)| {
                    let what = format!("destination of tensor {name:?}");
                    memory::host_buffer(&what, dst, memory::Expect::Bytes(*nbytes))
                })
                .collect::<Result<Vec<_>, Error>>()
        })?;
        let jobs_in: Vec<(&str, usize, usize, &str)> = items
            .iter()
            .zip(&dsts)
            .map(|((name, _, nbytes, dtype), d)| (name.as_str(), d.addr, *nbytes, dtype.as_str()))
            .collect();
        let r = py.detach(|| {
            guard("copy_many", || {
                let mut ranges: Vec<(usize, usize)> = Vec::with_capacity(jobs_in.len());
                let mut dtypes = Vec::with_capacity(jobs_in.len());
                for &(name, ptr, nbytes, dtype) in &jobs_in {
                    dtypes.push(io::parse_dtype(dtype)?);
                    if nbytes > 0 && ptr == 0 {
                        return Err(Error::InvalidArgument(format!(
                            "tensor {name:?}: null destination address for {nbytes} bytes"
                        )));
                    }
                    if ptr.checked_add(nbytes).is_none() || nbytes > isize::MAX as usize {
                        return Err(Error::InvalidArgument(format!(
                            "tensor {name:?}: destination range overflows"
                        )));
                    }
                    if nbytes > 0 {
                        ranges.push((ptr, nbytes));
                    }
                }
                ranges.sort_unstable();
                if ranges.windows(2).any(|w| w[0].0 + w[0].1 > w[1].0) {
                    return Err(Error::InvalidArgument(
                        "destinations overlap: two tensors would be written to the same memory"
                            .into(),
                    ));
                }
                let jobs = jobs_in
                    .iter()
                    .zip(dtypes)
                    .map(|(&(name, ptr, nbytes, _), dtype)| {
                        let dst: &mut [u8] = if nbytes == 0 {
                            &mut []
                        } else {
                            // SAFETY: `ptr` starts `nbytes` of live, writable host memory: a
                            // contiguous CPU tensor at least that long (checked in `host_buffer`),
                            // which the caller's reference in `items` keeps alive, or a range
                            // inside a ramtorch region (checked), kept mapped by the lease in
                            // `dsts`; the ranges were checked not to overlap, so no two slices
                            // alias; nothing else uses them (the caller's promise); u8 has no
                            // alignment requirement.
                            unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, nbytes) }
                        };
                        io::CopyJob { name, dst, dtype }
                    })
                    .collect();
                self.inner.copy_many(jobs)
            })
        });
        drop(dsts);
        r
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
