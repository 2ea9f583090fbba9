//! CPU optimizer kernels over host memory: AdamW, SGD (momentum, Nesterov) and Lion, plus the
//! gradient statistics and scaling that global-norm clipping and loss scaling need.
//!
//! # Storage modes
//!
//! Every optimizer computes in `f32` and supports three ways of storing a parameter:
//!
//! - **float32**: `param` is `f32` and is updated in place;
//! - **fp32 master**: `master` (`f32`) is updated, and `param` (`bf16` or `f16`, the compute copy)
//!   is overwritten with `master` rounded to nearest even;
//! - **bfloat16 everywhere**: `param` is `bf16`, loaded to `f32`, updated and written back with
//!   stochastic rounding.
//!
//! - **compensated bfloat16**: `param` is `bf16` and a second `bf16` buffer holds the rounding
//!   error of the last write (Kahan-style): the master is their sum, about 16 significant bits
//!   (a relative resolution near 2^-16, against 2^-8 for `bf16` alone), in 4 bytes a parameter;
//!   written as the new value rounded to nearest even and the new rounding error rounded
//!   stochastically, so that what the pair cannot hold is dropped without bias
//!   ([`ParamMut::Compensated`]).
//!
//! Gradients may be `f32`, `bf16` or `f16` in every mode. Optimizer states are `f32` (stored
//! exactly), `bf16` (written back with stochastic rounding), or block-quantized to 8 bits
//! ([`StateMut::Q8`], see [`quant`]: one byte an element and one `f32` scale per block of
//! [`quant::BLOCK`]); `f16` states are refused because `exp_avg_sq` underflows in `f16`.
//!
//! # Blocks
//!
//! Every rule and format goes through one driver: a tensor is cut into pieces that are whole
//! quantization blocks (pieces start at multiples of [`quant::BLOCK`]). When an operand is a block
//! format (a block-quantized state, a compensated parameter), each block's operands are decoded
//! to `f32`, the rule runs over the block, and the results are encoded back; otherwise a piece runs
//! one fused loop over its elements (load, update, store every operand of an element), which gives
//! the same bits in one pass over memory (the random bits of stochastic rounding stay a function of
//! the element index either way). The `*_update`
//! functions take every format ([`ParamMut`], [`StateMut`]); `*_step` and `*_step_from` are their
//! spelling for unquantized states.
//!
//! # Stochastic rounding
//!
//! Rounding `x` to `bf16` adds 16 uniformly random bits below the `bf16` mantissa and truncates,
//! so `x` rounds away from zero with probability exactly equal to its distance from the lower
//! neighbour in ulps: `E[round(x)] = x`. The random bits come from a counter-based generator: a
//! keyed integer hash of the element index, with keys drawn by SplitMix64 from `(seed, step)`.
//! Element `i` of a call always gets the same bits whatever the chunking or the number of
//! threads, so results are bitwise reproducible. Callers should vary `seed` (or `step`) from one
//! call to the next, and between tensors.
//!
//! # Performance
//!
//! Each combination of storage types compiles to its own loops that LLVM vectorises: one fused
//! loop per element for the element-wise formats, loops over a block of [`quant::BLOCK`] elements
//! (decode every operand into `f32` arrays in L1, update, encode back) for the block formats; on
//! x86-64 the loops are also compiled for AVX2 and for AVX-512, and the best the CPU has is chosen
//! at run time (all paths give the same bits). The 8-bit codec of [`quant`] is written with AVX2
//! and AVX-512 intrinsics (table look-ups as gathers, no division in the AVX-512 encoder), with the
//! bits of its scalar code. Tensors
//! above [`SERIAL_MAX`] elements are split into pieces of [`SERIAL_MAX`] / 2 to [`SERIAL_MAX`]
//! elements that run on the rayon pool; smaller ones run on the calling thread.
//!
//! # Modules
//!
//! - [`adamw`](adamw_step), [`sgd`](sgd_step), [`lion`](lion_step): one update rule each (its
//!   hyperparameters, their checks, the per-element update);
//! - `kernel`: what the rules share (pieces on the rayon pool, instruction-set dispatch, storage
//!   formats as block codecs, the block-wise driver);
//! - [`quant`]: 8-bit block quantization of states (a small float per element over a scale per
//!   block, encode and decode);
//! - [`precision`]: `f32`↔`bf16`/`f16` conversions and stochastic rounding, used crate-wide;
//! - `stats`: gradient statistics, in-place scaling, stochastic rounding of a whole tensor.
//!
//! ```
//! use ramtorch_core::optim::{adamw_step, AdamW, Tensor, TensorMut};
//!
//! let mut p = vec![1.0f32; 4];
//! let g = vec![0.5f32; 4];
//! let (mut m, mut v) = (vec![0.0f32; 4], vec![0.0f32; 4]);
//! let h = AdamW { lr: 0.1, step: 1, ..AdamW::default() };
//! adamw_step(&h, TensorMut::F32(&mut p), None, Tensor::F32(&g),
//!            TensorMut::F32(&mut m), TensorMut::F32(&mut v)).unwrap();
//! assert!(p[0] < 1.0);
//! ```

use std::fmt;

/// The 16-bit float types of the views, re-exported from the `half` crate.
pub use half::{bf16, f16};

use crate::{Error, Result};

mod adamw;
mod kernel;
mod lion;
pub mod precision;
pub mod quant;
mod sgd;
mod stats;
#[cfg(test)]
mod tests;

pub use adamw::{adamw_step, adamw_step_from, adamw_update, AdamRule, AdamW};
pub use lion::{lion_step, lion_step_from, lion_update, Lion};
pub use sgd::{sgd_step, sgd_step_from, sgd_update, Sgd};
pub use stats::{add_in_place, grad_stats, scale_in_place, stochastic_round_bf16, GradStats};

/// The instruction set the optimizer kernels run with on this CPU: `"avx512"`, `"avx2"` or
/// `"base"`: the best the CPU has, at most what the environment variable `RAMTORCH_CPU_KERNELS`
/// names (one of those three; for A/B measurements). A value it does not name is an error here (the kernels
/// then run uncapped).
pub fn kernel_isa() -> Result<&'static str> {
    if let Err(v) = kernel::isa_cap() {
        return Err(invalid(format!(
            "environment variable {}={v:?} names no instruction set; use one of {}",
            kernel::ISA_VAR,
            kernel::ISA_NAMES.join(", ")
        )));
    }
    Ok(kernel::ISA_NAMES[kernel::isa_rank(kernel::best_isa())])
}

/// Tensors with at most this many elements are processed on the calling thread; larger ones are
/// split in halves (at multiples of 1024 elements) until every piece is at most this long, and the
/// pieces run on the rayon pool.
pub const SERIAL_MAX: usize = 1 << 15;

/// Pieces start at multiples of this many elements (whole cache lines, whole vectors).
pub(crate) const ALIGN: usize = 1024;

/// Size of the rayon pool the kernels run on.
pub fn threads() -> usize {
    rayon::current_num_threads()
}

pub(crate) fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}

// ---------------------------------------------------------------------------------------------
// Element types and tensor views.

/// Element type of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// IEEE binary32.
    F32,
    /// bfloat16: the top half of a binary32.
    BF16,
    /// IEEE binary16.
    F16,
}

impl Dtype {
    /// Parses `"float32"`, `"bfloat16"` or `"float16"` (a `"torch."` prefix is accepted, so
    /// `str(tensor.dtype)` works).
    pub fn parse(name: &str) -> Result<Self> {
        match name.strip_prefix("torch.").unwrap_or(name) {
            "float32" => Ok(Dtype::F32),
            "bfloat16" => Ok(Dtype::BF16),
            "float16" => Ok(Dtype::F16),
            _ => Err(invalid(format!(
                "unknown dtype {name:?}; expected \"float32\", \"bfloat16\" or \"float16\""
            ))),
        }
    }

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::BF16 | Dtype::F16 => 2,
        }
    }

    /// The torch name of the type.
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "float32",
            Dtype::BF16 => "bfloat16",
            Dtype::F16 => "float16",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A parameter, as the `*_update` functions take it.
#[derive(Debug)]
pub enum ParamMut<'a> {
    /// A `f32` parameter (updated in place) or a `bf16` one (stochastic rounding).
    Plain(TensorMut<'a>),
    /// `f32` master weights, updated, and the `bf16`/`f16` compute copy, rewritten from them
    /// rounded to nearest even.
    Master {
        /// The compute copy.
        param: TensorMut<'a>,
        /// The master weights.
        master: &'a mut [f32],
    },
    /// A `bf16` weight and its `bf16` compensation: the master is their sum.
    Compensated {
        /// The weight (the compute copy).
        param: &'a mut [bf16],
        /// The rounding error of the last write of `param`.
        comp: &'a mut [bf16],
    },
}

impl<'a> ParamMut<'a> {
    /// The parameter of the `*_step` functions: `param`, with `master` when given.
    pub fn new(param: TensorMut<'a>, master: Option<&'a mut [f32]>) -> Self {
        match master {
            Some(master) => ParamMut::Master { param, master },
            None => ParamMut::Plain(param),
        }
    }
}

/// A writable optimizer state, as the `*_update` functions take it.
#[derive(Debug)]
pub enum StateMut<'a> {
    /// One `f32` or `bf16` element per parameter element.
    Plain(TensorMut<'a>),
    /// Block-quantized (see [`quant`]): one code per element, one scale per block of
    /// [`quant::BLOCK`] elements (the last one may be short).
    Q8 {
        /// One code per element (`quant`'s format).
        codes: &'a mut [u8],
        /// The largest magnitude of each block.
        scales: &'a mut [f32],
    },
}

impl<'a> From<TensorMut<'a>> for StateMut<'a> {
    fn from(t: TensorMut<'a>) -> Self {
        StateMut::Plain(t)
    }
}

/// A read-only optimizer state (the old values of an out-of-place step), in either format of
/// [`StateMut`].
#[derive(Clone, Copy, Debug)]
pub enum State<'a> {
    /// One `f32` or `bf16` element per parameter element.
    Plain(Tensor<'a>),
    /// Block-quantized codes and scales.
    Q8 {
        /// One code per element (`quant`'s format).
        codes: &'a [u8],
        /// The largest magnitude of each block.
        scales: &'a [f32],
    },
}

impl<'a> From<Tensor<'a>> for State<'a> {
    fn from(t: Tensor<'a>) -> Self {
        State::Plain(t)
    }
}

/// The old values of an out-of-place step (`adamw_step_from` and the other `_from` functions):
/// the step reads these and writes its results to its own operands, leaving these unchanged, so
/// an update can be computed ahead and committed, or dropped, later. Per piece, the old values
/// are copied over the operand right before the piece is updated (while it is in cache): the
/// step moves the bytes of an in-place one. `None`: that operand is read in place.
///
/// `param` is the old parameter for a float32, stochastically rounded or compensated bfloat16
/// parameter (with `comp`, the old compensation, for the last); with master weights the
/// parameter is only written (rounded from the master), so `master` is given instead. `states`
/// are the old optimizer states, in the rule's order. Each must have its operand's format and
/// length, and none may overlap an operand.
#[derive(Clone, Copy, Debug, Default)]
pub struct Old<'a> {
    /// The old parameter (no master weights).
    pub param: Option<Tensor<'a>>,
    /// The old master weights.
    pub master: Option<&'a [f32]>,
    /// The old compensation of a compensated parameter.
    pub comp: Option<&'a [bf16]>,
    /// The old states: AdamW's `exp_avg`, `exp_avg_sq`; SGD's momentum buffer; Lion's `exp_avg`.
    pub states: [Option<State<'a>>; 2],
}

/// The gradient an update reads: one tensor, or the sum of two tensors of one dtype and length,
/// added element by element as torch's `add` does (in `f32`; a `bf16` or `f16` sum rounded to
/// nearest even), in the update's own pass instead of into a tensor first.
#[derive(Clone, Copy, Debug)]
pub enum Grad<'a> {
    /// One tensor.
    One(Tensor<'a>),
    /// The sum of two.
    Sum(Tensor<'a>, Tensor<'a>),
}

impl<'a> From<Tensor<'a>> for Grad<'a> {
    fn from(t: Tensor<'a>) -> Self {
        Grad::One(t)
    }
}

/// A read-only, typed view of a contiguous tensor.
#[derive(Clone, Copy, Debug)]
pub enum Tensor<'a> {
    /// `float32` elements.
    F32(&'a [f32]),
    /// `bfloat16` elements.
    BF16(&'a [bf16]),
    /// `float16` elements.
    F16(&'a [f16]),
}

impl Tensor<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Tensor::F32(s) => s.len(),
            Tensor::BF16(s) => s.len(),
            Tensor::F16(s) => s.len(),
        }
    }

    /// Whether the view has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element type.
    pub fn dtype(&self) -> Dtype {
        match self {
            Tensor::F32(_) => Dtype::F32,
            Tensor::BF16(_) => Dtype::BF16,
            Tensor::F16(_) => Dtype::F16,
        }
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        match self {
            Tensor::F32(s) => {
                let (a, b) = s.split_at(mid);
                (Tensor::F32(a), Tensor::F32(b))
            }
            Tensor::BF16(s) => {
                let (a, b) = s.split_at(mid);
                (Tensor::BF16(a), Tensor::BF16(b))
            }
            Tensor::F16(s) => {
                let (a, b) = s.split_at(mid);
                (Tensor::F16(a), Tensor::F16(b))
            }
        }
    }
}

/// A writable, typed view of a contiguous tensor.
#[derive(Debug)]
pub enum TensorMut<'a> {
    /// `float32` elements.
    F32(&'a mut [f32]),
    /// `bfloat16` elements.
    BF16(&'a mut [bf16]),
    /// `float16` elements.
    F16(&'a mut [f16]),
}

impl TensorMut<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            TensorMut::F32(s) => s.len(),
            TensorMut::BF16(s) => s.len(),
            TensorMut::F16(s) => s.len(),
        }
    }

    /// Whether the view has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element type.
    pub fn dtype(&self) -> Dtype {
        match self {
            TensorMut::F32(_) => Dtype::F32,
            TensorMut::BF16(_) => Dtype::BF16,
            TensorMut::F16(_) => Dtype::F16,
        }
    }
}
