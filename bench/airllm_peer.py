"""W2 forward pass on the peer AirLLM (pip ``airllm``, 4.0.0), which runs a model layer by layer
from disk; prints one JSON record on stdout (logs, AirLLM's prints included, go to stderr).

The model is W2 of ``w2.py`` (``transformers.LlamaForCausalLM``, bf16, random weights, hidden 4096,
32 layers, 8.03e9 parameters, 15.0 GiB): built on ``--device`` by ``w2.build``, moved to host RAM
and written with ``save_pretrained`` (safetensors, 5 GB shards as published Llama checkpoints are)
under ``--disk``, with a placeholder tokenizer (AirLLM loads one at construction; the pass only
takes token ids). The model is then freed and opened with ``airllm.AutoModel.from_pretrained``
with AirLLM's defaults: no compression, prefetching on. AutoModel picks the generic
``AirLLMBaseModel`` for ``LlamaForCausalLM``: it splits the checkpoint into one safetensors file
per module (embedding, each decoder layer, final norm, LM head; a second full copy on disk), builds
the transformers model on the meta device (sdpa attention, transformers' own forward), and hooks
every module to read its file into RAM (``safetensors.torch.load_file``, pinned when the device is
CUDA), copy it to the device before the module runs and drop it to ``meta`` after; the next
module's file is read on a worker thread meanwhile. After every module AirLLM also runs its
``clean_memory`` (``gc.collect()``, ``malloc_trim``, ``torch.cuda.empty_cache()``); the record
keeps the seconds each timed pass spent there (a timer around it, nothing else changed).

Timed: forward only (``torch.no_grad()``, ``use_cache=False``), one sequence of ``--seq`` tokens,
batch 1, each pass between device synchronizes. Before every pass, warm-up ones included, the page
cache of every file AirLLM or the checkpoint wrote is dropped (``posix_fadvise(DONTNEED)``), so
each pass reads its weights from the disk, as AirLLM's own runs on a model larger than RAM do; the
record keeps how much of those files was still cached after each drop (``mincore``). The logits of
the last pass are compared with those of the model built in memory on ``--device`` (same ids).
Everything is written in a fresh directory under ``--disk`` that is removed at the end, on error too.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import inspect
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from w2 import build, config

AIRLLM_WHEEL = "airllm-4.0.0-py3-none-any.whl"
SHARD_SIZE = "5GB"  # save_pretrained's max_shard_size (transformers 4's default; 5's is 50GB)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def files_under(dirs: list[Path]) -> list[Path]:
    """Every regular file under ``dirs`` (links not followed), sorted."""
    out: list[Path] = []
    for d in dirs:
        for root, _, names in os.walk(d):
            out += [p for p in (Path(root) / n for n in names) if p.is_file() and not p.is_symlink()]
    return sorted(out)


def drop_page_cache(paths: list[Path]) -> None:
    """Asks the kernel to evict these files' pages from the page cache."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    ptr, size, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    libc.mmap.restype = ptr
    libc.mmap.argtypes = [ptr, size, i, i, i, ctypes.c_long]
    libc.munmap.argtypes = [ptr, size]
    libc.mincore.argtypes = [ptr, size, ctypes.POINTER(ctypes.c_ubyte)]
    return libc


def cached_bytes(paths: list[Path]) -> int | None:
    """Bytes of these files in the page cache (``mincore`` on a read-only mapping); None where the
    platform does not tell."""
    try:
        libc = _libc()
        page = os.sysconf("SC_PAGE_SIZE")
        total = 0
        for p in paths:
            size = p.stat().st_size
            if size == 0:
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
                if addr is None or addr == ctypes.c_void_p(-1).value:
                    return None
                try:
                    npages = (size + page - 1) // page
                    vec = (ctypes.c_ubyte * npages)()
                    if libc.mincore(addr, size, vec) != 0:
                        return None
                    resident = int(torch.frombuffer(vec, dtype=torch.uint8).bitwise_and(1).sum())
                    total += min(resident * page, size)
                finally:
                    libc.munmap(addr, size)
            finally:
                os.close(fd)
        return total
    except (OSError, AttributeError):
        return None


def save_checkpoint(model: nn.Module, hf: Path) -> None:
    """``save_pretrained`` in safetensors, plus a placeholder tokenizer (AirLLM's constructor
    loads the directory's tokenizer; the benchmark feeds token ids and never uses it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    kw: dict = {"max_shard_size": SHARD_SIZE}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kw["safe_serialization"] = True  # transformers 4 (5 writes only safetensors)
    model.save_pretrained(hf, **kw)
    if not list(hf.glob("*.safetensors")):
        raise RuntimeError(f"save_pretrained wrote no safetensors file under {hf}")
    tok = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(hf)


def import_airllm():  # noqa: ANN201 - the module
    try:
        import airllm
    except ImportError as e:
        raise SystemExit(
            f"airllm_peer: cannot import airllm ({e}); install {AIRLLM_WHEEL} with --no-deps "
            "(it needs tqdm, torch, transformers, accelerate, safetensors, huggingface-hub)"
        ) from e
    return airllm


def airllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("airllm")
    except PackageNotFoundError:
        return "unknown"


def time_clean_memory(airllm: object) -> list[float]:
    """Wraps ``airllm.airllm_base.clean_memory`` (``gc.collect()``, ``malloc_trim(0)``,
    ``torch.cuda.empty_cache()``, which AirLLM calls after every module) in a timer, unchanged
    otherwise; returns the one-element list the seconds add up in."""
    base = sys.modules[airllm.AirLLMBaseModel.__module__]
    inner = base.clean_memory
    spent = [0.0]

    def timed() -> None:
        t = time.perf_counter()
        inner()
        spent[0] += time.perf_counter() - t

    base.clean_memory = timed
    return spent


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """AirLLM prints progress on stdout; the record must be the only thing there."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--disk", required=True, help="directory to write the checkpoint and AirLLM's split in")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--commit", default="unknown", help="stored in the record")
    # Hidden: a tiny Llama, to check the script on the CPU.
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    dev = a.device
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("airllm_peer: --device cuda but torch sees no CUDA device (use --tiny --device cpu)")

    if not os.path.isdir(a.disk):
        raise SystemExit(f"airllm_peer: --disk {a.disk} is not a directory")
    with stdout_to_stderr():
        airllm = import_airllm()
        work = Path(tempfile.mkdtemp(prefix="airllm_peer-", dir=a.disk))
        try:
            rec = run(a, airllm, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            print(f"airllm_peer: removed {work}", file=sys.stderr)
    print(json.dumps(rec), flush=True)


def run(a: argparse.Namespace, airllm: object, work: Path) -> dict:
    dev = a.device
    cfg = config(a.tiny, a.seq)
    hf = work / "hf"
    shards_root = work / "shards"

    t0 = time.perf_counter()
    model = build(cfg, dev)
    wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    nparams = sum(p.numel() for p in model.parameters())
    free = shutil.disk_usage(work).free
    if free < 2 * wbytes + 2**30:
        raise SystemExit(
            f"airllm_peer: {free / 2**30:.1f} GiB free under {a.disk}; the checkpoint and AirLLM's split "
            f"need {2 * wbytes / 2**30:.1f} GiB (+1 GiB)"
        )
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, a.seq), generator=gen).to(dev)
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits.float().cpu()
    build_seconds = time.perf_counter() - t0

    t0 = time.perf_counter()
    model.to("cpu")
    free_device()
    save_checkpoint(model, hf)
    del model
    free_device()
    save_seconds = time.perf_counter() - t0

    t0 = time.perf_counter()
    options = {
        "compression": None,
        "prefetching": True,
        "dtype": "bfloat16",
        "profiling_mode": False,
        "delete_original": False,
        "layer_shards_saving_path": "<disk>/shards",
        "max_shard_size": SHARD_SIZE,
    }
    cls_module, cls_name = airllm.AutoModel.get_module_class(str(hf))
    air = airllm.AutoModel.from_pretrained(
        str(hf),
        device=dev,
        dtype=torch.bfloat16,  # the checkpoint's dtype, explicit so a config without one cannot mean fp16
        layer_shards_saving_path=str(shards_root),
        compression=None,
        prefetching=True,
    )
    sync(dev)
    split_seconds = time.perf_counter() - t0
    split_dir = Path(air.checkpoint_path)
    os.sync()  # written pages are dirty until flushed, and DONTNEED leaves dirty pages cached
    files = files_under([hf, shards_root])
    streamed = sum(p.stat().st_size for p in split_dir.glob("*.safetensors"))

    gc_seconds = time_clean_memory(airllm)
    cached_after_drop: list[int | None] = []
    last: list[torch.Tensor] = []  # the latest pass's logits

    def one_pass() -> float:
        drop_page_cache(files)
        cached_after_drop.append(cached_bytes(files))
        gc_seconds[0] = 0.0
        sync(dev)
        t = time.perf_counter()
        with torch.no_grad():
            out = air(input_ids=ids, use_cache=False)
        sync(dev)
        elapsed = time.perf_counter() - t
        last[:] = [out.logits]
        return elapsed

    if dev.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    for _ in range(a.warmup):
        print(f"airllm_peer: warm-up pass {one_pass():.3f} s", file=sys.stderr)
    times, gc_times = [], []
    for i in range(a.reps):
        times.append(one_pass())
        gc_times.append(gc_seconds[0])
        print(f"airllm_peer: pass {i} {times[-1]:.3f} s", file=sys.stderr)
    diff = None
    if last and last[0].shape == ref.shape:
        diff = (last[0].float().cpu() - ref).abs().max().item()

    known = [c for c in cached_after_drop if c is not None]
    return {
        "workload": "W2",
        "system": "airllm",
        "phase": "forward",
        "tokens": a.seq,
        "seq": a.seq,
        "batch": 1,
        "seconds": statistics.median(times) if times else None,
        "times": times,
        "warmup": a.warmup,
        "reps": a.reps,
        "weight_bytes": wbytes,
        "params": nparams,
        "airllm_version": airllm_version(),
        "airllm_class": f"{cls_module}.{cls_name}",
        "options": options,
        "attn_implementation": getattr(air.model.config, "_attn_implementation", None),
        "setup_seconds": save_seconds + split_seconds,
        "save_seconds": save_seconds,
        "split_seconds": split_seconds,
        "build_seconds": build_seconds,
        "streamed_bytes_per_pass": streamed,
        "split_files": len(list(split_dir.glob("*.safetensors"))),
        "clean_memory_seconds": gc_times,
        "page_cache_dropped": True,
        "cached_bytes_after_drop_max": max(known) if known else None,
        "cached_bytes_after_drop": cached_after_drop,
        "max_abs_diff_vs_resident": diff,
        "gpu_peak_bytes": torch.cuda.max_memory_allocated() if dev.startswith("cuda") else 0,
        "device": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu",
        "device_kind": dev,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "commit": a.commit,
        "command": "python3 " + " ".join(sys.argv),
    }


if __name__ == "__main__":
    main()
