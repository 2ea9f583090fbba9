"""How far the host may queue copies ahead of the device, A/B inside one process: the int8 LoRA
step of ``bench/lora.py`` (the 8B shape, ``--layers`` deep, rank 16 on all projections, one
sequence of ``--tokens``), offloaded with default options, timed in rounds that alternate
``ramtorch._engine.COPIES_AHEAD`` between its default (64: the host runs ahead, the slots alone
order the copies on the device) and ``--other`` (``none``: the host blocks while ``max_inflight``
copies are in flight); or (``--vary sync``) a device synchronize after every step against none.
One process, so that the spread between processes (300-430 ms a step on one H200) does not enter
the comparison. Prints one JSON line per round, with the engine's
time per step that the host blocked on copies in flight (``throttle_wait``), that the compute
stream waited for copies (``stall``) and that the host waited for the engine's streams to drain
at the end of each backward (``sync_wait``).

    python3 bench/copies_ahead.py [--layers 32] [--rounds 6] [--steps 4] [--other none]
    python3 bench/copies_ahead.py --vary sync [--resident-first 3]
    python3 bench/copies_ahead.py --workload decode   # or lora (bf16 base), train, forward
    python3 bench/copies_ahead.py --smoke        # tiny Llama on the CPU device: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib  # noqa: E402
import lora  # noqa: E402
from arch import build, free_device, greedy, inputs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument(
        "--other",
        type=lambda v: None if v == "none" else int(v),
        default=None,
        help="the setting the default's rounds alternate with (none: max_inflight)",
    )
    ap.add_argument(
        "--vary",
        choices=("copies_ahead", "sync"),
        default="copies_ahead",
        help="what alternates between rounds: COPIES_AHEAD (default and --other), or a device "
        "synchronize after every step (as a loop that reads the loss each step) against none",
    )
    ap.add_argument(
        "--resident-first",
        type=int,
        default=0,
        help="steps of the model trained on the GPU (torch's fused AdamW) before it is offloaded, "
        "as bench/lora.py does",
    )
    ap.add_argument(
        "--workload",
        choices=("qlora", "lora", "train", "forward", "decode"),
        default="qlora",
        help="qlora: int8 base + rank-16 adapters, AdamW step (default); lora: the same on a bf16 base; "
        "train: full forward+backward, no optimizer; forward: one forward without grad; "
        "decode: greedy generate() of --new tokens at B=1",
    )
    ap.add_argument("--gpu-budget", default=None, help="offload's gpu_budget (e.g. 8GiB); default none")
    ap.add_argument("--new", type=int, default=16, help="decode: tokens generated per step")
    ap.add_argument("--smoke", action="store_true", help="tiny Llama on the CPU device, 2 rounds")
    a = ap.parse_args()
    device = "cpu" if a.smoke else "cuda"
    if a.smoke:
        a.layers, a.tokens, a.rounds, a.steps, a.warmup = 2, 16, 2, 1, 1
    import ramtorch
    import ramtorch._engine as eng
    import ramtorch.optim as ropt

    torch.manual_seed(0)
    model = build("llama", a.layers, a.smoke, device, torch.bfloat16)
    if a.workload == "qlora":
        lora.quantize_int8(model)
    if a.workload in ("qlora", "lora"):
        model, _ = lora.add_adapters(model, 16, "auto")
    x, _ = inputs("llama", a.tokens, a.smoke, device)
    if a.resident_first:
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        ref = torch.optim.AdamW(params, lr=1e-4, fused=device == "cuda")
        for _ in range(a.resident_first):
            model(**x).loss.backward()
            ref.step()
            ref.zero_grad(set_to_none=True)
        del ref
    model.to("cpu")
    free_device()
    ramtorch.offload(model, device=device, gpu_budget=a.gpu_budget)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = ropt.AdamW(trainable, lr=1e-4) if a.workload in ("qlora", "lora") else None
    prompt = x["input_ids"][:, : min(128, a.tokens)]

    def step() -> None:
        if a.workload == "decode":
            model.eval()
            greedy(model, prompt, a.new)
            return
        if a.workload == "forward":
            model.eval()
            with torch.no_grad():
                model(input_ids=x["input_ids"])
            return
        model.train()
        model(**x).loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            ramtorch.synchronize()
            for p in trainable:
                p.grad = None

    for _ in range(a.warmup):
        step()

    def engine_seconds() -> dict[str, float]:
        st = ramtorch.stats()["devices"]
        keys = ("throttle_wait_seconds", "stall_seconds", "sync_wait_seconds")
        return {k: sum(float(d.get(k, 0.0)) for d in st.values()) for k in keys}

    def sync() -> None:
        if opt is not None:
            opt.synchronize()
        if device == "cuda":
            torch.cuda.synchronize()

    sync()
    print(json.dumps({"host_pace": benchlib.host_pace(device)}))
    default = eng.COPIES_AHEAD
    for r in range(a.rounds):
        other = r % 2 == 1
        ahead = a.other if other and a.vary == "copies_ahead" else default
        each = other and a.vary == "sync"
        eng.COPIES_AHEAD = ahead
        step()  # one step at the new setting before the timed ones
        sync()
        before = engine_seconds()
        t = time.perf_counter()
        for _ in range(a.steps):
            step()
            if each and device == "cuda":
                torch.cuda.synchronize()
        sync()
        ms = (time.perf_counter() - t) / a.steps * 1e3
        row: dict[str, object] = {"round": r, "copies_ahead": ahead, "sync_each_step": each}
        row["ms_per_step"] = round(ms, 1)
        after = engine_seconds()
        # Per step: the host blocked on copies in flight (throttle_wait), the compute stream waited
        # for copies (stall), the host waited for the lanes at the end of backward (sync_wait).
        for k in after:
            per_step = (after[k] - before[k]) / a.steps
            row[f"{k.removesuffix('_seconds')}_ms_per_step"] = round(per_step * 1e3, 2)
        row["layers"] = a.layers
        row["workload"] = a.workload
        row["gpu_budget"] = a.gpu_budget
        row["resident_first"] = a.resident_first
        print(json.dumps(row))
    eng.COPIES_AHEAD = default


if __name__ == "__main__":
    main()
