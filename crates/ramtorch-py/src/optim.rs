//! Bindings of the CPU optimizer kernels (`ramtorch_core::optim`). Each buffer is a contiguous CPU
//! torch tensor (pointer and size come from torch; its dtype and element count are checked against
//! the call's), or the address of memory ramtorch allocated (`tensor.data_ptr()` of an arena or
//! shared tensor), which must lie inside a live arena or shared region. The memory is kept alive
//! for the call. The caller promises only that nothing else reads or writes the buffers during the
//! call. Everything else (addresses outside ramtorch's memory, null or misaligned addresses, wrong
//! sizes or dtypes, overlapping buffers, unknown dtypes, mismatched modes, bad hyperparameters) is
//! checked and raises `ValueError`. The GIL is released while the kernels run.

use pyo3::prelude::*;

use ramtorch_core::arena::Lease;
use ramtorch_core::optim::{self, bf16, f16, Dtype, Old, Tensor, TensorMut};
use ramtorch_core::Error;

use crate::guard;
use crate::memory::{host_buffer, is_address, named, Expect};

/// What keeps a buffer's memory alive during a call: a lease on ramtorch memory (other memory is a
/// torch tensor the caller holds for the call).
enum Keep {
    Lease(#[allow(dead_code)] Lease),
}

/// One buffer argument as given from Python: a tensor, an address, or absent (`None`, or `0` where
/// a buffer is optional).
type Arg<'a, 'py> = Option<&'a Bound<'py, PyAny>>;

/// Turns the argument `obj` into a checked buffer of `numel` elements of `dtype`, pushing what keeps
/// its memory alive onto `keeps`. `None` (and the address 0) give `None` where `optional`.
fn resolve<'py>(
    name: &'static str,
    obj: Arg<'_, 'py>,
    dtype: &str,
    numel: usize,
    optional: bool,
    keeps: &mut Vec<Keep>,
) -> Result<Option<Buf>, Error> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        if optional {
            return Ok(None);
        }
        return Err(invalid(format!("{name} is required")));
    };
    let want = Dtype::parse(dtype).map_err(|e| named(name, e))?;
    if is_address(obj) {
        let addr = obj
            .extract::<usize>()
            .map_err(|e| invalid(format!("{name}: {e}")))?;
        if addr == 0 && optional {
            return Ok(None);
        }
        // Null, misaligned and overflowing addresses are named as such before the region check.
        Buf::new(name, addr, dtype, numel)?;
    }
    let hb = host_buffer(name, obj, Expect::Elements(want, numel))?;
    let b = Buf::new(name, hb.addr, dtype, numel)?;
    if let Some(l) = hb.lease {
        keeps.push(Keep::Lease(l));
    }
    Ok(Some(b))
}

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

/// The buffers of one step: `bufs` as `(name, argument, dtype)`, each required, then the float32
/// master weights when given; each checked, and checked pairwise disjoint. What keeps them alive
/// goes to `keeps`.
fn step_buffers(
    bufs: &[(&'static str, Arg<'_, '_>, &str)],
    master: Arg<'_, '_>,
    old: &OldBufs,
    numel: usize,
    keeps: &mut Vec<Keep>,
) -> Result<Vec<Buf>, Error> {
    let mut b = Vec::with_capacity(bufs.len() + 1);
    for &(name, obj, dtype) in bufs {
        if let Some(x) = resolve(name, obj, dtype, numel, false, keeps)? {
            b.push(x);
        }
    }
    if let Some(m) = resolve("master", master, "float32", numel, true, keeps)? {
        b.push(m);
    }
    old.disjoint_from(&b)?;
    Ok(b)
}

/// The old values of an out-of-place step (`old_param`, `old_master`, `old_state1`,
/// `old_state2`), each resolved and checked as the operands are.
#[derive(Clone, Copy, Default)]
struct OldBufs([Option<Buf>; 4]);

impl OldBufs {
    /// Resolves `args` (`old_param`, `old_master`, `old_state1`, `old_state2`).
    fn resolve(
        args: [Arg<'_, '_>; 4],
        param_dtype: &str,
        state_dtype: &str,
        numel: usize,
        keeps: &mut Vec<Keep>,
    ) -> Result<OldBufs, Error> {
        let [param, master, s1, s2] = args;
        Ok(OldBufs([
            resolve("old_param", param, param_dtype, numel, true, keeps)?,
            resolve("old_master", master, "float32", numel, true, keeps)?,
            resolve("old_state1", s1, state_dtype, numel, true, keeps)?,
            resolve("old_state2", s2, state_dtype, numel, true, keeps)?,
        ]))
    }

    /// Checks that the operands `b` and these old values share no byte.
    fn disjoint_from(&self, b: &[Buf]) -> Result<(), Error> {
        let mut all = b.to_vec();
        all.extend(self.bufs());
        disjoint(&all)
    }

    fn bufs(&self) -> impl Iterator<Item = Buf> + '_ {
        self.0.iter().flatten().copied()
    }

    /// The views of the old values.
    ///
    /// # Safety
    /// As for [`Buf::view`]: nothing writes these buffers during the call, and they overlap no
    /// operand (checked by [`disjoint`] over operands and old values together).
    unsafe fn old<'a>(&self) -> Result<Old<'a>, Error> {
        // SAFETY: forwarded contract.
        let view = |b: &Option<Buf>| b.map(|b| unsafe { b.view() });
        let master = match view(&self.0[1]) {
            None => None,
            Some(Tensor::F32(m)) => Some(m),
            Some(_) => return Err(invalid("old_master must be float32".to_string())),
        };
        Ok(Old {
            param: view(&self.0[0]),
            master,
            states: [view(&self.0[2]), view(&self.0[3])],
        })
    }
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
    master = None, numel, step, lr, beta1, beta2, eps, weight_decay,
    maximize = false, grad_scale = 1.0, seed = 0,
    old_param = None, old_master = None, old_state1 = None, old_state2 = None,
))]
#[allow(clippy::too_many_arguments)]
fn adamw_step(
    py: Python<'_>,
    param: &Bound<'_, PyAny>,
    param_dtype: &str,
    grad: &Bound<'_, PyAny>,
    grad_dtype: &str,
    exp_avg: &Bound<'_, PyAny>,
    exp_avg_sq: &Bound<'_, PyAny>,
    state_dtype: &str,
    master: Option<&Bound<'_, PyAny>>,
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
    old_param: Arg<'_, '_>,
    old_master: Arg<'_, '_>,
    old_state1: Arg<'_, '_>,
    old_state2: Arg<'_, '_>,
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
        ("param", Some(param), param_dtype),
        ("grad", Some(grad), grad_dtype),
        ("exp_avg", Some(exp_avg), state_dtype),
        ("exp_avg_sq", Some(exp_avg_sq), state_dtype),
    ];
    let mut keeps = Vec::with_capacity(9);
    let (bufs, old) = guard(op, || {
        let olds = [old_param, old_master, old_state1, old_state2];
        let old = OldBufs::resolve(olds, param_dtype, state_dtype, numel, &mut keeps)?;
        Ok((step_buffers(&named, master, &old, numel, &mut keeps)?, old))
    })?;
    py.detach(|| {
        guard(op, || {
            // SAFETY: the buffers were checked (non-null, aligned, sized, pairwise disjoint) and
            // are valid and unshared for the call by the module's contract.
            unsafe {
                let m = match bufs.get(4) {
                    Some(b) => Some(b.f32_mut()?),
                    None => None,
                };
                optim::adamw_step_from(
                    &h,
                    bufs[0].view_mut(),
                    m,
                    bufs[1].view(),
                    bufs[2].view_mut(),
                    bufs[3].view_mut(),
                    &old.old()?,
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
    master = None, numel, lr, momentum, dampening, weight_decay, nesterov, maximize, first_step,
    grad_scale = 1.0, seed = 0, step = 0, old_param = None, old_master = None, old_state1 = None,
))]
#[allow(clippy::too_many_arguments)]
fn sgd_step(
    py: Python<'_>,
    param: &Bound<'_, PyAny>,
    param_dtype: &str,
    grad: &Bound<'_, PyAny>,
    grad_dtype: &str,
    momentum_buffer: Option<&Bound<'_, PyAny>>,
    state_dtype: &str,
    master: Option<&Bound<'_, PyAny>>,
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
    old_param: Arg<'_, '_>,
    old_master: Arg<'_, '_>,
    old_state1: Arg<'_, '_>,
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
    let mut keeps = Vec::with_capacity(7);
    let (bufs, has_buf, has_master, old) = guard(op, || {
        let mut b = Vec::with_capacity(4);
        for (name, obj, dtype) in [("param", param, param_dtype), ("grad", grad, grad_dtype)] {
            b.extend(resolve(name, Some(obj), dtype, numel, false, &mut keeps)?);
        }
        // Checked even without a buffer, so that a typo is not silently ignored.
        Dtype::parse(state_dtype)?;
        let buf = resolve(
            "momentum_buffer",
            momentum_buffer,
            state_dtype,
            numel,
            true,
            &mut keeps,
        )?;
        let master = resolve("master", master, "float32", numel, true, &mut keeps)?;
        let flags = (buf.is_some(), master.is_some());
        b.extend(buf);
        b.extend(master);
        let olds = [old_param, old_master, old_state1, None];
        let old = OldBufs::resolve(olds, param_dtype, state_dtype, numel, &mut keeps)?;
        old.disjoint_from(&b)?;
        Ok((b, flags.0, flags.1, old))
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
                optim::sgd_step_from(&h, bufs[0].view_mut(), m, bufs[1].view(), buf, &old.old()?)
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
    master = None, numel, lr, beta1, beta2, weight_decay,
    maximize = false, grad_scale = 1.0, seed = 0, step = 0,
    old_param = None, old_master = None, old_state1 = None,
))]
#[allow(clippy::too_many_arguments)]
fn lion_step(
    py: Python<'_>,
    param: &Bound<'_, PyAny>,
    param_dtype: &str,
    grad: &Bound<'_, PyAny>,
    grad_dtype: &str,
    exp_avg: &Bound<'_, PyAny>,
    state_dtype: &str,
    master: Option<&Bound<'_, PyAny>>,
    numel: usize,
    lr: f64,
    beta1: f64,
    beta2: f64,
    weight_decay: f64,
    maximize: bool,
    grad_scale: f64,
    seed: u64,
    step: u64,
    old_param: Arg<'_, '_>,
    old_master: Arg<'_, '_>,
    old_state1: Arg<'_, '_>,
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
        ("param", Some(param), param_dtype),
        ("grad", Some(grad), grad_dtype),
        ("exp_avg", Some(exp_avg), state_dtype),
    ];
    let mut keeps = Vec::with_capacity(7);
    let (bufs, old) = guard(op, || {
        let olds = [old_param, old_master, old_state1, None];
        let old = OldBufs::resolve(olds, param_dtype, state_dtype, numel, &mut keeps)?;
        Ok((step_buffers(&named, master, &old, numel, &mut keeps)?, old))
    })?;
    py.detach(|| {
        guard(op, || {
            // SAFETY: the buffers were checked (non-null, aligned, sized, pairwise disjoint) and
            // are valid and unshared for the call by the module's contract.
            unsafe {
                let m = match bufs.get(3) {
                    Some(b) => Some(b.f32_mut()?),
                    None => None,
                };
                optim::lion_step_from(
                    &h,
                    bufs[0].view_mut(),
                    m,
                    bufs[1].view(),
                    bufs[2].view_mut(),
                    &old.old()?,
                )
            }
        })
    })
}

/// `(sum of squares as a float64, whether any element is inf/NaN)` of the `numel` elements of `ptr`
/// (a CPU tensor, or the address of memory ramtorch allocated).
#[pyfunction]
fn grad_stats(
    py: Python<'_>,
    ptr: &Bound<'_, PyAny>,
    dtype: &str,
    numel: usize,
) -> PyResult<(f64, bool)> {
    let op = "grad_stats";
    let mut keeps = Vec::with_capacity(1);
    let b = guard(op, || one_buffer(ptr, dtype, numel, &mut keeps))?;
    py.detach(|| {
        guard(op, || {
            // SAFETY: checked in `Buf::new`; valid and not written during the call by contract.
            let s = optim::grad_stats(unsafe { b.view() });
            Ok((s.sum_sq, s.non_finite))
        })
    })
}

/// Multiplies the `numel` elements of `ptr` (as for `grad_stats`) by `factor` in place
/// (bfloat16/float16 results rounded to nearest even).
#[pyfunction]
#[pyo3(name = "scale_")]
fn scale(
    py: Python<'_>,
    ptr: &Bound<'_, PyAny>,
    dtype: &str,
    numel: usize,
    factor: f64,
) -> PyResult<()> {
    let op = "scale_";
    let mut keeps = Vec::with_capacity(1);
    let b = guard(op, || {
        if !factor.is_finite() {
            return Err(invalid(format!("factor must be finite, got {factor}")));
        }
        one_buffer(ptr, dtype, numel, &mut keeps)
    })?;
    py.detach(|| {
        guard(op, || {
            // SAFETY: checked in `Buf::new`; valid and unshared during the call by contract.
            optim::scale_in_place(unsafe { b.view_mut() }, factor as f32);
            Ok(())
        })
    })
}

/// The one buffer of `grad_stats` and `scale_`.
fn one_buffer(
    obj: &Bound<'_, PyAny>,
    dtype: &str,
    numel: usize,
    keeps: &mut Vec<Keep>,
) -> Result<Buf, Error> {
    resolve("tensor", Some(obj), dtype, numel, false, keeps)?
        .ok_or_else(|| invalid("tensor is required".into()))
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
