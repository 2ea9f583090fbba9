"""Where one offloaded forward+backward of an architecture of ``bench/arch.py`` spends its time:
the host's busiest functions (``torch.profiler``, CPU self time) and ramtorch's trace summary
(link and compute busy time). A diagnostic, not a benchmark: it prints, it records nothing.

    python3 bench/profile_arch.py --arch mistral llama --layers 4
    python3 bench/profile_arch.py --arch qwen2 llama --layers 8 --decode 1 --out $OUT/traces

``--decode B``: greedy ``generate()`` of ``--new`` tokens after a ``--prompt``-token prompt at
batch B (default options), instead of a training pass; prints the link's largest idle gaps too.
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


def link_gaps(path: str, top: int = 12) -> dict:
    """The host→device track's idle gaps in a Chrome trace of ``ramtorch.trace``: their count and
    sum, and the ``top`` largest with the copies before and after them and what the compute track
    ran meanwhile."""
    doc = json.load(open(path))
    names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in doc["traceEvents"]
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    spans = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    h2d = sorted(
        (e for e in spans if names.get((e["pid"], e["tid"]), "").startswith("host→device")),
        key=lambda e: e["ts"],
    )
    other = sorted((e for e in spans if e not in h2d), key=lambda e: e["ts"])
    gaps = []
    for before, after in zip(h2d, h2d[1:]):
        t0, t1 = before["ts"] + before["dur"], after["ts"]
        if t1 > t0:
            during = [e["name"] for e in other if e["ts"] < t1 and e["ts"] + e["dur"] > t0][:6]
            gaps.append((t1 - t0, before["name"], after["name"], during))
    gaps.sort(reverse=True)
    return {
        "h2d_spans": len(h2d),
        "gaps": len(gaps),
        "gap_ms": round(sum(g[0] for g in gaps) / 1e3, 3),
        "largest": [
            {"ms": round(g / 1e3, 3), "after": b, "before": n, "during": d} for g, b, n, d in gaps[:top]
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", nargs="+", default=["mistral"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--accumulate", action="store_true", help="keep .grad between passes")
    ap.add_argument("--forward", action="store_true", help="forward passes only (no_grad, eval)")
    ap.add_argument("--out", default=None, help="a folder to keep each trace in (<arch>-<pass>.json)")
    ap.add_argument("--decode", type=int, default=0, help="profile greedy generate() at this batch")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=16)
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

        ids = None
        if a.decode:
            model.eval()
            g = torch.Generator().manual_seed(1000 + a.decode)
            ids = torch.randint(3, model.config.vocab_size, (a.decode, a.prompt), generator=g).to("cuda")

        def step(
            model: torch.nn.Module = model, x: dict = x, params: list = params, ids: torch.Tensor | None = ids
        ) -> None:
            if ids is not None:
                arch.greedy(model, ids, a.new)
                return
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
        kind = f"decode{a.decode}" if a.decode else "forward" if a.forward else "forward_backward"
        folder = a.out or tempfile.mkdtemp()
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{name}-{kind}.json")
        with ramtorch.trace(path):
            step()
        print(json.dumps(busy_summary(path), indent=1)[:3000], flush=True)
        print(json.dumps(link_gaps(path), indent=1), flush=True)
        del model, step, params
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
