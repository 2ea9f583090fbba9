"""One model over several GPUs of one process (``ramtorch.offload(model, devices=[...],
micro_batches=n)``) against one GPU (``ramtorch.offload(model, device="cuda:0")``): the Llama-3-8B
shape (W2: hidden 4096, FFN 14336, 32 layers, 32/8 heads, vocab 128256, random bf16 weights) at
the same global batch, inference and training; writes one JSON list (BENCH.md records, with
``"pipeline_gpus"``) and prints a table.

    python3 bench/pipeline.py --out $OUT/pipeline.json [--gpus 1 2] [--micro-batches 2 4 8]
        [--batch 8] [--calls 1 4] [--seq 2048] [--layers 32] [--budget none]
        [--phases forward forward_backward step]
        [--reps 3] [--warmup 1] [--precision fp32-master] [--recompute] [--no-resident] [--commit abc1234]
    python3 bench/pipeline.py --smoke --out /tmp/pipeline.json   # a tiny Llama on host stages

Each configuration builds the model afresh from the same seed (initialised on ``cuda:0``, then
moved to host RAM), offloads it and measures, then frees it: ``pipeline_gpus`` 1 is the model on
``cuda:0`` (``micro_batches`` 1: the batch whole, as a user runs it on one GPU); ``pipeline_gpus``
k > 1 is ``devices=["cuda:0", ..., "cuda:<k-1>"]`` at each ``--micro-batches``. ``--budget`` is
the ``gpu_budget`` of each device (``none``: every unit streams).

Phases (each the median of ``--reps`` calls after ``--warmup``, every GPU synchronised after each):
``forward`` (``eval()``, ``torch.no_grad()``, ``use_cache=False``; for each of ``--calls``: that
many calls of the batch, one after the other on one GPU, through ``ramtorch.relay`` on several,
``seconds`` a call), ``forward_backward`` (``train()``, the model's own loss with
``labels=input_ids``, ``loss.backward()``, ``ramtorch.synchronize()``, gradients set to None
after), ``step`` (the same with ``ramtorch.optim.AdamW(precision=...)``'s ``step()`` and
``zero_grad()``). A step at B=8 of 2048 tokens keeps about 70 GB of activations on one GPU:
``--recompute`` (``offload(recompute=True)``, for both) keeps them within an 80 GB card.
``tokens_per_second`` = batch x sequence / seconds; records of k GPUs carry
``speedup_vs_one_gpu`` (the one-GPU record's seconds over theirs, same phase and calls) and
``loss_vs_one_gpu`` / ``logits_max_abs_diff_vs_one_gpu`` (the first training forward's loss and
the first inference forward's last-position logits against one GPU's: equal up to the rounding
of micro-batched matmuls).

Limits, per forward record, from what this run measures: ``link_seconds`` = the largest over the
stages of (the stage's bytes streamed per pass x passes: one per micro-batch) / that GPU's pinned
H2D bandwidth; ``compute_seconds`` = the resident forward on ``cuda:0`` (``--no-resident``: not
measured) / k x (m + k - 1) / m (the relay's fill and drain: m = calls x n micro-batches over k
stages);
``limit_seconds`` = the larger, ``ratio_to_limit`` = limit / measured. The relay of one call gives at
most k n / (n + k - 1) of one GPU (1.78x for k = 2, n = 8), of ``calls`` calls k m / (m + k - 1):
the figure is reported as ``relay_bound``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
from benchlib import budget_arg, git_commit, jsonable, llama_config, rss
from w2 import build as build_llama

PHASES = ("forward", "forward_backward", "step")
PRECISIONS = ("fp32-master", "bf16", "compact")
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked: every problem is an ``argparse`` error (exit status 2) naming
    the argument."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON list of records to write")
    ap.add_argument("--gpus", nargs="+", type=int, default=[1, 2], help="pipeline sizes to run (1: one GPU)")
    ap.add_argument(
        "--micro-batches", nargs="+", type=int, default=[2, 4, 8], help="for pipelines of 2+ GPUs"
    )
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (the global batch)")
    ap.add_argument(
        "--calls",
        nargs="+",
        type=int,
        default=[1, 4],
        help="forward: calls relayed together (ramtorch.relay)",
    )
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (32: the full 8B shape)")
    ap.add_argument(
        "--budget", type=budget_arg, default=None, help="gpu_budget of each device (none: stream all)"
    )
    ap.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--precision", choices=PRECISIONS, default="fp32-master", help="ramtorch.optim.AdamW's")
    ap.add_argument(
        "--no-resident", action="store_true", help="skip the resident forward (the compute floor)"
    )
    ap.add_argument(
        "--recompute", action="store_true", help="offload(recompute=True): activations recomputed in backward"
    )
    ap.add_argument("--smoke", action="store_true", help="a tiny Llama on host stages (no GPU), one rep")
    ap.add_argument("--commit", default=None)
    a = ap.parse_args(argv)
    if a.batch < 1 or a.seq < 1:
        ap.error(f"--batch and --seq must be at least 1, got {a.batch} and {a.seq}")
    if a.reps < 1 or a.warmup < 0:
        ap.error(f"--reps must be at least 1 and --warmup at least 0, got {a.reps} and {a.warmup}")
    if any(g < 1 for g in a.gpus) or len(set(a.gpus)) != len(a.gpus):
        ap.error(f"--gpus must be distinct pipeline sizes of at least 1, got {a.gpus}")
    if 1 not in a.gpus:
        ap.error(f"--gpus {a.gpus} must include 1: every pipeline record is compared with one GPU's")
    if any(c < 1 for c in a.calls):
        ap.error(f"--calls must be at least 1, got {a.calls}")
    bad = [n for n in a.micro_batches if n < 1 or n > a.batch]
    if bad:
        ap.error(f"--micro-batches {bad}: each must be between 1 and --batch ({a.batch})")
    if a.layers < max(a.gpus):
        ap.error(f"--layers {a.layers} cannot fill {max(a.gpus)} stages")
    if not a.smoke:
        have = torch.cuda.device_count()
        if have < max(a.gpus):
            ap.error(
                f"--gpus {max(a.gpus)} needs {max(a.gpus)} CUDA devices; this machine has {have} "
                "(--smoke runs host stages)"
            )
    return a


def config(a: argparse.Namespace) -> Any:
    """The 8B shape (benchlib's Llama config), or a tiny one with ``--smoke``."""
    if a.smoke:
        return llama_config(64, 128, a.layers, 4, 2, 256, max(8192, a.seq))
    return llama_config(4096, 14336, a.layers, 32, 8, 128256, max(8192, a.seq))


def build(cfg: Any, device: str) -> torch.nn.Module:
    """LlamaForCausalLM, random bf16 weights from seed 0, made on ``device`` (``w2.build``) and
    moved to host RAM."""
    torch.manual_seed(0)
    return build_llama(cfg, device).to("cpu")


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    import ramtorch

    ramtorch.empty_cache()


def sync_all() -> None:
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)


def timed(fn: Any, reps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    sync_all()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync_all()
        out.append(time.perf_counter() - t)
    return out


def h2d_gbps(device: str, n: int = 1 << 30) -> float:
    """Pinned host→``device`` GB/s (best of 3 after a warm-up)."""
    h = torch.empty(n, dtype=torch.uint8).pin_memory()
    d = torch.empty(n, dtype=torch.uint8, device=device)
    d.copy_(h, non_blocking=True)
    torch.cuda.synchronize(device)
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        d.copy_(h, non_blocking=True)
        torch.cuda.synchronize(device)
        ts.append(time.perf_counter() - t)
    del h, d
    torch.cuda.empty_cache()
    return n / min(ts) / 1e9


def resident_forward(cfg: Any, ids: torch.Tensor, a: argparse.Namespace) -> float:
    """The median forward of the model resident on ``cuda:0``: the compute floor."""
    model = build(cfg, "cuda:0").to("cuda:0").eval()
    x = ids.to("cuda:0")
    with torch.no_grad():
        return statistics.median(timed(lambda: model(input_ids=x, use_cache=False), a.reps, a.warmup))


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.smoke:
        a.reps, a.warmup, a.seq, a.layers, a.no_resident = 1, 0, min(a.seq, 16), min(a.layers, 4), True
    import transformers

    cuda = not a.smoke
    cfg = config(a)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=torch.Generator().manual_seed(1))
    base = {
        "workload": "W2" if a.layers == 32 and not a.smoke else "W2-layers" if not a.smoke else "W2-smoke",
        "system": "ramtorch",
        "batch": a.batch,
        "sequence": a.seq,
        "tokens": a.batch * a.seq,
        "layers": a.layers,
        "gpu_budget": a.budget,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "commit": a.commit or git_commit(),
        "command": "python3 bench/pipeline.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "transformers": transformers.__version__,
    }
    if cuda:
        base["h2d_gbps"] = [h2d_gbps(f"cuda:{d}") for d in range(max(a.gpus))]
        log(f"H2D GB/s per GPU: {base['h2d_gbps']}")
    records: list[dict[str, Any]] = []
    resident_fwd = None
    if cuda and not a.no_resident and "forward" in a.phases:
        resident_fwd = resident_forward(cfg, ids, a)
        log(f"resident forward on cuda:0: {resident_fwd * 1e3:.1f} ms")
        free()
    one: dict[str, Any] = {}
    runs = [(1, 1)] + [(k, n) for k in sorted(a.gpus) if k > 1 for n in a.micro_batches]
    for k, n in runs:
        records += measure(a, cfg, ids, k, n, base, one, resident_fwd)
        free()
        with open(a.out, "w") as fh:
            json.dump([jsonable(r) for r in records], fh, indent=1)
    print(_table(records))
    log(f"wrote {len(records)} records to {os.path.abspath(a.out)}")
    return 0


def measure(
    a: argparse.Namespace,
    cfg: Any,
    ids: torch.Tensor,
    k: int,
    n: int,
    base: dict[str, Any],
    one: dict[str, Any],
    resident_fwd: float | None,
) -> list[dict[str, Any]]:
    """The records of one configuration: ``k`` GPUs (1: ``device=``; more: ``devices=``) and ``n``
    micro-batches, each phase asked for. ``one`` keeps one GPU's figures for the comparisons."""
    import ramtorch
    import ramtorch.optim

    cuda = not a.smoke
    if k == 1:
        devices = ["cuda:0" if cuda else "cpu"]
    else:
        devices = [f"cuda:{d}" for d in range(k)] if cuda else ["cpu"] * k
    log(f"{k} GPU(s), micro_batches={n}: building")
    model = build(cfg, "cuda:0" if cuda else "cpu")
    if k == 1:
        ramtorch.offload(model, gpu_budget=a.budget, device=devices[0], recompute=a.recompute)
    else:
        ramtorch.offload(model, gpu_budget=a.budget, devices=devices, micro_batches=n, recompute=a.recompute)
    x = ids.to(devices[0])
    rec_base = {**base, "pipeline_gpus": k, "micro_batches": n, "gpus": k if cuda else 0}
    if a.recompute:
        rec_base["recompute"] = True
    if k > 1:
        rec_base["options"] = f"devices={devices}, micro_batches={n}"
        rec_base["relay_bound"] = k * n / (n + k - 1)
    st = ramtorch.stats(model)
    stages = st["stages"] if k > 1 else [st]
    rec_base["stage_streamed_bytes"] = [s["streamed_bytes_per_pass"] for s in stages]
    records = []
    if "forward" in a.phases:
        model.eval()
        with torch.no_grad():
            first = model(input_ids=x, use_cache=False).logits[:, -1].float().cpu()
        for calls in a.calls:

            def forward(calls: int = calls) -> object:
                if calls == 1:
                    return model(input_ids=x, use_cache=False).logits
                if k == 1:  # one GPU: the calls one after the other
                    return [model(input_ids=x, use_cache=False).logits for _ in range(calls)]
                return ramtorch.relay(model, [{"input_ids": x, "use_cache": False}] * calls)

            with torch.no_grad():
                secs = timed(forward, a.reps, a.warmup)
            rec = _record({**rec_base, "calls": calls}, "forward", [t / calls for t in secs], a)
            if calls > 1 and k > 1:
                rec["options"] += f", ramtorch.relay of {calls} calls"
                rec["relay_bound"] = k * calls * n / (calls * n + k - 1)
            if cuda:
                gbps = base["h2d_gbps"]
                link = max(b * n / (gbps[d] * 1e9) for d, b in enumerate(rec_base["stage_streamed_bytes"]))
                m = calls * n
                compute = None if resident_fwd is None else resident_fwd / k * (m + k - 1) / m
                limit = max(link, compute or 0.0)
                rec.update(link_seconds=link, compute_seconds=compute, limit_seconds=limit)
                rec["ratio_to_limit"] = limit / rec["seconds"]
            if k == 1:
                one["logits"] = first
            else:
                rec["logits_max_abs_diff_vs_one_gpu"] = float((first - one["logits"]).abs().max())
            records.append(_compare(rec, one))
    train = [p for p in ("forward_backward", "step") if p in a.phases]
    if not train:
        return records
    model.train()
    # Made for the step phase only: an optimizer listening to the backward changes its timing.
    opt: Any = None

    def step(update: bool) -> None:
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        if update:
            assert opt is not None
            opt.step()
            opt.zero_grad()
        else:
            ramtorch.synchronize()
            for p in model.parameters():
                p.grad = None

    loss = float(model(input_ids=x, labels=x, use_cache=False).loss)
    if k == 1:
        one["loss"] = loss
    for phase in train:
        if phase == "step":
            opt = ramtorch.optim.AdamW(model.parameters(), lr=1e-5, precision=a.precision)
        secs = timed(lambda phase=phase: step(phase == "step"), a.reps, a.warmup)
        rec = _record(rec_base, phase, secs, a)
        if phase == train[0]:
            rec["loss"] = loss
            if k > 1 and "loss" in one:
                rec["loss_vs_one_gpu"] = loss - one["loss"]
        if phase == "step":
            rec["optimizer"] = f"ramtorch.optim.AdamW({a.precision})"
        records.append(_compare(rec, one))
    return records


def _record(base: dict[str, Any], phase: str, secs: list[float], a: argparse.Namespace) -> dict[str, Any]:
    seconds = statistics.median(secs)
    peak = max((torch.cuda.max_memory_allocated(d) for d in range(torch.cuda.device_count())), default=0)
    return {
        **base,
        "phase": phase,
        "seconds": seconds,
        "seconds_all": secs,
        "tokens_per_second": a.batch * a.seq / seconds,
        "gpu_peak_bytes": peak,
        "host_rss_bytes": rss(),
    }


def _compare(rec: dict[str, Any], one: dict[str, Any]) -> dict[str, Any]:
    """Records one GPU's seconds per phase, and the speedup of a pipeline over them."""
    key = f"seconds:{rec['phase']}:{rec.get('calls', 1)}"
    if rec["pipeline_gpus"] == 1:
        one[key] = rec["seconds"]
    elif key in one:
        rec["speedup_vs_one_gpu"] = one[key] / rec["seconds"]
    print(json.dumps(jsonable(rec)), flush=True)
    return rec


def _table(records: list[dict[str, Any]]) -> str:
    lines = [
        "| phase | GPUs | micro-batches | calls | seconds a call | tokens/s | vs one GPU | limit ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        vs = r.get("speedup_vs_one_gpu")
        ratio = r.get("ratio_to_limit")
        lines.append(
            f"| {r['phase']} | {r['pipeline_gpus']} | {r['micro_batches']} | {r.get('calls', 1)} | "
            f"{r['seconds']:.3f} | "
            f"{r['tokens_per_second']:.0f} | {'' if vs is None else f'{vs:.2f}x'} | "
            f"{'' if ratio is None else f'{ratio:.2f}'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
