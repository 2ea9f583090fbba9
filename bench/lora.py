"""LoRA and QLoRA training steps under ``ramtorch.offload``: a Llama-3-8B-shaped model
(``bench/arch.py``'s ``llama``, fewer layers) with frozen random bf16 base weights, or int8 ones
(torchao ``Int8WeightOnlyConfig`` on the decoder layers' projections), and rank-16 adapters on all
seven projections (q, k, v, o, gate, up, down); writes one JSON list and prints a table.

    python3 bench/lora.py --out $OUT/lora.json [--base bf16 int8] [--layers 4] [--tokens 2048]
        [--rank 16] [--adapters auto|peft|minimal] [--phases step forward_backward] [--reps 3]
        [--stream-adapters] [--trace DIR]
    python3 bench/lora.py --smoke --out /tmp/lora.json      # tiny Llama on the CPU, 1 rep

Adapters: peft's ``get_peft_model(LoraConfig(r, lora_alpha=2r, target_modules=..., lora_dropout=0))``
when peft is importable (``--adapters auto``), else a minimal LoRA wrapper of this file (frozen base
``Linear`` plus ``B(A(x)) · alpha / r``, B zero-initialised as peft does); ``"adapters"`` says which.
The int8 base needs torchao; without it that base is skipped (said on stderr).

Each base runs in its own process: the model is built on the GPU, quantized there, given its
adapters, measured resident (system ``resident``: the compute floor, ``torch.optim.AdamW(fused)``
on the adapters), then moved to host RAM and offloaded with default options (system ``ramtorch``,
``ramtorch.optim.AdamW`` on the adapters, default schedule). Phase ``step``: forward (one
sequence of ``--tokens`` tokens, the model's causal-LM loss) + backward + ``step()`` +
``zero_grad()``, steps back to back after the warm-up (the time is the steady state of one, as in
``bench/benchlib.py: measure``); ``forward_backward`` on request.

By default the adapters stay on the GPU (``offload`` keeps a unit's light trainable parameters
over a frozen base resident); ``--stream-adapters`` streams them with their units, as ramtorch did
before, for an A/B (its records carry ``"options": {"adapters": "streamed"}``).

Limit: the frozen base crosses the link twice a step (forward, and backward for the input
gradients) and only the adapters' gradients come back: link = max(2 × streamed bytes per pass / H2D,
adapter gradient bytes / D2H); compute = the resident model's time for the phase;
``limit_seconds`` = max(link, compute), ``limit_parts``, ``ratio`` = limit / measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import warnings
from typing import Any

import torch
from arch import (
    add_limits,
    build,
    ceilings,
    command_line,
    free_device,
    git_commit,
    inputs,
    streamed_grad_bytes,
    table,
)
from benchlib import measure
from torch import nn

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BASES = ("bf16", "int8")


class LoRALinear(nn.Module):
    """A frozen ``Linear`` plus a trainable low-rank update ``B(A(x)) · alpha / r``, as peft makes it:
    fp32 adapters (the input cast to fp32 for them, the update cast back), B starting at zero."""

    def __init__(self, base: nn.Linear, r: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        self.base.requires_grad_(False)
        dev = base.weight.device
        self.lora_A = nn.Linear(base.in_features, r, bias=False, device=dev, dtype=torch.float32)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, device=dev, dtype=torch.float32)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype))) * self.scaling
        return self.base(x) + update.to(x.dtype)


def peft_version() -> str | None:
    try:
        import peft
    except ImportError:
        return None
    return peft.__version__


def add_adapters(model: nn.Module, r: int, how: str) -> tuple[nn.Module, str]:
    """The model with every parameter frozen and rank-``r`` adapters on the TARGETS projections;
    the name of the implementation."""
    if how in ("auto", "peft") and peft_version() is not None:
        from peft import LoraConfig, get_peft_model

        cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(TARGETS), lora_dropout=0.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # peft on torchao weights: merge() is unsupported
            return get_peft_model(model, cfg), f"peft {peft_version()}"
    if how == "peft":
        raise SystemExit("--adapters peft: peft is not importable")
    model.requires_grad_(False)
    for mod in list(model.modules()):
        for child_name, child in list(mod.named_children()):
            if child_name in TARGETS and isinstance(child, nn.Linear):
                setattr(mod, child_name, LoRALinear(child, r, 2 * r))
    return model, "minimal (bench/lora.py LoRALinear)"


def quantize_int8(model: nn.Module) -> str:
    """torchao int8 weight-only quantization of the decoder layers' Linear weights, in place."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torchao
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(
            model,
            Int8WeightOnlyConfig(),
            filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and ".layers." in fqn,
        )
    return f"torchao {torchao.__version__} Int8WeightOnlyConfig"


def run_base(a: argparse.Namespace, base: str) -> list[dict[str, Any]]:
    """Resident then offloaded measurements of one base; records without limits."""
    import ramtorch
    import ramtorch.optim as ropt

    dev = a.device
    layers = a.layers or (2 if a.smoke else 4)
    t0 = time.perf_counter()
    model = build("llama", layers, a.smoke, dev, torch.bfloat16)
    quant = quantize_int8(model) if base == "int8" else None
    model, impl = add_adapters(model, a.rank, a.adapters)
    build_seconds = time.perf_counter() - t0
    x, fields = inputs("llama", a.tokens, a.smoke, dev)
    trainable = [p for p in model.parameters() if p.requires_grad]
    common = {
        "workload": "arch:llama",
        **fields,
        "layers": layers,
        "lora_rank": a.rank,
        "lora_targets": list(TARGETS),
        "adapters": impl,
        "base": base,
        "base_quantization": quant,
        "compress": "int8" if base == "int8" else None,
        "params": sum(p.numel() for p in model.parameters()),
        "trainable_params": sum(p.numel() for p in trainable),
        "trainable_dtype": str(trainable[0].dtype).removeprefix("torch."),
        "build_seconds": build_seconds,
    }

    def phase_fn(opt: Any, offloaded: bool, phase: str) -> Any:
        def fwd_bwd() -> None:
            acc = getattr(opt, "accumulate", None)  # no update during backward in this phase
            with acc() if acc is not None else contextlib.nullcontext():
                model(**x).loss.backward()
            if offloaded:
                ramtorch.synchronize()
            opt.zero_grad(set_to_none=True)

        def step() -> None:
            model(**x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step if phase == "step" else fwd_bwd

    records: list[dict[str, Any]] = []
    model.train()
    opt: Any = torch.optim.AdamW(trainable, lr=1e-4, fused=dev.startswith("cuda"))
    for phase in a.phases:
        try:
            r = measure(
                phase_fn(opt, False, phase),
                system="resident",
                phase=phase,
                reps=a.reps,
                warmup=a.warmup,
                device=dev,
                weight_bytes=0,
                params=common["params"],
                fields={**common, "optimizer": "torch.optim.AdamW(fused)" if phase == "step" else None},
                consecutive=(lambda: None) if phase == "step" else None,
            )
        except torch.OutOfMemoryError as e:
            r = {**common, "phase": phase, "system": "resident", "seconds": None, "error": str(e)[:200]}
        records.append(r)
        print(f"# {base} {phase} resident: {r['seconds']}", file=sys.stderr, flush=True)
    del opt
    model.to("cpu")
    free_device()
    if a.stream_adapters:  # the A/B of an option: adapters stream with their units, as before
        import ramtorch._stream.units as stream_units

        stream_units.LIGHT_SHARE = 0.0
        common["options"] = {"adapters": "streamed"}
    t1 = time.perf_counter()
    ramtorch.offload(model, device=dev)
    st = ramtorch.stats(model)
    extra = {
        "offload_seconds": time.perf_counter() - t1,
        "streamed_bytes_per_pass": st["streamed_bytes_per_pass"],
        "streamed_grad_bytes": streamed_grad_bytes(model, dev, st["streamed_bytes_per_pass"]),
        "units": st["units"],
    }
    opt = ropt.AdamW(trainable, lr=1e-4)
    precision = "fp32 master" if trainable[0].dtype in (torch.bfloat16, torch.float16) else "fp32"
    for phase in a.phases:
        r = measure(
            phase_fn(opt, True, phase),
            system="ramtorch",
            phase=phase,
            reps=a.reps,
            warmup=a.warmup,
            device=dev,
            weight_bytes=0,
            params=common["params"],
            fields={
                **common,
                **extra,
                "optimizer": f"ramtorch.optim.AdamW({precision})" if phase == "step" else None,
            },
            consecutive=opt.synchronize if phase == "step" else None,
        )
        r.pop("stats", None)
        if phase == "step":  # the default schedule's choice and what its updates did
            auto = getattr(opt, "_auto", None)
            r["update_schedule"] = auto.choice if auto is not None else str(opt._mode)
            r["optimizer_timings"] = dict(opt.timings)
        records.append(r)
        print(f"# {base} {phase} ramtorch: {r['seconds']}", file=sys.stderr, flush=True)
        if a.trace:
            path = os.path.join(a.trace, f"lora-{base}-{phase}.json")
            r["trace"] = traced(phase_fn(opt, True, phase), opt, path)
    for r in records:
        r["weight_bytes"] = extra["streamed_bytes_per_pass"]
        if r.get("optimizer") is None:
            r.pop("optimizer", None)
        if r.get("compress") is None:
            r.pop("compress", None)
    return records


def traced(fn: Any, opt: Any, path: str) -> dict[str, Any]:
    """Two more calls of ``fn`` under ``ramtorch.trace(path)``: the trace's busy time per track
    and the link's largest idle gaps (``bench/profile_arch.py``)."""
    import ramtorch
    from profile_arch import link_gaps
    from w1 import busy_summary

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with ramtorch.trace(path):
        for _ in range(2):
            fn()
        opt.synchronize()
    out = {"busy": busy_summary(path), "link_gaps": link_gaps(path)}
    print(json.dumps(out["link_gaps"], indent=1), file=sys.stderr, flush=True)
    return out


def run_child(a: argparse.Namespace, base: str) -> list[dict[str, Any]]:
    """One base in its own process; its records."""
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), "--child", base, "--tokens", str(a.tokens)]
    cmd += ["--reps", str(a.reps), "--warmup", str(a.warmup), "--rank", str(a.rank), "--adapters", a.adapters]
    cmd += ["--phases", *a.phases, "--device", a.device] + (["--layers", str(a.layers)] if a.layers else [])
    cmd += ["--smoke"] if a.smoke else []
    cmd += ["--trace", a.trace] if a.trace else []
    cmd += ["--stream-adapters"] if a.stream_adapters else []
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        out, err, rc = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        err, rc = f"timed out after {a.timeout:.0f} s", -1
    if rc != 0:
        print(f"# {base} failed ({rc}):\n{err[-3000:]}", file=sys.stderr, flush=True)
    else:
        sys.stderr.write(err)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--base", nargs="+", choices=BASES, default=list(BASES))
    ap.add_argument("--phases", nargs="+", choices=("step", "forward_backward"), default=["step"])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; smoke 2)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", choices=("auto", "peft", "minimal"), default="auto")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--commit", default=None)
    ap.add_argument(
        "--stream-adapters",
        action="store_true",
        help="adapters stream with their units (the default keeps them on the GPU): an A/B",
    )
    ap.add_argument("--trace", default=None, help="a folder: trace two more offloaded calls a phase")
    ap.add_argument("--smoke", action="store_true", help="tiny Llama on the CPU, 1 rep: checks the script")
    ap.add_argument("--device", default=None, help="compute device (default: cuda, or cpu with --smoke)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.smoke:
        a.device = a.device or "cpu"
        a.tokens = a.tokens if "--tokens" in sys.argv else 64
        a.reps = a.reps if "--reps" in sys.argv else 1
        a.warmup = a.warmup if "--warmup" in sys.argv else 1
    a.device = a.device or "cuda"
    if a.child is not None:
        torch.manual_seed(0)
        for r in run_base(a, a.child):
            print(json.dumps(r), flush=True)
        return
    if a.out is None:
        ap.error("--out is required")
    bases = list(a.base)
    if "int8" in bases:
        try:
            import torchao  # noqa: F401
        except ImportError:
            print("# int8 base skipped: torchao is not importable", file=sys.stderr)
            bases.remove("int8")
    bw = ceilings(a.device)
    meta = {
        **bw,
        "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device,
        "gpus": 1 if a.device.startswith("cuda") else 0,
        "commit": a.commit or git_commit(),
        "command": command_line(),
    }
    records: list[dict[str, Any]] = []
    for base in bases:
        got = run_child(a, base)
        add_limits(got, bw)
        records += [{**r, **meta} for r in got]
        with open(a.out, "w") as fh:
            json.dump(records, fh, indent=1)
    print(table(records))
    if len({r["base"] for r in records}) < len(bases):
        sys.exit(1)


if __name__ == "__main__":
    main()
