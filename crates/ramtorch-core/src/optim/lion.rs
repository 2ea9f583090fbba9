//! Lion (sign of an interpolated momentum).

use super::kernel::*;
use super::precision::*;
use super::{Grad, Old, ParamMut, StateMut, Tensor, TensorMut};
use crate::Result;

// ---------------------------------------------------------------------------------------------
// Lion.

/// Hyperparameters of one Lion step (Chen et al. 2023, as in `lion-pytorch`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Lion {
    /// Learning rate.
    pub lr: f64,
    /// Interpolation between momentum and gradient for the update's sign.
    pub beta1: f64,
    /// Decay of the momentum.
    pub beta2: f64,
    /// Decoupled weight decay: the parameter is multiplied by `1 - lr * weight_decay` first.
    pub weight_decay: f64,
    /// Maximise the objective (the gradient's sign is flipped).
    pub maximize: bool,
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

impl Default for Lion {
    /// `lr=1e-4, betas=(0.9, 0.99)`, no weight decay.
    fn default() -> Self {
        Lion {
            lr: 1e-4,
            beta1: 0.9,
            beta2: 0.99,
            weight_decay: 0.0,
            maximize: false,
            grad_scale: 1.0,
            step: 0,
            seed: 0,
            index_offset: 0,
        }
    }
}

#[derive(Clone, Copy)]
pub(super) struct LionRule {
    gs: f32,
    decay: f32,
    beta1: f32,
    c1: f32,
    beta2: f32,
    c2: f32,
    neg_lr: f32,
}

impl Rule for LionRule {
    #[inline(always)]
    fn elem(&self, p: f32, g: f32, m: f32, _: f32) -> (f32, f32, f32) {
        let k = self;
        let g = g * k.gs;
        let pd = p * k.decay;
        let c = m * k.beta1 + k.c1 * g;
        // torch.sign: +-1, zero stays zero, NaN stays NaN.
        let s = if c > 0.0 {
            1.0
        } else if c < 0.0 {
            -1.0
        } else {
            c
        };
        (pd + k.neg_lr * s, m * k.beta2 + k.c2 * g, 0.0)
    }
}

/// One Lion step over one tensor:
///
/// ```text
/// g = grad * grad_scale;  if maximize: g = -g
/// p = p * (1 - lr * weight_decay)
/// p = p - lr * sign(beta1 * m + (1 - beta1) * g)
/// m = beta2 * m + (1 - beta2) * g
/// ```
///
/// Storage as for [`adamw_step`](super::adamw_step) (one state, `exp_avg`).
pub fn lion_step(
    h: &Lion,
    param: TensorMut<'_>,
    master: Option<&mut [f32]>,
    grad: Tensor<'_>,
    exp_avg: TensorMut<'_>,
) -> Result<()> {
    lion_step_from(h, param, master, grad, exp_avg, &Old::default())
}

/// As [`lion_step`], out of place: reads the old values from `old` (see [`Old`]) instead of
/// from the operands, which receive the new ones.
pub fn lion_step_from(
    h: &Lion,
    param: TensorMut<'_>,
    master: Option<&mut [f32]>,
    grad: Tensor<'_>,
    exp_avg: TensorMut<'_>,
    old: &Old<'_>,
) -> Result<()> {
    lion_update(
        h,
        ParamMut::new(param, master),
        grad,
        StateMut::Plain(exp_avg),
        old,
    )
}

/// As [`lion_step_from`], over every storage format ([`ParamMut`], [`StateMut`]; a quantized
/// `exp_avg` uses the signed map).
pub fn lion_update<'a>(
    h: &Lion,
    param: ParamMut<'_>,
    grad: impl Into<Grad<'a>>,
    exp_avg: StateMut<'_>,
    old: &Old<'_>,
) -> Result<()> {
    check_nonneg("lr", h.lr)?;
    check_beta("beta1", h.beta1, true)?;
    check_beta("beta2", h.beta2, true)?;
    check_nonneg("weight_decay", h.weight_decay)?;
    check_finite("grad_scale", h.grad_scale)?;
    let param = param_mode(param)?;
    let n = param.len();
    let grad = check_grad(grad.into(), n)?;
    check_offset(h.index_offset, n)?;
    let state = state_mode("exp_avg", exp_avg, n, true)?;
    let gs = if h.maximize {
        -h.grad_scale
    } else {
        h.grad_scale
    };
    let rule = LionRule {
        gs: gs as f32,
        decay: (1.0 - h.lr * h.weight_decay) as f32,
        beta1: h.beta1 as f32,
        c1: (1.0 - h.beta1) as f32,
        beta2: h.beta2 as f32,
        c2: (1.0 - h.beta2) as f32,
        neg_lr: (-h.lr) as f32,
    };
    let old = sources(old, &param, Some(&state), None)?;
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
