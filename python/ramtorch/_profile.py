"""Ranges for external profilers: ``torch.profiler`` (and ``torch.autograd.profiler.emit_nvtx``,
which turns them into NVTX ranges) and Nsight Systems.

While ``torch.profiler`` (or ``emit_nvtx``) records, unit passes and engine copies and waits open
``record_function`` ranges named ``ramtorch.*``. With ``RAMTORCH_NVTX=1`` in the environment they
are NVTX ranges (``torch.cuda.nvtx``) whether or not a torch profiler runs, for ``nsys profile``.
Otherwise nothing is recorded: :func:`active` is one flag read, and callers test it before
building a range's name.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.autograd.profiler as _torch_profiler

#: NVTX ranges for Nsight Systems without a torch profiler (``RAMTORCH_NVTX=1``; CUDA builds only).
NVTX = os.environ.get("RAMTORCH_NVTX", "").strip() not in ("", "0") and torch.cuda.is_available()


def active() -> bool:
    """Whether a profiler wants ranges now (torch's own fast flag, or ``RAMTORCH_NVTX``)."""
    return NVTX or _torch_profiler._is_profiler_enabled


def begin(name: str) -> Any:
    """Opens the range ``name``; pass what it returns to :func:`end` (on any thread)."""
    if _torch_profiler._is_profiler_enabled:
        return ("rf", torch.ops.profiler._record_function_enter_new(name, None))
    if NVTX:
        return ("nvtx", torch.cuda.nvtx.range_start(name))
    return None


def end(handle: Any) -> None:
    """Closes a range :func:`begin` opened (``None``: nothing)."""
    if handle is None:
        return
    kind, h = handle
    if kind == "rf":
        torch.ops.profiler._record_function_exit._RecordFunction(h)
    else:
        torch.cuda.nvtx.range_end(h)


class span:
    """``with span(name):`` a range around a block, when :func:`active` (check it first on hot
    paths: this object costs an allocation)."""

    __slots__ = ("name", "handle")

    def __init__(self, name: str) -> None:
        self.name = name
        self.handle: Any = None

    def __enter__(self) -> span:
        self.handle = begin(self.name)
        return self

    def __exit__(self, *exc: object) -> None:
        end(self.handle)
