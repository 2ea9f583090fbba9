"""Decoding spans: stretches of forward passes between which only a decoding loop's own code runs.

Between two passes of an offloaded model, user code may rewrite weights in ways no version counter
sees (in-place writes through ``param.data``), so by default a pass copies its units afresh
(:meth:`~ramtorch._stream.streamer.Streamer.begin_pass`). Inside a *span*, the code between passes
is a decoding loop's (transformers' ``GenerationMixin.generate``: the model's forward, the logits
processors, stopping criteria and streamers given to it, its cache bookkeeping), which does not
write weights through ``.data``. There, the second and later passes of a model take the copies
prefetched at the end of the pass before (each copy still checked against its unit's key: the
parameters' identities, storage addresses and version counters), and each pass prefetches the
next one's first units while its last kernels run. The first pass of a span (the prefill) copies
afresh, like any pass that follows user code.

Spans are per thread: a pass run by another thread is not in this thread's span, and it copies
afresh (which also ends the trust of the generating thread's next pass in that model's copies).
Spans nest (an assistant model's ``generate`` inside the main one's): the outermost one counts.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from .. import _engine


class Span:
    """One decoding span (the outermost ``generate()`` call of a thread): the streamers that ran
    passes in it (weakly), told when it ends (``leave_span``)."""

    def __init__(self) -> None:
        self.serial = _engine.next_generation()
        self.members: weakref.WeakSet[Any] = weakref.WeakSet()


class _Local(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.span: Span | None = None


_LOCAL = _Local()


def current() -> Span | None:
    """This thread's open span, if any."""
    return _LOCAL.span


@contextlib.contextmanager
def span() -> Iterator[Span]:
    """Runs the block as a decoding span of this thread (nested blocks join the outer span). When
    the outermost block ends, each streamer that ran a pass in it gives back what it prefetched
    for a next pass (which will not come in this span)."""
    local = _LOCAL
    if local.span is None:
        local.span = Span()
    sp = local.span
    local.depth += 1
    try:
        yield sp
    finally:
        local.depth -= 1
        if local.depth == 0:
            local.span = None
            for s in list(sp.members):
                s.leave_span(sp)
