"""The architecture matrix: transformers models of 7–8e9-parameter shapes (fewer layers, so that a run
is short), random bf16 weights, under ``ramtorch.offload`` with its default options on one GPU,
next to the same model resident on the GPU; writes one JSON list (BENCH.md records, workload
``arch:<name>``) and prints a table.

    python3 bench/arch.py --out $OUT/arch.json [--arch llama qwen2 ...] [--phases forward ...]
        [--tokens 4096] [--reps 3] [--warmup 1] [--layers N | --full-depth] [--commit abc1234]
        [--phases ... decode --batch 1 8 --prompt 128 --new 16] [--host-gather]
    python3 bench/arch.py --smoke --out /tmp/arch.json      # tiny configs on the CPU, 1 rep

Architectures (their per-layer shapes are those of the real configs named; ``layers`` blocks):

| name | model class | shape of the layers |
| --- | --- | --- |
| llama | LlamaForCausalLM | Llama-3-8B: hidden 4096, FFN 14336, 32/8 heads, vocab 128256, untied |
| qwen2 | Qwen2ForCausalLM | Qwen2-7B: hidden 3584, FFN 18944, 28/4 heads, q/k/v biases, vocab 152064 |
| mistral | MistralForCausalLM | Mistral-7B-v0.3: hidden 4096, FFN 14336, 32/8 heads, vocab 32768 |
| gemma | GemmaForCausalLM | Gemma-7B: hidden 3072, FFN 24576, 16 heads of 256, vocab 256000, tied |
| gpt-neox | GPTNeoXForCausalLM | Pythia-6.9B: hidden 4096, FFN 16384, 32 heads, parallel residual |
| phi | PhiForCausalLM | Phi-2's layout (parallel blocks, partial rotary, biases) at hidden 4096 |
| bert | BertModel | BERT's layout at hidden 4096, FFN 16384, 32 heads; sequences of 512 |
| t5 | T5ForConditionalGeneration | T5 v1.1 XXL: d_model 4096, gated FFN 10240, 64 heads; 512 |
| vit | ViTModel | ViT's layout at hidden 4096, FFN 16384, 32 heads; 224×224, 14×14 patches |
| resnet | ResNetModel | BiT ResNet-152x4: bottleneck stages [3, 8, 36, 3], width ×4; 224×224 |

Qwen2 and Llama have untied heads; Phi and GPT-NeoX FFN 16384, vocabulary 51200 and 50432. T5's
``layers`` are split between encoder and decoder.

``tokens`` per step T (default 4096): one sequence of T tokens for the decoders; T/512 sequences of
512 for BERT and for T5 (encoder and decoder inputs both); T/256 images of 224×224 for ViT (256
patches each, plus its class token) and for ResNet (the same images). ``layers`` scales every
transformer's depth (T5: half encoder, half decoder) and the ResNet's bottleneck blocks (spread
over its stages as in [3, 8, 36, 3]); each record carries ``layers`` and ``full_layers``,
``params`` and ``full_params`` (the real depth): the limit scales linearly with the layers.

Each architecture runs in its own process: the weights are initialised on the GPU (seconds, where
the host would take minutes), the resident model is measured (system ``resident``, the compute
floor), then it moves to host RAM and ``ramtorch.offload(model)`` streams it (system ``ramtorch``).
Phases: ``forward`` (``torch.no_grad()``, ``eval()``), ``forward_backward`` (``train()``; the
loss: the model's own with labels for the language models, the mean square of the last hidden state
otherwise; ``ramtorch.synchronize()`` so every ``.grad`` is written; gradients set to None after),
``forward_backward_accumulate`` (the time of a second forward+backward that adds into the
gradients the first one, untimed, left: no ``zero_grad`` between), and on request ``decode`` (the
language models only: a step of greedy ``generate()`` with default options at each ``--batch``,
after a ``--prompt``-token prompt, measured as ``bench/generate.py`` does; records carry
``"batch"``; its link limit is one forward's streamed bytes). Times are medians of ``--reps``
calls after ``--warmup`` calls, each ended by a device synchronisation.

Limit, per record, from ceilings measured in this run (pinned 2 GiB copies, before the models):
``link`` = forward: streamed bytes per pass (``ramtorch.stats``) / H2D; with backward: streamed /
H2D (the forward) + max(streamed / H2D, gradient bytes of the streamed parameters / D2H, (streamed +
gradient bytes) / duplex) (the backward: the weights cross again while the gradients go out, and
both directions at once move ``duplex_gbps`` in total, measured as the others); ``compute`` = the
resident model's time for the same phase. ``limit_seconds`` = max(link, compute), ``limit_parts`` =
``{"link_seconds", "compute_seconds"}``, ``ratio`` (= ``limit_over_measured``) = limit / measured,
``vs_resident`` = resident seconds / ramtorch seconds. Where the resident forward was measured
too, a training record also carries ``phase_limit_seconds`` and ``phase_ratio``: the larger of the
limit and the sum of one bound per pass, since the passes do not overlap (the forward: max(streamed
/ H2D, resident forward); the backward, before which no gradient exists: max(gradient bytes / D2H,
resident forward+backward less resident forward)). ``--relimit FILE...`` prints the table of
records already written, with these recomputed. If the resident model does not fit, its
records carry ``"error"`` and the limit is the link alone (``compute_seconds`` null); with
``--resident-layers LO HI`` the resident records are instead extrapolated linearly in the layers
from resident models of LO and HI layers (records carry ``"how"`` and both measured times).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from benchlib import env_options, gpu_peak, host_pace, reset_peak, rss, sync
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
PHASES = ("forward", "forward_backward", "forward_backward_accumulate", "decode")
#: The phases run when none are named (``decode`` on request: it takes longer).
DEFAULT_PHASES = PHASES[:3]


@dataclass(frozen=True)
class Spec:
    """One architecture of the matrix: the transformers classes, the full-size configuration
    (without its depth), the depth of the real model, the default depth of a run, the kind of
    input, and the configuration of the tiny smoke model."""

    model: str
    config: str
    kw: dict[str, Any]
    full_layers: int
    layers: int
    kind: str  # "lm" (decoder, one sequence), "encoder" (BERT), "seq2seq" (T5), "vit", "cnn"
    tiny: dict[str, Any] = field(default_factory=dict)


_TINY_DEC = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=512)

ARCHS: dict[str, Spec] = {
    "llama": Spec(
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=8192,
            rope_theta=500000.0,
            tie_word_embeddings=False,
        ),
        32,
        4,
        "lm",
        dict(_TINY_DEC, num_key_value_heads=2),
    ),
    "qwen2": Spec(
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
        ),
        28,
        4,
        "lm",
        dict(_TINY_DEC, num_key_value_heads=2),
    ),
    "mistral": Spec(
        "MistralForCausalLM",
        "MistralConfig",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32768,
            max_position_embeddings=32768,
            sliding_window=None,
            tie_word_embeddings=False,
        ),
        32,
        4,
        "lm",
        dict(_TINY_DEC, num_key_value_heads=2),
    ),
    "gemma": Spec(
        "GemmaForCausalLM",
        "GemmaConfig",
        dict(
            hidden_size=3072,
            intermediate_size=24576,
            num_attention_heads=16,
            num_key_value_heads=16,
            head_dim=256,
            vocab_size=256000,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
        ),
        28,
        4,
        "lm",
        dict(_TINY_DEC, num_key_value_heads=4, head_dim=32),
    ),
    "gpt-neox": Spec(
        "GPTNeoXForCausalLM",
        "GPTNeoXConfig",
        dict(
            hidden_size=4096,
            intermediate_size=16384,
            num_attention_heads=32,
            vocab_size=50432,
            max_position_embeddings=8192,
            rotary_pct=0.25,
            use_parallel_residual=True,
            tie_word_embeddings=False,
        ),
        32,
        4,
        "lm",
        dict(_TINY_DEC),
    ),
    "phi": Spec(
        "PhiForCausalLM",
        "PhiConfig",
        dict(
            hidden_size=4096,
            intermediate_size=16384,
            num_attention_heads=32,
            vocab_size=51200,
            max_position_embeddings=8192,
            # Phi-2's 0.4 of its 80-wide heads is 32 rotary dimensions; of 128-wide heads it would
            # be 51.2, which transformers' rotary embedding cannot split: half of each head here.
            partial_rotary_factor=0.5,
            tie_word_embeddings=False,
        ),
        32,
        4,
        "lm",
        dict(_TINY_DEC),
    ),
    "bert": Spec(
        "BertModel",
        "BertConfig",
        dict(hidden_size=4096, intermediate_size=16384, num_attention_heads=32, vocab_size=30522),
        32,
        8,
        "encoder",
        dict(_TINY_DEC),
    ),
    "t5": Spec(
        "T5ForConditionalGeneration",
        "T5Config",
        dict(
            d_model=4096,
            d_ff=10240,
            num_heads=64,
            d_kv=64,
            vocab_size=32128,
            feed_forward_proj="gated-gelu",
            tie_word_embeddings=False,
            decoder_start_token_id=0,
            pad_token_id=0,
        ),
        48,
        4,
        "seq2seq",
        dict(d_model=64, d_ff=128, num_heads=4, d_kv=16, vocab_size=512),
    ),
    "vit": Spec(
        "ViTModel",
        "ViTConfig",
        dict(
            hidden_size=4096, intermediate_size=16384, num_attention_heads=32, image_size=224, patch_size=14
        ),
        32,
        8,
        "vit",
        dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, image_size=32, patch_size=8),
    ),
    "resnet": Spec(
        "ResNetModel",
        "ResNetConfig",
        dict(embedding_size=256, hidden_sizes=[1024, 2048, 4096, 8192], layer_type="bottleneck"),
        50,
        50,
        "cnn",
        dict(embedding_size=8, hidden_sizes=[16, 32, 64, 128], image_size=32),
    ),
}

#: Sequence length of the encoder models (BERT, T5): their inputs are T / SEQ sequences.
ENCODER_SEQ = 512
RESNET_DEPTHS = (3, 8, 36, 3)
#: Blocks of a smoke run's models: [transformers, ResNet].
SMOKE_LAYERS = (2, 4)


def resnet_depths(blocks: int) -> list[int]:
    """``blocks`` bottleneck blocks spread over the four stages as in ResNet-152 (at least one each)."""
    blocks = max(4, blocks)
    out = [max(1, round(blocks * d / sum(RESNET_DEPTHS))) for d in RESNET_DEPTHS]
    out[2] += blocks - sum(out)  # the remainder to the deepest stage
    return out


def make_config(name: str, layers: int, smoke: bool) -> Any:
    """The transformers configuration of architecture ``name`` with ``layers`` blocks."""
    import transformers

    spec = ARCHS[name]
    kw = dict(spec.kw)
    if smoke:
        kw = {k: v for k, v in kw.items() if k not in spec.tiny} | spec.tiny
    if spec.kind == "seq2seq":
        kw["num_layers"] = max(1, layers // 2)
        kw["num_decoder_layers"] = max(1, layers - layers // 2)
    elif spec.kind == "cnn":
        kw.pop("image_size", None)
        kw["depths"] = resnet_depths(layers)
    else:
        kw["num_hidden_layers"] = layers
    return getattr(transformers, spec.config)(**kw)


def image_size(name: str, smoke: bool) -> int:
    spec = ARCHS[name]
    return int((spec.tiny if smoke else spec.kw).get("image_size", 224))


def patch_size(name: str, smoke: bool) -> int:
    """Pixels of a side of the patch one token stands for (ResNet: the ViT's, for the batch size)."""
    return 8 if smoke else 14


def build(name: str, layers: int, smoke: bool, device: str, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The model with every tensor created and initialised on ``device`` in ``dtype``."""
    import transformers

    cfg = make_config(name, layers, smoke)
    cls = getattr(transformers, ARCHS[name].model)
    kw = {"add_pooling_layer": False} if ARCHS[name].kind in ("encoder", "vit") else {}
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(cfg, **kw)
    finally:
        torch.set_default_dtype(old)
    return model


def full_params(name: str, smoke: bool) -> int:
    """Parameters of the architecture at its real depth (built on the meta device)."""
    with torch.device("meta"):
        model = build(name, ARCHS[name].full_layers, smoke, "meta")
    return sum(p.numel() for p in model.parameters())


def inputs(
    name: str, tokens: int, smoke: bool, device: str, dtype: torch.dtype = torch.bfloat16
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The keyword inputs of one step of about ``tokens`` tokens, and the fields describing them
    (tokens, batch, seq or image size)."""
    spec = ARCHS[name]
    cfg_vocab = int((spec.tiny if smoke else spec.kw).get("vocab_size", 0))
    if spec.kind in ("vit", "cnn"):
        side = image_size(name, smoke)
        per_image = (side // patch_size(name, smoke)) ** 2
        batch = max(1, tokens // per_image)
        px = torch.randn(batch, 3, side, side, device=device, dtype=dtype)
        return {"pixel_values": px}, {"tokens": batch * per_image, "batch": batch, "image_size": side}
    seq = tokens if spec.kind == "lm" else min(tokens, 64 if smoke else ENCODER_SEQ)
    batch = max(1, tokens // seq)
    ids = torch.randint(0, cfg_vocab, (batch, seq), device=device)
    fields = {"tokens": batch * seq, "batch": batch, "seq": seq}
    if spec.kind == "lm":
        return {"input_ids": ids, "labels": ids, "use_cache": False}, fields
    if spec.kind == "seq2seq":
        return {"input_ids": ids, "labels": ids, "use_cache": False}, fields
    return {"input_ids": ids}, fields


def loss_of(out: Any) -> torch.Tensor:
    """The model's own loss when it computed one (labels given), else the mean square of its last
    hidden state (or feature map), in fp32."""
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    return out.last_hidden_state.float().square().mean()


# -- one architecture, in its own process ---------------------------------------------------------


def free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engine_counters(device: str) -> dict[str, float]:
    """The engine's cumulative copy counters of ``device`` (bytes each way, stall seconds)."""
    import ramtorch

    d = (ramtorch.stats().get("devices") or {}).get(
        device if ":" in device or device == "cpu" else f"{device}:0"
    )
    d = d or {}
    keys = (
        "h2d_bytes",
        "d2h_bytes",
        "stall_seconds",
        "grad_sum_bytes",
        "grad_adds_wait_seconds",
        "grad_sums_streamed",
        "grad_streamed_share",
    )
    return {k: float(d.get(k, 0) or 0) for k in keys}


def allocator_counters(device: str) -> dict[str, float]:
    """torch's caching allocator on ``device``: retries of a failed ``cudaMalloc`` after freeing
    its cache (slow: each synchronises the device) and the bytes it holds from the driver."""
    if not device.startswith("cuda"):
        return {}
    st = torch.cuda.memory_stats(device)
    return {
        "alloc_retries": float(st.get("num_alloc_retries", 0)),
        "reserved_bytes": float(torch.cuda.memory_reserved(device)),
    }


def phase_fns(
    model: nn.Module, x: dict[str, Any], offloaded: bool
) -> dict[str, tuple[Callable[[], None] | None, Callable[[], None]]]:
    """Per phase: (an untimed call before each timed one, or None; the timed call)."""
    params = [p for p in model.parameters() if p.requires_grad]

    def settle() -> None:
        if offloaded:
            import ramtorch

            ramtorch.synchronize()  # every .grad written

    def clear() -> None:
        for p in params:
            p.grad = None

    # Inference has no labels: the decoder's inputs are given directly (T5), no loss computed.
    x_fwd = {k: v for k, v in x.items() if k != "labels"}
    if "decoder_input_ids" not in x and "labels" in x and model.config.is_encoder_decoder:
        x_fwd["decoder_input_ids"] = x["labels"]

    def fwd() -> None:
        with torch.no_grad():
            model(**x_fwd)

    def fwd_bwd() -> None:
        loss_of(model(**x)).backward()
        settle()

    def fwd_bwd_clear() -> None:
        fwd_bwd()
        clear()

    def first() -> None:
        clear()
        fwd_bwd()

    return {
        "forward": (None, fwd),
        "forward_backward": (None, fwd_bwd_clear),
        "forward_backward_accumulate": (first, fwd_bwd),
    }


def time_phase(
    before: Callable[[], None] | None,
    fn: Callable[[], None],
    reps: int,
    warmup: int,
    device: str,
    offloaded: bool,
) -> dict[str, Any]:
    """Median wall time of ``reps`` calls of ``fn`` (each after ``before``, untimed), after
    ``warmup`` untimed rounds; GPU peak over the timed calls; the engine's copies during them."""
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    sync(device)
    reset_peak(device)
    times: list[float] = []
    moved = {"h2d_bytes": 0.0, "d2h_bytes": 0.0, "stall_seconds": 0.0}
    each: list[dict[str, float]] = []  # per timed call: what moved, and the allocator's retries
    for _ in range(reps):
        if before is not None:
            before()
        sync(device)
        c0 = engine_counters(device) if offloaded else {}
        a0 = allocator_counters(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
        a1 = allocator_counters(device)
        one = {"seconds": times[-1], "reserved_bytes": a1.get("reserved_bytes", 0.0)}
        one["alloc_retries"] = a1.get("alloc_retries", 0.0) - a0.get("alloc_retries", 0.0)
        if offloaded:
            c1 = engine_counters(device)
            for k in moved:
                moved[k] += c1[k] - c0[k]
            one.update(
                {k: c1[k] - c0[k] for k in ("d2h_bytes", "grad_adds_wait_seconds", "grad_sums_streamed")}
            )
            one["grad_sum_bytes"] = c1["grad_sum_bytes"]
            one["grad_streamed_share"] = c1["grad_streamed_share"]
        each.append(one)
    rec: dict[str, Any] = {
        "seconds": statistics.median(times),
        "seconds_all": times,
        "per_call": each,
        "gpu_peak_bytes": gpu_peak(device),
        "host_rss_bytes": rss(),
        "host_pace": host_pace(device),
    }
    if offloaded:
        rec.update({f"{k}_per_rep": v / reps for k, v in moved.items()})
    return rec


def resident_records(
    a: argparse.Namespace, model: nn.Module, name: str, common: dict[str, Any], x: Any
) -> list[dict[str, Any]]:
    """The resident model's records of every phase (the compute floor), on the GPU."""
    records: list[dict[str, Any]] = []
    for phase in a.phases:
        if phase == "decode":
            records += decode_records(a, model, name, common, {}, "resident")
            continue
        model.train(phase != "forward")
        before, fn = phase_fns(model, x, offloaded=False)[phase]
        try:
            r = time_phase(before, fn, a.reps, a.warmup, a.device, offloaded=False)
        except torch.OutOfMemoryError as e:
            r = {"seconds": None, "error": f"resident: {str(e)[:200]}"}
        for p in model.parameters():
            p.grad = None
        free_device()
        records.append({**common, "phase": phase, "system": "resident", **r})
        log(name, phase, "resident", r.get("seconds"))
    return records


def extrapolated_resident(
    a: argparse.Namespace, name: str, layers: int, common: dict[str, Any], x: Any
) -> list[dict[str, Any]]:
    """Resident records at ``layers`` from resident models of ``--resident-layers LO HI`` layers:
    ``t(layers) = t(LO) + (t(HI) - t(LO)) / (HI - LO) * (layers - LO)``, per phase (decode
    steps are not extrapolated). Each record carries both measured times and ``"how"``."""
    lo, hi = a.resident_layers
    dtype = torch.float32 if a.smoke else torch.bfloat16
    measured: dict[int, dict[str, dict[str, Any]]] = {}
    for depth in (lo, hi):
        model = build(name, depth, a.smoke, a.device, dtype)
        sub = {**common, "layers": depth}
        phases = [p for p in a.phases if p != "decode"]
        got = resident_records(argparse.Namespace(**{**vars(a), "phases": phases}), model, name, sub, x)
        measured[depth] = {r["phase"]: r for r in got}
        del model
        free_device()
    records = []
    for phase in a.phases:
        if phase == "decode":
            continue
        t_lo, t_hi = (measured[d][phase].get("seconds") for d in (lo, hi))
        how = f"extrapolated from resident models of {lo} and {hi} layers"
        if t_lo is None or t_hi is None:
            errors = [measured[d][phase].get("error") for d in (lo, hi)]
            r: dict[str, Any] = {"seconds": None, "error": f"resident at {lo}/{hi} layers: {errors}"}
        elif t_hi <= t_lo:
            r = {"seconds": None, "error": f"resident time does not grow with depth: {t_lo} s, {t_hi} s"}
        else:
            r = {"seconds": t_lo + (t_hi - t_lo) / (hi - lo) * (layers - lo)}
        records.append(
            {
                **common,
                "phase": phase,
                "system": "resident",
                **r,
                "how": how,
                "resident_measured": {str(lo): t_lo, str(hi): t_hi},
            }
        )
        log(name, phase, "resident (extrapolated)", r.get("seconds"))
    return records


def run_arch(a: argparse.Namespace, name: str) -> list[dict[str, Any]]:
    """Resident then offloaded measurements of one architecture; records without limits."""
    import ramtorch

    dev = a.device
    layers = a.layers or (SMOKE_LAYERS[ARCHS[name].kind == "cnn"] if a.smoke else ARCHS[name].layers)
    if a.full_depth and not a.smoke:
        layers = ARCHS[name].full_layers
    dtype = torch.float32 if a.smoke else torch.bfloat16
    t0 = time.perf_counter()
    model = build(name, layers, a.smoke, dev, dtype)
    build_seconds = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    x, fields = inputs(name, a.tokens, a.smoke, dev, dtype)
    common = {
        "workload": f"arch:{name}",
        **fields,
        "layers": layers,
        "full_layers": ARCHS[name].full_layers,
        "params": params,
        "full_params": full_params(name, a.smoke),
        "weight_bytes": weight_bytes,
        "model_class": ARCHS[name].model,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
    }
    if env_options():
        common["options"] = env_options()
    if ARCHS[name].kind == "cnn":
        common["depths"] = list(model.config.depths)
    records: list[dict[str, Any]] = []
    if a.resident_layers and ARCHS[name].kind != "cnn":
        # The compute floor of a model whose resident passes do not fit: the same layers resident
        # at two smaller depths, extrapolated linearly in the layers (exact for a stack of
        # identical blocks; the embeddings and head are in both).
        model.to("cpu")
        free_device()
        records += extrapolated_resident(a, name, layers, common, x)
    else:
        records += resident_records(a, model, name, common, x)
    model.to("cpu")
    free_device()
    if a.host_gather:  # the A/B of the default: lookups without gradient gather on the host
        import ramtorch._stream.gather as stream_gather

        stream_gather.reads_in_place = lambda *args, **kw: False
        common["options"] = {**common.get("options", {}), "lookups": "host gather"}
    t1 = time.perf_counter()
    ramtorch.offload(model, device=dev)
    offload_seconds = time.perf_counter() - t1
    st = ramtorch.stats(model)
    streamed = st["streamed_bytes_per_pass"]
    grad_bytes = streamed_grad_bytes(model, dev, streamed)
    extra = {
        "streamed_bytes_per_pass": streamed,
        "streamed_grad_bytes": grad_bytes,
        "units": st["units"],
        "resident_units": st["resident_units"],
        "ramtorch_gpu_bytes": st["gpu_bytes"],
        "slot_bytes": st["slot_bytes"],
        "build_seconds": build_seconds,
        "offload_seconds": offload_seconds,
    }
    for phase in a.phases:
        if phase == "decode":
            records += decode_records(a, model, name, common, extra, "ramtorch")
            continue
        model.train(phase != "forward")
        before, fn = phase_fns(model, x, offloaded=True)[phase]
        counted = ("forwards_by_rows", "forwards_by_parts")
        cut = {k: ramtorch.stats(model).get(k, 0) for k in counted}
        r = time_phase(before, fn, a.reps, a.warmup, dev, offloaded=True)
        r.update({k: ramtorch.stats(model).get(k, 0) - cut[k] for k in counted})
        for p in model.parameters():
            p.grad = None
        records.append({**common, **extra, "phase": phase, "system": "ramtorch", **r})
        log(name, phase, "ramtorch", r["seconds"])

    def ab(phases: list[str], opts: dict[str, str]) -> None:
        """The offloaded phases again with the options ``opts`` (an A/B of the default)."""
        for phase in phases:
            model.train(phase != "forward")
            before, fn = phase_fns(model, x, offloaded=True)[phase]
            r = time_phase(before, fn, a.reps, a.warmup, dev, offloaded=True)
            for p in model.parameters():
                p.grad = None
            records.append({**common, **extra, "phase": phase, "system": "ramtorch", "options": opts, **r})
            log(name, f"{phase} ({', '.join(f'{k} {v}' for k, v in opts.items())})", "ramtorch", r["seconds"])

    import ramtorch._stream.parts as stream_parts
    import ramtorch._stream.rows as stream_rows

    grad_phases = [p for p in ("forward_backward", "forward_backward_accumulate") if p in a.phases]
    if a.head_grad_whole and grad_phases:
        # The head's weight gradient computed whole and sent once its node is done (the hook
        # every other weight gets), not by blocks as they are computed.
        by_blocks = stream_rows.ByRowsBackward
        stream_rows.ByRowsBackward = None  # the graph walk then hooks the node as any other
        ab(grad_phases, {**common.get("options", {}), "head_grad": "whole"})
        stream_rows.ByRowsBackward = by_blocks
    ab_phases = [p for p in ("forward", "forward_backward") if p in a.phases]
    if (a.whole_head or a.whole_units) and ab_phases:
        # The same forward (and forward+backward) with no Linear computed by blocks of rows
        # (--whole-head) and no unit computed by parts (--whole-units) as its copy lands.
        opts = dict(common.get("options", {}))
        if a.whole_head:
            stream_rows.by_rows = lambda *args, **kw: None
            opts["head"] = "whole"
        if a.whole_units:
            stream_parts.by_parts = lambda *args, **kw: None
            opts["units"] = "whole"
        ab(ab_phases, opts)
    return records


def greedy(model: nn.Module, ids: torch.Tensor, n: int) -> None:
    """Greedy ``generate()`` of exactly ``n`` new tokens after ``ids`` (no padding), no grad."""
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )


def decode_records(
    a: argparse.Namespace,
    model: nn.Module,
    name: str,
    common: dict[str, Any],
    extra: dict[str, Any],
    system: str,
) -> list[dict[str, Any]]:
    """Greedy ``generate()`` of the language models (other kinds: none), per batch size: one
    warm-up generate of ``--new`` tokens, then ``--reps`` × (a generate of 1 token, one of
    ``--new``); the record's ``seconds`` is a decode step, (median of the long ones − median of the
    short ones) / (new − 1), as ``bench/generate.py`` measures it. Default options: no
    ``weights_unchanged``, so the records carry no ``"options"``."""
    if ARCHS[name].kind != "lm" or a.new < 2:
        return []
    model.eval()
    dev, out = a.device, []
    vocab = model.config.vocab_size
    for b in a.batch:
        g = torch.Generator().manual_seed(1000 + b)
        ids = torch.randint(3, vocab, (b, a.prompt), generator=g).to(dev)

        def gen(n: int, ids: torch.Tensor = ids) -> None:
            greedy(model, ids, n)

        try:
            gen(a.new)
            short: list[float] = []
            long: list[float] = []
            for _ in range(a.reps):
                for n, into in ((1, short), (a.new, long)):
                    sync(dev)
                    t = time.perf_counter()
                    gen(n)
                    sync(dev)
                    into.append(time.perf_counter() - t)
            step = (statistics.median(long) - statistics.median(short)) / (a.new - 1)
            r: dict[str, Any] = {"seconds": step, "prefill_seconds": statistics.median(short)}
        except torch.OutOfMemoryError as e:
            r = {"seconds": None, "error": f"{system}: {str(e)[:200]}"}
        free_device()
        rec = {**common, **extra, "phase": "decode", "system": system, "batch": b, "prompt": a.prompt}
        out.append({**rec, "new_tokens": a.new, "tokens": b, **r})
        log(name, f"decode B={b}", system, r.get("seconds"))
    return out


def streamed_grad_bytes(model: nn.Module, device: str, streamed: int) -> int:
    """Bytes of the gradients that come back to host RAM in a backward: those of the trainable
    parameters in host RAM (on a CPU compute device every parameter is there: then at most the
    streamed bytes, which is exact when every streamed parameter trains or none of the frozen
    ones streams)."""
    host = [p for p in model.parameters() if p.requires_grad and p.device.type != torch.device(device).type]
    if torch.device(device).type == "cpu":
        host = [p for p in model.parameters() if p.requires_grad]
    return min(streamed, sum(p.numel() * p.element_size() for p in host))


def log(name: str, phase: str, system: str, seconds: float | None) -> None:
    s = "failed" if seconds is None else f"{seconds * 1e3:.1f} ms"
    print(f"# {name} {phase} {system}: {s}", file=sys.stderr, flush=True)


# -- the whole matrix ------------------------------------------------------------------------------


def ceilings(device: str) -> dict[str, float]:
    """Pinned H2D and D2H bandwidth in GB/s (2 GiB copies, best of 3); on the CPU, the speed of a
    host copy stands in for both (a smoke run's limits are not meaningful)."""
    if device.startswith("cuda"):
        from generate import link_bandwidth

        bw = link_bandwidth(device)
        assert bw is not None
        return bw
    a, b = torch.ones(1 << 26, dtype=torch.uint8), torch.zeros(1 << 26, dtype=torch.uint8)
    b.copy_(a)  # pages touched
    t = time.perf_counter()
    b.copy_(a)
    g = a.numel() / (time.perf_counter() - t) / 1e9
    return {"h2d_gbps": g, "d2h_gbps": g, "duplex_gbps": 2 * g}


def add_limits(records: list[dict[str, Any]], bw: dict[str, float]) -> None:
    """limit_seconds, limit_parts, ratio (limit / measured) and vs_resident of every record, in place."""

    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r["workload"], r["phase"], r.get("batch") if r["phase"] == "decode" else None)

    resident = {key(r): r.get("seconds") for r in records if r["system"] == "resident"}
    h2d, d2h = bw["h2d_gbps"] * 1e9, bw["d2h_gbps"] * 1e9
    duplex = bw.get("duplex_gbps", bw["h2d_gbps"] + bw["d2h_gbps"]) * 1e9
    for r in records:
        compute = resident.get(key(r))
        if r["system"] == "resident":
            link = 0.0
        elif r["phase"] in ("forward", "decode"):  # a decode step is one forward pass
            link = r["streamed_bytes_per_pass"] / h2d
        else:
            w, g = r["streamed_bytes_per_pass"], r["streamed_grad_bytes"]
            # forward: the weights in; backward: the weights in again while the gradients go out
            # (each direction at most its own ceiling, both together at most the duplex one)
            link = w / h2d + max(w / h2d, g / d2h, (w + g) / duplex)
        limit = max(link, compute or 0.0) if (compute or link) else None
        r["limit_seconds"] = limit
        r["limit_parts"] = {"link_seconds": link, "compute_seconds": compute}
        ok = limit is not None and r.get("seconds")
        r["ratio"] = r["limit_over_measured"] = limit / r["seconds"] if ok else None
        if r["system"] == "ramtorch" and compute and r.get("seconds"):
            r["vs_resident"] = compute / r["seconds"]
        fwd = resident.get((r["workload"], "forward", None))
        if r["system"] != "resident" and r["phase"].startswith("forward_backward") and compute and fwd and ok:
            # The passes run one after the other: the forward is at least its own link time or
            # compute, and the backward, before which no gradient exists, at least its gradients'
            # link time or its compute (the resident pass less the resident forward, which runs
            # without grad there: a little less than a forward that keeps activations).
            w, g = r["streamed_bytes_per_pass"], r["streamed_grad_bytes"]
            by_phase = max(w / h2d, fwd) + max(g / d2h, compute - fwd)
            r["phase_limit_seconds"] = max(limit, by_phase)
            r["phase_ratio"] = r["phase_limit_seconds"] / r["seconds"]


def command_line() -> str:
    """This run's command, the output file by its name only."""
    args = sys.argv[1:]
    return f"python3 bench/{os.path.basename(sys.argv[0])} " + " ".join(
        os.path.basename(x) if i and args[i - 1] == "--out" else x for i, x in enumerate(args)
    )


def git_commit() -> str:
    try:
        p = subprocess.run(
            ["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        return p.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def child_args(a: argparse.Namespace, name: str) -> list[str]:
    out = ["--child", name, "--tokens", str(a.tokens), "--reps", str(a.reps), "--warmup", str(a.warmup)]
    out += ["--phases", *a.phases, "--device", a.device]
    out += ["--batch", *map(str, a.batch), "--prompt", str(a.prompt), "--new", str(a.new)]
    if a.layers:
        out += ["--layers", str(a.layers)]
    if a.full_depth:
        out.append("--full-depth")
    if a.smoke:
        out.append("--smoke")
    if a.host_gather:
        out.append("--host-gather")
    if a.whole_head:
        out.append("--whole-head")
    if a.whole_units:
        out.append("--whole-units")
    if a.head_grad_whole:
        out.append("--head-grad-whole")
    if a.resident_layers:
        out += ["--resident-layers", *map(str, a.resident_layers)]
    return out


def run_child(a: argparse.Namespace, name: str) -> list[dict[str, Any]]:
    """One architecture in its own process (nothing of a model outlives it); its records."""
    cmd = [sys.executable, os.path.abspath(__file__), *child_args(a, name)]
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        stdout, err = p.stdout, p.stderr
        if p.returncode != 0:
            print(f"# {name} failed ({p.returncode}):\n{err[-3000:]}", file=sys.stderr, flush=True)
        else:
            sys.stderr.write(err)
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        print(f"# {name} timed out after {a.timeout:.0f} s:\n{err[-3000:]}", file=sys.stderr, flush=True)
    recs = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    print(f"# {name}: {len(recs)} records in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    return recs


def relimit(paths: list[str]) -> str:
    """The table of the records in ``paths``, their limits recomputed (:func:`add_limits`) from
    the ceilings each record carries, per file and device."""
    out: list[dict[str, Any]] = []
    for path in paths:
        with open(path) as fh:
            records = json.load(fh)
        groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
        for r in records:
            groups.setdefault((r.get("h2d_gbps"), r.get("d2h_gbps"), r.get("duplex_gbps")), []).append(r)
        for (h2d, d2h, duplex), got in groups.items():
            if h2d and d2h:
                add_limits(got, {"h2d_gbps": h2d, "d2h_gbps": d2h, "duplex_gbps": duplex or h2d + d2h})
            out += got
    return table(out)


def table(records: list[dict[str, Any]]) -> str:
    """The records as a markdown table."""

    def ms(v: float | None) -> str:
        return "" if v is None else f"{v * 1e3:.1f}"

    rows = [
        "| workload | phase | system | tokens | layers | params | measured ms | limit ms | link ms | "
        "compute ms | ratio | by pass ms | ratio by pass | GPU peak GiB |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in records:
        parts = r.get("limit_parts") or {}
        ratio, phase = r.get("ratio"), r.get("phase_ratio")
        workload = r["workload"]
        if "lora_rank" in r:
            workload += f" (LoRA r={r['lora_rank']}, {r['base']} base)"
        system = r["system"]
        if r.get("options"):  # an A/B beside the default
            system += " (" + ", ".join(f"{k} {v}" for k, v in r["options"].items()) + ")"
        rows.append(
            f"| {workload} | {r['phase']} | {system} | {r['tokens']} | {r['layers']} | "
            f"{r['params'] / 1e9:.2f}e9 | {ms(r.get('seconds'))} | {ms(r.get('limit_seconds'))} | "
            f"{ms(parts.get('link_seconds'))} | {ms(parts.get('compute_seconds'))} | "
            f"{'' if ratio is None else f'{ratio:.3f}'} | {ms(r.get('phase_limit_seconds'))} | "
            f"{'' if phase is None else f'{phase:.3f}'} | "
            f"{r.get('gpu_peak_bytes', 0) / 2**30:.2f} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", default=None, help="JSON list of the records (rewritten after each architecture)"
    )
    ap.add_argument("--arch", nargs="+", choices=list(ARCHS), default=list(ARCHS))
    ap.add_argument("--phases", nargs="+", choices=PHASES, default=list(DEFAULT_PHASES))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode: sequences per generate()")
    ap.add_argument("--prompt", type=int, default=128, help="decode: prompt tokens")
    ap.add_argument("--new", type=int, default=16, help="decode: new tokens per timed generate()")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per step (vision: 256 per image)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument(
        "--layers", type=int, default=None, help="blocks of every model (default: per architecture)"
    )
    ap.add_argument(
        "--resident-layers",
        type=int,
        nargs=2,
        default=None,
        metavar=("LO", "HI"),
        help="the resident records (the compute floor) extrapolated from resident models of LO and HI "
        "layers, for models whose resident passes do not fit (not the ResNet); records carry how",
    )
    ap.add_argument(
        "--full-depth",
        action="store_true",
        help="each model at its real depth (full_layers; not with --smoke)",
    )
    ap.add_argument(
        "--timeout", type=float, default=240, help="seconds allowed to one architecture's process"
    )
    ap.add_argument(
        "--host-gather",
        action="store_true",
        help="an A/B: embedding lookups without gradient gather rows on the host (the default reads "
        "the table in place on the GPU); records carry options",
    )
    ap.add_argument(
        "--whole-head",
        action="store_true",
        help="an A/B: the forward (and forward+backward) again with no Linear computed by blocks "
        "of rows as its copy lands (the default cuts the LM head); records carry options",
    )
    ap.add_argument(
        "--head-grad-whole",
        action="store_true",
        help="an A/B: forward+backward (and accumulating) again with the LM head's weight gradient "
        "sent whole once its backward is done (the default sends it by blocks of rows as they are "
        "computed, before the input's gradient); records carry options",
    )
    ap.add_argument(
        "--whole-units",
        action="store_true",
        help="an A/B: the forward (and forward+backward) again with no large unit of torch's "
        "layers computed by parts as its copy lands (the default cuts a ResNet's largest stage "
        "and a pass's last unit); records carry options",
    )
    ap.add_argument("--commit", default=None, help="default: git rev-parse --short HEAD, else unknown")
    ap.add_argument("--smoke", action="store_true", help="tiny configs on the CPU, 1 rep: checks the script")
    ap.add_argument("--device", default=None, help="compute device (default: cuda, or cpu with --smoke)")
    ap.add_argument(
        "--relimit",
        nargs="+",
        default=None,
        metavar="FILE",
        help="print the table of records already written (JSON lists of this script), their limits "
        "recomputed from the ceilings each record carries; runs nothing",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.smoke:
        a.device = a.device or "cpu"
        if "--tokens" not in sys.argv:
            a.tokens = 64
        if "--reps" not in sys.argv:
            a.reps = 1
    a.device = a.device or "cuda"
    if a.resident_layers and not 0 < a.resident_layers[0] < a.resident_layers[1]:
        ap.error("--resident-layers LO HI needs 0 < LO < HI")
    if a.child is not None:
        torch.manual_seed(0)
        for r in run_arch(a, a.child):
            print(json.dumps(r), flush=True)
        return
    if a.relimit:
        print(relimit(a.relimit))
        return
    if a.out is None:
        ap.error("--out is required")

    bw = ceilings(a.device)
    print(f"# link: {json.dumps(bw)}", file=sys.stderr, flush=True)
    meta = {
        **bw,
        "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device,
        "gpus": 1 if a.device.startswith("cuda") else 0,
        "commit": a.commit or git_commit(),
        "command": command_line(),
    }
    records: list[dict[str, Any]] = []
    for name in a.arch:
        got = run_child(a, name)
        add_limits(got, bw)
        records += [{**r, **meta} for r in got]
        with open(a.out, "w") as fh:
            json.dump(records, fh, indent=1)
    print(table(records))
    missing = [n for n in a.arch if not any(r["workload"] == f"arch:{n}" for r in records)]
    if missing:
        print(f"# no records for {missing}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
