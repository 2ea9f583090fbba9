"""How far the 8-bit moments of ``precision="compact"`` drift from exact AdamW moments when they
are stored (and so rounded) at every step, on the gradients of one trajectory.

A MiniLM-shaped BERT (``bench/compact_quality.py``'s ``--workload minilm-distill`` task: distil a
frozen teacher's last hidden states, float32 here) is trained with torch's AdamW; beside it, on the
same gradients, moments are kept in the compact format two ways:

- ``kernel``: by the engine's own AdamW kernel (``_core.optim_step`` in the compact format with a
  learning rate of 0, so only the moments move): 256-element blocks of small floats over each
  block's scale, the first moment rounded to nearest, the second stochastically;
- ``nearest``: each step's new moments computed from the stored ones and stored again through the
  block quantizer rounding to nearest (``_core.q8_quantize``/``q8_dequantize``), as the kernel
  stored both moments before it rounded the second stochastically.

At the given steps it prints and records, over all parameters and for each way, the norm of the
update those moments make against the exact moments' update, their cosine, and the ratio of the
sums of ``sqrt(v)``. A diagnostic of the state format alone: the weights follow torch's
trajectory, not the compact optimizer's.

    OMP_NUM_THREADS=1 python bench/compact_drift.py --steps 300 --out bench/results/compact-drift.json
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import compact_quality  # noqa: E402
from ramtorch import _core  # noqa: E402


def round_trip(x: torch.Tensor, signed: bool) -> torch.Tensor:
    """``x`` stored in the compact format and read back (float32, same shape)."""
    flat = x.detach().contiguous().view(-1).float()
    n = flat.numel()
    codes = torch.empty(n, dtype=torch.uint8)
    scales = torch.empty((n + 255) // 256, dtype=torch.float32)
    out = torch.empty(n)
    _core.q8_quantize(flat, codes, scales, signed)
    _core.q8_dequantize(codes, scales, out, signed)
    return out.view(x.shape)


class KernelMoments:
    """The moments of one parameter as the engine's compact AdamW keeps them: its kernel run with
    a learning rate of 0 on a zero bf16 weight (which stays zero), so only the states move."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.p = torch.zeros(n, dtype=torch.bfloat16)
        self.comp = torch.zeros(n, dtype=torch.bfloat16)
        self.codes = [torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)]
        self.scales = [torch.zeros((n + 255) // 256), torch.zeros((n + 255) // 256)]

    def step(self, grad: torch.Tensor, step: int, beta1: float, beta2: float, eps: float) -> None:
        h = {
            "step": step,
            "lr": 0.0,
            "beta1": beta1,
            "beta2": beta2,
            "eps": eps,
            "weight_decay": 0.0,
            "maximize": False,
            "grad_scale": 1.0,
            "seed": step,
        }
        g = grad.detach().reshape(-1).float().contiguous()
        _core.optim_step("adamw", h, self.p, g, self.codes, comp=self.comp, scales=self.scales)

    def moments(self, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for codes, scales, signed in zip(self.codes, self.scales, (True, False)):
            x = torch.empty(self.n)
            _core.q8_dequantize(codes, scales, x, signed)
            out.append(x.view(shape))
        return out[0], out[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--at", type=int, nargs="+", default=[10, 25, 50, 100, 200, 300])
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    from transformers import BertModel

    beta1, beta2, eps = 0.9, 0.999, 1e-8
    torch.manual_seed(a.seed + 1000)
    teacher = BertModel(compact_quality.minilm_config(), add_pooling_layer=False).eval()
    torch.manual_seed(a.seed)
    model = BertModel(compact_quality.minilm_config(), add_pooling_layer=False)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(beta1, beta2), eps=eps, weight_decay=0.01)
    gen = torch.Generator().manual_seed(a.seed)
    stored: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    kernel = {name: KernelMoments(q.numel()) for name, q in model.named_parameters()}
    warmup = max(1, a.steps // 10)
    rows = []
    t0 = time.perf_counter()
    for step in range(1, a.steps + 1):
        for group in opt.param_groups:
            group["lr"] = a.lr * min(1.0, step / warmup)
        ids = torch.randint(0, 256, (32, 32), generator=gen)
        with torch.no_grad():
            target = teacher(input_ids=ids).last_hidden_state
        loss = F.mse_loss(model(input_ids=ids).last_hidden_state, target)
        loss.backward()
        with torch.no_grad():
            for name, q in model.named_parameters():
                g = q.grad
                m, v = stored.get(name, (torch.zeros_like(g), torch.zeros_like(g)))
                stored[name] = (
                    round_trip(m.lerp(g, 1 - beta1), True),
                    round_trip(v * beta2 + (1 - beta2) * g * g, False),
                )
                kernel[name].step(g, step, beta1, beta2, eps)
        opt.step()
        opt.zero_grad()
        if step in a.at:
            bc1, bc2 = 1 - beta1**step, 1 - beta2**step
            row: dict[str, Any] = {"step": step, "loss": loss.item()}
            line = f"step {step}: loss {row['loss']:.4f}"
            for way in ("kernel", "nearest"):
                num = den = dot = vq_sum = v_sum = 0.0
                for name, q in model.named_parameters():
                    st = opt.state[q]
                    m, v = st["exp_avg"], st["exp_avg_sq"]
                    mq, vq = kernel[name].moments(q.shape) if way == "kernel" else stored[name]
                    u = (m / bc1) / ((v / bc2).sqrt() + eps)
                    uq = (mq / bc1) / ((vq / bc2).sqrt() + eps)
                    num += uq.square().sum().item()
                    den += u.square().sum().item()
                    dot += (u * uq).sum().item()
                    vq_sum += vq.sqrt().sum().item()
                    v_sum += v.sqrt().sum().item()
                row[way] = {
                    "update_norm_ratio": math.sqrt(num / den),
                    "update_cosine": dot / math.sqrt(num * den),
                    "sqrt_v_sum_ratio": vq_sum / v_sum,
                }
                line += (
                    f" | {way}: |update(stored)|/|update(exact)| {row[way]['update_norm_ratio']:.4f}, "
                    f"cosine {row[way]['update_cosine']:.4f}, "
                    f"sum sqrt(v) stored/exact {row[way]['sqrt_v_sum_ratio']:.4f}"
                )
            rows.append(row)
            print(line, flush=True)
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    record = {
        "workload": "minilm-distill",
        "phase": "state-drift",
        "optimizer": "torch AdamW trajectory; moments stored in the compact format beside it "
        "(kernel: the engine's AdamW kernel; nearest: both moments rounded to nearest)",
        "steps": a.steps,
        "lr": a.lr,
        "seed": a.seed,
        "rows": rows,
        "seconds": time.perf_counter() - t0,
        "commit": commit,
        "command": "python bench/compact_drift.py " + " ".join(sys.argv[1:]),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
