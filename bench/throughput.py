"""Model FLOP/s of a full fine-tune: a Llama-3-8B-shaped decoder (random weights) under
``ramtorch.offload`` with ``ramtorch.optim.AdamW`` in its defaults, micro-batches accumulated into
one optimizer step, against the same layers resident on the GPU at the same micro-batch.

    python bench/throughput.py --batch 3 --seq 4096 --accum 3 --precision compact

Model FLOPs are ``6 · parameters · tokens`` (``BENCH.md``). The resident figure is the compute
floor of the same micro-batch: a resident forward+backward of the model at two depths (the
8e9-parameter model's activations for a 12k-token micro-batch do not fit next to its weights and
gradients), extrapolated to the full depth by its per-layer time, which is exact for a stack of
identical layers up to timing noise. It leaves out the optimizer update, which favours the
resident side. One JSON list of records on stdout (and in ``--out``)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shlex
import sys
import time
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import budget_arg, git_commit, host_cpus, llama_config, peak_rss, rss  # noqa: E402

OPTIMIZER_NAMES = {
    "fp32-master": "fp32 master",
    "bf16": "bf16",
    "compact": "8-bit moments, bf16+compensation",
}


SCHEDULES = {
    "default": "default schedule",
    "backward": "committed in backward",
    "off": "in step",
    "pipeline": "pipelined",
}


def config(a: argparse.Namespace, layers: int) -> Any:
    return llama_config(a.hidden, a.inter, layers, a.heads, a.kv_heads, a.vocab, max(8192, a.seq))


def build(a: argparse.Namespace, layers: int) -> nn.Module:
    """The model with random weights, filled on ``a.device`` (fast on a GPU)."""
    import transformers

    with torch.device(a.device):
        model = transformers.AutoModelForCausalLM.from_config(config(a, layers), dtype=torch.bfloat16)
    model.train()
    return model


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def micro_batches(a: argparse.Namespace) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(a.device) for _ in range(a.accum)]


def forward_backward(model: nn.Module, ids: torch.Tensor, scale: float) -> None:
    out = model(input_ids=ids, labels=ids)
    (out.loss * scale).backward()


def resident_seconds(a: argparse.Namespace, layers: int, ids: torch.Tensor) -> float:
    """Mean time of one micro-batch's forward+backward with the whole model on the device."""
    model = build(a, layers)

    def once() -> None:
        model.zero_grad(set_to_none=True)
        forward_backward(model, ids, 1.0)

    for _ in range(a.warmup_resident):
        once()
    sync(a.device)
    times = []
    for _ in range(a.reps_resident):
        s = time.perf_counter()
        once()
        sync(a.device)
        times.append(time.perf_counter() - s)
    return sum(times) / len(times)  # the model is freed on return


def count_params(a: argparse.Namespace, layers: int) -> int:
    with torch.device("meta"):
        import transformers

        model = transformers.AutoModelForCausalLM.from_config(config(a, layers))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batch", type=int, default=3, help="sequences a micro-batch")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--accum", type=int, nargs="+", default=[3], help="micro-batches a step, each a run")
    ap.add_argument("--precision", choices=sorted(OPTIMIZER_NAMES), default="compact")
    ap.add_argument(
        "--overlap",
        choices=["default", "backward", "off", "pipeline"],
        default="default",
        help="ramtorch.optim.AdamW's overlap: default (True), 'backward', off (False), or pipeline "
        "(pipeline=True: step() returns while updates run on; its steps are timed back to back, the "
        "last one settled)",
    )
    ap.add_argument("--gpu-budget", default=None, help="ramtorch.offload's gpu_budget (default: none)")
    ap.add_argument(
        "--gpu-updates",
        choices=["off", "on"],
        nargs="+",
        default=["off"],
        help="ramtorch.optim.AdamW's gpu_updates, each a run with an optimizer of its own (default: off)",
    )
    ap.add_argument("--warmup", type=int, default=6, help="steps before timing (the schedule chooses in 5)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument(
        "--resident-layers",
        type=int,
        nargs=2,
        default=[2, 8],
        help="depths of the two resident runs extrapolated to --layers (0 0: no resident run)",
    )
    ap.add_argument("--warmup-resident", type=int, default=2)
    ap.add_argument("--reps-resident", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--trace",
        default=None,
        help="a Chrome trace (ramtorch.trace) of the last timed step to this path",
    )
    a = ap.parse_args()

    import ramtorch
    import ramtorch.optim as ropt
    from ramtorch import _core

    commit = a.commit or git_commit()
    command = "python3 bench/throughput.py " + shlex.join(sys.argv[1:])
    device_name = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    micro = a.batch * a.seq
    params = count_params(a, a.layers)
    records: list[dict[str, Any]] = []
    common = {
        "workload": "W2",
        "model": "Llama-3-8B shape" if (a.hidden, a.layers) == (4096, 32) else "llama",
        "params": params,
        "layers": a.layers,
        "micro_batch_tokens": micro,
        "batch": a.batch,
        "seq": a.seq,
        "device": device_name,
        "cpu_kernels": _core.optim_isa(),
        "host_cpus": host_cpus(),
        "commit": commit,
        "command": command,
        "gpus": 1,
    }

    def emit(rec: dict[str, Any]) -> None:
        records.append(rec)
        print(json.dumps(rec), flush=True)

    # The compute floor: the same layers resident, at the same micro-batch.
    res_flops = None
    ids_r = micro_batches(a_one(a))[0]
    lo, hi = a.resident_layers
    if hi > lo > 0:
        t_lo = resident_seconds(a, lo, ids_r)
        free(a.device)
        t_hi = resident_seconds(a, hi, ids_r)
        per_layer = (t_hi - t_lo) / (hi - lo)
        t_full = t_lo + per_layer * (a.layers - lo)
        res_flops = 6 * params * micro / t_full / 1e12
        emit(
            {
                **common,
                "phase": "forward_backward",
                "system": "resident",
                "tokens": micro,
                "seconds": t_full,
                "resident_measured": {str(lo): t_lo, str(hi): t_hi},
                "how": f"extrapolated from resident models of {lo} and {hi} layers",
                "model_tflops": res_flops,
            }
        )
        print(f"resident: {t_full * 1e3:.1f} ms a micro-batch, {res_flops:.0f} TFLOP/s", file=sys.stderr)
    del ids_r
    free(a.device)

    t0 = time.perf_counter()
    model = build(a, a.layers)
    ramtorch.offload(model, device=a.device, gpu_budget=budget_arg(a.gpu_budget))
    free(a.device)
    overlap: bool | str = {"default": True, "backward": "backward", "off": False, "pipeline": True}[a.overlap]
    setup = time.perf_counter() - t0
    print(f"offloaded in {setup:.1f} s", file=sys.stderr)
    for gpu_updates in a.gpu_updates:
        opt = ropt.AdamW(
            model.parameters(),
            lr=1e-5,
            precision=a.precision,
            overlap=overlap,
            pipeline=a.overlap == "pipeline",
            gpu_updates=gpu_updates == "on",
        )
        run_steps(a, model, opt, common, params, micro, res_flops, setup, gpu_updates, emit)
        del opt
        gc.collect()
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(records, fh, indent=1)


def run_steps(
    a: argparse.Namespace,
    model: torch.nn.Module,
    opt: Any,
    common: dict[str, Any],
    params: int,
    micro: int,
    res_flops: float | None,
    setup: float,
    gpu_updates: str,
    emit: Any,
) -> None:
    """The timed steps of one optimizer, for each ``--accum``."""
    import ramtorch

    for n, accum in enumerate(a.accum):
        batches = micro_batches(argparse.Namespace(**{**vars(a), "accum": accum}))

        def step(
            batches: list[torch.Tensor] = batches,
            marks: list[float] | None = None,
            sums: list[int] | None = None,
        ) -> None:
            start = time.perf_counter()
            for ids in batches:
                forward_backward(model, ids, 1.0 / len(batches))
                if marks is not None:
                    marks.append(time.perf_counter() - start)  # backward() has returned
            if sums is not None:
                sums.append(sum(s["grad_sum_bytes"] for s in ramtorch.stats()["devices"].values()))
            opt.step()
            if marks is not None:
                marks.append(time.perf_counter() - start)
            opt.zero_grad(set_to_none=True)

        def settle() -> None:
            opt.synchronize()
            sync(a.device)

        warm = []
        for _ in range(a.warmup if n == 0 else min(a.warmup, 2)):  # the schedule is chosen once
            s = time.perf_counter()
            step()
            warm.append(time.perf_counter() - s)  # not settled: the next step waits for it
        settle()
        if a.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        # A pipelined step's updates run on into the next step: its steps are timed back to back
        # (each from its start to the next one's), and the last one waits for its updates.
        back_to_back = a.overlap == "pipeline"
        times = []
        marks: list[list[float]] = []
        sums: list[int] = []  # gradient sums held on the device at the end of each timed step's backwards
        for rep in range(a.reps):
            marks.append([])
            path = None
            if a.trace is not None and rep == a.reps - 1:
                path = a.trace if gpu_updates == "off" else a.trace.replace(".json", "") + "-gpu-updates.json"
            with ramtorch.trace(path) if path else contextlib.nullcontext():
                s = time.perf_counter()
                step(marks=marks[-1], sums=sums)
                if not back_to_back or rep == a.reps - 1:
                    settle()
                times.append(time.perf_counter() - s)
        seconds = sum(times) / len(times)
        tokens = micro * accum
        flops = 6 * params * tokens / seconds / 1e12
        host = rss()
        rec = {
            **common,
            "phase": "step",
            "system": "ramtorch",
            "tokens": tokens,
            "micro_batches": accum,
            "optimizer": f"ramtorch.optim.AdamW({OPTIMIZER_NAMES[a.precision]}, {SCHEDULES[a.overlap]})",
            "schedule_chosen": getattr(getattr(opt, "_auto", None), "choice", None),
            "seconds": seconds,
            "seconds_all": times,
            "warmup_seconds_all": warm,
            "model_tflops": flops,
            "of_resident": None if res_flops is None else flops / res_flops,
            "setup_seconds": setup,
            "host_rss_bytes": host,
            "host_bytes_per_param": host / params,
            "host_peak_rss_bytes": peak_rss(),
            "gpu_peak_bytes": torch.cuda.max_memory_allocated() if a.device.startswith("cuda") else 0,
            "optimizer_timings": dict(getattr(opt, "timings", {})),
            # Seconds into each timed step at which each micro-batch's backward() returned, then
            # step() (the host's view: the device may still be running).
            "host_marks": marks,
            # Bytes of gradients summed on the device (the rest are added on the host).
            "grad_sum_bytes": sums,
            # Where the host's bytes are, after the step's zero_grad: the arena (parameters,
            # states, gradients, spare buffers; pooled = freed and kept for reuse) and the
            # default schedule's spare buffers (made, and parameters refused one for lack of memory).
            "host_arena": {k: v for k, v in ramtorch.stats()["host"].items() if k.endswith("_bytes")},
            "spare_buffer_bytes": getattr(getattr(opt, "_shadows", None), "nbytes", 0),
            "spare_buffers_refused": len(getattr(getattr(opt, "_shadows", None), "_refused", ())),
        }
        if a.gpu_budget is not None:
            rec["gpu_budget"] = a.gpu_budget
        options: dict[str, Any] = {}
        if a.overlap != "default":
            options["overlap"] = a.overlap
        if gpu_updates == "on":
            options["gpu_updates"] = True
        if options:
            rec["options"] = options
        emit(rec)
        ratio = "" if res_flops is None else f", {flops / res_flops:.2f} of resident"
        print(
            f"{tokens} tokens a step, gpu_updates {gpu_updates}: {seconds:.2f} s, {flops:.0f} TFLOP/s{ratio}",
            file=sys.stderr,
        )
        del batches


def a_one(a: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(a), "accum": 1})


if __name__ == "__main__":
    main()
