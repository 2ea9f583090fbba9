"""Benchmark: resuming W1 training from a checkpoint (``ramtorch.load_checkpoint`` into an offloaded
model and ``ramtorch.optim.AdamW``, fp32 master). Prints one JSON line.

The process builds W1 (``--layers`` blocks of ``d``/``f``, bf16) under ``ramtorch.offload``, takes a
training step (so the optimizer holds state, as when resuming into a running job), optionally saves
a checkpoint to ``--path`` (``--save``; then takes one more step so the states differ), and loads the
checkpoint. Reported: the load's seconds, file bytes and GB/s, the anonymous resident memory before
and at its peak during the load (sampled every millisecond), and the optimizer state's bytes.

    python bench/resume.py --path /tmp/w1.ckpt --save --layers 4
    python bench/resume.py --path /tmp/w1.ckpt --layers 4          # another process: page cache warm
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import torch
from w1 import build, loss_of, to_host


def anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", required=True)
    ap.add_argument("--save", action="store_true", help="save the checkpoint first")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=8192)
    ap.add_argument("--f", type=int, default=28672)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    import ramtorch

    model = build("ramtorch", a.d, a.f, a.layers, a.device)
    to_host(model)
    model = ramtorch.offload(model, device=a.device, progress=False)
    opt = ramtorch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(a.tokens, a.d, device=a.device, dtype=torch.bfloat16)

    def step() -> None:
        loss_of(model(x)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    rec: dict = {"layers": a.layers, "params": sum(p.numel() for p in model.parameters())}
    if a.save:
        t = time.perf_counter()
        ramtorch.save_checkpoint(a.path, model, opt, progress=False)
        rec["save_seconds"] = time.perf_counter() - t
        step()
    ramtorch.synchronize()
    rec["optimizer_state_bytes"] = sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
    )
    before = anon()
    peak = [before]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], anon())
            stop.wait(0.001)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t = time.perf_counter()
    try:
        ramtorch.load_checkpoint(a.path, model, opt, progress=False)
        rec["load_seconds"] = time.perf_counter() - t
    finally:
        stop.set()
        th.join()
    size = os.path.getsize(a.path)
    rec.update(
        file_bytes=size,
        load_gbps=size / rec["load_seconds"] / 1e9,
        anon_before_gib=before / 2**30,
        anon_peak_gib=peak[0] / 2**30,
        anon_growth_over_state=(peak[0] - before) / rec["optimizer_state_bytes"],
    )
    step()  # training goes on from the loaded state
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
