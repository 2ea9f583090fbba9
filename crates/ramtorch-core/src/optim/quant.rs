//! Block-wise 8-bit quantization of optimizer states: each block of [`BLOCK`] elements is stored as
//! one `f32` scale (the block's largest magnitude) and one byte per element, the index of the
//! nearest value of a 256-entry *dynamic map* to `x / scale`.
//!
//! The dynamic map (Dettmers, "8-bit approximations for parallelism in deep learning", 2016;
//! the map of bitsandbytes' and torchao's 8-bit optimizers) spends its codes on seven decades,
//! `[1e-7, 1e-6)` to `[0.1, 1)`, with more codes in the higher decades: the signed map has `2^i`
//! evenly spaced values in decade `i` (on each side of zero), the unsigned map `2^(i+1)`; both
//! hold exactly 0 and 1. Relative to the block's scale, a value in the top decade is stored within
//! 0.0071 (signed) or 0.0036 (unsigned), in the decade below within a tenth of that, and so on:
//! a value `x` with `|x| >= scale / 10` comes back within 7.1% of itself (signed) and 3.6%
//! (unsigned), anything down to `scale * 1e-6` within a few tens of percent, and smaller
//! magnitudes flush to the nearest of 0 and the smallest code (`3.25e-7 * scale` unsigned,
//! `5.5e-7 * scale` signed).
//!
//! Encoding is a branch-free binary search over the sorted map (8 comparisons) and a
//! round-to-nearest between the two neighbours; decoding is a table look-up and a multiply.
//! Both are pure functions of the block, so results do not depend on threads or chunking.

use std::sync::OnceLock;

/// Elements per quantization block (one `f32` scale each).
pub const BLOCK: usize = 256;

/// Number of scales of a tensor of `n` elements (the last block may be short).
pub const fn blocks(n: usize) -> usize {
    n.div_ceil(BLOCK)
}

fn build(signed: bool) -> [f32; 256] {
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

/// The dynamic map, sorted ascending: `qmap(true)` is signed (values in `[-1, 1]`),
/// `qmap(false)` unsigned (in `[0, 1]`).
pub fn qmap(signed: bool) -> &'static [f32; 256] {
    static SIGNED: OnceLock<[f32; 256]> = OnceLock::new();
    static UNSIGNED: OnceLock<[f32; 256]> = OnceLock::new();
    if signed {
        SIGNED.get_or_init(|| build(true))
    } else {
        UNSIGNED.get_or_init(|| build(false))
    }
}

/// The code of the map value nearest `x` (ties to the upper one); `x` outside the map's range
/// takes its end code, NaN takes code 0.
#[inline(always)]
fn encode(map: &[f32; 256], x: f32) -> u8 {
    // The largest code whose value is <= x (0 if none): indices stay below 256.
    let mut c = 0usize;
    for step in [128usize, 64, 32, 16, 8, 4, 2, 1] {
        c += if x >= map[c + step] { step } else { 0 };
    }
    let up = (c + 1).min(255);
    let (lo, hi) = (map[c], map[up]);
    if x - lo >= (hi - lo) * 0.5 {
        up as u8
    } else {
        c as u8
    }
}

/// Decodes one block: `out[i] = map[codes[i]] * scale`.
#[inline(always)]
pub(super) fn decode_block(map: &[f32; 256], codes: &[u8], scale: f32, out: &mut [f32]) {
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = map[c as usize] * scale;
    }
}

/// Encodes one block of `x` (at most [`BLOCK`] values) into `codes`; returns its scale, the largest
/// magnitude (NaN if any value is not finite, which decodes the whole block to NaN, as a NaN would
/// spread through an unquantized state).
#[inline(always)]
pub(super) fn encode_block(map: &[f32; 256], x: &[f32], codes: &mut [u8]) -> f32 {
    let mut amax = 0f32;
    let mut finite = true;
    for &v in x {
        amax = amax.max(v.abs());
        finite &= v.is_finite();
    }
    if !finite {
        codes.fill(0);
        return f32::NAN;
    }
    if amax == 0.0 {
        let zero = encode(map, 0.0);
        codes.fill(zero);
        return 0.0;
    }
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = encode(map, v / amax);
    }
    amax
}

/// Quantizes `x` block by block into `codes` (one per element) and `scales` (one per block,
/// [`blocks`]`(x.len())`), with the signed or the unsigned map. Lengths must match.
pub fn quantize(
    x: &[f32],
    codes: &mut [u8],
    scales: &mut [f32],
    signed: bool,
) -> crate::Result<()> {
    check(x.len(), codes.len(), scales.len())?;
    let map = qmap(signed);
    for ((xb, cb), s) in x
        .chunks(BLOCK)
        .zip(codes.chunks_mut(BLOCK))
        .zip(scales.iter_mut())
    {
        *s = encode_block(map, xb, cb);
    }
    Ok(())
}

/// Decodes `codes` and `scales` (as written by [`quantize`]) into `out`. Lengths must match.
pub fn dequantize(
    codes: &[u8],
    scales: &[f32],
    out: &mut [f32],
    signed: bool,
) -> crate::Result<()> {
    check(out.len(), codes.len(), scales.len())?;
    let map = qmap(signed);
    for ((ob, cb), &s) in out.chunks_mut(BLOCK).zip(codes.chunks(BLOCK)).zip(scales) {
        decode_block(map, cb, s, ob);
    }
    Ok(())
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
