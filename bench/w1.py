"""W1 (MLP stack, bf16) for one system in this process; prints one JSON record per line.

The model is ``layers`` blocks of ``Linear(d, f) → GELU → Linear(f, d)`` (no bias) held in an
``nn.ModuleList``. Systems:

- ``resident``: plain ``nn.Linear`` with every weight on the GPU (the compute floor);
- ``ramtorch``: the plain model moved to host RAM, then ``ramtorch.offload(model, gpu_budget=...)``
  (``--budget``: bytes, a string such as ``8GiB``, or ``none`` to stream everything);
- ``ramtorch-linear``: this package's per-layer ``ramtorch.nn.Linear``;
- ``ramtorch-1.11``: the original RamTorch 1.11 ``OffloadModel``, one chunk per block, ``window=2``
  (run with that package first on ``PYTHONPATH``);
- ``ramtorch-1.11-linear``: the original RamTorch's per-layer ``ramtorch.Linear`` (same);
- ``accelerate``: ``accelerate.cpu_offload(model, execution_device="cuda")``, forward only.

Weights are filled on the compute device and copied to the host where a system needs them there
(initialising 3.8e9 parameters on the host would take minutes).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import torch
from benchlib import (
    budget_arg,
    measure,
    parse_bytes,
)
from torch import nn

SYSTEMS = ("resident", "ramtorch", "ramtorch-linear", "ramtorch-1.11", "ramtorch-1.11-linear", "accelerate")
INFERENCE_ONLY = ("accelerate",)


class Stack(nn.Module):
    """The W1 model: blocks applied in order."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def linear(system: str, i: int, o: int, device: str) -> nn.Module:
    dt = torch.bfloat16
    if system == "ramtorch-linear":
        import ramtorch.nn as rnn

        lin = rnn.Linear(i, o, bias=False, device=device, dtype=dt)
    elif system == "ramtorch-1.11-linear":
        import ramtorch as rt

        lin = rt.Linear(i, o, bias=False, device=device, dtype=dt, skip_init=True)
    else:  # a plain layer, allocated on the compute device without running its initialiser
        lin = torch.nn.utils.skip_init(nn.Linear, i, o, bias=False, device=device, dtype=dt)
    with torch.no_grad():  # fill on the device, copy into wherever the layer keeps weights
        lin.weight.copy_(torch.randn(o, i, device=device, dtype=dt).mul_(i**-0.5))
    return lin


def build(system: str, d: int, f: int, layers: int, device: str) -> Stack:
    blocks = []
    for _ in range(layers):
        blocks.append(nn.Sequential(linear(system, d, f, device), nn.GELU(), linear(system, f, d, device)))
    return Stack(blocks)


def loss_of(out: torch.Tensor, _target: object = None) -> torch.Tensor:
    """W1's loss: mean of squared outputs, in fp32."""
    return out.float().pow(2).mean()


def to_host(model: nn.Module) -> None:
    """Moves the model to host RAM tensor by tensor (GPU memory is freed as it goes)."""
    model.to("cpu")
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def wrap(system: str, model: Stack, device: str, budget: int | str | None) -> tuple[nn.Module, dict]:
    """Applies the system's offloading to the built model; returns the model to call and extra fields."""
    extra: dict = {}
    if system == "ramtorch":
        import ramtorch

        to_host(model)
        model = ramtorch.offload(model, gpu_budget=budget, device=device)
        extra["gpu_budget"] = budget
        extra["gpu_budget_bytes"] = parse_bytes(budget)
    elif system == "ramtorch-1.11":
        from ramtorch import OffloadModel

        blocks = list(model.blocks)
        model = OffloadModel(blocks, device=device, window=2)
        extra.update(chunks=len(blocks), window=2)
    elif system == "accelerate":
        import accelerate

        to_host(model)
        model = accelerate.cpu_offload(model, execution_device=torch.device(device))
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return model, extra


def make_optimizer(system: str, kind: str, params: list[torch.Tensor]) -> tuple[object, str, int]:
    """The optimizer of phase ``step`` and the host bytes one step of it moves (AdamW: read
    weight, gradient and both moments, write weight and moments; plus the fp32 master)."""
    n = sum(p.numel() for p in params)
    host = [p for p in params if p.device.type == "cpu"]
    nh = sum(p.numel() for p in host)
    if system == "ramtorch" and kind.startswith("rust"):
        import ramtorch.optim as ropt

        if kind == "rust-bf16":
            return ropt.AdamW(params, lr=1e-5, precision="bf16"), "ramtorch.optim.AdamW(bf16)", 14 * nh
        return ropt.AdamW(params, lr=1e-5), "ramtorch.optim.AdamW(fp32 master)", 28 * nh
    if system == "resident":
        return torch.optim.AdamW(params, lr=1e-5, fused=True), "torch.optim.AdamW(fused, GPU)", 0
    # ramtorch-1.11 (its CPU parameters) and ramtorch with torch's optimizer: fused CPU AdamW on
    # the bf16 host weights (bf16 states).
    del n
    return torch.optim.AdamW(params, lr=1e-5, fused=True), "torch.optim.AdamW(fused, CPU)", 14 * nh


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", required=True, choices=SYSTEMS)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--d", type=int, default=8192)
    ap.add_argument("--f", type=int, default=28672)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--phases", nargs="+", default=["forward", "forward_backward"])
    ap.add_argument("--budget", default=None, help="ramtorch gpu_budget: bytes, e.g. 8GiB, or none")
    ap.add_argument(
        "--optimizer",
        default="rust",
        choices=["rust", "rust-bf16", "torch-fused"],
        help="phase 'step' of ramtorch: ramtorch.optim.AdamW (fp32 master, bf16 states) or torch's fused",
    )
    # Hidden: run on the CPU with a tiny model, to check the harness without a GPU.
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.tiny:
        a.d, a.f, a.layers = 64, 160, 3
    dev = a.device
    budget = budget_arg(a.budget)
    phases = [p for p in a.phases if not (a.system in INFERENCE_ONLY and p != "forward")]
    if len(phases) < len(a.phases):
        print(f"{a.system}: inference only, skipping {sorted(set(a.phases) - set(phases))}", file=sys.stderr)

    t0 = time.perf_counter()
    model = build(a.system, a.d, a.f, a.layers, dev)
    wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    nparams = sum(p.numel() for p in model.parameters())
    model, extra = wrap(a.system, model, dev, budget)
    extra["setup_seconds"] = time.perf_counter() - t0  # build, copy to host, wrap
    params = list(model.parameters())
    opt, opt_name, opt_bytes = (
        make_optimizer(a.system, a.optimizer, params) if "step" in phases else (None, "", 0)
    )
    if opt is not None:
        extra.update(optimizer=opt_name, optimizer_host_bytes=opt_bytes)

    for t in a.tokens:
        x = torch.randn(t, a.d, device=dev, dtype=torch.bfloat16)
        for phase in phases:

            def fwd(x: torch.Tensor = x) -> None:
                with torch.no_grad():
                    model(x)

            def fwd_bwd(x: torch.Tensor = x) -> None:
                if a.system == "ramtorch-1.11":
                    model.step(x, loss_fn=loss_of)
                    model.flush_grads()  # accumulated gradients to .grad (host, for streamed chunks)
                    return
                loss_of(model(x)).backward()
                if a.system == "ramtorch":
                    import ramtorch

                    if hasattr(ramtorch, "synchronize"):
                        ramtorch.synchronize()  # every .grad written
                for p in params:
                    p.grad = None

            def step(x: torch.Tensor = x) -> None:
                assert opt is not None
                if a.system == "ramtorch-1.11":
                    model.step(x, loss_fn=loss_of)
                    model.flush_grads()
                else:
                    loss_of(model(x)).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            fn = {"forward": fwd, "forward_backward": fwd_bwd, "step": step}[phase]
            rec = measure(
                fn,
                system=a.system,
                phase=phase,
                reps=a.reps,
                warmup=a.warmup,
                device=dev,
                weight_bytes=wbytes,
                params=nparams,
                fields={"workload": "W1", "tokens": t, **extra},
            )
            if a.system == "ramtorch-linear":
                import ramtorch

                rec["engine"] = ramtorch.stats()["devices"].get("cuda:0")
            elif a.system == "ramtorch-1.11":
                rec["offload_stats"] = dict(model.stats)
            if dev != "cuda":
                rec["device_kind"] = dev
            print(json.dumps(rec), flush=True)
    if a.system == "ramtorch-1.11":
        model.close()


if __name__ == "__main__":
    main()
