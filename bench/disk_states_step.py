"""The optimizer step of parameters whose weights and optimizer states are on disk
(``offload(host_budget=0, disk=..., optimizer_on_disk=True)``), on the CPU: a stack of bf16
``nn.Linear`` layers, ``ramtorch.optim.AdamW`` (fp32 masters), the second ``step()`` timed and
traced. Prints the step's seconds, the write-back spans and the stores' write bandwidth.
``--keep``: the store is kept (``offload(keep=True)``) and committed after each step
(``ramtorch.commit``): the step then journals what it overwrites, and the commit's seconds are
printed too.

    python bench/disk_states_step.py --disk /tmp/rt-disk [--width 2048 --ffn 8192 --layers 8] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import defaultdict

import torch
from torch import nn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--disk", required=True)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--keep", action="store_true", help="a kept store, committed after each step")
    a = ap.parse_args()

    import ramtorch
    import ramtorch.optim as ropt

    torch.manual_seed(0)
    d, f = a.width, a.ffn
    m = nn.Sequential(
        *[nn.Sequential(nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)) for _ in range(a.layers)]
    ).to(torch.bfloat16)
    os.makedirs(a.disk, exist_ok=True)
    disk = tempfile.mkdtemp(dir=a.disk) if a.keep else a.disk
    ramtorch.offload(m, device="cpu", host_budget=0, disk=disk, optimizer_on_disk=True, keep=a.keep)
    opt = ropt.AdamW(m.parameters(), lr=1e-4)
    x = torch.randn(4, d, dtype=torch.bfloat16)

    def fb() -> None:
        opt.zero_grad()
        m(x).float().square().mean().backward()

    fb()
    opt.step()  # (makes the states)
    if a.keep:
        ramtorch.commit(m, opt)
    fb()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        t = time.perf_counter()
        with ramtorch.trace(path):
            opt.step()
            opt.synchronize()
        seconds = time.perf_counter() - t
        journal = ramtorch.stats(m).get("disk_journal_bytes")  # (a commit empties it)
        t = time.perf_counter()
        if a.keep:
            ramtorch.commit(m, opt)
        commit_seconds = time.perf_counter() - t
        with open(path) as fh:
            events = json.load(fh)
    events = events["traceEvents"] if isinstance(events, dict) else events
    tracks = {
        e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"
    }
    busy: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and tracks.get(e["tid"]) == "disk write-backs":
            busy[e["name"].rsplit(" ", 1)[0]] += e["dur"] / 1e6
    st = ramtorch.stats(m)
    params = sum(p.numel() for p in m.parameters())
    if a.keep:
        import shutil

        del opt, m
        shutil.rmtree(disk, ignore_errors=True)
    print(
        json.dumps(
            {
                "params": params,
                "state_bytes": st["disk_state_bytes"],
                "keep": a.keep,
                "step_seconds": seconds,
                "commit_seconds": commit_seconds if a.keep else None,
                "journal_bytes": journal,
                "write_back_span_seconds": dict(busy),
                "disk_state_write_gbps": st["disk_state_write_gbps"],
                "disk_write_gbps": st["disk_write_gbps"],
            }
        )
    )


if __name__ == "__main__":
    main()
