"""Long-context decode with the KV cache in host RAM: ``ramtorch.HostCache`` against transformers'
offloaded caches, on W2 (Llama, 8.03e9 parameters) under a GPU budget; prints one JSON record per
line (BENCH.md format).

    python3 bench/long_context.py [--shapes 1x262144 8x32768] [--budget 24GiB] [--steps 6]
        [--warmup 2] [--kv host host_plain offloaded offloaded_static] [--page-tokens 256]
        [--no-resident] [--deadline SECONDS] [--commit C]
    python3 bench/long_context.py --tiny --device cpu --shapes 1x512 2x128   # CPU smoke run

Each shape ``BxC`` is B sequences whose cache holds C tokens each at the last step (filled with
C − warmup − steps tokens before the first step). The cache is filled with random keys and
values (the same bits for every cache: a generator seeded per layer), not by a prefill: what is
measured is the decode step, and a 256k-token prefill would cost minutes of compute that no cache
changes. ``HostCache`` is filled the way a chunked prefill fills it (``--fill-chunk`` tokens of
every layer per pass, layers in order), so that its device pages are shared among the layers as
they are after ``ramtorch.prefill``; transformers' caches in one pass (each pass of theirs moves the
whole cache both ways). Run transformers' caches in a process of their own (``--kv offloaded``):
they allocate page-locked host memory through torch's caching host allocator, which keeps what it
freed.

Then ``--warmup`` + ``--steps`` decode steps, each ``model(ids[:, s:s+1], cache=cache,
use_cache=True)`` with the same token ids for every cache (random, teacher-forced: every cache sees
the same inputs); the median step time of the timed ones is reported.

Systems, in this order:

- ``resident`` (skipped with ``--no-resident``): the model and a ``DynamicCache`` on the GPU, no
  budget. Its step time is the compute floor and its last-position logits the reference.
- Then the model moves to host RAM and ``ramtorch.offload(model, gpu_budget=--budget)``; with each
  ``--kv``:
  - ``host``: ``ramtorch.HostCache.for_model(model, context=C, batch=B)`` (the device
    bytes the budget leaves hold copies of the cache's first pages; ``kv_bytes_per_step`` counts
    what still crosses);
  - ``host_plain``: ``ramtorch.HostCache()`` (no device pages: the whole cache crosses each step;
    ``"options": "device_bytes=0"``);
  - ``offloaded``: transformers' ``DynamicCache(offloading=True)`` (what
    ``cache_implementation="offloaded"`` makes: each layer's cache comes up a layer ahead and goes
    back after use), CUDA only, transformers 5.20 or later;
  - ``offloaded_static``: ``StaticCache(config, max_cache_len=C, offloading=True)``, same.

Limit of a step (``limit_seconds``), from the pinned H2D/D2H bandwidth measured in this process
(2 GiB copies) and the bytes the step must move: up = weights streamed per pass (ramtorch's
``streamed_bytes_per_pass``) + cache bytes brought up; down = cache bytes written back.
``HostCache`` moves up what its device pages do not hold and down the new token (its own
counters); the transformers caches move the whole cache both ways. Link time =
max(up / H2D, down / D2H, (up + down) / duplex); limit = max(link time, the resident step when it
was measured). ``"ratio_to_limit"`` = limit / measured (1.0 is perfect). The bytes that must cross
are what the budget cannot hold, so ``"floor_seconds"`` is also given: (weights + cache − budget
left for them) / H2D, the best any cache could do under this budget.

Each record: workload ``W2-long-context``, phase ``decode``, system, ``kv`` (the cache),
``kv_place`` (``gpu``/``host``), ``batch``, ``context`` (tokens held at the last step),
``kv_bytes_per_step`` (cache bytes over the link, both directions, in one step), seconds,
tokens_per_second, the limits, GPU peak (``max_memory_allocated`` during the timed steps) and the
ramtorch budget, host RSS, and the logits against the resident model's
(``logits_vs_resident``: bitwise, largest difference, greedy picks that differ). A cache that runs
out of memory gives a record with ``"error"`` and the run goes on.

Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from benchlib import budget_arg, git_commit, gpu_peak, jsonable, parse_bytes, reset_peak, rss, sync
from generate import compare_logits, link_bandwidth
from torch import nn
from w2 import build, config, free_gpu, to_host

KV = ("host", "host_plain", "offloaded", "offloaded_static")
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def shape_arg(text: str) -> tuple[int, int]:
    try:
        b, c = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is BxC (sequences x tokens), got {text!r}") from None
    if b < 1 or c < 1:
        raise argparse.ArgumentTypeError(f"a shape needs B >= 1 and C >= 1, got {text!r}")
    return b, c


def kv_dims(cfg: Any) -> tuple[int, int, int]:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim


def cache_bytes(cfg: Any, batch: int, tokens: int) -> int:
    """Bytes of ``tokens`` tokens' keys and values in every layer, bf16 (as ramtorch sizes them)."""
    from ramtorch import _kv_sizes

    return _kv_sizes.bytes_per_token(cfg, torch.bfloat16, batch) * tokens


def fill(cache: Any, cfg: Any, batch: int, context: int, chunk: int, device: str) -> None:
    """``context`` tokens of random keys and values into every layer of ``cache``, ``chunk`` tokens
    of each layer per pass (layers in order, as a chunked prefill fills it). The bits depend only
    on (layer, position), not on ``chunk``: every cache gets the same."""
    layers, heads, dim = kv_dims(cfg)
    for start in range(0, context, chunk):
        n = min(chunk, context - start)
        for layer in range(layers):
            g = torch.Generator(device=device)
            g.manual_seed(1_000_003 * layer)
            # the layer's whole sequence, sliced: the bits do not depend on the chunks
            kv = torch.randn(
                (2, batch, heads, context, dim), generator=g, device=device, dtype=torch.bfloat16
            )
            extra = {"cache_position": torch.arange(start, start + n, device=device)}
            cache.update(kv[0, :, :, start : start + n], kv[1, :, :, start : start + n], layer, extra)
            del kv
    sync(device)


def decode(
    model: nn.Module,
    cache: Any,
    ids: torch.Tensor,
    warmup: int,
    device: str,
    after_warmup: Callable[[], None],
) -> tuple[list[float], torch.Tensor, int]:
    """Decode steps over ``ids`` ([B, warmup + steps]): the timed steps' seconds, every step's
    last-position logits (float32, on the CPU) and the GPU peak of the timed steps."""
    from ramtorch._kv_cache import _cache_kwarg

    name = _cache_kwarg(model)
    seconds, logits = [], []
    for s in range(ids.shape[1]):
        if s == warmup:
            sync(device)
            reset_peak(device)
            after_warmup()
        sync(device)
        t = time.perf_counter()
        with torch.no_grad():
            out = model(ids[:, s : s + 1], **{name: cache}, use_cache=True)
        sync(device)
        if s >= warmup:
            seconds.append(time.perf_counter() - t)
        logits.append(out.logits[:, -1].float().cpu())
        del out
    return seconds, torch.stack(logits), gpu_peak(device)


def make_cache(
    kind: str, model: nn.Module, cfg: Any, batch: int, tokens: int, page_tokens: int | None
) -> Any:
    import ramtorch
    from transformers import DynamicCache, StaticCache

    if kind == "host":
        kw = {} if page_tokens is None else {"page_tokens": page_tokens}
        return ramtorch.HostCache.for_model(model, context=tokens, batch=batch, **kw)
    if kind == "host_plain":
        return ramtorch.HostCache() if page_tokens is None else ramtorch.HostCache(page_tokens=page_tokens)
    if kind == "offloaded":
        return DynamicCache(config=cfg, offloading=True)
    if kind == "offloaded_static":
        return StaticCache(config=cfg, max_cache_len=tokens, offloading=True)
    if kind == "dynamic":
        return DynamicCache(config=cfg)
    raise ValueError(kind)


def streamed_bytes(model: nn.Module) -> int:
    streamer = getattr(model, "_ramtorch_streamer", None)
    if streamer is None:
        return 0
    return int(streamer.stats().get("streamed_bytes_per_pass", 0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", type=shape_arg, default=[(1, 262144), (8, 32768)])
    ap.add_argument("--budget", type=budget_arg, default="24GiB")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--kv", nargs="+", choices=KV, default=list(KV))
    ap.add_argument("--page-tokens", type=int, default=None, help="HostCache pages (default: its own)")
    ap.add_argument("--fill-chunk", type=int, default=32768, help="tokens per layer per fill pass")
    ap.add_argument("--no-resident", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--deadline", type=float, default=None, help="no new (shape, cache) after S seconds")
    ap.add_argument("--commit", default=None)
    a = ap.parse_args()
    if a.steps < 1 or a.warmup < 0 or a.fill_chunk < 1:
        ap.error("--steps must be at least 1, --warmup at least 0, --fill-chunk at least 1")
    cuda = a.device.startswith("cuda")
    if not cuda:
        a.kv = [k for k in a.kv if not k.startswith("offloaded")]  # transformers offloads to CUDA only
    import ramtorch
    import transformers

    commit = a.commit or git_commit()
    command = "python3 bench/long_context.py " + " ".join(sys.argv[1:])
    most = max(c for _, c in a.shapes)
    if min(c for _, c in a.shapes) <= a.warmup + a.steps:
        ap.error("each shape's context must exceed --warmup + --steps")
    cfg = config(a.tiny, most)
    base = {
        "workload": "W2-long-context" if not a.tiny else "W2-long-context-tiny",
        "phase": "decode",
        "commit": commit,
        "command": command,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "gpus": 1 if cuda else 0,
        "transformers": transformers.__version__,
        "layers": cfg.num_hidden_layers,
    }
    bw = link_bandwidth(a.device)
    if bw:
        base.update(bw)
        log(f"link: {bw}")
    torch.manual_seed(0)
    log("building the model")
    model = build(cfg, a.device)
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    base["params"] = params

    steps = a.warmup + a.steps
    ids = {
        (b, c): torch.randint(
            0, cfg.vocab_size, (b, steps), generator=torch.Generator().manual_seed(b * 7 + c)
        )
        for b, c in a.shapes
    }
    reference: dict[tuple[int, int], torch.Tensor] = {}
    floor: dict[tuple[int, int], float] = {}
    records: list[dict] = []

    def emit(rec: dict) -> None:
        rec = jsonable({**base, **rec})
        records.append(rec)
        print(json.dumps(rec), flush=True)

    def expired() -> bool:
        return a.deadline is not None and time.perf_counter() - T0 > a.deadline

    def run(system: str, kind: str, b: int, c: int, extra: dict) -> None:
        name = f"{system}/{kind} B={b} C={c}"
        if expired():
            log(f"{name}: skipped (deadline)")
            return
        log(f"{name}: filling")
        cache = None
        try:
            cache = make_cache(kind, model, cfg, b, c, a.page_tokens)
            t = time.perf_counter()
            host = kind.startswith("host")
            filled = c - steps
            fill(cache, cfg, b, filled, min(a.fill_chunk, filled) if host else filled, a.device)
            fill_s = time.perf_counter() - t
            marks: dict[str, int] = {}
            counters = cache.stats if host else None

            def mark() -> None:
                if counters is not None:
                    st = counters()
                    marks.update(h2d=st["h2d_bytes"], d2h=st["d2h_bytes"])

            log(f"{name}: filled in {fill_s:.1f} s; decoding")
            secs, logits, peak = decode(model, cache, ids[(b, c)].to(a.device), a.warmup, a.device, mark)
            step = statistics.median(secs)
            full = cache_bytes(cfg, b, c - a.steps // 2)  # the cache at a middle timed step
            if host:
                st = cache.stats()
                up_kv = (st["h2d_bytes"] - marks["h2d"]) / a.steps
                down_kv = (st["d2h_bytes"] - marks["d2h"]) / a.steps
            elif kind == "dynamic":
                up_kv = down_kv = 0.0
            else:
                up_kv, down_kv = float(full), float(full)
            weights_up = streamed_bytes(model) if system == "ramtorch" else 0
            up = weights_up + up_kv
            rec: dict[str, Any] = {
                "system": system,
                "kv": kind,
                "kv_place": "gpu" if kind == "dynamic" else "host",
                "batch": b,
                "context": c,
                "steps": a.steps,
                "seconds": step,
                "seconds_all": secs,
                "tokens_per_second": b / step,
                "kv_bytes_per_step": up_kv + down_kv,
                "kv_up_bytes_per_step": up_kv,
                "kv_down_bytes_per_step": down_kv,
                "kv_cache_bytes": full,
                "weights_up_bytes_per_step": weights_up,
                "fill_seconds": fill_s,
                "gpu_peak_bytes": peak,
                "host_rss_bytes": rss(),
                **extra,
            }
            if kind == "host_plain":
                rec["options"] = "device_bytes=0"
            if host:
                rec["host_cache"] = cache.stats()
                rec["device_bytes"] = cache.device_bytes
                rec["page_tokens"] = cache.page_tokens
            if bw and system != "resident":
                link = max(up / (bw["h2d_gbps"] * 1e9), down_kv / (bw["d2h_gbps"] * 1e9))
                link = max(link, (up + down_kv) / (bw["duplex_gbps"] * 1e9))
                limit = max(link, floor.get((b, c), 0.0))
                rec.update(link_seconds=link, limit_seconds=limit, ratio_to_limit=limit / step)
                rec["limit_compute_source"] = "resident" if (b, c) in floor else None
                if system == "ramtorch":
                    budget = parse_bytes(a.budget) or 0
                    must = max(0, weight_bytes + cache_bytes(cfg, b, c - a.steps // 2) - budget)
                    rec["floor_seconds"] = must / (bw["h2d_gbps"] * 1e9)
            if (b, c) in reference:
                rec["logits_vs_resident"] = compare_logits(reference[(b, c)], logits)
            elif system == "resident":
                reference[(b, c)] = logits
                floor[(b, c)] = step
            emit(rec)
            ratio = rec.get("ratio_to_limit")
            log(f"{name}: {step * 1e3:.1f} ms a step" + (f", {ratio:.3f} of the limit" if ratio else ""))
        except torch.OutOfMemoryError as e:
            emit(
                {"system": system, "kv": kind, "batch": b, "context": c, "error": f"out of memory: {e}"[:400]}
            )
            log(f"{name}: out of memory")
        except Exception as e:  # noqa: BLE001 - a failing cache is a record, the run goes on
            traceback.print_exc()
            emit({"system": system, "kv": kind, "batch": b, "context": c, "error": repr(e)[:400]})
        finally:
            del cache
            gc.collect()
            free_gpu()
            getattr(torch._C, "_host_emptyCache", lambda: None)()

    if not a.no_resident:
        for b, c in a.shapes:
            run("resident", "dynamic", b, c, {})
    log("moving the model to host RAM and offloading it")
    to_host(model)
    ramtorch.offload(model, gpu_budget=a.budget, device=a.device)
    mstats = model._ramtorch_streamer.stats()
    extra = {
        "budget": a.budget,
        "streamed_bytes_per_pass": mstats.get("streamed_bytes_per_pass"),
        "resident_bytes": mstats.get("resident_bytes"),
    }
    log(f"offloaded: {extra}")
    for b, c in a.shapes:
        for kind in a.kv:
            run("ramtorch", kind, b, c, extra)
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
