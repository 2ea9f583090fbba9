"""``ramtorch.nn.Embedding`` and ``ramtorch.nn.Conv2d``: torch's layers with their weights in host
RAM, each streamed as a unit of its own by the same machinery as :func:`ramtorch.offload`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import _config, _engine, _offload


class _StreamedLayer(nn.Module):
    """Mixin: the layer's parameters are one streamed unit; ``.to(device)`` changes where it
    computes, ``.to(dtype)`` converts the parameters inside host RAM."""

    compute_device: torch.device
    max_inflight: int

    def _stream_setup(self, device: Any, max_inflight: int | None) -> None:
        self.max_inflight = _config.max_inflight(max_inflight)
        self.compute_device = _engine.normalize_device(device)
        self._ramtorch_streamer = None
        self._restream()

    def _restream(self) -> None:
        _offload.detach_streamer(self)
        _offload.offload(self, device=self.compute_device, max_inflight=self.max_inflight, progress=False)

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
        state.pop("_ramtorch_unit", None)
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
