"""Training step of a transformers decoder that is not Llama (Qwen2 or Mistral, random weights)
under ``ramtorch.offload``, with ``ramtorch.optim.AdamW`` in a chosen schedule: one JSON record per
run on stdout.

    python bench/decoder_step.py --arch qwen2 --overlap default --precision fp32-master --tokens 4096

``--overlap default`` is what users get (updates computed during backward, committed by
``step()``); ``backward`` is ``overlap="backward"`` (committed during backward); ``off`` is
``overlap=False``. Steps run back to back after the warm-up; the time is the mean of the timed
steps, ended by ``opt.synchronize()`` and a device synchronisation."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch


def build(arch: str, layers: int, hidden: int, inter: int, vocab: int, device: str) -> torch.nn.Module:
    import transformers

    common: dict[str, Any] = dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=max(1, hidden // 512),
        vocab_size=vocab,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    )
    cfg = (transformers.Qwen2Config if arch == "qwen2" else transformers.MistralConfig)(**common)
    cfg._attn_implementation = "sdpa"
    # Random weights filled on the device (fast), then moved to the host for offload.
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    return model.cpu()


def optimizer_name(precision: str, overlap: str) -> str:
    """The record's ``"optimizer"`` (``BENCH.md``): the state's precision and the mode."""
    state = {
        "fp32-master": "fp32 master",
        "bf16": "bf16",
        "compact": "8-bit moments, bf16+compensation",
    }[precision]
    mode = {"default": "speculative", "backward": "committed in backward", "off": "in step"}[overlap]
    return f"ramtorch.optim.AdamW({state}, {mode})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", choices=["qwen2", "mistral"], default="qwen2")
    ap.add_argument("--overlap", choices=["default", "backward", "off"], default="default")
    ap.add_argument("--precision", choices=["fp32-master", "bf16", "compact"], default="fp32-master")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--inter", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()

    import ramtorch
    import ramtorch.optim as ropt

    dev = a.device
    t0 = time.perf_counter()
    model = build(a.arch, a.layers, a.hidden, a.inter, a.vocab, dev)
    ramtorch.offload(model, device=dev)
    overlap: bool | str = {"default": True, "backward": "backward", "off": False}[a.overlap]
    opt = ropt.AdamW(model.parameters(), lr=1e-5, precision=a.precision, overlap=overlap)
    setup = time.perf_counter() - t0
    ids = torch.randint(0, a.vocab, (1, a.tokens), device=dev)

    def step() -> None:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync() -> None:
        opt.synchronize()
        if dev.startswith("cuda"):
            torch.cuda.synchronize()

    for _ in range(a.warmup):
        step()
    sync()
    times = []
    for _ in range(a.reps):
        s = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - s)
    params = sum(p.numel() for p in model.parameters())
    rec = {
        "workload": f"decoder-{a.arch}",
        "arch": a.arch,
        "params": params,
        "tokens": a.tokens,
        "layers": a.layers,
        "hidden": a.hidden,
        "phase": "step",
        "system": "ramtorch",
        "overlap": a.overlap,
        "precision": a.precision,
        "optimizer": optimizer_name(a.precision, a.overlap),
        "seconds": sum(times) / len(times),
        "seconds_all": times,
        "setup_seconds": setup,
        "optimizer_timings": dict(opt.timings),
        "speculation_bytes": opt.speculation_bytes,
        "speculation_bytes_per_param": opt.speculation_bytes / params,
        "gpu_peak_bytes": torch.cuda.max_memory_allocated() if dev.startswith("cuda") else 0,
    }
    print(json.dumps(rec), flush=True)
    print(f"{a.arch} {a.overlap} {a.precision}: {rec['seconds'] * 1e3:.1f} ms a step", file=sys.stderr)


if __name__ == "__main__":
    main()
