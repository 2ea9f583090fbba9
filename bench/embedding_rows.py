"""Bytes and time per pass of a large input embedding under ``ramtorch.offload``: streamed by rows
(``gather_rows=True``: each pass copies the distinct rows it reads) against the whole table
(``gather_rows=False``: each pass copies the table through a slot); one JSON record per line.

    python3 bench/embedding_rows.py [--vocab 200000] [--dim 1024] [--dtype bf16] [--batch 8]
        [--seq 2048] [--reps 5] [--ids-on gpu cpu] [--device cuda]
    python3 bench/embedding_rows.py --device cpu --vocab 20000 --dim 64 --seq 128   # CPU smoke run

The model is ``nn.Embedding(vocab, dim)`` followed by two ``nn.Linear(dim, dim)`` and a
``nn.Linear(dim, 8)`` head, each a unit. A pass is forward and backward of ``out.float().square()
.mean()`` on ``batch x seq`` random ids (a new draw each pass); the first pass is a warm-up. Per
mode and place of the ids (``gpu``: one device→host copy of the ids per pass; ``cpu``: none),
medians over ``--reps`` passes:

- ``pass_seconds``: forward + backward, synchronised;
- ``row_h2d_bytes`` / ``row_d2h_bytes``: rows gathered to the device and row gradients sent back
  (``ramtorch.stats()["devices"][device]``), per pass;
- ``engine_h2d_bytes`` / ``engine_d2h_bytes``: the engine's slot copies and gradient copies, per
  pass (the whole table among them with ``gather_rows=False``);
- ``distinct_rows``: distinct ids per pass; ``table_bytes``; ``slot_device_bytes``: device memory
  of the slots; ``max_allocated``: peak device memory of the timed passes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import ramtorch
import torch
from torch import nn

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build(vocab: int, dim: int, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(vocab, dim), nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, 8)
    ).to(dtype)


def run(args: argparse.Namespace, gather: bool, ids_on: str) -> dict:
    dev = torch.device(args.device)
    model = ramtorch.offload(build(args.vocab, args.dim, DTYPES[args.dtype]), device=dev, gather_rows=gather)
    key = str(ramtorch._engine.normalize_device(dev))
    where = "cpu" if ids_on == "cpu" else dev
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    per: dict[str, list[float]] = {}
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for rep in range(args.reps + 1):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=where)
        sync()
        before = dict(ramtorch.stats()["devices"][key])
        t = time.perf_counter()
        model(ids).float().square().mean().backward()
        sync()
        dt = time.perf_counter() - t
        after = ramtorch.stats()["devices"][key]
        for p in model.parameters():
            p.grad = None
        if rep == 0:
            continue  # warm-up
        per.setdefault("pass_seconds", []).append(dt)
        per.setdefault("distinct_rows", []).append(ids.unique().numel())
        for name, k in (
            ("row_h2d_bytes", "row_h2d_bytes"),
            ("row_d2h_bytes", "row_d2h_bytes"),
            ("engine_h2d_bytes", "h2d_bytes"),
            ("engine_d2h_bytes", "d2h_bytes"),
        ):
            per.setdefault(name, []).append(after[k] - before[k])
    out = {
        "bench": "embedding_rows",
        "device": key,
        "gather_rows": gather,
        "ids_on": ids_on,
        "vocab": args.vocab,
        "dim": args.dim,
        "dtype": args.dtype,
        "tokens": args.batch * args.seq,
        "table_bytes": model[0].weight.numel() * model[0].weight.element_size(),
        "slot_device_bytes": ramtorch.stats()["devices"][key]["slot_device_bytes"],
        "max_allocated": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
    }
    out.update({k: statistics.median(v) for k, v in per.items()})
    ramtorch._offload.detach_streamer(model)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ids-on", nargs="+", choices=["gpu", "cpu"], default=["gpu", "cpu"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    for gather in (True, False):
        for ids_on in args.ids_on if gather else ["gpu"]:
            print(json.dumps(run(args, gather, ids_on)), flush=True)


if __name__ == "__main__":
    main()
