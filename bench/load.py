"""Benchmark: ``ramtorch.load`` into an offloaded model vs ``safetensors.torch.load_file`` + ``pin_memory``.

Writes a checkpoint of about ``--gib`` GiB (sharded, Hugging Face layout) to a temporary directory,
then times each method in a fresh subprocess (so peak RSS, from ``VmHWM``, is per method; it is
reset just before the timed part). Prints one JSON line per method. The files are read from the page
cache after the first run (warm), so this measures copying and conversion, not the disk.
Peak memory is reported as VmHWM and, sampled every 5 ms, as its two parts: anonymous memory
(``peak_anon_gib``: the process's own copies) and mapped file pages (``peak_file_mapped_gib``: page
cache, shared and reclaimable).

    python bench/load.py --gib 0.2
    python bench/load.py --gib 8 --dtype bf16 --file-dtype f32 --keep /tmp/ckpt
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


class Stack(nn.Module):
    def __init__(self, layers: int, d: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d, bias=False, dtype=dtype) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build(layers: int, d: int, dtype: torch.dtype) -> nn.Module:
    with torch.device("meta"):
        m = Stack(layers, d, dtype)
    return m.to_empty(device="cpu")


def rss_gib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / (1 << 30)
    return float("nan")


def reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


class PeakSampler:
    """Samples RssAnon (the process's own memory) and RssFile (mapped file pages, which live in the
    page cache) every few milliseconds; VmHWM alone counts both together."""

    def __init__(self) -> None:
        self.peak = {"RssAnon": 0.0, "RssFile": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for k in self.peak:
                self.peak[k] = max(self.peak[k], rss_gib(k))
            self._stop.wait(0.005)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def child(args: argparse.Namespace) -> None:
    ckpt = Path(args.dir)
    result: dict[str, object] = {"method": args.child, "gib": args.gib}
    if args.child == "ramtorch.load":
        import ramtorch

        model = ramtorch.offload(build(args.layers, args.d, DTYPES[args.dtype]), device="cpu", progress=False)
        result["rss_before_gib"] = rss_gib("VmRSS")
        result["anon_before_gib"] = rss_gib("RssAnon")
        reset_peak()
        with PeakSampler() as peaks:
            t0 = time.perf_counter()
            res = ramtorch.load(model, ckpt, progress=False)
            seconds = time.perf_counter() - t0
        nbytes = res["bytes"]
    else:
        from safetensors.torch import load_file

        pin = torch.cuda.is_available()
        dtype = DTYPES[args.dtype]
        result["rss_before_gib"] = rss_gib("VmRSS")
        result["anon_before_gib"] = rss_gib("RssAnon")
        reset_peak()
        with PeakSampler() as peaks:
            t0 = time.perf_counter()
            state: dict[str, torch.Tensor] = {}
            nbytes = 0
            for f in sorted(ckpt.glob("*.safetensors")):
                for k, v in load_file(f).items():
                    nbytes += v.numel() * v.element_size()
                    v = v.to(dtype)
                    state[k] = v.pin_memory() if pin else v.clone()
            seconds = time.perf_counter() - t0
        result["pinned"] = pin
        if not pin:
            result["note"] = "no CUDA: .clone() stands in for .pin_memory()"
    result.update(
        seconds=round(seconds, 4),
        file_bytes=nbytes,
        gbps=round(nbytes / seconds / 1e9, 3),
        peak_rss_gib=round(rss_gib("VmHWM"), 3),
        peak_anon_gib=round(peaks.peak["RssAnon"], 3),
        peak_file_mapped_gib=round(peaks.peak["RssFile"], 3),
    )
    print(json.dumps(result), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB (default 1)")
    ap.add_argument("--d", type=int, default=2048, help="layer width (default 2048)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="f32", help="model dtype")
    ap.add_argument("--file-dtype", choices=sorted(DTYPES), default=None, help="checkpoint dtype")
    ap.add_argument("--shard", default="1GB", help="max shard size (default 1GB)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per method (default 2; the first warms)")
    ap.add_argument("--keep", default=None, help="write the checkpoint here and keep it")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    file_dtype = DTYPES[args.file_dtype or args.dtype]
    per_layer = args.d * args.d * torch.empty(0, dtype=file_dtype).element_size()
    args.layers = max(1, round(args.gib * (1 << 30) / per_layer))

    import ramtorch

    with tempfile.TemporaryDirectory(prefix="ramtorch-bench-load-") as tmp:
        ckpt = Path(args.keep or tmp)
        src = build(args.layers, args.d, file_dtype)
        with torch.no_grad():
            for p in src.parameters():
                p.uniform_(-0.02, 0.02)
        t0 = time.perf_counter()
        ramtorch.save_pretrained(src, ckpt, max_shard_size=args.shard)
        save_s = time.perf_counter() - t0
        del src
        print(
            json.dumps({"method": "save_pretrained", "gib": args.gib, "seconds": round(save_s, 4)}),
            flush=True,
        )
        base = [sys.executable, os.path.abspath(__file__), "--gib", str(args.gib), "--d", str(args.d)]
        base += ["--dtype", args.dtype, "--dir", str(ckpt), "--layers", str(args.layers)]
        for run in range(args.repeat):
            for method in ("ramtorch.load", "load_file+pin_memory"):
                out = subprocess.run(base + ["--child", method], capture_output=True, text=True, check=True)
                line = json.loads(out.stdout.strip().splitlines()[-1])
                line["run"] = run
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
