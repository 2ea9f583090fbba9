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
//! `5.5e-7 * scale` signed). Rounded stochastically (the AdamW second moment), a positive value
//! never takes the code of 0: below the smallest code it is rounded up to it (see
//! [`Map::round_stochastic`]).
//!
//! Encoding rounds `x / scale` to the nearest map value (ties to the upper one), as a binary search
//! over the sorted map followed by a comparison with the midpoint would: a table indexed by the
//! sign, binade and top seven mantissa bits of the quotient gives the code at the start of its
//! bucket and where in the bucket the next code begins, so a code is one look-up and one integer
//! compare (checked on every float against the binary search). Decoding is a table look-up and a
//! multiply. On x86-64 the arithmetic runs eight or sixteen elements at a time (AVX2, AVX-512),
//! with the bits of the scalar code; AVX-512 looks up the encoder's tables with gathers, AVX2 one
//! element at a time (on CPUs with microcoded gathers, such as AMD's up to Zen 3, those are the
//! slower way). Where the CPU has AVX-512 VBMI, the map's values and gaps (decoding, and the two
//! look-ups of stochastic rounding) are looked up 64 codes at a time by byte permutes from the
//! tables' byte planes ([`Planes`]): on a Sapphire Rapids core this took the compact AdamW step
//! from 2.65 to 2.38 ns a parameter in cache, and from 1.30 to 1.13 on two threads out of it.
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

/// Binades of the encoder's table, per sign: magnitudes below `2^-23` share the first (no map
/// value's rounding boundary is that small), `[2^-23, 2^-22)` up to `[0.5, 1)` have one each, and
/// `[1, inf)` shares the last (every magnitude there takes the top code of its sign).
const BINADES: u32 = 25;
/// The biased exponent of the first binade with its own buckets (`2^-23`), minus one.
const LOW_EXP: u32 = 126 - 23;
/// Top mantissa bits that index a bucket within a binade: buckets `2^-7` of a binade wide, so
/// that none holds more than one rounding boundary (checked when the table is built).
const MANT_BITS: u32 = 7;
/// Entries of the encoder's table: the sign bit selects a half of `2^12` (of which the
/// `BINADES << MANT_BITS` = 3200 first are used).
const TABLE: usize = 2 << 12;

/// A map with its encoder's table.
///
/// The encoder rounds `x` to the nearest map value (ties to the upper one), which is a monotone
/// step function of `x`: code `c + 1` begins at the smallest float `t_c` with
/// `t_c - m[c] >= (m[c + 1] - m[c]) / 2`. The table cuts the floats into buckets (sign, binade,
/// top [`MANT_BITS`] mantissa bits) that hold at most one such `t_c` each, and stores for each
/// bucket the code of its smallest value (bits 16..24) and, in the low 16 bits, where in the
/// bucket the next code begins: the low 16 bits of `t_c` (in value order: complemented for a
/// negative bucket) minus one, or `0xFFFF` if the code does not change in the bucket. Encoding
/// is then one look-up and one compare, identical for scalar and vector code.
///
/// The unsigned map has a second table of the same form for the *floor* step function (code `c`
/// from `m[c]` on: the largest map value at or below `x`, code 0 below the map), and the gaps
/// `m[c + 1] - m[c]` (0 for the last code): stochastic rounding ([`Map::round_stochastic`]) is
/// then one look-up and one compare for the floor, and two look-ups and a compare for the step up.
pub(super) struct Map {
    pub(super) values: [f32; 256],
    table: Box<[u32; TABLE]>,
    floor: Option<Box<[u32; TABLE]>>,
    gaps: [f32; 256],
    /// `values` and `gaps` as byte planes, for look-ups by byte permutes ([`Planes`]).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    planes: Box<[Planes; 2]>,
}

/// A table of 256 `f32` as four byte planes (plane `k` holds byte `k` of every entry, in code
/// order): the look-up of 64 codes is then eight two-source byte permutes and the interleaving of
/// their bytes (`x86::lookup64`), where a gather loads each element on its own.
#[repr(C, align(64))]
pub(super) struct Planes([[u8; 256]; 4]);

impl Planes {
    fn new(t: &[f32; 256]) -> Planes {
        let mut p = [[0u8; 256]; 4];
        for (c, v) in t.iter().enumerate() {
            for (k, b) in v.to_le_bytes().into_iter().enumerate() {
                p[k][c] = b;
            }
        }
        Planes(p)
    }
}

/// The bucket of `x`'s bits `b` (see [`Map`]) and `x`'s low 16 bits in value order.
#[inline(always)]
fn bucket(b: u32) -> (usize, u32) {
    let sign = b >> 31;
    let exp = (b >> 23) & 0xFF;
    let binade = exp.saturating_sub(LOW_EXP).min(BINADES - 1);
    let top = (b >> 16) & ((1 << MANT_BITS) - 1);
    let low = (b ^ (((b as i32) >> 31) as u32)) & 0xFFFF;
    ((sign << 12 | binade << MANT_BITS | top) as usize, low)
}

impl Map {
    fn new(signed: bool) -> Map {
        let values = build(signed);
        let table = Self::table(&values, encode_by_search);
        // A signed map's floor steps at 0 (from -0.0 to the negative values), inside the bucket of
        // the smallest negative binades: only the unsigned map has the floor table.
        let floor = (!signed).then(|| Self::table(&values, floor_by_search));
        let mut gaps = [0f32; 256];
        for (c, g) in gaps.iter_mut().enumerate().take(255) {
            *g = values[c + 1] - values[c];
        }
        let planes = Box::new([Planes::new(&values), Planes::new(&gaps)]);
        Map {
            values,
            table,
            floor,
            gaps,
            planes,
        }
    }

    /// The table of the monotone step function `code` of the floats (see [`Map`]).
    fn table(values: &[f32; 256], code: fn(&[f32; 256], f32) -> u8) -> Box<[u32; TABLE]> {
        let mut table = Box::new([0u32; TABLE]);
        for sign in 0..2u32 {
            for binade in 0..BINADES {
                for top in 0..1u32 << MANT_BITS {
                    // The bucket's floats, ascending: low 16 bits in value order `l` -> bits.
                    // Binade 0 stands for every exponent up to `LOW_EXP`, the last binade for
                    // every one from 127 up: their buckets are checked over that whole range.
                    let (e_lo, e_hi) = match binade {
                        0 => (0, LOW_EXP),
                        b if b == BINADES - 1 => (LOW_EXP + b, 0xFE),
                        b => (LOW_EXP + b, LOW_EXP + b),
                    };
                    let at = |e: u32, l: u32| -> f32 {
                        let low = if sign == 1 { l ^ 0xFFFF } else { l };
                        f32::from_bits(sign << 31 | e << 23 | top << 16 | low)
                    };
                    // Value order within the bucket: for a negative sign, larger exponents are
                    // smaller values.
                    let (first, last) = if sign == 1 {
                        (at(e_hi, 0), at(e_lo, 0xFFFF))
                    } else {
                        (at(e_lo, 0), at(e_hi, 0xFFFF))
                    };
                    let c0 = code(values, first);
                    let c1 = code(values, last);
                    let entry = if c1 == c0 {
                        0xFFFF
                    } else {
                        assert!(
                            c1 == c0 + 1 && e_lo == e_hi,
                            "a bucket of the encoder's table holds two steps of its code"
                        );
                        // The smallest `l` of the bucket that takes code `c0 + 1` (monotone).
                        let (mut lo, mut hi) = (0u32, 0xFFFFu32);
                        while lo < hi {
                            let mid = (lo + hi) / 2;
                            if code(values, at(e_lo, mid)) > c0 {
                                hi = mid;
                            } else {
                                lo = mid + 1;
                            }
                        }
                        lo - 1
                    };
                    let (idx, _) = bucket(first.to_bits());
                    table[idx] = u32::from(c0) << 16 | entry;
                }
            }
        }
        table
    }

    /// The code of the map value nearest `x` (ties to the upper one); `x` below the map takes
    /// code 0, above it code 255. `x` must not be NaN.
    #[inline(always)]
    pub(super) fn encode(&self, x: f32) -> u8 {
        lookup(&self.table, x)
    }

    /// Stochastic rounding of `y` (not NaN) by the random word `r`, with this map's `floor`
    /// table (the unsigned map's [`Map::floor_table`]): between the map values `lo <= y < hi`
    /// around it, `hi` when `y - lo > u * (hi - lo)` with `u` the low 16 bits of `r` as a fraction
    /// in `[0, 1)`, so `hi` with probability `(y - lo) / (hi - lo)` to 2^-16 and the code is right
    /// on average. A value on the map (0 and 1 among them) keeps its code; one below the map takes
    /// code 0. Except: a positive value never takes code 0 (the map's 0). Below the smallest
    /// positive code (`3.25e-7` of the block's scale) it takes that code, rounded up: an AdamW
    /// second moment stored as 0 beside a first moment that is not makes an update of
    /// `m / eps`, thousands of times the update AdamW makes (whose `|m| / sqrt(v)` is bounded),
    /// where a second moment rounded up only slows that element.
    #[inline(always)]
    pub(super) fn round_stochastic(&self, floor: &[u32; TABLE], y: f32, r: u32) -> u8 {
        let c = lookup(floor, y) as usize;
        let u = (r & 0xFFFF) as f32 * SR_UNIT;
        let c = c + usize::from(y - self.values[c] > u * self.gaps[c]);
        c.max(usize::from(y > 0.0)) as u8
    }

    /// The floor table, which the unsigned map has.
    pub(super) fn floor_table(&self) -> Option<&[u32; TABLE]> {
        self.floor.as_deref()
    }
}

/// The code of `x` in an encoder's `table` (see [`Map`]): one look-up and one compare.
#[inline(always)]
fn lookup(table: &[u32; TABLE], x: f32) -> u8 {
    let (idx, low) = bucket(x.to_bits());
    let e = table[idx & (TABLE - 1)];
    ((e >> 16) + u32::from(low > (e & 0xFFFF))) as u8
}

/// The reference floor: the largest map value at or below `x` by binary search (code 0 if none).
/// `x` must not be NaN.
fn floor_by_search(m: &[f32; 256], x: f32) -> u8 {
    let mut c = 0usize;
    for step in [128usize, 64, 32, 16, 8, 4, 2, 1] {
        c += if x >= m[c + step] { step } else { 0 };
    }
    c as u8
}

/// `2^-16`: the weight of the lowest of the 16 random bits of [`Map::round_stochastic`].
const SR_UNIT: f32 = 1.0 / 65_536.0;

/// The reference encoder: a branch-free binary search over the sorted map for the largest value
/// at or below `x` (code 0 if none), then the nearer of it and the next value (ties to the upper
/// one). `x` must not be NaN.
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
    #[cfg(target_arch = "x86_64")]
    match super::kernel::isa() {
        // SAFETY: `isa()` found AVX-512 F/BW/VL/DQ and VBMI on this CPU.
        super::kernel::Isa::Avx512Vbmi => {
            return unsafe { x86::decode_vbmi(map, codes, scale, out) }
        }
        // SAFETY: `isa()` found AVX-512 F/BW/VL/DQ on this CPU.
        super::kernel::Isa::Avx512 => return unsafe { x86::decode_avx512(map, codes, scale, out) },
        // SAFETY: `isa()` found AVX2 and F16C on this CPU.
        super::kernel::Isa::Avx2 => return unsafe { x86::decode_avx2(map, codes, scale, out) },
        super::kernel::Isa::Base => {}
    }
    decode_scalar(map, codes, scale, out);
}

#[inline(always)]
fn decode_scalar(map: &Map, codes: &[u8], scale: f32, out: &mut [f32]) {
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
    encode_block_as::<false>(map, &map.table, x, codes, &[])
}

/// [`encode_block`] with stochastic rounding ([`Map::round_stochastic`]): `r` holds one random
/// word per element (with fewer words than elements the block is rounded to nearest). Used for a state whose small changes from step to step
/// would otherwise round back to the stored code every time (an AdamW second moment moves by a
/// thousandth of itself a step, far less than a code's width): rounded to nearest, such a state
/// stays where it was while the block's scale moves, and drifts; rounded stochastically, it is
/// right on average.
/// Only the unsigned map rounds stochastically (a signed one rounds to nearest here).
#[inline(always)]
pub(super) fn encode_block_sr(map: &Map, x: &[f32], codes: &mut [u8], r: &[u32]) -> f32 {
    match map.floor_table() {
        Some(floor) if r.len() >= x.len() => encode_block_as::<true>(map, floor, x, codes, r),
        _ => encode_block(map, x, codes),
    }
}

/// `floor` is read with `SR` only (any table otherwise).
#[inline(always)]
fn encode_block_as<const SR: bool>(
    map: &Map,
    floor: &[u32; TABLE],
    x: &[f32],
    codes: &mut [u8],
    r: &[u32],
) -> f32 {
    // The largest magnitude as the largest of the bits without the sign (the same order for
    // non-NaN floats; infinities and NaNs are the bits from 0x7F80_0000 up).
    let amax_bits = x
        .iter()
        .fold(0u32, |a, &v| a.max(v.to_bits() & 0x7FFF_FFFF));
    if amax_bits >= 0x7F80_0000 {
        codes.fill(0);
        return f32::NAN;
    }
    let amax = f32::from_bits(amax_bits);
    if amax == 0.0 {
        let zero = map.encode(0.0);
        codes.fill(zero);
        return 0.0;
    }
    #[cfg(target_arch = "x86_64")]
    match super::kernel::isa() {
        // SAFETY: `isa()` found AVX-512 F/BW/VL/DQ on this CPU.
        super::kernel::Isa::Avx512 => unsafe {
            x86::encode_avx512::<SR>(map, floor, x, amax, codes, r, false)
        },
        // SAFETY: `isa()` found AVX-512 F/BW/VL/DQ and VBMI on this CPU.
        super::kernel::Isa::Avx512Vbmi => unsafe {
            x86::encode_avx512::<SR>(map, floor, x, amax, codes, r, true)
        },
        // SAFETY: `isa()` found AVX2 and F16C on this CPU.
        super::kernel::Isa::Avx2 => unsafe {
            x86::encode_avx2::<SR>(map, floor, x, amax, codes, r)
        },
        super::kernel::Isa::Base => encode_scalar::<SR>(map, floor, x, amax, codes, r),
    }
    #[cfg(not(target_arch = "x86_64"))]
    encode_scalar::<SR>(map, floor, x, amax, codes, r);
    amax
}

/// `codes[i] = map.encode(x[i] / amax)`, or with `SR` rounded stochastically by `r[i]` (with
/// the `floor` table).
#[inline(always)]
fn encode_scalar<const SR: bool>(
    map: &Map,
    floor: &[u32; TABLE],
    x: &[f32],
    amax: f32,
    codes: &mut [u8],
    r: &[u32],
) {
    if SR {
        for ((c, &v), &r) in codes.iter_mut().zip(x).zip(r) {
            *c = map.round_stochastic(floor, v / amax, r);
        }
    } else {
        for (c, &v) in codes.iter_mut().zip(x) {
            *c = map.encode(v / amax);
        }
    }
}

/// The block codec in AVX2 and AVX-512: the scalar code's operations, eight or sixteen lanes at
/// a time (the look-ups are gathers), the same bits.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Map, Planes, BINADES, BLOCK, LOW_EXP, MANT_BITS, TABLE};
    use std::arch::x86_64::*;

    /// The table indices and the low 16 bits in value order of the eight floats of bits `b` (one
    /// per 32-bit lane), as [`super::bucket`].
    #[inline]
    #[target_feature(enable = "avx2")]
    fn bucket8(b: __m256i) -> (__m256i, __m256i) {
        let sign = _mm256_srli_epi32::<31>(b);
        let exp = _mm256_and_si256(_mm256_srli_epi32::<23>(b), _mm256_set1_epi32(0xFF));
        let binade = _mm256_min_epi32(
            _mm256_max_epi32(
                _mm256_sub_epi32(exp, _mm256_set1_epi32(LOW_EXP as i32)),
                _mm256_setzero_si256(),
            ),
            _mm256_set1_epi32(BINADES as i32 - 1),
        );
        let top = _mm256_and_si256(
            _mm256_srli_epi32::<16>(b),
            _mm256_set1_epi32((1 << MANT_BITS) - 1),
        );
        let idx = _mm256_or_si256(
            _mm256_or_si256(
                _mm256_slli_epi32::<12>(sign),
                _mm256_slli_epi32::<{ MANT_BITS as i32 }>(binade),
            ),
            top,
        );
        let low = _mm256_and_si256(
            _mm256_xor_si256(b, _mm256_srai_epi32::<31>(b)),
            _mm256_set1_epi32(0xFFFF),
        );
        (idx, low)
    }

    /// The codes of eight floats from their table entries `e` and low 16 bits `low`, as
    /// [`Map::encode`], one per 32-bit lane.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn codes8_wide(e: __m256i, low: __m256i) -> __m256i {
        let base = _mm256_srli_epi32::<16>(e);
        // `low > boundary` is -1 (both below 2^16: the signed compare is the unsigned one).
        let up = _mm256_cmpgt_epi32(low, _mm256_and_si256(e, _mm256_set1_epi32(0xFFFF)));
        _mm256_sub_epi32(base, up)
    }

    /// [`codes8_wide`] packed into the low eight bytes.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn codes8(e: __m256i, low: __m256i) -> __m128i {
        let c = codes8_wide(e, low);
        let w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256::<1>(c));
        _mm_packus_epi16(w, w)
    }

    /// [`super::encode_scalar`] in AVX2, in three passes over the block: the quotients' table
    /// indices and low bits eight at a time, the table look-ups one element at a time (cheaper
    /// than gathers on CPUs whose gathers are microcoded), the codes eight at a time. With `SR`,
    /// the scalar code's stochastic rounding (with the `floor` table) by `r`.
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn encode_avx2<const SR: bool>(
        map: &Map,
        floor: &[u32; TABLE],
        x: &[f32],
        amax: f32,
        codes: &mut [u8],
        r: &[u32],
    ) {
        let n = x.len().min(codes.len());
        if SR {
            let n = n.min(r.len());
            for ((x, codes), r) in x[..n]
                .chunks(BLOCK)
                .zip(codes[..n].chunks_mut(BLOCK))
                .zip(r[..n].chunks(BLOCK))
            {
                // SAFETY: the caller's CPU has AVX2.
                unsafe { encode_sr_avx2_chunk(map, floor, x, amax, codes, r) };
            }
            return;
        }
        for (x, codes) in x[..n].chunks(BLOCK).zip(codes[..n].chunks_mut(BLOCK)) {
            // SAFETY: the caller's CPU has AVX2.
            unsafe { encode_avx2_chunk(map, x, amax, codes) };
        }
    }

    /// [`encode_avx2`]'s stochastic rounding over at most [`BLOCK`] elements, in three passes:
    /// the quotients and their buckets eight at a time; the floor codes, map values and gaps one
    /// element at a time (three dependent loads, cheaper than gathers on CPUs whose gathers are
    /// microcoded); the step up by the random words eight at a time.
    ///
    /// # Safety
    /// The CPU must have AVX2; `r` must hold as many words as `x` has elements.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn encode_sr_avx2_chunk(
        map: &Map,
        floor: &[u32; TABLE],
        x: &[f32],
        amax: f32,
        codes: &mut [u8],
        r: &[u32],
    ) {
        let n = x.len().min(codes.len()).min(r.len()).min(BLOCK);
        let whole = n / 8 * 8;
        let a = _mm256_set1_ps(amax);
        // Scratch written before it is read (the first `whole` elements only), so not zeroed.
        let mut ys = std::mem::MaybeUninit::<[f32; BLOCK]>::uninit();
        let mut idx = std::mem::MaybeUninit::<[u32; BLOCK]>::uninit();
        let mut low = std::mem::MaybeUninit::<[u32; BLOCK]>::uninit();
        let mut lo = std::mem::MaybeUninit::<[f32; BLOCK]>::uninit();
        let mut gap = std::mem::MaybeUninit::<[f32; BLOCK]>::uninit();
        let (ys_ptr, idx_ptr, low_ptr, lo_ptr, gap_ptr) = (
            ys.as_mut_ptr().cast::<f32>(),
            idx.as_mut_ptr().cast::<u32>(),
            low.as_mut_ptr().cast::<u32>(),
            lo.as_mut_ptr().cast::<f32>(),
            gap.as_mut_ptr().cast::<f32>(),
        );
        let mut i = 0;
        while i < whole {
            // SAFETY: `i + 8 <= whole <= n`, within `x` and the arrays (of `BLOCK >= n`).
            unsafe {
                let y = _mm256_div_ps(_mm256_loadu_ps(x.as_ptr().add(i)), a);
                let (ix, l) = bucket8(_mm256_castps_si256(y));
                _mm256_storeu_ps(ys_ptr.add(i), y);
                _mm256_storeu_si256(idx_ptr.add(i).cast(), ix);
                _mm256_storeu_si256(low_ptr.add(i).cast(), l);
            }
            i += 8;
        }
        // SAFETY: the loop above wrote the first `whole` elements of `idx` and `low`.
        let (idx, low) = unsafe {
            (
                std::slice::from_raw_parts_mut(idx_ptr, whole),
                std::slice::from_raw_parts(low_ptr, whole),
            )
        };
        for (k, (c, &l)) in idx.iter_mut().zip(low).enumerate() {
            // As `super::lookup`: every index is below the table's length (the mask states it).
            let e = floor[*c as usize & (TABLE - 1)];
            let code = ((e >> 16) + u32::from(l > (e & 0xFFFF))) as usize & 0xFF;
            *c = code as u32;
            // SAFETY: `k < whole`, within both arrays.
            unsafe {
                *lo_ptr.add(k) = map.values[code];
                *gap_ptr.add(k) = map.gaps[code];
            }
        }
        let mut i = 0;
        while i < whole {
            // SAFETY: `i + 8 <= whole <= n`, within `codes`, `r` and the written part of every
            // array.
            unsafe {
                let words = _mm256_loadu_si256(r.as_ptr().add(i).cast());
                let u = _mm256_mul_ps(
                    _mm256_cvtepi32_ps(_mm256_and_si256(words, _mm256_set1_epi32(0xFFFF))),
                    _mm256_set1_ps(super::SR_UNIT),
                );
                let y = _mm256_loadu_ps(ys_ptr.add(i));
                let d = _mm256_sub_ps(y, _mm256_loadu_ps(lo_ptr.add(i)));
                let t = _mm256_mul_ps(u, _mm256_loadu_ps(gap_ptr.add(i)));
                // All ones where `d > t` (ordered): subtracting -1 steps the code up.
                let step = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GT_OQ>(d, t));
                let c = _mm256_sub_epi32(_mm256_loadu_si256(idx.as_ptr().add(i).cast()), step);
                // A positive value never takes code 0: at least 1 where `y > 0`.
                let pos = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GT_OQ>(y, _mm256_setzero_ps()));
                let c = _mm256_max_epu32(c, _mm256_and_si256(pos, _mm256_set1_epi32(1)));
                let w =
                    _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256::<1>(c));
                _mm_storel_epi64(codes.as_mut_ptr().add(i).cast(), _mm_packus_epi16(w, w));
            }
            i += 8;
        }
        super::encode_scalar::<true>(
            map,
            floor,
            &x[whole..n],
            amax,
            &mut codes[whole..n],
            &r[whole..n],
        );
    }

    /// [`encode_avx2`] over at most [`BLOCK`] elements.
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn encode_avx2_chunk(map: &Map, x: &[f32], amax: f32, codes: &mut [u8]) {
        let n = x.len().min(codes.len()).min(BLOCK);
        let whole = n / 8 * 8;
        let a = _mm256_set1_ps(amax);
        // Scratch written before it is read (the first `whole` elements only), so not zeroed.
        let mut idx = std::mem::MaybeUninit::<[u32; BLOCK]>::uninit();
        let mut low = std::mem::MaybeUninit::<[u32; BLOCK]>::uninit();
        let (idx_ptr, low_ptr) = (
            idx.as_mut_ptr().cast::<u32>(),
            low.as_mut_ptr().cast::<u32>(),
        );
        let mut i = 0;
        while i < whole {
            // SAFETY: `i + 8 <= whole <= n`, within `x` and both arrays (of `BLOCK >= n`).
            unsafe {
                let y = _mm256_div_ps(_mm256_loadu_ps(x.as_ptr().add(i)), a);
                let (ix, lo) = bucket8(_mm256_castps_si256(y));
                _mm256_storeu_si256(idx_ptr.add(i).cast(), ix);
                _mm256_storeu_si256(low_ptr.add(i).cast(), lo);
            }
            i += 8;
        }
        // SAFETY: the loop above wrote the first `whole` elements of `idx`.
        let idx = unsafe { std::slice::from_raw_parts_mut(idx_ptr, whole) };
        let table = &map.table;
        for e in idx.iter_mut() {
            // Every index is below 2 << 12 = the table's length (sign bit 12, binade below 2^5
            // at bit 7, top below 2^7): the mask only states it.
            *e = table[*e as usize & (TABLE - 1)];
        }
        let mut i = 0;
        while i + 32 <= whole {
            // SAFETY: `i + 32 <= whole <= n`, within `codes` and the written part of both arrays.
            unsafe {
                let c = |k: usize| {
                    let e = _mm256_loadu_si256(idx.as_ptr().add(i + k).cast());
                    let lo = _mm256_loadu_si256(low_ptr.add(i + k).cast());
                    codes8_wide(e, lo)
                };
                // Packing works within 128-bit lanes: bytes come out in the order of dwords
                // 0-3 of a, b, c, d then 4-7 of each; the permute restores element order.
                let ab = _mm256_packus_epi32(c(0), c(8));
                let cd = _mm256_packus_epi32(c(16), c(24));
                let bytes = _mm256_packus_epi16(ab, cd);
                let ordered =
                    _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                _mm256_storeu_si256(codes.as_mut_ptr().add(i).cast(), ordered);
            }
            i += 32;
        }
        while i < whole {
            // SAFETY: `i + 8 <= whole <= n`, within `codes` and the written part of both arrays.
            unsafe {
                let e = _mm256_loadu_si256(idx.as_ptr().add(i).cast());
                let lo = _mm256_loadu_si256(low_ptr.add(i).cast());
                _mm_storel_epi64(codes.as_mut_ptr().add(i).cast(), codes8(e, lo));
            }
            i += 8;
        }
        let table = &map.table;
        super::encode_scalar::<false>(map, table, &x[whole..n], amax, &mut codes[whole..n], &[]);
    }

    /// [`super::decode_scalar`] for AVX2: one look-up per element (cheaper than gathers on CPUs
    /// whose gathers are microcoded), the same multiply.
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn decode_avx2(map: &Map, codes: &[u8], scale: f32, out: &mut [f32]) {
        super::decode_scalar(map, codes, scale, out);
    }

    /// `x / amax` for sixteen lanes, with the bits of the division (`r` = `1 / amax`, `fast` as in
    /// [`encode_avx512`]).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn quotient16(v: __m512, a: __m512, r: __m512, fast: bool) -> __m512 {
        if fast {
            let q = _mm512_mul_ps(v, r);
            let q = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, a, v), r, q);
            _mm512_fmadd_ps(_mm512_fnmadd_ps(q, a, v), r, q)
        } else {
            _mm512_div_ps(v, a)
        }
    }

    /// The codes of sixteen quotients `y` in an encoder's `table` (see [`Map`]), as
    /// [`super::lookup`]: the bucket's entry by a gather, then one compare.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F; `table` is an encoder's table.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn lookup16(table: &[u32; TABLE], y: __m512) -> __m512i {
        let b = _mm512_castps_si512(y);
        let sign = _mm512_srli_epi32::<31>(b);
        let exp = _mm512_and_si512(_mm512_srli_epi32::<23>(b), _mm512_set1_epi32(0xFF));
        let binade = _mm512_min_epi32(
            _mm512_max_epi32(
                _mm512_sub_epi32(exp, _mm512_set1_epi32(LOW_EXP as i32)),
                _mm512_setzero_si512(),
            ),
            _mm512_set1_epi32(BINADES as i32 - 1),
        );
        let top = _mm512_and_si512(
            _mm512_srli_epi32::<16>(b),
            _mm512_set1_epi32((1 << MANT_BITS) - 1),
        );
        let idx = _mm512_or_si512(
            _mm512_or_si512(
                _mm512_slli_epi32::<12>(sign),
                _mm512_slli_epi32::<{ MANT_BITS }>(binade),
            ),
            top,
        );
        let low16 = _mm512_set1_epi32(0xFFFF);
        let low = _mm512_and_si512(_mm512_xor_si512(b, _mm512_srai_epi32::<31>(b)), low16);
        // SAFETY: every index is below `TABLE` (sign bit 12, binade below 2^5 at bit 7, top below
        // 2^7).
        let e = unsafe { _mm512_i32gather_epi32::<4>(idx, table.as_ptr().cast()) };
        let up = _mm512_cmpgt_epi32_mask(low, _mm512_and_si512(e, low16));
        let base = _mm512_srli_epi32::<16>(e);
        _mm512_mask_add_epi32(base, up, base, _mm512_set1_epi32(1))
    }

    /// The uniform fractions `u` of [`Map::round_stochastic`] from sixteen random words.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn unit16(words: __m512i) -> __m512 {
        _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_and_si512(words, _mm512_set1_epi32(0xFFFF))),
            _mm512_set1_ps(super::SR_UNIT),
        )
    }

    /// [`super::encode_scalar`] in AVX-512 (with `SR`, rounded stochastically by `rand`; with
    /// `vbmi`, by [`encode_sr_vbmi`] where it can).
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, BW, VL and DQ, and VBMI if `vbmi`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c")]
    pub(super) unsafe fn encode_avx512<const SR: bool>(
        map: &Map,
        floor: &[u32; TABLE],
        x: &[f32],
        amax: f32,
        codes: &mut [u8],
        rand: &[u32],
        vbmi: bool,
    ) {
        let n = if SR {
            x.len().min(codes.len()).min(rand.len())
        } else {
            x.len().min(codes.len())
        };
        // `x / amax` without a division where `amax` is not tiny: `q = x * (1 / amax)`, then
        // two corrections `q += (x - q * amax) * (1 / amax)` with the remainder computed exactly
        // by a fused multiply-add; the first brings `q` within one ulp of the quotient, the second
        // rounds it correctly (Markstein's theorem: a correctly rounded reciprocal, a `q` within
        // one ulp, no underflow), so `y` has the bits of the division. From `amax >= 2^-64` on,
        // every remainder that matters is exact (a quotient below 2^-26 codes as 0 whatever its
        // last bits: see `BINADES`).
        let fast = amax >= f32::from_bits(0x1F80_0000);
        let a = _mm512_set1_ps(amax);
        let r = _mm512_set1_ps(1.0 / amax);
        let mut i = 0;
        if SR && n >= 64 && vbmi {
            // SAFETY: the caller's CPU has AVX-512 F/BW/VL/DQ and VBMI; `n` is within `x`,
            // `codes` and `rand`.
            i = unsafe { encode_sr_vbmi(map, floor, &x[..n], amax, &mut codes[..n], rand) };
        }
        // With `SR` the floor's table gives the code below, then one step up by the random word.
        let table = if SR { floor } else { &map.table };
        while i + 16 <= n {
            // SAFETY: `i + 16 <= n`, within `x`, `codes` and (with `SR`) `rand`; the map's and
            // gaps' gathers index within 0..=255 (codes).
            unsafe {
                let y = quotient16(_mm512_loadu_ps(x.as_ptr().add(i)), a, r, fast);
                let mut c = lookup16(table, y);
                if SR {
                    // `Map::round_stochastic`, sixteen lanes at a time.
                    let lo = _mm512_i32gather_ps::<4>(c, map.values.as_ptr());
                    let gap = _mm512_i32gather_ps::<4>(c, map.gaps.as_ptr());
                    let u = unit16(_mm512_loadu_si512(rand.as_ptr().add(i).cast()));
                    let step = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(
                        _mm512_sub_ps(y, lo),
                        _mm512_mul_ps(u, gap),
                    );
                    let one = _mm512_set1_epi32(1);
                    c = _mm512_mask_add_epi32(c, step, c, one);
                    // A positive value never takes code 0.
                    let pos = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(y, _mm512_setzero_ps());
                    c = _mm512_mask_max_epu32(c, pos, c, one);
                }
                _mm_storeu_si128(codes.as_mut_ptr().add(i).cast(), _mm512_cvtepi32_epi8(c));
            }
            i += 16;
        }
        let tail = if SR {
            &rand[i.min(rand.len())..]
        } else {
            &[][..]
        };
        super::encode_scalar::<SR>(map, table, &x[i..n], amax, &mut codes[i..n], tail);
    }

    /// [`encode_avx512`]'s stochastic rounding over the whole multiples of 64 of a block (at most
    /// [`BLOCK`] elements): the quotients and their floor codes sixteen at a time, then the map
    /// values and gaps of the codes by byte permutes ([`lookup64`]) instead of two gathers, 64 at
    /// a time, and the step up. Returns how many elements it coded.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, BW, VL, DQ and VBMI; `rand` must hold `x.len()` words.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,f16c")]
    unsafe fn encode_sr_vbmi(
        map: &Map,
        floor: &[u32; TABLE],
        x: &[f32],
        amax: f32,
        codes: &mut [u8],
        rand: &[u32],
    ) -> usize {
        let n = x.len().min(codes.len()).min(BLOCK) / 64 * 64;
        let fast = amax >= f32::from_bits(0x1F80_0000);
        let a = _mm512_set1_ps(amax);
        let r = _mm512_set1_ps(1.0 / amax);
        let mut i = 0;
        while i < n {
            // SAFETY: `i + 64 <= n`, within `x`, `codes` and `rand` (the caller's `x.len()`
            // words).
            unsafe {
                let y: [__m512; 4] = std::array::from_fn(|k| {
                    quotient16(_mm512_loadu_ps(x.as_ptr().add(i + 16 * k)), a, r, fast)
                });
                let c: [__m128i; 4] =
                    std::array::from_fn(|k| _mm512_cvtepi32_epi8(lookup16(floor, y[k])));
                // The 64 floor codes in one vector (in registers: a store of four parts read
                // back whole would stall), then in `lookup64`'s order.
                let all = _mm512_inserti32x4::<3>(
                    _mm512_inserti32x4::<2>(
                        _mm512_inserti32x4::<1>(_mm512_castsi128_si512(c[0]), c[1]),
                        c[2],
                    ),
                    c[3],
                );
                let ordered = order64(all);
                let lo = lookup64(&map.planes[0], ordered);
                let gap = lookup64(&map.planes[1], ordered);
                for k in 0..4 {
                    let at = i + 16 * k;
                    let u = unit16(_mm512_loadu_si512(rand.as_ptr().add(at).cast()));
                    let step = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(
                        _mm512_sub_ps(y[k], _mm512_castsi512_ps(lo[k])),
                        _mm512_mul_ps(u, _mm512_castsi512_ps(gap[k])),
                    );
                    let one = _mm_set1_epi8(1);
                    let c = _mm_mask_add_epi8(c[k], step, c[k], one);
                    // A positive value never takes code 0.
                    let pos = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(y[k], _mm512_setzero_ps());
                    let p = codes.as_mut_ptr().add(at).cast::<__m128i>();
                    _mm_storeu_si128(p, _mm_mask_max_epu8(c, pos, c, one));
                }
            }
            i += 64;
        }
        n
    }

    /// The byte order that [`lookup64`] takes its 64 codes in: position `16l + 4k + i` holds the
    /// code of element `16k + 4l + i`, so that the interleaving of the looked-up bytes, which
    /// works within 128-bit lanes, gives the elements in order.
    const ORDER: [u8; 64] = {
        let mut o = [0u8; 64];
        let mut q = 0;
        while q < 64 {
            let (l, k, i) = (q / 16, q % 16 / 4, q % 4);
            o[q] = (16 * k + 4 * l + i) as u8;
            q += 1;
        }
        o
    };

    /// `t[c]` for the 64 codes `c` (in [`ORDER`]), as the bits of sixteen `f32` per vector in
    /// element order: per byte plane, two two-source byte permutes (codes below and from 128)
    /// and a blend by the code's top bit; then the planes' bytes interleaved into dwords.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, BW and VBMI.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    unsafe fn lookup64(t: &Planes, c: __m512i) -> [__m512i; 4] {
        let top = _mm512_movepi8_mask(c);
        let plane = |k: usize| {
            let p = t.0[k].as_ptr().cast::<__m512i>();
            // SAFETY: `Planes` is 64-byte aligned and each plane is four vectors of 64 bytes.
            let (a0, a1, a2, a3) = unsafe {
                (
                    _mm512_load_si512(p),
                    _mm512_load_si512(p.add(1)),
                    _mm512_load_si512(p.add(2)),
                    _mm512_load_si512(p.add(3)),
                )
            };
            let lo = _mm512_permutex2var_epi8(a0, c, a1);
            let hi = _mm512_permutex2var_epi8(a2, c, a3);
            _mm512_mask_blend_epi8(top, lo, hi)
        };
        let (b0, b1, b2, b3) = (plane(0), plane(1), plane(2), plane(3));
        let (w01l, w01h) = (_mm512_unpacklo_epi8(b0, b1), _mm512_unpackhi_epi8(b0, b1));
        let (w23l, w23h) = (_mm512_unpacklo_epi8(b2, b3), _mm512_unpackhi_epi8(b2, b3));
        [
            _mm512_unpacklo_epi16(w01l, w23l),
            _mm512_unpackhi_epi16(w01l, w23l),
            _mm512_unpacklo_epi16(w01h, w23h),
            _mm512_unpackhi_epi16(w01h, w23h),
        ]
    }

    /// 64 codes in element order put in [`lookup64`]'s order.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    fn order64(codes: __m512i) -> __m512i {
        // SAFETY: `ORDER` is 64 bytes.
        let order = unsafe { _mm512_loadu_si512(ORDER.as_ptr().cast()) };
        _mm512_permutexvar_epi8(order, codes)
    }

    /// [`super::decode_scalar`] by byte permutes ([`lookup64`]), 64 elements at a time.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, BW, VL, DQ and VBMI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,f16c")]
    pub(super) unsafe fn decode_vbmi(map: &Map, codes: &[u8], scale: f32, out: &mut [f32]) {
        let n = out.len().min(codes.len());
        let s = _mm512_set1_ps(scale);
        let mut i = 0;
        while i + 64 <= n {
            // SAFETY: `i + 64 <= n`, within both slices.
            unsafe {
                let c = order64(_mm512_loadu_si512(codes.as_ptr().add(i).cast()));
                let v = lookup64(&map.planes[0], c);
                for (k, v) in v.into_iter().enumerate() {
                    let o = out.as_mut_ptr().add(i + 16 * k);
                    _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_castsi512_ps(v), s));
                }
            }
            i += 64;
        }
        // SAFETY: the caller's CPU has AVX-512 F/BW/VL/DQ.
        unsafe { decode_avx512(map, &codes[i..n], scale, &mut out[i..n]) };
    }

    /// [`super::decode_scalar`] in AVX-512.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, BW, VL and DQ.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c")]
    pub(super) unsafe fn decode_avx512(map: &Map, codes: &[u8], scale: f32, out: &mut [f32]) {
        let n = out.len().min(codes.len());
        let s = _mm512_set1_ps(scale);
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: `i + 16 <= n`, within both slices; the codes index the map's 256 values.
            unsafe {
                let c = _mm512_cvtepu8_epi32(_mm_loadu_si128(codes.as_ptr().add(i).cast()));
                let v = _mm512_i32gather_ps::<4>(c, map.values.as_ptr());
                _mm512_storeu_ps(out.as_mut_ptr().add(i), _mm512_mul_ps(v, s));
            }
            i += 16;
        }
        super::decode_scalar(map, &codes[i..n], scale, &mut out[i..n]);
    }
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
    use crate::optim::kernel::{Isa, FORCE_ISA};

    /// The encoder this crate had before the table of rounding boundaries (kept as a second
    /// reference): a 64 KiB table indexed by the top 16 bits of `x`'s order key gives the largest
    /// code `j >= 1` at or below the bucket's start, two steps up find the largest code at or
    /// below `x`, then the nearer of it and the next.
    struct OldMap {
        values: [f32; 256],
        start: Vec<u8>,
    }

    fn order_key(x: f32) -> u32 {
        let b = (x + 0.0).to_bits();
        if b & 0x8000_0000 != 0 {
            !b
        } else {
            b | 0x8000_0000
        }
    }

    impl OldMap {
        fn new(signed: bool) -> OldMap {
            let values = build(signed);
            let keys: Vec<u32> = values.iter().map(|&v| order_key(v)).collect();
            let mut start = vec![0u8; 1 << 16];
            let mut j = 0usize;
            for (k, s) in start.iter_mut().enumerate() {
                let lo = (k as u32) << 16;
                while j < 255 && keys[j + 1] <= lo {
                    j += 1;
                }
                *s = j as u8;
            }
            OldMap { values, start }
        }

        fn encode(&self, x: f32) -> u8 {
            let m = &self.values;
            let mut c = self.start[(order_key(x) >> 16) as usize] as usize;
            for _ in 0..2 {
                c += usize::from(c < 255 && x >= m[(c + 1).min(255)]);
            }
            let c = c.min(255);
            let up = (c + 1).min(255);
            let (lo, hi) = (m[c], m[up]);
            (c + usize::from(x - lo >= (hi - lo) * 0.5 && up > c)) as u8
        }
    }

    /// A small deterministic generator (an LCG's top bits).
    fn lcg(z: &mut u64) -> u64 {
        *z = z
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *z >> 32
    }

    /// Values that probe the encoder: zeros, ones, denormals, infinities, every map value and
    /// its neighbours, every midpoint between map values and its neighbours, every bucket edge
    /// of the table, random values over thirty binades.
    fn probes(m: &[f32; 256]) -> Vec<f32> {
        let mut xs: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            -1.0,
            1.5,
            -1.5,
            2.0,
            -2.0,
            1e-30,
            -1e-30,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            f32::from_bits(1),
            f32::from_bits(0x8000_0001),
            f32::from_bits(0x007F_FFFF),
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        let near = |x: f32, xs: &mut Vec<f32>| {
            for d in -3i32..=3 {
                xs.push(f32::from_bits((x.to_bits() as i32).wrapping_add(d) as u32));
            }
        };
        for &v in m {
            near(v, &mut xs);
        }
        for w in m.windows(2) {
            near((w[0] + w[1]) * 0.5, &mut xs);
            near(w[0] + (w[1] - w[0]) * 0.5, &mut xs);
        }
        for b in 0..1u32 << 16 {
            near(f32::from_bits(b << 16), &mut xs);
        }
        let mut z = 0x1234_5678u64;
        for _ in 0..400_000 {
            let r = lcg(&mut z) as u32;
            let u = f32::from_bits(r & 0x807F_FFFF | 0x3F00_0000);
            let e = (lcg(&mut z) % 30) as i32;
            xs.push(u * 2f32.powi(-e));
        }
        xs.retain(|x| !x.is_nan());
        xs
    }

    #[test]
    fn the_table_encoder_equals_a_binary_search_and_the_old_encoder() {
        for signed in [true, false] {
            let mp = map(signed);
            let old = OldMap::new(signed);
            assert_eq!(old.values, mp.values);
            for x in probes(&mp.values) {
                let want = encode_by_search(&mp.values, x);
                assert_eq!(mp.encode(x), want, "x = {x:e} ({:#x})", x.to_bits());
                assert_eq!(old.encode(x), want, "old, x = {x:e}");
                if let Some(floor) = mp.floor_table() {
                    let want = floor_by_search(&mp.values, x);
                    assert_eq!(lookup(floor, x), want, "floor, x = {x:e}");
                }
            }
            assert_eq!(mp.floor_table().is_some(), !signed);
        }
    }

    /// Every non-NaN float (2^32 of them, on the rayon pool): `cargo test --release -p
    /// ramtorch-core -- --ignored every_float`.
    #[test]
    #[ignore = "minutes on a few cores"]
    fn every_float_encodes_as_the_binary_search_and_the_old_encoder() {
        use rayon::prelude::*;
        for signed in [true, false] {
            let mp = map(signed);
            let old = OldMap::new(signed);
            (0..1u32 << 16).into_par_iter().for_each(|hi| {
                for lo in 0..1u32 << 16 {
                    let x = f32::from_bits(hi << 16 | lo);
                    if x.is_nan() {
                        continue;
                    }
                    let want = encode_by_search(&mp.values, x);
                    assert_eq!(mp.encode(x), want, "x = {x:e}");
                    assert_eq!(old.encode(x), want, "old, x = {x:e}");
                    if let Some(floor) = mp.floor_table() {
                        assert_eq!(
                            lookup(floor, x),
                            floor_by_search(&mp.values, x),
                            "floor, {x:e}"
                        );
                    }
                }
            });
        }
    }

    /// Blocks whose quotients `x / amax` fall on and around the rounding boundaries of the maps,
    /// for scales over seventy binades (the vector encoders may divide by other means than a
    /// division): every instruction set gives the scalar code's codes.
    #[test]
    fn every_instruction_set_encodes_boundaries_alike() {
        boundaries_alike(60, 0x5555_1234);
    }

    /// As [`every_instruction_set_encodes_boundaries_alike`] over many more scales, on the rayon
    /// pool: `cargo test --release -p ramtorch-core -- --ignored many_scales`.
    #[test]
    #[ignore = "a minute on a few cores"]
    fn many_scales_encode_boundaries_alike() {
        use rayon::prelude::*;
        (0..256u64)
            .into_par_iter()
            .for_each(|k| boundaries_alike(40, k * 7919 + 1));
    }

    fn boundaries_alike(scales: usize, seed: u64) {
        let mut z = seed;
        let mut amaxes: Vec<f32> = vec![1.0, f32::from_bits(0x3FFF_FFFF), 3.0, 1e-3, 7e-21];
        for _ in 0..scales {
            let m = lcg(&mut z) as u32 & 0x007F_FFFF;
            let e = 127 - 70 + (lcg(&mut z) % 80) as u32;
            amaxes.push(f32::from_bits(e << 23 | m));
        }
        amaxes.extend([
            f32::from_bits(0x1F80_0000),
            f32::from_bits(0x1F7F_FFFF),
            1e-30,
        ]);
        let step = |x: f32, d: i32| f32::from_bits((x.to_bits() as i32).wrapping_add(d) as u32);
        for signed in [true, false] {
            let mp = map(signed);
            for &amax in &amaxes {
                let mut xs: Vec<f32> = Vec::new();
                for w in mp.values.windows(2) {
                    for d in -3..=3 {
                        let y = step((w[0] + w[1]) * 0.5, d);
                        for e in -2..=2 {
                            let v = step(y * amax, e);
                            if v.abs() <= amax {
                                xs.push(v);
                            }
                        }
                    }
                }
                for chunk in xs.chunks(BLOCK - 1) {
                    let mut x = chunk.to_vec();
                    x.push(amax);
                    let run = |isa: Isa| {
                        FORCE_ISA.with(|f| f.set(Some(isa)));
                        let mut codes = vec![0u8; x.len()];
                        let s = encode_block(mp, &x, &mut codes);
                        FORCE_ISA.with(|f| f.set(None));
                        (codes, s.to_bits())
                    };
                    let base = run(Isa::Base);
                    #[cfg(target_arch = "x86_64")]
                    for isa in [Isa::Avx2, Isa::Avx512, Isa::Avx512Vbmi] {
                        assert!(run(isa) == base, "{isa:?}, amax {amax:e}");
                    }
                }
            }
        }
    }

    /// Blocks through every instruction set the codec is compiled for: the same codes, scales and
    /// decoded values as the scalar code.
    /// Codes, scale bits and decoded bits of block `x` with the codec of instruction set `isa`.
    fn codec_on(mp: &Map, x: &[f32], isa: Isa, words: Option<&[u32]>) -> (Vec<u8>, u32, Vec<u32>) {
        FORCE_ISA.with(|f| f.set(Some(isa)));
        let mut codes = vec![0u8; x.len()];
        let s = match words {
            Some(r) => encode_block_sr(mp, x, &mut codes, r),
            None => encode_block(mp, x, &mut codes),
        };
        let mut y = vec![0f32; x.len()];
        decode_block(mp, &codes, s, &mut y);
        FORCE_ISA.with(|f| f.set(None));
        (codes, s.to_bits(), y.iter().map(|v| v.to_bits()).collect())
    }

    /// Decoding by byte permutes (`Isa::Avx512Vbmi`) and by gathers gives each code's map value
    /// times the scale, for every code at every position of 64 and the tails after them.
    #[test]
    fn every_code_decodes_alike_on_every_instruction_set() {
        let mut z = 0x00DE_C0DE_u64;
        for signed in [true, false] {
            let mp = map(signed);
            for len in [1usize, 16, 63, 64, 65, 127, 128, 200, 255, 256] {
                for round in 0..8 {
                    // Every code appears at every position across the rounds' rotations.
                    let codes: Vec<u8> = (0..len)
                        .map(|i| match round {
                            0 => i as u8,
                            1 => 255 - i as u8,
                            _ => lcg(&mut z) as u8,
                        })
                        .collect();
                    for scale in [1.0f32, 0.37, 3.5e-20, f32::NAN] {
                        let want: Vec<u32> = codes
                            .iter()
                            .map(|&c| (mp.values[c as usize] * scale).to_bits())
                            .collect();
                        let mut isas = vec![Isa::Base];
                        #[cfg(target_arch = "x86_64")]
                        isas.extend([Isa::Avx2, Isa::Avx512, Isa::Avx512Vbmi]);
                        for isa in isas {
                            FORCE_ISA.with(|f| f.set(Some(isa)));
                            let mut out = vec![0f32; len];
                            decode_block(mp, &codes, scale, &mut out);
                            FORCE_ISA.with(|f| f.set(None));
                            let got: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                            assert!(got == want, "{isa:?}, length {len}, scale {scale}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_instruction_set_codes_blocks_alike() {
        let mut z = 0x9876_5432u64;
        let mut blocks: Vec<Vec<f32>> = Vec::new();
        for len in [1usize, 7, 8, 15, 16, 17, 31, 33, 100, 255, 256] {
            for kind in 0..6 {
                let x: Vec<f32> = (0..len)
                    .map(|i| {
                        let r = lcg(&mut z) as u32;
                        let u = f32::from_bits(r & 0x807F_FFFF | 0x3F00_0000);
                        match kind {
                            0 => u,
                            1 => u * 2f32.powi(-((lcg(&mut z) % 30) as i32)),
                            2 => u.abs() * 1e-3,
                            3 if i == len / 2 => f32::from_bits(1),
                            3 => 0.0,
                            4 if i == 0 => f32::INFINITY,
                            _ => u * 1e30,
                        }
                    })
                    .collect();
                blocks.push(x);
            }
        }
        blocks.push(vec![-0.0; 256]);
        for signed in [true, false] {
            let mp = map(signed);
            for x in &blocks {
                let words: Vec<u32> = x.iter().map(|_| lcg(&mut z) as u32).collect();
                for sr in [None, Some(&words[..])] {
                    let run = |isa: Isa| codec_on(mp, x, isa, sr);
                    let base = run(Isa::Base);
                    for (i, (&c, &v)) in base.0.iter().zip(x).enumerate() {
                        if base.1 != f32::NAN.to_bits() && base.1 != 0 {
                            let y = v / f32::from_bits(base.1);
                            let near = encode_by_search(&mp.values, y);
                            // A signed map rounds to nearest even when asked for stochastic
                            // rounding.
                            if sr.is_none() || signed {
                                assert_eq!(c, near, "element {i}");
                            } else {
                                assert_sr_brackets(mp, y, c, i);
                            }
                        }
                    }
                    #[cfg(target_arch = "x86_64")]
                    for isa in [Isa::Avx2, Isa::Avx512, Isa::Avx512Vbmi] {
                        assert!(
                            run(isa) == base,
                            "{isa:?} differs from the scalar codec ({sr:?})"
                        );
                    }
                }
            }
        }
    }

    /// A stochastically rounded code is one of the two map values around `y` (the value itself
    /// when it is on the map; the map's end when `y` is past it).
    fn assert_sr_brackets(mp: &Map, y: f32, c: u8, i: usize) {
        let m = &mp.values;
        let c = c as usize;
        let ok = if m.contains(&y) {
            m[c] == y
        } else if y < m[0] {
            c == 0
        } else if y > m[255] {
            c == 255
        } else if y > 0.0 && y < m[1] {
            // A positive value never takes code 0.
            c == 1
        } else {
            (m[c] < y && c < 255 && y < m[c + 1]) || (c > 0 && m[c - 1] < y && y < m[c])
        };
        assert!(ok, "element {i}: {y} took code {c} ({})", m[c]);
    }

    /// Stochastic rounding (of the unsigned map) is right on average: over many random words the
    /// mean decoded value of a point between two map values is that point (within the sampling
    /// error), a point on the map always keeps its code, and the nearest code is not what every
    /// word gives. The scalar rule equals its definition from the nearest code and two map values
    /// (the GPU kernel's form).
    #[test]
    fn stochastic_rounding_is_unbiased() {
        let mut z = 0x5151_2026u64;
        let mp = map(false);
        let floor = mp
            .floor_table()
            .expect("the unsigned map has a floor table");
        let m = &mp.values;
        let by_definition = |y: f32, r: u32| -> u8 {
            let near = mp.encode(y) as usize;
            let c = near - usize::from(near > 0 && y < m[near]);
            let (lo, hi) = (m[c], m[(c + 1).min(255)]);
            let u = (r & 0xFFFF) as f32 * SR_UNIT;
            let c = c + usize::from(y - lo > u * (hi - lo));
            // A positive value never takes code 0.
            (if y > 0.0 { c.max(1) } else { c }) as u8
        };
        for c in (0..255).step_by(3) {
            for t in [0.0f32, 0.1, 0.37, 0.5, 0.93] {
                let y = m[c] + t * (m[c + 1] - m[c]);
                let trials = 20_000;
                let mut sum = 0f64;
                let mut ups = 0;
                for _ in 0..trials {
                    let r = lcg(&mut z) as u32;
                    let got = mp.round_stochastic(floor, y, r);
                    assert_eq!(got, by_definition(y, r), "code {c}, t {t}, word {r:#x}");
                    assert!(got as usize == c || got as usize == c + 1 || m[c] == y);
                    ups += usize::from(got as usize == c + 1);
                    sum += f64::from(m[got as usize]);
                }
                if c == 0 && t > 0.0 {
                    // Between 0 and the smallest positive code: rounded up, every time.
                    assert_eq!(ups, trials, "t {t}");
                    continue;
                }
                let w = f64::from(m[c + 1] - m[c]);
                let mean = sum / trials as f64;
                let p = (f64::from(y) - f64::from(m[c])) / w;
                // Binomial sampling error: 5 standard deviations of the mean.
                let tol = 5.0 * w * (p * (1.0 - p) / trials as f64).sqrt() + 1e-6 * w;
                assert!(
                    (mean - f64::from(y)).abs() <= tol,
                    "code {c}, t {t}: mean {mean} for {y}"
                );
                if t == 0.0 {
                    assert_eq!(ups, 0);
                } else {
                    assert!(
                        ups > 0 && ups < trials,
                        "code {c}, t {t}: {ups} of {trials}"
                    );
                }
            }
        }
        for y in [0.0f32, -0.0, 1.0, -1e-30, 2e-7] {
            for _ in 0..100 {
                let r = lcg(&mut z) as u32;
                assert_eq!(
                    mp.round_stochastic(floor, y, r),
                    by_definition(y, r),
                    "{y:e}"
                );
            }
        }
    }

    /// Blocks that mix edge values (zeros of both signs, denormals, the smallest normals, values
    /// spanning forty binades, the block's own maximum of either sign) at every length from 1 to
    /// [`BLOCK`], plus all-zero, non-finite and NaN blocks: every instruction set gives the scalar
    /// codec's codes, scale and decoded values, and the codes are the binary search's (rounded to
    /// nearest) or one of the two map values around the value (rounded stochastically).
    #[test]
    fn every_instruction_set_codes_edge_blocks_alike() {
        let mut z = 0x0bad_cafe_u64;
        let edges = [
            0.0,
            -0.0,
            f32::from_bits(1),
            f32::from_bits(0x8000_0001),
            f32::from_bits(0x007F_FFFF),
            -f32::MIN_POSITIVE,
            f32::MIN_POSITIVE,
        ];
        let mut blocks: Vec<Vec<f32>> = Vec::new();
        for len in 1..=BLOCK {
            let x: Vec<f32> = (0..len)
                .map(|_| {
                    let r = lcg(&mut z) as u32;
                    match r % 4 {
                        0 => edges[(r / 4) as usize % edges.len()],
                        _ => {
                            let u = f32::from_bits(lcg(&mut z) as u32 & 0x807F_FFFF | 0x3F00_0000);
                            u * 2f32.powi(-((lcg(&mut z) % 40) as i32))
                        }
                    }
                })
                .collect();
            blocks.push(x);
        }
        blocks.push(vec![0.0; BLOCK]);
        blocks.push(vec![0.0; 13]);
        blocks.push(vec![f32::from_bits(1); 9]);
        let mut x = vec![0.5f32; 100];
        x[57] = f32::NAN;
        blocks.push(x);
        let mut x = vec![-0.25f32; 40];
        x[39] = f32::NEG_INFINITY;
        blocks.push(x);
        for signed in [true, false] {
            let mp = map(signed);
            for x in &blocks {
                let words: Vec<u32> = x.iter().map(|_| lcg(&mut z) as u32).collect();
                for sr in [None, Some(&words[..])] {
                    let run = |isa: Isa| codec_on(mp, x, isa, sr);
                    let base = run(Isa::Base);
                    let scale = f32::from_bits(base.1);
                    if scale.is_finite() && scale != 0.0 {
                        for (i, (&c, &v)) in base.0.iter().zip(x).enumerate() {
                            if sr.is_none() || signed {
                                assert_eq!(c, encode_by_search(&mp.values, v / scale));
                            } else {
                                assert_sr_brackets(mp, v / scale, c, i);
                            }
                        }
                    }
                    #[cfg(target_arch = "x86_64")]
                    for isa in [Isa::Avx2, Isa::Avx512, Isa::Avx512Vbmi] {
                        assert!(run(isa) == base, "{isa:?}, length {}, {sr:?}", x.len());
                    }
                }
            }
        }
    }
}
