//! Conversions between `f32` and the 16-bit float types, and the stochastic rounding of `f32` to
//! `bf16`, written once for the whole crate (the optimizer kernels and the file readers/writers).
//! Branch-free bit manipulation, so that the loops using them vectorise; checked against the
//! `half` crate in the tests.

use super::{bf16, f16};

/// `bf16` to `f32` (exact).
#[inline(always)]
pub fn bf16_to_f32(h: bf16) -> f32 {
    f32::from_bits((h.to_bits() as u32) << 16)
}

/// `f32` to `bf16`, round to nearest even; NaN stays a (quiet) NaN.
#[inline(always)]
pub fn bf16_rne(x: f32) -> bf16 {
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
pub fn bf16_sr(x: f32, r: u32) -> bf16 {
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
pub fn f16_to_f32(h: f16) -> f32 {
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

/// `a + b` as torch's `add` computes it for `bf16`: in `f32`, rounded to nearest even. The one
/// definition of a `bf16` gradient sum (host adds, a gradient read in two parts).
#[inline(always)]
pub fn add_bf16(a: bf16, b: bf16) -> bf16 {
    bf16_rne(bf16_to_f32(a) + bf16_to_f32(b))
}

/// `f32` to `f16`, round to nearest even (overflow to infinity, NaN to a quiet NaN), after
/// F. Giesen's branch-free `float_to_half_fast3_rtne`.
#[inline(always)]
pub fn f16_rne(x: f32) -> f16 {
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

pub(super) const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The SplitMix64 finaliser (a bijection of `u64` with good avalanche).
#[inline(always)]
pub(super) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A keyed variant of C. Wellons' `lowbias32` integer hash (a bijection of `u32` for fixed keys):
/// one multiply-xorshift round, the second key, another round. 32-bit multiplies keep it at eight
/// elements per AVX2 instruction.
#[inline(always)]
pub(super) fn hash32(x: u32, k1: u32, k2: u32) -> u32 {
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
pub(super) struct Stream {
    key: u64,
    /// Index in the whole tensor of the first element a call updates (a piece of the tensor:
    /// its words are those the whole tensor's update would use).
    pub(super) offset: u64,
}

/// The keys of the random words of stochastic rounding for the elements of a call with `seed`
/// at `step` whose index (in the whole tensor) divided by 2^32 is that of `offset`: `[k0, k1]`
/// hash word 0 of element `i` as `hash32(i mod 2^32, k0, k1)`, `[k2, k3]` word 1. Word 0 rounds
/// the parameter (its low 16 bits) and the first state (its high 16 bits), word 1 the second
/// state. For another implementation of the kernels to draw the same words.
pub fn stochastic_keys(seed: u64, step: u64, offset: u64) -> [u32; 4] {
    let s = Stream::new(seed, step);
    let (k0, k1) = s.keys(0, offset >> 32);
    let (k2, k3) = s.keys(1, offset >> 32);
    [k0, k1, k2, k3]
}

impl Stream {
    pub(super) fn new(seed: u64, step: u64) -> Self {
        let k = mix64(seed ^ 0x6A09_E667_F3BC_C908);
        Stream {
            key: mix64(k ^ mix64(step.wrapping_add(0xBB67_AE85_84CA_A73B))),
            offset: 0,
        }
    }

    /// The stream of a call that updates the piece of a tensor starting at element `offset`.
    pub(super) fn at(self, offset: u64) -> Self {
        Stream { offset, ..self }
    }

    /// The hash keys of word `lane` for elements whose index divided by 2^32 is `hi`.
    #[inline(always)]
    pub(super) fn keys(self, lane: u64, hi: u64) -> (u32, u32) {
        let k = mix64(self.key.wrapping_add((hi << 8 | lane).wrapping_mul(GOLDEN)));
        (k as u32, (k >> 32) as u32)
    }

    /// For a piece whose first element is element `start` of the call: that element's index in
    /// the whole tensor mod 2^32, and the keys of words 0 and 1 (`[k0, k1, k2, k3]`) over the
    /// piece (pieces do not straddle a multiple of 2^32).
    #[inline(always)]
    pub(super) fn piece_keys(self, start: usize) -> (u32, [u32; 4]) {
        let start = start as u64 + self.offset;
        let hi = start >> 32;
        let (k0, k1) = self.keys(0, hi);
        let (k2, k3) = self.keys(1, hi);
        (start as u32, [k0, k1, k2, k3])
    }
}

/// `a + b` as torch's `add` computes it for `f16`: in `f32`, rounded to nearest even (as
/// [`add_bf16`]).
#[inline(always)]
pub fn add_f16(a: f16, b: f16) -> f16 {
    f16_rne(f16_to_f32(a) + f16_to_f32(b))
}
