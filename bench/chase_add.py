"""Gradients that add onto host gradients: added whole after their copy lands, or by parts as each
part lands.

An accumulating backward whose running sums do not fit on the GPU copies each new gradient into a
host buffer and adds the gradient of the earlier backwards into it (``buf += prior``). Added whole
after the copy, the buffer has left the CPU's caches by then: the host's memory carries the copy's
write, the buffer's read, the prior's read and the buffer's write (four bytes for each gradient
byte). Added by parts right behind the copy, a part may still be in the last-level cache where the
host's PCIe writes land (Intel's DDIO), and the buffer's write and read cost the memory nothing.

This measures how long ``--grads`` gradients of ``--numel`` bf16 elements take to cross and be
added, with the link's other direction busy (``--load h2d``: the weights of a backward) or idle:

    python bench/chase_add.py --numel 224e6 --grads 12 --parts 0 8 32 --ahead 0 4 --load none h2d

``--parts 0`` copies each gradient whole; ``--ahead N`` (N > 0) lets the copies run at most N parts
ahead of the adds (0: no bound). One JSON record per line.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import threading
import time

import torch
from ramtorch import _arena, _core


class H2DLoad:
    """A thread copying pinned host memory to the GPU in a loop until :meth:`stop`."""

    def __init__(self, nbytes: int) -> None:
        self.src = _arena.host_empty((nbytes,), torch.uint8)
        self.dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.flag = threading.Event()
        self.copied = 0
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.t0 = time.perf_counter()
        self.thread.start()

    def _loop(self) -> None:
        stream = torch.cuda.Stream()
        while not self.flag.is_set():
            with torch.cuda.stream(stream):
                self.dst.copy_(self.src, non_blocking=True)
            stream.synchronize()
            self.copied += self.src.numel()

    def stop(self) -> float:
        self.flag.set()
        self.thread.join()
        return self.copied / (time.perf_counter() - self.t0) / 1e9


def one_round(
    grads: list[torch.Tensor], bufs: list[torch.Tensor], priors: list[torch.Tensor], part: int, ahead: int
) -> tuple[float, float]:
    """Seconds until every gradient has landed and been added, and until the last copy landed."""
    stream = torch.cuda.Stream()
    jobs: queue.Queue = queue.Queue()
    done = threading.Semaphore(ahead if ahead > 0 else 1 << 30)
    landed = [0.0]

    def adder() -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            ev, dst, src = job
            ev.synchronize()
            landed[0] = time.perf_counter()
            _core.add_(dst, src, "bfloat16", dst.numel())
            done.release()

    worker = threading.Thread(target=adder, daemon=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    worker.start()
    for g, b, p in zip(grads, bufs, priors):
        n = g.numel()
        step = n if part <= 0 else part
        for o in range(0, n, step):
            done.acquire()
            with torch.cuda.stream(stream):
                b[o : o + step].copy_(g[o : o + step], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
            jobs.put((ev, b[o : o + step], p[o : o + step]))
    jobs.put(None)
    worker.join()
    t1 = time.perf_counter()
    return t1 - t0, landed[0] - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=float, default=224e6)
    ap.add_argument("--grads", type=int, default=12)
    ap.add_argument("--parts", type=float, nargs="+", default=[0, 8, 32], help="MiB a part; 0: whole")
    ap.add_argument("--ahead", type=int, nargs="+", default=[0])
    ap.add_argument("--load", nargs="+", default=["none", "h2d"], choices=["none", "h2d"])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    numel = int(args.numel)
    # Device gradients: a few distinct tensors reused (the copies read them; values do not matter).
    dev = [torch.randn(numel, device="cuda").to(torch.bfloat16) for _ in range(min(args.grads, 3))]
    grads = [dev[i % len(dev)] for i in range(args.grads)]
    bufs = [_arena.host_empty((numel,), torch.bfloat16) for _ in range(args.grads)]
    priors = [_arena.host_empty((numel,), torch.bfloat16) for _ in range(args.grads)]
    for p in priors:
        p.fill_(1.0)
    gbytes = args.grads * numel * 2
    for load in args.load:
        for part_mib in args.parts:
            for ahead in args.ahead:
                if part_mib <= 0 and ahead > 0:
                    continue
                part = int(part_mib * 2**20) // 2
                one_round(grads, bufs, priors, part, ahead)  # warm-up
                times, lands, rates = [], [], []
                for _ in range(args.rounds):
                    h = H2DLoad(1 << 30) if load == "h2d" else None
                    t, last = one_round(grads, bufs, priors, part, ahead)
                    rates.append(h.stop() if h is not None else 0.0)
                    times.append(t)
                    lands.append(last)
                med = statistics.median(times)
                rec = {
                    "bench": "chase_add",
                    "load": load,
                    "part_mib": part_mib,
                    "ahead": ahead,
                    "grads": args.grads,
                    "numel": numel,
                    "ms": [round(t * 1e3, 1) for t in times],
                    "last_landed_ms": [round(t * 1e3, 1) for t in lands],
                    "grad_gbps": round(gbytes / med / 1e9, 1),
                    "h2d_gbps": [round(r, 1) for r in rates],
                }
                print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
