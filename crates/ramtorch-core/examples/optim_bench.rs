//! Times one in-place AdamW update over `N` parameters with bf16 gradients, in each storage mode:
//!
//! - `fp32-master`: bf16 param, f32 master, f32 moments (28 bytes moved a parameter: master read
//!   and written, param written, grad read, both moments read and written);
//! - `bf16`: bf16 param and moments, stochastic rounding (14 bytes);
//! - `compact`: bf16 weight and bf16 compensation, 8-bit block-quantized moments (14 bytes, plus
//!   two `f32` scales per block of 256 read and written: 14.06).
//!
//! Each mode runs on one thread and on the whole rayon pool (`RAYON_NUM_THREADS` sets its size);
//! prints ns per parameter, GB/s of the bytes above and, per thread count, each mode's speed
//! against `fp32-master` (best of `REPS` steps after a warm-up step).
//!
//! ```text
//! cargo run --release -p ramtorch-core --example optim_bench -- [N] [REPS] [modes,...]
//! cargo run --release -p ramtorch-core --example optim_bench -- 268435456 5 compact,fp32-master
//! ```
//!
//! Defaults: N = 2^26 (the states of fp32-master take 16 bytes a parameter, 1 GiB), 5 reps, every
//! mode.

use std::time::Instant;

use ramtorch_core::optim::quant::blocks;
use ramtorch_core::optim::*;

/// Bytes of host memory one step moves per parameter, in each mode.
fn bytes_per_param(mode: &str) -> f64 {
    match mode {
        "fp32-master" => 28.0,
        "bf16" => 14.0,
        _ => 14.0 + 16.0 / quant::BLOCK as f64,
    }
}

/// A deterministic pseudo-random value in [-1, 1) for element `i` (SplitMix64).
fn unit(i: usize, salt: u64) -> f32 {
    let mut z =
        (i as u64 ^ salt.wrapping_mul(0xD1B5_4A32_D192_ED03)).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// Buffers of one mode.
enum Bufs {
    Master(Vec<bf16>, Vec<f32>, Vec<f32>, Vec<f32>),
    Bf16(Vec<bf16>, Vec<bf16>, Vec<bf16>),
    Compact(Vec<bf16>, Vec<bf16>, Vec<u8>, Vec<f32>, Vec<u8>, Vec<f32>),
}

fn make(mode: &str, n: usize) -> Bufs {
    let w = || -> Vec<bf16> { (0..n).map(|i| bf16::from_f32(unit(i, 1))).collect() };
    match mode {
        "fp32-master" => Bufs::Master(
            w(),
            (0..n).map(|i| unit(i, 1)).collect(),
            vec![0.0; n],
            vec![0.0; n],
        ),
        "bf16" => Bufs::Bf16(w(), vec![bf16::ZERO; n], vec![bf16::ZERO; n]),
        _ => Bufs::Compact(
            w(),
            vec![bf16::ZERO; n],
            vec![0; n],
            vec![0.0; blocks(n)],
            vec![0; n],
            vec![0.0; blocks(n)],
        ),
    }
}

fn step(b: &mut Bufs, g: &[bf16], h: &AdamW) -> Result<(), ramtorch_core::Error> {
    let g = Tensor::BF16(g);
    let old = Old::default();
    match b {
        Bufs::Master(p, master, m, v) => adamw_update(
            h,
            ParamMut::Master {
                param: TensorMut::BF16(p),
                master,
            },
            g,
            StateMut::Plain(TensorMut::F32(m)),
            StateMut::Plain(TensorMut::F32(v)),
            &old,
        ),
        Bufs::Bf16(p, m, v) => adamw_update(
            h,
            ParamMut::Plain(TensorMut::BF16(p)),
            g,
            StateMut::Plain(TensorMut::BF16(m)),
            StateMut::Plain(TensorMut::BF16(v)),
            &old,
        ),
        Bufs::Compact(p, comp, mc, ms, vc, vs) => adamw_update(
            h,
            ParamMut::Compensated { param: p, comp },
            g,
            StateMut::Q8 {
                codes: mc,
                scales: ms,
            },
            StateMut::Q8 {
                codes: vc,
                scales: vs,
            },
            &old,
        ),
    }
}

/// The block codec alone over 16384 elements (in L1 and L2; one task of `quantize`): ns per element
/// to quantize (signed and unsigned format) and to dequantize.
fn codec() -> Result<(), ramtorch_core::Error> {
    const N: usize = 1 << 14;
    const REPS: usize = 2000;
    let x: Vec<f32> = (0..N).map(|i| unit(i, 3) * unit(i, 4).abs()).collect();
    let mut codes = vec![0u8; N];
    let mut scales = vec![0f32; blocks(N)];
    let mut y = vec![0f32; N];
    for signed in [true, false] {
        let x: Vec<f32> = if signed {
            x.clone()
        } else {
            x.iter().map(|v| v * v).collect()
        };
        let t0 = Instant::now();
        for _ in 0..REPS {
            quant::quantize(&x, &mut codes, &mut scales, signed)?;
        }
        let enc = t0.elapsed().as_secs_f64() * 1e9 / (N * REPS) as f64;
        let t0 = Instant::now();
        for _ in 0..REPS {
            quant::dequantize(&codes, &scales, &mut y, signed)?;
        }
        let dec = t0.elapsed().as_secs_f64() * 1e9 / (N * REPS) as f64;
        let format = if signed { "signed" } else { "unsigned" };
        println!(
            "codec, {format:>8} format: quantize {enc:.3} ns/element, dequantize {dec:.3} ns/element"
        );
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let n: usize = args.first().map_or(Ok(1 << 26), |s| s.parse())?;
    let reps: u64 = args.get(1).map_or(Ok(5), |s| s.parse())?;
    let modes: Vec<String> = args.get(2).map_or_else(
        || vec!["fp32-master".into(), "bf16".into(), "compact".into()],
        |s| s.split(',').map(String::from).collect(),
    );
    for m in &modes {
        if !["fp32-master", "bf16", "compact"].contains(&m.as_str()) {
            return Err(format!("unknown mode {m:?} (fp32-master, bf16, compact)").into());
        }
    }
    codec()?;
    let all = threads();
    let single = rayon::ThreadPoolBuilder::new().num_threads(1).build()?;
    println!(
        "N = {n}, {reps} reps (best of), pool of {all} threads, kernels: {}",
        kernel_isa()?
    );
    let g: Vec<bf16> = (0..n).map(|i| bf16::from_f32(1e-2 * unit(i, 2))).collect();
    let mut rows: Vec<(String, usize, f64)> = Vec::new();
    for mode in &modes {
        let mut b = make(mode, n);
        for t in [1, all] {
            let mut best = f64::INFINITY;
            // One warm-up step (the states leave zero), then the timed ones.
            for s in 1..=reps + 1 {
                let h = AdamW {
                    step: s,
                    seed: 7,
                    ..AdamW::default()
                };
                let t0 = Instant::now();
                if t == 1 {
                    single.install(|| step(&mut b, &g, &h))?;
                } else {
                    step(&mut b, &g, &h)?;
                }
                let dt = t0.elapsed().as_secs_f64();
                if s > 1 {
                    best = best.min(dt);
                }
            }
            let ns = best * 1e9 / n as f64;
            let gbs = bytes_per_param(mode) * n as f64 / best / 1e9;
            println!(
                "{mode:>12} threads {t:>3}: {:>9.1} ms  {ns:>7.3} ns/param  {gbs:>7.2} GB/s",
                best * 1e3
            );
            rows.push((mode.clone(), t, ns));
            if all == 1 {
                break;
            }
        }
    }
    for t in [1, all] {
        if let Some(base) = rows
            .iter()
            .find(|r| r.0 == "fp32-master" && r.1 == t)
            .map(|r| r.2)
        {
            for r in rows.iter().filter(|r| r.1 == t && r.0 != "fp32-master") {
                println!(
                    "threads {t:>3}: {} is {:.2}x the speed of fp32-master",
                    r.0,
                    base / r.2
                );
            }
        }
        if all == 1 {
            break;
        }
    }
    Ok(())
}
