"""ramtorch.trace records the CPU optimizer's work: each update (in step() on the caller's thread,
during backward on the optimizer's worker thread) and each wait of a reader for a pipelined update,
on the timeline of the engine's records. On the CPU device the engine's events are host times, so
the order of optimizer spans against forward/backward spans checks the clock alignment."""

from __future__ import annotations

import json
import threading
import time

import pytest
import ramtorch
import ramtorch.nn as rnn
import ramtorch.optim as ropt
import torch
from conftest import Net, slow_updates
from ramtorch import _engine, _trace
from torch import nn

UNITS = ["inp", "blocks.0", "blocks.1", "blocks.2", "out"]
WORKER, CALLER, WAITS = _trace.HostSpans.WORKER, _trace.HostSpans.CALLER, _trace.HostSpans.WAITS


def train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, steps: int) -> None:
    for _ in range(steps):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        model(x)  # pipelined: waits for the updates of the last step


def traced(path, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> tuple[list, dict, float]:
    """Trains two steps under ramtorch.trace; returns the trace's spans (each with its track's
    name), its otherData and how long the block took (µs: the trace's time range)."""
    start = time.perf_counter()
    with ramtorch.trace(path):
        train(model, opt, x, 2)
    elapsed_us = (time.perf_counter() - start) * 1e6
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans = [dict(e, track=tracks[(e["pid"], e["tid"])]) for e in events if e["ph"] == "X"]
    return spans, data["otherData"], elapsed_us


def unit_bytes(model: nn.Module) -> dict[str, int]:
    return {
        u.name: sum(p.numel() * p.element_size() for p in u.params) for u in model._ramtorch_streamer.units
    }


@pytest.mark.parametrize("pipeline", [False, True], ids=["backward", "pipeline"])
def test_trace_shows_optimizer_updates_and_waits_on_the_device_timeline(tmp_path, pipeline):
    torch.manual_seed(0)
    model = Net(layers=3)
    ramtorch.offload(model, device="cpu")
    assert sorted(u.name for u in model._ramtorch_streamer.units) == sorted(UNITS)
    opt = ropt.AdamW(model.parameters(), lr=1e-2, pipeline=pipeline, overlap="backward")
    slow_updates(opt, 0.003)
    x = torch.randn(4, 8)
    spans, other, elapsed_us = traced(tmp_path / "trace.json", model, opt, x)
    tol = other["alignment_error_us"]["cpu"] + 1.0  # where the device records may sit, against host times
    assert 0 <= tol < 1e4

    # Every span lies in the trace's time range.
    for e in spans:
        assert e["dur"] >= 0, e
        assert -tol <= e["ts"] and e["ts"] + e["dur"] <= elapsed_us + tol, e

    # The optimizer's tracks are in the process of the device the model computes on.
    cpu_pid = next(e["pid"] for e in spans if e["track"] == "compute")
    caller = [e for e in spans if e["track"] == CALLER]
    worker = [e for e in spans if e["track"] == WORKER and e["name"].startswith("update ")]
    assert caller and worker
    assert {e["pid"] for e in caller + worker} == {cpu_pid}

    # The first step's updates run in step(), on the caller's thread: one span per unit. The
    # second step's run during backward, on the optimizer's worker thread, one job per unit.
    sizes = unit_bytes(model)
    for track, thread in ((caller, threading.current_thread().name), (worker, "ramtorch-optim")):
        assert sorted(e["name"] for e in track) == sorted(f"update {u}" for u in UNITS)
        for e in track:
            unit = e["name"].removeprefix("update ")
            assert e["dur"] >= 3000 * e["args"]["params"] > 0, e  # the injected 3 ms a parameter
            assert e["args"]["units"] == [unit]
            assert e["args"]["bytes"] == sizes[unit]
            assert e["args"]["thread"] == thread

    # On the device's timeline: step 1's updates come after its backward and before the next
    # forward; a job of step 2 starts once its unit's backward has begun.
    compute = [e for e in spans if e["track"] == "compute"]
    fwd = sorted((e for e in compute if e["name"].startswith("forward ")), key=lambda e: e["ts"])
    bwd = sorted((e for e in compute if e["name"].startswith("backward ")), key=lambda e: e["ts"])
    n = len(UNITS)
    assert len(fwd) == 3 * n and len(bwd) == 2 * n
    end_of = lambda e: e["ts"] + e["dur"]  # noqa: E731
    assert max(end_of(e) for e in bwd[:n]) <= min(e["ts"] for e in caller) + tol
    assert max(end_of(e) for e in caller) <= fwd[n]["ts"] + tol
    for e in worker:
        unit = e["name"].removeprefix("update ")
        began = next(b["ts"] for b in bwd[n:] if b["name"] == f"backward {unit}")
        assert e["ts"] >= began - tol, (e, began)

    waits = [e for e in spans if e["track"] == WAITS]
    if not pipeline:
        # backward() returned with its updates done: the next forward never waited.
        assert not waits
        assert max(end_of(e) for e in worker) <= fwd[2 * n]["ts"] + tol
        return
    # Pipelined: step() returned with updates queued; the third forward waited for them.
    assert waits
    readers = set()
    for w in waits:
        assert w["name"] == "wait for update" and w["dur"] > 0 and w["pid"] == cpu_pid
        reader = w["args"]["reader"]
        assert reader in UNITS and w["args"]["updates"]
        readers.add(reader)
        # The update it waited for ended inside the wait, and the reader's forward came after.
        done = next(end_of(e) for e in worker if e["name"] == f"update {reader}")
        assert w["ts"] <= done <= end_of(w) + 1.0, (w, done)
        forward = next(f for f in fwd[2 * n :] if f["name"] == f"forward {reader}")
        assert end_of(w) <= forward["ts"] + tol, (w, forward)
    assert len(readers) == len(waits)


def test_per_layer_linear_updates_are_named_by_size(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(rnn.Linear(8, 16, device="cpu"), nn.GELU(), rnn.Linear(16, 3, device="cpu"))
    opt = ropt.AdamW(model.parameters(), lr=1e-2, pipeline=True)
    slow_updates(opt, 0.001)
    spans, _, elapsed_us = traced(tmp_path / "trace.json", model, opt, torch.randn(4, 8))
    updates = [e for e in spans if e["track"] in (CALLER, WORKER) and e["name"].startswith("update ")]
    # Step 1 in step() (the param group, joined), step 2 one job per layer during backward.
    names = sorted(e["name"] for e in updates)
    assert names == ["update 2 params, 204 B", "update 2 params, 576 B", "update 4 params, 780 B"]
    for e in updates:
        assert e["dur"] > 0 and 0 <= e["ts"] and e["ts"] + e["dur"] <= elapsed_us
        assert e["args"]["units"] == []


def test_nothing_is_recorded_outside_a_trace(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(_trace.HostSpans, "add", lambda self, *a, **k: calls.append(a[:2]))
    torch.manual_seed(0)
    model = Net(layers=3)
    ramtorch.offload(model, device="cpu")
    opt = ropt.AdamW(model.parameters(), lr=1e-2, pipeline=True)
    slow_updates(opt, 0.002)
    x = torch.randn(4, 8)
    train(model, opt, x, 3)
    ramtorch.synchronize()
    assert _engine.host_spans is None and calls == []
    with ramtorch.trace(tmp_path / "trace.json"):
        assert _engine.host_spans is not None
        train(model, opt, x, 1)
    assert calls  # the patch sees recording when there is some
    assert _engine.host_spans is None
    calls.clear()
    train(model, opt, x, 2)
    ramtorch.synchronize()
    assert calls == []
