"""``ramtorch.trace``: a Chrome trace (``chrome://tracing``, Perfetto) of copies, compute, waits,
the CPU optimizer's updates and the disk tier's reads.

**Clocks.** The engine times copies, compute-stream waits and unit marks with device events: each
record's ``start``/``end`` is milliseconds after a *base* event that ``trace_start`` records on the
compute stream (``cudaEventElapsedTime`` on CUDA; on the CPU device an event completes when its
lane reaches it, stamped with ``std::time::Instant``). Host spans (optimizer updates, waits for
them, disk reads: the store stamps them with ``CLOCK_MONOTONIC``, ``perf_counter()``'s clock on
Linux) are ``time.perf_counter()`` seconds. Both are put on one timeline whose zero is ``origin``, a
``perf_counter()`` reading taken when the trace starts: for each engine the compute stream is
drained, then ``trace_start`` is called between two ``perf_counter()`` readings ``before`` and
``after``, and the stream is drained again before ``after``. The base event ran on an idle stream
inside that window, so its host time is taken as ``(before + after) / 2``, within
``(after - before) / 2`` (a few microseconds; written to the trace as ``alignment_error_us``), and a
device record lands at ``base - origin + start``. Device timers and the host's monotonic clock
drift apart by parts per million: microseconds over a trace of seconds.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from . import _engine
from ._stream import shared as _shared
from ._stream import streamer as _streamer
from ._units import format_bytes

_KIND_TRACK = {"h2d": "host→device", "d2h": "device→host", "wait": "compute waits", "mark": "compute"}


class HostSpans:
    """Host-side spans recorded while :func:`trace` is on: the optimizer's updates (on its worker
    thread during backward and pipelined steps, on the caller's thread in ``step()``) and the
    times a reader of the weights (a forward, ``state_dict``, ``ramtorch.synchronize``) blocked
    waiting for them. ``_engine.host_spans`` holds the one being recorded, ``None`` otherwise:
    checking it is all recording costs while no trace is on."""

    #: Tracks (rows of the trace) of host spans, in the process of the device they concern.
    WORKER = "optimizer (worker thread)"
    CALLER = "optimizer (caller thread)"
    WAITS = "waits for updates"
    #: The disk tier (``offload(disk=...)``): each unit's read from its store (queued to done, on
    #: the store's I/O threads) and the times a forward or backward blocked waiting for one.
    DISK = "disk reads"
    DISK_WAITS = "waits for the disk"
    #: ``optimizer_on_disk=True``: each updated parameter's write-back (its states and weight,
    #: on the stores' I/O threads).
    DISK_WRITES = "disk write-backs"
    TRACKS = (WORKER, CALLER, WAITS, DISK, DISK_WAITS, DISK_WRITES)

    __slots__ = ("spans",)

    def __init__(self) -> None:
        # (track, label, start, end, thread, device, param ids, numel, bytes, args)
        self.spans: list[tuple[Any, ...]] = []

    def add(
        self,
        track: str,
        label: str,
        start: float,
        end: float,
        params: Iterable[torch.Tensor] = (),
        device: torch.device | None = None,
        args: dict[str, Any] | None = None,
    ) -> None:
        """Records ``label`` from ``start`` to ``end`` (``time.perf_counter()`` seconds) on
        ``track``, about ``params`` (named after their offloaded units when the trace is written,
        else counted), on the calling thread."""
        ids, numel, nbytes = [], 0, 0
        for p in params:
            ids.append(id(p))
            numel += p.numel()
            nbytes += p.numel() * p.element_size()
        thread = threading.current_thread().name
        # list.append is atomic: the optimizer's worker thread and the caller record concurrently.
        self.spans.append((track, label, start, end, thread, device, ids, numel, nbytes, args))


def _unit_names() -> dict[int, str]:
    names: dict[int, str] = {}
    for s in [*_streamer.streamers(), *_shared.streamers()]:
        for u in s.units:
            names[u.tag] = u.name
    return names


def _param_units() -> dict[int, tuple[str, torch.device]]:
    """id(parameter) -> the name of the offloaded unit holding it and the device it computes on."""
    units: dict[int, tuple[str, torch.device]] = {}
    for s in _streamer.streamers():
        for u in s.units:
            for p in u.params:
                units.setdefault(id(p), (u.name or "(model)", s.eng.device))
    return units


def _what(
    ids: list[int], nbytes: int, units_of: dict[int, tuple[str, torch.device]]
) -> tuple[str, list[str]]:
    """Names the parameters of a span: their units when every one belongs to an offloaded unit,
    else their count and size. Also returns the units found."""
    units = list(dict.fromkeys(units_of[i][0] for i in ids if i in units_of))
    if units and all(i in units_of for i in ids):
        if len(units) <= 3:
            return ", ".join(units), units
        return f"{units[0]} … {units[-1]} ({len(units)} units)", units
    return f"{len(ids)} param{'s' if len(ids) != 1 else ''}, {format_bytes(nbytes)}", units


def _host_events(
    spans: list[tuple[Any, ...]], pid_of: dict[torch.device, int], origin: float
) -> list[dict[str, Any]]:
    """Chrome events of the host spans, on ``origin``'s timeline (see the module documentation)."""
    units_of = _param_units()
    # Updates in step() run one parameter at a time: consecutive ones of one param group and one
    # unit (or of no unit) are one span.
    merged: list[list[Any]] = []
    last: list[Any] | None = None
    for track, label, start, end, thread, device, ids, numel, nbytes, args in spans:
        unit = units_of.get(ids[0]) if ids else None
        if (
            last is not None
            and track == HostSpans.CALLER
            and last[6]
            and ids
            and (last[0], last[1], last[4], last[5], last[9], last[10])
            == (track, label, thread, device, args, unit)
            and all(units_of.get(i) == unit for i in ids)
        ):
            last[3] = max(last[3], end)
            last[6].extend(ids)
            last[7] += numel
            last[8] += nbytes
            continue
        if any(units_of.get(i) != unit for i in ids):
            unit = False  # of several units, or some of none: joins no other span
        last = [track, label, start, end, thread, device, list(ids), numel, nbytes, args, unit]
        merged.append(last)
    tids = {t: len(_KIND_TRACK) + k for k, t in enumerate(HostSpans.TRACKS)}
    out: list[dict[str, Any]] = []
    used: set[tuple[int, str]] = set()
    for track, label, start, end, thread, device, ids, numel, nbytes, args, _ in merged:
        if device is None and ids and ids[0] in units_of:
            device = units_of[ids[0]][1]  # host parameters: the device of their model
        pid = pid_of.get(device, 0)  # else the first engine's process
        if (pid, track) not in used:
            used.add((pid, track))
            out.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": tids[track], "args": {"name": track}}
            )
        info: dict[str, Any] = {"thread": thread}
        if track in (HostSpans.WAITS, HostSpans.DISK_WAITS):
            name = label
            info["reader"] = _what(ids, nbytes, units_of)[0] if ids else "all parameters"
        else:
            what, units = _what(ids, nbytes, units_of)
            name = f"{label} {what}"
            info.update(params=len(ids), numel=numel, bytes=nbytes, units=units)
        if args:
            info.update(args)
        out.append(
            {
                "ph": "X",
                "name": name,
                "pid": pid,
                "tid": tids[track],
                "ts": (start - origin) * 1e6,
                "dur": max(end - start, 0.0) * 1e6,
                "args": info,
            }
        )
    return out


def _events(
    device: str,
    records: list[tuple[str, int, int, int, float, float]],
    pid: int,
    shift_ms: float = 0.0,
) -> list[dict[str, Any]]:
    """Chrome events of an engine's records; ``shift_ms``: where its base event lies on the trace's
    timeline (see the module documentation)."""
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
            phase = "forward" if code in (_streamer.MARK_FWD_BEGIN, _streamer.MARK_FWD_END) else "backward"
            if code in (_streamer.MARK_FWD_BEGIN, _streamer.MARK_BWD_BEGIN):
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
                    "ts": (begin + shift_ms) * 1e3,
                    "dur": max(start - begin, 0.0) * 1e3,
                }
            )
            continue
        ev: dict[str, Any] = {
            "ph": "X",
            "name": f"{kind} {name}",
            "pid": pid,
            "tid": tids[kind],
            "ts": (start + shift_ms) * 1e3,
            "dur": max(end - start, 0.0) * 1e3,
        }
        if nbytes:
            ms = end - start
            ev["args"] = {"bytes": nbytes, "GB/s": round(nbytes / (ms * 1e6), 2) if ms > 0 else None}
        out.append(ev)
    return out


def _wait_for_updates_in_flight() -> None:
    """Until the optimizer updates still running or queued have finished (their failures are
    raised by the optimizer and the weights' readers, not here)."""
    for u in _engine.pending_updates():
        u.done.wait()


@contextmanager
def trace(path: str | os.PathLike[str]) -> Iterator[None]:
    """Records every copy, compute-stream wait and unit forward/backward span inside the block, and
    the work of ``ramtorch.optim`` optimizers: each update (of an offloaded unit, named after it, or
    of a count of parameters) on the optimizer's worker thread or in ``step()``, and each time a
    forward or another reader blocked waiting for a pipelined update. Writes them to ``path`` as a
    Chrome trace (open it in ``chrome://tracing`` or Perfetto).

    Copies and compute come from device events, so they show what the GPU did, not when Python
    asked for it; optimizer spans are host times, put on the same timeline (the device is
    synchronised once on entry for that; see the module documentation). On exit the block waits
    for the optimizer updates still running (pipelined steps), so that the trace holds them. The
    file is written atomically when the block exits (also when it raises).
    """
    path = os.fspath(path)
    engines = _engine.engines()
    origin = time.perf_counter()
    bases: dict[int, tuple[float, float]] = {}  # id(engine) -> (host time of its base event, error)
    for e in engines:
        e.synchronize_compute()  # the base event is recorded on an idle stream: it runs at once
        before = time.perf_counter()
        e._core.trace_start(e._stream())
        e.synchronize_compute()  # ... and has run by ``after``
        after = time.perf_counter()
        bases[id(e)] = ((before + after) / 2, (after - before) / 2)
        e.tracing = True
    spans = HostSpans()
    _engine.host_spans = spans
    try:
        yield
    finally:
        try:
            _wait_for_updates_in_flight()
        finally:
            _engine.host_spans = None
        events: list[dict[str, Any]] = []
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        pid_of: dict[torch.device, int] = {}
        alignment: dict[str, float] = {}
        for pid, e in enumerate(_engine.engines()):
            if id(e) not in bases:
                e._core.trace_start(e._stream())  # created inside the block: nothing earlier to keep
            records = e._core.trace_stop()
            e.tracing = False
            base, error = bases.get(id(e), (origin, 0.0))
            pid_of[e.device] = pid
            if id(e) in bases:
                alignment[str(e.device)] = round(error * 1e6, 3)
            events += _events(str(e.device), records, pid, (base - origin) * 1e3)
        if not pid_of and spans.spans:
            events.append({"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "ramtorch host"}})
        events += _host_events(spans.spans, pid_of, origin)
        folder = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".trace-", suffix=".json")
        other = {"clock": "µs after the trace began (host perf_counter)", "alignment_error_us": alignment}
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump({"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}, fh)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
