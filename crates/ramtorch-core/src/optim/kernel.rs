//! The machinery every update rule shares: splitting tensors into pieces for the rayon pool, the
//! instruction-set dispatch, the storage modes (how a parameter, a gradient and a state are loaded
//! and stored) and the fused per-element loop that runs a [`Rule`].

use super::precision::*;
use super::{bf16, f16, invalid, Old, Tensor, TensorMut, ALIGN, SERIAL_MAX};
use crate::Result;

// ---------------------------------------------------------------------------------------------
// Parallel driver: binary splitting, leaves compiled for several instruction sets.

/// Something that can be cut in two at an element index.
pub(super) trait Split: Sized + Send {
    fn split_at(self, mid: usize) -> (Self, Self);
}

/// The work on one piece; `start` is the index of the piece's first element in the whole tensor.
pub(super) trait Leaf<P>: Sync {
    type Out: Send;
    fn run(&self, start: usize, parts: P) -> Self::Out;
    fn join(a: Self::Out, b: Self::Out) -> Self::Out;
}

/// The instruction sets the leaves are compiled for; the best one the CPU has is used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Isa {
    /// The target's baseline (SSE2 on x86-64, NEON on aarch64).
    Base,
    /// AVX2 and F16C.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512 F, BW, VL and DQ.
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

#[cfg(test)]
thread_local! {
    /// Tests run the kernels of a lower instruction set through this (on the calling thread only,
    /// so with at most [`SERIAL_MAX`] elements).
    pub(super) static FORCE_ISA: std::cell::Cell<Option<Isa>> = const { std::cell::Cell::new(None) };
}

pub(super) fn isa() -> Isa {
    let best = best_isa();
    #[cfg(test)]
    if let Some(forced) = FORCE_ISA.with(|f| f.get()) {
        return forced.min(best);
    }
    best
}

pub(super) fn best_isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512dq") {
                return Isa::Avx512;
            }
            if has!("avx2") && has!("f16c") {
                return Isa::Avx2;
            }
        }
        Isa::Base
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
pub(super) fn leaf_avx2<P, L: Leaf<P>>(leaf: &L, start: usize, parts: P) -> L::Out {
    leaf.run(start, parts)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c")]
pub(super) fn leaf_avx512<P, L: Leaf<P>>(leaf: &L, start: usize, parts: P) -> L::Out {
    leaf.run(start, parts)
}

/// Runs one leaf with the code compiled for `want`, or for the best the CPU has if that is less.
/// The element code has no FMA contraction and only correctly rounded operations, so every path
/// gives the same bits.
pub(super) fn leaf_on<P, L: Leaf<P>>(want: Isa, leaf: &L, start: usize, parts: P) -> L::Out {
    match want.min(isa()) {
        Isa::Base => leaf.run(start, parts),
        // SAFETY: `isa()` found AVX2 and F16C on this CPU.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { leaf_avx2(leaf, start, parts) },
        // SAFETY: `isa()` found AVX-512 F/BW/VL/DQ on this CPU.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { leaf_avx512(leaf, start, parts) },
    }
}

/// Runs `leaf` over `parts` (`len` elements), on the calling thread when small, else split in
/// halves on the rayon pool. Pieces never straddle a multiple of 2^32 elements (so the random
/// stream's keys are constant over a piece), and the split points depend on `len` only, so any
/// reduction done by `Leaf::join` is the same whatever the number of threads.
pub(super) fn for_pieces<P: Split, L: Leaf<P>>(len: usize, parts: P, leaf: &L) -> L::Out {
    fn rec<P: Split, L: Leaf<P>>(start: usize, len: usize, parts: P, leaf: &L) -> L::Out {
        let next_boundary = ((start as u64 >> 32) + 1) << 32;
        let mid = if next_boundary < (start + len) as u64 {
            (next_boundary - start as u64) as usize
        } else if len <= SERIAL_MAX {
            return leaf_on(isa(), leaf, start, parts);
        } else {
            (len / 2).div_ceil(ALIGN) * ALIGN
        };
        let (a, b) = parts.split_at(mid);
        let (x, y) = rayon::join(
            || rec(start, mid, a, leaf),
            || rec(start + mid, len - mid, b, leaf),
        );
        L::join(x, y)
    }
    rec(0, len, parts, leaf)
}

impl<T: Send> Split for &mut [T] {
    fn split_at(self, mid: usize) -> (Self, Self) {
        self.split_at_mut(mid)
    }
}

impl<T: Sync> Split for &[T] {
    fn split_at(self, mid: usize) -> (Self, Self) {
        <[T]>::split_at(self, mid)
    }
}

impl Split for Tensor<'_> {
    fn split_at(self, mid: usize) -> (Self, Self) {
        Tensor::split_at(self, mid)
    }
}

impl Split for TensorMut<'_> {
    fn split_at(self, mid: usize) -> (Self, Self) {
        match self {
            TensorMut::F32(s) => {
                let (a, b) = s.split_at_mut(mid);
                (TensorMut::F32(a), TensorMut::F32(b))
            }
            TensorMut::BF16(s) => {
                let (a, b) = s.split_at_mut(mid);
                (TensorMut::BF16(a), TensorMut::BF16(b))
            }
            TensorMut::F16(s) => {
                let (a, b) = s.split_at_mut(mid);
                (TensorMut::F16(a), TensorMut::F16(b))
            }
        }
    }
}

impl<A: Split, B: Split> Split for (A, B) {
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (a0, a1) = self.0.split_at(mid);
        let (b0, b1) = self.1.split_at(mid);
        ((a0, b0), (a1, b1))
    }
}

// ---------------------------------------------------------------------------------------------
// Optimizer storage: validated modes, then one accessor type per way of storing an operand, so
// that every combination compiles to one fused, vectorised loop.

/// How a parameter is stored (validated form of `param` + `master`).
pub(super) enum ParamMode<'a> {
    F32(&'a mut [f32]),
    Bf16Sr(&'a mut [bf16]),
    MasterBf16(&'a mut [f32], &'a mut [bf16]),
    MasterF16(&'a mut [f32], &'a mut [f16]),
}

/// How an optimizer state is stored.
pub(super) enum StateMode<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [bf16]),
}

pub(super) fn check_len(what: &str, len: usize, expected: usize) -> Result<()> {
    if len != expected {
        return Err(invalid(format!(
            "{what} has {len} elements but param has {expected}"
        )));
    }
    Ok(())
}

pub(super) fn param_mode<'a>(
    param: TensorMut<'a>,
    master: Option<&'a mut [f32]>,
) -> Result<ParamMode<'a>> {
    let n = param.len();
    if let Some(m) = &master {
        check_len("master", m.len(), n)?;
    }
    match (param, master) {
        (TensorMut::F32(p), None) => Ok(ParamMode::F32(p)),
        (TensorMut::BF16(p), None) => Ok(ParamMode::Bf16Sr(p)),
        (TensorMut::BF16(p), Some(m)) => Ok(ParamMode::MasterBf16(m, p)),
        (TensorMut::F16(p), Some(m)) => Ok(ParamMode::MasterF16(m, p)),
        (TensorMut::F16(_), None) => Err(invalid(
            "a float16 param needs float32 master weights (stochastic rounding without a master \
             is implemented for bfloat16 params only)",
        )),
        (TensorMut::F32(_), Some(_)) => Err(invalid(
            "master weights are for bfloat16 or float16 params; a float32 param is its own master",
        )),
    }
}

pub(super) fn state_mode<'a>(what: &str, state: TensorMut<'a>, n: usize) -> Result<StateMode<'a>> {
    check_len(what, state.len(), n)?;
    match state {
        TensorMut::F32(s) => Ok(StateMode::F32(s)),
        TensorMut::BF16(s) => Ok(StateMode::Bf16(s)),
        TensorMut::F16(_) => Err(invalid(format!(
            "{what}: float16 optimizer states are not supported (they underflow); use float32 or \
             bfloat16"
        ))),
    }
}

pub(super) fn check_grad(grad: &Tensor<'_>, n: usize) -> Result<()> {
    check_len("grad", grad.len(), n)
}

pub(super) fn check_finite(what: &str, x: f64) -> Result<()> {
    if !x.is_finite() {
        return Err(invalid(format!("{what} must be finite, got {x}")));
    }
    Ok(())
}

pub(super) fn check_nonneg(what: &str, x: f64) -> Result<()> {
    if !(x >= 0.0 && x.is_finite()) {
        return Err(invalid(format!("{what} must be finite and >= 0, got {x}")));
    }
    Ok(())
}

pub(super) fn check_beta(what: &str, x: f64, closed: bool) -> Result<()> {
    let ok = x >= 0.0 && (x < 1.0 || (closed && x == 1.0));
    if !ok {
        let range = if closed { "[0, 1]" } else { "[0, 1)" };
        return Err(invalid(format!("{what} must be in {range}, got {x}")));
    }
    Ok(())
}

/// Read/write access to the parameter of element `i` (indices below `len()`).
pub(super) trait ParamIo: Split {
    /// Whether `set` uses random bits.
    const SR: bool;
    fn len(&self) -> usize;
    fn get(&self, i: usize) -> f32;
    fn set(&mut self, i: usize, x: f32, r: u32);
    /// Copies `old` (the values the update reads: the parameter, or its master) over this piece.
    fn fill(&mut self, old: Tensor<'_>);
}

/// Read access to the gradient of element `i`.
pub(super) trait GradIo: Split + Copy + Sync {
    fn len(&self) -> usize;
    fn get(&self, i: usize) -> f32;
}

/// Read/write access to an optimizer state of element `i`; [`NoState`] when absent.
pub(super) trait StateIo: Split {
    /// Whether `set` uses random bits.
    const SR: bool;
    /// Whether the state has `n` elements (always true when absent).
    fn fits(&self, n: usize) -> bool;
    fn get(&self, i: usize) -> f32;
    fn set(&mut self, i: usize, x: f32, r: u32);
    /// Copies `old` over this piece of the state.
    fn fill(&mut self, old: Tensor<'_>);
}

/// A `f32` parameter, updated in place.
pub(super) struct PF32<'a>(&'a mut [f32]);
/// A `bf16` parameter, written back with stochastic rounding.
pub(super) struct PBf16Sr<'a>(&'a mut [bf16]);
/// `f32` master weights and their `bf16` compute copy (round to nearest even).
pub(super) struct PMasterBf16<'a>(&'a mut [f32], &'a mut [bf16]);
/// `f32` master weights and their `f16` compute copy (round to nearest even).
pub(super) struct PMasterF16<'a>(&'a mut [f32], &'a mut [f16]);
/// A state that the optimizer does not have.
pub(super) struct NoState;

impl ParamIo for PF32<'_> {
    const SR: bool = false;
    #[inline(always)]
    fn len(&self) -> usize {
        self.0.len()
    }
    #[inline(always)]
    fn get(&self, i: usize) -> f32 {
        self.0[i]
    }
    #[inline(always)]
    fn set(&mut self, i: usize, x: f32, _: u32) {
        self.0[i] = x;
    }
    #[inline]
    fn fill(&mut self, old: Tensor<'_>) {
        fill_f32(self.0, old);
    }
}

impl ParamIo for PBf16Sr<'_> {
    const SR: bool = true;
    #[inline(always)]
    fn len(&self) -> usize {
        self.0.len()
    }
    #[inline(always)]
    fn get(&self, i: usize) -> f32 {
        bf16_to_f32(self.0[i])
    }
    #[inline(always)]
    fn set(&mut self, i: usize, x: f32, r: u32) {
        self.0[i] = bf16_sr(x, r);
    }
    #[inline]
    fn fill(&mut self, old: Tensor<'_>) {
        fill_bf16(self.0, old);
    }
}

impl ParamIo for PMasterBf16<'_> {
    const SR: bool = false;
    #[inline(always)]
    fn len(&self) -> usize {
        self.0.len().min(self.1.len())
    }
    #[inline(always)]
    fn get(&self, i: usize) -> f32 {
        self.0[i]
    }
    #[inline(always)]
    fn set(&mut self, i: usize, x: f32, _: u32) {
        self.0[i] = x;
        self.1[i] = bf16_rne(x);
    }
    #[inline]
    fn fill(&mut self, old: Tensor<'_>) {
        fill_f32(self.0, old); // the compute copy is written, never read
    }
}

impl ParamIo for PMasterF16<'_> {
    const SR: bool = false;
    #[inline(always)]
    fn len(&self) -> usize {
        self.0.len().min(self.1.len())
    }
    #[inline(always)]
    fn get(&self, i: usize) -> f32 {
        self.0[i]
    }
    #[inline(always)]
    fn set(&mut self, i: usize, x: f32, _: u32) {
        self.0[i] = x;
        self.1[i] = f16_rne(x);
    }
    #[inline]
    fn fill(&mut self, old: Tensor<'_>) {
        fill_f32(self.0, old); // the compute copy is written, never read
    }
}

impl GradIo for &[f32] {
    #[inline(always)]
    fn len(&self) -> usize {
        <[f32]>::len(self)
    }
    #[inline(always)]
    fn get(&self, i: usize) -> f32 {
        self[i]
    }
}

impl GradIo for &[bf16] {
    #[inline(always)]
    fn len(&self) -> usize {
        <[bf16]>::len(self)
    }
    #[inline(always)]
    fn get(&self, i: usize) -> f32 {
        bf16_to_f32(self[i])
    }
}

impl GradIo for &[f16] {
    #[inline(always)]
    fn len(&self) -> usize {
        <[f16]>::len(self)
    }
    #[inline(always)]
    fn get(&self, i: usize) -> f32 {
        f16_to_f32(self[i])
    }
}

impl StateIo for &mut [f32] {
    const SR: bool = false;
    #[inline(always)]
    fn fits(&self, n: usize) -> bool {
        self.len() == n
    }
    #[inline(always)]
    fn get(&self, i: usize) -> f32 {
        self[i]
    }
    #[inline(always)]
    fn set(&mut self, i: usize, x: f32, _: u32) {
        self[i] = x;
    }
    #[inline]
    fn fill(&mut self, old: Tensor<'_>) {
        fill_f32(self, old);
    }
}

impl StateIo for &mut [bf16] {
    const SR: bool = true;
    #[inline(always)]
    fn fits(&self, n: usize) -> bool {
        self.len() == n
    }
    #[inline(always)]
    fn get(&self, i: usize) -> f32 {
        bf16_to_f32(self[i])
    }
    #[inline(always)]
    fn set(&mut self, i: usize, x: f32, r: u32) {
        self[i] = bf16_sr(x, r);
    }
    #[inline]
    fn fill(&mut self, old: Tensor<'_>) {
        fill_bf16(self, old);
    }
}

impl StateIo for NoState {
    const SR: bool = false;
    #[inline(always)]
    fn fits(&self, _: usize) -> bool {
        true
    }
    #[inline(always)]
    fn get(&self, _: usize) -> f32 {
        0.0
    }
    #[inline(always)]
    fn set(&mut self, _: usize, _: f32, _: u32) {}
    #[inline]
    fn fill(&mut self, _: Tensor<'_>) {}
}

/// Copies `old` over `dst` when both are `f32` of one length ([`sources`] checked that they are).
#[inline]
fn fill_f32(dst: &mut [f32], old: Tensor<'_>) {
    if let Tensor::F32(s) = old {
        if s.len() == dst.len() {
            dst.copy_from_slice(s);
        }
    }
}

/// Copies `old` over `dst` when both are `bf16` of one length.
#[inline]
fn fill_bf16(dst: &mut [bf16], old: Tensor<'_>) {
    if let Tensor::BF16(s) = old {
        if s.len() == dst.len() {
            dst.copy_from_slice(s);
        }
    }
}

/// The old values of an out-of-place step, checked against the operands they stand for: the
/// parameter's (or, with a master, the master's), the first and the second state's. Each piece
/// copies its part of them over its destination just before updating it, while it is in cache,
/// so an out-of-place step moves the bytes of an in-place one (read old, write new).
#[derive(Clone, Copy, Default)]
pub(super) struct Sources<'a>([Option<Tensor<'a>>; 3]);

impl Split for Sources<'_> {
    fn split_at(self, mid: usize) -> (Self, Self) {
        let mut a = [None; 3];
        let mut b = [None; 3];
        for (k, t) in self.0.into_iter().enumerate() {
            if let Some(t) = t {
                let (x, y) = t.split_at(mid);
                a[k] = Some(x);
                b[k] = Some(y);
            }
        }
        (Sources(a), Sources(b))
    }
}

/// Checks `old` against the step's operands (`param` and the states `a`, `b` when present) and
/// returns the sources of the pieces. With a master, the old parameter is not read (the compute
/// copy is rewritten from the master), so it must not be given; every other old value must have
/// its operand's dtype and length.
pub(super) fn sources<'a>(
    old: &Old<'a>,
    param: &ParamMode<'_>,
    a: Option<&StateMode<'_>>,
    b: Option<&StateMode<'_>>,
) -> Result<Sources<'a>> {
    fn check<'a>(
        what: &str,
        t: Option<Tensor<'a>>,
        dtype: Option<super::Dtype>,
        n: usize,
    ) -> Result<Option<Tensor<'a>>> {
        let Some(t) = t else { return Ok(None) };
        let Some(want) = dtype else {
            return Err(invalid(format!(
                "old {what} given, but the step has no {what}"
            )));
        };
        if t.dtype() != want {
            return Err(invalid(format!(
                "old {what} is {}, but {what} is {want}",
                t.dtype()
            )));
        }
        check_len(&format!("old {what}"), t.len(), n)?;
        Ok(Some(t))
    }
    use super::Dtype;
    let (n, read) = match param {
        ParamMode::F32(p) => (p.len(), Some(("param", Dtype::F32))),
        ParamMode::Bf16Sr(p) => (p.len(), Some(("param", Dtype::BF16))),
        ParamMode::MasterBf16(m, _) | ParamMode::MasterF16(m, _) => (m.len(), None),
    };
    let state_dtype = |s: Option<&StateMode<'_>>| {
        s.map(|s| match s {
            StateMode::F32(_) => Dtype::F32,
            StateMode::Bf16(_) => Dtype::BF16,
        })
    };
    let first = match read {
        Some((what, dtype)) => {
            if old.master.is_some() {
                return Err(invalid(
                    "old master given, but the step has no master weights",
                ));
            }
            check(what, old.param, Some(dtype), n)?
        }
        None => {
            if old.param.is_some() {
                return Err(invalid(
                    "old param given for a step with master weights: the param is rewritten from \
                     the master, give the old master instead",
                ));
            }
            check("master", old.master.map(Tensor::F32), Some(Dtype::F32), n)?
        }
    };
    Ok(Sources([
        first,
        check("state 1", old.states[0], state_dtype(a), n)?,
        check("state 2", old.states[1], state_dtype(b), n)?,
    ]))
}

impl Split for PF32<'_> {
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (a, b) = self.0.split_at_mut(mid);
        (PF32(a), PF32(b))
    }
}

impl Split for PBf16Sr<'_> {
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (a, b) = self.0.split_at_mut(mid);
        (PBf16Sr(a), PBf16Sr(b))
    }
}

impl Split for PMasterBf16<'_> {
    fn split_at(self, mid: usize) -> (Self, Self) {
        let ((m0, p0), (m1, p1)) = (self.0, self.1).split_at(mid);
        (PMasterBf16(m0, p0), PMasterBf16(m1, p1))
    }
}

impl Split for PMasterF16<'_> {
    fn split_at(self, mid: usize) -> (Self, Self) {
        let ((m0, p0), (m1, p1)) = (self.0, self.1).split_at(mid);
        (PMasterF16(m0, p0), PMasterF16(m1, p1))
    }
}

impl Split for NoState {
    fn split_at(self, _: usize) -> (Self, Self) {
        (NoState, NoState)
    }
}

/// The element-wise update of an optimizer, in `f32`: from `(param, grad, state1, state2)` to
/// the new `(param, state1, state2)` (absent states read as 0 and their results are dropped).
pub(super) trait Rule: Copy + Sync {
    fn elem(&self, p: f32, g: f32, a: f32, b: f32) -> (f32, f32, f32);
}

/// The update of one piece of a tensor: one fused loop that loads, updates and stores every
/// operand of an element, in whatever type each is stored.
pub(super) struct Step<R> {
    rule: R,
    stream: Stream,
}

impl<R: Rule, P: ParamIo, G: GradIo, A: StateIo, B: StateIo> Leaf<(((P, G), (A, B)), Sources<'_>)>
    for Step<R>
{
    type Out = ();

    #[inline(always)]
    fn run(
        &self,
        start: usize,
        (((mut p, g), (mut a, mut b)), old): (((P, G), (A, B)), Sources<'_>),
    ) {
        let n = g.len();
        // The lengths were validated before the split; stating them lets the compiler drop the
        // bounds checks in the loop.
        if p.len() != n || !a.fits(n) || !b.fits(n) {
            return;
        }
        // An out-of-place step: this piece's old values, copied in while they will be in cache.
        if let Some(t) = old.0[0] {
            p.fill(t);
        }
        if let Some(t) = old.0[1] {
            a.fill(t);
        }
        if let Some(t) = old.0[2] {
            b.fill(t);
        }
        // Random word 0 of an element rounds the param (bits 0..16) and the first state (bits
        // 16..32); word 1 rounds the second state. Pieces do not straddle a multiple of 2^32.
        let hi = start as u64 >> 32;
        let lo = start as u32;
        let (k0, k1) = self.stream.keys(0, hi);
        let (k2, k3) = self.stream.keys(1, hi);
        let rule = self.rule;
        for i in 0..n {
            let j = lo.wrapping_add(i as u32);
            let r0 = if P::SR || A::SR { hash32(j, k0, k1) } else { 0 };
            let r1 = if B::SR { hash32(j, k2, k3) } else { 0 };
            let (np, na, nb) = rule.elem(p.get(i), g.get(i), a.get(i), b.get(i));
            p.set(i, np, r0);
            a.set(i, na, r0 >> 16);
            b.set(i, nb, r1);
        }
    }

    fn join(_: (), _: ()) {}
}

/// The states of an optimizer, dispatched to their accessor types.
pub(super) trait States {
    fn run<R: Rule, P: ParamIo, G: GradIo>(self, step: &Step<R>, p: P, g: G, old: Sources<'_>);
}

pub(super) fn go<R: Rule, P: ParamIo, G: GradIo, A: StateIo, B: StateIo>(
    step: &Step<R>,
    p: P,
    g: G,
    a: A,
    b: B,
    old: Sources<'_>,
) {
    for_pieces(g.len(), (((p, g), (a, b)), old), step);
}

/// Two states (AdamW).
impl States for (StateMode<'_>, StateMode<'_>) {
    fn run<R: Rule, P: ParamIo, G: GradIo>(self, step: &Step<R>, p: P, g: G, old: Sources<'_>) {
        match self {
            (StateMode::F32(a), StateMode::F32(b)) => go(step, p, g, a, b, old),
            (StateMode::F32(a), StateMode::Bf16(b)) => go(step, p, g, a, b, old),
            (StateMode::Bf16(a), StateMode::F32(b)) => go(step, p, g, a, b, old),
            (StateMode::Bf16(a), StateMode::Bf16(b)) => go(step, p, g, a, b, old),
        }
    }
}

/// One state (Lion).
impl States for StateMode<'_> {
    fn run<R: Rule, P: ParamIo, G: GradIo>(self, step: &Step<R>, p: P, g: G, old: Sources<'_>) {
        match self {
            StateMode::F32(a) => go(step, p, g, a, NoState, old),
            StateMode::Bf16(a) => go(step, p, g, a, NoState, old),
        }
    }
}

/// One optional state (SGD's momentum buffer).
impl States for Option<StateMode<'_>> {
    fn run<R: Rule, P: ParamIo, G: GradIo>(self, step: &Step<R>, p: P, g: G, old: Sources<'_>) {
        match self {
            Some(s) => s.run(step, p, g, old),
            None => go(step, p, g, NoState, NoState, old),
        }
    }
}

pub(super) fn with_grad<R: Rule, P: ParamIo, S: States>(
    step: &Step<R>,
    p: P,
    grad: Tensor<'_>,
    states: S,
    old: Sources<'_>,
) {
    match grad {
        Tensor::F32(g) => states.run(step, p, g, old),
        Tensor::BF16(g) => states.run(step, p, g, old),
        Tensor::F16(g) => states.run(step, p, g, old),
    }
}

pub(super) fn run_step<R: Rule, S: States>(
    rule: R,
    stream: Stream,
    param: ParamMode<'_>,
    grad: Tensor<'_>,
    states: S,
    old: Sources<'_>,
) {
    let step = &Step { rule, stream };
    match param {
        ParamMode::F32(p) => with_grad(step, PF32(p), grad, states, old),
        ParamMode::Bf16Sr(p) => with_grad(step, PBf16Sr(p), grad, states, old),
        ParamMode::MasterBf16(m, p) => with_grad(step, PMasterBf16(m, p), grad, states, old),
        ParamMode::MasterF16(m, p) => with_grad(step, PMasterF16(m, p), grad, states, old),
    }
}
