//! Block-wise 8-bit storage of optimizer states: each block of [`BLOCK`] elements is stored as
//! one `f32` scale (the block's largest magnitude) and one byte per element, a small float
//! relative to that scale.
//!
//! A code's magnitude `c` stands for `2^e * (1 + k/8)`: the bits of an `f32` whose exponent and
//! top three mantissa bits are `c + OFF` (and whose lower 20 bits are zero), so that the largest
//! code is exactly 1 and the others step by an eighth of their binade. The signed format (the
//! AdamW first moment) spends bit 7 on the sign and 7 bits on the magnitude: codes down to
//! `1.25 * 2^-16` of the scale, 16 binades; the unsigned one (the second moment, a square) 8 bits:
//! down to `1.25 * 2^-32`, 32 binades. Magnitude 0 is 0. Rounded to nearest, a value from the
//! smallest code up comes back within a sixteenth of itself (the second moment enters AdamW's
//! update through its square root: within a thirty-second there).
//!
//! Encoding divides by the scale (`x * (1 / scale)`, both correctly rounded) and rounds the
//! quotient's bits: to nearest (ties away from zero) by adding half a step and truncating, or
//! stochastically by adding 16 random bits in place of that half step (probability of rounding up
//! = the quotient's position between its two codes, to 2^-16). Rounded stochastically, a positive
//! value never takes the code of 0: below the smallest code it is rounded up to it (a second
//! moment of 0 beside a first moment that is not would make AdamW's update `m / eps`). Rounded to
//! nearest, a magnitude below half the smallest code is 0. These are integer operations on the
//! bits and one multiply, so the codec vectorizes as it is written (the kernels compile it for
//! AVX2 and AVX-512) and gives the same bits wherever it runs, the GPU's Triton kernel included.
//!
//! A block whose largest magnitude is not finite is stored with a NaN scale (it decodes to NaNs,
//! as a NaN would spread through an unquantized state); one whose largest magnitude is below the
//! smallest normal `f32` (zero included) is stored as zeros.
//!
//! States saved by the first compact format (a 256-value dynamic map of decades, as bitsandbytes'
//! 8-bit optimizers use) are read through [`legacy_map`].

use std::sync::OnceLock;

/// Elements per quantization block (one `f32` scale each).
pub const BLOCK: usize = 256;

/// Number of scales of a tensor of `n` elements (the last block may be short).
pub const fn blocks(n: usize) -> usize {
    n.div_ceil(BLOCK)
}

/// Mantissa bits a code keeps.
const MANT_BITS: u32 = 3;
/// The `f32` bits below those a code keeps.
const SHIFT: u32 = 23 - MANT_BITS;
/// The sign bit of a signed code.
const SIGN: u32 = 0x80;

/// The largest magnitude of a code (it stands for exactly 1).
const fn top(signed: bool) -> u32 {
    if signed {
        0x7F
    } else {
        0xFF
    }
}

/// What a magnitude adds to make the top bits of its `f32` (1.0's bits above [`SHIFT`] minus the
/// top magnitude).
const fn off(signed: bool) -> u32 {
    (1.0f32.to_bits() >> SHIFT) - top(signed)
}

/// The value of `code` relative to its block's scale.
pub fn value(code: u8, signed: bool) -> f32 {
    let mut out = [0f32];
    if signed {
        decode_block::<true>(&[code], 1.0, &mut out);
    } else {
        decode_block::<false>(&[code], 1.0, &mut out);
    }
    out[0]
}

/// Decodes one block: `out[i]` = the value of `codes[i]` times `scale`.
#[inline(always)]
pub(super) fn decode_block<const SIGNED: bool>(codes: &[u8], scale: f32, out: &mut [f32]) {
    let n = out.len().min(codes.len());
    for (o, &c) in out[..n].iter_mut().zip(&codes[..n]) {
        *o = decode_one::<SIGNED>(c, scale);
    }
}

/// The value of one code of a block whose scale is `scale` (as [`decode_block`] decodes it).
#[inline(always)]
pub(super) fn decode_one<const SIGNED: bool>(c: u8, scale: f32) -> f32 {
    let off = off(SIGNED);
    let c = c as u32;
    let mag = if SIGNED { c & !SIGN } else { c };
    let bits = if mag == 0 { 0 } else { (mag + off) << SHIFT };
    let sign = if SIGNED { (c & SIGN) << 24 } else { 0 };
    f32::from_bits(bits | sign) * scale
}

/// Encodes one block of `x` (at most [`BLOCK`] values) into `codes`, rounded to nearest, or with
/// `SR` stochastically by the low 16 bits of `r[i]` (`r` as long as `x`); returns its scale.
#[inline(always)]
pub(super) fn encode_block<const SIGNED: bool, const SR: bool>(
    x: &[f32],
    codes: &mut [u8],
    r: &[u32],
) -> f32 {
    let n = x.len().min(codes.len());
    // The largest magnitude as the largest of the bits without the sign (the same order for
    // non-NaN floats; infinities and NaNs are the bits from 0x7F80_0000 up).
    let mut amax_bits = 0u32;
    for &v in &x[..n] {
        amax_bits = amax_bits.max(magnitude_bits(v));
    }
    encode_block_with::<SIGNED, SR>(x, codes, r, amax_bits)
}

/// The bits of `|v|`: their largest over a block is [`encode_block_with`]'s `amax_bits`.
#[inline(always)]
pub(super) fn magnitude_bits(v: f32) -> u32 {
    v.to_bits() & 0x7FFF_FFFF
}

/// [`encode_block`] given the largest of the block's [`magnitude_bits`] (computed while the block
/// was made, saving a pass over it).
#[inline(always)]
pub(super) fn encode_block_with<const SIGNED: bool, const SR: bool>(
    x: &[f32],
    codes: &mut [u8],
    r: &[u32],
    amax_bits: u32,
) -> f32 {
    let n = x.len().min(codes.len());
    let (x, codes) = (&x[..n], &mut codes[..n]);
    if amax_bits >= 0x7F80_0000 {
        codes.fill(0);
        return f32::NAN;
    }
    if amax_bits < 0x0080_0000 {
        codes.fill(0);
        return 0.0;
    }
    let amax = f32::from_bits(amax_bits);
    let inv = 1.0 / amax;
    let off = off(SIGNED);
    let top = top(SIGNED);
    // Half the smallest code's value, as bits: a magnitude from there up rounds to nearest to a
    // code (not to 0).
    let half_first = ((off + 1) << SHIFT) - 0x0080_0000;
    if SR && r.len() >= n {
        let r = &r[..n];
        for ((c, &v), &r) in codes.iter_mut().zip(x).zip(r) {
            let a = v.to_bits() & 0x7FFF_FFFF;
            let y = (f32::from_bits(a) * inv).to_bits();
            let q = (y + ((r & 0xFFFF) << (SHIFT - 16))) >> SHIFT;
            let mag = q.clamp(off, off + top) - off;
            // A value that is not 0 never takes the code of 0.
            let mag = mag.max((a != 0) as u32);
            *c = code::<SIGNED>(mag, v);
        }
    } else {
        for (c, &v) in codes.iter_mut().zip(x) {
            let y = (f32::from_bits(v.to_bits() & 0x7FFF_FFFF) * inv).to_bits();
            let q = (y + (1 << (SHIFT - 1))) >> SHIFT;
            let mag = q.clamp(off, off + top) - off;
            let mag = mag.max((y >= half_first) as u32);
            *c = code::<SIGNED>(mag, v);
        }
    }
    amax
}

/// The code of magnitude `mag` with the sign of `v` (signed: none on a magnitude of 0).
#[inline(always)]
fn code<const SIGNED: bool>(mag: u32, v: f32) -> u8 {
    if SIGNED {
        let sign = (v.to_bits() >> 24) & SIGN;
        (mag | if mag == 0 { 0 } else { sign }) as u8
    } else {
        mag as u8
    }
}

/// Blocks a task of [`quantize`] and [`dequantize`] takes (1 MiB of `f32`).
const TASK_BLOCKS: usize = 1024;

/// Quantizes `x` block by block into `codes` (one per element) and `scales` (one per block,
/// [`blocks`]`(x.len())`), rounded to nearest, in the signed or the unsigned format. Lengths must
/// match. Runs on the rayon pool with the kernels' instruction set (the same bits on any).
pub fn quantize(
    x: &[f32],
    codes: &mut [u8],
    scales: &mut [f32],
    signed: bool,
) -> crate::Result<()> {
    use rayon::prelude::*;
    check(x.len(), codes.len(), scales.len())?;
    let tasks = x
        .par_chunks(BLOCK * TASK_BLOCKS)
        .zip(codes.par_chunks_mut(BLOCK * TASK_BLOCKS))
        .zip(scales.par_chunks_mut(TASK_BLOCKS));
    run_tasks(signed, tasks.map(|((x, c), s)| Coding::Encode(x, c, s)));
    Ok(())
}

/// Decodes `codes` and `scales` (as written by [`quantize`]) into `out`. Lengths must match. Runs
/// as [`quantize`] does.
pub fn dequantize(
    codes: &[u8],
    scales: &[f32],
    out: &mut [f32],
    signed: bool,
) -> crate::Result<()> {
    use rayon::prelude::*;
    check(out.len(), codes.len(), scales.len())?;
    let tasks = out
        .par_chunks_mut(BLOCK * TASK_BLOCKS)
        .zip(codes.par_chunks(BLOCK * TASK_BLOCKS))
        .zip(scales.par_chunks(TASK_BLOCKS));
    run_tasks(signed, tasks.map(|((o, c), s)| Coding::Decode(c, s, o)));
    Ok(())
}

/// Runs each task on the rayon pool with the kernels' instruction set.
fn run_tasks<'a>(signed: bool, tasks: impl rayon::iter::ParallelIterator<Item = Coding<'a>>) {
    let leaf = Codec { signed };
    tasks.for_each(|task| super::kernel::leaf_on(super::kernel::isa(), &leaf, 0, task));
}

/// One task of [`quantize`] or [`dequantize`]: whole blocks (the last may be short).
enum Coding<'a> {
    Encode(&'a [f32], &'a mut [u8], &'a mut [f32]),
    Decode(&'a [u8], &'a [f32], &'a mut [f32]),
}

/// The codec as a kernel leaf, so that it is compiled for each instruction set.
struct Codec {
    signed: bool,
}

impl<'a> super::kernel::Leaf<Coding<'a>> for Codec {
    type Out = ();

    #[inline(always)]
    fn run(&self, _: usize, task: Coding<'a>) {
        match task {
            Coding::Encode(x, codes, scales) => {
                for ((xb, cb), s) in x.chunks(BLOCK).zip(codes.chunks_mut(BLOCK)).zip(scales) {
                    *s = if self.signed {
                        encode_block::<true, false>(xb, cb, &[])
                    } else {
                        encode_block::<false, false>(xb, cb, &[])
                    };
                }
            }
            Coding::Decode(codes, scales, out) => {
                for ((ob, cb), &s) in out.chunks_mut(BLOCK).zip(codes.chunks(BLOCK)).zip(scales) {
                    if self.signed {
                        decode_block::<true>(cb, s, ob);
                    } else {
                        decode_block::<false>(cb, s, ob);
                    }
                }
            }
        }
    }

    fn join(_: (), _: ()) {}
}

fn check(n: usize, codes: usize, scales: usize) -> crate::Result<()> {
    if codes != n {
        return Err(super::invalid(format!(
            "codes have {codes} elements, expected {n} (one per element)"
        )));
    }
    if scales != blocks(n) {
        return Err(super::invalid(format!(
            "scales have {scales} elements, expected {} (one per block of {BLOCK})",
            blocks(n)
        )));
    }
    Ok(())
}

/// The 256 values, sorted, of the first compact format's dynamic map (Dettmers, "8-bit
/// approximations for parallelism in deep learning", 2016): seven decades `[1e-7, 1e-6)` to
/// `[0.1, 1)` with `2^i` values in decade `i` on each side of 0 (signed) or `2^(i+1)` (unsigned),
/// and 0 and 1. A state saved in that format is code `c` of this map times its block's scale; the
/// optimizer reads such states through this and stores them in the current format.
pub fn legacy_map(signed: bool) -> &'static [f32; 256] {
    static MAPS: OnceLock<[[f32; 256]; 2]> = OnceLock::new();
    &MAPS.get_or_init(|| [build_legacy(true), build_legacy(false)])[usize::from(!signed)]
}

fn build_legacy(signed: bool) -> [f32; 256] {
    // Decades 10^-6..10^0 (scaled by the means of `fraction` evenly spaced boundaries in
    // [0.1, 1]); 7 decades with 2^i (signed) or 2^(i+1) (unsigned) means each: 254 values, plus 0
    // and 1.
    let mut v: Vec<f64> = Vec::with_capacity(256);
    for i in 0..7u32 {
        let items = if signed { 1u32 << i } else { 1u32 << (i + 1) };
        let decade = 10f64.powi(i as i32 - 6);
        for k in 0..items {
            // Boundaries linspace(0.1, 1, items + 1); the mean of boundaries k and k + 1.
            let b = |j: u32| 0.1 + 0.9 * j as f64 / items as f64;
            let mean = (b(k) + b(k + 1)) / 2.0;
            v.push(decade * mean);
            if signed {
                v.push(-decade * mean);
            }
        }
    }
    v.push(0.0);
    v.push(1.0);
    v.sort_by(f64::total_cmp);
    let mut out = [0f32; 256];
    for (o, x) in out.iter_mut().zip(&v) {
        *o = *x as f32;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Codes of a block `[1.0, y]` (its scale is 1, so `y` is its own quotient), the second one.
    fn code_of(y: f32, signed: bool, r: Option<u32>) -> u8 {
        let mut c = [0u8; 2];
        let s = match (signed, r) {
            (true, None) => encode_block::<true, false>(&[1.0, y], &mut c, &[]),
            (false, None) => encode_block::<false, false>(&[1.0, y], &mut c, &[]),
            (true, Some(r)) => encode_block::<true, true>(&[1.0, y], &mut c, &[0, r]),
            (false, Some(r)) => encode_block::<false, true>(&[1.0, y], &mut c, &[0, r]),
        };
        assert_eq!(s, 1.0);
        c[1]
    }

    /// Magnitudes in increasing order with their codes.
    fn ladder(signed: bool) -> Vec<(f32, u8)> {
        (0..=top(signed))
            .map(|c| (value(c as u8, signed), c as u8))
            .collect()
    }

    #[test]
    fn every_code_is_a_float_with_three_mantissa_bits() {
        for signed in [true, false] {
            let l = ladder(signed);
            assert_eq!(l[0].0, 0.0);
            assert_eq!(l.last().map(|x| x.0), Some(1.0));
            assert!(l.windows(2).all(|w| w[0].0 < w[1].0), "increasing");
            for &(v, _) in &l[1..] {
                assert_eq!(
                    v.to_bits() & ((1 << SHIFT) - 1),
                    0,
                    "{v}: three mantissa bits"
                );
            }
            // Each code is within an eighth of its binade of the next.
            for w in l[1..].windows(2) {
                assert!(w[1].0 / w[0].0 <= 1.125 + 1e-6, "{} -> {}", w[0].0, w[1].0);
            }
            let smallest = if signed {
                1.25 * 2f32.powi(-16)
            } else {
                1.25 * 2f32.powi(-32)
            };
            assert_eq!(l[1].0, smallest);
            if signed {
                for (v, c) in l {
                    assert_eq!(value(c | 0x80, true), -v);
                }
            }
        }
    }

    /// Quotients to try: every code, the midpoints of neighbours and a float either side of each,
    /// and a spread of magnitudes down to below the smallest code.
    fn probes(signed: bool) -> Vec<f32> {
        let l = ladder(signed);
        let mut y = Vec::new();
        for w in l.windows(2) {
            let mid = (w[0].0 + w[1].0) / 2.0;
            for v in [w[0].0, mid, w[1].0] {
                y.extend([
                    v,
                    f32::from_bits(v.to_bits().saturating_sub(1)),
                    f32::from_bits(v.to_bits() + 1),
                ]);
            }
        }
        let mut z = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..20_000 {
            z ^= z << 13;
            z ^= z >> 7;
            z ^= z << 17;
            let e = (z >> 40) % 40;
            y.push((z as u32 >> 9) as f32 / (1u32 << 23) as f32 * 2f32.powi(-(e as i32)));
        }
        y.retain(|v| (0.0..=1.0).contains(v));
        y
    }

    #[test]
    fn rounding_to_nearest_takes_the_nearest_code_ties_up() {
        for signed in [true, false] {
            let l = ladder(signed);
            for y in probes(signed) {
                // The nearest by a search over every code (ties to the larger).
                let mut best = l[0];
                for &(v, c) in &l {
                    if (y - v).abs() <= (y - best.0).abs() {
                        best = (v, c);
                    }
                }
                assert_eq!(code_of(y, signed, None), best.1, "{y:e} (signed {signed})");
                if signed && best.1 != 0 {
                    assert_eq!(code_of(-y, true, None), best.1 | 0x80, "-{y:e}");
                }
            }
        }
    }

    #[test]
    fn stochastic_rounding_is_unbiased_and_brackets() {
        for signed in [true, false] {
            let l = ladder(signed);
            for y in probes(signed).into_iter().step_by(37) {
                if y < l[1].0 {
                    continue;
                }
                let i = l.iter().rposition(|&(v, _)| v <= y).unwrap_or(0);
                let (lo, hi) = (l[i], l[(i + 1).min(l.len() - 1)]);
                let mut sum = 0f64;
                for r in 0..=0xFFFFu32 {
                    // High bits of the word are not used.
                    let c = code_of(y, signed, Some(r | 0xABCD_0000));
                    assert!(
                        c == lo.1 || c == hi.1,
                        "{y:e}: code {c} outside [{}, {}]",
                        lo.1,
                        hi.1
                    );
                    sum += f64::from(value(c, signed));
                }
                let mean = sum / 65536.0;
                let gap = f64::from(hi.0 - lo.0);
                assert!(
                    (mean - f64::from(y)).abs() <= gap / 65536.0 + 1e-12 * f64::from(y),
                    "{y:e}: mean {mean:e}"
                );
            }
        }
    }

    #[test]
    fn a_positive_value_never_rounds_stochastically_to_zero() {
        for signed in [true, false] {
            let first = value(1, signed);
            for y in [
                1e-30f32,
                first * 1e-6,
                first * 0.49,
                first * 0.5,
                first * 0.99,
            ] {
                for r in [0u32, 1, 0x7FFF, 0xFFFF] {
                    assert_eq!(code_of(y, signed, Some(r)), 1, "{y:e}, word {r}");
                }
            }
            // To nearest: 0 below half the smallest code, the smallest code from there.
            assert_eq!(code_of(first * 0.49, signed, None), 0);
            assert_eq!(code_of(first * 0.5, signed, None), 1);
            assert_eq!(code_of(0.0, signed, Some(0xFFFF)), 0);
        }
    }

    #[test]
    fn blocks_that_are_not_finite_or_below_normal_floats() {
        let mut c = [7u8; 3];
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let s = encode_block::<true, false>(&[1.0, bad, -2.0], &mut c, &[]);
            assert!(s.is_nan() && c == [0; 3]);
            let s = encode_block::<false, true>(&[1.0, bad, 2.0], &mut c, &[1, 2, 3]);
            assert!(s.is_nan() && c == [0; 3]);
        }
        for tiny in [0.0f32, 1e-40, -1e-39] {
            c = [7; 3];
            assert_eq!(
                encode_block::<true, false>(&[tiny, 0.0, -tiny], &mut c, &[]),
                0.0
            );
            assert_eq!(c, [0; 3]);
        }
        // The block's largest magnitude is its scale, and that element's code is the top one.
        let s = encode_block::<true, false>(&[0.25, -3.0, 1.5], &mut c, &[]);
        assert_eq!((s, c[1]), (3.0, 0xFF));
        let mut y = [0f32; 3];
        decode_block::<true>(&c, s, &mut y);
        assert_eq!(y[1], -3.0);
    }

    #[test]
    fn the_legacy_maps_are_sorted_and_hold_zero_and_one() {
        for signed in [true, false] {
            let m = legacy_map(signed);
            assert!(m.windows(2).all(|w| w[0] < w[1]), "sorted, no duplicates");
            assert!(m.contains(&0.0) && m[255] == 1.0);
            assert_eq!(m[0] < 0.0, signed);
        }
    }
}
