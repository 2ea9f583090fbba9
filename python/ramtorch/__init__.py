"""ramtorch: train and run PyTorch models larger than GPU memory.

Parameters live in page-locked host RAM owned by a Rust engine and are streamed to the GPU just in
time, overlapped with compute::

    import ramtorch.nn as rnn
    layer = rnn.Linear(768, 3072, device="cuda")      # was nn.Linear(768, 3072)
    model = ramtorch.replace_linear(model)            # or convert a whole model at once
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from torch import nn as _torch_nn

from . import _core, _engine, _offload, distributed, nn, optim, plan
from ._core import CudaError
from ._keep import commit, resume
from ._offload import offload, relay, weights_unchanged
from ._stream import gather as _gather
from ._trace import trace
from .checkpoint import load_checkpoint, save_checkpoint
from .convert import replace_linear
from .io import load
from .io import save as save_pretrained

try:
    # The distribution is "ramtorch-rs" (the index's "ramtorch" is another project).
    __version__ = version("ramtorch-rs")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "CudaError",
    "commit",
    "distributed",
    "empty_cache",
    "load",
    "load_checkpoint",
    "nn",
    "offload",
    "relay",
    "weights_unchanged",
    "optim",
    "plan",
    "replace_linear",
    "resume",
    "save_checkpoint",
    "save_pretrained",
    "stats",
    "synchronize",
    "trace",
]


#: Names served by :func:`__getattr__`: they need transformers, imported only when first used.
_LAZY = {"HostCache": "_kv_cache", "prefill": "_kv_cache"}


def __getattr__(name: str) -> Any:
    """``ramtorch.HostCache`` and ``ramtorch.prefill`` (a transformers KV cache in host RAM, and
    prefill in chunks into it: :mod:`ramtorch._kv_cache`), imported on first use so that
    ``import ramtorch`` does not import transformers."""
    if name in _LAZY:
        from . import _kv_cache

        return getattr(_kv_cache, name)
    raise AttributeError(f"module 'ramtorch' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def stats(model: _torch_nn.Module | None = None) -> dict[str, Any]:
    """Counters of the engine, or of one offloaded model.

    - ``host``: host arena bytes (reserved, in use, pinned, pageable, pooled);
    - ``devices``: per compute device, bytes and copies each way, achieved bandwidth
      (``h2d_gbps``/``d2h_gbps``, from device timings of the copies), seconds the compute stream
      waited on copies (``stall_seconds``), slots and their bytes, copies saved by reusing a slot
      that still held a unit (``reuses``), and time the host blocked;
    - ``models``: per live offloaded model, in the order they were offloaded, an entry naming it
      (``model``: its class name) with its resident and streamed units, bytes held on the device,
      bytes streamed per pass, the learned itinerary and prefetch hits. A model that was freed
      has no entry.

    With ``model`` (a model :func:`ramtorch.offload` streams): its entry alone. A model that is not
    offloaded is a ``ValueError``.
    """
    if model is not None:
        streamer = getattr(model, "_ramtorch_streamer", None)
        if streamer is None:
            raise ValueError(
                f"ramtorch.stats: this {type(model).__name__} is not offloaded (ramtorch.offload); "
                "the counters of ramtorch.nn layers are per device, in ramtorch.stats()['devices']"
            )
        return _model_stats(model, streamer)
    models = []
    for s in sorted(_offload.streamers(), key=lambda s: s.serial):
        m = s.model_ref()
        if m is not None:
            models.append(_model_stats(m, s))
    return {
        "host": dict(_core.arena_stats()),
        "devices": {str(e.device): e.stats() for e in _engine.engines()},
        "models": models,
    }


def _model_stats(model: _torch_nn.Module, streamer: Any) -> dict[str, Any]:
    """One model's entry of :func:`stats`: its class name first, then its streamer's counters (a
    model offloaded over several devices: its devices, micro-batches, and each stage's)."""
    pipe = getattr(model, "_ramtorch_pipeline", None)
    if pipe is not None:
        return {
            "model": type(model).__name__,
            "pipeline_devices": [str(d) for d in pipe.devices],
            "micro_batches": pipe.micro_batches,
            "stages": [s.stats() for s in pipe.streamers],
        }
    return {"model": type(model).__name__, **streamer.stats()}


def synchronize() -> None:
    """Waits for every copy the engine has queued, and writes pending gradients to ``.grad``
    (the gradients of a backward pass that raised before its end are dropped instead: such a
    pass writes no ``.grad`` at all).

    Weights edited between passes, in any way (``param.data`` included), need nothing: each pass
    copies the streamed weights again. Call this before editing weights in place right after a
    forward whose results you have not read (its copies run asynchronously).

    It also waits for the updates that pipelined optimizers (``ramtorch.optim.AdamW(...,
    pipeline=True)``) still run after ``step()``: read weights yourself only after this.
    """
    for e in _engine.engines():
        e.synchronize()
    from . import optim

    for opt in list(optim._LISTENING):
        opt.synchronize()
    _engine.wait_updates()


def empty_cache() -> None:
    """Returns pooled host memory (freed parameters and gradients, and the zeroed gradient
    buffers that embedding tables streamed by rows keep for their next fresh backward) to the
    OS."""
    _gather.drop_zeros()
    _core.arena_empty_cache()
