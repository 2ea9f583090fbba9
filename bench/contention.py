"""How fast the fp32-master AdamW runs while the link and the GPU are busy, as in a training step.

A streamed training step runs the CPU optimizer at the same time as the copies of weights to the
GPU and of gradients back, and as the threads that launch the GPU's work and wait on it. This
measures the optimizer's speed under each of those loads alone, to find which one slows it:

- ``alone``: nothing else runs;
- ``h2d`` / ``d2h`` / ``duplex``: threads copy between pinned host memory and the GPU in a loop
  (one direction each, or both at once), and the record gives the copies' GB/s too;
- ``compute``: a thread launches bf16 matrix products on the GPU and waits on them;
- ``step``: duplex copies and compute together, as during a backward pass.

Each load's threads wait on the GPU either spinning (``--waits spin``: ``cudaStreamSynchronize`` under
CUDA's default scheduling, which spins while there are fewer contexts than cores) or sleeping
(``--waits blocking``: events created with ``blocking=True``). The optimizer updates ``--units`` units of
``--numel`` parameters one after another (fp32 master, moments unpinned; bf16 weights and
gradients pinned, as ramtorch keeps them), ``--rounds`` times per load, and each record holds the
median and best milliseconds per unit and the GB/s of optimizer traffic (28 B per parameter).

    python bench/contention.py --numel 235e6 --units 16 --rounds 2

``--op add`` measures the host adds of an accumulating backward instead (``buf += prior``, three
elements' bytes per element), by torch on ``--threads`` threads; ``--op add-core`` by the engine's
kernel (``_core.add_``, on the rayon pool).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from collections.abc import Callable

import torch
from ramtorch import _core

BYTES_PER_PARAM = 28  # master-mode AdamW: reads p, m, v, g; writes p, m, v and the bf16 weight


class Load:
    """Background threads that keep the link or the GPU busy until :meth:`stop`."""

    def __init__(self, kinds: set[str], blocking: bool, nbytes: int) -> None:
        self.kinds = kinds
        self.blocking = blocking
        self.nbytes = nbytes
        self.stop_flag = threading.Event()
        self.copied: dict[str, int] = {}
        self.threads: list[threading.Thread] = []
        self.t0 = self.t1 = 0.0

    def _wait(self, stream: torch.cuda.Stream) -> None:
        if self.blocking:
            ev = torch.cuda.Event(blocking=True)
            ev.record(stream)
            ev.synchronize()
        else:
            stream.synchronize()

    def _copy_loop(self, name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream = torch.cuda.Stream()
        n = 0
        while not self.stop_flag.is_set():
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            self._wait(stream)
            n += src.numel() * src.element_size()
        self.copied[name] = n

    def _compute_loop(self, a: torch.Tensor, b: torch.Tensor) -> None:
        stream = torch.cuda.Stream()
        while not self.stop_flag.is_set():
            with torch.cuda.stream(stream):
                for _ in range(4):
                    torch.mm(a, b)
            self._wait(stream)

    def __enter__(self) -> Load:
        n = self.nbytes // 2
        if self.kinds & {"h2d", "d2h"}:
            host_src = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
            host_dst = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
            dev = torch.empty(2 * n, dtype=torch.bfloat16, device="cuda")
            if "h2d" in self.kinds:
                self.threads.append(threading.Thread(target=self._copy_loop, args=("h2d", dev[:n], host_src)))
            if "d2h" in self.kinds:
                self.threads.append(threading.Thread(target=self._copy_loop, args=("d2h", host_dst, dev[n:])))
        if "compute" in self.kinds:
            a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
            self.threads.append(threading.Thread(target=self._compute_loop, args=(a, a)))
        torch.cuda.synchronize()
        self.t0 = time.perf_counter()
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_flag.set()
        for t in self.threads:
            t.join()
        self.t1 = time.perf_counter()

    def rates(self) -> dict[str, float]:
        secs = self.t1 - self.t0
        return {f"{k}_gb_per_s": v / secs / 1e9 for k, v in self.copied.items()}


def unit_adds(numel: int, units: int, dtype: torch.dtype, kernel: bool) -> list[Callable[[int], None]]:
    """One function per unit that adds a bf16 gradient into another (``buf += prior``, torch's CPU
    kernel on its intra-op threads), as the host adds of an accumulating backward do."""
    fns = []
    for _ in range(units):
        buf = torch.empty(numel, dtype=dtype, pin_memory=True).fill_(0.5)
        prior = torch.empty(numel, dtype=dtype, pin_memory=True).fill_(0.25)

        def add(k: int, buf=buf, prior=prior) -> None:
            if kernel:  # the engine's own (``_core.add_``), as its host adds run it
                _core.add_(buf, prior, str(buf.dtype).removeprefix("torch."), buf.numel())
            else:
                buf.add_(prior)

        fns.append(add)
    return fns


def unit_steps(numel: int, units: int) -> list[Callable[[int], None]]:
    """One update function per unit, each over its own buffers."""
    fns = []
    for _ in range(units):
        master = torch.empty(numel).uniform_(-1, 1)
        m, v = torch.zeros(numel), torch.zeros(numel)
        w = torch.empty(numel, dtype=torch.bfloat16, pin_memory=True)
        g = torch.empty(numel, dtype=torch.bfloat16, pin_memory=True).normal_()

        def step(k: int, master=master, m=m, v=v, w=w, g=g) -> None:
            _core.adamw_step(
                w.data_ptr(), "bfloat16", g.data_ptr(), "bfloat16", m.data_ptr(), v.data_ptr(), "float32",
                master=master.data_ptr(), numel=numel, step=k, lr=1e-3, beta1=0.9, beta2=0.999,
                eps=1e-8, weight_decay=1e-2,
            )  # fmt: skip

        fns.append(step)
    return fns


LOADS = {
    "alone": set(),
    "h2d": {"h2d"},
    "d2h": {"d2h"},
    "duplex": {"h2d", "d2h"},
    "compute": {"compute"},
    "step": {"h2d", "d2h", "compute"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=lambda s: int(float(s)), default=235_000_000, help="parameters per unit")
    ap.add_argument("--units", type=int, default=16, help="units updated one after another")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the units per load")
    ap.add_argument("--loads", nargs="+", default=list(LOADS), choices=list(LOADS))
    ap.add_argument("--waits", nargs="+", default=["spin"], choices=["spin", "blocking"], help="load waits")
    ap.add_argument(
        "--op",
        default="adamw",
        choices=["adamw", "add", "add-core"],
        help="the host work: optimizer, torch add, engine add",
    )
    ap.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="--op add's"
    )
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads for --op add (0: torch's)")
    ap.add_argument("--copy-bytes", type=lambda s: int(float(s)), default=1 << 30, help="bytes per copy")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("contention.py needs a CUDA device")

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    adds = args.op.startswith("add")
    fns = (
        unit_adds(args.numel, args.units, dtype, args.op == "add-core")
        if adds
        else unit_steps(args.numel, args.units)
    )
    per_param = 3 * dtype.itemsize if adds else BYTES_PER_PARAM  # add: reads two elements, writes one
    k = 1
    for f in fns:  # warm-up: first touch of every page
        f(k)
    base = {
        "numel": args.numel,
        "units": args.units,
        "op": f"{args.op} {args.dtype}" if adds else args.op,
        "rayon_threads": _core.optim_threads(),
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
    }
    for name, wait in [(n, w) for w in args.waits for n in args.loads]:
        if not LOADS[name] and wait != args.waits[0]:
            continue  # nothing waits under "alone"
        times = []
        with Load(LOADS[name], wait == "blocking", args.copy_bytes) as load:
            time.sleep(0.05)  # let the load reach its pace
            for _ in range(args.rounds):
                k += 1
                for f in fns:
                    t0 = time.perf_counter()
                    f(k)
                    times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        rec = {
            **base,
            "load": name,
            "waits": wait,
            "median_ms": med * 1e3,
            "best_ms": min(times) * 1e3,
            "worst_ms": max(times) * 1e3,
            "gb_per_s": per_param * args.numel / med / 1e9,
            **load.rates(),
        }
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
