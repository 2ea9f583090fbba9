"""W2 generation under a GPU budget: prefill and decode throughput of ``model.generate`` on a model
under ``ramtorch.offload``, next to its limits; prints one JSON record per line (BENCH.md format).

    python3 bench/generate.py [--budget 8GiB] [--gpu-cap 12GiB] [--batch 1 4 16 64] [--prompt 512]
        [--new 32] [--kv dynamic offloaded host] [--reps 2] [--check] [--no-resident] [--deadline SECONDS]
        [--modes default weights_unchanged]
    python3 bench/generate.py --tiny --device cpu --batch 1 4 --new 8 --prompt 16   # CPU smoke run

The model is W2 (``bench/w2.py``: ``LlamaForCausalLM``, 8.03e9 parameters, bf16, random weights
filled on the GPU), or with ``--tiny`` a small Llama (3 layers, hidden 128). Before the model moves
to host RAM, the same generations run on the resident model (system ``resident``, dynamic KV cache,
skipped with ``--no-resident``): its times are the compute floor. Then the model goes to host RAM,
the process's GPU memory is capped (``--gpu-cap``, ``torch.cuda.set_per_process_memory_fraction``)
and the model is offloaded: ``ramtorch.offload(model, gpu_budget=--budget, device=--device)``. With
``--tiny`` the default budget is half the weights (so that part of the model streams).

For each batch size B (``--batch``) and KV cache (``--kv``): ``dynamic`` is transformers' default
cache on the GPU, ``offloaded`` passes ``cache_implementation="offloaded"`` (the KV cache lives in
host RAM; each layer's keys and values come to the GPU one layer ahead and go back after use, so the
context is not bounded by GPU memory; it needs CUDA and is skipped on the CPU), ``host`` passes a
fresh ``ramtorch.HostCache()`` to each generate (pages in host RAM, copied to the GPU one layer
ahead; only the new tokens go back; runs on the CPU too). Records say where the cache lived
(``"kv_place"``: ``gpu``/``host``), the tokens it held at the end (``"context"``) and, with
``host``, the cache bytes that crossed in the last decode step (``"kv_bytes_per_step"``). The prompt is B
random sequences of ``--prompt`` tokens, no padding. Greedy generation::

    model.generate(ids, attention_mask=ones, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                   pad_token_id=0)

One warm-up generate of N tokens (every shape the timed ones see) per (B, cache, mode), then ``--reps``
times, interleaved: a generate of 1 new token and one of N = ``--new`` tokens (medians reported).

``--modes``: how ramtorch's generates run, each measured in turn for every (B, cache), in this
process on the same offloaded model. ``default`` is what a user gets (plain ``model.generate``; its
records carry no ``"options"``); ``weights_unchanged`` runs the same generates inside
``ramtorch.weights_unchanged(model)`` (records with ``"options": "weights_unchanged"``). Default:
``default`` only.

- prefill: the generate of 1 new token: time to first token, i.e. one forward over B × prompt
  tokens plus generate()'s own setup (cache, mask, argmax: small). A bare ``model(ids)`` would
  compute logits for every position (B × prompt × vocabulary: 8 GiB at B=64) where generate keeps
  the last one, and it would not build the offloaded cache: not the same work.
  Prefill tokens/s = B × prompt / seconds.
- decode: (median generate of N tokens − median generate of 1 token) / (N − 1) per step: the
  setup and the prefill cancel out. Decode tokens/s = B / step seconds.

Limits (``limit_seconds``, ``limit_over_measured``; 1.0 is perfect), with the pinned H2D and D2H
bandwidth measured in this process (2 GiB copies; not on the CPU, where limits are null unless
``--h2d-gbps`` is given):

- link: bytes the step must move / bandwidth. Weights: ``streamed_bytes_per_pass`` of
  ``ramtorch.stats()["models"]``, once per forward. With the offloaded cache the KV cache crosses
  too: prefill writes B × prompt tokens of it to the host (D2H); a decode step brings the whole
  cache up (H2D, on the link the weights use) and writes it back (D2H). Link time is
  max((weights + KV up) / H2D, KV down / D2H), with the mean context of the decode steps.
- compute: the resident model's time for the same step (measured, ``limit_compute_source``:
  ``resident``); without it, for prefill only, an estimate at ``--tflops`` (default 790e12 FLOP/s,
  ``estimate``): 2 × (parameters outside the embedding and the LM head) × B × prompt + 2 × LM-head
  parameters × B (generate computes logits at the last position only) + causal attention
  2 × B × prompt² × hidden × layers. Decode has no compute estimate (none is honest: it is
  launch-bound).
- limit = max(link, compute).

Each record: workload ``W2-generate``, phase ``prefill``/``decode``, system ``ramtorch``/``resident``,
batch, prompt, new_tokens, kv, tokens (prefill: B × prompt; decode: B per step), seconds,
tokens_per_second, the limits, GPU peak (``max_memory_allocated``, reset before each generate; max
over the generates of that phase), host RSS, budget, GPU cap, ramtorch's units (resident, streamed)
and bytes, the engine's H2D bytes per prefill/decode step, and whether the tokens equal the resident
model's (informational). A (B, cache) that runs out of GPU memory gives records with ``"error"`` and
the run goes on.

``--logits``: the resident model and then each (B, cache) also run prefill and N − 1 decode steps
teacher-forced with the resident model's greedy tokens (so both see the same inputs) and compare the
last-position logits: bitwise equality, largest difference against the logits' spread, greedy
picks that differ and the resident top-two margin where they do (``logits_vs_resident``).

``--check``: first generates with a tiny Llama (resident vs. offloaded copies, budgets "stream
everything" and half the weights, each KV cache available) and compares the tokens; the benchmark
still runs, and the exit status is 1 on a mismatch (also on an error other than out-of-memory).
``--deadline S``: no new (B, cache) starts after S seconds from the start.

Progress goes to stderr. The script assumes ``model.device`` of an offloaded model is the compute
device (generate() puts its inputs there).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from benchlib import budget_arg, gpu_allocated, gpu_peak, jsonable, parse_bytes, reset_peak, rss, sync
from torch import nn
from w2 import build, config, free_gpu, to_host

KV_MODES = ("dynamic", "offloaded", "host")
#: The HostCache of the latest generate with ``--kv host`` (its counters go into the records).
LAST_HOST_CACHE: list = []
MODES = ("default", "weights_unchanged")
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


# -- measured ceilings ---------------------------------------------------------------------------


def link_bandwidth(device: str) -> dict[str, float] | None:
    """Pinned host→device and device→host bandwidth in GB/s (2 GiB copies, best of 3 after a
    warm-up), as bench/run.py measures it, and ``duplex_gbps``: the total of both directions at
    once (the link is full duplex, but the two directions together move less than twice one);
    None off CUDA."""
    if not device.startswith("cuda"):
        return None
    out = _copy_speeds(device, 2 << 30)
    torch.cuda.empty_cache()
    getattr(torch._C, "_host_emptyCache", lambda: None)()  # give the pinned pages back
    return out


def _copy_speeds(device: str, n: int) -> dict[str, float]:
    h = torch.empty(n, dtype=torch.uint8).pin_memory()
    d = torch.empty(n, dtype=torch.uint8, device=device)

    def best(dst: torch.Tensor, src: torch.Tensor) -> float:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        return n / min(ts) / 1e9

    out = {"h2d_gbps": best(d, h), "d2h_gbps": best(h, d)}
    # both directions at once (as in a backward pass: weights in, gradients out), on two streams
    h2, d2 = torch.empty_like(h).pin_memory(), torch.empty_like(d)
    streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)]

    def duplex() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.cuda.stream(streams[0]):
            d.copy_(h, non_blocking=True)
        with torch.cuda.stream(streams[1]):
            h2.copy_(d2, non_blocking=True)
        torch.cuda.synchronize()
        return 2 * n / (time.perf_counter() - t) / 1e9

    duplex()
    out["duplex_gbps"] = max(duplex() for _ in range(3))
    return out


# -- model facts ----------------------------------------------------------------------------------


def kv_bytes_per_token(cfg: object) -> int:
    """Bytes of keys and values one token adds to the cache over all layers (bf16)."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2


def prefill_flops(model: nn.Module, cfg: object, batch: int, prompt: int) -> float:
    """Matrix-product FLOPs of generate's prefill (see the module docstring)."""
    embed = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    body = sum(p.numel() for p in model.parameters()) - embed - head
    attention = 2 * batch * prompt**2 * cfg.hidden_size * cfg.num_hidden_layers
    return 2 * body * batch * prompt + 2 * head * batch + attention


def model_stats(model: nn.Module) -> dict:
    """This model's entry of ``ramtorch.stats()["models"]`` (the only one once --check's models
    are gone; otherwise the model's own streamer)."""
    import ramtorch

    models = ramtorch.stats()["models"]
    if len(models) == 1:
        return jsonable(models[0])
    return jsonable(model._ramtorch_streamer.stats())


COUNTERS = ("h2d_bytes", "d2h_bytes", "reused_bytes", "stall_seconds")


def engine_counters() -> dict[str, float]:
    """ramtorch's device counters summed over devices (bytes copied, seconds stalled)."""
    import ramtorch

    devs = ramtorch.stats()["devices"].values()
    return {k: float(sum(d.get(k, 0) for d in devs)) for k in COUNTERS}


# -- generation -----------------------------------------------------------------------------------


def host_cache_kw(model: nn.Module) -> dict:
    """A fresh ``ramtorch.HostCache`` under the name this transformers' ``generate`` takes it by
    (``cache`` from 5.24, ``past_key_values`` before)."""
    import inspect

    import ramtorch

    cache = ramtorch.HostCache()
    LAST_HOST_CACHE[:] = [cache]
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def generate(model: nn.Module, ids: torch.Tensor, new: int, kv: str) -> torch.Tensor:
    kw = {"cache_implementation": "offloaded"} if kv == "offloaded" else {}
    if kv == "host":
        kw = host_cache_kw(model)
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        **kw,
    )


@dataclass
class Runs:
    """Timed generates of one length."""

    seconds: list[float] = field(default_factory=list)
    peak: int = 0
    peak_above_base: int = 0
    counters: list[dict[str, float]] = field(default_factory=list)
    tokens: torch.Tensor | None = None
    kv_bytes_per_step: list[int] = field(default_factory=list)  # --kv host: the last decode step's

    def median(self) -> float:
        return statistics.median(self.seconds)

    def mean_counter(self, key: str) -> float:
        return statistics.fmean(c[key] for c in self.counters) if self.counters else 0.0


def timed(model: nn.Module, ids: torch.Tensor, new: int, kv: str, device: str, runs: Runs, ram: bool) -> None:
    sync(device)
    reset_peak(device)
    base = gpu_allocated(device)
    before = engine_counters() if ram else {}
    t = time.perf_counter()
    out = generate(model, ids, new, kv)
    sync(device)
    runs.seconds.append(time.perf_counter() - t)
    runs.peak = max(runs.peak, gpu_peak(device))
    runs.peak_above_base = max(runs.peak_above_base, gpu_peak(device) - base)
    if ram:
        after = engine_counters()
        runs.counters.append({k: after[k] - before[k] for k in COUNTERS})
    runs.tokens = out
    if kv == "host":
        runs.kv_bytes_per_step.append(LAST_HOST_CACHE[0].kv_bytes_per_step)


def measure(
    model: nn.Module, ids: torch.Tensor, new: int, kv: str, reps: int, device: str, ram: bool
) -> tuple[Runs, Runs]:
    """One warm-up generate of ``new`` tokens (every decode shape of the timed ones seen once, so
    that the mode measured first pays no first-call costs the next one would not), then ``reps``
    × (generate 1 token, generate ``new`` tokens)."""
    generate(model, ids, new, kv)
    sync(device)
    first, full = Runs(), Runs()
    for _ in range(reps):
        timed(model, ids, 1, kv, device, first, ram)
        timed(model, ids, new, kv, device, full, ram)
    return first, full


def attempt(
    fn: Callable[..., tuple[Runs, Runs]], *args: object, **kw: object
) -> tuple[tuple[Runs, Runs] | None, str | None]:
    """``fn(*args, **kw)`` and no error, or None and the error: "out of memory" or the exception's repr (its
    traceback goes to stderr). The GPU memory a failed attempt held is given back once the
    exception, whose frames hold the activations, is gone."""
    try:
        return fn(*args, **kw), None
    except Exception as e:  # a benchmark records what it can
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
            error = "out of memory"
        else:
            traceback.print_exc()
            error = repr(e)
    free_gpu()
    return None, error


def prompt_ids(batch: int, prompt: int, vocab: int, device: str) -> torch.Tensor:
    """The same random prompt for a batch size in every system (seeded by the batch size)."""
    g = torch.Generator().manual_seed(1000 + batch)
    return torch.randint(3, vocab, (batch, prompt), generator=g).to(device)  # no bos/eos/pad ids


# -- records --------------------------------------------------------------------------------------


@dataclass
class Setting:
    """What every record of the run shares, and what the limits need."""

    args: argparse.Namespace
    cfg: object
    params: int
    weight_bytes: int
    bw: dict[str, float] | None
    common: dict
    flops: dict[int, float]  # prefill FLOPs per batch size
    streamed: int = 0  # weight bytes streamed per forward (0 for the resident model)


def limits(
    s: Setting, phase: str, kv: str, batch: int, seconds: float | None, compute: float | None, flops: float
) -> dict:
    a, per_tok = s.args, kv_bytes_per_token(s.cfg)
    up = down = 0
    if kv in ("offloaded", "host"):
        if phase == "prefill":
            down = batch * a.prompt * per_tok
        else:  # decode step k (1..N-1) brings up prompt+k-1 tokens, writes back prompt+k
            up = int(batch * (a.prompt + (a.new - 2) / 2) * per_tok)
            down = int(batch * (a.prompt + a.new / 2) * per_tok)
            if kv == "host":  # HostCache writes back the new token only
                down = batch * per_tok
    out: dict = {
        "limit_streamed_bytes": s.streamed,
        "limit_kv_h2d_bytes": up,
        "limit_kv_d2h_bytes": down,
        "compute_estimate_flops": flops if phase == "prefill" else None,
        "limit_compute_estimate_seconds": flops / a.tflops if phase == "prefill" else None,
    }
    link = None
    if s.bw is not None:
        link = max((s.streamed + up) / (s.bw["h2d_gbps"] * 1e9), down / (s.bw["d2h_gbps"] * 1e9))
    source = "resident" if compute is not None else None
    if compute is None and phase == "prefill":
        compute, source = out["limit_compute_estimate_seconds"], "estimate"
    limit = None if link is None else max(link, compute or 0.0)
    out.update(
        limit_link_seconds=link,
        limit_compute_seconds=compute,
        limit_compute_source=source,
        limit_seconds=limit,
        limit_over_measured=(limit / seconds) if (limit is not None and seconds) else None,
    )
    return out


def records(
    s: Setting,
    system: str,
    kv: str,
    batch: int,
    first: Runs | None,
    full: Runs | None,
    resident: dict | None,
    extra: dict,
) -> list[dict]:
    """The prefill and decode records of one (system, B, cache); ``first``/``full`` None: failed."""
    a = s.args
    steps = a.new - 1
    ok = first is not None and full is not None
    pre = first.median() if ok else None
    step = (full.median() - first.median()) / steps if ok else None
    flops = s.flops[batch]
    out = []
    for phase, sec, tokens in (("prefill", pre, batch * a.prompt), ("decode", step, batch)):
        floor = None
        if resident is not None and system != "resident":
            floor = resident[phase]
        r = {
            "workload": "W2-generate",
            "phase": phase,
            "system": system,
            "batch": batch,
            "prompt": a.prompt,
            "new_tokens": a.new,
            "kv": kv,
            "kv_place": "host" if kv in ("offloaded", "host") else "gpu",
            "context": a.prompt if phase == "prefill" else a.prompt + a.new - 1,  # at the end
            "tokens": tokens,
            "seconds": sec,
            "tokens_per_second": tokens / sec if sec else None,
            **s.common,
            **extra,
        }
        if ok:
            runs = first if phase == "prefill" else full
            if phase == "prefill":
                r["seconds_all"] = first.seconds
            else:
                r["seconds_all"] = [(n - o) / steps for n, o in zip(full.seconds, first.seconds)]
                r["generate_seconds"] = full.median()
                r["generate_seconds_all"] = full.seconds
            r["gpu_peak_bytes"] = runs.peak
            r["gpu_peak_above_base_bytes"] = runs.peak_above_base
            if runs.counters:  # ramtorch's engine: per prefill (1-token generate) / per decode step
                for k in COUNTERS:
                    v = first.mean_counter(k)
                    if phase == "decode":
                        v = (full.mean_counter(k) - v) / steps
                    r[f"engine_{k}"] = v
            if phase == "decode" and full.kv_bytes_per_step:
                r["kv_bytes_per_step"] = statistics.median(full.kv_bytes_per_step)
            if system == "ramtorch" and resident is not None and resident.get(phase):
                r["vs_resident"] = resident[phase] / sec if sec else None
        r["host_rss_bytes"] = rss()
        r["kv_cache_bytes"] = batch * (a.prompt + a.new) * kv_bytes_per_token(s.cfg)
        r.update(limits(s, phase, kv, batch, sec, floor if system != "resident" else sec, flops))
        if system == "resident":
            r["limit_compute_source"] = "resident"
        out.append(r)
    return out


def emit(recs: list[dict]) -> None:
    for r in recs:
        print(json.dumps(jsonable(r)), flush=True)


# -- greedy check -----------------------------------------------------------------------------


def check(device: str, kv_modes: list[str]) -> bool:
    """Greedy tokens of a tiny Llama: offloaded copies (stream everything, half the weights
    resident) against the resident model, for each KV cache. True when all are equal."""
    import ramtorch

    cfg = config(True, 64)
    cfg.initializer_range = 0.2  # a random model that does not repeat one token forever
    torch.manual_seed(0)
    ref = build(cfg, device)
    wbytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    ids = prompt_ids(3, 12, cfg.vocab_size, device)
    want = generate(ref, ids, 16, "dynamic")
    if len(set(want[0, 12:].tolist())) <= 1:
        log("check: the reference repeats one token; the comparison says little")
    ok = True
    for budget in (None, wbytes // 2):
        ours = copy.deepcopy(ref)
        to_host(ours)
        ramtorch.offload(ours, gpu_budget=budget, device=device)
        units = model_stats(ours)
        for kv in kv_modes:
            got = generate(ours, ids, 16, kv)
            same = torch.equal(got.cpu(), want.cpu())
            ok &= same
            log(
                f"check: budget={budget} ({len(units['resident_units'])} resident, "
                f"{units['streamed_units']} streamed units), kv={kv}: "
                + ("tokens equal" if same else f"MISMATCH\n  want {want.tolist()}\n  got  {got.tolist()}")
            )
        del ours
        gc.collect()
    del ref
    free_gpu()
    return ok


# -- logits, teacher-forced -----------------------------------------------------------------------


@torch.no_grad()
def forced_logits(model: nn.Module, ids: torch.Tensor, tokens: torch.Tensor, kv: str) -> torch.Tensor:
    """Last-position logits of the prefill of ``ids`` and of one decode step per column of
    ``tokens`` (fed in, whatever the model would pick), on a KV cache: [steps + 1, B, vocab] fp32 on
    the host. Two models given the same ``ids`` and ``tokens`` get exactly the same inputs."""
    from transformers import DynamicCache

    cache = DynamicCache()
    if kv == "host":
        import ramtorch

        cache = ramtorch.HostCache()
    if kv == "offloaded":  # what cache_implementation="offloaded" builds
        try:
            cache = DynamicCache(offloading=True)
        except TypeError:  # transformers 4.x
            from transformers.cache_utils import OffloadedCache

            cache = OffloadedCache()
    out = model(ids, past_key_values=cache, use_cache=True)
    rows = [out.logits[:, -1].float().cpu()]
    for k in range(tokens.shape[1]):
        out = model(tokens[:, k : k + 1], past_key_values=out.past_key_values, use_cache=True)
        rows.append(out.logits[:, -1].float().cpu())
    return torch.stack(rows)


def compare_logits(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """How far ``got`` is from ``ref`` ([steps, B, vocab]): bitwise equality, the largest
    difference against the logits' spread, the greedy picks that differ, and how close the
    resident model's top two logits were where they do (a near tie flips on rounding noise; a
    wrong weight would move logits by their whole spread)."""
    diff = (got - ref).abs()
    top2 = ref.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    flips = ref.argmax(-1) != got.argmax(-1)
    return {
        "bitwise_equal": bool(torch.equal(ref, got)),
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "logit_std": float(ref.std()),
        "max_abs_diff_per_step": [round(float(x), 5) for x in diff.amax(dim=(1, 2))],
        "greedy_flips": int(flips.sum()),
        "positions": int(flips.numel()),
        "max_margin_where_flipped": float(margin[flips].max()) if flips.any() else None,
        "median_margin": float(margin.median()),
    }


# -- main -----------------------------------------------------------------------------------------


def commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--budget", default=None, help="ramtorch gpu_budget (default 8GiB; --tiny: half the weights)"
    )
    ap.add_argument(
        "--gpu-cap", default="12GiB", help="cap on this process's GPU memory once the model is on the host"
    )
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64], help="batch sizes")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per sequence")
    ap.add_argument("--compress", default=None, help="offload(compress=...): lossless, fp8 (frozen model)")
    ap.add_argument("--new", type=int, default=32, help="new tokens per generate (N >= 2)")
    ap.add_argument("--kv", nargs="+", choices=KV_MODES, default=list(KV_MODES), help="KV caches")
    ap.add_argument("--reps", type=int, default=2, help="timed repetitions (median)")
    ap.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=["default"],
        help="ramtorch's generates: plain (default), and/or inside ramtorch.weights_unchanged(model)",
    )
    ap.add_argument(
        "--check", action="store_true", help="greedy tokens of a tiny offloaded Llama vs resident"
    )
    ap.add_argument("--no-resident", action="store_true", help="skip the resident model's generations")
    ap.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic kernels (torch.use_deterministic_algorithms, no reduced-precision bf16 "
        "reductions; set CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment): equal inputs give equal bits",
    )
    ap.add_argument(
        "--logits",
        action="store_true",
        help="also compare teacher-forced logits (prefill and --new decode steps) with the resident model's",
    )
    ap.add_argument(
        "--deadline", type=float, default=None, help="start no (B, cache) after this many seconds"
    )
    ap.add_argument("--tflops", type=float, default=790e12, help="FLOP/s of the prefill compute estimate")
    ap.add_argument("--commit", default=None, help="commit recorded (default: git's HEAD of this checkout)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a small Llama instead of W2")
    # Hidden: limits on a machine without CUDA (smoke runs of the limit arithmetic).
    ap.add_argument("--h2d-gbps", type=float, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.new < 2:
        ap.error("--new must be at least 2 (decode = N-token generate minus 1-token generate)")
    if a.reps < 1:
        ap.error("--reps must be at least 1")
    return a


def main() -> int:
    import ramtorch

    a = parse()
    if a.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    dev = a.device
    cuda = dev.startswith("cuda")
    kv_modes = list(dict.fromkeys(a.kv))
    if not cuda and "offloaded" in kv_modes:
        log("kv=offloaded skipped: transformers' offloaded KV cache needs a CUDA device (CUDA streams)")
        kv_modes.remove("offloaded")
    failed = False
    if a.check:
        log("greedy check (tiny Llama, resident vs offloaded)")
        failed |= not check(dev, kv_modes or ["dynamic"])

    bw = link_bandwidth(dev)
    if bw is None and a.h2d_gbps is not None:
        bw = {"h2d_gbps": a.h2d_gbps, "d2h_gbps": a.h2d_gbps}
    log(f"link: {bw}" if bw else "link: not measured (no CUDA): limits are null")

    t = time.perf_counter()
    cfg = config(a.tiny, a.prompt + a.new)
    model = build(cfg, dev)
    params = sum(p.numel() for p in model.parameters())
    wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    log(
        f"built {'tiny Llama' if a.tiny else 'W2'} on {dev}: {params / 1e9:.3f}e9 parameters, "
        f"{wbytes / 2**30:.2f} GiB"
    )
    budget = budget_arg(a.budget) if a.budget is not None else (wbytes // 2 if a.tiny else "8GiB")
    common = {
        "tiny": a.tiny,
        "reps": a.reps,
        "params": params,
        "weight_bytes": wbytes,
        "device": torch.cuda.get_device_name() if cuda else dev,
        "gpus": 1 if cuda else 0,
        "commit": a.commit or commit(),
        "command": "python3 bench/generate.py " + " ".join(sys.argv[1:]),
        **(bw or {}),
    }
    flops = {b: prefill_flops(model, cfg, b, a.prompt) for b in a.batch}
    s = Setting(a, cfg, params, wbytes, bw, common, flops)

    def expired() -> bool:
        if a.deadline is not None and time.perf_counter() - T0 > a.deadline:
            log(f"deadline of {a.deadline:.0f} s reached: the remaining measurements are skipped")
            return True
        return False

    # The resident model: compute floor and reference tokens (dynamic cache).
    floor: dict[int, dict] = {}
    ref_tokens: dict[int, torch.Tensor] = {}
    ref_logits: dict[int, torch.Tensor] = {}
    if not a.no_resident:
        for b in a.batch:
            if expired():
                break
            ids = prompt_ids(b, a.prompt, cfg.vocab_size, dev)
            log(f"resident B={b}: generate 1 and {a.new} tokens x {a.reps}")
            done, error = attempt(measure, model, ids, a.new, "dynamic", a.reps, dev, ram=False)
            if done is None:
                log(f"resident B={b}: {error}")
                emit(records(s, "resident", "dynamic", b, None, None, None, {"error": error}))
                failed |= error != "out of memory"
                continue
            first, full = done
            recs = records(s, "resident", "dynamic", b, first, full, None, {})
            floor[b] = {r["phase"]: r["seconds"] for r in recs}
            ref_tokens[b] = full.tokens.cpu()
            if a.logits:
                ref_logits[b] = forced_logits(model, ids, full.tokens[:, a.prompt :], "dynamic")
            emit(recs)
            log(
                f"resident B={b}: prefill {floor[b]['prefill'] * 1e3:.1f} ms, "
                f"decode {floor[b]['decode'] * 1e3:.2f} ms/step"
            )

    to_host(model)
    extra: dict = {"gpu_budget": budget, "gpu_budget_bytes": parse_bytes(budget)}
    cap = parse_bytes(a.gpu_cap)
    if cap is not None and cuda:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
        extra["gpu_cap_bytes"] = cap
    if a.compress is not None:
        model.requires_grad_(False)  # compressed units are frozen ones
        model = ramtorch.offload(model, gpu_budget=budget, device=dev, compress=a.compress)
    else:
        model = ramtorch.offload(model, gpu_budget=budget, device=dev)
    free_gpu()
    st = model_stats(model)
    s.streamed = st["streamed_bytes_per_pass"]
    raw_streamed = s.streamed
    if a.compress is not None:
        # The limits count the encoded bytes that cross; the gain is over the raw bytes' limit.
        s.streamed = st["link_bytes_per_pass"]
        extra.update(
            options={"compress": a.compress},
            compress=a.compress,
            link_bytes_per_pass=s.streamed,
            compressed_ratio=s.streamed / max(raw_streamed, 1),
        )
    extra.update(
        setup_seconds=time.perf_counter() - t,  # build, resident runs, copy to host, offload
        units=st["units"],
        resident_units=st["resident_units"],
        resident_unit_count=len(st["resident_units"]),
        streamed_units=st["streamed_units"],
        streamed_bytes_per_pass=st["streamed_bytes_per_pass"],
        ramtorch_gpu_bytes=st["gpu_bytes"],
        ramtorch_resident_bytes=st["resident_bytes"],
        slot_count=st["slot_count"],
        slot_bytes=st["slot_bytes"],
    )
    log(
        f"offloaded (budget {budget}): {len(st['resident_units'])} resident, "
        f"{st['streamed_units']} streamed units, {st['streamed_bytes_per_pass'] / 2**30:.2f} GiB "
        f"streamed per pass, {st['gpu_bytes'] / 2**30:.2f} GiB on the device"
    )

    if not kv_modes:
        log("no KV cache left to measure with ramtorch")
    modes = list(dict.fromkeys(a.modes))
    for b, kv, mode in [(b, kv, mode) for b in a.batch for kv in kv_modes for mode in modes]:
        if expired():
            break
        ids = prompt_ids(b, a.prompt, cfg.vocab_size, dev)
        log(f"ramtorch B={b} kv={kv} ({mode}): generate 1 and {a.new} tokens x {a.reps}")
        more = dict(extra)
        promise: contextlib.AbstractContextManager = contextlib.nullcontext()
        if mode == "weights_unchanged":
            more["options"] = "weights_unchanged"  # a default record names no option (BENCH.md)
            promise = ramtorch.weights_unchanged(model)
        with promise:
            done, error = attempt(measure, model, ids, a.new, kv, a.reps, dev, ram=True)
        if done is None:
            if error == "out of memory":  # expected at large B with the cache on the GPU
                kv_gib = b * (a.prompt + a.new) * kv_bytes_per_token(cfg) / 2**30
                log(f"ramtorch B={b} kv={kv}: out of GPU memory (KV cache {kv_gib:.2f} GiB)")
            else:
                log(f"ramtorch B={b} kv={kv}: {error}")
                failed = True
            emit(records(s, "ramtorch", kv, b, None, None, floor.get(b), {**more, "error": error}))
            continue
        first, full = done
        if b in ref_tokens:
            more["tokens_match_resident"] = torch.equal(full.tokens.cpu(), ref_tokens[b])
        if b in ref_logits:
            forced = ref_tokens[b][:, a.prompt :].to(dev)
            cmp = compare_logits(ref_logits[b], forced_logits(model, ids, forced, kv))
            more["logits_vs_resident"] = cmp
            log(f"ramtorch B={b} kv={kv}: teacher-forced logits vs resident: {json.dumps(cmp)}")
        recs = records(s, "ramtorch", kv, b, first, full, floor.get(b), more)
        if a.compress is not None and bw is not None:
            for r in recs:
                link_raw = raw_streamed / (bw["h2d_gbps"] * 1e9)
                comp = r.get("limit_compute_seconds") or 0.0
                r["bf16_floor_seconds"] = max(link_raw, comp)
                r["speedup_vs_bf16_floor"] = r["bf16_floor_seconds"] / r["seconds"] if r["seconds"] else None
        emit(recs)
        pre, dec = recs
        log(
            f"ramtorch B={b} kv={kv} ({mode}): prefill {pre['seconds'] * 1e3:.1f} ms "
            f"({pre['tokens_per_second']:.0f} tok/s), "
            f"decode {dec['seconds'] * 1e3:.1f} ms/step ({dec['tokens_per_second']:.1f} tok/s), "
            f"limit/measured {fmt(pre['limit_over_measured'])} / {fmt(dec['limit_over_measured'])}"
            + (
                ""
                if "tokens_match_resident" not in more
                else f", tokens = resident: {more['tokens_match_resident']}"
            )
        )
    log("done" + (" (with failures)" if failed else ""))
    return 1 if failed else 0


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


if __name__ == "__main__":
    sys.exit(main())
