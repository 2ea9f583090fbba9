"""Host time of queueing a copy in parts, an event after each: torch's copies and events, and the
engine's ``prefetch(parts=...)``, alone and behind another copy; and small copies queued behind a
large one, with events that the host may wait for (``blocking``) or not. A diagnostic: it prints.

    python3 bench/parts_issue.py
"""

from __future__ import annotations

import time

import torch

N = 1296941056  # the bytes of a ResNet's third stage (bench/arch.py --arch resnet --full-depth)
SMALL = 1 << 20


def median_ms(samples: list[float]) -> float:
    samples.sort()
    return samples[len(samples) // 2] * 1e3


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

    for parts in (1, 10, 72, 300):
        print(
            f"torch, {parts:4d} parts: host {torch_parts(parts, False):7.3f} ms, "
            f"blocking events {torch_parts(parts, True):7.3f} ms",
            flush=True,
        )

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

    for parts in (1, 10, 16, 72, 300):
        print(
            f"engine, {parts:4d} parts: host {engine_parts(parts, False):7.3f} ms, "
            f"behind another copy {engine_parts(parts, True):7.3f} ms",
            flush=True,
        )

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

    for k in (16, 48, 64, 128, 512):
        print(
            f"{k:4d} small copies behind a large one: host {behind_big(k, False):7.3f} ms, "
            f"blocking events {behind_big(k, True):7.3f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
