//! Bindings of the CPU optimizer kernels (`ramtorch_core::optim`). Tensors come in as addresses
//! (`tensor.data_ptr()`), an element count and a dtype name; the caller promises that each address
//! is the start of a live, contiguous CPU buffer of `numel` elements of that dtype that nothing
//! else reads or writes during the call. Everything else (null or misaligned addresses,
//! overlapping buffers, unknown dtypes, mismatched modes, bad hyperparameters) is checked and
//! raises `ValueError`. The GIL is released while the kernels run.

use pyo3::prelude::*;

use ramtorch_core::optim::{self, bf16, f16, Dtype, Tensor, TensorMut};
use ramtorch_core::Error;

use crate::guard;

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

/// One buffer as passed from Python, checked but not yet turned into a slice.
#[derive(Clone, Copy)]
struct Buf {
    name: &'static str,
    addr: usize,
    dtype: Dtype,
    numel: usize,
}

impl Buf {
    fn new(name: &'static str, addr: usize, dtype: &str, numel: usize) -> Result<Buf, Error> {
        let dtype = Dtype::parse(dtype).map_err(|e| match e {
            Error::InvalidArgument(m) => invalid(format!("{name}: {m}")),
            e => e,
        })?;
        let b = Buf {
            name,
            addr,
            dtype,
            numel,
        };
        let bytes = b.bytes()?;
        if numel > 0 {
            if addr == 0 {
                return Err(invalid(format!(
                    "{name}: null address for {numel} elements"
                )));
            }
            if !addr.is_multiple_of(dtype.size()) {
                return Err(invalid(format!(
                    "{name}: address {addr:#x} is not aligned for {dtype}"
                )));
            }
            if addr.checked_add(bytes).is_none() {
                return Err(invalid(format!("{name}: address range overflows")));
            }
        }
        Ok(b)
    }

    fn bytes(&self) -> Result<usize, Error> {
        self.numel
            .checked_mul(self.dtype.size())
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| {
                invalid(format!(
                    "{}: {} elements is too many",
                    self.name, self.numel
                ))
            })
    }

    /// A read-only view.
    ///
    /// # Safety
    /// `addr` must point to `numel` live, initialised elements of `dtype` that nothing writes
    /// while the view is in use (the module's calling contract), and the buffer must not overlap a
    /// mutable view made at the same time ([`disjoint`] checks that).
    unsafe fn view<'a>(&self) -> Tensor<'a> {
        let (p, n) = (self.addr, self.numel);
        if n == 0 {
            return match self.dtype {
                Dtype::F32 => Tensor::F32(&[]),
                Dtype::BF16 => Tensor::BF16(&[]),
                Dtype::F16 => Tensor::F16(&[]),
            };
        }
        // SAFETY: non-null and aligned (checked in `new`), `n * size <= isize::MAX` bytes that do
        // not wrap (checked in `new`); validity and exclusivity are the caller's contract above.
        unsafe {
            match self.dtype {
                Dtype::F32 => Tensor::F32(std::slice::from_raw_parts(p as *const f32, n)),
                Dtype::BF16 => Tensor::BF16(std::slice::from_raw_parts(p as *const bf16, n)),
                Dtype::F16 => Tensor::F16(std::slice::from_raw_parts(p as *const f16, n)),
            }
        }
    }

    /// A writable view.
    ///
    /// # Safety
    /// As for [`Buf::view`], and nothing else may read the buffer while the view is in use.
    unsafe fn view_mut<'a>(&self) -> TensorMut<'a> {
        let (p, n) = (self.addr, self.numel);
        if n == 0 {
            return match self.dtype {
                Dtype::F32 => TensorMut::F32(&mut []),
                Dtype::BF16 => TensorMut::BF16(&mut []),
                Dtype::F16 => TensorMut::F16(&mut []),
            };
        }
        // SAFETY: as in `view`; the buffer is not aliased by any other view of this call
        // (`disjoint`) and, by the caller's contract, by nothing else during the call.
        unsafe {
            match self.dtype {
                Dtype::F32 => TensorMut::F32(std::slice::from_raw_parts_mut(p as *mut f32, n)),
                Dtype::BF16 => TensorMut::BF16(std::slice::from_raw_parts_mut(p as *mut bf16, n)),
                Dtype::F16 => TensorMut::F16(std::slice::from_raw_parts_mut(p as *mut f16, n)),
            }
        }
    }

    /// The master weights as an `f32` slice.
    ///
    /// # Safety
    /// As for [`Buf::view_mut`].
    unsafe fn f32_mut<'a>(&self) -> Result<&'a mut [f32], Error> {
        // SAFETY: forwarded contract.
        match unsafe { self.view_mut() } {
            TensorMut::F32(s) => Ok(s),
            _ => Err(invalid(format!("{} must be float32", self.name))),
        }
    }
}

/// Checks that no two buffers share a byte, so the slices made from them do not alias.
fn disjoint(bufs: &[Buf]) -> Result<(), Error> {
    for (i, a) in bufs.iter().enumerate() {
        for b in &bufs[i + 1..] {
            let (la, lb) = (a.bytes()?, b.bytes()?);
            if la == 0 || lb == 0 {
                continue;
            }
            if a.addr < b.addr + lb && b.addr < a.addr + la {
                return Err(invalid(format!(
                    "{} and {} overlap in memory; every buffer must be distinct",
                    a.name, b.name
                )));
            }
        }
    }
    Ok(())
}

/// The buffers of one step: `named` as `(name, address, dtype)`, then the float32 master weights
/// when `master` is non-zero; each checked, and checked pairwise disjoint.
fn step_buffers(
    named: &[(&'static str, usize, &str)],
    master: usize,
    numel: usize,
) -> Result<Vec<Buf>, Error> {
    let mut b = named
        .iter()
        .map(|&(name, addr, dtype)| Buf::new(name, addr, dtype, numel))
        .collect::<Result<Vec<_>, Error>>()?;
    if master != 0 {
        b.push(Buf::new("master", master, "float32", numel)?);
    }
    disjoint(&b)?;
    Ok(b)
}

/// One AdamW step (torch.optim.AdamW semantics) over one tensor of `numel` elements.
///
/// Modes: `param_dtype="float32"` (updated in place); `"bfloat16"` without `master` (stochastic
/// rounding); `"bfloat16"`/`"float16"` with `master` = address of float32 master weights (updated,
/// and the param set to them rounded to nearest even). States are float32 or bfloat16 (stochastic
/// rounding); the gradient is any of the three. `g = grad * grad_scale` (negated if `maximize`);
/// `step` counts from 1; `seed` (with `step`) drives stochastic rounding.
#[pyfunction]
#[pyo3(signature = (
    param, param_dtype, grad, grad_dtype, exp_avg, exp_avg_sq, state_dtype, *,
    master = 0, numel, step, lr, beta1, beta2, eps, weight_decay,
    maximize = false, grad_scale = 1.0, seed = 0,
))]
#[allow(clippy::too_many_arguments)]
fn adamw_step(
    py: Python<'_>,
    param: usize,
    param_dtype: &str,
    grad: usize,
    grad_dtype: &str,
    exp_avg: usize,
    exp_avg_sq: usize,
    state_dtype: &str,
    master: usize,
    numel: usize,
    step: u64,
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    maximize: bool,
    grad_scale: f64,
    seed: u64,
) -> PyResult<()> {
    let op = "adamw_step";
    let h = optim::AdamW {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        maximize,
        grad_scale,
        step,
        seed,
    };
    let named = [
        ("param", param, param_dtype),
        ("grad", grad, grad_dtype),
        ("exp_avg", exp_avg, state_dtype),
        ("exp_avg_sq", exp_avg_sq, state_dtype),
    ];
    let bufs = guard(op, || step_buffers(&named, master, numel))?;
    py.detach(|| {
        guard(op, || {
            // SAFETY: the buffers were checked (non-null, aligned, sized, pairwise disjoint) and
            // are valid and unshared for the call by the module's contract.
            unsafe {
                let m = match bufs.get(4) {
                    Some(b) => Some(b.f32_mut()?),
                    None => None,
                };
                optim::adamw_step(
                    &h,
                    bufs[0].view_mut(),
                    m,
                    bufs[1].view(),
                    bufs[2].view_mut(),
                    bufs[3].view_mut(),
                )
            }
        })
    })
}

/// One SGD step (torch.optim.SGD semantics) over one tensor of `numel` elements.
///
/// `momentum_buffer` is the address of the buffer (needed when `momentum != 0`, else pass 0);
/// `first_step=True` initialises it to the gradient. Storage modes as for `adamw_step`; `seed` and
/// `step` drive stochastic rounding (vary them from call to call).
#[pyfunction]
#[pyo3(signature = (
    param, param_dtype, grad, grad_dtype, momentum_buffer, state_dtype, *,
    master = 0, numel, lr, momentum, dampening, weight_decay, nesterov, maximize, first_step,
    grad_scale = 1.0, seed = 0, step = 0,
))]
#[allow(clippy::too_many_arguments)]
fn sgd_step(
    py: Python<'_>,
    param: usize,
    param_dtype: &str,
    grad: usize,
    grad_dtype: &str,
    momentum_buffer: usize,
    state_dtype: &str,
    master: usize,
    numel: usize,
    lr: f64,
    momentum: f64,
    dampening: f64,
    weight_decay: f64,
    nesterov: bool,
    maximize: bool,
    first_step: bool,
    grad_scale: f64,
    seed: u64,
    step: u64,
) -> PyResult<()> {
    let op = "sgd_step";
    let h = optim::Sgd {
        lr,
        momentum,
        dampening,
        weight_decay,
        nesterov,
        maximize,
        first_step,
        grad_scale,
        step,
        seed,
    };
    let (has_buf, has_master) = (momentum_buffer != 0, master != 0);
    let bufs = guard(op, || {
        let mut named = vec![("param", param, param_dtype), ("grad", grad, grad_dtype)];
        if has_buf {
            named.push(("momentum_buffer", momentum_buffer, state_dtype));
        } else {
            // Checked even without a buffer, so that a typo is not silently ignored.
            Dtype::parse(state_dtype)?;
        }
        step_buffers(&named, master, numel)
    })?;
    py.detach(|| {
        guard(op, || {
            // SAFETY: the buffers were checked (non-null, aligned, sized, pairwise disjoint) and
            // are valid and unshared for the call by the module's contract.
            unsafe {
                let buf = if has_buf {
                    Some(bufs[2].view_mut())
                } else {
                    None
                };
                let m = if has_master {
                    Some(bufs[bufs.len() - 1].f32_mut()?)
                } else {
                    None
                };
                optim::sgd_step(&h, bufs[0].view_mut(), m, bufs[1].view(), buf)
            }
        })
    })
}

/// One Lion step over one tensor of `numel` elements: `p *= 1 - lr*weight_decay;
/// p -= lr * sign(beta1*m + (1-beta1)*g); m = beta2*m + (1-beta2)*g`. Storage modes as for
/// `adamw_step`; `seed` and `step` drive stochastic rounding (vary them from call to call).
#[pyfunction]
#[pyo3(signature = (
    param, param_dtype, grad, grad_dtype, exp_avg, state_dtype, *,
    master = 0, numel, lr, beta1, beta2, weight_decay,
    maximize = false, grad_scale = 1.0, seed = 0, step = 0,
))]
#[allow(clippy::too_many_arguments)]
fn lion_step(
    py: Python<'_>,
    param: usize,
    param_dtype: &str,
    grad: usize,
    grad_dtype: &str,
    exp_avg: usize,
    state_dtype: &str,
    master: usize,
    numel: usize,
    lr: f64,
    beta1: f64,
    beta2: f64,
    weight_decay: f64,
    maximize: bool,
    grad_scale: f64,
    seed: u64,
    step: u64,
) -> PyResult<()> {
    let op = "lion_step";
    let h = optim::Lion {
        lr,
        beta1,
        beta2,
        weight_decay,
        maximize,
        grad_scale,
        step,
        seed,
    };
    let named = [
        ("param", param, param_dtype),
        ("grad", grad, grad_dtype),
        ("exp_avg", exp_avg, state_dtype),
    ];
    let bufs = guard(op, || step_buffers(&named, master, numel))?;
    py.detach(|| {
        guard(op, || {
            // SAFETY: the buffers were checked (non-null, aligned, sized, pairwise disjoint) and
            // are valid and unshared for the call by the module's contract.
            unsafe {
                let m = match bufs.get(3) {
                    Some(b) => Some(b.f32_mut()?),
                    None => None,
                };
                optim::lion_step(
                    &h,
                    bufs[0].view_mut(),
                    m,
                    bufs[1].view(),
                    bufs[2].view_mut(),
                )
            }
        })
    })
}

/// `(sum of squares as a float64, whether any element is inf/NaN)` of `numel` elements at `ptr`.
#[pyfunction]
fn grad_stats(py: Python<'_>, ptr: usize, dtype: &str, numel: usize) -> PyResult<(f64, bool)> {
    let op = "grad_stats";
    let b = guard(op, || Buf::new("tensor", ptr, dtype, numel))?;
    py.detach(|| {
        guard(op, || {
            // SAFETY: checked in `Buf::new`; valid and not written during the call by contract.
            let s = optim::grad_stats(unsafe { b.view() });
            Ok((s.sum_sq, s.non_finite))
        })
    })
}

/// Multiplies `numel` elements at `ptr` by `factor` in place (bfloat16/float16 results rounded to
/// nearest even).
#[pyfunction]
#[pyo3(name = "scale_")]
fn scale(py: Python<'_>, ptr: usize, dtype: &str, numel: usize, factor: f64) -> PyResult<()> {
    let op = "scale_";
    let b = guard(op, || {
        if !factor.is_finite() {
            return Err(invalid(format!("factor must be finite, got {factor}")));
        }
        Buf::new("tensor", ptr, dtype, numel)
    })?;
    py.detach(|| {
        guard(op, || {
            // SAFETY: checked in `Buf::new`; valid and unshared during the call by contract.
            optim::scale_in_place(unsafe { b.view_mut() }, factor as f32);
            Ok(())
        })
    })
}

/// Number of threads the optimizer kernels run on (the rayon pool; set RAYON_NUM_THREADS before
/// the first call to change it).
#[pyfunction]
fn optim_threads() -> usize {
    optim::threads()
}

/// Adds the optimizer functions to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(adamw_step, m)?)?;
    m.add_function(wrap_pyfunction!(sgd_step, m)?)?;
    m.add_function(wrap_pyfunction!(lion_step, m)?)?;
    m.add_function(wrap_pyfunction!(grad_stats, m)?)?;
    m.add_function(wrap_pyfunction!(scale, m)?)?;
    m.add_function(wrap_pyfunction!(optim_threads, m)?)?;
    Ok(())
}
