"""Host time of queueing a copy in parts, an event after each: torch's copies and events, and the
engine's ``prefetch(parts=...)``, alone and behind another copy; and small copies queued behind a
large one, with events that the host may wait for (``blocking``) or not. A diagnostic: it prints.

    python3 bench/parts_issue.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

N = 1296941056  # the bytes of a ResNet's third stage (bench/arch.py --arch resnet --full-depth)
SMALL = 1 << 20


def median_ms(samples: list[float]) -> float:
    samples.sort()
    return samples[len(samples) // 2] * 1e3


def rows(what: str, cases: tuple[int, ...], time_of: Callable[[int, bool], float], other: str) -> None:
    """Prints ``time_of(case, False)`` and ``time_of(case, True)`` (``other``) for each case."""
    for c in cases:
        print(
            f"{what.format(c)}: host {time_of(c, False):7.3f} ms, {other} {time_of(c, True):7.3f} ms",
            flush=True,
        )


def main() -> None:
    from ramtorch import _arena, _engine

    src = _arena.host_bytes(N)  # page-locked arena memory, as units are
    dst = torch.empty(N, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()

    def torch_parts(parts: int, blocking: bool, reps: int = 5) -> float:
        ends = [N * (i + 1) // parts for i in range(parts)]
        events = [torch.cuda.Event(blocking=blocking) for _ in range(parts)]
        out = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.cuda.stream(side):
                at = 0
                for e, ev in zip(ends, events):
                    dst[at:e].copy_(src[at:e], non_blocking=True)
                    ev.record(side)
                    at = e
            out.append(time.perf_counter() - t)
            torch.cuda.synchronize()
        return median_ms(out)

    rows("torch, {:4d} parts", (1, 10, 72, 300), torch_parts, "blocking events")

    eng = _engine.engine_for(torch.device("cuda", torch.cuda.current_device()))
    eng.reserve(N, 3)
    key = [1 << 40]

    def engine_parts(parts: int, behind: bool, reps: int = 5) -> float:
        ends = [N * (i + 1) // parts for i in range(parts - 1)]
        out = []
        for _ in range(reps):
            torch.cuda.synchronize()
            key[0] += 2
            held = []
            if behind:
                held.append(eng.prefetch(key[0], src, N, 2, [], 0, 0, [])[0])
            t = time.perf_counter()
            held.append(eng.prefetch(key[0] + 1, src, N, 2, [], 0, 0, ends)[0])
            out.append(time.perf_counter() - t)
            for slot in held:
                eng.claim(slot)
                eng.release(slot)
            torch.cuda.synchronize()
        return median_ms(out)

    rows("engine, {:4d} parts", (1, 10, 16, 72, 300), engine_parts, "behind another copy")

    def behind_big(k: int, blocking: bool, reps: int = 3) -> float:
        events = [torch.cuda.Event(blocking=blocking) for _ in range(k)]
        out = []
        for _ in range(reps):
            torch.cuda.synchronize()
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)
                t = time.perf_counter()
                for i, ev in enumerate(events):
                    a, b = i * SMALL, (i + 1) * SMALL
                    dst[a:b].copy_(src[a:b], non_blocking=True)
                    ev.record(side)
                out.append(time.perf_counter() - t)
            torch.cuda.synchronize()
        return median_ms(out)

    rows("{:4d} small copies behind a large one", (16, 48, 64, 128, 512), behind_big, "blocking events")


if __name__ == "__main__":
    main()
