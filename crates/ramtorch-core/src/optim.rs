//! CPU optimizer kernels over host memory: AdamW, SGD (momentum, Nesterov) and Lion, plus the
//! gradient statistics and scaling that global-norm clipping and loss scaling need.
//!
//! # Storage modes
//!
//! Every optimizer computes in `f32` and supports three ways of storing a parameter:
//!
//! - **float32**: `param` is `f32` and is updated in place;
//! - **fp32 master**: `master` (`f32`) is updated, and `param` (`bf16` or `f16`, the compute copy)
//!   is overwritten with `master` rounded to nearest even;
//! - **bfloat16 everywhere**: `param` is `bf16`, loaded to `f32`, updated and written back with
//!   stochastic rounding.
//!
//! Gradients may be `f32`, `bf16` or `f16` in every mode. Optimizer states are `f32` (stored
//! exactly) or `bf16` (written back with stochastic rounding); `f16` states are refused because
//! `exp_avg_sq` underflows in `f16`.
//!
//! # Stochastic rounding
//!
//! Rounding `x` to `bf16` adds 16 uniformly random bits below the `bf16` mantissa and truncates,
//! so `x` rounds away from zero with probability exactly equal to its distance from the lower
//! neighbour in ulps: `E[round(x)] = x`. The random bits come from a counter-based generator: a
//! keyed integer hash of the element index, with keys drawn by SplitMix64 from `(seed, step)`.
//! Element `i` of a call always gets the same bits whatever the chunking or the number of
//! threads, so results are bitwise reproducible. Callers should vary `seed` (or `step`) from one
//! call to the next, and between tensors.
//!
//! # Performance
//!
//! Each combination of storage types compiles to one fused loop (load, update, store every operand
//! of an element) that LLVM vectorises; on x86-64 the loops are also compiled for AVX2 and for
//! AVX-512, and the best the CPU has is chosen at run time (all paths give the same bits). Tensors
//! above [`SERIAL_MAX`] elements are split into pieces of [`SERIAL_MAX`] / 2 to [`SERIAL_MAX`]
//! elements that run on the rayon pool; smaller ones run on the calling thread.
//!
//! ```
//! use ramtorch_core::optim::{adamw_step, AdamW, Tensor, TensorMut};
//!
//! let mut p = vec![1.0f32; 4];
//! let g = vec![0.5f32; 4];
//! let (mut m, mut v) = (vec![0.0f32; 4], vec![0.0f32; 4]);
//! let h = AdamW { lr: 0.1, step: 1, ..AdamW::default() };
//! adamw_step(&h, TensorMut::F32(&mut p), None, Tensor::F32(&g),
//!            TensorMut::F32(&mut m), TensorMut::F32(&mut v)).unwrap();
//! assert!(p[0] < 1.0);
//! ```

use std::fmt;

/// The 16-bit float types of the views, re-exported from the `half` crate.
pub use half::{bf16, f16};

use crate::{Error, Result};

/// Tensors with at most this many elements are processed on the calling thread; larger ones are
/// split in halves (at multiples of 1024 elements) until every piece is at most this long, and the
/// pieces run on the rayon pool.
pub const SERIAL_MAX: usize = 1 << 15;

/// Pieces start at multiples of this many elements (whole cache lines, whole vectors).
const ALIGN: usize = 1024;

/// Size of the rayon pool the kernels run on.
pub fn threads() -> usize {
    rayon::current_num_threads()
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}

// ---------------------------------------------------------------------------------------------
// Element types and tensor views.

/// Element type of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// IEEE binary32.
    F32,
    /// bfloat16: the top half of a binary32.
    BF16,
    /// IEEE binary16.
    F16,
}

impl Dtype {
    /// Parses `"float32"`, `"bfloat16"` or `"float16"` (a `"torch."` prefix is accepted, so
    /// `str(tensor.dtype)` works).
    pub fn parse(name: &str) -> Result<Self> {
        match name.strip_prefix("torch.").unwrap_or(name) {
            "float32" => Ok(Dtype::F32),
            "bfloat16" => Ok(Dtype::BF16),
            "float16" => Ok(Dtype::F16),
            _ => Err(invalid(format!(
                "unknown dtype {name:?}; expected \"float32\", \"bfloat16\" or \"float16\""
            ))),
        }
    }

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::BF16 | Dtype::F16 => 2,
        }
    }

    /// The torch name of the type.
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "float32",
            Dtype::BF16 => "bfloat16",
            Dtype::F16 => "float16",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A read-only, typed view of a contiguous tensor.
#[derive(Clone, Copy, Debug)]
pub enum Tensor<'a> {
    /// `float32` elements.
    F32(&'a [f32]),
    /// `bfloat16` elements.
    BF16(&'a [bf16]),
    /// `float16` elements.
    F16(&'a [f16]),
}

impl Tensor<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Tensor::F32(s) => s.len(),
            Tensor::BF16(s) => s.len(),
            Tensor::F16(s) => s.len(),
        }
    }

    /// Whether the view has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element type.
    pub fn dtype(&self) -> Dtype {
        match self {
            Tensor::F32(_) => Dtype::F32,
            Tensor::BF16(_) => Dtype::BF16,
            Tensor::F16(_) => Dtype::F16,
        }
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        match self {
            Tensor::F32(s) => {
                let (a, b) = s.split_at(mid);
                (Tensor::F32(a), Tensor::F32(b))
            }
            Tensor::BF16(s) => {
                let (a, b) = s.split_at(mid);
                (Tensor::BF16(a), Tensor::BF16(b))
            }
            Tensor::F16(s) => {
                let (a, b) = s.split_at(mid);
                (Tensor::F16(a), Tensor::F16(b))
            }
        }
    }
}

/// A writable, typed view of a contiguous tensor.
#[derive(Debug)]
pub enum TensorMut<'a> {
    /// `float32` elements.
    F32(&'a mut [f32]),
    /// `bfloat16` elements.
    BF16(&'a mut [bf16]),
    /// `float16` elements.
    F16(&'a mut [f16]),
}

impl TensorMut<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            TensorMut::F32(s) => s.len(),
            TensorMut::BF16(s) => s.len(),
            TensorMut::F16(s) => s.len(),
        }
    }

    /// Whether the view has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element type.
    pub fn dtype(&self) -> Dtype {
        match self {
            TensorMut::F32(_) => Dtype::F32,
            TensorMut::BF16(_) => Dtype::BF16,
            TensorMut::F16(_) => Dtype::F16,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Conversions. Branch-free bit manipulation, so that the loops using them vectorise; checked
// against the `half` crate in the tests.

/// `bf16` to `f32` (exact).
#[inline(always)]
fn bf16_to_f32(h: bf16) -> f32 {
    f32::from_bits((h.to_bits() as u32) << 16)
}

/// `f32` to `bf16`, round to nearest even; NaN stays a (quiet) NaN.
#[inline(always)]
fn bf16_rne(x: f32) -> bf16 {
    let u = x.to_bits();
    let nan = (u & 0x7FFF_FFFF) > 0x7F80_0000;
    let rounded = u.wrapping_add(0x7FFF + ((u >> 16) & 1)) >> 16;
    let quiet = (u >> 16) | 0x0040;
    bf16::from_bits(if nan { quiet } else { rounded } as u16)
}

/// `f32` to `bf16`, stochastic rounding with the low 16 bits of `r` as the random fraction.
/// Finite values round to one of their two `bf16` neighbours (past the largest finite `bf16`,
/// possibly to infinity), with probabilities that make the rounding unbiased; infinities stay,
/// NaN stays a (quiet) NaN.
#[inline(always)]
fn bf16_sr(x: f32, r: u32) -> bf16 {
    let u = x.to_bits();
    let nan = (u & 0x7FFF_FFFF) > 0x7F80_0000;
    // Adding to the magnitude bits cannot carry into the sign: the largest non-NaN magnitude is
    // 0x7F80_0000 (infinity), and 0x7F80_0000 + 0xFFFF still truncates to infinity.
    let rounded = u.wrapping_add(r & 0xFFFF) >> 16;
    let quiet = (u >> 16) | 0x0040;
    bf16::from_bits(if nan { quiet } else { rounded } as u16)
}

/// `f16` to `f32` (exact), after F. Giesen's branch-free `half_to_float`.
#[inline(always)]
fn f16_to_f32(h: f16) -> f32 {
    let h = h.to_bits() as u32;
    const SHIFTED_EXP: u32 = 0x7C00 << 13;
    let o = (h & 0x7FFF) << 13;
    let exp = o & SHIFTED_EXP;
    let o = o + ((127 - 15) << 23);
    let inf_nan = o + ((128 - 16) << 23);
    let sub = (f32::from_bits(o + (1 << 23)) - f32::from_bits(113 << 23)).to_bits();
    let r = if exp == SHIFTED_EXP {
        inf_nan
    } else if exp == 0 {
        sub
    } else {
        o
    };
    f32::from_bits(r | ((h & 0x8000) << 16))
}

/// `f32` to `f16`, round to nearest even (overflow to infinity, NaN to a quiet NaN), after
/// F. Giesen's branch-free `float_to_half_fast3_rtne`.
#[inline(always)]
fn f16_rne(x: f32) -> f16 {
    let u = x.to_bits();
    let sign = (u >> 16) & 0x8000;
    let a = u & 0x7FFF_FFFF;
    let special = if a > 0x7F80_0000 { 0x7E00 } else { 0x7C00 };
    // |x| < 2^-14: align the 10 mantissa bits at the bottom of 0.5's mantissa; the float
    // addition rounds to nearest even.
    const MAGIC: u32 = 126 << 23;
    let sub = (f32::from_bits(a) + f32::from_bits(MAGIC))
        .to_bits()
        .wrapping_sub(MAGIC);
    let odd = (a >> 13) & 1;
    let norm = a.wrapping_sub(112 << 23).wrapping_add(0xFFF + odd) >> 13;
    let r = if a >= (127 + 16) << 23 {
        special
    } else if a < 113 << 23 {
        sub
    } else {
        norm
    };
    f16::from_bits((r | sign) as u16)
}

// ---------------------------------------------------------------------------------------------
// The counter-based random stream of stochastic rounding.

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The SplitMix64 finaliser (a bijection of `u64` with good avalanche).
#[inline(always)]
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A keyed variant of C. Wellons' `lowbias32` integer hash (a bijection of `u32` for fixed keys):
/// one multiply-xorshift round, the second key, another round. 32-bit multiplies keep it at eight
/// elements per AVX2 instruction.
#[inline(always)]
fn hash32(x: u32, k1: u32, k2: u32) -> u32 {
    let mut x = x ^ k1;
    x ^= x >> 16;
    x = x.wrapping_mul(0x21F0_AAAD);
    x ^= x >> 15;
    x ^= k2;
    x = x.wrapping_mul(0x735A_2D97);
    x ^ (x >> 15)
}

/// The random words of stochastic rounding for one call, keyed by `(seed, step)`. Word `lane` of
/// element `i` is `hash32(i mod 2^32)` under keys derived from the call's key, the lane and
/// `i / 2^32`: a pure function of the element index, so the rounding does not depend on how the
/// work is cut or on the number of threads.
#[derive(Clone, Copy, Debug)]
struct Stream {
    key: u64,
}

impl Stream {
    fn new(seed: u64, step: u64) -> Self {
        let k = mix64(seed ^ 0x6A09_E667_F3BC_C908);
        Stream {
            key: mix64(k ^ mix64(step.wrapping_add(0xBB67_AE85_84CA_A73B))),
        }
    }

    /// The hash keys of word `lane` for elements whose index divided by 2^32 is `hi`.
    #[inline(always)]
    fn keys(self, lane: u64, hi: u64) -> (u32, u32) {
        let k = mix64(self.key.wrapping_add((hi << 8 | lane).wrapping_mul(GOLDEN)));
        (k as u32, (k >> 32) as u32)
    }
}

// ---------------------------------------------------------------------------------------------
// Parallel driver: binary splitting, leaves compiled for several instruction sets.

/// Something that can be cut in two at an element index.
trait Split: Sized + Send {
    fn split_at(self, mid: usize) -> (Self, Self);
}

/// The work on one piece; `start` is the index of the piece's first element in the whole tensor.
trait Leaf<P>: Sync {
    type Out: Send;
    fn run(&self, start: usize, parts: P) -> Self::Out;
    fn join(a: Self::Out, b: Self::Out) -> Self::Out;
}

/// The instruction sets the leaves are compiled for; the best one the CPU has is used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Isa {
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
    static FORCE_ISA: std::cell::Cell<Option<Isa>> = const { std::cell::Cell::new(None) };
}

fn isa() -> Isa {
    let best = best_isa();
    #[cfg(test)]
    if let Some(forced) = FORCE_ISA.with(|f| f.get()) {
        return forced.min(best);
    }
    best
}

fn best_isa() -> Isa {
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
fn leaf_avx2<P, L: Leaf<P>>(leaf: &L, start: usize, parts: P) -> L::Out {
    leaf.run(start, parts)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c")]
fn leaf_avx512<P, L: Leaf<P>>(leaf: &L, start: usize, parts: P) -> L::Out {
    leaf.run(start, parts)
}

/// Runs one leaf with the code compiled for `want`, or for the best the CPU has if that is less.
/// The element code has no FMA contraction and only correctly rounded operations, so every path
/// gives the same bits.
fn leaf_on<P, L: Leaf<P>>(want: Isa, leaf: &L, start: usize, parts: P) -> L::Out {
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
fn for_pieces<P: Split, L: Leaf<P>>(len: usize, parts: P, leaf: &L) -> L::Out {
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
enum ParamMode<'a> {
    F32(&'a mut [f32]),
    Bf16Sr(&'a mut [bf16]),
    MasterBf16(&'a mut [f32], &'a mut [bf16]),
    MasterF16(&'a mut [f32], &'a mut [f16]),
}

/// How an optimizer state is stored.
enum StateMode<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [bf16]),
}

fn check_len(what: &str, len: usize, expected: usize) -> Result<()> {
    if len != expected {
        return Err(invalid(format!(
            "{what} has {len} elements but param has {expected}"
        )));
    }
    Ok(())
}

fn param_mode<'a>(param: TensorMut<'a>, master: Option<&'a mut [f32]>) -> Result<ParamMode<'a>> {
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

fn state_mode<'a>(what: &str, state: TensorMut<'a>, n: usize) -> Result<StateMode<'a>> {
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

fn check_grad(grad: &Tensor<'_>, n: usize) -> Result<()> {
    check_len("grad", grad.len(), n)
}

fn check_finite(what: &str, x: f64) -> Result<()> {
    if !x.is_finite() {
        return Err(invalid(format!("{what} must be finite, got {x}")));
    }
    Ok(())
}

fn check_nonneg(what: &str, x: f64) -> Result<()> {
    if !(x >= 0.0 && x.is_finite()) {
        return Err(invalid(format!("{what} must be finite and >= 0, got {x}")));
    }
    Ok(())
}

fn check_beta(what: &str, x: f64, closed: bool) -> Result<()> {
    let ok = x >= 0.0 && (x < 1.0 || (closed && x == 1.0));
    if !ok {
        let range = if closed { "[0, 1]" } else { "[0, 1)" };
        return Err(invalid(format!("{what} must be in {range}, got {x}")));
    }
    Ok(())
}

/// Read/write access to the parameter of element `i` (indices below `len()`).
trait ParamIo: Split {
    /// Whether `set` uses random bits.
    const SR: bool;
    fn len(&self) -> usize;
    fn get(&self, i: usize) -> f32;
    fn set(&mut self, i: usize, x: f32, r: u32);
}

/// Read access to the gradient of element `i`.
trait GradIo: Split + Copy + Sync {
    fn len(&self) -> usize;
    fn get(&self, i: usize) -> f32;
}

/// Read/write access to an optimizer state of element `i`; [`NoState`] when absent.
trait StateIo: Split {
    /// Whether `set` uses random bits.
    const SR: bool;
    /// Whether the state has `n` elements (always true when absent).
    fn fits(&self, n: usize) -> bool;
    fn get(&self, i: usize) -> f32;
    fn set(&mut self, i: usize, x: f32, r: u32);
}

/// A `f32` parameter, updated in place.
struct PF32<'a>(&'a mut [f32]);
/// A `bf16` parameter, written back with stochastic rounding.
struct PBf16Sr<'a>(&'a mut [bf16]);
/// `f32` master weights and their `bf16` compute copy (round to nearest even).
struct PMasterBf16<'a>(&'a mut [f32], &'a mut [bf16]);
/// `f32` master weights and their `f16` compute copy (round to nearest even).
struct PMasterF16<'a>(&'a mut [f32], &'a mut [f16]);
/// A state that the optimizer does not have.
struct NoState;

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
trait Rule: Copy + Sync {
    fn elem(&self, p: f32, g: f32, a: f32, b: f32) -> (f32, f32, f32);
}

/// The update of one piece of a tensor: one fused loop that loads, updates and stores every
/// operand of an element, in whatever type each is stored.
struct Step<R> {
    rule: R,
    stream: Stream,
}

impl<R: Rule, P: ParamIo, G: GradIo, A: StateIo, B: StateIo> Leaf<((P, G), (A, B))> for Step<R> {
    type Out = ();

    #[inline(always)]
    fn run(&self, start: usize, ((mut p, g), (mut a, mut b)): ((P, G), (A, B))) {
        let n = g.len();
        // The lengths were validated before the split; stating them lets the compiler drop the
        // bounds checks in the loop.
        if p.len() != n || !a.fits(n) || !b.fits(n) {
            return;
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
trait States {
    fn run<R: Rule, P: ParamIo, G: GradIo>(self, step: &Step<R>, p: P, g: G);
}

fn go<R: Rule, P: ParamIo, G: GradIo, A: StateIo, B: StateIo>(
    step: &Step<R>,
    p: P,
    g: G,
    a: A,
    b: B,
) {
    for_pieces(g.len(), ((p, g), (a, b)), step);
}

/// Two states (AdamW).
impl States for (StateMode<'_>, StateMode<'_>) {
    fn run<R: Rule, P: ParamIo, G: GradIo>(self, step: &Step<R>, p: P, g: G) {
        match self {
            (StateMode::F32(a), StateMode::F32(b)) => go(step, p, g, a, b),
            (StateMode::F32(a), StateMode::Bf16(b)) => go(step, p, g, a, b),
            (StateMode::Bf16(a), StateMode::F32(b)) => go(step, p, g, a, b),
            (StateMode::Bf16(a), StateMode::Bf16(b)) => go(step, p, g, a, b),
        }
    }
}

/// One state (Lion).
impl States for StateMode<'_> {
    fn run<R: Rule, P: ParamIo, G: GradIo>(self, step: &Step<R>, p: P, g: G) {
        match self {
            StateMode::F32(a) => go(step, p, g, a, NoState),
            StateMode::Bf16(a) => go(step, p, g, a, NoState),
        }
    }
}

/// One optional state (SGD's momentum buffer).
impl States for Option<StateMode<'_>> {
    fn run<R: Rule, P: ParamIo, G: GradIo>(self, step: &Step<R>, p: P, g: G) {
        match self {
            Some(s) => s.run(step, p, g),
            None => go(step, p, g, NoState, NoState),
        }
    }
}

fn with_grad<R: Rule, P: ParamIo, S: States>(step: &Step<R>, p: P, grad: Tensor<'_>, states: S) {
    match grad {
        Tensor::F32(g) => states.run(step, p, g),
        Tensor::BF16(g) => states.run(step, p, g),
        Tensor::F16(g) => states.run(step, p, g),
    }
}

fn run_step<R: Rule, S: States>(
    rule: R,
    stream: Stream,
    param: ParamMode<'_>,
    grad: Tensor<'_>,
    states: S,
) {
    let step = &Step { rule, stream };
    match param {
        ParamMode::F32(p) => with_grad(step, PF32(p), grad, states),
        ParamMode::Bf16Sr(p) => with_grad(step, PBf16Sr(p), grad, states),
        ParamMode::MasterBf16(m, p) => with_grad(step, PMasterBf16(m, p), grad, states),
        ParamMode::MasterF16(m, p) => with_grad(step, PMasterF16(m, p), grad, states),
    }
}

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
        }
    }
}

#[derive(Clone, Copy)]
struct AdamRule {
    gs: f32,
    decay: f32,
    w1: f32,
    w1c: f32,
    lerp_low: bool,
    beta2: f32,
    c2: f32,
    inv_bc2_sqrt: f32,
    eps: f32,
    neg_step_size: f32,
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
    let n = param.len();
    check_grad(&grad, n)?;
    let param = param_mode(param, master)?;
    let states = (
        state_mode("exp_avg", exp_avg, n)?,
        state_mode("exp_avg_sq", exp_avg_sq, n)?,
    );
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
    let rule = AdamRule {
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
    };
    run_step(rule, Stream::new(h.seed, h.step), param, grad, states);
    Ok(())
}

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
        }
    }
}

#[derive(Clone, Copy)]
struct SgdRule {
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
/// Storage as for [`adamw_step`]; `momentum_buffer` is needed when `momentum != 0` (it is ignored,
/// though its length is checked, when `momentum == 0`).
pub fn sgd_step(
    h: &Sgd,
    param: TensorMut<'_>,
    master: Option<&mut [f32]>,
    grad: Tensor<'_>,
    momentum_buffer: Option<TensorMut<'_>>,
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
    let n = param.len();
    check_grad(&grad, n)?;
    let has_momentum = h.momentum != 0.0;
    let state = match momentum_buffer {
        Some(b) => {
            let s = state_mode("momentum_buffer", b, n)?;
            has_momentum.then_some(s)
        }
        None if has_momentum => {
            return Err(invalid("momentum != 0 needs a momentum_buffer"));
        }
        None => None,
    };
    let param = param_mode(param, master)?;
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
    run_step(rule, Stream::new(h.seed, h.step), param, grad, state);
    Ok(())
}

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
        }
    }
}

#[derive(Clone, Copy)]
struct LionRule {
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
/// Storage as for [`adamw_step`] (one state, `exp_avg`).
pub fn lion_step(
    h: &Lion,
    param: TensorMut<'_>,
    master: Option<&mut [f32]>,
    grad: Tensor<'_>,
    exp_avg: TensorMut<'_>,
) -> Result<()> {
    check_nonneg("lr", h.lr)?;
    check_beta("beta1", h.beta1, true)?;
    check_beta("beta2", h.beta2, true)?;
    check_nonneg("weight_decay", h.weight_decay)?;
    check_finite("grad_scale", h.grad_scale)?;
    let n = param.len();
    check_grad(&grad, n)?;
    let param = param_mode(param, master)?;
    let state = state_mode("exp_avg", exp_avg, n)?;
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
    run_step(rule, Stream::new(h.seed, h.step), param, grad, state);
    Ok(())
}

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

struct SumSq;

const LANES: usize = 16;

#[inline(always)]
fn sum_sq_of<T: Copy>(x: &[T], f: impl Fn(T) -> f32) -> f64 {
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

struct Scale(f32);

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

struct RoundSr(Stream);

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

#[cfg(test)]
mod tests {
    use super::*;

    // -----------------------------------------------------------------------------------------
    // Helpers: data, references, comparisons.

    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(GOLDEN);
            mix64(self.0)
        }
        fn uniform(&mut self) -> f64 {
            (self.next() >> 11) as f64 / (1u64 << 53) as f64
        }
        fn normal(&mut self) -> f64 {
            let (u, v) = (1.0 - self.uniform(), self.uniform());
            (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
        }
        fn vec(&mut self, n: usize, scale: f64) -> Vec<f32> {
            (0..n).map(|_| (self.normal() * scale) as f32).collect()
        }
    }

    fn bf(x: &[f32]) -> Vec<bf16> {
        x.iter().map(|&v| bf16::from_f32(v)).collect()
    }
    fn hf(x: &[f32]) -> Vec<f16> {
        x.iter().map(|&v| f16::from_f32(v)).collect()
    }
    fn from_bf(x: &[bf16]) -> Vec<f32> {
        x.iter().map(|v| v.to_f32()).collect()
    }
    fn wide(x: &[f32]) -> Vec<f64> {
        x.iter().map(|&v| v as f64).collect()
    }

    /// `|got - want| <= rtol * max(|want|, 0.1 * max|want|)` everywhere: relative error, measured
    /// against a tenth of the tensor's scale for elements that cancelled to near zero (whose
    /// float32 rounding error is that of the larger terms they came from). NaN in `want` marks an
    /// element the reference could not decide (at most 0.1% of them).
    fn assert_close(what: &str, got: &[f32], want: &[f64], rtol: f64) {
        assert_eq!(got.len(), want.len());
        let undecided = want.iter().filter(|w| w.is_nan()).count();
        assert!(
            undecided * 1000 <= want.len(),
            "{what}: {undecided} undecided"
        );
        let scale = want.iter().fold(0.0f64, |a, w| a.max(w.abs()));
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            if w.is_nan() {
                continue;
            }
            let err = (*g as f64 - w).abs();
            let tol = rtol * w.abs().max(0.1 * scale);
            assert!(
                err <= tol,
                "{what}[{i}]: got {g}, want {w} (error {err:e} > {tol:e})"
            );
        }
    }

    /// `got` is `x` or one of its two `bf16` neighbours, as stochastic rounding allows.
    fn assert_neighbour(what: &str, got: &[bf16], want: &[f32]) -> (usize, usize) {
        let (mut up, mut inexact) = (0, 0);
        for (i, (g, x)) in got.iter().zip(want).enumerate() {
            let (gb, xb) = (g.to_bits() as u32, x.to_bits());
            if xb & 0xFFFF == 0 {
                assert_eq!(
                    gb,
                    xb >> 16,
                    "{what}[{i}]: {x} is exact in bf16 but became {g}"
                );
            } else {
                inexact += 1;
                assert!(
                    gb == xb >> 16 || gb == (xb >> 16) + 1,
                    "{what}[{i}]: {g} is not a bf16 neighbour of {x}"
                );
                up += (gb != xb >> 16) as usize;
            }
        }
        (up, inexact)
    }

    /// An optimizer configuration; `at(t)` gives its hyperparameters for step `t` (from 1).
    #[derive(Clone, Copy, Debug)]
    enum Opt {
        Adam(AdamW),
        Sgd(Sgd),
        Lion(Lion),
    }

    impl Opt {
        fn states(self) -> usize {
            match self {
                Opt::Adam(_) => 2,
                Opt::Sgd(h) => (h.momentum != 0.0) as usize,
                Opt::Lion(_) => 1,
            }
        }

        fn at(self, t: u64) -> Opt {
            match self {
                Opt::Adam(h) => Opt::Adam(AdamW {
                    step: t,
                    seed: h.seed ^ t,
                    ..h
                }),
                Opt::Sgd(h) => Opt::Sgd(Sgd {
                    first_step: t == 1,
                    step: t,
                    ..h
                }),
                Opt::Lion(h) => Opt::Lion(Lion { step: t, ..h }),
            }
        }

        fn run(
            self,
            p: TensorMut<'_>,
            master: Option<&mut [f32]>,
            g: Tensor<'_>,
            a: Option<TensorMut<'_>>,
            b: Option<TensorMut<'_>>,
        ) -> Result<()> {
            match self {
                Opt::Adam(h) => adamw_step(&h, p, master, g, a.unwrap(), b.unwrap()),
                Opt::Sgd(h) => sgd_step(&h, p, master, g, a),
                Opt::Lion(h) => lion_step(&h, p, master, g, a.unwrap()),
            }
        }

        /// Straight from the formulas of the torch docs (and the Lion paper), in f64.
        fn reference(self, p: &mut [f64], g: &[f64], a: &mut [f64], b: &mut [f64]) {
            match self {
                Opt::Adam(h) => {
                    let t = h.step as f64;
                    for i in 0..p.len() {
                        let g = if h.maximize { -1.0 } else { 1.0 } * g[i] * h.grad_scale;
                        p[i] -= h.lr * h.weight_decay * p[i];
                        a[i] = h.beta1 * a[i] + (1.0 - h.beta1) * g;
                        b[i] = h.beta2 * b[i] + (1.0 - h.beta2) * g * g;
                        let m_hat = a[i] / (1.0 - h.beta1.powf(t));
                        let v_hat = b[i] / (1.0 - h.beta2.powf(t));
                        p[i] -= h.lr * m_hat / (v_hat.sqrt() + h.eps);
                    }
                }
                Opt::Sgd(h) => {
                    for i in 0..p.len() {
                        let mut g = g[i] * h.grad_scale;
                        if h.maximize {
                            g = -g;
                        }
                        if h.weight_decay != 0.0 {
                            g += h.weight_decay * p[i];
                        }
                        if h.momentum != 0.0 {
                            a[i] = if h.first_step {
                                g
                            } else {
                                h.momentum * a[i] + (1.0 - h.dampening) * g
                            };
                            g = if h.nesterov {
                                g + h.momentum * a[i]
                            } else {
                                a[i]
                            };
                        }
                        p[i] -= h.lr * g;
                    }
                }
                Opt::Lion(h) => {
                    for i in 0..p.len() {
                        let g = if h.maximize { -1.0 } else { 1.0 } * g[i] * h.grad_scale;
                        p[i] *= 1.0 - h.lr * h.weight_decay;
                        let (x, y) = (h.beta1 * a[i], (1.0 - h.beta1) * g);
                        let c = x + y;
                        // Where float32 rounding can flip the sign, the reference cannot say
                        // which way the kernel goes: that element is left undecided (NaN).
                        if c.abs() <= 1e-6 * (x.abs() + y.abs()) {
                            p[i] = f64::NAN;
                        }
                        let sign = if c > 0.0 {
                            1.0
                        } else if c < 0.0 {
                            -1.0
                        } else {
                            0.0
                        };
                        p[i] -= h.lr * sign;
                        a[i] = h.beta2 * a[i] + (1.0 - h.beta2) * g;
                    }
                }
            }
        }
    }

    fn configs() -> Vec<Opt> {
        let adam = AdamW::default();
        let sgd = Sgd {
            lr: 1e-2,
            ..Sgd::default()
        };
        let lion = Lion::default();
        vec![
            Opt::Adam(adam),
            Opt::Adam(AdamW {
                lr: 1e-2,
                weight_decay: 0.1,
                maximize: true,
                grad_scale: 0.25,
                ..adam
            }),
            // beta1 <= 0.5: torch's lerp takes its other form.
            Opt::Adam(AdamW {
                beta1: 0.3,
                beta2: 0.9,
                eps: 1e-6,
                weight_decay: 0.0,
                ..adam
            }),
            Opt::Sgd(sgd),
            Opt::Sgd(Sgd {
                weight_decay: 1e-2,
                maximize: true,
                grad_scale: 2.0,
                ..sgd
            }),
            Opt::Sgd(Sgd {
                momentum: 0.9,
                ..sgd
            }),
            Opt::Sgd(Sgd {
                momentum: 0.9,
                dampening: 0.1,
                weight_decay: 1e-3,
                ..sgd
            }),
            Opt::Sgd(Sgd {
                momentum: 0.8,
                nesterov: true,
                weight_decay: 1e-2,
                maximize: true,
                grad_scale: 0.5,
                ..sgd
            }),
            Opt::Lion(lion),
            Opt::Lion(Lion {
                lr: 1e-3,
                beta1: 0.95,
                beta2: 0.98,
                weight_decay: 0.1,
                maximize: true,
                grad_scale: 3.0,
                ..lion
            }),
        ]
    }

    /// Sizes on the calling thread, with vector tails, and over several pieces on the pool.
    const SIZES: [usize; 5] = [1, 7, 1000, 33_000, 100_003];
    const STEPS: u64 = 5;

    // -----------------------------------------------------------------------------------------
    // Conversions and rounding.

    #[test]
    fn bf16_and_f16_loads_match_half_exhaustively() {
        for bits in 0..=u16::MAX {
            let (b, h) = (bf16::from_bits(bits), f16::from_bits(bits));
            // NaNs stay NaNs (half quiets signalling ones; we keep the bits, as torch does).
            for (ours, theirs) in [(bf16_to_f32(b), b.to_f32()), (f16_to_f32(h), h.to_f32())] {
                if theirs.is_nan() {
                    assert!(ours.is_nan(), "{bits:#x}");
                } else {
                    assert_eq!(ours.to_bits(), theirs.to_bits(), "{bits:#x}");
                }
            }
        }
    }

    #[test]
    fn round_to_nearest_even_matches_half() {
        let specials = [
            0.0f32,
            -0.0,
            1.0,
            65504.0,
            65519.99,
            65520.0,
            65536.0,
            6.1035156e-5,
            5.9604645e-8,
            2.9802322e-8,
            2.9802326e-8,
            8.940697e-8,
            1e-45,
            f32::MAX,
            f32::MIN_POSITIVE,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            1.0 + f32::EPSILON * 32768.0,
            1.0 + f32::EPSILON * 65536.0,
        ];
        let sweep = (0..=u32::MAX).step_by(997).map(f32::from_bits);
        for x in specials.into_iter().chain(sweep) {
            for x in [x, -x] {
                let (ob, tb) = (bf16_rne(x), bf16::from_f32(x));
                let (oh, th) = (f16_rne(x), f16::from_f32(x));
                if x.is_nan() {
                    assert!(ob.is_nan() && oh.is_nan(), "{x}");
                } else {
                    assert_eq!(ob.to_bits(), tb.to_bits(), "bf16 of {x:e}");
                    assert_eq!(oh.to_bits(), th.to_bits(), "f16 of {x:e}");
                }
            }
        }
    }

    #[test]
    fn stochastic_rounding_picks_a_neighbour() {
        let mut rng = Rng(1);
        for _ in 0..100_000 {
            let x = f32::from_bits(rng.next() as u32);
            let r = rng.next() as u32;
            let y = bf16_sr(x, r);
            if x.is_nan() {
                assert!(y.is_nan());
                continue;
            }
            let (yb, xb) = (y.to_bits() as u32, x.to_bits());
            assert!(yb == xb >> 16 || yb == (xb >> 16) + 1, "{x:e} -> {y}");
            // Exact values never move; r = 0 truncates; all-ones rounds an inexact value away.
            assert_eq!(bf16_sr(bf16_to_f32(y), r).to_bits(), y.to_bits());
            assert_eq!(bf16_sr(x, 0).to_bits() as u32, xb >> 16);
            if xb & 0xFFFF != 0 {
                assert_eq!(bf16_sr(x, 0xFFFF).to_bits() as u32, (xb >> 16) + 1);
            }
        }
        for r in [0, 1, 0x8000, 0xFFFF] {
            assert_eq!(bf16_sr(f32::INFINITY, r), bf16::INFINITY);
            assert_eq!(bf16_sr(f32::NEG_INFINITY, r), bf16::NEG_INFINITY);
            assert!(bf16_sr(f32::from_bits(0x7FFF_FFFF), r).is_nan());
            assert!(bf16_sr(f32::from_bits(0xFFFF_FFFF), r).is_nan());
            assert!(bf16_sr(f32::from_bits(0x7F80_0001), r).is_nan());
        }
    }

    /// Rounds `n` copies of `x` and checks the mean against `x` (within 5 standard errors).
    fn check_unbiased(x: f32, seed: u64) {
        let n = 1 << 20;
        let lo = f32::from_bits(x.to_bits() & 0xFFFF_0000) as f64;
        let hi = f32::from_bits((x.to_bits() & 0xFFFF_0000) + 0x1_0000) as f64;
        let q = (x as f64 - lo) / (hi - lo);
        let src = vec![x; n];
        let mut dst = vec![bf16::ZERO; n];
        stochastic_round_bf16(&src, &mut dst, seed, 0).unwrap();
        let mean = dst.iter().map(|v| v.to_f64()).sum::<f64>() / n as f64;
        let se = (hi - lo).abs() * (q * (1.0 - q) / n as f64).sqrt();
        assert!(
            (mean - x as f64).abs() < 5.0 * se,
            "x={x:e}: mean {mean:e}, off by {:.1} standard errors",
            (mean - x as f64).abs() / se
        );
    }

    #[test]
    fn stochastic_rounding_is_unbiased() {
        for (k, base) in [1.0f32, 3.7e-3, 1.2e30, 2.5e-39].into_iter().enumerate() {
            let b = base.to_bits() & 0xFFFF_0000;
            for q in [0.01f64, 0.25, 0.5, 0.73, 0.99] {
                let x = f32::from_bits(b + (q * 65536.0) as u32);
                check_unbiased(x, k as u64);
                check_unbiased(-x, 100 + k as u64);
            }
        }
    }

    fn round_half_way(seed: u64, step: u64, n: usize) -> Vec<bf16> {
        let x = f32::from_bits(0x3F80_8000); // half way between two bf16 neighbours of 1.0
        let mut dst = vec![bf16::ZERO; n];
        stochastic_round_bf16(&vec![x; n], &mut dst, seed, step).unwrap();
        dst
    }

    fn differing(a: &[bf16], b: &[bf16]) -> usize {
        a.iter().zip(b).filter(|(x, y)| x != y).count()
    }

    #[test]
    fn random_streams_differ_by_seed_step_and_position() {
        let n = 1 << 17;
        let base = round_half_way(7, 3, n);
        assert_eq!(
            base,
            round_half_way(7, 3, n),
            "same seed and step, same bits"
        );
        // Independent fair coins differ half the time.
        for other in [round_half_way(8, 3, n), round_half_way(7, 4, n)] {
            let d = differing(&base, &other);
            assert!((n * 2 / 5..n * 3 / 5).contains(&d), "{d} of {n} differ");
        }
        let d = differing(&base[..n / 2], &base[n / 2..]);
        assert!(
            (n / 5..n * 3 / 10).contains(&d),
            "halves: {d} of {} differ",
            n / 2
        );
        let d = differing(&base[..SERIAL_MAX], &base[SERIAL_MAX..2 * SERIAL_MAX]);
        assert!(d > SERIAL_MAX * 2 / 5, "pieces: {d} differ");
    }

    // -----------------------------------------------------------------------------------------
    // The optimizers against the f64 references.

    #[test]
    fn float32_mode_matches_the_reference() {
        for (c, opt) in configs().into_iter().enumerate() {
            for &n in &SIZES {
                let mut rng = Rng(1000 * c as u64 + n as u64);
                let mut p = rng.vec(n, 1.0);
                let mut a = vec![0.0f32; n];
                let mut b = vec![0.0f32; n];
                let (mut rp, mut ra, mut rb) = (wide(&p), vec![0.0; n], vec![0.0; n]);
                for t in 1..=STEPS {
                    let g = rng.vec(n, 0.1);
                    let o = opt.at(t);
                    let states = o.states();
                    o.run(
                        TensorMut::F32(&mut p),
                        None,
                        Tensor::F32(&g),
                        (states >= 1).then_some(TensorMut::F32(&mut a)),
                        (states >= 2).then_some(TensorMut::F32(&mut b)),
                    )
                    .unwrap();
                    o.reference(&mut rp, &wide(&g), &mut ra, &mut rb);
                }
                let what = format!("{opt:?} n={n}");
                assert_close(&format!("{what} param"), &p, &rp, 1e-6);
                if opt.states() >= 1 {
                    assert_close(&format!("{what} state 1"), &a, &ra, 1e-6);
                }
                if opt.states() >= 2 {
                    assert_close(&format!("{what} state 2"), &b, &rb, 1e-6);
                }
            }
        }
    }

    #[test]
    fn master_mode_matches_the_reference_and_rounds_the_param() {
        for (c, opt) in configs().into_iter().enumerate() {
            for (k, &n) in SIZES.iter().enumerate() {
                for param_dtype in [Dtype::BF16, Dtype::F16] {
                    let grad_dtype = [Dtype::F32, Dtype::BF16, Dtype::F16][(c + k) % 3];
                    let mut rng = Rng(7 + 1000 * c as u64 + n as u64);
                    let mut master = rng.vec(n, 1.0);
                    let mut pb = bf(&master);
                    let mut ph = hf(&master);
                    let mut a = vec![0.0f32; n];
                    let mut b = vec![0.0f32; n];
                    let (mut rp, mut ra, mut rb) = (wide(&master), vec![0.0; n], vec![0.0; n]);
                    for t in 1..=STEPS {
                        let g = rng.vec(n, 0.1);
                        let (gb, gh) = (bf(&g), hf(&g));
                        let (grad, g64) = match grad_dtype {
                            Dtype::F32 => (Tensor::F32(&g), wide(&g)),
                            Dtype::BF16 => (Tensor::BF16(&gb), wide(&from_bf(&gb))),
                            Dtype::F16 => {
                                let w = gh.iter().map(|v| v.to_f64()).collect();
                                (Tensor::F16(&gh), w)
                            }
                        };
                        let param = match param_dtype {
                            Dtype::BF16 => TensorMut::BF16(&mut pb),
                            _ => TensorMut::F16(&mut ph),
                        };
                        let o = opt.at(t);
                        let states = o.states();
                        o.run(
                            param,
                            Some(&mut master),
                            grad,
                            (states >= 1).then_some(TensorMut::F32(&mut a)),
                            (states >= 2).then_some(TensorMut::F32(&mut b)),
                        )
                        .unwrap();
                        o.reference(&mut rp, &g64, &mut ra, &mut rb);
                    }
                    let what = format!("{opt:?} n={n} {param_dtype} grad {grad_dtype}");
                    assert_close(&format!("{what} master"), &master, &rp, 1e-6);
                    for (i, &m) in master.iter().enumerate() {
                        match param_dtype {
                            Dtype::BF16 => assert_eq!(pb[i], bf16::from_f32(m), "{what} [{i}]"),
                            _ => assert_eq!(ph[i].to_bits(), f16::from_f32(m).to_bits()),
                        }
                    }
                }
            }
        }
    }

    /// bf16 param and/or states with stochastic rounding: every stored value is a neighbour of
    /// what the float32 kernel computes from the same (widened) inputs, rounding goes both ways in
    /// proportion, and after several steps the result stays within bf16 noise of the reference.
    #[test]
    fn bf16_mode_rounds_the_float32_result_stochastically() {
        for (c, opt) in configs().into_iter().enumerate() {
            for bf16_param in [true, false] {
                let n = 50_001;
                let mut rng = Rng(99 + c as u64);
                let p0 = rng.vec(n, 1.0);
                let mut pb = bf(&p0);
                let mut pf = p0.clone();
                let (mut a, mut b) = (vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
                let (mut rp, mut ra, mut rb) = (wide(&from_bf(&pb)), vec![0.0; n], vec![0.0; n]);
                if !bf16_param {
                    rp = wide(&pf);
                }
                let (mut ups, mut inexact) = (0, 0);
                for t in 1..=STEPS {
                    let g = bf(&rng.vec(n, 0.1));
                    let o = opt.at(t);
                    let states = o.states();
                    // What the float32 kernel makes of the same inputs.
                    let mut ep = if bf16_param { from_bf(&pb) } else { pf.clone() };
                    let (mut ea, mut eb) = (from_bf(&a), from_bf(&b));
                    o.run(
                        TensorMut::F32(&mut ep),
                        None,
                        Tensor::BF16(&g),
                        (states >= 1).then_some(TensorMut::F32(&mut ea)),
                        (states >= 2).then_some(TensorMut::F32(&mut eb)),
                    )
                    .unwrap();
                    let param = if bf16_param {
                        TensorMut::BF16(&mut pb)
                    } else {
                        TensorMut::F32(&mut pf)
                    };
                    o.run(
                        param,
                        None,
                        Tensor::BF16(&g),
                        (states >= 1).then_some(TensorMut::BF16(&mut a)),
                        (states >= 2).then_some(TensorMut::BF16(&mut b)),
                    )
                    .unwrap();
                    let what = format!("{opt:?} step {t}");
                    if bf16_param {
                        let (u, i) = assert_neighbour(&format!("{what} param"), &pb, &ep);
                        (ups, inexact) = (ups + u, inexact + i);
                    } else {
                        assert_eq!(pf, ep, "{what}: the f32 param is updated exactly");
                    }
                    if states >= 1 {
                        let (u, i) = assert_neighbour(&format!("{what} state 1"), &a, &ea);
                        (ups, inexact) = (ups + u, inexact + i);
                    }
                    if states >= 2 {
                        let (u, i) = assert_neighbour(&format!("{what} state 2"), &b, &eb);
                        (ups, inexact) = (ups + u, inexact + i);
                    }
                    o.reference(&mut rp, &wide(&from_bf(&g)), &mut ra, &mut rb);
                }
                // Rounding goes both ways (the fractions are spread over [0, 1)).
                if inexact > 0 {
                    let f = ups as f64 / inexact as f64;
                    assert!((0.3..0.7).contains(&f), "{opt:?}: {f} of roundings go up");
                }
                // bf16 keeps 8 bits: a few ulps of 2^-8 of the magnitude.
                let p = if bf16_param { from_bf(&pb) } else { pf.clone() };
                assert_close(&format!("{opt:?} bf16 param"), &p, &rp, 0.03);
            }
        }
    }

    #[test]
    fn stochastic_rounding_through_an_optimizer_is_unbiased() {
        // SGD with lr 1: the new param is p - g, rounded; its mean must be p - g.
        let n = 1 << 20;
        let h = Sgd {
            lr: 1.0,
            seed: 5,
            ..Sgd::default()
        };
        let mut p = vec![bf16::from_f32(1.0); n];
        let g = vec![-0.0037f32; n];
        sgd_step(&h, TensorMut::BF16(&mut p), None, Tensor::F32(&g), None).unwrap();
        let x = 1.0f32 + 0.0037;
        let (lo, hi) = (1.0f64 + 2f64.powi(-7) * 0.0, 1.0 + 2f64.powi(-7));
        let q = (x as f64 - lo) / (hi - lo);
        let mean = p.iter().map(|v| v.to_f64()).sum::<f64>() / n as f64;
        let se = (hi - lo) * (q * (1.0 - q) / n as f64).sqrt();
        assert!((mean - x as f64).abs() < 5.0 * se, "mean {mean} vs {x}");
    }

    // -----------------------------------------------------------------------------------------
    // Determinism.

    #[allow(clippy::type_complexity)]
    fn bf16_run(n: usize) -> (Vec<bf16>, Vec<bf16>, Vec<bf16>, Vec<u16>, Vec<f32>, f64) {
        let mut rng = Rng(3);
        let mut p = bf(&rng.vec(n, 1.0));
        let (mut m, mut v) = (vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
        let mut master = rng.vec(n, 1.0);
        let mut ph = hf(&master);
        let (mut m2, mut v2) = (vec![0.0f32; n], vec![0.0f32; n]);
        for t in 1..=3 {
            let g = bf(&rng.vec(n, 0.1));
            let h = AdamW {
                step: t,
                seed: 11,
                ..AdamW::default()
            };
            let (pm, gm) = (TensorMut::BF16(&mut p), Tensor::BF16(&g));
            adamw_step(
                &h,
                pm,
                None,
                gm,
                TensorMut::BF16(&mut m),
                TensorMut::BF16(&mut v),
            )
            .unwrap();
            let (pm, gm) = (TensorMut::F16(&mut ph), Tensor::BF16(&g));
            let (am, bm) = (TensorMut::F32(&mut m2), TensorMut::F32(&mut v2));
            adamw_step(&h, pm, Some(&mut master), gm, am, bm).unwrap();
        }
        let sum = grad_stats(Tensor::BF16(&p)).sum_sq + grad_stats(Tensor::F32(&master)).sum_sq;
        let ph = ph.iter().map(|v| v.to_bits()).collect();
        (p, m, v, ph, master, sum)
    }

    #[test]
    fn results_do_not_depend_on_the_number_of_threads() {
        let n = 300_001;
        let run = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| bf16_run(n))
        };
        let one = run(1);
        for threads in [2, 3, 8] {
            let other = run(threads);
            assert!(one == other, "{threads} threads differ from 1");
            assert_eq!(one.5.to_bits(), other.5.to_bits());
        }
    }

    #[test]
    fn every_instruction_set_gives_the_same_bits() {
        let n = SERIAL_MAX - 3; // one piece, on this thread
        let base = {
            FORCE_ISA.with(|f| f.set(Some(Isa::Base)));
            bf16_run(n)
        };
        let mut isas = vec![Isa::Base];
        #[cfg(target_arch = "x86_64")]
        isas.extend([Isa::Avx2, Isa::Avx512]);
        for want in isas {
            FORCE_ISA.with(|f| f.set(Some(want)));
            assert_eq!(isa(), want.min(best_isa()));
            let got = bf16_run(n);
            assert!(got == base, "{want:?} differs from the baseline");
        }
        FORCE_ISA.with(|f| f.set(None));
    }

    // -----------------------------------------------------------------------------------------
    // Gradient statistics and scaling.

    #[test]
    fn grad_stats_sums_squares_and_spots_non_finite_values() {
        assert_eq!(
            grad_stats(Tensor::F32(&[])),
            GradStats {
                sum_sq: 0.0,
                non_finite: false
            }
        );
        let mut rng = Rng(17);
        for n in [5, 1000, 100_003] {
            let g = rng.vec(n, 3.0);
            let want: f64 = g.iter().map(|&v| (v as f64) * (v as f64)).sum();
            let s = grad_stats(Tensor::F32(&g));
            assert!(!s.non_finite);
            assert!(
                (s.sum_sq - want).abs() <= 1e-12 * want,
                "{} vs {want}",
                s.sum_sq
            );
            let gb = bf(&g);
            let want: f64 = gb.iter().map(|v| v.to_f64() * v.to_f64()).sum();
            let s = grad_stats(Tensor::BF16(&gb));
            assert!((s.sum_sq - want).abs() <= 1e-12 * want);
            let gh = hf(&g);
            let want: f64 = gh.iter().map(|v| v.to_f64() * v.to_f64()).sum();
            let s = grad_stats(Tensor::F16(&gh));
            assert!((s.sum_sq - want).abs() <= 1e-12 * want);
            for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
                let mut g = g.clone();
                g[n * 2 / 3] = bad;
                assert!(grad_stats(Tensor::F32(&g)).non_finite);
                assert!(grad_stats(Tensor::BF16(&bf(&g))).non_finite);
                assert!(grad_stats(Tensor::F16(&hf(&g))).non_finite);
            }
            // Large but finite values do not overflow the f64 sum.
            let big = vec![f32::MAX; n];
            assert!(!grad_stats(Tensor::F32(&big)).non_finite);
            // ...but they overflow f16, which is then infinite.
            assert!(grad_stats(Tensor::F16(&hf(&big))).non_finite);
        }
    }

    #[test]
    fn scale_multiplies_and_rounds_like_torch() {
        let mut rng = Rng(23);
        let n = 70_000;
        let x = rng.vec(n, 10.0);
        let k = 0.37f32;
        let mut f = x.clone();
        scale_in_place(TensorMut::F32(&mut f), k);
        assert!(f
            .iter()
            .zip(&x)
            .all(|(a, b)| a.to_bits() == (b * k).to_bits()));
        let mut b = bf(&x);
        scale_in_place(TensorMut::BF16(&mut b), k);
        for (o, i) in b.iter().zip(bf(&x)) {
            assert_eq!(*o, bf16::from_f32(i.to_f32() * k));
        }
        let mut h = hf(&x);
        scale_in_place(TensorMut::F16(&mut h), k);
        for (o, i) in h.iter().zip(hf(&x)) {
            assert_eq!(o.to_bits(), f16::from_f32(i.to_f32() * k).to_bits());
        }
    }

    // -----------------------------------------------------------------------------------------
    // Errors.

    fn err_of(r: Result<()>) -> String {
        match r {
            Err(Error::InvalidArgument(m)) => m,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn bad_arguments_are_invalid_argument_errors() {
        assert!(Dtype::parse("torch.bfloat16").is_ok());
        assert!(err_of(Dtype::parse("float64").map(|_| ())).contains("unknown dtype"));
        let h = AdamW::default();
        let (mut p, g, mut m, mut v) = (vec![0f32; 4], vec![0f32; 4], vec![0f32; 4], vec![0f32; 4]);
        let mut short = vec![0f32; 3];
        let mut pb = vec![bf16::ZERO; 4];
        let mut ph = vec![f16::ZERO; 4];
        let mut mh = vec![f16::ZERO; 4];
        fn f(x: &mut [f32]) -> TensorMut<'_> {
            TensorMut::F32(x)
        }
        let cases: Vec<(Result<()>, &str)> = vec![
            (
                adamw_step(
                    &h,
                    f(&mut p),
                    None,
                    Tensor::F32(&g[..3]),
                    f(&mut m),
                    f(&mut v),
                ),
                "grad has 3 elements but param has 4",
            ),
            (
                adamw_step(
                    &h,
                    f(&mut p),
                    None,
                    Tensor::F32(&g),
                    f(&mut short),
                    f(&mut v),
                ),
                "exp_avg has 3",
            ),
            (
                adamw_step(
                    &h,
                    TensorMut::BF16(&mut pb),
                    Some(&mut short),
                    Tensor::F32(&g),
                    f(&mut m),
                    f(&mut v),
                ),
                "master has 3",
            ),
            (
                adamw_step(
                    &h,
                    f(&mut p),
                    Some(&mut short),
                    Tensor::F32(&g),
                    f(&mut m),
                    f(&mut v),
                ),
                "master has 3",
            ),
            (
                adamw_step(
                    &h,
                    f(&mut p),
                    Some(&mut v),
                    Tensor::F32(&g),
                    f(&mut m),
                    f(&mut short),
                ),
                "its own master",
            ),
            (
                adamw_step(
                    &h,
                    TensorMut::F16(&mut ph),
                    None,
                    Tensor::F32(&g),
                    f(&mut m),
                    f(&mut v),
                ),
                "needs float32 master",
            ),
            (
                adamw_step(
                    &h,
                    f(&mut p),
                    None,
                    Tensor::F32(&g),
                    TensorMut::F16(&mut mh),
                    f(&mut v),
                ),
                "float16 optimizer states",
            ),
            (
                adamw_step(
                    &AdamW { step: 0, ..h },
                    f(&mut p),
                    None,
                    Tensor::F32(&g),
                    f(&mut m),
                    f(&mut v),
                ),
                "step counts from 1",
            ),
            (
                adamw_step(
                    &AdamW { beta1: 1.0, ..h },
                    f(&mut p),
                    None,
                    Tensor::F32(&g),
                    f(&mut m),
                    f(&mut v),
                ),
                "beta1 must be in [0, 1)",
            ),
            (
                adamw_step(
                    &AdamW { lr: f64::NAN, ..h },
                    f(&mut p),
                    None,
                    Tensor::F32(&g),
                    f(&mut m),
                    f(&mut v),
                ),
                "lr must be finite",
            ),
            (
                adamw_step(
                    &AdamW {
                        grad_scale: f64::INFINITY,
                        ..h
                    },
                    f(&mut p),
                    None,
                    Tensor::F32(&g),
                    f(&mut m),
                    f(&mut v),
                ),
                "grad_scale must be finite",
            ),
            (
                sgd_step(
                    &Sgd {
                        nesterov: true,
                        ..Sgd::default()
                    },
                    f(&mut p),
                    None,
                    Tensor::F32(&g),
                    Some(f(&mut m)),
                ),
                "Nesterov momentum requires a momentum and zero dampening",
            ),
            (
                sgd_step(
                    &Sgd {
                        momentum: 0.9,
                        ..Sgd::default()
                    },
                    f(&mut p),
                    None,
                    Tensor::F32(&g),
                    None,
                ),
                "needs a momentum_buffer",
            ),
            (
                sgd_step(
                    &Sgd {
                        momentum: -0.5,
                        ..Sgd::default()
                    },
                    f(&mut p),
                    None,
                    Tensor::F32(&g),
                    Some(f(&mut m)),
                ),
                "momentum must be finite and >= 0",
            ),
            (
                lion_step(
                    &Lion {
                        beta2: 1.5,
                        ..Lion::default()
                    },
                    f(&mut p),
                    None,
                    Tensor::F32(&g),
                    f(&mut m),
                ),
                "beta2 must be in [0, 1]",
            ),
            (
                lion_step(
                    &Lion::default(),
                    f(&mut p),
                    None,
                    Tensor::F32(&g),
                    f(&mut short),
                ),
                "exp_avg has 3",
            ),
            (
                stochastic_round_bf16(&g, &mut pb[..2], 0, 0),
                "src has 4 elements but dst has 2",
            ),
        ];
        for (r, want) in cases {
            let m = err_of(r);
            assert!(m.contains(want), "{m:?} should mention {want:?}");
        }
        // Nothing was written by the refused calls.
        assert!(p.iter().chain(&m).chain(&v).all(|&x| x == 0.0));
        // Empty tensors are fine.
        let h = AdamW::default();
        adamw_step(
            &h,
            TensorMut::F32(&mut []),
            None,
            Tensor::F32(&[]),
            TensorMut::F32(&mut []),
            TensorMut::F32(&mut []),
        )
        .unwrap();
    }
}
