"""Where one offloaded forward+backward of an architecture of ``bench/arch.py`` spends its time:
the host's busiest functions (``torch.profiler``, CPU self time) and ramtorch's trace summary
(link and compute busy time). A diagnostic, not a benchmark: it prints, it records nothing.

    python3 bench/profile_arch.py --arch mistral llama --layers 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import arch  # noqa: E402
from w1 import busy_summary  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", nargs="+", default=["mistral"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--accumulate", action="store_true", help="keep .grad between passes")
    ap.add_argument("--forward", action="store_true", help="forward passes only (no_grad, eval)")
    ap.add_argument("--out", default=None, help="a folder to keep each trace in (<arch>-<pass>.json)")
    ap.add_argument("--no-profiler", action="store_true", help="skip torch.profiler's table")
    ap.add_argument("--torch-trace", action="store_true", help="keep torch.profiler's trace (with --out)")
    a = ap.parse_args()
    import ramtorch

    for name in a.arch:
        model = arch.build(name, a.layers, False, "cuda", torch.bfloat16)
        x, _ = arch.inputs(name, a.tokens, False, "cuda", torch.bfloat16)
        model.to("cpu")
        torch.cuda.empty_cache()
        ramtorch.offload(model, device="cuda")
        model.train(not a.forward)
        params = list(model.parameters())

        def step(model: torch.nn.Module = model, x: dict = x, params: list = params) -> None:
            if a.forward:
                with torch.no_grad():
                    model(**x)
                return
            arch.loss_of(model(**x)).backward()
            ramtorch.synchronize()
            if not a.accumulate:
                for p in params:
                    p.grad = None

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        print(f"## {name}: {1e3 * (time.perf_counter() - t):.1f} ms", flush=True)
        if not a.no_profiler:
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts[: 1 + a.torch_trace]) as prof:
                step()
                torch.cuda.synchronize()
            if a.torch_trace and a.out:
                os.makedirs(a.out, exist_ok=True)
                prof.export_chrome_trace(os.path.join(a.out, f"{name}-torch.json"))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18), flush=True)
        kind = "forward" if a.forward else "forward_backward"
        folder = a.out or tempfile.mkdtemp()
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{name}-{kind}.json")
        with ramtorch.trace(path):
            step()
        print(json.dumps(busy_summary(path), indent=1)[:3000], flush=True)
        del model, step, params
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
