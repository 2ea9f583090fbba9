"""Streaming under ``torch.compile``: the streaming code runs as it does in eager mode, between
compiled regions.

What streaming does around a unit is host-side work on live state (slots of the engine, the
itinerary, saved-tensor hooks, autograd functions whose backward sends gradients to the host),
nothing a graph can hold: traced, its slot views would be fake tensors of whatever the slot held
when the graph was traced. Each entry point (a unit's forward hooks, a streamed layer's forward)
starts with::

    if is_compiling():
        return opaque(Class.method, self, ...)

(``is_compiling`` is ``torch.compiler.is_compiling``) so that Dynamo, which sees it as true, breaks
the graph there and runs the method as is, Dynamo off for it and all it calls, while eager mode
pays one flag read. Under ``fullgraph=True`` that graph break is an error, which names
:func:`ramtorch_streaming__compile_without_fullgraph`: weights stream between graphs, so a streamed
model does not compile into one. The unit's own modules, between its hooks, are compiled as
usual, on the device views of its weights.

Where the graph breaks inside a module call, Dynamo runs that call and compiles the frames it
meets on the way as frames of their own: the hooks among them are marked by :func:`run_eagerly`
(a flag on their code, nothing per call), else each hook would be compiled once per kind of unit,
up to Dynamo's recompile limit and its warnings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.compiler import is_compiling as is_compiling


def ramtorch_streaming__compile_without_fullgraph(fn: Callable[..., Any], *args: Any) -> Any:
    """Calls ``fn(*args)``. Its name is what Dynamo's error shows under ``fullgraph=True``."""
    return fn(*args)


#: ``opaque(fn, *args)`` calls ``fn(*args)`` with Dynamo off for it and all it calls; traced, it is a
#: graph break (torch's lazy ``torch._dynamo.disable``: ``torch._dynamo`` loads at the first call,
#: which happens only in a process that compiles).
opaque = torch._disable_dynamo(ramtorch_streaming__compile_without_fullgraph)


def run_eagerly(*fns: Callable[..., Any]) -> None:
    """Dynamo never compiles a frame of ``fns``, nor of what they call: they run as plain Python
    even with a compiled model around them (torch marks its own markers this way: a flag on the
    code object, no cost per call, no import of ``torch._dynamo``). On a torch without this
    switch the frames are compiled, with the same results (``opaque`` breaks the graph)."""
    frames = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    try:
        skip = frames._FrameAction.SKIP  # type: ignore[union-attr]
        strategy = frames._FrameExecStrategy(skip, skip)  # type: ignore[union-attr]
        for fn in fns:
            frames.set_code_exec_strategy(fn.__code__, strategy)  # type: ignore[union-attr]
    except (AttributeError, TypeError):
        pass
