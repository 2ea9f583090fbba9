"""W2 (a Llama-architecture model, bf16, random weights) for one system in this process; prints one
JSON record per line.

The model is ``transformers.LlamaForCausalLM`` from a ``LlamaConfig`` with hidden 4096, FFN 14336,
32 layers, 32 heads, 8 KV heads, vocabulary 128256 (8.03e9 parameters, 15.0 GiB), run forward only
(``torch.no_grad()``, ``use_cache=False``) on one sequence of ``--seq`` tokens (batch 1). Systems:

- ``resident``: the whole model on the GPU (the compute floor);
- ``ramtorch``: the model moved to host RAM, then ``ramtorch.offload(model, gpu_budget=...)``
  (``--budget``: bytes, a string such as ``8GiB``, or ``none`` to stream everything);
- ``accelerate``: ``accelerate.cpu_offload(model, execution_device="cuda")``;
- ``ramtorch-1.11``: the original RamTorch 1.11 ``OffloadModel``, chunks = [embedding + rotary
  table, each decoder layer, final norm + LM head], ``window=2`` (run with that package first on
  ``PYTHONPATH``).

The weights are initialised on the GPU (transformers' initialisation: seconds there, minutes on the
host) and copied to host RAM for the offloading systems. ``--gpu-cap`` caps what the process may
allocate on the GPU (``torch.cuda.set_per_process_memory_fraction``) once the model is on the host.
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
    links_arg,
    measure,
    parse_bytes,
)
from torch import nn

SYSTEMS = ("resident", "ramtorch", "accelerate", "ramtorch-1.11")


def config(tiny: bool, seq: int):  # noqa: ANN201 - transformers is imported lazily
    from transformers import LlamaConfig

    kw = dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=max(8192, seq),
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    if tiny:
        kw.update(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1000,
        )
    return LlamaConfig(**kw)


def build(cfg: object, device: str) -> nn.Module:
    """LlamaForCausalLM with every tensor created and initialised on ``device`` in bf16."""
    from transformers import LlamaForCausalLM

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def to_host(model: nn.Module) -> None:
    """Moves the model to host RAM tensor by tensor (GPU memory is freed as it goes)."""
    model.to("cpu")
    free_gpu()


def free_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Embed(nn.Module):
    """First RamTorch 1.11 chunk: token embedding and the rotary table for the whole sequence."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.embed = model.model.embed_tokens
        self.rotary = model.model.rotary_emb

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.embed(ids)
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        cos, sin = self.rotary(h, pos)
        return h, cos, sin


class Layer(nn.Module):
    """One decoder layer as a RamTorch 1.11 chunk; passes the rotary table through."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.layer(h, position_embeddings=(cos, sin), use_cache=False)
        return (out[0] if isinstance(out, tuple) else out), cos, sin


class Head(nn.Module):
    """Last RamTorch 1.11 chunk: final norm and LM head."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.norm = model.model.norm
        self.lm_head = model.lm_head

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", required=True, choices=SYSTEMS)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget", default=None, help="ramtorch gpu_budget: bytes, e.g. 8GiB, or none")
    ap.add_argument("--compress", default=None, help="ramtorch offload(compress=...): lossless, fp8")
    ap.add_argument("--links", type=links_arg, default=None, help="offload(links=...): auto or cuda:1,...")
    ap.add_argument("--gpu-cap", default=None, help="cap GPU memory of the offloading systems, e.g. 12GiB")
    # Hidden: run on the CPU with a tiny model, to check the harness without a GPU.
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    dev = a.device
    budget = budget_arg(a.budget)
    cfg = config(a.tiny, a.seq)

    t0 = time.perf_counter()
    model = build(cfg, dev)
    wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    nparams = sum(p.numel() for p in model.parameters())
    extra: dict = {}
    if a.system != "resident":
        to_host(model)
        cap = parse_bytes(a.gpu_cap)
        if cap is not None and dev.startswith("cuda"):
            total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
            extra["gpu_cap_bytes"] = cap
    if a.system == "ramtorch":
        import ramtorch

        if a.compress is not None:
            model.requires_grad_(False)  # compressed units are frozen ones (the pass is no_grad anyway)
        model = ramtorch.offload(model, gpu_budget=budget, device=dev, compress=a.compress, links=a.links)
        extra["gpu_budget"] = budget
        extra["gpu_budget_bytes"] = parse_bytes(budget)
    elif a.system == "accelerate":
        import accelerate

        model = accelerate.cpu_offload(model, execution_device=torch.device(dev))
    elif a.system == "ramtorch-1.11":
        from ramtorch import OffloadModel

        chunks = [Embed(model), *(Layer(m) for m in model.model.layers), Head(model)]
        model = OffloadModel(chunks, device=dev, window=2)
        extra.update(chunks=len(chunks), window=2)
    free_gpu()
    extra["setup_seconds"] = time.perf_counter() - t0  # build, copy to host, wrap

    ids = torch.randint(0, cfg.vocab_size, (1, a.seq), device=dev)

    def fwd() -> None:
        with torch.no_grad():
            if a.system == "ramtorch-1.11":
                model(ids)
            else:
                model(input_ids=ids, use_cache=False)

    rec = measure(
        fwd,
        system=a.system,
        phase="forward",
        reps=a.reps,
        warmup=a.warmup,
        device=dev,
        weight_bytes=wbytes,
        params=nparams,
        fields={"workload": "W2", "tokens": a.seq, "seq": a.seq, "batch": 1, **extra},
    )
    if a.system == "ramtorch-1.11":
        rec["offload_stats"] = dict(model.stats)
        model.close()
    if dev != "cuda":
        rec["device_kind"] = dev
    print(json.dumps(rec), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
