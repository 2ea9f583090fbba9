"""How far the 8-bit moments of ``precision="compact"`` drift from exact AdamW moments when they
are stored (and so rounded) at every step, on the gradients of one trajectory.

A MiniLM-shaped BERT (``bench/compact_quality.py``'s ``--workload minilm-distill`` task: distil a
frozen teacher's last hidden states, float32 here) is trained with torch's AdamW; beside it, on the
same gradients, moments are kept as the compact format keeps them: each step's new first and
second moments are computed from the stored ones and stored again through the engine's block
quantizer (``_core.q8_quantize``/``q8_dequantize``, the kernel's encoder: 256-element blocks,
dynamic map, round to nearest). At the given steps it prints and records, over all parameters,
the norm of the update those moments make against the exact moments' update, their cosine, and
the ratio of the sums of ``sqrt(v)``. A diagnostic of the state format alone: the weights follow
torch's trajectory, not the compact optimizer's.

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
        opt.step()
        opt.zero_grad()
        if step in a.at:
            num = den = dot = vq_sum = v_sum = 0.0
            bc1, bc2 = 1 - beta1**step, 1 - beta2**step
            for name, q in model.named_parameters():
                st = opt.state[q]
                m, v = st["exp_avg"], st["exp_avg_sq"]
                mq, vq = stored[name]
                u = (m / bc1) / ((v / bc2).sqrt() + eps)
                uq = (mq / bc1) / ((vq / bc2).sqrt() + eps)
                num += uq.square().sum().item()
                den += u.square().sum().item()
                dot += (u * uq).sum().item()
                vq_sum += vq.sqrt().sum().item()
                v_sum += v.sqrt().sum().item()
            row = {
                "step": step,
                "loss": loss.item(),
                "update_norm_ratio": math.sqrt(num / den),
                "update_cosine": dot / math.sqrt(num * den),
                "sqrt_v_sum_ratio": vq_sum / v_sum,
            }
            rows.append(row)
            print(
                f"step {step}: loss {row['loss']:.4f}, |update(stored)|/|update(exact)| "
                f"{row['update_norm_ratio']:.4f}, cosine {row['update_cosine']:.4f}, "
                f"sum sqrt(v) stored/exact {row['sqrt_v_sum_ratio']:.4f}",
                flush=True,
            )
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    record = {
        "workload": "minilm-distill",
        "phase": "state-drift",
        "optimizer": "torch AdamW trajectory; moments stored in the compact format beside it",
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
