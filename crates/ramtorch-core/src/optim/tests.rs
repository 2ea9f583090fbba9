//! What only the crate can test: every instruction set the kernels are compiled for gives the same
//! bits (the other kernel tests are in `tests/optim.rs`, through the public API).

use super::kernel::*;
use super::*;

/// A few AdamW steps in bf16 (stochastic rounding) and fp16-with-master modes, on one piece.
#[allow(clippy::type_complexity)]
fn bf16_run(n: usize) -> (Vec<bf16>, Vec<bf16>, Vec<bf16>, Vec<u16>, Vec<f32>) {
    let x = |i: usize, k: f32| (i as f32 * 0.618 + k).sin() * 1.7;
    let mut p: Vec<bf16> = (0..n).map(|i| bf16::from_f32(x(i, 0.0))).collect();
    let (mut m, mut v) = (vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
    let mut master: Vec<f32> = (0..n).map(|i| x(i, 1.0)).collect();
    let mut ph: Vec<f16> = master.iter().map(|&y| f16::from_f32(y)).collect();
    let (mut m2, mut v2) = (vec![0.0f32; n], vec![0.0f32; n]);
    for t in 1..=3u64 {
        let g: Vec<bf16> = (0..n)
            .map(|i| bf16::from_f32(0.1 * x(i, t as f32)))
            .collect();
        let h = AdamW {
            step: t,
            seed: 11,
            ..AdamW::default()
        };
        adamw_step(
            &h,
            TensorMut::BF16(&mut p),
            None,
            Tensor::BF16(&g),
            TensorMut::BF16(&mut m),
            TensorMut::BF16(&mut v),
        )
        .unwrap();
        adamw_step(
            &h,
            TensorMut::F16(&mut ph),
            Some(&mut master),
            Tensor::BF16(&g),
            TensorMut::F32(&mut m2),
            TensorMut::F32(&mut v2),
        )
        .unwrap();
    }
    let ph = ph.iter().map(|v| v.to_bits()).collect();
    (p, m, v, ph, master)
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

#[test]
fn every_instruction_set_adds_the_same_bits() {
    let n = SERIAL_MAX - 3; // one piece, on this thread
    let x = |i: usize, k: f32| (i as f32 * 0.618 + k).sin() * 1.7;
    let run = || {
        let mut a: Vec<bf16> = (0..n).map(|i| bf16::from_f32(x(i, 0.0))).collect();
        let b: Vec<bf16> = (0..n).map(|i| bf16::from_f32(x(i, 2.0) * 1e-3)).collect();
        let mut h: Vec<f16> = (0..n).map(|i| f16::from_f32(x(i, 1.0))).collect();
        let hb: Vec<f16> = (0..n).map(|i| f16::from_f32(x(i, 3.0))).collect();
        add_in_place(TensorMut::BF16(&mut a), Tensor::BF16(&b)).unwrap();
        add_in_place(TensorMut::F16(&mut h), Tensor::F16(&hb)).unwrap();
        (a, h.iter().map(|v| v.to_bits()).collect::<Vec<u16>>())
    };
    FORCE_ISA.with(|f| f.set(Some(Isa::Base)));
    let base = run();
    let mut isas = vec![Isa::Base];
    #[cfg(target_arch = "x86_64")]
    isas.extend([Isa::Avx2, Isa::Avx512]);
    for want in isas {
        FORCE_ISA.with(|f| f.set(Some(want)));
        assert!(run() == base, "{want:?} differs from the baseline");
    }
    FORCE_ISA.with(|f| f.set(None));
}

/// A few compact AdamW steps (moments in 8 bits) over `n` elements with a compensated `bf16`
/// weight and with an `f32` one; the values include a block of zeros, a block below the smallest
/// normal float, infinities and a NaN.
#[allow(clippy::type_complexity)]
fn compact_run(n: usize) -> Vec<(Vec<u32>, Vec<u8>, Vec<u8>, Vec<u32>, Vec<u32>)> {
    let x = |i: usize, k: f32| (i as f32 * 0.618 + k).sin() * 1.7;
    let special = |i: usize, y: f32| match i {
        0..=255 => 0.0,
        256..=511 => y * 1e-39,
        700 => f32::INFINITY,
        701 => f32::NEG_INFINITY,
        900 => f32::NAN,
        _ => y,
    };
    let mut out = Vec::new();
    for compensated in [true, false] {
        let mut w: Vec<bf16> = (0..n).map(|i| bf16::from_f32(x(i, 0.0))).collect();
        let mut c = vec![bf16::ZERO; n];
        let mut p32: Vec<f32> = (0..n).map(|i| x(i, 0.5)).collect();
        let (mut m, mut v) = (vec![0u8; n], vec![0u8; n]);
        let (mut ms, mut vs) = (vec![0f32; quant::blocks(n)], vec![0f32; quant::blocks(n)]);
        for t in 1..=4u64 {
            let g: Vec<bf16> = (0..n)
                .map(|i| bf16::from_f32(special(i, 0.1 * x(i, t as f32))))
                .collect();
            let h = AdamW {
                step: t,
                lr: 1e-2,
                seed: 5,
                ..AdamW::default()
            };
            let param = if compensated {
                ParamMut::Compensated {
                    param: &mut w,
                    comp: &mut c,
                }
            } else {
                ParamMut::Plain(TensorMut::F32(&mut p32))
            };
            adamw_update(
                &h,
                param,
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
        let bits = |s: &[f32]| s.iter().map(|y| y.to_bits()).collect::<Vec<u32>>();
        let param: Vec<u32> = if compensated {
            w.iter()
                .zip(&c)
                .map(|(a, b)| ((a.to_bits() as u32) << 16) | b.to_bits() as u32)
                .collect()
        } else {
            bits(&p32)
        };
        out.push((param, m, v, bits(&ms), bits(&vs)));
    }
    out
}

#[test]
fn the_fused_compact_loop_gives_the_block_loops_bits() {
    let n = SERIAL_MAX - 3; // one piece, on this thread; a short last block
    let mut isas = vec![Isa::Base];
    #[cfg(target_arch = "x86_64")]
    isas.extend([Isa::Avx2, Isa::Avx512]);
    for want in isas {
        FORCE_ISA.with(|f| f.set(Some(want)));
        FORCE_BLOCK_STEP.with(|f| f.set(true));
        let block = compact_run(n);
        FORCE_BLOCK_STEP.with(|f| f.set(false));
        let fused = compact_run(n);
        assert!(
            fused == block,
            "{want:?}: the fused loop differs from the block loops"
        );
    }
    FORCE_ISA.with(|f| f.set(None));
}
