//! The engine's one error type.

use thiserror::Error;

/// Everything the engine can report. The bindings map each variant to a Python exception.
#[derive(Debug, Error)]
pub enum Error {
    /// A CUDA driver call failed; `op` names the call, `detail` is the driver's message.
    #[error("CUDA error in {op}: {detail}")]
    Cuda {
        /// The operation that failed, e.g. `cuMemcpyHtoDAsync`.
        op: &'static str,
        /// The driver's error name and text.
        detail: String,
    },
    /// CUDA was asked for but cannot be used (no driver library, no device, bad ordinal).
    #[error("CUDA is not available: {0}")]
    CudaUnavailable(String),
    /// The host could not provide memory.
    #[error("host allocation of {bytes} bytes failed: {reason}")]
    HostAlloc {
        /// Bytes asked for.
        bytes: usize,
        /// What the OS said.
        reason: String,
    },
    /// A caller passed a value the engine cannot work with.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Every device slot is held by an acquire without a release.
    #[error("all {slots} device slots are held; release a unit before acquiring another (or raise MAX_INFLIGHT)")]
    SlotsExhausted {
        /// Number of slots on the device.
        slots: usize,
    },
    /// This process was forked after ramtorch started in its parent (see [`crate::fork`]).
    #[error(
        "ramtorch cannot be used in a process forked after ramtorch started in its parent: \
         fork() copies only the calling thread, so the engine's threads and locks are not in \
         the child; start worker processes with the 'spawn' or 'forkserver' start method \
         (multiprocessing.get_context('spawn'), or DataLoader(multiprocessing_context='spawn') \
         when workers use ramtorch)"
    )]
    ForkedChild,
    /// A read, write or allocation of the disk tier failed (see [`crate::disk`]).
    #[error("{op} of {path}: {source}")]
    Disk {
        /// What was being done, e.g. `reading bytes 0..+4096`.
        op: String,
        /// The store file.
        path: String,
        /// What the OS said (its errno is kept: `ENOSPC` for a full disk).
        source: std::io::Error,
    },
    /// A worker thread of the host device stopped.
    #[error("host device worker stopped: {0}")]
    Worker(String),
}

/// Result with the engine's error.
pub type Result<T> = std::result::Result<T, Error>;
