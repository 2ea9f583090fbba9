"""``ramtorch.nn.Linear``: ``torch.nn.Linear`` with its weights in host RAM."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch import nn

from .._stream.compiling import is_compiling, opaque, run_eagerly
from .layers import _StreamedLayer

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Linear(_StreamedLayer, nn.Linear):
    """Drop-in :class:`torch.nn.Linear` whose parameters live in page-locked host RAM.

    Same signature, initialisation and behaviour as ``nn.Linear``; ``device`` is where the layer
    *computes* (weights stay in RAM and are copied to it just in time, ``max_inflight`` copies at
    most in flight). ``layer.weight`` is a real CPU ``nn.Parameter``: optimizers, ``state_dict``,
    ``torch.save`` and ``copy.deepcopy`` work on it as usual, and ``.grad`` is host memory too.

    It streams as ``ramtorch.nn.Embedding`` and ``Conv2d`` do, and as the units of
    :func:`ramtorch.offload` do: through its forward hooks, one unit of its device's shared
    streamer. Its forward is ``nn.Linear``'s, on device copies of the weights, and autograd computes
    the weight gradients with torch's own kernels; each leaves for the host as soon as it is
    computed. Under ``torch.autocast`` it computes in the autocast dtype, as ``nn.Linear`` does.

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
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"ramtorch.nn.Linear: {name} must be a non-negative int, got {v!r}")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if dtype not in _FLOAT_DTYPES:
            raise TypeError(f"ramtorch.nn.Linear: dtype must be one of {_FLOAT_DTYPES}, got {dtype}")
        # Built (and initialised, as nn.Linear is) on the CPU, then moved into the arena.
        nn.Linear.__init__(self, in_features, out_features, bias, device="cpu", dtype=dtype)
        self._stream_setup(device, max_inflight)

    def _label(self) -> str:
        return f"ramtorch.nn.Linear({self.in_features}, {self.out_features})"

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Linear:
        """``.to()``, ``.cuda()``, ``.half()``…: the device becomes the compute device, a dtype
        change converts the parameters inside the arena; the weights never leave host RAM."""
        try:
            probe = fn(torch.empty(0, dtype=self.weight.dtype))
        except Exception as e:  # noqa: BLE001 - re-raised with the layer named
            raise RuntimeError(f"{self._label()}: cannot apply {getattr(fn, '__name__', fn)}: {e}") from e
        if probe.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{self._label()}: parameters must be floating point, got {probe.dtype}")
        return super()._apply(fn, recurse)

    # -- forward ------------------------------------------------------------------------------------

    def _input_error(self, x: Any) -> Exception | None:
        """What is wrong with the input ``x`` (``None``: nothing), named in the layer's terms."""
        if not isinstance(x, torch.Tensor):
            return TypeError(f"{self._label()}: input must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            return ValueError(
                f"{self._label()}: input's last dimension must be {self.in_features}, "
                f"got shape {tuple(x.shape)}"
            )
        dev = x.device
        if dev.type != self.compute_device.type or (
            dev.type == "cuda" and dev.index != self.compute_device.index
        ):
            return RuntimeError(
                f"{self._label()}: input is on {dev} but the layer computes on {self.compute_device}; "
                f"move the input or call .to({str(dev)!r}) on the model"
            )
        if not x.is_floating_point():
            return TypeError(f"{self._label()}: input dtype {x.dtype} is not floating point")
        w = self.weight
        if not w.is_floating_point():
            return TypeError(f"{self._label()}: parameters must be floating point, got {w.dtype}")
        if x.dtype != w.dtype and not torch.is_autocast_enabled(dev.type):
            return TypeError(
                f"{self._label()}: input dtype {x.dtype} does not match the weight dtype "
                f"{w.dtype} (use torch.autocast or convert one of them)"
            )
        return None

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
        """``nn.Linear``'s forward, on the device views of the weights that the forward hooks put
        in place of the parameters around this call (``LayerStreamer.attach``), after the input's
        checks."""
        error = self._input_error(input)
        if error is not None:
            if is_compiling():  # (traced only on a torch without run_eagerly's switch)
                return opaque(Linear._refuse, self, error)
            return self._refuse(error)
        try:
            return nn.Linear.forward(self, input)
        except BaseException as e:
            if not isinstance(e, Exception):
                # A Ctrl-C here skips the forward hook (torch calls it on exceptions only): the
                # forward is undone now, so the weights, the slot and the device's forwards are
                # not held until this thread streams a layer again.
                self._layer_streamer._abandon(self._ramtorch_unit)
            raise

    def _refuse(self, error: Exception) -> NoReturn:
        """Raises ``error``: this forward delivers no gradient, so it is not counted for the
        optimizers' hand-off (its forward pre-hook counted it)."""
        self._layer_streamer.forward_failed(self._ramtorch_unit)
        raise error

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
        dtype = w.dtype if w.dtype in _FLOAT_DTYPES else torch.get_default_dtype()
        # (Copied into the arena when the layer starts streaming; ``linear`` keeps its own.)
        new.weight = nn.Parameter(w.detach().to("cpu", dtype), requires_grad=w.requires_grad)
        if linear.bias is not None:
            b = linear.bias
            new.bias = nn.Parameter(b.detach().to("cpu", dtype), requires_grad=b.requires_grad)
        else:
            new.register_parameter("bias", None)
        new.train(linear.training)
        new._stream_setup(w.device if device is None else device, max_inflight)
        return new


# One kernel between two graph breaks (its hooks): compiled, it would gain nothing and be compiled
# again for every shape of layer, up to Dynamo's recompile limit. It runs as in eager mode.
run_eagerly(Linear.forward)
