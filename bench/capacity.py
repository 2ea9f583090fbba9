"""The largest model that trains on this machine: ``ramtorch.plan`` picks the deepest decoder of a
given width whose training fits in host memory (before anything is allocated), then the model is
built, offloaded under ``--gpu-budget`` and trained a few steps with ``ramtorch.optim.AdamW``
(compact state by default: fp32 quality, ``BENCHMARKS.md``), and the host memory it really held is
recorded next to the prediction (``host_bytes_per_param``: the peak resident memory less what
the process held before the model was built, a parameter).

    python bench/capacity.py --gpu-budget 24GiB --precision compact --steps 3

Parameters that stay on the device under the budget keep their optimizer states in host RAM
(``states="host"``), so that the device holds the budget, their gradients and the activations.
Random weights are filled on the device and packed straight into host memory (no pageable copy)."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import budget_arg, git_commit, llama_config, peak_rss, rss  # noqa: E402


def config(a: argparse.Namespace, layers: int) -> Any:
    return llama_config(a.hidden, a.inter, layers, a.heads, a.kv_heads, a.vocab, max(4096, a.tokens))


def build(a: argparse.Namespace, layers: int, device: str | torch.device) -> nn.Module:
    import transformers

    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config(a, layers), dtype=torch.bfloat16)


def choose_layers(a: argparse.Namespace) -> tuple[int, Any]:
    """The most layers (up to ``--max-layers``) whose training ``ramtorch.plan`` says fits in host
    memory, and that plan."""
    from ramtorch import plan

    best = None
    for layers in range(a.max_layers, 0, -1):
        model = build(a, layers, "meta")
        pred = plan.predict(
            model,
            budget_arg(a.gpu_budget),
            a.tokens,
            precision=a.precision,
            states="host",
            host_memory=a.host_memory,
        )
        print(
            f"plan: {layers} layers, {pred.params / 1e9:.2f}e9 parameters, "
            f"{pred.host_bytes_per_param:.2f} host bytes a parameter: "
            f"{'fits' if pred.fits_host else 'does not fit'}",
            file=sys.stderr,
        )
        if pred.fits_host:
            best = (layers, pred)
            break
    if best is None:
        raise SystemExit("no depth fits in host memory")
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--inter", type=int, default=13824)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--max-layers", type=int, default=64, help="deepest model tried by the plan")
    ap.add_argument("--layers", type=int, default=None, help="this depth, not the plan's choice")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens a step (one sequence)")
    ap.add_argument("--gpu-budget", default="24GiB")
    ap.add_argument("--precision", choices=["fp32-master", "bf16", "compact"], default="compact")
    ap.add_argument("--host-memory", default="auto", help="host memory the plan checks against")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--disk", default=None, help="directory of the disk tier (with --host-budget)")
    ap.add_argument("--host-budget", default=None, help="offload(host_budget=...): the rest on --disk")
    ap.add_argument(
        "--optimizer-on-disk",
        action="store_true",
        help="offload(optimizer_on_disk=True): the disk units' states too",
    )
    a = ap.parse_args()

    import ramtorch
    import ramtorch.optim as ropt
    from ramtorch import plan

    if a.layers is None:
        if a.disk is not None:
            raise SystemExit("--disk needs --layers (the plan does not choose a depth for the disk tier)")
        layers, pred = choose_layers(a)
    else:
        layers = a.layers
        pred = plan.predict(
            build(a, layers, "meta"),
            budget_arg(a.gpu_budget),
            a.tokens,
            precision=a.precision,
            states="host",
            host_memory=a.host_memory,
        )
    print(pred.summary(), file=sys.stderr)
    if a.device.startswith("cuda"):
        torch.cuda.init()
        torch.empty(1, device=a.device)
    runtime = rss()  # torch, CUDA and Python before the model: not the model's bytes
    t0 = time.perf_counter()
    model = build(a, layers, a.device)
    model.train()
    tier = {}
    if a.disk is not None:
        os.makedirs(a.disk, exist_ok=True)
        tier = {"disk": a.disk, "host_budget": a.host_budget, "optimizer_on_disk": a.optimizer_on_disk}
    ramtorch.offload(model, device=a.device, gpu_budget=budget_arg(a.gpu_budget), **tier)
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()
    opt = ropt.AdamW(model.parameters(), lr=1e-5, precision=a.precision, states="host")
    setup = time.perf_counter() - t0
    print(f"built and offloaded in {setup:.1f} s; host RSS {rss() / 2**30:.1f} GiB", file=sys.stderr)
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, a.vocab, (1, a.tokens), generator=torch.Generator().manual_seed(0)).to(a.device)
    probe = next(p for p in model.parameters() if p.dim() == 2)
    before = probe.detach().float().sum().item()
    times, losses = [], []
    for step in range(a.steps):
        s = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        opt.synchronize()
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - s)
        losses.append(loss.item())
        held = rss() / 2**30
        print(f"step {step}: loss {losses[-1]:.4f}, {times[-1]:.2f} s, RSS {held:.1f} GiB", file=sys.stderr)
    if not all(math.isfinite(x) for x in losses):
        raise SystemExit(f"training diverged: losses {losses}")
    if probe.detach().float().sum().item() == before:
        raise SystemExit("the weights did not change: nothing was trained")
    peak = peak_rss()
    st = ramtorch.stats(model)
    ds = opt._disk_states
    disk_rec = {}
    if a.disk is not None:
        disk_rec = {
            "host_budget": a.host_budget,
            "optimizer_on_disk": a.optimizer_on_disk,
            "disk_units": len(st.get("disk_units", [])),
            "disk_unit_params": sum(
                p.numel() for p in model.parameters() if ramtorch._disk.store_of(p) is not None
            ),
            "disk_weight_bytes": st.get("disk_bytes"),
            "disk_state_bytes": 0 if ds is None else ds.nbytes,
            "disk_read_gbps": st.get("disk_read_gbps"),
            "disk_wait_seconds": st.get("disk_wait_seconds"),
        }
    rec = {
        "workload": "capacity",
        "model": f"llama, hidden {a.hidden}, {layers} layers",
        "layers": layers,
        "phase": "step",
        "system": "ramtorch",
        "tokens": a.tokens,
        "largest_params": params,
        "host_bytes_per_param": (peak - runtime) / params,
        "host_peak_rss_bytes": peak,
        "host_runtime_bytes": runtime,
        "host_memory_bytes": plan.machine_memory(),
        "predicted_host_bytes_per_param": pred.host_bytes_per_param,
        "predicted_fits": pred.fits_host,
        "gpu_budget": a.gpu_budget,
        "gpu_peak_bytes": torch.cuda.max_memory_allocated() if a.device.startswith("cuda") else 0,
        "optimizer": f"ramtorch.optim.AdamW({a.precision}, states in host RAM"
        + (", the disk units' on disk)" if a.optimizer_on_disk else ")"),
        **disk_rec,
        "seconds": sum(times[1:]) / max(1, len(times) - 1),
        "seconds_all": times,
        "losses": losses,
        "setup_seconds": setup,
        "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
        "commit": a.commit or git_commit(),
        "command": "python3 bench/capacity.py " + shlex.join(sys.argv[1:]),
        "gpus": 1,
    }
    print(json.dumps(rec), flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump([rec], fh, indent=1)


if __name__ == "__main__":
    main()
