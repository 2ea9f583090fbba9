//! Pinners for tests: one that refuses, one that counts.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use ramtorch_core::arena::Pinner;
use ramtorch_core::{Error, Result};

pub struct Refuse;
impl Pinner for Refuse {
    unsafe fn pin(&self, _: *mut u8, _: usize) -> Result<()> {
        Err(Error::Cuda {
            op: "cuMemHostRegister",
            detail: "CUDA_ERROR_OUT_OF_MEMORY".into(),
        })
    }
    unsafe fn unpin(&self, _: *mut u8, _: usize) {
        unreachable!("nothing was pinned")
    }
}

/// Counts pins and unpins, to check the pool keeps memory pinned between uses.
#[derive(Default)]
pub struct Counting {
    pub pins: AtomicUsize,
    pub unpins: AtomicUsize,
}
/// Pins by counting into a shared [`Counting`].
pub struct CountingPinner(pub Arc<Counting>);

impl Pinner for CountingPinner {
    unsafe fn pin(&self, _: *mut u8, _: usize) -> Result<()> {
        self.0.pins.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
    unsafe fn unpin(&self, _: *mut u8, _: usize) {
        self.0.unpins.fetch_add(1, Ordering::Relaxed);
    }
}
