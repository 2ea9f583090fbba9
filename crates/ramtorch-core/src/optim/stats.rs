//! Gradient statistics (global-norm clipping), in-place scaling (loss scaling), in-place addition
//! (gradients accumulated on the host) and stochastic rounding of a whole tensor.

use super::kernel::*;
use super::precision::*;
use super::{bf16, invalid, Tensor, TensorMut};
use crate::Result;

// ---------------------------------------------------------------------------------------------
// Gradient statistics, scaling, rounding.

/// What [`grad_stats`] finds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GradStats {
    /// Sum of the squares of the elements, accumulated in `f64` (NaN or infinite when an element
    /// is).
    pub sum_sq: f64,
    /// Whether any element is NaN or infinite.
    pub non_finite: bool,
}

pub(super) struct SumSq;

pub(super) const LANES: usize = 16;

#[inline(always)]
pub(super) fn sum_sq_of<T: Copy>(x: &[T], f: impl Fn(T) -> f32) -> f64 {
    // Independent lanes so the loop vectorises without reassociating; combined in a fixed order.
    let mut acc = [0f64; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            let v = f(*v) as f64;
            *a += v * v;
        }
    }
    for (a, v) in acc.iter_mut().zip(chunks.remainder()) {
        let v = f(*v) as f64;
        *a += v * v;
    }
    let mut s = 0.0;
    for a in acc {
        s += a;
    }
    s
}

impl<'a> Leaf<Tensor<'a>> for SumSq {
    type Out = f64;

    #[inline(always)]
    fn run(&self, _: usize, t: Tensor<'a>) -> f64 {
        match t {
            Tensor::F32(s) => sum_sq_of(s, |v| v),
            Tensor::BF16(s) => sum_sq_of(s, bf16_to_f32),
            Tensor::F16(s) => sum_sq_of(s, f16_to_f32),
        }
    }

    fn join(a: f64, b: f64) -> f64 {
        a + b
    }
}

/// Sum of squares (in `f64`) and whether anything is non-finite, for global-norm clipping and
/// inf/NaN checks. Deterministic: the summation order depends on the length only, not on the
/// number of threads.
pub fn grad_stats(grad: Tensor<'_>) -> GradStats {
    let sum_sq = for_pieces(grad.len(), grad, &SumSq);
    // Squares of f32/bf16/f16 values are at most ~1.2e77 in f64, so no finite input overflows:
    // the sum is finite exactly when every element is.
    GradStats {
        sum_sq,
        non_finite: !sum_sq.is_finite(),
    }
}

pub(super) struct Scale(f32);

impl<'a> Leaf<TensorMut<'a>> for Scale {
    type Out = ();

    #[inline(always)]
    fn run(&self, _: usize, t: TensorMut<'a>) {
        let k = self.0;
        match t {
            TensorMut::F32(s) => s.iter_mut().for_each(|v| *v *= k),
            TensorMut::BF16(s) => s
                .iter_mut()
                .for_each(|v| *v = bf16_rne(bf16_to_f32(*v) * k)),
            TensorMut::F16(s) => s.iter_mut().for_each(|v| *v = f16_rne(f16_to_f32(*v) * k)),
        }
    }

    fn join(_: (), _: ()) {}
}

/// Multiplies every element by `factor` (as `f32`; `bf16`/`f16` results rounded to nearest
/// even, as torch's `mul_` does).
pub fn scale_in_place(tensor: TensorMut<'_>, factor: f32) {
    let n = tensor.len();
    for_pieces(n, tensor, &Scale(factor));
}

pub(super) struct Add;

impl<'a> Leaf<(TensorMut<'a>, Tensor<'a>)> for Add {
    type Out = ();

    #[inline(always)]
    fn run(&self, _: usize, (dst, src): (TensorMut<'a>, Tensor<'a>)) {
        match (dst, src) {
            (TensorMut::F32(d), Tensor::F32(s)) => d.iter_mut().zip(s).for_each(|(a, b)| *a += *b),
            (TensorMut::BF16(d), Tensor::BF16(s)) => {
                d.iter_mut().zip(s).for_each(|(a, b)| *a = add_bf16(*a, *b))
            }
            (TensorMut::F16(d), Tensor::F16(s)) => {
                d.iter_mut().zip(s).for_each(|(a, b)| *a = add_f16(*a, *b))
            }
            // Refused by `add_in_place` before any piece runs.
            _ => {}
        }
    }

    fn join(_: (), _: ()) {}
}

/// `dst += src` element by element, as torch's `add_` computes it: in `f32`, `bf16`/`f16` results
/// rounded to nearest even (NaN stays a NaN). The two must have one dtype and one length.
pub fn add_in_place(dst: TensorMut<'_>, src: Tensor<'_>) -> Result<()> {
    if dst.dtype() != src.dtype() || dst.len() != src.len() {
        return Err(invalid(format!(
            "add: dst is {} elements of {:?}, src {} of {:?}; they must match",
            dst.len(),
            dst.dtype(),
            src.len(),
            src.dtype()
        )));
    }
    let n = dst.len();
    for_pieces(n, (dst, src), &Add);
    Ok(())
}

pub(super) struct RoundSr(Stream);

impl<'a> Leaf<(&'a [f32], &'a mut [bf16])> for RoundSr {
    type Out = ();

    #[inline(always)]
    fn run(&self, start: usize, (src, dst): (&'a [f32], &'a mut [bf16])) {
        let n = src.len();
        if dst.len() != n {
            return;
        }
        let (k0, k1) = self.0.keys(0, start as u64 >> 32);
        let lo = start as u32;
        for i in 0..n {
            dst[i] = bf16_sr(src[i], hash32(lo.wrapping_add(i as u32), k0, k1));
        }
    }

    fn join(_: (), _: ()) {}
}

/// Rounds `src` into `dst` stochastically (unbiased), with the same random stream as the
/// optimizers' parameter rounding for `(seed, step)`.
pub fn stochastic_round_bf16(src: &[f32], dst: &mut [bf16], seed: u64, step: u64) -> Result<()> {
    if src.len() != dst.len() {
        return Err(invalid(format!(
            "src has {} elements but dst has {}",
            src.len(),
            dst.len()
        )));
    }
    for_pieces(src.len(), (src, dst), &RoundSr(Stream::new(seed, step)));
    Ok(())
}
