"""ramtorch: train and run PyTorch models larger than GPU memory.

Parameters live in page-locked host RAM owned by a Rust engine and are streamed to the GPU just in
time, overlapped with compute::

    import ramtorch.nn as rnn
    layer = rnn.Linear(768, 3072, device="cuda")      # was nn.Linear(768, 3072)
    model = ramtorch.replace_linear(model)            # or convert a whole model at once
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from . import _core, _engine, nn
from ._core import CudaError
from .convert import replace_linear

try:
    __version__ = version("ramtorch")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = ["CudaError", "empty_cache", "nn", "replace_linear", "stats", "synchronize"]


def stats() -> dict[str, object]:
    """Counters of the engine: host arena bytes (reserved, in use, pinned, pageable, pooled) and,
    per compute device, bytes and copies each way, slots and time the host waited."""
    return {
        "host": dict(_core.arena_stats()),
        "devices": {str(e.device): e.stats() for e in _engine.engines()},
    }


def synchronize() -> None:
    """Waits for every copy the engine has queued, and writes pending gradients to ``.grad``.

    Needed only before editing weights in place right after a forward whose results you have not
    read (a forward's weight copies run asynchronously); optimizer steps and ``load_state_dict``
    on ramtorch layers do not need it after a completed backward.
    """
    for e in _engine.engines():
        e.synchronize()


def empty_cache() -> None:
    """Returns pooled host memory (freed parameters and gradients) to the OS."""
    _core.arena_empty_cache()
