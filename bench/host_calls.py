"""Host time of the streaming's own calls during one offloaded pass of an architecture of
``bench/arch.py`` (the streamer's hooks, its prefetches, the engine's calls and the backward's
hooks, each wrapped with a timer; a call's time includes the wrapped calls it makes): the total per
call, and each call that held the host at least ``--min-ms``, with when it began; the calls into
the engines' Rust halves (``core.*``); and the engine's waits on the device. Finds where the host
stands between the GPU and its next kernels. A diagnostic: it prints, it records nothing.

    python3 bench/host_calls.py --arch resnet --layers 50
    python3 bench/host_calls.py --arch resnet --layers 50 --train
    python3 bench/host_calls.py --arch resnet --layers 50 --train --bare --passes 30

``--bare`` wraps nothing (the timers add host time to every call they wrap) and prints, per pass,
the host time of the forward and of the backward, when the device was done, and the time Python's
garbage collector took in the pass (by generation): whether a slow pass was slow on the host or on
the device, and whether a full collection made it so.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import arch  # noqa: E402

#: (class path, method names) wrapped with timers.
WRAPPED = (
    (
        "ramtorch._stream.streamer.Streamer",
        ("pre_forward", "_post_forward", "part_pre_forward", "begin_pass"),
    ),
    ("ramtorch._stream.itinerary.Prefetcher", ("_prefetch_along", "_take")),
    (
        "ramtorch._engine.DeviceEngine",
        ("prefetch", "claim", "release", "push_grad", "finish", "_stream", "_add_small", "_copy_small"),
    ),
    ("ramtorch._stream.functions.GradientHooks", ("_pack", "_unpack", "_hook_weight_consumers")),
    ("ramtorch._stream.functions._EarlyGrad", ("__call__",)),
)


def wrap(log: list[tuple[str, str, float, float]], origin: list[float]) -> None:
    """Replaces the methods of :data:`WRAPPED` with timed ones that append to ``log``."""
    import importlib

    for path, names in WRAPPED:
        module, _, cls_name = path.rpartition(".")
        cls = getattr(importlib.import_module(module), cls_name)
        for name in names:
            label = f"{cls_name}()" if name == "__call__" else name
            setattr(cls, name, timed(getattr(cls, name), label, log, origin))


def timed(f: Callable[..., Any], name: str, log: list, origin: list[float]) -> Callable[..., Any]:
    @functools.wraps(f)
    def g(self: Any, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(self, *a, **k)
        finally:
            what = getattr(a[0], "name", "") if a else ""
            if name == "prefetch":  # (the label: a method's name, or Class() for __call__)
                parts = a[7] if len(a) > 7 else k.get("parts", ())
                what = f"{a[2] / 2**20:.0f} MiB in {len(parts) + 1} parts"
            log.append((name, what, t - origin[0], time.perf_counter() - t))

    return g


#: Methods of the engines' Rust halves timed through :class:`TimedCore` (labelled ``core.*``).
CORE_CALLS = ("copy_to_host", "prefetch", "claim", "claim_part", "release", "synchronize")


class TimedCore:
    """An engine's Rust half (``DeviceEngine._core``) whose :data:`CORE_CALLS` are timed."""

    def __init__(self, core: Any, log: list, origin: list[float]) -> None:
        self._inner = core
        for name in CORE_CALLS:
            f = getattr(core, name)
            setattr(self, name, timed_call(f, f"core.{name}", log, origin))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def timed_call(f: Callable[..., Any], name: str, log: list, origin: list[float]) -> Callable[..., Any]:
    def g(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            log.append((name, "", t - origin[0], time.perf_counter() - t))

    return g


def engine_waits() -> dict[str, float]:
    """The engines' counters of time the host waited on the device (summed over devices): for a
    throttle (``throttle_*``) and for every copy at the end of a backward (``sync_wait_seconds``)."""
    from ramtorch import _engine

    keys = ("throttle_waits", "throttle_wait_seconds", "sync_wait_seconds")
    out = dict.fromkeys(keys, 0.0)
    for e in _engine.engines():
        st = e.stats()
        for k in keys:
            out[k] += float(st.get(k, 0.0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=list(arch.ARCHS), default="resnet")
    ap.add_argument("--layers", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--train", action="store_true", help="forward+backward (default: forward, no_grad)")
    ap.add_argument("--min-ms", type=float, default=0.2, help="list each call that took this long")
    ap.add_argument("--bare", action="store_true", help="no timers: per pass, host and device times only")
    ap.add_argument("--passes", type=int, default=2, help="passes timed (after 4 warm-up passes)")
    a = ap.parse_args()
    import ramtorch

    log: list[tuple[str, str, float, float]] = []
    origin = [0.0]
    if not a.bare:
        wrap(log, origin)
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    model = arch.build(a.arch, a.layers, not cuda, dev, torch.bfloat16)
    x, _ = arch.inputs(a.arch, a.tokens, not cuda, dev, torch.bfloat16)
    model.to("cpu")
    ramtorch.offload(model, device=dev)
    from ramtorch import _engine

    if not a.bare:
        for e in _engine.engines():
            e._core = TimedCore(e._core, log, origin)
    model.train(a.train)
    params = list(model.parameters())

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    queued = [0.0]
    forward_done = [0.0]

    def step() -> None:
        if not a.train:
            with torch.no_grad():
                model(**x)
            queued[0] = forward_done[0] = time.perf_counter()
            return
        loss = arch.loss_of(model(**x))
        forward_done[0] = time.perf_counter()
        loss.backward()
        queued[0] = time.perf_counter()
        ramtorch.synchronize()
        for p in params:
            p.grad = None

    for _ in range(4):
        step()
    collections: list[tuple[int, float]] = []  # (generation, seconds) of the collections in a pass
    began = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            collections.append((info["generation"], time.perf_counter() - began[0]))

    if a.bare:
        gc.callbacks.append(on_gc)
        print("pass  host forward  host backward  device done  gc (ms; host: before the closing synchronize)")
    for i in range(a.passes):
        sync()
        log.clear()
        collections.clear()
        waits0 = engine_waits()
        origin[0] = time.perf_counter()
        step()
        host = time.perf_counter() - origin[0]
        sync()
        done = time.perf_counter() - origin[0]
        before = queued[0] - origin[0]
        waits = {k: v - waits0[k] for k, v in engine_waits().items()}
        if a.bare:
            fwd = forward_done[0] - origin[0]
            by_gen: dict[int, list[float]] = {}
            for g, d in collections:
                by_gen.setdefault(g, []).append(d)
            gcs = " ".join(f"gen{g}: {len(v)} in {sum(v) * 1e3:.2f}" for g, v in sorted(by_gen.items()))
            print(f"{i:4d} {fwd * 1e3:13.2f} {(before - fwd) * 1e3:14.2f} {done * 1e3:12.2f}  {gcs}")
            continue
        print(
            f"pass: host {host * 1e3:.2f} ms ({before * 1e3:.2f} before its closing synchronize), "
            f"until the device is done {done * 1e3:.2f} ms"
        )
        shown = [f"{k} {v * 1e3:.2f} ms" if "seconds" in k else f"{k} {v:.0f}" for k, v in waits.items()]
        print("  the engine's waits on the device in it: " + ", ".join(shown))
        totals: dict[str, list[float]] = {}
        for name, _, _, d in log:
            t = totals.setdefault(name, [0, 0.0])
            t[0] += 1
            t[1] += d
        for name, (n, d) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
            print(f"  {name:18s} {int(n):5d} calls {d * 1e3:8.2f} ms")
        for name, what, t, d in log:
            if d * 1e3 >= a.min_ms:
                print(f"    at {t * 1e3:8.2f} ms: {d * 1e3:6.2f} ms {name} {what}")


if __name__ == "__main__":
    main()
