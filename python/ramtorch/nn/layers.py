"""``ramtorch.nn.Embedding`` and ``ramtorch.nn.Conv2d``: torch's layers with their weights in host
RAM, each streamed as a unit of its own, through its forward hooks, by its device's shared streamer
(the one ``ramtorch.nn.Linear`` streams on, with the same itinerary and prefetch as
:func:`ramtorch.offload`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import _config, _engine
from .._stream import shared as _shared


class _StreamedLayer(nn.Module):
    """Mixin: the layer's parameters are one streamed unit; ``.to(device)`` changes where it
    computes, ``.to(dtype)`` converts the parameters inside host RAM."""

    compute_device: torch.device
    max_inflight: int
    #: Streams itself: ``ramtorch.offload`` leaves it out of the units it builds.
    _ramtorch_streams_itself = True

    def _stream_setup(self, device: Any, max_inflight: int | None) -> None:
        self.max_inflight = _config.max_inflight(max_inflight)
        self.compute_device = _engine.normalize_device(device)
        self._ramtorch_streamer = None
        self._restream()

    def _restream(self) -> None:
        """(Re)attaches the layer to the shared streamer of its compute device."""
        for h in self.__dict__.get("_stream_handles") or ():
            h.remove()
        old, streamer = self.__dict__.get("_ramtorch_unit"), self.__dict__.get("_layer_streamer")
        if old is not None and streamer is not None:
            streamer.eng.synchronize()
            streamer.forget(old)
        streamer = _shared.for_device(self.compute_device)
        unit, handles = streamer.attach(self, type(self).__name__, self.max_inflight)
        self._ramtorch_unit = unit
        self._stream_handles = handles
        self._layer_streamer = streamer

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        ref = next(self.parameters(), None)
        dtype = ref.dtype if ref is not None else torch.get_default_dtype()
        label = type(self).__name__
        try:
            probe = fn(torch.empty(0, dtype=dtype))
        except Exception as e:  # noqa: BLE001 - re-raised with the layer named
            raise RuntimeError(f"ramtorch.nn.{label}: cannot apply {getattr(fn, '__name__', fn)}: {e}") from e
        try:
            device = _engine.normalize_device(probe.device)
        except (RuntimeError, ValueError) as e:
            raise RuntimeError(f"ramtorch.nn.{label}: {e}") from e
        with torch.no_grad():
            if probe.dtype != dtype:
                for p in self.parameters():
                    if p.is_floating_point():
                        p.data = p.data.to(probe.dtype)
            for name, b in self._buffers.items():
                if b is not None:
                    self._buffers[name] = fn(b)
        self.compute_device = device
        self._restream()
        return self

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_ramtorch_streamer"] = None
        for key in ("_ramtorch_unit", "_stream_handles", "_layer_streamer"):
            state.pop(key, None)
        for key in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_forward_hooks_with_kwargs",
            "_forward_pre_hooks_with_kwargs",
            "_forward_hooks_always_called",
        ):
            state[key] = type(state[key])()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._restream()

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        import copy

        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return new


class Embedding(_StreamedLayer, nn.Embedding):
    """Drop-in :class:`torch.nn.Embedding` whose table lives in host RAM.

    Same arguments as ``nn.Embedding`` (``device`` is where it computes), plus ``max_inflight``.
    The whole table crosses the link at each use; for tables much larger than the batch's rows,
    keep the embedding resident instead (``ramtorch.offload`` with a ``gpu_budget``).
    """

    def __init__(
        self, *args: Any, device: Any = None, max_inflight: int | None = None, **kwargs: Any
    ) -> None:
        nn.Embedding.__init__(self, *args, device="cpu", **kwargs)
        self._stream_setup(device, max_inflight)


class Conv2d(_StreamedLayer, nn.Conv2d):
    """Drop-in :class:`torch.nn.Conv2d` whose weights live in host RAM.

    Same arguments as ``nn.Conv2d`` (``device`` is where it computes), plus ``max_inflight``.
    """

    def __init__(
        self, *args: Any, device: Any = None, max_inflight: int | None = None, **kwargs: Any
    ) -> None:
        nn.Conv2d.__init__(self, *args, device="cpu", **kwargs)
        self._stream_setup(device, max_inflight)
