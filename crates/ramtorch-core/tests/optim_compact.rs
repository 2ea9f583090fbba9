//! The compact storage formats through the public API: 8-bit block-quantized states
//! ([`StateMut::Q8`], [`quant`]) and the bf16 weight with a bf16 compensation
//! ([`ParamMut::Compensated`]).

use ramtorch_core::optim::precision::*;
use ramtorch_core::optim::quant::{self, blocks, BLOCK};
use ramtorch_core::optim::*;

/// A small deterministic generator (SplitMix64) for test data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

#[test]
fn round_trip_error_is_within_a_sixteenth() {
    let mut rng = Rng(3);
    for n in [1, 255, 256, 257, 1000, 3 * BLOCK + 7] {
        for signed in [true, false] {
            let x: Vec<f32> = (0..n)
                .map(|i| {
                    let v = rng.unit() * 10f32.powi((i % 7) as i32 - 3);
                    if signed {
                        v
                    } else {
                        v * v
                    }
                })
                .collect();
            let mut codes = vec![0u8; n];
            let mut scales = vec![0f32; blocks(n)];
            quant::quantize(&x, &mut codes, &mut scales, signed).unwrap();
            let mut y = vec![0f32; n];
            quant::dequantize(&codes, &scales, &mut y, signed).unwrap();
            // The smallest code, relative to the scale: below it a value may flush to 0.
            let first = quant::value(1, signed);
            for (b, (xb, yb)) in x.chunks(BLOCK).zip(y.chunks(BLOCK)).enumerate() {
                let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
                assert_eq!(scales[b], amax);
                for (u, v) in xb.iter().zip(yb) {
                    let bound = (u.abs() / 16.0).max(first * amax);
                    assert!((u - v).abs() <= bound * 1.0001, "{u} -> {v}");
                }
            }
        }
    }
    let mut codes = vec![0u8; 10];
    assert!(quant::quantize(&[0.0; 10], &mut codes, &mut [0.0; 2], true).is_err());
}

/// `steps` AdamW steps with compact storage (bf16 weight + compensation, 8-bit moments) over `n`
/// elements; returns the weight, compensation, codes and scales.
#[allow(clippy::type_complexity)]
fn compact_run(
    n: usize,
    steps: u64,
) -> (Vec<bf16>, Vec<bf16>, Vec<u8>, Vec<u8>, Vec<f32>, Vec<f32>) {
    let mut rng = Rng(11);
    let mut w: Vec<bf16> = (0..n).map(|_| bf16_rne(rng.unit())).collect();
    let mut c = vec![bf16::ZERO; n];
    let (mut m, mut v) = (vec![0u8; n], vec![0u8; n]);
    let (mut ms, mut vs) = (vec![0f32; blocks(n)], vec![0f32; blocks(n)]);
    for t in 1..=steps {
        let g: Vec<bf16> = (0..n).map(|_| bf16_rne(rng.unit())).collect();
        let h = AdamW {
            step: t,
            lr: 1e-3,
            ..AdamW::default()
        };
        adamw_update(
            &h,
            ParamMut::Compensated {
                param: &mut w,
                comp: &mut c,
            },
            Tensor::BF16(&g),
            StateMut::Q8 {
                codes: &mut m,
                scales: &mut ms,
            },
            StateMut::Q8 {
                codes: &mut v,
                scales: &mut vs,
            },
            &Old::default(),
        )
        .unwrap();
    }
    (w, c, m, v, ms, vs)
}

#[test]
fn compact_results_do_not_depend_on_the_number_of_threads() {
    let n = 200_001; // several pieces, a short last block
    let run = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(|| compact_run(n, 3))
    };
    let one = run(1);
    for threads in [2, 5] {
        assert!(one == run(threads), "{threads} threads differ from 1");
    }
}

#[test]
fn compact_out_of_place_equals_in_place_bitwise() {
    let n = 100_003;
    let (w, c, m, v, ms, vs) = compact_run(n, 2);
    let g: Vec<f32> = {
        let mut rng = Rng(5);
        (0..n).map(|_| rng.unit()).collect()
    };
    let h = AdamW {
        step: 3,
        weight_decay: 0.1,
        ..AdamW::default()
    };
    let (mut w1, mut c1, mut m1, mut v1, mut ms1, mut vs1) = (
        w.clone(),
        c.clone(),
        m.clone(),
        v.clone(),
        ms.clone(),
        vs.clone(),
    );
    adamw_update(
        &h,
        ParamMut::Compensated {
            param: &mut w1,
            comp: &mut c1,
        },
        Tensor::F32(&g),
        StateMut::Q8 {
            codes: &mut m1,
            scales: &mut ms1,
        },
        StateMut::Q8 {
            codes: &mut v1,
            scales: &mut vs1,
        },
        &Old::default(),
    )
    .unwrap();
    let (mut w2, mut c2, mut m2, mut v2) = (
        vec![bf16::ZERO; n],
        vec![bf16::ZERO; n],
        vec![0; n],
        vec![0; n],
    );
    let (mut ms2, mut vs2) = (vec![0f32; blocks(n)], vec![0f32; blocks(n)]);
    let old = Old {
        param: Some(Tensor::BF16(&w)),
        comp: Some(&c),
        states: [
            Some(State::Q8 {
                codes: &m,
                scales: &ms,
            }),
            Some(State::Q8 {
                codes: &v,
                scales: &vs,
            }),
        ],
        ..Old::default()
    };
    adamw_update(
        &h,
        ParamMut::Compensated {
            param: &mut w2,
            comp: &mut c2,
        },
        Tensor::F32(&g),
        StateMut::Q8 {
            codes: &mut m2,
            scales: &mut ms2,
        },
        StateMut::Q8 {
            codes: &mut v2,
            scales: &mut vs2,
        },
        &old,
    )
    .unwrap();
    assert!(w1 == w2 && c1 == c2 && m1 == m2 && v1 == v2);
    assert!(ms1
        .iter()
        .zip(&ms2)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    assert!(vs1
        .iter()
        .zip(&vs2)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
fn the_compensated_weight_tracks_an_fp32_master() {
    // Updates of about 1e-4 on weights near 1 (bf16's resolution there: 2^-8 = 0.004).
    let n = 4096;
    let mut rng = Rng(9);
    let w0: Vec<f32> = (0..n).map(|_| 1.0 + 0.01 * rng.unit()).collect();
    let mut master = w0.clone();
    let mut pm: Vec<bf16> = w0.iter().map(|&x| bf16_rne(x)).collect();
    let mut pc = pm.clone();
    let mut c: Vec<bf16> = w0
        .iter()
        .zip(&pc)
        .map(|(&x, &p)| bf16_rne(x - bf16_to_f32(p)))
        .collect();
    let mut s = [vec![0f32; n], vec![0f32; n], vec![0f32; n], vec![0f32; n]];
    for t in 1..=300 {
        let g: Vec<f32> = (0..n).map(|_| rng.unit() + 0.5).collect();
        let h = AdamW {
            step: t,
            lr: 1e-4,
            weight_decay: 0.0,
            ..AdamW::default()
        };
        let [s0, s1, s2, s3] = &mut s;
        adamw_step(
            &h,
            TensorMut::BF16(&mut pm),
            Some(&mut master),
            Tensor::F32(&g),
            TensorMut::F32(s0),
            TensorMut::F32(s1),
        )
        .unwrap();
        adamw_update(
            &h,
            ParamMut::Compensated {
                param: &mut pc,
                comp: &mut c,
            },
            Tensor::F32(&g),
            StateMut::Plain(TensorMut::F32(s2)),
            StateMut::Plain(TensorMut::F32(s3)),
            &Old::default(),
        )
        .unwrap();
    }
    let mut worst = 0f32;
    let mut moved = 0f32;
    for i in 0..n {
        worst = worst.max((bf16_to_f32(pc[i]) + bf16_to_f32(c[i]) - master[i]).abs());
        moved = moved.max((master[i] - w0[i]).abs());
        // The weight is the master rounded to nearest (or one bf16 step from it).
        assert!((bf16_to_f32(pc[i]) - master[i]).abs() <= 2f32.powi(-7));
    }
    assert!(moved > 0.02, "the weights moved by {moved}");
    // One unit of the compensation's last place (2^-16 near 1) at most per write, unbiased:
    // a random walk of 300 steps stays well within 2^-10.
    assert!(worst <= 2f32.powi(-10), "compensated master off by {worst}");
}

#[test]
fn mixed_or_mis_sized_compact_operands_are_refused() {
    let n = 300;
    let (mut w, mut c) = (vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
    let g = vec![0f32; n];
    let (mut m, mut v) = (vec![0u8; n], vec![0u8; n]);
    let (mut ms, mut vs) = (vec![0f32; 2], vec![0f32; 3]);
    let mut f = vec![0f32; n];
    let h = AdamW::default();
    let err = adamw_update(
        &h,
        ParamMut::Compensated {
            param: &mut w,
            comp: &mut c,
        },
        Tensor::F32(&g),
        StateMut::Q8 {
            codes: &mut m,
            scales: &mut ms,
        },
        StateMut::Plain(TensorMut::F32(&mut f)),
        &Old::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("both be block-quantized"), "{err}");
    let err = adamw_update(
        &h,
        ParamMut::Compensated {
            param: &mut w,
            comp: &mut c,
        },
        Tensor::F32(&g),
        StateMut::Q8 {
            codes: &mut m,
            scales: &mut ms,
        },
        StateMut::Q8 {
            codes: &mut v,
            scales: &mut vs,
        },
        &Old::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("scales have 3 elements"), "{err}");
    let mut short = vec![bf16::ZERO; n - 1];
    let err = adamw_update(
        &h,
        ParamMut::Compensated {
            param: &mut w,
            comp: &mut short,
        },
        Tensor::F32(&g),
        StateMut::Plain(TensorMut::F32(&mut f)),
        StateMut::Plain(TensorMut::F32(&mut vec![0f32; n])),
        &Old::default(),
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("compensation has 299 elements"),
        "{err}"
    );
}

/// The operands of one update, owned: a weight in one of three formats and two states.
#[derive(Clone, PartialEq, Debug)]
struct TwoParts {
    w: Vec<bf16>,
    c: Vec<bf16>,
    w32: Vec<f32>,
    s32: Vec<f32>,
    m: Vec<u8>,
    v: Vec<u8>,
    ms: Vec<f32>,
    vs: Vec<f32>,
    mb: Vec<bf16>,
    vb: Vec<bf16>,
}

/// One update of `ops` with `grad`: `format` 0 is compact AdamW (compensated weight, 8-bit
/// moments: the block path), 1 bf16 AdamW with bf16 moments (the fused path), 2 f32 SGD with
/// momentum, 3 f32 Lion.
fn update_with(format: usize, ops: &mut TwoParts, grad: Grad<'_>) -> ramtorch_core::Result<()> {
    let h = AdamW {
        step: 4,
        lr: 1e-2,
        seed: 9,
        ..AdamW::default()
    };
    let TwoParts {
        w,
        c,
        w32,
        s32,
        m,
        v,
        ms,
        vs,
        mb,
        vb,
    } = ops;
    match format {
        0 => adamw_update(
            &h,
            ParamMut::Compensated { param: w, comp: c },
            grad,
            StateMut::Q8 {
                codes: m,
                scales: ms,
            },
            StateMut::Q8 {
                codes: v,
                scales: vs,
            },
            &Old::default(),
        ),
        1 => adamw_update(
            &h,
            ParamMut::Plain(TensorMut::BF16(w)),
            grad,
            StateMut::Plain(TensorMut::BF16(mb)),
            StateMut::Plain(TensorMut::BF16(vb)),
            &Old::default(),
        ),
        2 => sgd_update(
            &Sgd {
                lr: 0.1,
                momentum: 0.9,
                step: 4,
                ..Sgd::default()
            },
            ParamMut::Plain(TensorMut::F32(w32)),
            grad,
            Some(StateMut::Plain(TensorMut::F32(s32))),
            &Old::default(),
        ),
        _ => lion_update(
            &Lion {
                lr: 1e-3,
                step: 4,
                ..Lion::default()
            },
            ParamMut::Plain(TensorMut::F32(w32)),
            grad,
            StateMut::Plain(TensorMut::F32(s32)),
            &Old::default(),
        ),
    }
}

#[test]
fn a_gradient_in_two_parts_updates_as_their_sum() {
    let mut rng = Rng(23);
    let n = 3 * 65_536 + 301; // several pieces, a short last block
                              // Parts whose sums round (bf16, f16), cancel, overflow f16 and carry non-finite values.
    let mut a: Vec<f32> = (0..n)
        .map(|i| rng.unit() * 10f32.powi((i % 9) as i32 - 6))
        .collect();
    let mut b: Vec<f32> = (0..n)
        .map(|i| rng.unit() * 10f32.powi((i % 5) as i32 - 4))
        .collect();
    a[7] = f32::NAN;
    b[11] = f32::INFINITY;
    a[12] = 60_000.0;
    b[12] = 60_000.0;
    b[13] = -a[13];
    let start = {
        let mut r = Rng(5);
        let w: Vec<bf16> = (0..n).map(|_| bf16_rne(r.unit())).collect();
        let (mut m, mut v) = (vec![0u8; n], vec![0u8; n]);
        let (mut ms, mut vs) = (vec![0f32; blocks(n)], vec![0f32; blocks(n)]);
        let mom: Vec<f32> = (0..n).map(|_| r.unit() * 1e-2).collect();
        let sq: Vec<f32> = (0..n).map(|_| r.unit().abs() * 1e-4).collect();
        quant::quantize(&mom, &mut m, &mut ms, true).unwrap();
        quant::quantize(&sq, &mut v, &mut vs, false).unwrap();
        TwoParts {
            c: (0..n).map(|_| bf16_rne(r.unit() * 1e-3)).collect(),
            w32: w.iter().map(|x| x.to_f32()).collect(),
            s32: mom.clone(),
            w,
            m,
            v,
            ms,
            vs,
            mb: mom.iter().map(|&x| bf16_rne(x)).collect(),
            vb: sq.iter().map(|&x| bf16_rne(x)).collect(),
        }
    };
    for dtype in 0..3 {
        for format in 0..4 {
            let what = format!("grad dtype {dtype}, format {format}");
            let (mut summed, mut two) = (start.clone(), start.clone());
            match dtype {
                0 => {
                    let mut s = a.clone();
                    add_in_place(TensorMut::F32(&mut s), Tensor::F32(&b)).unwrap();
                    update_with(format, &mut summed, Tensor::F32(&s).into()).unwrap();
                    update_with(
                        format,
                        &mut two,
                        Grad::Sum(Tensor::F32(&a), Tensor::F32(&b)),
                    )
                    .unwrap();
                }
                1 => {
                    let (x, y): (Vec<bf16>, Vec<bf16>) = (
                        a.iter().map(|&v| bf16_rne(v)).collect(),
                        b.iter().map(|&v| bf16_rne(v)).collect(),
                    );
                    let mut s = x.clone();
                    add_in_place(TensorMut::BF16(&mut s), Tensor::BF16(&y)).unwrap();
                    update_with(format, &mut summed, Tensor::BF16(&s).into()).unwrap();
                    update_with(
                        format,
                        &mut two,
                        Grad::Sum(Tensor::BF16(&x), Tensor::BF16(&y)),
                    )
                    .unwrap();
                }
                _ => {
                    let (x, y): (Vec<f16>, Vec<f16>) = (
                        a.iter().map(|&v| f16::from_f32(v)).collect(),
                        b.iter().map(|&v| f16::from_f32(v)).collect(),
                    );
                    let mut s = x.clone();
                    add_in_place(TensorMut::F16(&mut s), Tensor::F16(&y)).unwrap();
                    update_with(format, &mut summed, Tensor::F16(&s).into()).unwrap();
                    update_with(
                        format,
                        &mut two,
                        Grad::Sum(Tensor::F16(&x), Tensor::F16(&y)),
                    )
                    .unwrap();
                }
            }
            assert!(summed != start, "{what}: the update changed nothing");
            // Bitwise (NaN payloads included): compare the bits of every float.
            let bits = |o: &TwoParts| {
                (
                    o.w.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    o.c.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    o.w32
                        .iter()
                        .chain(&o.s32)
                        .map(|x| x.to_bits())
                        .collect::<Vec<_>>(),
                    (o.m.clone(), o.v.clone()),
                    o.ms.iter()
                        .chain(&o.vs)
                        .map(|x| x.to_bits())
                        .collect::<Vec<_>>(),
                    o.mb.iter()
                        .chain(&o.vb)
                        .map(|x| x.to_bits())
                        .collect::<Vec<_>>(),
                )
            };
            assert!(
                bits(&summed) == bits(&two),
                "{what}: the two parts update differently from their sum"
            );
        }
    }
    // Parts that cannot be summed are refused before anything is written.
    let mut ops = start.clone();
    let x: Vec<bf16> = a.iter().map(|&v| bf16_rne(v)).collect();
    let err = update_with(0, &mut ops, Grad::Sum(Tensor::F32(&a), Tensor::BF16(&x))).unwrap_err();
    assert!(err.to_string().contains("one dtype"), "{err}");
    let err = update_with(
        0,
        &mut ops,
        Grad::Sum(Tensor::F32(&a), Tensor::F32(&b[1..])),
    )
    .unwrap_err();
    assert!(err.to_string().contains("second part"), "{err}");
    assert!(ops == start);
}
