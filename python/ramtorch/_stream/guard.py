"""Streamed weights are not in autograd's graph: ``torch.autograd.grad`` with respect to them is
refused with a clear error instead of torch's "not used in the graph" (or ``None`` gradients with
``allow_unused=True``), and so is ``backward(inputs=...)`` naming them, which would leave their
``.grad`` silently untouched.

A unit's forward computes with device copies of its weights, and their gradients reach the host
parameters through the engine (``.grad``, written at the end of ``backward()``). Autograd never
sees the host parameters, so it would report them unused. The first streamed parameter installs a
thin wrapper around ``torch.autograd.grad`` and ``torch.autograd.backward`` (which
``Tensor.backward`` calls) that checks their ``inputs`` against the registry of streamed
parameters (a dictionary lookup per input; a backward without ``inputs`` pays one ``is None``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable
from typing import Any

import torch

from .. import _engine

# id(param) -> the parameter, weakly: the engine's registry of streamed parameters (the same dict).
_STREAMED = _engine.STREAMED
_LOCK = threading.Lock()
_installed = False
# Backwards running with ``inputs=`` (none of them streamed: those are refused): no streamed
# weight's gradient is accumulated in them, as torch accumulates none but the inputs'.
_restricted = 0


def register(params: Iterable[torch.Tensor]) -> None:
    """``params`` are streamed from now on (their forward uses device copies)."""
    _engine.register_streamed(list(params))
    with _LOCK:
        _install()


def restricted() -> bool:
    """Whether a ``backward(inputs=...)`` runs: streamed weights get no gradient from it."""
    return _restricted > 0


#: Whether a tensor is a registered streamed parameter.
is_streamed = _engine.is_streamed


def _install() -> None:
    global _installed
    if _installed:
        return
    inner = torch.autograd.grad

    @functools.wraps(inner)
    def grad(outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if _STREAMED:
            _check(inputs)
        return inner(outputs, inputs, *args, **kwargs)

    torch.autograd.grad = grad

    inner_backward = torch.autograd.backward

    @functools.wraps(inner_backward)
    def backward(*args: Any, **kwargs: Any) -> Any:
        inputs = kwargs.get("inputs")
        if inputs is None and len(args) > 5:
            inputs = args[5]
        if inputs is None or not _STREAMED:
            return inner_backward(*args, **kwargs)
        _check(inputs, "backward(inputs=...)")
        global _restricted
        with _LOCK:
            _restricted += 1
        try:
            return inner_backward(*args, **kwargs)
        finally:
            with _LOCK:
                _restricted -= 1

    torch.autograd.backward = backward  # Tensor.backward calls it by this name
    _installed = True


def _check(inputs: Any, what: str = "torch.autograd.grad") -> None:
    items = [inputs] if isinstance(inputs, torch.Tensor) else inputs
    try:
        items = list(items)
    except TypeError:
        return  # not a sequence: torch reports it
    for t in items:
        if isinstance(t, torch.Tensor) and is_streamed(t):
            raise RuntimeError(
                f"ramtorch: {what} cannot differentiate with respect to a streamed weight "
                f"(a parameter of shape {tuple(t.shape)} kept in host RAM): the forward computes with "
                "device copies of streamed weights, so autograd does not see them in the graph. "
                "Streamed weights get their gradients in .grad after loss.backward(); "
                f"{what} works for inputs and for weights that are not streamed "
                "(resident units)."
            )
