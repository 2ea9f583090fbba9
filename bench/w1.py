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
- ``accelerate``: ``accelerate.cpu_offload(model, execution_device="cuda")``, forward only;
- ``fsdp2``: PyTorch FSDP2 in this one process at world size 1 (a process group is started if none
  is: NCCL on CUDA, gloo on the CPU): ``fully_shard(block, offload_policy=CPUOffloadPolicy(),
  mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))`` on every block, then on
  the root. The usual FSDP2 CPU-offload training recipe: each block is cast to fp32 before it is
  sharded, so the sharded parameters in (pinned) host RAM are fp32 masters, as in ramtorch's
  fp32-master mode, and compute runs in bf16. Host RAM holds 4 B/param of weights (16 with the
  fp32 gradients and AdamW moments of phase ``step``); every all-gather copies the fp32 shard to
  the GPU before casting it, and the gradients come back in fp32. Phase ``step`` uses
  ``torch.optim.AdamW(fused=True)`` on the host DTensor parameters (``foreach`` if a fused probe
  step fails; the record's ``optimizer`` says which).

Weights are filled on the compute device and copied to the host where a system needs them there
(initialising 3.8e9 parameters on the host would take minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from benchlib import (
    budget_arg,
    env_options,
    links_arg,
    measure,
    parse_bytes,
)
from torch import nn

SYSTEMS = (
    "resident",
    "ramtorch",
    "ramtorch-linear",
    "ramtorch-1.11",
    "ramtorch-1.11-linear",
    "accelerate",
    "fsdp2",
)
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


def init_world_size_1(device: str) -> str | None:
    """Starts a process group of world size 1 in this process when none is running (NCCL on CUDA,
    gloo on the CPU); returns its backend, or None when one was already running."""
    import torch.distributed as dist

    if dist.is_initialized():
        return None
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)
    return backend


def fsdp2(model: Stack, device: str) -> dict:
    """Applies FSDP2 with CPU offload to every block and then to the root, in place; returns the
    record's extra fields. Blocks are cast to fp32 one at a time on the compute device before
    ``fully_shard`` (which moves the fp32 shard to host RAM), so the GPU never holds an fp32 copy
    of the whole model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    backend = init_world_size_1(device)
    mesh = init_device_mesh(torch.device(device).type, (1,))
    # Pinning needs a CUDA driver; a CPU smoke run shards into pageable memory.
    pin = device.startswith("cuda")
    offload = CPUOffloadPolicy(pin_memory=pin)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        block.float()
        fully_shard(block, mesh=mesh, offload_policy=offload, mp_policy=mp)
    fully_shard(model, mesh=mesh, offload_policy=offload, mp_policy=mp)
    n = sum(p.numel() for p in model.parameters())
    return {
        "process_group": backend or "existing",
        "master_dtype": "float32",
        "param_dtype": "bfloat16",
        "reduce_dtype": "float32",
        "pin_memory": pin,
        "host_param_bytes": 4 * n,  # the fp32 sharded parameters (gradients: 4 more, AdamW: 8)
        # Copies of the recipe, computed (not measured): each all-gather copies the fp32 shard to
        # the GPU; blocks reshard after forward, so backward gathers them again; fp32 gradients.
        "h2d_bytes_forward": 4 * n,
        "h2d_bytes_forward_backward": 8 * n,
        "d2h_bytes_backward": 4 * n,
    }


def wrap(
    system: str,
    model: Stack,
    device: str,
    budget: int | str | None,
    compress: str | None = None,
    links: str | list[str] | None = None,
) -> tuple[nn.Module, dict]:
    """Applies the system's offloading to the built model; returns the model to call and extra fields."""
    extra: dict = {}
    if system == "ramtorch":
        import ramtorch

        to_host(model)
        if compress is not None:
            model.requires_grad_(False)  # compressed units are frozen ones
        model = ramtorch.offload(model, gpu_budget=budget, device=device, compress=compress, links=links)
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
    elif system == "fsdp2":
        extra.update(fsdp2(model, device))
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return model, extra


def fused_adamw_works(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW steps these (FSDP2: host DTensor) parameters: one step of a
    throwaway optimizer with ``lr=0`` and no weight decay on the smallest of them, which leaves the
    weight unchanged."""
    p = min(params, key=lambda t: t.numel())
    try:
        p.grad = torch.zeros_like(p)
        torch.optim.AdamW([p], lr=0.0, weight_decay=0.0, fused=True).step()
        return True
    except (RuntimeError, NotImplementedError, TypeError) as e:
        print(f"fused AdamW unsupported here ({e!r:.200}); using foreach", file=sys.stderr)
        return False
    finally:
        p.grad = None


def make_optimizer(
    system: str, kind: str, params: list[torch.Tensor], gpu_updates: bool = False
) -> tuple[object, str, int]:
    """The optimizer of phase ``step`` and the host bytes one step of it moves (AdamW: read
    weight, gradient and both moments, write weight and moments; plus the fp32 master).
    ``gpu_updates``: ramtorch's AdamW with ``gpu_updates=True``."""
    n = sum(p.numel() for p in params)
    host = [p for p in params if p.device.type == "cpu"]
    nh = sum(p.numel() for p in host)
    if system == "ramtorch" and kind.startswith("rust"):
        import ramtorch.optim as ropt

        pipe = kind.endswith("-pipeline")
        # -backward: updates committed during backward (overlap="backward"), the earlier default.
        overlap: bool | str = "backward" if kind.endswith("-backward") else True
        tail = ", pipelined" if pipe else ", committed in backward" if overlap == "backward" else ""
        if kind.startswith("rust-bf16"):
            opt = ropt.AdamW(
                params, lr=1e-5, precision="bf16", pipeline=pipe, overlap=overlap, gpu_updates=gpu_updates
            )
            return opt, f"ramtorch.optim.AdamW(bf16{tail})", 14 * nh
        if kind.startswith("rust-compact"):
            # Read: weight 2 + compensation 2 + moments 1 + 1 + gradient 2 + scales 8/256;
            # written: weight, compensation, moments and scales again (14.06 bytes a parameter).
            opt = ropt.AdamW(
                params, lr=1e-5, precision="compact", pipeline=pipe, overlap=overlap, gpu_updates=gpu_updates
            )
            mode = tail or ", speculative"
            name = f"ramtorch.optim.AdamW(8-bit moments, bf16+compensation{mode})"
            return opt, name, round((14 + 16 / 256) * nh)
        opt = ropt.AdamW(params, lr=1e-5, pipeline=pipe, overlap=overlap, gpu_updates=gpu_updates)
        return opt, f"ramtorch.optim.AdamW(fp32 master{tail})", 28 * nh
    if system == "resident":
        return torch.optim.AdamW(params, lr=1e-5, fused=True), "torch.optim.AdamW(fused, GPU)", 0
    if system == "fsdp2":  # fp32 sharded parameters, gradients and moments, all on the host
        impl = "fused" if fused_adamw_works(params) else "foreach"
        opt = torch.optim.AdamW(params, lr=1e-5, **{impl: True})
        return opt, f"torch.optim.AdamW({impl}, CPU, fp32 FSDP2 shards)", 28 * nh
    # ramtorch-1.11 (its CPU parameters) and ramtorch with torch's optimizer: fused CPU AdamW on
    # the bf16 host weights (bf16 states).
    del n
    return torch.optim.AdamW(params, lr=1e-5, fused=True), "torch.optim.AdamW(fused, CPU)", 14 * nh


def busy_summary(path: str) -> dict:
    """Per track of a Chrome trace, and per kind of span in it ("track: kind"): spans, summed
    duration and busy time (the union of its spans), in ms, over the window from the first span's
    start to the last one's end."""
    events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]
    names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in json.loads(Path(path).read_text())["traceEvents"]
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    if not events:
        return {}
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)
    tracks: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        track = names.get((e["pid"], e["tid"]), str(e["tid"]))
        # Kinds of span within a track, without the unit's name: "update", "wait for gradients".
        kind = e["name"].split(" of ")[0] if " of " in e["name"] else e["name"].split(" ")[0]
        for key in (track, f"{track}: {kind}"):
            tracks.setdefault(key, []).append((e["ts"], e["ts"] + e["dur"]))
    out: dict = {"window_ms": (t1 - t0) / 1e3, "tracks": {}}
    for name, spans in tracks.items():
        spans.sort()
        busy, end = 0.0, -float("inf")
        for s, e in spans:
            if e > end:
                busy += e - max(s, end)
                end = e
        out["tracks"][name] = {
            "spans": len(spans),
            "sum_ms": round(sum(e - s for s, e in spans) / 1e3, 3),
            "busy_ms": round(busy / 1e3, 3),
        }
    return out


def traced_steps(fn: Callable[[], None], opt: object, path: str, device: str) -> dict:
    """Two training steps under ``ramtorch.trace(path)`` (after the timed ones: steady state),
    ended by waiting for their updates; the trace's per-track busy times."""
    import ramtorch

    with ramtorch.trace(path):
        for _ in range(2):
            fn()
        getattr(opt, "synchronize", lambda: None)()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    summary = busy_summary(path)
    print(f"trace {path}: {json.dumps(summary)}", file=sys.stderr, flush=True)
    return summary


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
    ap.add_argument("--compress", default=None, help="offload(compress=...): lossless, fp8 (frozen model)")
    ap.add_argument("--links", type=links_arg, default=None, help="offload(links=...): auto or cuda:1,...")
    ap.add_argument(
        "--optimizer",
        default="rust",
        choices=[
            "rust",
            "rust-backward",
            "rust-pipeline",
            "rust-bf16",
            "rust-bf16-backward",
            "rust-bf16-pipeline",
            "rust-compact",
            "rust-compact-backward",
            "rust-compact-pipeline",
            "torch-fused",
        ],
        help="phase 'step' of ramtorch: ramtorch.optim.AdamW (fp32 master, bf16 states; -backward: "
        "overlap='backward'; -pipeline: pipeline=True) or torch's fused",
    )
    ap.add_argument(
        "--gpu-updates",
        action="store_true",
        help="phase 'step' of ramtorch: ramtorch.optim.AdamW(gpu_updates=True), the GPU making a share of "
        "the updates",
    )
    ap.add_argument(
        "--trace",
        default=None,
        help="ramtorch, phase step: after the timed steps, run two more under ramtorch.trace(TRACE) "
        "and add each track's busy time to the record (trace_summary); {tokens} in TRACE is replaced",
    )
    ap.add_argument(
        "--weights-unchanged",
        action="store_true",
        help="ramtorch (offload), phase forward: time the passes inside ramtorch.weights_unchanged(model), "
        "so each pass starts on the copies the previous one prefetched",
    )
    ap.add_argument(
        "--compile",
        default=None,
        choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"],
        help="call the (wrapped) model through torch.compile with this mode; the warm-up passes compile",
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
    model, extra = wrap(a.system, model, dev, budget, a.compress, a.links)
    extra["setup_seconds"] = time.perf_counter() - t0  # build, copy to host, wrap
    if env_options() and a.system == "ramtorch":
        extra["options"] = {**extra.get("options", {}), **env_options()}
    params = list(model.parameters())
    opt, opt_name, opt_bytes = (
        make_optimizer(a.system, a.optimizer, params, a.gpu_updates) if "step" in phases else (None, "", 0)
    )
    if opt is not None:
        extra.update(optimizer=opt_name, optimizer_host_bytes=opt_bytes)
        if a.gpu_updates:
            extra["options"] = {**extra.get("options", {}), "gpu_updates": True}

    call: Callable[[torch.Tensor], torch.Tensor] = model
    if a.compile:
        compiled = torch.compile(model, mode=None if a.compile == "default" else a.compile)
        graphs = a.compile == "reduce-overhead"

        def call(x: torch.Tensor) -> torch.Tensor:
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            return compiled(x)

        extra["compile"] = a.compile
    if a.weights_unchanged:
        if a.system != "ramtorch":
            ap.error("--weights-unchanged applies to --system ramtorch (offload) only")
        import ramtorch

        extra["weights_unchanged"] = True
        unchanged = functools.partial(ramtorch.weights_unchanged, model)
    else:
        unchanged = contextlib.nullcontext

    for i, t in enumerate(a.tokens):
        if i and opt is not None:
            # Each length gets an optimizer of its own, as a run at that length would: ramtorch's
            # default schedule chooses once per optimizer between speculating during backward and
            # updating in step(), and a choice made at another length would carry over.
            getattr(opt, "synchronize", lambda: None)()
            del opt
            gc.collect()
            opt, _, _ = make_optimizer(a.system, a.optimizer, params, a.gpu_updates)
        x = torch.randn(t, a.d, device=dev, dtype=torch.bfloat16)
        for phase in phases:

            def fwd(x: torch.Tensor = x) -> None:
                with torch.no_grad(), unchanged():
                    call(x)

            def fwd_bwd(x: torch.Tensor = x, accumulate: bool = False, opt: Any = opt) -> None:
                if a.system == "ramtorch-1.11":
                    model.step(x, loss_fn=loss_of)
                    model.flush_grads()  # accumulated gradients to .grad (host, for streamed chunks)
                    return
                # With ramtorch's optimizer built for phase step, backward would update weights as
                # their gradients land: accumulate() keeps this phase forward+backward alone.
                acc = getattr(opt, "accumulate", None)
                with acc() if acc is not None else contextlib.nullcontext():
                    loss_of(call(x)).backward()
                if a.system == "ramtorch":
                    import ramtorch

                    if hasattr(ramtorch, "synchronize"):
                        ramtorch.synchronize()  # every .grad written
                if accumulate:
                    return  # the next call's backward adds to these gradients (micro-batches)
                for p in params:
                    p.grad = None

            def step(x: torch.Tensor = x, opt: Any = opt) -> None:
                assert opt is not None
                if a.system == "ramtorch-1.11":
                    model.step(x, loss_fn=loss_of)
                    model.flush_grads()
                else:
                    loss_of(call(x)).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            fn = {
                "forward": fwd,
                "forward_backward": fwd_bwd,
                # Every timed backward adds to the gradients the one before left (the warm-up
                # calls' included): the loop of micro-batches, without its zero_grad.
                "forward_backward_accumulate": functools.partial(fwd_bwd, accumulate=True),
                "step": step,
            }[phase]
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
                # Training steps run back to back (a pipelined optimizer's updates overlap the
                # next forward), ended by waiting for every update.
                consecutive=(getattr(opt, "synchronize", lambda: None) if phase == "step" else None),
            )
            ours = a.system in ("ramtorch", "ramtorch-linear")
            if a.trace and phase == "step" and ours:
                rec["trace_summary"] = traced_steps(fn, opt, a.trace.format(tokens=t), dev)
            if phase == "step" and hasattr(opt, "speculation_bytes"):
                # The default schedule: updates computed during backward and committed by step().
                rec["optimizer_timings"] = dict(opt.timings)  # type: ignore[union-attr]
                rec["speculation_bytes"] = opt.speculation_bytes  # type: ignore[union-attr]
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
    elif a.system == "fsdp2" and extra.get("process_group") != "existing":
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
