//! The optimizer kernels against references in `f64`, the conversions against `half`, and the
//! properties of stochastic rounding, through the public API.

use ramtorch_core::optim::precision::*;
use ramtorch_core::optim::*;
use ramtorch_core::{Error, Result};

/// SplitMix64's increment and finaliser, for the tests' own random data.
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

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

#[test]
fn add_in_place_rounds_as_torch_does() {
    // Every dtype, on the rayon pool (more than one piece) and with special values: each element is
    // `a + b` in f32, rounded to nearest even for the 16-bit types (NaN stays a NaN).
    let mut rng = Rng(23);
    let n = 3 * (1 << 16) + 5;
    let mut x = rng.vec(n, 10.0);
    let y = rng.vec(n, 10.0);
    for (i, v) in [
        f32::NAN,
        f32::INFINITY,
        -f32::INFINITY,
        0.0,
        -0.0,
        1e-40,
        65504.0,
        3.4e38,
    ]
    .into_iter()
    .enumerate()
    {
        x[i] = v;
        x[n - 1 - i] = -v;
    }
    let mut f = x.clone();
    add_in_place(TensorMut::F32(&mut f), Tensor::F32(&y)).unwrap();
    for ((o, a), b) in f.iter().zip(&x).zip(&y) {
        let want = a + b;
        assert!(o.to_bits() == want.to_bits() || (o.is_nan() && want.is_nan()));
    }
    let (mut b, yb) = (bf(&x), bf(&y));
    add_in_place(TensorMut::BF16(&mut b), Tensor::BF16(&yb)).unwrap();
    for ((o, a), c) in b.iter().zip(bf(&x)).zip(&yb) {
        let want = bf16::from_f32(a.to_f32() + c.to_f32());
        assert!(
            *o == want || (o.is_nan() && want.is_nan()),
            "{a} + {c}: {o} != {want}"
        );
    }
    let (mut h, yh) = (hf(&x), hf(&y));
    add_in_place(TensorMut::F16(&mut h), Tensor::F16(&yh)).unwrap();
    for ((o, a), c) in h.iter().zip(hf(&x)).zip(&yh) {
        let want = f16::from_f32(a.to_f32() + c.to_f32());
        assert!(
            o.to_bits() == want.to_bits() || (o.is_nan() && want.is_nan()),
            "{a} + {c}"
        );
    }
    // Mismatched operands are refused, and nothing is written.
    let mut d = vec![1.0f32; 4];
    assert!(
        err_of(add_in_place(TensorMut::F32(&mut d), Tensor::F32(&[1.0; 3]))).contains("must match")
    );
    assert!(err_of(add_in_place(
        TensorMut::F32(&mut d),
        Tensor::BF16(&[bf16::ONE; 4])
    ))
    .contains("must match"));
    assert_eq!(d, vec![1.0f32; 4]);
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

// -----------------------------------------------------------------------------------------
// Out-of-place steps (`*_step_from`): the same bits as in place, and the old values untouched.

/// The operands of one step in one storage mode, as owned vectors.
#[derive(Clone, PartialEq, Debug)]
struct Operands {
    p32: Vec<f32>,
    pbf: Vec<bf16>,
    master: Vec<f32>,
    s32: [Vec<f32>; 2],
    sbf: [Vec<bf16>; 2],
}

fn operands(rng: &mut Rng, n: usize) -> Operands {
    let p = rng.vec(n, 1.0);
    Operands {
        pbf: bf(&p),
        master: p.clone(),
        p32: p,
        s32: [
            rng.vec(n, 0.1),
            rng.vec(n, 0.01).iter().map(|v| v.abs()).collect(),
        ],
        sbf: [
            bf(&rng.vec(n, 0.1)),
            bf(&rng.vec(n, 0.01).iter().map(|v| v.abs()).collect::<Vec<_>>()),
        ],
    }
}

/// Runs `rule` (0: AdamW, 1: SGD with momentum, 2: Lion) over `ops` in `mode` (0: f32 param, 1:
/// bf16 with stochastic rounding, 2: bf16 with an f32 master) with `bf16_states`, in place
/// (`old` None) or reading `old`.
fn step_mode(
    rule: usize,
    mode: usize,
    bf16_states: bool,
    ops: &mut Operands,
    g: &[f32],
    old: Option<&Operands>,
) -> Result<()> {
    let o = old.map(|o| Old {
        param: match mode {
            0 => Some(Tensor::F32(&o.p32)),
            1 => Some(Tensor::BF16(&o.pbf)),
            _ => None,
        },
        master: (mode == 2).then_some(&o.master[..]),
        comp: None,
        states: if bf16_states {
            [
                Some(Tensor::BF16(&o.sbf[0]).into()),
                Some(Tensor::BF16(&o.sbf[1]).into()),
            ]
        } else {
            [
                Some(Tensor::F32(&o.s32[0]).into()),
                Some(Tensor::F32(&o.s32[1]).into()),
            ]
        },
    });
    let mut o = o.unwrap_or_default();
    let Operands {
        p32,
        pbf,
        master,
        s32,
        sbf,
    } = ops;
    let (param, master) = match mode {
        0 => (TensorMut::F32(p32), None),
        1 => (TensorMut::BF16(pbf), None),
        _ => (TensorMut::BF16(pbf), Some(&mut master[..])),
    };
    let [s0, s1] = s32;
    let [b0, b1] = sbf;
    let (a, b) = if bf16_states {
        (TensorMut::BF16(b0), TensorMut::BF16(b1))
    } else {
        (TensorMut::F32(s0), TensorMut::F32(s1))
    };
    let g = Tensor::F32(g);
    match rule {
        0 => adamw_step_from(
            &AdamW {
                lr: 0.01,
                step: 3,
                seed: 7,
                ..AdamW::default()
            },
            param,
            master,
            g,
            a,
            b,
            &o,
        ),
        1 => {
            o.states[1] = None;
            let h = Sgd {
                lr: 0.1,
                momentum: 0.9,
                step: 3,
                seed: 7,
                ..Sgd::default()
            };
            sgd_step_from(&h, param, master, g, Some(a), &o)
        }
        _ => {
            o.states[1] = None;
            lion_step_from(
                &Lion {
                    lr: 0.01,
                    step: 3,
                    seed: 7,
                    ..Lion::default()
                },
                param,
                master,
                g,
                a,
                &o,
            )
        }
    }
}

#[test]
fn out_of_place_steps_equal_in_place_bitwise() {
    let mut rng = Rng(41);
    // Small (one piece, the calling thread) and large (pieces on the pool, an odd tail).
    for n in [1000, 3 * SERIAL_MAX + 77] {
        let g = rng.vec(n, 0.5);
        for rule in 0..3 {
            for mode in 0..3 {
                for bf16_states in [false, true] {
                    let before = operands(&mut rng, n);
                    let mut in_place = before.clone();
                    step_mode(rule, mode, bf16_states, &mut in_place, &g, None).unwrap();
                    // The destination starts as garbage: every value it ends with is computed.
                    let old = before.clone();
                    let mut out = operands(&mut rng, n);
                    step_mode(rule, mode, bf16_states, &mut out, &g, Some(&old)).unwrap();
                    assert_eq!(
                        old, before,
                        "rule {rule} mode {mode}: the old values changed"
                    );
                    let what = format!("rule {rule} mode {mode} bf16 states {bf16_states} n {n}");
                    match mode {
                        0 => assert_eq!(out.p32, in_place.p32, "{what}: param"),
                        1 => assert_eq!(out.pbf, in_place.pbf, "{what}: param"),
                        _ => {
                            assert_eq!(out.pbf, in_place.pbf, "{what}: param");
                            assert_eq!(out.master, in_place.master, "{what}: master");
                        }
                    }
                    let states = if rule == 0 { 2 } else { 1 };
                    for k in 0..states {
                        if bf16_states {
                            assert_eq!(out.sbf[k], in_place.sbf[k], "{what}: state {k}");
                        } else {
                            assert_eq!(out.s32[k], in_place.s32[k], "{what}: state {k}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn out_of_place_steps_check_their_old_values() {
    let n = 64;
    let (mut p, g, mut m, mut v) = (
        vec![1.0f32; n],
        vec![0.5f32; n],
        vec![0.0f32; n],
        vec![0.0f32; n],
    );
    let short = vec![0.0f32; n - 1];
    let bf_old = vec![bf16::ZERO; n];
    let h = AdamW {
        step: 1,
        ..AdamW::default()
    };
    let cases: [(Old<'_>, &str); 4] = [
        (
            Old {
                param: Some(Tensor::F32(&short)),
                ..Old::default()
            },
            "elements",
        ),
        (
            Old {
                states: [Some(Tensor::BF16(&bf_old).into()), None],
                ..Old::default()
            },
            "is bfloat16",
        ),
        (
            Old {
                master: Some(&short),
                ..Old::default()
            },
            "no master",
        ),
        (
            Old {
                param: Some(Tensor::BF16(&bf_old)),
                ..Old::default()
            },
            "is bfloat16",
        ),
    ];
    for (old, says) in cases {
        let err = adamw_step_from(
            &h,
            TensorMut::F32(&mut p),
            None,
            Tensor::F32(&g),
            TensorMut::F32(&mut m),
            TensorMut::F32(&mut v),
            &old,
        )
        .unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument(m) if m.contains(says)),
            "{err}"
        );
    }
    assert_eq!(p, vec![1.0f32; n], "a refused step changed nothing");
    // With master weights the param is written, not read: an old param is refused.
    let mut pb = vec![bf16::ONE; n];
    let mut master = vec![1.0f32; n];
    let old = Old {
        param: Some(Tensor::BF16(&bf_old)),
        ..Old::default()
    };
    let err = adamw_step_from(
        &h,
        TensorMut::BF16(&mut pb),
        Some(&mut master),
        Tensor::F32(&g),
        TensorMut::F32(&mut m),
        TensorMut::F32(&mut v),
        &old,
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("old master")),
        "{err}"
    );
}

/// One AdamW step of a bf16 tensor and its bf16 moments (stochastic rounding).
fn bf16_adamw(h: &AdamW, p: &mut [bf16], g: &[bf16], m: &mut [bf16], v: &mut [bf16]) {
    adamw_step(
        h,
        TensorMut::BF16(p),
        None,
        Tensor::BF16(g),
        TensorMut::BF16(m),
        TensorMut::BF16(v),
    )
    .unwrap();
}

/// A tensor updated in pieces (`index_offset`: each piece's first element in the whole tensor)
/// gets the bits of one whole update, stochastic rounding included.
#[test]
fn pieces_with_their_offsets_update_as_the_whole_tensor() {
    let n = 10_000;
    let x = |i: usize, k: f32| (i as f32 * 0.377 + k).sin() * 1.3;
    let init = |k: f32| -> Vec<bf16> { (0..n).map(|i| bf16::from_f32(x(i, k))).collect() };
    let (mut p, mut m, mut v) = (init(0.0), vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
    let (mut pp, mut mp, mut vp) = (p.clone(), m.clone(), v.clone());
    for t in 1..=3u64 {
        let g: Vec<bf16> = (0..n)
            .map(|i| bf16::from_f32(0.1 * x(i, t as f32)))
            .collect();
        let h = AdamW {
            step: t,
            seed: 5,
            ..AdamW::default()
        };
        bf16_adamw(&h, &mut p, &g, &mut m, &mut v);
        for (a, b) in [(0, 4096), (4096, 8192), (8192, n)] {
            let hp = AdamW {
                index_offset: a as u64,
                ..h
            };
            bf16_adamw(&hp, &mut pp[a..b], &g[a..b], &mut mp[a..b], &mut vp[a..b]);
        }
    }
    assert!(
        p == pp && m == mp && v == vp,
        "pieces differ from the whole update"
    );
    // Without the offset a piece would draw other words: the test can tell.
    let h = AdamW {
        step: 4,
        seed: 5,
        ..AdamW::default()
    };
    let g = init(4.0);
    let (mut p1, mut m1, mut v1) = (p.clone(), m.clone(), v.clone());
    let (mut p2, mut m2, mut v2) = (p.clone(), m.clone(), v.clone());
    bf16_adamw(
        &h,
        &mut p1[4096..],
        &g[4096..],
        &mut m1[4096..],
        &mut v1[4096..],
    );
    let h2 = AdamW {
        index_offset: 4096,
        ..h
    };
    bf16_adamw(
        &h2,
        &mut p2[4096..],
        &g[4096..],
        &mut m2[4096..],
        &mut v2[4096..],
    );
    assert!(p1 != p2 || m1 != m2 || v1 != v2);
}

#[test]
fn a_piece_across_a_multiple_of_2_pow_32_elements_is_refused() {
    let mut p = vec![0.0f32; 8];
    let (mut m, mut v) = (vec![0.0f32; 8], vec![0.0f32; 8]);
    let g = vec![0.5f32; 8];
    let h = AdamW {
        index_offset: (1u64 << 32) - 4,
        ..AdamW::default()
    };
    let err = adamw_step(
        &h,
        TensorMut::F32(&mut p),
        None,
        Tensor::F32(&g),
        TensorMut::F32(&mut m),
        TensorMut::F32(&mut v),
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("crosses a multiple of 2^32"),
        "{err}"
    );
}
