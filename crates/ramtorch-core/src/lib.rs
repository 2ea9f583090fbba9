//! ramtorch's engine: parameters in page-locked host memory, streamed to a device just in time.
//!
//! - [`arena`]: the host arena (exact sizes, pinned, pooled);
//! - [`device`]: what a device must offer, for CUDA and for the host stand-in used without a GPU;
//! - [`disk`]: the disk tier, a store file for units that do not fit in host RAM, read ahead;
//! - [`engine`]: device slots, the copy throttle and the gradient write-back;
//! - [`fork`]: refusing work in a process forked after ramtorch started in its parent;
//! - [`links`]: several links into one device: copies split between its own link and peers;
//! - [`cuda`]: thin safe wrappers over the CUDA driver API, loaded at run time;
//! - [`optim`]: CPU optimizer kernels (AdamW, SGD, Lion) over host memory, all cores, SIMD.
//! - [`shared`]: host memory mapped once by several processes of a node (a memfd), each pinning it.
//!
//! ```
//! use ramtorch_core::{arena::Arena, device::{ComputeStream, HostDevice}, engine::Engine};
//!
//! let arena = Arena::new(None);
//! let weights = arena.alloc(16, true).unwrap();
//! let engine = Engine::new(HostDevice::new().unwrap());
//! let mut slots = vec![vec![0u8; 16]; 3];
//! let ptrs: Vec<u64> = slots.iter_mut().map(|s| s.as_mut_ptr() as u64).collect();
//! // SAFETY: the slot buffers outlive the engine.
//! unsafe { engine.set_slots(&ptrs, 16) }.unwrap();
//! // The slice keeps `weights` alive until the copy has run.
//! let compute = ComputeStream::DEFAULT;
//! let (slot, _) = engine.acquire_slice(&weights.slice(0, 16).unwrap(), 2, compute).unwrap();
//! engine.release(slot, compute).unwrap();
//! engine.synchronize().unwrap();
//! ```
#![warn(missing_docs)]

pub mod arena;
pub mod cuda;
pub mod device;
pub mod disk;
pub mod engine;
pub mod error;
pub mod fork;
pub mod io;
pub mod links;
pub mod optim;
pub mod shared;

pub use error::{Error, Result};
