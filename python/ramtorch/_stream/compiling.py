"""Streaming under ``torch.compile``: the streaming code runs as it does in eager mode, between
compiled regions.

What streaming does around a unit is host-side work on live state (slots of the engine, the
itinerary, saved-tensor hooks, autograd functions whose backward sends gradients to the host),
nothing a graph can hold: traced, its slot views would be fake tensors of whatever the slot held
when the graph was traced. Each entry point (a unit's forward hooks, a streamed layer's forward)
starts with::

    if is_compiling():
        return opaque(Class.method)(self, ...)

(``is_compiling`` is ``torch.compiler.is_compiling``) so that Dynamo, which sees it as true, breaks
the graph there and runs the method as is (``torch._dynamo.disable``), while eager mode pays one
flag read. The unit's own modules, between its hooks, are compiled as usual, on the device views
of its weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch.compiler import is_compiling as is_compiling

F = TypeVar("F", bound=Callable[..., Any])

#: Dynamo's message when it meets streaming code where it may not break the graph (``fullgraph=True``).
REASON = (
    "ramtorch streams weights between compiled regions (a graph break at each streamed unit); "
    "compile a streamed model without fullgraph=True"
)

_OPAQUE: dict[Callable[..., Any], Callable[..., Any]] = {}


def opaque(fn: F) -> F:
    """``fn`` as a call that ``torch.compile`` does not trace (a graph break: it runs eagerly,
    as do the functions it calls). Made on first use, so that ``torch._dynamo`` loads only in a
    process that compiles."""
    wrapped = _OPAQUE.get(fn)
    if wrapped is None:
        import torch._dynamo

        wrapped = _OPAQUE[fn] = torch._dynamo.disable(fn, recursive=True, reason=REASON)
    return wrapped  # type: ignore[return-value]
