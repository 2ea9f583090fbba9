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
//! Encoding finds the largest map value at or below `x` (a 64 KiB table indexed by the top 16
//! bits of `x`'s order key gives a start a step or two below it) and rounds to the nearer of it
//! and the next value, as a binary search over the sorted map would; decoding is a table look-up and a multiply.
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
    &map(signed).values
}

/// The most map values in one bucket of [`Map`]'s table (the steps of an encode).
const STEPS: usize = 2;

/// A map with its encoder's bucket table: `start[k]` is the largest code `j >= 1` whose value's
/// order key is at most `k << 16` (0 if none), so that the largest code at or below any `x` in
/// bucket `k` is found by stepping up from `start[k]` (a step or two: buckets are finer than the
/// map's gaps but for its top values).
pub(super) struct Map {
    pub(super) values: [f32; 256],
    /// Indexed by the top 16 bits of a key: sized so that no index needs a bounds check.
    start: Box<[u8; 1 << 16]>,
}

/// A key of `x`'s bits whose integer order is the float order (for non-NaN `x`, -0 taken as +0).
#[inline(always)]
fn order_key(x: f32) -> u32 {
    let b = (x + 0.0).to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

impl Map {
    fn new(signed: bool) -> Map {
        let values = build(signed);
        let keys: Vec<u32> = values.iter().map(|&v| order_key(v)).collect();
        let mut start = Box::new([0u8; 1 << 16]);
        let mut j = 0usize;
        for (k, s) in start.iter_mut().enumerate() {
            let lo = (k as u32) << 16;
            while j < 255 && keys[j + 1] <= lo {
                j += 1;
            }
            *s = j as u8;
        }
        Map { values, start }
    }

    /// The code of the map value nearest `x` (ties to the upper one); `x` below the map takes
    /// code 0, above it code 255. `x` must not be NaN.
    #[inline(always)]
    pub(super) fn encode(&self, x: f32) -> u8 {
        let m = &self.values;
        // The largest code >= 1 whose value is <= x, else 0 (as a binary search over the map).
        // No bucket holds more than `STEPS` map values (checked in the tests): fixed, branch-free
        // steps.
        let mut c = self.start[(order_key(x) >> 16) as usize] as usize;
        for _ in 0..STEPS {
            c += usize::from(c < 255 && x >= m[(c + 1).min(255)]);
        }
        let c = c.min(255);
        let up = (c + 1).min(255);
        let (lo, hi) = (m[c], m[up]);
        // Branch-free, so that the loops over a block can use vector gathers.
        (c + usize::from(x - lo >= (hi - lo) * 0.5 && up > c)) as u8
    }
}

/// The map and encoder: `signed` (values in `[-1, 1]`) or unsigned (in `[0, 1]`).
pub(super) fn map(signed: bool) -> &'static Map {
    static SIGNED: OnceLock<Map> = OnceLock::new();
    static UNSIGNED: OnceLock<Map> = OnceLock::new();
    if signed {
        SIGNED.get_or_init(|| Map::new(true))
    } else {
        UNSIGNED.get_or_init(|| Map::new(false))
    }
}

/// Decodes one block: `out[i] = map[codes[i]] * scale`.
#[inline(always)]
pub(super) fn decode_block(map: &Map, codes: &[u8], scale: f32, out: &mut [f32]) {
    let m = &map.values;
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = m[c as usize] * scale;
    }
}

/// Encodes one block of `x` (at most [`BLOCK`] values) into `codes`; returns its scale, the largest
/// magnitude (NaN if any value is not finite, which decodes the whole block to NaN, as a NaN would
/// spread through an unquantized state).
#[inline(always)]
pub(super) fn encode_block(map: &Map, x: &[f32], codes: &mut [u8]) -> f32 {
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
        let zero = map.encode(0.0);
        codes.fill(zero);
        return 0.0;
    }
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = map.encode(v / amax);
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
    let map = map(signed);
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
    let map = map(signed);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference: a branch-free binary search over the sorted map, then round to nearest.
    fn encode_by_search(m: &[f32; 256], x: f32) -> u8 {
        let mut c = 0usize;
        for step in [128usize, 64, 32, 16, 8, 4, 2, 1] {
            c += if x >= m[c + step] { step } else { 0 };
        }
        let up = (c + 1).min(255);
        if x - m[c] >= (m[up] - m[c]) * 0.5 {
            up as u8
        } else {
            c as u8
        }
    }

    #[test]
    fn no_bucket_holds_more_than_steps_map_values() {
        for signed in [true, false] {
            let mp = map(signed);
            let mut per = std::collections::HashMap::new();
            for &v in &mp.values[1..] {
                *per.entry(order_key(v) >> 16).or_insert(0usize) += 1;
            }
            assert!(
                per.values().all(|&n| n <= STEPS),
                "{:?}",
                per.values().max()
            );
        }
    }

    #[test]
    fn the_bucketed_encoder_equals_a_binary_search() {
        for signed in [true, false] {
            let mp = map(signed);
            let mut xs: Vec<f32> = vec![0.0, -0.0, 1.0, -1.0, 1.5, -1.5, 1e-30, -1e-30];
            for &v in mp.values.iter() {
                for d in [-2i32, -1, 0, 1, 2] {
                    xs.push(f32::from_bits((v.to_bits() as i32 + d) as u32));
                }
            }
            for w in mp.values.windows(2) {
                let mid = (w[0] + w[1]) * 0.5;
                xs.extend([
                    mid,
                    f32::from_bits(mid.to_bits() + 1),
                    f32::from_bits(mid.to_bits() - 1),
                ]);
            }
            let mut z = 0x1234_5678u64;
            for _ in 0..200_000 {
                z = z
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = f32::from_bits((z >> 32) as u32 & 0x807F_FFFF | 0x3F00_0000);
                let e = ((z >> 8) % 30) as i32;
                xs.push(u * 2f32.powi(-e));
            }
            for x in xs.into_iter().filter(|x| !x.is_nan()) {
                assert_eq!(mp.encode(x), encode_by_search(&mp.values, x), "x = {x:e}");
            }
        }
    }
}
