//! SGD with momentum, dampening and Nesterov (torch.optim.SGD semantics).

use super::kernel::*;
use super::precision::*;
use super::{invalid, Grad, Old, ParamMut, StateMut, Tensor, TensorMut};
use crate::Result;

// ---------------------------------------------------------------------------------------------
// SGD.

/// Hyperparameters of one SGD step (`torch.optim.SGD`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0: plain SGD, no buffer).
    pub momentum: f64,
    /// Dampening of the gradient in the momentum buffer (not applied on the first step).
    pub dampening: f64,
    /// L2 penalty, added to the gradient: `g += weight_decay * p`.
    pub weight_decay: f64,
    /// Nesterov momentum (needs `momentum > 0` and `dampening == 0`).
    pub nesterov: bool,
    /// Maximise the objective (the gradient's sign is flipped).
    pub maximize: bool,
    /// The momentum buffer is initialised to the gradient (torch's first step, `buf is None`).
    pub first_step: bool,
    /// The gradient is multiplied by this before use (unscaling, clipping).
    pub grad_scale: f64,
    /// Step number, mixed into the stochastic rounding stream (any value; vary it or `seed`).
    pub step: u64,
    /// Seed of stochastic rounding.
    pub seed: u64,
    /// Index of the first element in the whole tensor when a call updates a piece of it: the
    /// piece's stochastic rounding then draws the words the whole tensor's update would (0 for
    /// a whole tensor). A piece must not cross a multiple of 2^32 elements.
    pub index_offset: u64,
}

impl Default for Sgd {
    /// `lr=1e-3`, no momentum, no weight decay.
    fn default() -> Self {
        Sgd {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            maximize: false,
            first_step: false,
            grad_scale: 1.0,
            step: 0,
            seed: 0,
            index_offset: 0,
        }
    }
}

#[derive(Clone, Copy)]
pub(super) struct SgdRule {
    gs: f32,
    wd: f32,
    has_wd: bool,
    momentum: f32,
    has_momentum: bool,
    damp: f32,
    nesterov: bool,
    first: bool,
    neg_lr: f32,
}

impl Rule for SgdRule {
    #[inline(always)]
    fn elem(&self, p: f32, g: f32, buf: f32, _: f32) -> (f32, f32, f32) {
        let k = self;
        let g = g * k.gs;
        let d = if k.has_wd { g + k.wd * p } else { g };
        if !k.has_momentum {
            return (p + k.neg_lr * d, 0.0, 0.0);
        }
        let buf = if k.first {
            d
        } else {
            buf * k.momentum + k.damp * d
        };
        let u = if k.nesterov {
            d + k.momentum * buf
        } else {
            buf
        };
        (p + k.neg_lr * u, buf, 0.0)
    }
}

/// One SGD step over one tensor, with `torch.optim.SGD` semantics:
///
/// ```text
/// g = grad * grad_scale;  if maximize: g = -g
/// if weight_decay != 0: g = g + weight_decay * p
/// if momentum != 0:
///     buf = g if first_step else momentum * buf + (1 - dampening) * g
///     g = g + momentum * buf if nesterov else buf
/// p = p - lr * g
/// ```
///
/// Storage as for [`adamw_step`](super::adamw_step); `momentum_buffer` is needed when `momentum != 0` (it is ignored,
/// though its length is checked, when `momentum == 0`).
pub fn sgd_step(
    h: &Sgd,
    param: TensorMut<'_>,
    master: Option<&mut [f32]>,
    grad: Tensor<'_>,
    momentum_buffer: Option<TensorMut<'_>>,
) -> Result<()> {
    sgd_step_from(h, param, master, grad, momentum_buffer, &Old::default())
}

/// As [`sgd_step`], out of place: reads the old values from `old` (see [`Old`]) instead of
/// from the operands, which receive the new ones.
pub fn sgd_step_from(
    h: &Sgd,
    param: TensorMut<'_>,
    master: Option<&mut [f32]>,
    grad: Tensor<'_>,
    momentum_buffer: Option<TensorMut<'_>>,
    old: &Old<'_>,
) -> Result<()> {
    sgd_update(
        h,
        ParamMut::new(param, master),
        grad,
        momentum_buffer.map(StateMut::Plain),
        old,
    )
}

/// As [`sgd_step_from`], over every storage format ([`ParamMut`], [`StateMut`]; a quantized
/// momentum buffer uses the signed map).
pub fn sgd_update<'a>(
    h: &Sgd,
    param: ParamMut<'_>,
    grad: impl Into<Grad<'a>>,
    momentum_buffer: Option<StateMut<'_>>,
    old: &Old<'_>,
) -> Result<()> {
    check_nonneg("lr", h.lr)?;
    check_nonneg("momentum", h.momentum)?;
    check_finite("dampening", h.dampening)?;
    check_nonneg("weight_decay", h.weight_decay)?;
    check_finite("grad_scale", h.grad_scale)?;
    if h.nesterov && (h.momentum <= 0.0 || h.dampening != 0.0) {
        return Err(invalid(
            "Nesterov momentum requires a momentum and zero dampening",
        ));
    }
    let param = param_mode(param)?;
    let n = param.len();
    let grad = check_grad(grad.into(), n)?;
    check_offset(h.index_offset, n)?;
    let has_momentum = h.momentum != 0.0;
    let state = match momentum_buffer {
        Some(b) => {
            let s = state_mode("momentum_buffer", b, n, true)?;
            has_momentum.then_some(s)
        }
        None if has_momentum => {
            return Err(invalid("momentum != 0 needs a momentum_buffer"));
        }
        None => None,
    };
    let gs = if h.maximize {
        -h.grad_scale
    } else {
        h.grad_scale
    };
    let rule = SgdRule {
        gs: gs as f32,
        wd: h.weight_decay as f32,
        has_wd: h.weight_decay != 0.0,
        momentum: h.momentum as f32,
        has_momentum,
        damp: (1.0 - h.dampening) as f32,
        nesterov: h.nesterov,
        first: h.first_step,
        neg_lr: (-h.lr) as f32,
    };
    let old = sources(old, &param, state.as_ref(), None)?;
    run_step(
        rule,
        Stream::new(h.seed, h.step).at(h.index_offset),
        param,
        grad,
        state,
        old,
    );
    Ok(())
}
