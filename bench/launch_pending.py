"""Host cost of launching kernels on a stream that waits for another stream's unfinished work.

A diagnostic for the host time of a streamed pass: torch.profiler traces of an int8 LoRA step of
the 8B shape (``bench/profile_lora.py --export``) had the same kernels take the same device time
resident and offloaded, but every op's host time about 1.6x longer offloaded, where each unit's
kernels are queued behind a wait for its copy (``Engine::claim``: the compute stream waits on the
copy's event). This times the host side of ``--ops`` small ops (``torch.add`` into a preallocated
output) on the current stream in four states, ``--reps`` times each, and prints the median
microseconds an op for each (one JSON line):

- ``idle``: the stream and the device are idle;
- ``busy``: a long kernel (a bf16 matmul of ``--busy-ms`` about) is queued before them on the
  same stream;
- ``waits_pending``: the stream waits on an event recorded after a long host-to-device copy on
  another stream (``--copy-mib``), still running when the ops are launched;
- ``waits_done``: the stream waits on an event that has already completed.

    python3 bench/launch_pending.py [--ops 2000] [--reps 7] [--copy-mib 1024]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--copy-mib", type=int, default=1024)
    ap.add_argument("--busy-n", type=int, default=16384, help="the busy matmul's size (n x n x n)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("launch_pending.py needs a CUDA device")
    dev = torch.device("cuda")
    x = torch.ones(256, device=dev)
    y = torch.ones(256, device=dev)
    out = torch.empty(256, device=dev)
    src = torch.empty(a.copy_mib << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty(a.copy_mib << 20, dtype=torch.uint8, device=dev)
    big = torch.randn(a.busy_n, a.busy_n, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream(dev)
    cur = torch.cuda.current_stream(dev)

    def launch() -> float:
        t = time.perf_counter()
        for _ in range(a.ops):
            torch.add(x, y, out=out)
        return (time.perf_counter() - t) / a.ops * 1e6

    def idle() -> float:
        torch.cuda.synchronize()
        return launch()

    def busy() -> float:
        torch.cuda.synchronize()
        torch.mm(big, big)
        return launch()

    def waits_pending() -> float:
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(side)
        cur.wait_event(ev)
        return launch()

    def waits_done() -> float:
        torch.cuda.synchronize()
        ev = torch.cuda.Event()
        ev.record(side)
        ev.synchronize()
        cur.wait_event(ev)
        return launch()

    cases = {"idle": idle, "busy": busy, "waits_pending": waits_pending, "waits_done": waits_done}
    for fn in cases.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(a.reps):
        for k, fn in cases.items():
            times[k].append(fn())
    torch.cuda.synchronize()
    row = {k: round(statistics.median(v), 2) for k, v in times.items()}
    row.update(ops=a.ops, reps=a.reps, copy_mib=a.copy_mib, device=torch.cuda.get_device_name(dev))
    print(json.dumps(row))


if __name__ == "__main__":
    main()
