"""``ramtorch.nn.Linear``: ``torch.nn.Linear`` with its weights in host RAM."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import _arena, _config, _engine
from .._stream import guard
from .._stream import shared as _shared
from .._stream.compiling import is_compiling, opaque, run_eagerly
from .._stream.streamer import inside_ddp_forward, refuse_ddp

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return weight.dtype


class _LinearFn(torch.autograd.Function):
    """Forward and backward of a streamed Linear: a one-unit stream of the compute device's
    shared streamer (:mod:`ramtorch._stream.shared`), which prefetches the layers that ran next
    last time and hands the weight gradients to the optimizers once every forward has sent them.

    The CPU parameters are not inputs of the node: their gradients travel device→host on the
    engine's gradient stream and are written to ``.grad`` once, at the end of the backward pass
    (with the parameters' hooks run by us, not by autograd). ``anchor`` is an empty leaf that
    requires grad whenever a parameter does, so autograd reaches this node even when the input
    does not require grad. The parameters are saved so that autograd still detects an in-place
    change between forward and backward.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, anchor: torch.Tensor | None, layer: Linear
    ) -> torch.Tensor:
        weight, bias = layer.weight, layer.bias
        streamer = _shared.for_device(layer.compute_device)
        cdtype = _compute_dtype(x, weight)
        with streamer.borrow(layer._unit) as views:
            w, b = views[0], (views[1] if len(views) > 1 else None)
            with torch.autocast(x.device.type, enabled=False):
                y = F.linear(x.to(cdtype), w.to(cdtype), None if b is None else b.to(cdtype))
        ctx.save_for_backward(x, weight, bias)
        ctx.need_w = weight.requires_grad
        ctx.need_b = bias is not None and bias.requires_grad
        ctx.layer = layer
        ctx.cdtype = cdtype
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:  # type: ignore[override]
        # The saved parameters only let autograd detect in-place changes since forward; under
        # activation checkpointing they come back as other tensor objects, so the gradients go
        # to the layer's own parameters.
        x, _, _ = ctx.saved_tensors
        layer: Linear = ctx.layer
        weight, bias = layer.weight, layer.bias
        cdtype: torch.dtype = ctx.cdtype
        need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.need_w, ctx.need_b
        if guard.restricted():  # backward(inputs=...): torch accumulates no weight gradient
            need_w = need_b = False
        streamer = _shared.for_device(layer.compute_device)
        eng = streamer.eng
        unit = layer._unit
        streamer.begin_backward()
        g = gy.to(cdtype)
        gx = None
        if need_x:
            with streamer.borrow(unit) as views:
                gx = g.matmul(views[0].to(cdtype)).to(x.dtype)
        if need_w or need_b:
            # The leading size spelled out: ``reshape(-1, 0)`` is ambiguous for a layer with no
            # input or output features.
            lead = math.prod(g.shape[:-1])
            g2 = g.reshape(lead, layer.out_features)
            if need_w:
                x2 = x.to(cdtype).reshape(lead, layer.in_features)
                eng.push_grad(weight, g2.t().matmul(x2), layer.max_inflight)
            if need_b:
                # Reduce over the leading dims as nn.Linear's backward does (same summation order).
                gb = g if g.dim() == 1 else g.sum(dim=tuple(range(g.dim() - 1)))
                eng.push_grad(bias, gb, layer.max_inflight)
            streamer.delivered(unit, [i for i, need in ((0, need_w), (1, need_b)) if need])
        return gx, None, None


class Linear(nn.Linear):
    """Drop-in :class:`torch.nn.Linear` whose parameters live in page-locked host RAM.

    Same signature, initialisation and behaviour as ``nn.Linear``; ``device`` is where the layer
    *computes* (weights stay in RAM and are copied to it just in time, ``max_inflight`` copies at
    most in flight). ``layer.weight`` is a real CPU ``nn.Parameter``: optimizers, ``state_dict``,
    ``torch.save`` and ``copy.deepcopy`` work on it as usual, and ``.grad`` is host memory too.

    Args:
        in_features: size of each input sample.
        out_features: size of each output sample.
        bias: learn an additive bias.
        device: compute device (``"cuda"``, ``"cuda:1"``, ``"cpu"``); default CPU, changed by
            ``.to(device)`` / ``.cuda()`` like any module.
        dtype: parameter dtype (default ``torch.get_default_dtype()``).
        max_inflight: copies in flight per device; default ``RAMTORCH_MAX_INFLIGHT`` or
            ``MAX_INFLIGHT`` from the environment, else 2.
    """

    #: Streams itself: ``ramtorch.offload`` leaves it out of the units it builds.
    _ramtorch_streams_itself = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | int | None = None,
        dtype: torch.dtype | None = None,
        *,
        max_inflight: int | None = None,
    ) -> None:
        nn.Module.__init__(self)
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"ramtorch.nn.Linear: {name} must be a non-negative int, got {v!r}")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if dtype not in _FLOAT_DTYPES:
            raise TypeError(f"ramtorch.nn.Linear: dtype must be one of {_FLOAT_DTYPES}, got {dtype}")
        self.in_features = in_features
        self.out_features = out_features
        self.max_inflight = _config.max_inflight(max_inflight)
        self.compute_device = _engine.normalize_device(device)
        shapes = [(out_features, in_features)] + ([(out_features,)] if bias else [])
        flat, views = _arena.pack(shapes, dtype)
        self.weight = nn.Parameter(views[0])
        if bias:
            self.bias = nn.Parameter(views[1])
        else:
            self.register_parameter("bias", None)
        self._set_home(flat)
        self.reset_parameters()

    # -- host storage ---------------------------------------------------------------------------

    def _params(self) -> list[nn.Parameter]:
        return [self.weight] + ([self.bias] if self.bias is not None else [])

    def _set_home(self, flat: torch.Tensor) -> None:
        """The parameters live in ``flat`` now: they stream as one unit of the compute device's
        shared streamer (the unit of the previous home, or device, is forgotten)."""
        self._flat = flat
        if getattr(self, "_anchor", None) is None:
            self._anchor = torch.empty(0, requires_grad=True)
        old, old_streamer = self.__dict__.get("_unit"), self.__dict__.get("_streamer")
        if old is not None and old_streamer is not None:
            old_streamer.forget(old)
        params = self._params()
        names = ["weight", "bias"][: len(params)]
        streamer = _shared.for_device(self.compute_device)
        self._unit = streamer.adopt(self, self._label(), params, names, flat, self.max_inflight)
        self._streamer = streamer

    def _is_home(self) -> bool:
        u = self.__dict__.get("_unit")
        if u is None or getattr(self, "_flat", None) is None:
            return False
        params = self._params()
        return len(params) == len(u.params) and all(p is q for p, q in zip(params, u.params)) and u.is_home()

    @torch.no_grad()
    def _rehome(self, dtype: torch.dtype | None = None) -> None:
        """Moves the parameters (and their grads) into a fresh arena region, in ``dtype``."""
        params = [self.weight] + ([self.bias] if self.bias is not None else [])
        dtype = self.weight.dtype if dtype is None else dtype
        if dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{self._label()}: parameters must be floating point, got {dtype}")
        flat, views = _arena.pack([tuple(p.shape) for p in params], dtype)
        for p, v in zip(params, views):
            v.copy_(p.detach())
            grad = p.grad
            p.data = v
            if grad is not None:
                g = _arena.host_empty(tuple(p.shape), dtype)
                g.copy_(grad)
                p.grad = g
        self._set_home(flat)

    def _label(self) -> str:
        return f"ramtorch.nn.Linear({self.in_features}, {self.out_features})"

    # -- nn.Module hooks --------------------------------------------------------------------------

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Linear:
        """``.to()``, ``.cuda()``, ``.half()``…: the device becomes the compute device, a dtype
        change converts the parameters inside the arena; the weights never leave host RAM."""
        try:
            probe = fn(torch.empty(0, dtype=self.weight.dtype))
        except Exception as e:  # noqa: BLE001 - re-raised with the layer named
            raise RuntimeError(f"{self._label()}: cannot apply {getattr(fn, '__name__', fn)}: {e}") from e
        if probe.device.type not in ("cpu", "cuda"):
            raise RuntimeError(
                f"{self._label()}: cannot move to {probe.device}: ramtorch computes on cpu or cuda"
            )
        try:
            device = _engine.normalize_device(probe.device)
        except RuntimeError as e:
            raise RuntimeError(f"{self._label()}: {e}") from e
        before, self.compute_device = self.compute_device, device
        try:
            if probe.dtype != self.weight.dtype or not self._is_home():
                self._rehome(probe.dtype)
            elif self._streamer.device != device:
                self._set_home(self._flat)  # streams on the new compute device
        except BaseException:
            self.compute_device = before
            raise
        return self

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for k in ("_flat", "_unit", "_streamer"):
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._flat = None
        self._rehome()

    # -- forward ------------------------------------------------------------------------------------

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self._label()}: input must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"{self._label()}: input's last dimension must be {self.in_features}, "
                f"got shape {tuple(x.shape)}"
            )
        dev = x.device
        if dev.type != self.compute_device.type or (
            dev.type == "cuda" and dev.index != self.compute_device.index
        ):
            raise RuntimeError(
                f"{self._label()}: input is on {dev} but the layer computes on {self.compute_device}; "
                f"move the input or call .to({str(dev)!r}) on the model"
            )
        if not x.is_floating_point():
            raise TypeError(f"{self._label()}: input dtype {x.dtype} is not floating point")
        if x.dtype != self.weight.dtype and not torch.is_autocast_enabled(dev.type):
            raise TypeError(
                f"{self._label()}: input dtype {x.dtype} does not match the weight dtype "
                f"{self.weight.dtype} (use torch.autocast or convert one of them)"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
        if is_compiling():
            # Streaming runs as in eager mode between compiled regions (see ramtorch._stream.compiling).
            return opaque(Linear.forward, self, input)
        self._check_input(input)
        if not self._is_home():
            self._rehome()
        b = self.bias
        wants_grad = self.weight.requires_grad or (b is not None and b.requires_grad)
        if wants_grad and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            if inside_ddp_forward():
                refuse_ddp(f"{self._label()} (trainable)")
            # Counted so that optimizers can update this layer during backward, as soon as the
            # backward of every such forward has pushed its gradients (a recomputation inside
            # backward is not counted: its backward is the original forward's).
            self._streamer.count_forward(self._unit)
        return _LinearFn.apply(input, self._anchor if wants_grad else None, self)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, compute_device={self.compute_device}, weights=host"

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, device: torch.device | str | None = None, max_inflight: int | None = None
    ) -> Linear:
        """A ramtorch Linear with ``linear``'s weights (copied into host RAM), computing on
        ``device`` (default: where ``linear``'s weight is)."""
        w = linear.weight
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.max_inflight = _config.max_inflight(max_inflight)
        new.compute_device = _engine.normalize_device(w.device if device is None else device)
        dtype = w.dtype if w.dtype in _FLOAT_DTYPES else torch.get_default_dtype()
        params = [w] + ([linear.bias] if linear.bias is not None else [])
        flat, views = _arena.pack([tuple(p.shape) for p in params], dtype)
        with torch.no_grad():
            for v, p in zip(views, params):
                v.copy_(p.detach())
        new.weight = nn.Parameter(views[0], requires_grad=w.requires_grad)
        if linear.bias is not None:
            new.bias = nn.Parameter(views[1], requires_grad=linear.bias.requires_grad)
        else:
            new.register_parameter("bias", None)
        new.train(linear.training)
        new._set_home(flat)
        return new


run_eagerly(Linear.forward)
