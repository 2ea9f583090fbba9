"""``ramtorch.nn.Embedding`` and ``ramtorch.nn.Conv2d`` (and the base of ``ramtorch.nn.Linear``):
torch's layers with their weights in host RAM, each streamed as a unit of its own, through its
forward hooks, by its device's shared streamer (with the same itinerary, prefetch and gradient path
as :func:`ramtorch.offload`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import _config, _engine
from .._stream import gather as _gather
from .._stream import shared as _shared

#: The module's hook dictionaries (keyed by hook id) that may hold the streaming hooks.
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_state_dict_pre_hooks",
)


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
        unit, handles = streamer.attach(self, type(self).__name__, self.max_inflight, self._by_rows())
        self._ramtorch_unit = unit
        self._stream_handles = handles
        self._layer_streamer = streamer

    def _by_rows(self) -> bool:
        """Whether the layer streams by rows (an embedding table: see :class:`Embedding`)."""
        return False

    def _label(self) -> str:
        """Names the layer in its errors."""
        return f"ramtorch.nn.{type(self).__name__}"

    def _is_home(self) -> bool:
        """Whether the layer's parameters are those of its unit, in the unit's host region."""
        u = self.__dict__.get("_ramtorch_unit")
        if u is None:
            return False
        params = list(dict.fromkeys(p for p in self._parameters.values() if p is not None))
        return len(params) == len(u.params) and all(p is q for p, q in zip(params, u.params)) and u.is_home()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        ref = next(self.parameters(), None)
        dtype = ref.dtype if ref is not None else torch.get_default_dtype()
        label = self._label()
        try:
            probe = fn(torch.empty(0, dtype=dtype))
        except Exception as e:  # noqa: BLE001 - re-raised with the layer named
            raise RuntimeError(f"{label}: cannot apply {getattr(fn, '__name__', fn)}: {e}") from e
        if probe.device.type not in ("cpu", "cuda"):
            raise RuntimeError(f"{label}: cannot move to {probe.device}: ramtorch computes on cpu or cuda")
        try:
            device = _engine.normalize_device(probe.device)
        except (RuntimeError, ValueError) as e:
            raise RuntimeError(f"{label}: {e}") from e
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
        """The module's state without its streaming (hooks, unit): a copy streams afresh. Hooks
        the user registered are kept, as ``nn.Module`` keeps them."""
        state = self.__dict__.copy()
        ours = {h.id for h in state.get("_stream_handles") or ()}
        state["_ramtorch_streamer"] = None
        for key in ("_ramtorch_unit", "_stream_handles", "_layer_streamer"):
            state.pop(key, None)
        for key in _HOOK_DICTS:
            if key in state:
                state[key] = type(state[key])((k, v) for k, v in state[key].items() if k not in ours)
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

    Same arguments as ``nn.Embedding`` (``device`` is where it computes), plus ``max_inflight`` and
    ``gather_rows``. A large table streams by rows: each forward copies to the device only the
    distinct rows its indices read, gathered on the host, and its backward adds their gradient
    into the rows of the table's dense ``.grad``. Reading the indices on the host costs one small
    device→host copy at the forward, which waits for the work queued before it; indices given on
    the CPU cost none (the output is on ``device`` either way). A small table crosses the link
    whole at each use.

    Args:
        gather_rows: stream by rows; ``None`` (default): when the table takes at least
            ``RAMTORCH_GATHER_MIN_BYTES`` (16 MiB unless set). Rows moved are counted in
            ``ramtorch.stats()["devices"][device]`` (``row_h2d_bytes``, ``rows_gathered``).
    """

    def __init__(
        self,
        *args: Any,
        device: Any = None,
        max_inflight: int | None = None,
        gather_rows: bool | None = None,
        **kwargs: Any,
    ) -> None:
        if gather_rows is not None and not isinstance(gather_rows, bool):
            raise TypeError(f"ramtorch.nn.Embedding: gather_rows must be a bool or None, got {gather_rows!r}")
        nn.Embedding.__init__(self, *args, device="cpu", **kwargs)
        self.gather_rows = gather_rows
        self._stream_setup(device, max_inflight)

    def _by_rows(self) -> bool:
        return _gather.wanted(self, self.gather_rows)


class Conv2d(_StreamedLayer, nn.Conv2d):
    """Drop-in :class:`torch.nn.Conv2d` whose weights live in host RAM.

    Same arguments as ``nn.Conv2d`` (``device`` is where it computes), plus ``max_inflight``.
    """

    def __init__(
        self, *args: Any, device: Any = None, max_inflight: int | None = None, **kwargs: Any
    ) -> None:
        nn.Conv2d.__init__(self, *args, device="cpu", **kwargs)
        self._stream_setup(device, max_inflight)
