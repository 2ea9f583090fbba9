"""``ramtorch.trace``: a Chrome trace (``chrome://tracing``, Perfetto) of copies, compute and waits."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from . import _engine, _offload

_KIND_TRACK = {"h2d": "host→device", "d2h": "device→host", "wait": "compute waits", "mark": "compute"}


def _unit_names() -> dict[int, str]:
    names: dict[int, str] = {}
    for s in _offload.streamers():
        for u in s.units:
            names[u.tag] = u.name
    return names


def _events(
    device: str, records: list[tuple[str, int, int, int, float, float]], pid: int
) -> list[dict[str, Any]]:
    names = _unit_names()
    tids = {k: i for i, k in enumerate(_KIND_TRACK)}
    out: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"ramtorch {device}"}}
    ]
    for kind, tid in tids.items():
        out.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": _KIND_TRACK[kind]}}
        )
    opened: dict[tuple[int, int], float] = {}
    for kind, tag, code, nbytes, start, end in sorted(records, key=lambda r: r[4]):
        name = names.get(tag, f"unit {tag}") if tag else "layer"
        if kind == "mark":
            phase = "forward" if code in (_offload.MARK_FWD_BEGIN, _offload.MARK_FWD_END) else "backward"
            if code in (_offload.MARK_FWD_BEGIN, _offload.MARK_BWD_BEGIN):
                opened[(tag, code)] = start
                continue
            begin = opened.pop((tag, code - 1), None)
            if begin is None:
                continue
            out.append(
                {
                    "ph": "X",
                    "name": f"{phase} {name}",
                    "pid": pid,
                    "tid": tids["mark"],
                    "ts": begin * 1e3,
                    "dur": max(start - begin, 0.0) * 1e3,
                }
            )
            continue
        ev: dict[str, Any] = {
            "ph": "X",
            "name": f"{kind} {name}",
            "pid": pid,
            "tid": tids[kind],
            "ts": start * 1e3,
            "dur": max(end - start, 0.0) * 1e3,
        }
        if nbytes:
            ms = end - start
            ev["args"] = {"bytes": nbytes, "GB/s": round(nbytes / (ms * 1e6), 2) if ms > 0 else None}
        out.append(ev)
    return out


@contextmanager
def trace(path: str | os.PathLike[str]) -> Iterator[None]:
    """Records every copy, compute-stream wait and unit forward/backward span inside the block and
    writes them to ``path`` as a Chrome trace (open it in ``chrome://tracing`` or Perfetto).

    Times come from device events, so they show what the GPU did, not when Python asked for it.
    The file is written atomically when the block exits (also when it raises).
    """
    path = os.fspath(path)
    engines = _engine.engines()
    for e in engines:
        e._core.trace_start(e._stream())
        e.tracing = True
    started = set(id(e) for e in engines)
    try:
        yield
    finally:
        events: list[dict[str, Any]] = []
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for pid, e in enumerate(_engine.engines()):
            if id(e) not in started:
                e._core.trace_start(e._stream())  # created inside the block: nothing earlier to keep
            records = e._core.trace_stop()
            e.tracing = False
            events += _events(str(e.device), records, pid)
        folder = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".trace-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, fh)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
