//! Bindings of the CPU optimizer kernels (`ramtorch_core::optim`). Each buffer is a contiguous CPU
//! torch tensor (pointer and size come from torch; its dtype and element count are checked against
//! the call's), or the address of memory ramtorch allocated (`tensor.data_ptr()` of an arena or
//! shared tensor), which must lie inside a live arena or shared region. The memory is kept alive
//! for the call. The caller promises only that nothing else reads or writes the buffers during the
//! call. Everything else (addresses outside ramtorch's memory, null or misaligned addresses, wrong
//! sizes or dtypes, overlapping buffers, unknown dtypes, mismatched modes, bad hyperparameters) is
//! checked and raises `ValueError`. The GIL is released while the kernels run.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use ramtorch_core::arena::Lease;
use ramtorch_core::optim::{self, bf16, f16, Dtype, Old, State, Tensor, TensorMut};
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
    let want = Elem::parse(dtype).map_err(|e| named(name, e))?;
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
    let expect = match want {
        Elem::Float(d) => Expect::Elements(d, numel),
        Elem::U8 => Expect::Codes(numel),
    };
    let hb = host_buffer(name, obj, expect)?;
    let b = Buf::new(name, hb.addr, dtype, numel)?;
    if let Some(l) = hb.lease {
        keeps.push(Keep::Lease(l));
    }
    Ok(Some(b))
}

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

/// Element type of a buffer: one of the kernels' float types, or `uint8` (the codes of a
/// block-quantized state).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Elem {
    Float(Dtype),
    U8,
}

impl Elem {
    /// Parses a dtype name as [`Dtype::parse`] does, plus `"uint8"`.
    fn parse(name: &str) -> Result<Elem, Error> {
        if name.strip_prefix("torch.").unwrap_or(name) == "uint8" {
            return Ok(Elem::U8);
        }
        Dtype::parse(name).map(Elem::Float)
    }

    const fn size(self) -> usize {
        match self {
            Elem::Float(d) => d.size(),
            Elem::U8 => 1,
        }
    }
}

impl std::fmt::Display for Elem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Elem::Float(d) => d.fmt(f),
            Elem::U8 => f.write_str("uint8"),
        }
    }
}

/// One buffer as passed from Python, checked but not yet turned into a slice.
#[derive(Clone, Copy)]
struct Buf {
    name: &'static str,
    addr: usize,
    dtype: Elem,
    numel: usize,
}

impl Buf {
    fn new(name: &'static str, addr: usize, dtype: &str, numel: usize) -> Result<Buf, Error> {
        let dtype = Elem::parse(dtype).map_err(|e| match e {
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
    unsafe fn view<'a>(&self) -> Result<Tensor<'a>, Error> {
        let (p, n) = (self.addr, self.numel);
        let Elem::Float(dtype) = self.dtype else {
            return Err(invalid(format!(
                "{} must be a float tensor, got uint8",
                self.name
            )));
        };
        if n == 0 {
            return Ok(match dtype {
                Dtype::F32 => Tensor::F32(&[]),
                Dtype::BF16 => Tensor::BF16(&[]),
                Dtype::F16 => Tensor::F16(&[]),
            });
        }
        // SAFETY: non-null and aligned (checked in `new`), `n * size <= isize::MAX` bytes that do
        // not wrap (checked in `new`); validity and exclusivity are the caller's contract above.
        unsafe {
            Ok(match dtype {
                Dtype::F32 => Tensor::F32(std::slice::from_raw_parts(p as *const f32, n)),
                Dtype::BF16 => Tensor::BF16(std::slice::from_raw_parts(p as *const bf16, n)),
                Dtype::F16 => Tensor::F16(std::slice::from_raw_parts(p as *const f16, n)),
            })
        }
    }

    /// A read-only view of `uint8` codes.
    ///
    /// # Safety
    /// As for [`Buf::view`].
    unsafe fn codes<'a>(&self) -> Result<&'a [u8], Error> {
        if self.dtype != Elem::U8 {
            return Err(invalid(format!(
                "{} must be uint8 codes, got {}",
                self.name, self.dtype
            )));
        }
        if self.numel == 0 {
            return Ok(&[]);
        }
        // SAFETY: non-null (checked in `new`; bytes need no alignment), `numel <= isize::MAX`
        // bytes that do not wrap; validity and exclusivity are the caller's contract.
        Ok(unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.numel) })
    }

    /// A writable view of `uint8` codes.
    ///
    /// # Safety
    /// As for [`Buf::view_mut`].
    unsafe fn codes_mut<'a>(&self) -> Result<&'a mut [u8], Error> {
        if self.dtype != Elem::U8 {
            return Err(invalid(format!(
                "{} must be uint8 codes, got {}",
                self.name, self.dtype
            )));
        }
        if self.numel == 0 {
            return Ok(&mut []);
        }
        // SAFETY: as in `codes`; not aliased by any other view of this call (`disjoint`).
        Ok(unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.numel) })
    }

    /// A writable view.
    ///
    /// # Safety
    /// As for [`Buf::view`], and nothing else may read the buffer while the view is in use.
    unsafe fn view_mut<'a>(&self) -> Result<TensorMut<'a>, Error> {
        let (p, n) = (self.addr, self.numel);
        let Elem::Float(dtype) = self.dtype else {
            return Err(invalid(format!(
                "{} must be a float tensor, got uint8",
                self.name
            )));
        };
        if n == 0 {
            return Ok(match dtype {
                Dtype::F32 => TensorMut::F32(&mut []),
                Dtype::BF16 => TensorMut::BF16(&mut []),
                Dtype::F16 => TensorMut::F16(&mut []),
            });
        }
        // SAFETY: as in `view`; the buffer is not aliased by any other view of this call
        // (`disjoint`) and, by the caller's contract, by nothing else during the call.
        unsafe {
            Ok(match dtype {
                Dtype::F32 => TensorMut::F32(std::slice::from_raw_parts_mut(p as *mut f32, n)),
                Dtype::BF16 => TensorMut::BF16(std::slice::from_raw_parts_mut(p as *mut bf16, n)),
                Dtype::F16 => TensorMut::F16(std::slice::from_raw_parts_mut(p as *mut f16, n)),
            })
        }
    }

    /// The master weights as an `f32` slice.
    ///
    /// # Safety
    /// As for [`Buf::view_mut`].
    unsafe fn f32_mut<'a>(&self) -> Result<&'a mut [f32], Error> {
        // SAFETY: forwarded contract.
        match unsafe { self.view_mut()? } {
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
        let view = |b: &Option<Buf>| b.map(|b| unsafe { b.view() }).transpose();
        let master = match view(&self.0[1])? {
            None => None,
            Some(Tensor::F32(m)) => Some(m),
            Some(_) => return Err(invalid("old_master must be float32".to_string())),
        };
        Ok(Old {
            param: view(&self.0[0])?,
            master,
            comp: None,
            states: [
                view(&self.0[2])?.map(State::Plain),
                view(&self.0[3])?.map(State::Plain),
            ],
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
        index_offset: 0,
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
                    bufs[0].view_mut()?,
                    m,
                    bufs[1].view()?,
                    bufs[2].view_mut()?,
                    bufs[3].view_mut()?,
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
        index_offset: 0,
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
                    Some(bufs[2].view_mut()?)
                } else {
                    None
                };
                let m = if has_master {
                    Some(bufs[bufs.len() - 1].f32_mut()?)
                } else {
                    None
                };
                optim::sgd_step_from(
                    &h,
                    bufs[0].view_mut()?,
                    m,
                    bufs[1].view()?,
                    buf,
                    &old.old()?,
                )
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
        index_offset: 0,
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
                    bufs[0].view_mut()?,
                    m,
                    bufs[1].view()?,
                    bufs[2].view_mut()?,
                    &old.old()?,
                )
            }
        })
    })
}

/// The hyperparameters of one rule, read from the `hyper` dict of [`optim_step`].
enum RuleStep {
    AdamW(optim::AdamW),
    Sgd(optim::Sgd),
    Lion(optim::Lion),
}

/// `hyper[key]`, converted; an error naming the key when it is missing or of another type.
fn hyper_get<T>(
    hyper: &Bound<'_, PyDict>,
    key: &str,
    conv: impl Fn(&Bound<'_, PyAny>) -> PyResult<T>,
) -> Result<T, Error> {
    match hyper.get_item(key) {
        Ok(Some(v)) => conv(&v).map_err(|e| invalid(format!("hyperparameter {key:?}: {e}"))),
        Ok(None) => Err(invalid(format!("hyperparameter {key:?} is required"))),
        Err(e) => Err(invalid(format!("hyperparameter {key:?}: {e}"))),
    }
}

impl RuleStep {
    fn parse(rule: &str, hyper: &Bound<'_, PyDict>) -> Result<RuleStep, Error> {
        let f = |k: &str| hyper_get(hyper, k, |v| v.extract::<f64>());
        let b = |k: &str| hyper_get(hyper, k, |v| v.extract::<bool>());
        let u = |k: &str| hyper_get(hyper, k, |v| v.extract::<u64>());
        // Optional: the index of the piece's first element (0: a whole tensor).
        let offset = match hyper.get_item("index_offset") {
            Ok(Some(_)) => u("index_offset")?,
            _ => 0,
        };
        Ok(match rule {
            "adamw" => RuleStep::AdamW(optim::AdamW {
                lr: f("lr")?,
                beta1: f("beta1")?,
                beta2: f("beta2")?,
                eps: f("eps")?,
                weight_decay: f("weight_decay")?,
                maximize: b("maximize")?,
                grad_scale: f("grad_scale")?,
                step: u("step")?,
                seed: u("seed")?,
                index_offset: offset,
            }),
            "sgd" => RuleStep::Sgd(optim::Sgd {
                lr: f("lr")?,
                momentum: f("momentum")?,
                dampening: f("dampening")?,
                weight_decay: f("weight_decay")?,
                nesterov: b("nesterov")?,
                maximize: b("maximize")?,
                first_step: b("first_step")?,
                grad_scale: f("grad_scale")?,
                step: u("step")?,
                seed: u("seed")?,
                index_offset: offset,
            }),
            "lion" => RuleStep::Lion(optim::Lion {
                lr: f("lr")?,
                beta1: f("beta1")?,
                beta2: f("beta2")?,
                weight_decay: f("weight_decay")?,
                maximize: b("maximize")?,
                grad_scale: f("grad_scale")?,
                step: u("step")?,
                seed: u("seed")?,
                index_offset: offset,
            }),
            _ => {
                return Err(invalid(format!(
                    "unknown rule {rule:?}; expected \"adamw\", \"sgd\" or \"lion\""
                )))
            }
        })
    }

    /// How many states the rule takes: (fewest, most).
    fn states(&self) -> (usize, usize) {
        match self {
            RuleStep::AdamW(_) => (2, 2),
            RuleStep::Sgd(_) => (0, 1),
            RuleStep::Lion(_) => (1, 1),
        }
    }
}

/// `str(t.dtype)` of a tensor argument.
fn dtype_of(name: &str, obj: &Bound<'_, PyAny>) -> Result<String, Error> {
    obj.getattr("dtype")
        .and_then(|d| d.str())
        .map(|s| s.to_string())
        .map_err(|e| invalid(format!("{name} must be a tensor: {e}")))
}

/// The buffers of one [`optim_step`], resolved and checked; indices into `all`.
struct StepBufs {
    all: Vec<Buf>,
    /// The second part of a gradient given as the sum of two.
    grad2: Option<usize>,
    master: Option<usize>,
    comp: Option<usize>,
    /// Each state, with its scales when quantized.
    states: Vec<(usize, Option<usize>)>,
    old_param: Option<usize>,
    old_master: Option<usize>,
    old_comp: Option<usize>,
    old_states: [Option<(usize, Option<usize>)>; 2],
}

const STATE_NAMES: [&str; 2] = ["state1", "state2"];
const SCALE_NAMES: [&str; 2] = ["scales1", "scales2"];
const OLD_STATE_NAMES: [&str; 2] = ["old_state1", "old_state2"];
const OLD_SCALE_NAMES: [&str; 2] = ["old_scales1", "old_scales2"];

/// Item `k` of an optional list argument (None past its end).
fn nth<'a, 'py>(
    list: Option<&'a Vec<Bound<'py, PyAny>>>,
    k: usize,
) -> Option<&'a Bound<'py, PyAny>> {
    list.and_then(|l| l.get(k))
}

/// One update of one tensor by any rule over any storage format: the one entry the front end
/// calls. `rule` is `"adamw"`, `"sgd"` or `"lion"`; `hyper` a dict of its hyperparameters (the
/// fields of `AdamW`, `Sgd` or `Lion`: `lr`, `beta1`, ..., `grad_scale`, `step`, `seed`, and
/// optionally `index_offset`, when the call updates a piece of a larger tensor). `param`,
/// `grad` and `states` (as many as the rule keeps: AdamW 2, Lion 1, SGD 0 or 1) are contiguous CPU
/// tensors; `grad` may also be a list of two tensors of one dtype, whose sum (as torch's `add`
/// computes it) is the gradient, read in the update's pass. Their dtypes say their format: a
/// `uint8` state is block-quantized, with its `float32` scales (one per block of 256) at the same
/// position of `scales`. `master`: the float32 master weights; `comp`: the bfloat16 compensation
/// of a bfloat16 `param`. `old`, for an out-of-place update: a dict of the old values (`"param"`,
/// `"master"`, `"comp"`, `"states"`, `"scales"`), each in its operand's format.
#[pyfunction]
#[pyo3(signature = (rule, hyper, param, grad, states, *, master = None, comp = None, scales = None, old = None))]
#[allow(clippy::too_many_arguments)]
fn optim_step(
    py: Python<'_>,
    rule: &str,
    hyper: &Bound<'_, PyDict>,
    param: &Bound<'_, PyAny>,
    grad: &Bound<'_, PyAny>,
    states: Vec<Bound<'_, PyAny>>,
    master: Arg<'_, '_>,
    comp: Arg<'_, '_>,
    scales: Option<Vec<Bound<'_, PyAny>>>,
    old: Option<&Bound<'_, PyDict>>,
) -> PyResult<()> {
    let op = "optim_step";
    let mut keeps = Vec::with_capacity(16);
    let (h, b) = guard(op, || {
        let h = RuleStep::parse(rule, hyper)?;
        let (lo, hi) = h.states();
        if states.len() < lo || states.len() > hi {
            return Err(invalid(format!(
                "{rule} takes {} states, got {}",
                if lo == hi {
                    lo.to_string()
                } else {
                    format!("{lo} to {hi}")
                },
                states.len()
            )));
        }
        let numel = param
            .call_method0("numel")
            .and_then(|n| n.extract::<usize>())
            .map_err(|e| invalid(format!("param must be a tensor: {e}")))?;
        let nb = optim::quant::blocks(numel);
        let pdt = dtype_of("param", param)?;
        let old_item = |key: &str| -> Result<Option<Bound<'_, PyAny>>, Error> {
            match old {
                None => Ok(None),
                Some(d) => d
                    .get_item(key)
                    .map_err(|e| invalid(format!("old[{key:?}]: {e}"))),
            }
        };
        let old_list = |key: &str| -> Result<Option<Vec<Bound<'_, PyAny>>>, Error> {
            match old_item(key)? {
                None => Ok(None),
                Some(v) if v.is_none() => Ok(None),
                Some(v) => v
                    .extract::<Vec<Bound<'_, PyAny>>>()
                    .map(Some)
                    .map_err(|e| invalid(format!("old[{key:?}] must be a list: {e}"))),
            }
        };
        if let Some(d) = old {
            for k in d.keys() {
                let k = k.to_string();
                if !["param", "master", "comp", "states", "scales"].contains(&k.as_str()) {
                    return Err(invalid(format!(
                        "old has an unknown key {k:?}; expected \"param\", \"master\", \"comp\", \
                         \"states\", \"scales\""
                    )));
                }
            }
        }
        let mut all = Vec::with_capacity(12);
        let mut push = |b: Option<Buf>| -> Option<usize> {
            b.map(|b| {
                all.push(b);
                all.len() - 1
            })
        };
        push(resolve(
            "param",
            Some(param),
            &pdt,
            numel,
            false,
            &mut keeps,
        )?);
        let parts: Vec<Bound<'_, PyAny>> = if grad.is_instance_of::<PyList>()
            || grad.is_instance_of::<PyTuple>()
        {
            grad.extract()
                .map_err(|e| invalid(format!("grad must be a tensor or a list of tensors: {e}")))?
        } else {
            vec![grad.clone()]
        };
        if parts.is_empty() || parts.len() > 2 {
            return Err(invalid(format!(
                "grad must be a tensor or a list of one or two tensors (their sum), got a list of {}",
                parts.len()
            )));
        }
        let gdt = dtype_of("grad", &parts[0])?;
        push(resolve(
            "grad",
            Some(&parts[0]),
            &gdt,
            numel,
            false,
            &mut keeps,
        )?);
        let grad2_dt = match parts.get(1) {
            Some(g) => Some(dtype_of("grad", g)?),
            None => None,
        };
        if let Some(d) = &grad2_dt {
            if *d != gdt {
                return Err(invalid(format!(
                    "the two parts of grad must have one dtype; got {gdt} and {d}"
                )));
            }
        }
        let master = push(resolve(
            "master", master, "float32", numel, true, &mut keeps,
        )?);
        let comp = push(resolve("comp", comp, "bfloat16", numel, true, &mut keeps)?);
        let old_states_l = old_list("states")?;
        let old_scales_l = old_list("scales")?;
        let mut st = Vec::with_capacity(2);
        let mut old_states = [None, None];
        for (k, s) in states.iter().enumerate() {
            let sdt = dtype_of(STATE_NAMES[k], s)?;
            let quantized = Elem::parse(&sdt)? == Elem::U8;
            let i = push(resolve(
                STATE_NAMES[k],
                Some(s),
                &sdt,
                numel,
                false,
                &mut keeps,
            )?);
            let sc = if quantized {
                let Some(t) = nth(scales.as_ref(), k) else {
                    return Err(invalid(format!(
                        "{} is uint8 (block-quantized) and needs its scales: scales[{k}]",
                        STATE_NAMES[k]
                    )));
                };
                push(resolve(
                    SCALE_NAMES[k],
                    Some(t),
                    "float32",
                    nb,
                    false,
                    &mut keeps,
                )?)
            } else {
                None
            };
            if let Some(i) = i {
                st.push((i, sc));
            }
            let o = push(resolve(
                OLD_STATE_NAMES[k],
                nth(old_states_l.as_ref(), k),
                &sdt,
                numel,
                true,
                &mut keeps,
            )?);
            if let Some(o) = o {
                let osc = if quantized {
                    let Some(t) = nth(old_scales_l.as_ref(), k) else {
                        return Err(invalid(format!(
                            "{} is block-quantized and needs its old scales: old[\"scales\"][{k}]",
                            OLD_STATE_NAMES[k]
                        )));
                    };
                    push(resolve(
                        OLD_SCALE_NAMES[k],
                        Some(t),
                        "float32",
                        nb,
                        false,
                        &mut keeps,
                    )?)
                } else {
                    None
                };
                old_states[k] = Some((o, osc));
            }
        }
        let op_ = old_item("param")?;
        let old_param = push(resolve(
            "old_param",
            op_.as_ref(),
            &pdt,
            numel,
            true,
            &mut keeps,
        )?);
        let om = old_item("master")?;
        let old_master = push(resolve(
            "old_master",
            om.as_ref(),
            "float32",
            numel,
            true,
            &mut keeps,
        )?);
        let oc = old_item("comp")?;
        let old_comp = push(resolve(
            "old_comp",
            oc.as_ref(),
            "bfloat16",
            numel,
            true,
            &mut keeps,
        )?);
        let grad2 = match &grad2_dt {
            Some(d) => push(resolve("grad2", parts.get(1), d, numel, false, &mut keeps)?),
            None => None,
        };
        disjoint(&all)?;
        Ok((
            h,
            StepBufs {
                all,
                grad2,
                master,
                comp,
                states: st,
                old_param,
                old_master,
                old_comp,
                old_states,
            },
        ))
    })?;
    py.detach(|| {
        guard(op, || {
            // SAFETY: the buffers were checked (non-null, aligned, sized, pairwise disjoint) and
            // are valid and unshared for the call by the module's contract.
            unsafe { run_rule(&h, &b) }
        })
    })
}

/// Runs the rule over the checked buffers of [`optim_step`].
///
/// # Safety
/// As for [`Buf::view_mut`], for every buffer of `b` (they are pairwise disjoint).
unsafe fn run_rule(h: &RuleStep, b: &StepBufs) -> Result<(), Error> {
    use optim::{ParamMut, StateMut};
    let a = &b.all;
    // SAFETY: forwarded contract; each buffer of `b` is viewed once, as one kind of view.
    let param = unsafe {
        match (b.master, b.comp) {
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "master and comp are two ways of keeping the master weights: give one".into(),
                ))
            }
            (Some(m), None) => ParamMut::Master {
                param: a[0].view_mut()?,
                master: a[m].f32_mut()?,
            },
            (None, Some(c)) => match (a[0].view_mut()?, a[c].view_mut()?) {
                (TensorMut::BF16(param), TensorMut::BF16(comp)) => {
                    ParamMut::Compensated { param, comp }
                }
                _ => {
                    return Err(invalid(
                        "a param with a compensation must be bfloat16".into(),
                    ))
                }
            },
            (None, None) => ParamMut::Plain(a[0].view_mut()?),
        }
    };
    // SAFETY: as above (the gradient and its second part are only read).
    let grad = unsafe {
        match b.grad2 {
            Some(i) => optim::Grad::Sum(a[1].view()?, a[i].view()?),
            None => optim::Grad::One(a[1].view()?),
        }
    };
    let mut states = Vec::with_capacity(2);
    for &(i, sc) in &b.states {
        // SAFETY: as above; each state and its scales are viewed once.
        states.push(unsafe {
            match sc {
                Some(s) => StateMut::Q8 {
                    codes: a[i].codes_mut()?,
                    scales: a[s].f32_mut()?,
                },
                None => StateMut::Plain(a[i].view_mut()?),
            }
        });
    }
    let mut old = Old::default();
    // SAFETY: as above; the old values are only read, and overlap no operand (`disjoint`).
    unsafe {
        if let Some(i) = b.old_param {
            old.param = Some(a[i].view()?);
        }
        if let Some(i) = b.old_master {
            old.master = match a[i].view()? {
                Tensor::F32(m) => Some(m),
                _ => return Err(invalid("old master must be float32".into())),
            };
        }
        if let Some(i) = b.old_comp {
            old.comp = match a[i].view()? {
                Tensor::BF16(c) => Some(c),
                _ => return Err(invalid("old comp must be bfloat16".into())),
            };
        }
        for (k, s) in b.old_states.iter().enumerate() {
            old.states[k] = match *s {
                None => None,
                Some((i, Some(sc))) => Some(State::Q8 {
                    codes: a[i].codes()?,
                    scales: match a[sc].view()? {
                        Tensor::F32(x) => x,
                        _ => return Err(invalid("old scales must be float32".into())),
                    },
                }),
                Some((i, None)) => Some(State::Plain(a[i].view()?)),
            };
        }
    }
    let mut it = states.into_iter();
    match h {
        RuleStep::AdamW(h) => match (it.next(), it.next()) {
            (Some(m), Some(v)) => optim::adamw_update(h, param, grad, m, v, &old),
            _ => Err(invalid("adamw takes 2 states".into())),
        },
        RuleStep::Sgd(h) => optim::sgd_update(h, param, grad, it.next(), &old),
        RuleStep::Lion(h) => match it.next() {
            Some(m) => optim::lion_update(h, param, grad, m, &old),
            None => Err(invalid("lion takes 1 state".into())),
        },
    }
}

/// Quantizes the float32 tensor `x` block by block (256 elements a block) into `codes` (uint8,
/// one per element) and `scales` (float32, one per block), rounded to nearest in the signed or
/// the unsigned 8-bit format of the compact states (`ramtorch_core::optim::quant`).
#[pyfunction]
fn q8_quantize(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    codes: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
    signed: bool,
) -> PyResult<()> {
    let op = "q8_quantize";
    let mut keeps = Vec::with_capacity(3);
    let bufs = guard(op, || q8_buffers(x, "x", codes, scales, &mut keeps))?;
    py.detach(|| {
        guard(op, || {
            // SAFETY: checked and pairwise disjoint; valid and unshared during the call by
            // contract.
            unsafe {
                let Tensor::F32(x) = bufs[0].view()? else {
                    return Err(invalid("x must be float32".into()));
                };
                optim::quant::quantize(x, bufs[1].codes_mut()?, bufs[2].f32_mut()?, signed)
            }
        })
    })
}

/// Decodes `codes` and `scales` (as written by `q8_quantize`) into the float32 tensor `out`.
#[pyfunction]
fn q8_dequantize(
    py: Python<'_>,
    codes: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    signed: bool,
) -> PyResult<()> {
    let op = "q8_dequantize";
    let mut keeps = Vec::with_capacity(3);
    let bufs = guard(op, || q8_buffers(out, "out", codes, scales, &mut keeps))?;
    py.detach(|| {
        guard(op, || {
            // SAFETY: as in `q8_quantize`.
            unsafe {
                let Tensor::F32(s) = bufs[2].view()? else {
                    return Err(invalid("scales must be float32".into()));
                };
                optim::quant::dequantize(bufs[1].codes()?, s, bufs[0].f32_mut()?, signed)
            }
        })
    })
}

/// The float32 values, codes and scales of `q8_quantize`/`q8_dequantize`, checked.
fn q8_buffers(
    x: &Bound<'_, PyAny>,
    xname: &'static str,
    codes: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
    keeps: &mut Vec<Keep>,
) -> Result<Vec<Buf>, Error> {
    let numel = x
        .call_method0("numel")
        .and_then(|n| n.extract::<usize>())
        .map_err(|e| invalid(format!("{xname} must be a tensor: {e}")))?;
    let nb = optim::quant::blocks(numel);
    let mut b = Vec::with_capacity(3);
    b.extend(resolve(xname, Some(x), "float32", numel, false, keeps)?);
    b.extend(resolve("codes", Some(codes), "uint8", numel, false, keeps)?);
    b.extend(resolve(
        "scales",
        Some(scales),
        "float32",
        nb,
        false,
        keeps,
    )?);
    disjoint(&b)?;
    Ok(b)
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
            let s = optim::grad_stats(unsafe { b.view()? });
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
            optim::scale_in_place(unsafe { b.view_mut()? }, factor as f32);
            Ok(())
        })
    })
}

/// `dst += src` over `numel` elements of `dtype` (each as for `grad_stats`; not overlapping), as
/// torch's `add_` computes it: in float32, bfloat16/float16 results rounded to nearest even. On
/// the rayon pool, with the GIL released.
#[pyfunction]
#[pyo3(name = "add_")]
fn add(
    py: Python<'_>,
    dst: &Bound<'_, PyAny>,
    src: &Bound<'_, PyAny>,
    dtype: &str,
    numel: usize,
) -> PyResult<()> {
    let op = "add_";
    let mut keeps = Vec::with_capacity(2);
    let (d, s) = guard(op, || {
        let d = resolve("dst", Some(dst), dtype, numel, false, &mut keeps)?
            .ok_or_else(|| invalid("dst is required".into()))?;
        let s = resolve("src", Some(src), dtype, numel, false, &mut keeps)?
            .ok_or_else(|| invalid("src is required".into()))?;
        disjoint(&[d, s])?;
        Ok((d, s))
    })?;
    py.detach(|| {
        guard(op, || {
            // SAFETY: both checked in `Buf::new` and disjoint (checked above); valid, `dst` unread
            // and `src` unwritten by anything else during the call, by the module's contract.
            let (dv, sv) = unsafe { (d.view_mut()?, s.view()?) };
            optim::add_in_place(dv, sv)
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

/// The `f32` constants and stochastic-rounding keys of one step of `rule` with `hyper` (as
/// `optim_step` takes them), for the GPU implementation of the same kernels: a dict of the
/// rule's constants (AdamW: `gs`, `decay`, `w1`, `w1c`, `lerp_low`, `beta2`, `c2`,
/// `inv_bc2_sqrt`, `eps`, `neg_step_size`) and `keys`, the four hash keys of the elements from
/// `hyper["index_offset"]` (0 if absent) up to the next multiple of 2^32. Only AdamW has a GPU
/// implementation; other rules raise `ValueError`.
#[pyfunction]
fn optim_constants<'py>(
    py: Python<'py>,
    rule: &str,
    hyper: &Bound<'py, PyDict>,
) -> PyResult<Bound<'py, PyDict>> {
    let op = "optim_constants";
    let (h, offset, seed, step) = guard(op, || match RuleStep::parse(rule, hyper)? {
        RuleStep::AdamW(h) => Ok((h.constants()?, h.index_offset, h.seed, h.step)),
        _ => Err(invalid(format!(
            "{rule}: only adamw has a GPU implementation of its kernel"
        ))),
    })?;
    let d = PyDict::new(py);
    d.set_item("gs", h.gs)?;
    d.set_item("decay", h.decay)?;
    d.set_item("w1", h.w1)?;
    d.set_item("w1c", h.w1c)?;
    d.set_item("lerp_low", h.lerp_low)?;
    d.set_item("beta2", h.beta2)?;
    d.set_item("c2", h.c2)?;
    d.set_item("inv_bc2_sqrt", h.inv_bc2_sqrt)?;
    d.set_item("eps", h.eps)?;
    d.set_item("neg_step_size", h.neg_step_size)?;
    d.set_item(
        "keys",
        optim::precision::stochastic_keys(seed, step, offset).to_vec(),
    )?;
    Ok(d)
}

/// The instruction set the optimizer kernels run with on this CPU (`"avx512"`, `"avx2"` or
/// `"base"`, at most what `RAMTORCH_CPU_KERNELS` names), for benchmark
/// records; a `ValueError` when that variable names no instruction set.
#[pyfunction]
fn optim_isa() -> PyResult<&'static str> {
    guard("optim_isa", optim::kernel_isa)
}

/// The 256 values, ascending, of the dynamic map of the first compact format, signed (in
/// `[-1, 1]`) or unsigned (in `[0, 1]`): a state saved in that format is `map[code] * scale`.
#[pyfunction]
fn q8_legacy_map(signed: bool) -> Vec<f32> {
    optim::quant::legacy_map(signed).to_vec()
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
    m.add_function(wrap_pyfunction!(optim_step, m)?)?;
    m.add_function(wrap_pyfunction!(q8_quantize, m)?)?;
    m.add_function(wrap_pyfunction!(q8_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(grad_stats, m)?)?;
    m.add_function(wrap_pyfunction!(scale, m)?)?;
    m.add_function(wrap_pyfunction!(add, m)?)?;
    m.add_function(wrap_pyfunction!(optim_threads, m)?)?;
    m.add_function(wrap_pyfunction!(optim_constants, m)?)?;
    m.add_function(wrap_pyfunction!(q8_legacy_map, m)?)?;
    m.add_function(wrap_pyfunction!(optim_isa, m)?)?;
    Ok(())
}
