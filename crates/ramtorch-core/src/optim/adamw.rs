//! AdamW (torch.optim.AdamW semantics).

use super::kernel::*;
use super::precision::*;
use super::{invalid, Grad, Old, ParamMut, StateMut, Tensor, TensorMut};
use crate::Result;

// ---------------------------------------------------------------------------------------------
// AdamW.

/// Hyperparameters of one AdamW step (`torch.optim.AdamW`, decoupled weight decay).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f64,
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay: the parameter is multiplied by `1 - lr * weight_decay` first.
    pub weight_decay: f64,
    /// Maximise the objective (the gradient's sign is flipped).
    pub maximize: bool,
    /// The gradient is multiplied by this before use (unscaling, clipping).
    pub grad_scale: f64,
    /// Step number, from 1, for the bias corrections (and the rounding stream).
    pub step: u64,
    /// Seed of stochastic rounding (used when something is stored in `bf16` without a master).
    pub seed: u64,
    /// Index of the first element in the whole tensor when a call updates a piece of it: the
    /// piece's stochastic rounding then draws the words the whole tensor's update would (0 for
    /// a whole tensor). A piece must not cross a multiple of 2^32 elements.
    pub index_offset: u64,
}

impl Default for AdamW {
    /// torch's defaults: `lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2`, step 1.
    fn default() -> Self {
        AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
            maximize: false,
            grad_scale: 1.0,
            step: 1,
            seed: 0,
            index_offset: 0,
        }
    }
}

/// The `f32` constants of one AdamW step, as the kernels use them (computed from [`AdamW`] in
/// double, as torch does, then rounded): what another implementation of the same step (the GPU
/// kernel of the Python package) needs to compute the same bits. See [`AdamW::constants`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamRule {
    /// The gradient's factor (`grad_scale`, negated to maximise).
    pub gs: f32,
    /// The weight's factor, `1 - lr * weight_decay`.
    pub decay: f32,
    /// `1 - beta1`, the weight of torch's `lerp`.
    pub w1: f32,
    /// `1 - w1` in `f32`.
    pub w1c: f32,
    /// Whether `lerp` takes its low form, `m + w1 * (g - m)` (else `g - (g - m) * w1c`).
    pub lerp_low: bool,
    /// `beta2`.
    pub beta2: f32,
    /// `1 - beta2`.
    pub c2: f32,
    /// `1 / sqrt(1 - beta2^step)`.
    pub inv_bc2_sqrt: f32,
    /// `eps`.
    pub eps: f32,
    /// `-lr / (1 - beta1^step)`.
    pub neg_step_size: f32,
}

impl AdamW {
    /// The step's `f32` constants, after checking the hyperparameters (the errors of
    /// [`adamw_update`]).
    pub fn constants(&self) -> Result<AdamRule> {
        let h = self;
        check_nonneg("lr", h.lr)?;
        check_beta("beta1", h.beta1, false)?;
        check_beta("beta2", h.beta2, false)?;
        check_nonneg("eps", h.eps)?;
        check_nonneg("weight_decay", h.weight_decay)?;
        check_finite("grad_scale", h.grad_scale)?;
        if h.step == 0 {
            return Err(invalid(
                "step counts from 1 (the bias corrections divide by 1 - beta^step)",
            ));
        }
        // Scalars as torch computes them: in double, then cast to the tensors' float.
        let step = h.step as f64;
        let bc1 = 1.0 - h.beta1.powf(step);
        let bc2 = 1.0 - h.beta2.powf(step);
        let w1 = (1.0 - h.beta1) as f32;
        let gs = if h.maximize {
            -h.grad_scale
        } else {
            h.grad_scale
        };
        Ok(AdamRule {
            gs: gs as f32,
            decay: (1.0 - h.lr * h.weight_decay) as f32,
            w1,
            w1c: 1.0 - w1,
            lerp_low: w1.abs() < 0.5,
            beta2: h.beta2 as f32,
            c2: (1.0 - h.beta2) as f32,
            inv_bc2_sqrt: (1.0 / bc2.sqrt()) as f32,
            eps: h.eps as f32,
            neg_step_size: (-(h.lr / bc1)) as f32,
        })
    }
}

impl Rule for AdamRule {
    #[inline(always)]
    fn elem(&self, p: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32) {
        let k = self;
        let g = g * k.gs;
        let pd = p * k.decay;
        // torch's lerp(m, g, w), in the form torch picks for the weight.
        let m = if k.lerp_low {
            m + k.w1 * (g - m)
        } else {
            g - (g - m) * k.w1c
        };
        let v = v * k.beta2 + k.c2 * g * g;
        let denom = v.sqrt() * k.inv_bc2_sqrt + k.eps;
        (pd + k.neg_step_size * m / denom, m, v)
    }
}

/// One AdamW step over one tensor, with `torch.optim.AdamW` semantics (no amsgrad):
///
/// ```text
/// g = grad * grad_scale;  if maximize: g = -g
/// p = p * (1 - lr * weight_decay)
/// m = lerp(m, g, 1 - beta1)
/// v = beta2 * v + (1 - beta2) * g * g
/// p = p - lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
/// ```
///
/// `param` is `f32` (updated in place), `bf16` without `master` (stochastic rounding), or `bf16`
/// / `f16` with a `f32` `master` (the master is updated and `param` set to it, rounded to
/// nearest even). `exp_avg`/`exp_avg_sq` are `f32` or `bf16` (stochastic rounding); `grad` is any
/// of the three types. All lengths must match.
pub fn adamw_step(
    h: &AdamW,
    param: TensorMut<'_>,
    master: Option<&mut [f32]>,
    grad: Tensor<'_>,
    exp_avg: TensorMut<'_>,
    exp_avg_sq: TensorMut<'_>,
) -> Result<()> {
    adamw_step_from(h, param, master, grad, exp_avg, exp_avg_sq, &Old::default())
}

/// As [`adamw_step`], out of place: reads the old values from `old` (see [`Old`]) instead of
/// from the operands, which receive the new ones.
pub fn adamw_step_from(
    h: &AdamW,
    param: TensorMut<'_>,
    master: Option<&mut [f32]>,
    grad: Tensor<'_>,
    exp_avg: TensorMut<'_>,
    exp_avg_sq: TensorMut<'_>,
    old: &Old<'_>,
) -> Result<()> {
    adamw_update(
        h,
        ParamMut::new(param, master),
        grad,
        StateMut::Plain(exp_avg),
        StateMut::Plain(exp_avg_sq),
        old,
    )
}

/// As [`adamw_step_from`], over every storage format: `param` as [`ParamMut`] (e.g. a `bf16`
/// weight with its compensation), the moments as [`StateMut`], both unquantized (`f32`/`bf16`)
/// or both block-quantized (`exp_avg` with the signed map, `exp_avg_sq` with the unsigned one).
/// `old` as for [`adamw_step_from`] (`Old::default()`: in place).
pub fn adamw_update<'a>(
    h: &AdamW,
    param: ParamMut<'_>,
    grad: impl Into<Grad<'a>>,
    exp_avg: StateMut<'_>,
    exp_avg_sq: StateMut<'_>,
    old: &Old<'_>,
) -> Result<()> {
    let param = param_mode(param)?;
    let n = param.len();
    let grad = check_grad(grad.into(), n)?;
    check_offset(h.index_offset, n)?;
    if matches!(exp_avg, StateMut::Q8 { .. }) != matches!(exp_avg_sq, StateMut::Q8 { .. }) {
        return Err(invalid(
            "exp_avg and exp_avg_sq must both be block-quantized or both not",
        ));
    }
    let states = (
        state_mode("exp_avg", exp_avg, n, true)?,
        state_mode("exp_avg_sq", exp_avg_sq, n, false)?,
    );
    let rule = h.constants()?;
    let old = sources(old, &param, Some(&states.0), Some(&states.1))?;
    run_step(
        rule,
        Stream::new(h.seed, h.step).at(h.index_offset),
        param,
        grad,
        states,
        old,
    );
    Ok(())
}
