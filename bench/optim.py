"""Benchmark of ramtorch's CPU AdamW kernels against torch's CPU AdamW (fused and foreach).

For each thread count (1 up to all cores; each in a fresh process, since rayon's pool size is fixed
at start: RAYON_NUM_THREADS, and torch.set_num_threads for torch), on N parameters:

- ``copy``: a large tensor copy, the host memory bandwidth ceiling (GB/s read + write, 8 B per
  element; the write-allocate reads of the destination come on top), and ``inplace_add`` (``m += p``:
  12 B per element, in place like an optimizer);
- ``adamw`` ``ramtorch``: our kernel in three storage modes, ``f32`` (28 B of host traffic per
  parameter: reads p, g, m, v, writes p, m, v), ``master`` (fp32 master + bf16 param + bf16 grad,
  fp32 states: 28 B) and ``bf16_sr`` (bf16 param, grad and states, stochastic rounding: 14 B);
- ``adamw`` ``torch_fused`` (``torch.optim.AdamW(fused=True)``) in ``f32`` and ``bf16`` (bf16 params,
  grads and states, round to nearest), and ``torch_foreach`` in ``f32`` (up to ``--foreach-max``
  parameters: it allocates temporaries the size of the tensor).

Prints one JSON line per measurement: seconds (best of ``--repeat`` after a warm-up step, and the
median), GB/s achieved from the bytes above, ``fraction_of_bw`` (of the better of the two bandwidth
measurements), and ``speedup_vs_torch_fused`` = torch fused seconds / ours (same mode family: f32
and master against torch fused f32, bf16_sr against torch fused bf16). Ours and torch take turns
step by step, so that both see the same machine. Peak memory is about 24 bytes per parameter
(foreach adds its temporaries).

    python bench/optim.py                     # 1e9 parameters (needs ~24 GB of RAM)
    python bench/optim.py --numel 10000000    # quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from ramtorch import _core

LR, BETA1, BETA2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 1e-2
BYTES = {"f32": 28, "master": 28, "bf16_sr": 14, "bf16": 14}


def race(fns: dict[tuple[str, str], Callable[[int], None]], repeat: int) -> dict:
    """Best and median seconds of each ``fn(step)``, after one warm-up call each. The functions take
    turns, one call each per round, so that all of them see the same machine (noisy neighbours,
    clock changes) rather than one the quiet minute and another the busy one."""
    for fn in fns.values():
        fn(1)
    times: dict = {k: [] for k in fns}
    for i in range(repeat):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn(i + 2)
            times[k].append(time.perf_counter() - t0)
    return {k: (min(t), statistics.median(t)) for k, t in times.items()}


def ours(p, g, m, v, master=None, seed=0):
    """A step function running our adamw_step on these tensors."""
    dt = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

    def step(k: int) -> None:
        _core.adamw_step(
            p.data_ptr(),
            dt[p.dtype],
            g.data_ptr(),
            dt[g.dtype],
            m.data_ptr(),
            v.data_ptr(),
            dt[m.dtype],
            master=0 if master is None else master.data_ptr(),
            numel=p.numel(),
            step=k,
            lr=LR,
            beta1=BETA1,
            beta2=BETA2,
            eps=EPS,
            weight_decay=WD,
            seed=seed,
        )

    return step


def torch_step(p, g, **kw):
    """A step function running torch.optim.AdamW on ``p`` (storage shared) with gradient ``g``."""
    param = torch.nn.Parameter(p)
    param.grad = g
    opt = torch.optim.AdamW([param], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WD, **kw)

    def step(_: int) -> None:
        opt.step()

    return step, opt


def worker(args) -> None:
    threads = args.threads
    torch.set_num_threads(threads)
    n = args.numel
    base = {"numel": n, "threads": threads, "rayon_threads": _core.optim_threads()}
    records = []

    def emit(rec: dict) -> None:
        records.append({**base, **rec})

    def emit_all(results: dict) -> None:
        for (impl, mode), (best, med) in results.items():
            emit({"bench": "adamw", "impl": impl, "mode": mode, "seconds": best, "median_s": med})

    p = torch.empty(n).uniform_(-1, 1)
    g = torch.empty(n).normal_()
    m = torch.empty(n)

    bw = race({("copy", ""): lambda _: m.copy_(p), ("inplace_add", ""): lambda _: m.add_(p)}, args.repeat)
    copy_bw = 8 * n / bw["copy", ""][0] / 1e9
    # In place, like an optimizer: m += p reads 8 B and writes 4 B per element, with no
    # write-allocate reads (which a copy into a destination not in cache pays on top of its 8 B).
    inplace_bw = 12 * n / bw["inplace_add", ""][0] / 1e9
    for (name, _), (best, med), gbs in zip(bw, bw.values(), (copy_bw, inplace_bw)):
        emit({"bench": name, "seconds": best, "median_s": med, "gb_per_s": gbs})
    ceiling = max(copy_bw, inplace_bw)

    # float32: ours against torch fused, taking turns on the same tensors (24 B per parameter).
    v = torch.zeros(n)
    m.zero_()
    fused, opt = torch_step(p, g, fused=True)
    emit_all(race({("ramtorch", "f32"): ours(p, g, m, v), ("torch_fused", "f32"): fused}, args.repeat))
    fused = opt = None
    if n <= args.foreach_max:
        foreach, opt = torch_step(p, g, foreach=True)
        emit_all(race({("torch_foreach", "f32"): foreach}, args.repeat))
        foreach = opt = None

    # fp32 master and bf16 with stochastic rounding, against torch fused in bf16 (24 B per parameter).
    pb, gb = p.bfloat16(), g.bfloat16()
    g = None
    m.zero_()
    v.zero_()
    mb, vb = torch.zeros_like(pb), torch.zeros_like(pb)
    fused, opt = torch_step(pb, gb, fused=True)
    fns = {
        ("ramtorch", "master"): ours(pb, gb, m, v, master=p),
        ("ramtorch", "bf16_sr"): ours(pb, gb, mb, vb, seed=1),
        ("torch_fused", "bf16"): fused,
    }
    emit_all(race(fns, args.repeat))

    fused = {r["mode"]: r["seconds"] for r in records if r.get("impl") == "torch_fused"}
    fused["master"] = fused["f32"]
    fused["bf16_sr"] = fused["bf16"]
    for r in records:
        if r["bench"] == "adamw":
            r["bytes_per_param"] = BYTES[r["mode"]]
            r["gb_per_s"] = BYTES[r["mode"]] * n / r["seconds"] / 1e9
            r["fraction_of_bw"] = r["gb_per_s"] / ceiling
            r["speedup_vs_torch_fused"] = fused[r["mode"]] / r["seconds"]
        print(json.dumps(r), flush=True)


def thread_counts(spec: str | None) -> list[int]:
    if spec:
        return [int(t) for t in spec.split(",")]
    cores = os.cpu_count() or 1
    counts, t = [], 1
    while t < cores:
        counts.append(t)
        t *= 2
    return counts + [cores]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=lambda s: int(float(s)), default=10**9, help="parameters (1e9)")
    ap.add_argument("--threads", help="comma-separated thread counts (default 1, 2, 4, ... all cores)")
    ap.add_argument("--repeat", type=int, default=5, help="timed steps per measurement (5)")
    ap.add_argument(
        "--foreach-max",
        type=lambda s: int(float(s)),
        default=3 * 10**8,
        help="skip torch foreach above this many parameters (3e8)",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.threads = int(args.threads)
        worker(args)
        return
    for t in thread_counts(args.threads):
        env = {**os.environ, "RAYON_NUM_THREADS": str(t), "OMP_NUM_THREADS": str(t)}
        cmd = [sys.executable, __file__, "--worker", "--threads", str(t), "--numel", str(args.numel)]
        cmd += ["--repeat", str(args.repeat), "--foreach-max", str(args.foreach_max)]
        subprocess.run(cmd, env=env, check=True)


if __name__ == "__main__":
    main()
