"""Where a LoRA step's device time goes, resident against offloaded: torch.profiler's CUDA kernel
table (self device time, summed over two steps) of ``bench/lora.py``'s model (the 8B shape, fewer
layers) for each, on one base. A diagnostic, not a benchmark: it prints, it records nothing.

    python3 bench/profile_lora.py --base int8 --layers 4 [--rows 25] [--export DIR]

``--export DIR`` also writes each profile as a Chrome trace (``DIR/lora-<base>-<resident|ramtorch>.json``)
and prints the device's idle time between kernels per step.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lora  # noqa: E402
from arch import build, free_device, inputs  # noqa: E402


def profile(step: object, label: str, rows: int, export: str | None = None) -> None:
    for _ in range(4):
        step()  # type: ignore[operator]
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(2):
            step()  # type: ignore[operator]
        torch.cuda.synchronize()
    print(f"## {label}", flush=True)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows), flush=True)
    if export:
        os.makedirs(export, exist_ok=True)
        path = os.path.join(export, f"lora-{label.replace(' ', '-')}.json")
        prof.export_chrome_trace(path)
        print(f"# trace: {path}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", choices=lora.BASES, default="int8")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--export", default=None, help="a folder for the two Chrome traces")
    a = ap.parse_args()
    import ramtorch
    import ramtorch.optim as ropt

    torch.manual_seed(0)
    model = build("llama", a.layers, False, "cuda", torch.bfloat16)
    if a.base == "int8":
        lora.quantize_int8(model)
    model, _ = lora.add_adapters(model, 16, "auto")
    x, _ = inputs("llama", a.tokens, False, "cuda")
    trainable = [p for p in model.parameters() if p.requires_grad]
    model.train()
    opt = torch.optim.AdamW(trainable, lr=1e-4, fused=True)

    def step(opt: object = opt) -> None:
        model(**x).loss.backward()
        opt.step()  # type: ignore[attr-defined]
        opt.zero_grad(set_to_none=True)  # type: ignore[attr-defined]

    profile(step, f"{a.base} resident", a.rows, a.export)
    model.to("cpu")
    free_device()
    ramtorch.offload(model, device="cuda")
    offloaded_opt = ropt.AdamW(trainable, lr=1e-4)
    profile(lambda: step(offloaded_opt), f"{a.base} ramtorch", a.rows, a.export)


if __name__ == "__main__":
    main()
