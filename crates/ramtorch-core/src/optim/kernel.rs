//! The machinery every update rule shares: splitting tensors into pieces for the rayon pool, the
//! instruction-set dispatch, the storage formats (how a parameter, a gradient and a state are
//! decoded to `f32` and encoded back, one quantization block at a time) and the driver that runs a
//! [`Rule`]: every rule and every storage format goes through [`run_step`], which takes a fused
//! per-element loop when no state is block-quantized, a loop per block that decodes, updates and
//! keeps the moments for their encoding in one pass ([`FusedQ8`]) for AdamW's two 8-bit moments,
//! and the block-wise loops otherwise.

use super::precision::*;
use super::quant::{self, BLOCK};
use super::{
    bf16, f16, invalid, Grad, Old, ParamMut, State, StateMut, Tensor, TensorMut, ALIGN, SERIAL_MAX,
};
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

#[cfg(test)]
thread_local! {
    /// Tests send block-quantized updates of an element-wise parameter through [`Step`] instead of
    /// [`FusedQ8`] with this (on the calling thread only), to compare their bits.
    pub(super) static FORCE_BLOCK_STEP: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

pub(super) fn isa() -> Isa {
    let best = best_isa();
    #[cfg(test)]
    if let Some(forced) = FORCE_ISA.with(|f| f.get()) {
        return forced.min(best);
    }
    best
}

/// The environment variable that caps the instruction set of the optimizer kernels (read once).
pub(super) const ISA_VAR: &str = "RAMTORCH_CPU_KERNELS";

/// The names of the instruction sets, lowest first (on every target: a cap above what the CPU
/// has changes nothing).
pub(super) const ISA_NAMES: [&str; 3] = ["base", "avx2", "avx512"];

/// The rank in [`ISA_NAMES`] that [`ISA_VAR`] caps the kernels at: `Ok(None)` when it is unset
/// or empty, `Err` with the value when it names no instruction set.
pub(super) fn isa_cap() -> std::result::Result<Option<usize>, String> {
    match std::env::var(ISA_VAR) {
        Ok(v) if !v.trim().is_empty() => {
            let name = v.trim().to_ascii_lowercase();
            match ISA_NAMES.iter().position(|n| *n == name) {
                Some(rank) => Ok(Some(rank)),
                None => Err(v),
            }
        }
        _ => Ok(None),
    }
}

/// The rank of `isa` in [`ISA_NAMES`].
pub(super) fn isa_rank(isa: Isa) -> usize {
    match isa {
        Isa::Base => 0,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => 1,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => 2,
    }
}

/// The best instruction set the CPU has, capped by [`ISA_VAR`] when it names one (a name it
/// does not know leaves the kernels uncapped; [`super::kernel_isa`] reports it as an error).
pub(super) fn best_isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        let found = detect_isa();
        match isa_cap() {
            Ok(Some(cap)) if cap < isa_rank(found) => lower_isa(found, cap),
            _ => found,
        }
    })
}

/// The highest instruction set at or below `found` whose rank is at most `cap`.
fn lower_isa(found: Isa, cap: usize) -> Isa {
    let mut isa = found;
    while isa_rank(isa) > cap {
        isa = match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => Isa::Avx2,
            _ => Isa::Base,
        };
    }
    isa
}

fn detect_isa() -> Isa {
    {
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
    }
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
// Optimizer storage: validated modes, then one codec type per way of storing an operand (decode a
// block to `f32`, encode it back), so that every combination compiles to its own loops.

// Pieces start at multiples of `ALIGN` (or of 2^32): whole quantization blocks.
const _: () = assert!(ALIGN.is_multiple_of(BLOCK));

/// How a parameter is stored (validated form of a [`ParamMut`]).
pub(super) enum ParamMode<'a> {
    F32(&'a mut [f32]),
    Bf16Sr(&'a mut [bf16]),
    MasterBf16(&'a mut [f32], &'a mut [bf16]),
    MasterF16(&'a mut [f32], &'a mut [f16]),
    /// The `bf16` weight and its `bf16` compensation.
    Compensated(&'a mut [bf16], &'a mut [bf16]),
}

impl ParamMode<'_> {
    pub(super) fn len(&self) -> usize {
        match self {
            ParamMode::F32(p) => p.len(),
            ParamMode::Bf16Sr(p) | ParamMode::Compensated(p, _) => p.len(),
            ParamMode::MasterBf16(m, _) | ParamMode::MasterF16(m, _) => m.len(),
        }
    }
}

/// How an optimizer state is stored.
pub(super) enum StateMode<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [bf16]),
    /// Block-quantized: codes, one scale per block, and whether the map is signed.
    Q8(&'a mut [u8], &'a mut [f32], bool),
}

pub(super) fn check_len(what: &str, len: usize, expected: usize) -> Result<()> {
    if len != expected {
        return Err(invalid(format!(
            "{what} has {len} elements but param has {expected}"
        )));
    }
    Ok(())
}

pub(super) fn param_mode(param: ParamMut<'_>) -> Result<ParamMode<'_>> {
    match param {
        ParamMut::Plain(TensorMut::F32(p)) => Ok(ParamMode::F32(p)),
        ParamMut::Plain(TensorMut::BF16(p)) => Ok(ParamMode::Bf16Sr(p)),
        ParamMut::Plain(TensorMut::F16(_)) => Err(invalid(
            "a float16 param needs float32 master weights (stochastic rounding without a master \
             is implemented for bfloat16 params only)",
        )),
        ParamMut::Master { param, master } => {
            check_len("master", master.len(), param.len())?;
            match param {
                TensorMut::BF16(p) => Ok(ParamMode::MasterBf16(master, p)),
                TensorMut::F16(p) => Ok(ParamMode::MasterF16(master, p)),
                TensorMut::F32(_) => Err(invalid(
                    "master weights are for bfloat16 or float16 params; a float32 param is its \
                     own master",
                )),
            }
        }
        ParamMut::Compensated { param, comp } => {
            check_len("compensation", comp.len(), param.len())?;
            Ok(ParamMode::Compensated(param, comp))
        }
    }
}

/// Validates a state of `n` elements; `signed` picks the map of a quantized one (a state that can
/// be negative needs the signed map).
pub(super) fn state_mode<'a>(
    what: &str,
    state: StateMut<'a>,
    n: usize,
    signed: bool,
) -> Result<StateMode<'a>> {
    match state {
        StateMut::Plain(t) => {
            check_len(what, t.len(), n)?;
            match t {
                TensorMut::F32(s) => Ok(StateMode::F32(s)),
                TensorMut::BF16(s) => Ok(StateMode::Bf16(s)),
                TensorMut::F16(_) => Err(invalid(format!(
                    "{what}: float16 optimizer states are not supported (they underflow); use \
                     float32 or bfloat16"
                ))),
            }
        }
        StateMut::Q8 { codes, scales } => {
            check_len(&format!("{what} codes"), codes.len(), n)?;
            check_scales(what, scales.len(), n)?;
            Ok(StateMode::Q8(codes, scales, signed))
        }
    }
}

fn check_scales(what: &str, len: usize, n: usize) -> Result<()> {
    if len != quant::blocks(n) {
        return Err(invalid(format!(
            "{what} scales have {len} elements, but a param of {n} elements has {} blocks of {BLOCK}",
            quant::blocks(n)
        )));
    }
    Ok(())
}

/// A gradient of a piece (validated form of a [`Grad`]): one tensor, or two whose sum it is.
#[derive(Clone, Copy)]
pub(super) enum GradMode<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
    SumF32(&'a [f32], &'a [f32]),
    SumBf16(&'a [bf16], &'a [bf16]),
    SumF16(&'a [f16], &'a [f16]),
}

pub(super) fn check_grad<'a>(grad: Grad<'a>, n: usize) -> Result<GradMode<'a>> {
    let one = |t: Tensor<'a>| match t {
        Tensor::F32(g) => GradMode::F32(g),
        Tensor::BF16(g) => GradMode::Bf16(g),
        Tensor::F16(g) => GradMode::F16(g),
    };
    match grad {
        Grad::One(t) => {
            check_len("grad", t.len(), n)?;
            Ok(one(t))
        }
        Grad::Sum(a, b) => {
            check_len("grad", a.len(), n)?;
            check_len("grad's second part", b.len(), n)?;
            match (a, b) {
                (Tensor::F32(a), Tensor::F32(b)) => Ok(GradMode::SumF32(a, b)),
                (Tensor::BF16(a), Tensor::BF16(b)) => Ok(GradMode::SumBf16(a, b)),
                (Tensor::F16(a), Tensor::F16(b)) => Ok(GradMode::SumF16(a, b)),
                _ => Err(invalid(format!(
                    "the two parts of a gradient must have one dtype; got {:?} and {:?}",
                    a.dtype(),
                    b.dtype()
                ))),
            }
        }
    }
}

/// A piece of `n` elements starting at element `offset` of a tensor: its random words have the
/// keys of one multiple of 2^32 elements (the parallel driver keeps each piece within one).
pub(super) fn check_offset(offset: u64, n: usize) -> Result<()> {
    let end = offset.checked_add(n as u64);
    match end {
        Some(end) if n == 0 || offset >> 32 == (end - 1) >> 32 => Ok(()),
        _ => Err(invalid(format!(
            "index_offset {offset} with {n} elements crosses a multiple of 2^32 elements; \
             cut pieces at such multiples"
        ))),
    }
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

/// The parameter of a piece, decoded and encoded one block at a time: `at` is the index of the
/// block's first element in the piece (a multiple of [`BLOCK`]), the slices are the block's length.
pub(super) trait ParamIo: Split {
    /// Whether `store` uses random bits.
    const SR: bool;
    fn len(&self) -> usize;
    fn load(&self, at: usize, out: &mut [f32]);
    fn store(&mut self, at: usize, x: &[f32], r: &[u32]);
    /// Copies the old values the update reads (the parameter or its master; the compensation)
    /// over this piece.
    fn fill(&mut self, old: Option<Tensor<'_>>, comp: Option<&[bf16]>);
    /// Asks the CPU to start bringing the block at `at` into cache (a hint, no effect on
    /// results); `at` may be past the end.
    #[inline(always)]
    fn prefetch(&self, _at: usize) {}
}

/// A parameter format read and written element by element: the fused loops of [`Fused`] and
/// [`FusedQ8`] read and write it through these.
pub(super) trait ElemParam: ParamIo {
    fn get(&self, i: usize) -> f32;
    fn set(&mut self, i: usize, x: f32, r: u32);
}

/// The gradient of a piece, decoded one block at a time (or read one element at a time by
/// [`Fused`]).
pub(super) trait GradIo: Split + Copy + Sync {
    fn len(&self) -> usize;
    fn load(&self, at: usize, out: &mut [f32]);
    fn get(&self, i: usize) -> f32;
    /// As [`ParamIo::prefetch`].
    #[inline(always)]
    fn prefetch(&self, _at: usize) {}
}

/// An optimizer state of a piece, decoded and encoded one block at a time; [`NoState`] when
/// absent (it decodes to zeros).
pub(super) trait StateIo: Split {
    /// Whether `store` uses random bits.
    const SR: bool;
    /// Whether `store` reads only the low 16 bits of each random word: as the second state, it
    /// then takes word 0's bits 16..32 where the first state rounds to nearest (one hash an
    /// element fewer), else word 1.
    const SR16: bool = false;
    /// Whether the state has `n` elements (always true when absent).
    fn fits(&self, n: usize) -> bool;
    fn load(&self, at: usize, out: &mut [f32]);
    fn store(&mut self, at: usize, x: &[f32], r: &[u32]);
    /// Copies `old` over this piece of the state.
    fn fill(&mut self, old: State<'_>);
    /// As [`ParamIo::prefetch`].
    #[inline(always)]
    fn prefetch(&self, _at: usize) {}
}

/// A state format stored element by element (every one but the block-quantized one): the fused
/// per-element loop of [`Fused`] reads and writes it through these.
pub(super) trait ElemState: StateIo {
    fn get(&self, i: usize) -> f32;
    fn set(&mut self, i: usize, x: f32, r: u32);
}

/// A `f32` parameter, updated in place.
pub(super) struct PF32<'a>(&'a mut [f32]);
/// A `bf16` parameter, written back with stochastic rounding.
pub(super) struct PBf16Sr<'a>(&'a mut [bf16]);
/// `f32` master weights and their `bf16` compute copy (round to nearest even).
pub(super) struct PMasterBf16<'a>(&'a mut [f32], &'a mut [bf16]);
/// `f32` master weights and their `f16` compute copy (round to nearest even).
pub(super) struct PMasterF16<'a>(&'a mut [f32], &'a mut [f16]);
/// A `bf16` weight and a `bf16` compensation: the master is their sum (about 16 significant bits);
/// written as the weight rounded to nearest even and its rounding error rounded stochastically
/// (so that what the pair cannot hold is dropped without bias, step after step).
pub(super) struct PComp<'a>(&'a mut [bf16], &'a mut [bf16]);
/// A block-quantized state (codes, one scale per block) with the signed or the unsigned map.
pub(super) struct Q8<'a, const SIGNED: bool>(&'a mut [u8], &'a mut [f32]);
/// A state that the optimizer does not have.
pub(super) struct NoState;

/// Hints the CPU to bring the elements `at..at + BLOCK` of `src` (those that exist) into cache.
#[inline(always)]
fn prefetch_block<T>(src: &[T], at: usize) {
    #[cfg(target_arch = "x86_64")]
    if at < src.len() {
        let bytes = (src.len() - at).min(BLOCK) * std::mem::size_of::<T>();
        let p = src[at..].as_ptr().cast::<i8>();
        let mut off = 0;
        while off < bytes {
            // SAFETY: `off < bytes`, within `src[at..]`; a prefetch reads nothing architecturally.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.add(off))
            };
            off += 64;
        }
    }
}

/// `out[i] = f(src[at + i])` over the block.
#[inline(always)]
fn load_with<T: Copy>(src: &[T], at: usize, out: &mut [f32], f: impl Fn(T) -> f32) {
    let n = out.len();
    for (o, &v) in out.iter_mut().zip(&src[at..at + n]) {
        *o = f(v);
    }
}

/// `dst[at + i] = f(x[i], r[i])` over the block.
#[inline(always)]
fn store_with<T>(dst: &mut [T], at: usize, x: &[f32], r: &[u32], f: impl Fn(f32, u32) -> T) {
    let n = x.len();
    for ((d, &v), &r) in dst[at..at + n].iter_mut().zip(x).zip(&r[..n]) {
        *d = f(v, r);
    }
}

impl ParamIo for PF32<'_> {
    const SR: bool = false;
    #[inline(always)]
    fn len(&self) -> usize {
        self.0.len()
    }
    #[inline(always)]
    fn load(&self, at: usize, out: &mut [f32]) {
        out.copy_from_slice(&self.0[at..at + out.len()]);
    }
    #[inline(always)]
    fn store(&mut self, at: usize, x: &[f32], _: &[u32]) {
        self.0[at..at + x.len()].copy_from_slice(x);
    }
    #[inline]
    fn fill(&mut self, old: Option<Tensor<'_>>, _: Option<&[bf16]>) {
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
    fn load(&self, at: usize, out: &mut [f32]) {
        load_with(self.0, at, out, bf16_to_f32);
    }
    #[inline(always)]
    fn store(&mut self, at: usize, x: &[f32], r: &[u32]) {
        store_with(self.0, at, x, r, bf16_sr);
    }
    #[inline]
    fn fill(&mut self, old: Option<Tensor<'_>>, _: Option<&[bf16]>) {
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
    fn load(&self, at: usize, out: &mut [f32]) {
        out.copy_from_slice(&self.0[at..at + out.len()]);
    }
    #[inline(always)]
    fn store(&mut self, at: usize, x: &[f32], _: &[u32]) {
        self.0[at..at + x.len()].copy_from_slice(x);
        let n = x.len();
        for (d, &v) in self.1[at..at + n].iter_mut().zip(x) {
            *d = bf16_rne(v);
        }
    }
    #[inline]
    fn fill(&mut self, old: Option<Tensor<'_>>, _: Option<&[bf16]>) {
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
    fn load(&self, at: usize, out: &mut [f32]) {
        out.copy_from_slice(&self.0[at..at + out.len()]);
    }
    #[inline(always)]
    fn store(&mut self, at: usize, x: &[f32], _: &[u32]) {
        self.0[at..at + x.len()].copy_from_slice(x);
        let n = x.len();
        for (d, &v) in self.1[at..at + n].iter_mut().zip(x) {
            *d = f16_rne(v);
        }
    }
    #[inline]
    fn fill(&mut self, old: Option<Tensor<'_>>, _: Option<&[bf16]>) {
        fill_f32(self.0, old); // the compute copy is written, never read
    }
}

impl ParamIo for PComp<'_> {
    const SR: bool = true;
    #[inline(always)]
    fn len(&self) -> usize {
        self.0.len().min(self.1.len())
    }
    #[inline(always)]
    fn load(&self, at: usize, out: &mut [f32]) {
        let n = out.len();
        for ((o, &w), &c) in out
            .iter_mut()
            .zip(&self.0[at..at + n])
            .zip(&self.1[at..at + n])
        {
            *o = bf16_to_f32(w) + bf16_to_f32(c);
        }
    }
    #[inline(always)]
    fn store(&mut self, at: usize, x: &[f32], r: &[u32]) {
        let n = x.len();
        let (w, c) = (&mut self.0[at..at + n], &mut self.1[at..at + n]);
        for (((w, c), &v), &r) in w.iter_mut().zip(c.iter_mut()).zip(x).zip(&r[..n]) {
            (*w, *c) = comp_split(v, r);
        }
    }
    #[inline(always)]
    fn prefetch(&self, at: usize) {
        prefetch_block(self.0, at);
        prefetch_block(self.1, at);
    }
    #[inline]
    fn fill(&mut self, old: Option<Tensor<'_>>, comp: Option<&[bf16]>) {
        fill_bf16(self.0, old);
        if let Some(c) = comp {
            if c.len() == self.1.len() {
                self.1.copy_from_slice(c);
            }
        }
    }
}

impl GradIo for &[f32] {
    #[inline(always)]
    fn len(&self) -> usize {
        <[f32]>::len(self)
    }
    #[inline(always)]
    fn prefetch(&self, at: usize) {
        prefetch_block(self, at);
    }
    #[inline(always)]
    fn load(&self, at: usize, out: &mut [f32]) {
        out.copy_from_slice(&self[at..at + out.len()]);
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
    fn prefetch(&self, at: usize) {
        prefetch_block(self, at);
    }
    #[inline(always)]
    fn load(&self, at: usize, out: &mut [f32]) {
        load_with(self, at, out, bf16_to_f32);
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
    fn prefetch(&self, at: usize) {
        prefetch_block(self, at);
    }
    #[inline(always)]
    fn load(&self, at: usize, out: &mut [f32]) {
        load_with(self, at, out, f16_to_f32);
    }
    #[inline(always)]
    fn get(&self, i: usize) -> f32 {
        f16_to_f32(self[i])
    }
}

/// `out[i] = f(a[at + i], b[at + i])` over the block.
#[inline(always)]
fn load_sum_with<T: Copy>(a: &[T], b: &[T], at: usize, out: &mut [f32], f: impl Fn(T, T) -> f32) {
    let n = out.len();
    for ((o, &x), &y) in out.iter_mut().zip(&a[at..at + n]).zip(&b[at..at + n]) {
        *o = f(x, y);
    }
}

/// A gradient in two parts of one dtype: their sum as `add_in_place` stores it (`f32`; `bf16`
/// and `f16` rounded to nearest even), then decoded.
macro_rules! two_part_grad {
    ($t:ty, $sum:expr) => {
        impl GradIo for (&[$t], &[$t]) {
            #[inline(always)]
            fn len(&self) -> usize {
                self.0.len()
            }
            #[inline(always)]
            fn prefetch(&self, at: usize) {
                prefetch_block(self.0, at);
                prefetch_block(self.1, at);
            }
            #[inline(always)]
            fn load(&self, at: usize, out: &mut [f32]) {
                load_sum_with(self.0, self.1, at, out, $sum);
            }
            #[inline(always)]
            fn get(&self, i: usize) -> f32 {
                ($sum)(self.0[i], self.1[i])
            }
        }
    };
}

two_part_grad!(f32, |x: f32, y: f32| x + y);
two_part_grad!(bf16, |x: bf16, y: bf16| bf16_to_f32(add_bf16(x, y)));
two_part_grad!(f16, |x: f16, y: f16| f16_to_f32(add_f16(x, y)));

impl StateIo for &mut [f32] {
    const SR: bool = false;
    #[inline(always)]
    fn fits(&self, n: usize) -> bool {
        self.len() == n
    }
    #[inline(always)]
    fn load(&self, at: usize, out: &mut [f32]) {
        out.copy_from_slice(&self[at..at + out.len()]);
    }
    #[inline(always)]
    fn store(&mut self, at: usize, x: &[f32], _: &[u32]) {
        self[at..at + x.len()].copy_from_slice(x);
    }
    #[inline]
    fn fill(&mut self, old: State<'_>) {
        if let State::Plain(t) = old {
            fill_f32(self, Some(t));
        }
    }
}

impl StateIo for &mut [bf16] {
    const SR: bool = true;
    #[inline(always)]
    fn fits(&self, n: usize) -> bool {
        self.len() == n
    }
    #[inline(always)]
    fn load(&self, at: usize, out: &mut [f32]) {
        load_with(self, at, out, bf16_to_f32);
    }
    #[inline(always)]
    fn store(&mut self, at: usize, x: &[f32], r: &[u32]) {
        store_with(self, at, x, r, bf16_sr);
    }
    #[inline]
    fn fill(&mut self, old: State<'_>) {
        if let State::Plain(t) = old {
            fill_bf16(self, Some(t));
        }
    }
}

impl<const SIGNED: bool> StateIo for Q8<'_, SIGNED> {
    /// An unsigned state (AdamW's second moment, whose step-to-step change is far below a code's
    /// width) is rounded stochastically, a signed one to nearest (see [`quant`]).
    const SR: bool = !SIGNED;
    const SR16: bool = true;
    #[inline(always)]
    fn fits(&self, n: usize) -> bool {
        self.0.len() == n && self.1.len() == quant::blocks(n)
    }
    #[inline(always)]
    fn load(&self, at: usize, out: &mut [f32]) {
        let codes = &self.0[at..at + out.len()];
        quant::decode_block::<SIGNED>(codes, self.1[at / BLOCK], out);
    }
    #[inline(always)]
    fn prefetch(&self, at: usize) {
        prefetch_block(self.0, at);
    }
    #[inline(always)]
    fn store(&mut self, at: usize, x: &[f32], r: &[u32]) {
        let codes = &mut self.0[at..at + x.len()];
        self.1[at / BLOCK] = if Self::SR {
            quant::encode_block::<SIGNED, true>(x, codes, r)
        } else {
            quant::encode_block::<SIGNED, false>(x, codes, r)
        };
    }
    #[inline]
    fn fill(&mut self, old: State<'_>) {
        if let State::Q8 { codes, scales } = old {
            if codes.len() == self.0.len() && scales.len() == self.1.len() {
                self.0.copy_from_slice(codes);
                self.1.copy_from_slice(scales);
            }
        }
    }
}

impl StateIo for NoState {
    const SR: bool = false;
    #[inline(always)]
    fn fits(&self, _: usize) -> bool {
        true
    }
    #[inline(always)]
    fn load(&self, _: usize, out: &mut [f32]) {
        out.fill(0.0);
    }
    #[inline(always)]
    fn store(&mut self, _: usize, _: &[f32], _: &[u32]) {}
    #[inline]
    fn fill(&mut self, _: State<'_>) {}
}

impl ElemParam for PComp<'_> {
    #[inline(always)]
    fn get(&self, i: usize) -> f32 {
        bf16_to_f32(self.0[i]) + bf16_to_f32(self.1[i])
    }
    #[inline(always)]
    fn set(&mut self, i: usize, x: f32, r: u32) {
        (self.0[i], self.1[i]) = comp_split(x, r);
    }
}

/// A compensated weight's two halves for the value `x`: `x` rounded to nearest even, and the
/// rounding error rounded stochastically by the low 16 bits of `r`.
#[inline(always)]
fn comp_split(x: f32, r: u32) -> (bf16, bf16) {
    let hi = bf16_rne(x);
    // `x - hi` is exact; a non-finite weight keeps no compensation.
    let lo = x - bf16_to_f32(hi);
    (hi, bf16_sr(if lo.is_finite() { lo } else { 0.0 }, r))
}

impl ElemParam for PF32<'_> {
    #[inline(always)]
    fn get(&self, i: usize) -> f32 {
        self.0[i]
    }
    #[inline(always)]
    fn set(&mut self, i: usize, x: f32, _: u32) {
        self.0[i] = x;
    }
}

impl ElemParam for PBf16Sr<'_> {
    #[inline(always)]
    fn get(&self, i: usize) -> f32 {
        bf16_to_f32(self.0[i])
    }
    #[inline(always)]
    fn set(&mut self, i: usize, x: f32, r: u32) {
        self.0[i] = bf16_sr(x, r);
    }
}

impl ElemParam for PMasterBf16<'_> {
    #[inline(always)]
    fn get(&self, i: usize) -> f32 {
        self.0[i]
    }
    #[inline(always)]
    fn set(&mut self, i: usize, x: f32, _: u32) {
        self.0[i] = x;
        self.1[i] = bf16_rne(x);
    }
}

impl ElemParam for PMasterF16<'_> {
    #[inline(always)]
    fn get(&self, i: usize) -> f32 {
        self.0[i]
    }
    #[inline(always)]
    fn set(&mut self, i: usize, x: f32, _: u32) {
        self.0[i] = x;
        self.1[i] = f16_rne(x);
    }
}

impl ElemState for &mut [f32] {
    #[inline(always)]
    fn get(&self, i: usize) -> f32 {
        self[i]
    }
    #[inline(always)]
    fn set(&mut self, i: usize, x: f32, _: u32) {
        self[i] = x;
    }
}

impl ElemState for &mut [bf16] {
    #[inline(always)]
    fn get(&self, i: usize) -> f32 {
        bf16_to_f32(self[i])
    }
    #[inline(always)]
    fn set(&mut self, i: usize, x: f32, r: u32) {
        self[i] = bf16_sr(x, r);
    }
}

impl ElemState for NoState {
    #[inline(always)]
    fn get(&self, _: usize) -> f32 {
        0.0
    }
    #[inline(always)]
    fn set(&mut self, _: usize, _: f32, _: u32) {}
}

/// Copies `old` over `dst` when both are `f32` of one length ([`sources`] checked that they are).
#[inline]
fn fill_f32(dst: &mut [f32], old: Option<Tensor<'_>>) {
    if let Some(Tensor::F32(s)) = old {
        if s.len() == dst.len() {
            dst.copy_from_slice(s);
        }
    }
}

/// Copies `old` over `dst` when both are `bf16` of one length.
#[inline]
fn fill_bf16(dst: &mut [bf16], old: Option<Tensor<'_>>) {
    if let Some(Tensor::BF16(s)) = old {
        if s.len() == dst.len() {
            dst.copy_from_slice(s);
        }
    }
}

impl Split for State<'_> {
    fn split_at(self, mid: usize) -> (Self, Self) {
        match self {
            State::Plain(t) => {
                let (a, b) = t.split_at(mid);
                (State::Plain(a), State::Plain(b))
            }
            State::Q8 { codes, scales } => {
                let (c0, c1) = codes.split_at(mid);
                let (s0, s1) = scales.split_at((mid / BLOCK).min(scales.len()));
                (
                    State::Q8 {
                        codes: c0,
                        scales: s0,
                    },
                    State::Q8 {
                        codes: c1,
                        scales: s1,
                    },
                )
            }
        }
    }
}

/// The old values of an out-of-place step, checked against the operands they stand for: the
/// parameter's (or, with a master, the master's), the compensation, the first and the second
/// state's. Each piece copies its part of them over its destination just before updating it,
/// while it is in cache, so an out-of-place step moves the bytes of an in-place one (read old,
/// write new).
#[derive(Clone, Copy, Default)]
pub(super) struct Sources<'a> {
    param: Option<Tensor<'a>>,
    comp: Option<&'a [bf16]>,
    states: [Option<State<'a>>; 2],
}

impl Sources<'_> {
    /// The start of every leaf: whether the piece's operands have its gradient's `n` elements
    /// (validated before the split; stating it lets the compiler drop the bounds checks in the
    /// leaf's loops), and if so the old values filled in ([`Sources::fill`]).
    #[inline(always)]
    fn prepare<P: ParamIo, A: StateIo, B: StateIo>(
        self,
        n: usize,
        p: &mut P,
        a: &mut A,
        b: &mut B,
    ) -> bool {
        if p.len() != n || !a.fits(n) || !b.fits(n) {
            return false;
        }
        self.fill(p, a, b);
        true
    }

    /// An out-of-place step: copies this piece's old values into its parameter and states before
    /// the update (while they will be in cache); nothing for an in-place one.
    #[inline(always)]
    fn fill<P: ParamIo, A: StateIo, B: StateIo>(self, p: &mut P, a: &mut A, b: &mut B) {
        if self.param.is_some() || self.comp.is_some() {
            p.fill(self.param, self.comp);
        }
        if let Some(s) = self.states[0] {
            a.fill(s);
        }
        if let Some(s) = self.states[1] {
            b.fill(s);
        }
    }
}

impl Split for Sources<'_> {
    fn split_at(self, mid: usize) -> (Self, Self) {
        fn two<T: Split + Copy>(x: Option<T>, mid: usize) -> (Option<T>, Option<T>) {
            match x {
                Some(t) => {
                    let (a, b) = t.split_at(mid);
                    (Some(a), Some(b))
                }
                None => (None, None),
            }
        }
        let (p0, p1) = two(self.param, mid);
        let (c0, c1) = two(self.comp, mid);
        let (a0, a1) = two(self.states[0], mid);
        let (b0, b1) = two(self.states[1], mid);
        (
            Sources {
                param: p0,
                comp: c0,
                states: [a0, b0],
            },
            Sources {
                param: p1,
                comp: c1,
                states: [a1, b1],
            },
        )
    }
}

/// Checks `old` against the step's operands (`param` and the states `a`, `b` when present) and
/// returns the sources of the pieces. With a master, the old parameter is not read (the compute
/// copy is rewritten from the master), so it must not be given; every other old value must have
/// its operand's format and length.
pub(super) fn sources<'a>(
    old: &Old<'a>,
    param: &ParamMode<'_>,
    a: Option<&StateMode<'_>>,
    b: Option<&StateMode<'_>>,
) -> Result<Sources<'a>> {
    use super::Dtype;
    fn check<'a>(
        what: &str,
        t: Option<Tensor<'a>>,
        dtype: Option<Dtype>,
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
    fn check_state<'a>(
        what: &str,
        s: Option<State<'a>>,
        mode: Option<&StateMode<'_>>,
        n: usize,
    ) -> Result<Option<State<'a>>> {
        let Some(s) = s else { return Ok(None) };
        let Some(mode) = mode else {
            return Err(invalid(format!(
                "old {what} given, but the step has no {what}"
            )));
        };
        let want = match mode {
            StateMode::F32(_) => Some(Dtype::F32),
            StateMode::Bf16(_) => Some(Dtype::BF16),
            StateMode::Q8(..) => None,
        };
        match (s, want) {
            (State::Plain(t), Some(_)) => Ok(check(what, Some(t), want, n)?.map(State::Plain)),
            (State::Q8 { codes, scales }, None) => {
                check_len(&format!("old {what} codes"), codes.len(), n)?;
                check_scales(&format!("old {what}"), scales.len(), n)?;
                Ok(Some(s))
            }
            (State::Plain(t), None) => Err(invalid(format!(
                "old {what} is {}, but {what} is block-quantized (codes and scales)",
                t.dtype()
            ))),
            (State::Q8 { .. }, Some(d)) => Err(invalid(format!(
                "old {what} is block-quantized, but {what} is {d}"
            ))),
        }
    }
    let n = param.len();
    let (read, comp) = match param {
        ParamMode::F32(_) => (Some(Dtype::F32), false),
        ParamMode::Bf16Sr(_) => (Some(Dtype::BF16), false),
        ParamMode::Compensated(..) => (Some(Dtype::BF16), true),
        ParamMode::MasterBf16(..) | ParamMode::MasterF16(..) => (None, false),
    };
    let first = match read {
        Some(dtype) => {
            if old.master.is_some() {
                return Err(invalid(
                    "old master given, but the step has no master weights",
                ));
            }
            check("param", old.param, Some(dtype), n)?
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
    let old_comp = match old.comp {
        Some(c) if comp => {
            check_len("old compensation", c.len(), n)?;
            Some(c)
        }
        Some(_) => {
            return Err(invalid(
                "old compensation given, but the param has no compensation",
            ))
        }
        None => None,
    };
    Ok(Sources {
        param: first,
        comp: old_comp,
        states: [
            check_state("state 1", old.states[0], a, n)?,
            check_state("state 2", old.states[1], b, n)?,
        ],
    })
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

impl Split for PComp<'_> {
    fn split_at(self, mid: usize) -> (Self, Self) {
        let ((w0, c0), (w1, c1)) = (self.0, self.1).split_at(mid);
        (PComp(w0, c0), PComp(w1, c1))
    }
}

impl<const SIGNED: bool> Split for Q8<'_, SIGNED> {
    /// `mid` is a multiple of [`BLOCK`] (pieces start at multiples of [`ALIGN`] or of 2^32).
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (c0, c1) = self.0.split_at_mut(mid);
        let (s0, s1) = self.1.split_at_mut((mid / BLOCK).min(self.1.len()));
        (Q8(c0, s0), Q8(c1, s1))
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

/// The update of one piece of a tensor, one quantization block at a time: decode every operand of
/// the block to `f32`, run the rule over the block, encode the results back. The piece starts at
/// a multiple of [`BLOCK`], so its blocks are the tensor's.
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
        if !old.prepare(n, &mut p, &mut a, &mut b) {
            return;
        }
        // Random word 0 of an element rounds the param (bits 0..16) and the first state (bits
        // 16..32); word 1 rounds the second state, or word 0's bits 16..32 do where the first
        // state rounds to nearest and the second reads 16 bits (`StateIo::SR16`: the compact
        // format's second moment). Pieces do not straddle a multiple of 2^32.
        let b_shares = B::SR && B::SR16 && !A::SR;
        let (lo, [k0, k1, k2, k3]) = self.stream.piece_keys(start);
        let rule = self.rule;
        let (mut xp, mut xg, mut xa, mut xb) =
            ([0f32; BLOCK], [0f32; BLOCK], [0f32; BLOCK], [0f32; BLOCK]);
        let (mut rp, mut ra, mut rb) = ([0u32; BLOCK], [0u32; BLOCK], [0u32; BLOCK]);
        let mut at = 0;
        while at < n {
            let len = BLOCK.min(n - at);
            let (xp, xg, xa, xb) = (
                &mut xp[..len],
                &mut xg[..len],
                &mut xa[..len],
                &mut xb[..len],
            );
            // Streams of the block two ahead, while this one computes.
            let ahead = at + 2 * BLOCK;
            p.prefetch(ahead);
            g.prefetch(ahead);
            a.prefetch(ahead);
            b.prefetch(ahead);
            p.load(at, xp);
            g.load(at, xg);
            a.load(at, xa);
            b.load(at, xb);
            let base = lo.wrapping_add(at as u32);
            if P::SR || A::SR || b_shares {
                for (i, rp) in rp[..len].iter_mut().enumerate() {
                    *rp = hash32(base.wrapping_add(i as u32), k0, k1);
                }
                if A::SR {
                    for (ra, &r) in ra[..len].iter_mut().zip(&rp[..len]) {
                        *ra = r >> 16;
                    }
                }
            }
            if b_shares {
                for (rb, &r) in rb[..len].iter_mut().zip(&rp[..len]) {
                    *rb = r >> 16;
                }
            } else if B::SR {
                for (i, rb) in rb[..len].iter_mut().enumerate() {
                    *rb = hash32(base.wrapping_add(i as u32), k2, k3);
                }
            }
            for (((p, &g), a), b) in xp
                .iter_mut()
                .zip(&*xg)
                .zip(xa.iter_mut())
                .zip(xb.iter_mut())
            {
                (*p, *a, *b) = rule.elem(*p, g, *a, *b);
            }
            p.store(at, xp, &rp[..len]);
            a.store(at, xa, &ra[..len]);
            b.store(at, xb, &rb[..len]);
            at += len;
        }
    }

    fn join(_: (), _: ()) {}
}

/// The update of one piece when no operand is a block format: one fused loop that loads, updates
/// and stores every operand of an element, in whatever type each is stored (no `f32` staging
/// arrays, one pass over memory). Same elements, same random words and same operations as
/// [`Step`], so the same bits.
pub(super) struct Fused<R>(Step<R>);

impl<R: Rule, P: ElemParam, G: GradIo, A: ElemState, B: ElemState>
    Leaf<(((P, G), (A, B)), Sources<'_>)> for Fused<R>
{
    type Out = ();

    #[inline(always)]
    fn run(
        &self,
        start: usize,
        (((mut p, g), (mut a, mut b)), old): (((P, G), (A, B)), Sources<'_>),
    ) {
        let n = g.len();
        if !old.prepare(n, &mut p, &mut a, &mut b) {
            return;
        }
        // The random words of `Step`: word 0 rounds the param (bits 0..16) and the first state
        // (bits 16..32), word 1 the second state.
        let (lo, [k0, k1, k2, k3]) = self.0.stream.piece_keys(start);
        let rule = self.0.rule;
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

/// The update of one piece whose states are AdamW's two block-quantized moments and whose
/// parameter is stored element by element: for each block, the weight and gradient are loaded,
/// then one loop decodes both moments, hashes the random words, runs the rule and keeps the new
/// moments (and their largest magnitudes) for the encodings that follow, after the weight's store.
/// Same elements, same random words and same operations as [`Step`], so the same bits, with six
/// loops over a block instead of a dozen.
pub(super) struct FusedQ8<R>(Step<R>);

impl<R: Rule, P: ElemParam, G: GradIo> Leaf<(((P, G), (Q8<'_, true>, Q8<'_, false>)), Sources<'_>)>
    for FusedQ8<R>
{
    type Out = ();

    #[inline(always)]
    fn run(
        &self,
        start: usize,
        (((mut p, g), (mut a, mut b)), old): (((P, G), (Q8<'_, true>, Q8<'_, false>)), Sources<'_>),
    ) {
        let n = g.len();
        if !old.prepare(n, &mut p, &mut a, &mut b) {
            return;
        }
        // The words of `Step` for these states: word 0 rounds the param (bits 0..16) and, the
        // first moment rounding to nearest, its bits 16..32 round the second moment.
        let (lo, [k0, k1, _, _]) = self.0.stream.piece_keys(start);
        let rule = self.0.rule;
        let (mut xp, mut xg, mut rp) = ([0f32; BLOCK], [0f32; BLOCK], [0u32; BLOCK]);
        let (mut xa, mut xb, mut rb) = ([0f32; BLOCK], [0f32; BLOCK], [0u32; BLOCK]);
        let mut at = 0;
        while at < n {
            let len = BLOCK.min(n - at);
            let ahead = at + 2 * BLOCK;
            p.prefetch(ahead);
            g.prefetch(ahead);
            a.prefetch(ahead);
            b.prefetch(ahead);
            let (xp, xg, rp) = (&mut xp[..len], &mut xg[..len], &mut rp[..len]);
            let (xa, xb, rb) = (&mut xa[..len], &mut xb[..len], &mut rb[..len]);
            p.load(at, xp);
            g.load(at, xg);
            let (sa, sb) = (a.1[at / BLOCK], b.1[at / BLOCK]);
            let (ca, cb) = (&a.0[at..at + len], &b.0[at..at + len]);
            let base = lo.wrapping_add(at as u32);
            let (mut amax_a, mut amax_b) = (0u32, 0u32);
            for i in 0..len {
                let r = hash32(base.wrapping_add(i as u32), k0, k1);
                let ma = quant::decode_one::<true>(ca[i], sa);
                let vb = quant::decode_one::<false>(cb[i], sb);
                let (np, na, nb) = rule.elem(xp[i], xg[i], ma, vb);
                xp[i] = np;
                xa[i] = na;
                xb[i] = nb;
                rp[i] = r;
                rb[i] = r >> 16;
                amax_a = amax_a.max(quant::magnitude_bits(na));
                amax_b = amax_b.max(quant::magnitude_bits(nb));
            }
            p.store(at, xp, rp);
            a.1[at / BLOCK] =
                quant::encode_block_with::<true, false>(xa, &mut a.0[at..at + len], &[], amax_a);
            b.1[at / BLOCK] =
                quant::encode_block_with::<false, true>(xb, &mut b.0[at..at + len], rb, amax_b);
            at += len;
        }
    }

    fn join(_: (), _: ()) {}
}

/// The states of an optimizer, dispatched to their codec types.
pub(super) trait States {
    /// Whether a state is block-quantized (then the step takes the block path).
    fn blocked(&self) -> bool;
    fn run<R: Rule, P: ParamIo, G: GradIo>(self, step: &Step<R>, p: P, g: G, old: Sources<'_>);
    /// The fused per-element path; only for states that are not [`blocked`](States::blocked)
    /// (does nothing for the others).
    fn run_fused<R: Rule, P: ElemParam, G: GradIo>(
        self,
        step: &Fused<R>,
        p: P,
        g: G,
        old: Sources<'_>,
    );
    /// The block path for a parameter stored element by element: [`FusedQ8`] where it applies,
    /// else [`run`](States::run).
    fn run_elem_blocked<R: Rule, P: ElemParam, G: GradIo>(
        self,
        step: &Step<R>,
        p: P,
        g: G,
        old: Sources<'_>,
    ) where
        Self: Sized,
    {
        self.run(step, p, g, old)
    }
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

pub(super) fn go_fused<R: Rule, P: ElemParam, G: GradIo, A: ElemState, B: ElemState>(
    step: &Fused<R>,
    p: P,
    g: G,
    a: A,
    b: B,
    old: Sources<'_>,
) {
    for_pieces(g.len(), (((p, g), (a, b)), old), step);
}

/// Two states (AdamW): each `f32` or `bf16`, or both block-quantized (the first with the signed
/// map, the second with the unsigned one; `adamw_update` refuses other mixes).
impl States for (StateMode<'_>, StateMode<'_>) {
    fn blocked(&self) -> bool {
        self.0.blocked() || self.1.blocked()
    }
    fn run<R: Rule, P: ParamIo, G: GradIo>(self, step: &Step<R>, p: P, g: G, old: Sources<'_>) {
        match self {
            (StateMode::F32(a), StateMode::F32(b)) => go(step, p, g, a, b, old),
            (StateMode::F32(a), StateMode::Bf16(b)) => go(step, p, g, a, b, old),
            (StateMode::Bf16(a), StateMode::F32(b)) => go(step, p, g, a, b, old),
            (StateMode::Bf16(a), StateMode::Bf16(b)) => go(step, p, g, a, b, old),
            (StateMode::Q8(c, s, _), StateMode::Q8(d, t, _)) => {
                go(step, p, g, Q8::<true>(c, s), Q8::<false>(d, t), old)
            }
            // Refused by validation: a quantized state beside an unquantized one.
            _ => {}
        }
    }
    fn run_fused<R: Rule, P: ElemParam, G: GradIo>(
        self,
        step: &Fused<R>,
        p: P,
        g: G,
        old: Sources<'_>,
    ) {
        match self {
            (StateMode::F32(a), StateMode::F32(b)) => go_fused(step, p, g, a, b, old),
            (StateMode::F32(a), StateMode::Bf16(b)) => go_fused(step, p, g, a, b, old),
            (StateMode::Bf16(a), StateMode::F32(b)) => go_fused(step, p, g, a, b, old),
            (StateMode::Bf16(a), StateMode::Bf16(b)) => go_fused(step, p, g, a, b, old),
            // Block-quantized: `run_step` sent them to the block path.
            _ => {}
        }
    }
    fn run_elem_blocked<R: Rule, P: ElemParam, G: GradIo>(
        self,
        step: &Step<R>,
        p: P,
        g: G,
        old: Sources<'_>,
    ) {
        #[cfg(test)]
        if FORCE_BLOCK_STEP.with(|f| f.get()) {
            return self.run(step, p, g, old);
        }
        match self {
            (StateMode::Q8(c, s, _), StateMode::Q8(d, t, _)) => {
                let fused = FusedQ8(Step {
                    rule: step.rule,
                    stream: step.stream,
                });
                let parts = (((p, g), (Q8::<true>(c, s), Q8::<false>(d, t))), old);
                for_pieces(g.len(), parts, &fused)
            }
            states => states.run(step, p, g, old),
        }
    }
}

/// One state (Lion).
impl States for StateMode<'_> {
    fn blocked(&self) -> bool {
        matches!(self, StateMode::Q8(..))
    }
    fn run<R: Rule, P: ParamIo, G: GradIo>(self, step: &Step<R>, p: P, g: G, old: Sources<'_>) {
        match self {
            StateMode::F32(a) => go(step, p, g, a, NoState, old),
            StateMode::Bf16(a) => go(step, p, g, a, NoState, old),
            StateMode::Q8(c, s, true) => go(step, p, g, Q8::<true>(c, s), NoState, old),
            // Lion and SGD validate their state with the signed map. An unsigned one here would
            // be rounded stochastically by the 16 bits of the first state's word, too few.
            StateMode::Q8(c, s, false) => go(step, p, g, Q8::<false>(c, s), NoState, old),
        }
    }
    fn run_fused<R: Rule, P: ElemParam, G: GradIo>(
        self,
        step: &Fused<R>,
        p: P,
        g: G,
        old: Sources<'_>,
    ) {
        match self {
            StateMode::F32(a) => go_fused(step, p, g, a, NoState, old),
            StateMode::Bf16(a) => go_fused(step, p, g, a, NoState, old),
            // Block-quantized: `run_step` sent it to the block path.
            StateMode::Q8(..) => {}
        }
    }
}

/// One optional state (SGD's momentum buffer).
impl States for Option<StateMode<'_>> {
    fn blocked(&self) -> bool {
        self.as_ref().is_some_and(States::blocked)
    }
    fn run<R: Rule, P: ParamIo, G: GradIo>(self, step: &Step<R>, p: P, g: G, old: Sources<'_>) {
        match self {
            Some(s) => s.run(step, p, g, old),
            None => go(step, p, g, NoState, NoState, old),
        }
    }
    fn run_fused<R: Rule, P: ElemParam, G: GradIo>(
        self,
        step: &Fused<R>,
        p: P,
        g: G,
        old: Sources<'_>,
    ) {
        match self {
            Some(s) => s.run_fused(step, p, g, old),
            None => go_fused(step, p, g, NoState, NoState, old),
        }
    }
}

/// `$body` with `$g` bound to the gradient's reader for each [`GradMode`]: its slice, or the
/// pair of slices added as they are read. One arm list for every driver method.
macro_rules! each_grad {
    ($grad:expr, $g:ident => $body:expr) => {
        match $grad {
            GradMode::F32($g) => $body,
            GradMode::Bf16($g) => $body,
            GradMode::F16($g) => $body,
            GradMode::SumF32(a, b) => {
                let $g = (a, b);
                $body
            }
            GradMode::SumBf16(a, b) => {
                let $g = (a, b);
                $body
            }
            GradMode::SumF16(a, b) => {
                let $g = (a, b);
                $body
            }
        }
    };
}

/// A parameter stored element by element: the fused per-element loop when no state is
/// block-quantized either, else the block path ([`FusedQ8`] where it applies).
fn elem_or_block<R: Rule, P: ElemParam, S: States>(
    step: Step<R>,
    p: P,
    grad: GradMode<'_>,
    states: S,
    old: Sources<'_>,
) {
    if states.blocked() {
        return each_grad!(grad, g => states.run_elem_blocked(&step, p, g, old));
    }
    let step = &Fused(step);
    each_grad!(grad, g => states.run_fused(step, p, g, old))
}

/// The one entry of every rule: `rule` over `param`, `grad` and up to two states, in place (or
/// reading the old values of `old`), piece by piece on the rayon pool. When no state is
/// block-quantized, each piece runs one fused loop over its elements ([`Fused`]); with AdamW's two
/// 8-bit moments, one loop per block and the block's encoding ([`FusedQ8`]); otherwise the loops of
/// [`Step`], block by block. All give the same bits.
pub(super) fn run_step<R: Rule, S: States>(
    rule: R,
    stream: Stream,
    param: ParamMode<'_>,
    grad: GradMode<'_>,
    states: S,
    old: Sources<'_>,
) {
    let step = Step { rule, stream };
    match param {
        ParamMode::F32(p) => elem_or_block(step, PF32(p), grad, states, old),
        ParamMode::Bf16Sr(p) => elem_or_block(step, PBf16Sr(p), grad, states, old),
        ParamMode::MasterBf16(m, p) => elem_or_block(step, PMasterBf16(m, p), grad, states, old),
        ParamMode::MasterF16(m, p) => elem_or_block(step, PMasterF16(m, p), grad, states, old),
        ParamMode::Compensated(w, c) => elem_or_block(step, PComp(w, c), grad, states, old),
    }
}
