"""W1 (MLP stack, bf16) for one system in this process; prints one JSON record per line.

Systems: ``ramtorch-linear`` (this package's ``ramtorch.nn.Linear``), ``resident`` (plain
``nn.Linear`` on the GPU), ``ramtorch-1.11-linear`` (the original RamTorch's per-layer Linear; run
with that package first on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn


def build(system: str, d: int, f: int, layers: int) -> nn.Module:
    dt = torch.bfloat16
    mods: list[nn.Module] = []
    for _ in range(layers):
        for i, o in ((d, f), (f, d)):
            if system == "resident":
                lin = nn.Linear(i, o, bias=False, device="cuda", dtype=dt)
            elif system == "ramtorch-linear":
                import ramtorch.nn as rnn

                lin = rnn.Linear(i, o, bias=False, device="cuda", dtype=dt)
            elif system == "ramtorch-1.11-linear":
                import ramtorch as rt

                lin = rt.Linear(i, o, bias=False, device="cuda", dtype=dt, skip_init=True)
            else:
                raise SystemExit(f"unknown system {system}")
            with torch.no_grad():  # fill on the GPU, copy into wherever the layer keeps weights
                lin.weight.copy_(torch.randn(o, i, device="cuda", dtype=dt).mul_(i**-0.5))
            mods.append(lin)
            if i == d:
                mods.append(nn.GELU())
    return nn.Sequential(*mods)


def rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096


def timeit(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--d", type=int, default=8192)
    ap.add_argument("--f", type=int, default=28672)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--phases", nargs="+", default=["forward", "forward_backward"])
    a = ap.parse_args()
    model = build(a.system, a.d, a.f, a.layers)
    params = [p for p in model.parameters()]
    wbytes = sum(p.numel() * p.element_size() for p in params)
    for t in a.tokens:
        x = torch.randn(t, a.d, device="cuda", dtype=torch.bfloat16)
        for phase in a.phases:

            def fwd(x: torch.Tensor = x) -> None:
                with torch.no_grad():
                    model(x)

            def fwd_bwd(x: torch.Tensor = x) -> None:
                loss = model(x).float().pow(2).mean()
                loss.backward()
                for p in params:
                    p.grad = None

            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            s = timeit(fwd if phase == "forward" else fwd_bwd, warmup=2, reps=a.reps)
            rec = {
                "workload": "W1",
                "tokens": t,
                "phase": phase,
                "system": a.system,
                "seconds": s,
                "gpu_peak_bytes": torch.cuda.max_memory_allocated(),
                "gpu_peak_above_base_bytes": torch.cuda.max_memory_allocated() - base,
                "host_rss_bytes": rss(),
                "weight_bytes": wbytes,
                "params": sum(p.numel() for p in params),
            }
            if a.system == "ramtorch-linear":
                import ramtorch

                rec["engine"] = ramtorch.stats()["devices"].get("cuda:0")
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
