//! The engine without Python or a GPU: weights in arena memory are streamed unit by unit through
//! device slots of the host device (its copies are memcpy on worker threads), a made-up "kernel"
//! reads each slot and writes a gradient that goes back to arena memory on the gradient lane, and
//! AdamW updates the weights in place. Every step is checked against a plain reference; the program
//! exits non-zero on any mismatch.
//!
//! Run with `cargo run --release --example stream_and_adamw`.

use ramtorch_core::arena::{Arena, Region};
use ramtorch_core::device::{ComputeStream, HostDevice};
use ramtorch_core::engine::Engine;
use ramtorch_core::optim::{adamw_step, AdamW, Tensor, TensorMut};
use ramtorch_core::{Error, Result};

/// The compute stream: on the host device, the calling thread.
const COMPUTE: ComputeStream = ComputeStream::DEFAULT;

const UNITS: usize = 6;
const NUMEL: usize = 50_000;
const STEPS: u64 = 5;

/// The `f32` elements of a region (page-aligned, so aligned for `f32`).
///
/// # Safety
/// The region must outlive `'a`, and nothing else may use its bytes while the slice lives.
unsafe fn floats<'a>(r: &Region) -> &'a mut [f32] {
    // SAFETY: the region holds `len` bytes, page-aligned, exclusively ours by the contract above.
    unsafe { std::slice::from_raw_parts_mut(r.as_ptr().cast::<f32>(), r.len() / 4) }
}

fn check(what: &str, ok: bool) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!("check failed: {what}")))
    }
}

fn main() -> Result<()> {
    let arena = Arena::new(None);
    let engine = Engine::new(HostDevice::new()?);

    // Device slots: on the host device, plain host buffers. Three slots, two copies in flight.
    let bytes = NUMEL * 4;
    let mut slots = vec![vec![0u8; bytes]; 3];
    let ptrs: Vec<u64> = slots.iter_mut().map(|s| s.as_mut_ptr() as u64).collect();
    // SAFETY: `slots` outlives every use: the engine is synchronized and dropped before `slots`
    // at the end of `main`.
    unsafe { engine.set_slots(&ptrs, bytes) }?;

    // Weights and optimizer states in arena memory; a reference copy in plain vectors.
    let mut weights = Vec::new();
    let mut states = Vec::new();
    let mut reference = Vec::new();
    for u in 0..UNITS {
        let w = arena.alloc(bytes, true)?;
        // SAFETY: fresh region, only used here.
        let ws = unsafe { floats(&w) };
        for (i, x) in ws.iter_mut().enumerate() {
            *x = ((i * 7 + u * 13) % 101) as f32 / 50.0 - 1.0;
        }
        reference.push((ws.to_vec(), vec![0.0f32; NUMEL], vec![0.0f32; NUMEL]));
        weights.push(w);
        states.push((arena.alloc(bytes, true)?, arena.alloc(bytes, true)?));
    }
    let h = |step| AdamW {
        lr: 1e-2,
        weight_decay: 0.01,
        step,
        ..AdamW::default()
    };

    for step in 1..=STEPS {
        // Forward: stream each unit into a slot; the guard releases the slot when dropped.
        let mut grads = Vec::new();
        let mut device_grads = Vec::new();
        for w in &weights {
            let guard = engine.borrow(&w.slice(0, bytes)?, 2, COMPUTE)?;
            let slot = &slots[guard.index()];
            // SAFETY: `w` is not written while this view lives (the optimizer runs later).
            check(
                "the slot holds the unit's bytes",
                slot[..] == *unsafe { w.as_slice() },
            )?;
            // The "kernel": gradient = 2 * weight (of the loss sum(w^2)), on the device.
            let g: Vec<f32> = slot
                .chunks_exact(4)
                .map(|c| 2.0 * f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            guard.release()?;
            // Backward: the gradient goes back to arena memory on the gradient lane.
            let dst = arena.alloc(bytes, false)?;
            // SAFETY: `g` (the device source) is kept in `device_grads` until synchronize.
            unsafe {
                engine.copy_to_host_slice(&dst.slice(0, bytes)?, g.as_ptr() as u64, 2, COMPUTE, 0)
            }?;
            device_grads.push(g);
            grads.push(dst);
        }
        engine.synchronize()?;
        drop(device_grads);

        // Optimizer: AdamW on arena memory, and the reference on plain vectors.
        for u in 0..UNITS {
            let (m, v) = &states[u];
            // SAFETY: every copy has completed (synchronize); these views are the only users.
            let (p, g, m, v) =
                unsafe { (floats(&weights[u]), floats(&grads[u]), floats(m), floats(v)) };
            let (rp, rm, rv) = &mut reference[u];
            let rg: Vec<f32> = rp.iter().map(|x| 2.0 * x).collect();
            check("the gradient arrived", g[..] == rg[..])?;
            adamw_step(
                &h(step),
                TensorMut::F32(p),
                None,
                Tensor::F32(g),
                TensorMut::F32(m),
                TensorMut::F32(v),
            )?;
            adamw_step(
                &h(step),
                TensorMut::F32(rp),
                None,
                Tensor::F32(&rg),
                TensorMut::F32(rm),
                TensorMut::F32(rv),
            )?;
            check(
                "AdamW on arena memory matches the reference",
                p[..] == rp[..],
            )?;
        }
        // The loss sum(w^2) goes down.
        let loss: f64 = weights
            .iter()
            // SAFETY: no copy or kernel is running.
            .map(|w| {
                unsafe { floats(w) }
                    .iter()
                    .map(|&x| f64::from(x) * f64::from(x))
                    .sum::<f64>()
            })
            .sum();
        println!("step {step}: loss {loss:.3}");
    }
    let stats = engine.stats()?;
    println!(
        "streamed {} bytes in {} copies, {} bytes of gradients back; arena: {:?}",
        stats.h2d_bytes,
        stats.h2d_copies,
        stats.d2h_bytes,
        arena.stats()
    );
    check(
        "every unit was copied at every step",
        stats.h2d_copies == UNITS as u64 * STEPS,
    )?;
    engine.synchronize()?;
    drop(engine);
    drop(slots);
    println!("ok");
    Ok(())
}
