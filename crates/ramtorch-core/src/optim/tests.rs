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
