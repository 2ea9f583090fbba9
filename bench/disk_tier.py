"""The disk tier: W2 forward with only part of the model in host RAM, the rest on disk.

Measured in one process, in this order:

1. **Disk ceiling** in the ``--disk`` directory: a file of ``--probe-gib`` GiB written (8 MiB
   requests, 16 threads) then read with ``O_DIRECT``, sequentially, many requests in flight, over
   a grid of thread counts and request sizes; the best read is the ceiling. Falls back to buffered
   I/O (and says so) where the file system refuses ``O_DIRECT``.
2. **Link ceiling**: pinned host→device copies of 2 GiB (as ``bench/generate.py`` measures it).
3. **Resident forward** (the compute floor): W2 (``bench/w2.py``'s model) on the GPU.
4. **ramtorch**: the model moved to host RAM, then ``ramtorch.offload(model, gpu_budget=...,
   host_budget=<fraction of the model>, disk=--disk)``; forward passes timed (``--reps`` after
   ``--warmup``). The record carries the bytes read from disk per pass, the limit
   ``max(resident, disk bytes / disk read GB/s, streamed bytes / link GB/s)``, the ratio to it, and
   the process's resident memory (``VmRSS``: anonymous, file-backed and shared parts) after the
   passes, against ``host_budget`` plus the staging buffers.

One JSON list of records is written to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from benchlib import git_commit, peak_rss, rss
from generate import link_bandwidth
from w2 import build, config, free_gpu, to_host

CHUNK = 8 << 20
THREADS = 16


def _log(msg: str) -> None:
    print(f"[disk_tier] {msg}", file=sys.stderr, flush=True)


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[k] = int(v.split()[0]) * 1024
    return out


def _probe(fd: int, nbytes: int, threads: int, chunk: int, write: bool) -> float:
    """GB/s of one sequential pass over ``nbytes`` of ``fd`` in ``chunk`` requests on ``threads``
    threads (thread k takes chunks k, k + threads, ...: many requests in flight, in order)."""
    bufs = [mmap.mmap(-1, chunk) for _ in range(threads)]  # page-aligned, as O_DIRECT needs
    if write:
        for b in bufs:
            b.write(os.urandom(chunk))
    offsets = list(range(0, nbytes, chunk))

    def work(k: int) -> None:
        buf = bufs[k]
        for off in offsets[k::threads]:
            n = os.pwrite(fd, buf, off) if write else os.preadv(fd, [buf], off)
            if n != chunk:
                raise OSError(f"short transfer at {off}: {n}")

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(work, range(threads)))
    if write:
        os.fsync(fd)
    return nbytes / (time.perf_counter() - t) / 1e9


#: (threads, request bytes) tried for reads; the best is the ceiling.
READ_GRID = ((4, 8 << 20), (8, 8 << 20), (16, 8 << 20), (32, 8 << 20), (16, 1 << 20), (64, 1 << 20))


def major_faults() -> int:
    """Page faults of this process that read from the disk so far (``/proc/self/stat``)."""
    with open("/proc/self/stat") as f:
        return int(f.read().rpartition(")")[2].split()[9])


def disk_ceiling(directory: str, nbytes: int) -> dict[str, object]:
    """``O_DIRECT`` sequential write then reads of ``nbytes`` in ``directory``: the write in 8 MiB
    requests on 16 threads, the reads over a grid of thread counts and request sizes
    (``READ_GRID``); the best read is the ceiling, every figure is kept."""
    path = os.path.join(directory, f"ceiling-{os.getpid()}.bin")
    nbytes = nbytes // CHUNK * CHUNK
    direct = True
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    except OSError:
        direct = False
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    grid = {}
    try:
        os.posix_fallocate(fd, 0, nbytes)
        write = _probe(fd, nbytes, THREADS, CHUNK, True)
        for threads, chunk in READ_GRID:
            if not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            grid[f"{threads}x{chunk >> 20}MiB"] = _probe(fd, nbytes, threads, chunk, False)
    finally:
        os.close(fd)
        os.unlink(path)
    return {
        "disk_read_gbps": max(grid.values()),
        "disk_write_gbps": write,
        "disk_probe_bytes": nbytes,
        "disk_probe_direct": direct,
        "disk_probe_reads": grid,
        "disk_probe": f"write {THREADS} threads x {CHUNK >> 20} MiB; reads threads x request size",
    }


def timed(fn, reps: int, warmup: int, device: str) -> list[float]:  # noqa: ANN001
    for _ in range(warmup):
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def w1_step(a: argparse.Namespace, ceiling: dict, link: dict, common: dict) -> list[dict]:
    """W1 training steps (forward, backward, ``ramtorch.optim.AdamW``: fp32 masters by default,
    ``--precision`` otherwise) with the blocks past ``host_budget`` on disk, and with
    ``--optimizer-on-disk`` their optimizer states too (else in host RAM). The limit: the resident
    step's compute, or the disk's bytes a step at the probe's read and write speeds (read: the
    weights in forward and backward, measured, and the states; written: the updated weights and
    states), whichever is longer."""
    import ramtorch
    import ramtorch.optim as ropt
    from w1 import build as w1_build
    from w1 import loss_of
    from w1 import to_host as w1_to_host

    dev = a.device
    runtime = _status()  # the process before the model: the runtime (torch, the CUDA context)
    d, f, layers = (64, 128, 4) if a.tiny else (*a.w1_dims, a.layers)
    model = w1_build("resident", d, f, layers, dev)
    wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.randn(a.tokens, d, device=dev, dtype=torch.bfloat16)

    def fb() -> None:
        model.zero_grad(set_to_none=True)
        loss_of(model(x)).backward()

    t_res = timed(fb, a.reps, a.warmup, dev)
    resident = statistics.median(t_res)
    _log(f"W1 resident forward+backward {resident * 1e3:.1f} ms")
    common = {**common, "workload": "W1", "tokens": a.tokens}
    out = [{**common, "system": "resident", "phase": "forward_backward", "seconds": resident, "times": t_res}]
    w1_to_host(model)
    host_budget = int(wbytes * a.host_fraction) if a.host_budget is None else a.host_budget
    t0 = time.perf_counter()
    model = ramtorch.offload(
        model,
        gpu_budget=a.budget,
        device=dev,
        host_budget=host_budget,
        disk=a.disk,
        optimizer_on_disk=a.optimizer_on_disk,
    )
    setup = time.perf_counter() - t0
    opt = ropt.AdamW(model.parameters(), lr=1e-5, precision=a.precision, pipeline=a.pipeline)

    parts: dict[str, list[float]] = {"forward_backward": [], "optimizer_step": []}

    def step() -> None:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_of(model(x)).backward()
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        opt.step()
        opt.synchronize()
        parts["forward_backward"].append(t1 - t0)
        parts["optimizer_step"].append(time.perf_counter() - t1)

    first = timed(step, 1, 0, dev)
    opt.synchronize()
    _log(f"W1 first step {first}")
    ds = opt._disk_states
    state_bytes = 0 if ds is None else ds.nbytes
    s0 = ramtorch.stats(model)
    w0 = 0 if ds is None else ds.written_bytes
    f0 = major_faults()
    ends = timed(step, a.steps, 0, dev)
    opt.synchronize()
    f1 = major_faults()
    s1 = ramtorch.stats(model)
    secs = statistics.median(ends)
    read = (s1["disk_read_bytes"] - s0["disk_read_bytes"]) / a.steps + state_bytes
    # Every disk unit's weights change each step, and with them their states.
    written = s1["disk_bytes"] + state_bytes
    limits = {
        "resident_forward_backward": resident,
        "disk": read / (ceiling["disk_read_gbps"] * 1e9) + written / (ceiling["disk_write_gbps"] * 1e9),
    }
    limit = max(limits.values())
    mem = _status()
    out.append(
        {
            **common,
            "system": "ramtorch",
            "phase": "step",
            "optimizer": f"ramtorch.optim.AdamW(precision={a.precision!r}, pipeline={a.pipeline})",
            "optimizer_on_disk": a.optimizer_on_disk,
            "first_step_seconds": first[0],
            "step_parts_seconds": {k: v[1:] for k, v in parts.items()},  # the timed steps
            "disk_state_bytes": state_bytes,
            "disk_state_written_bytes_per_step": (None if ds is None else (ds.written_bytes - w0) / a.steps),
            "seconds": secs,
            "times": ends,
            "limit_seconds": limit,
            "limit_parts": limits,
            "ratio_to_limit": limit / secs,
            "weight_bytes": wbytes,
            "host_budget": host_budget,
            "disk_bytes": s1["disk_bytes"],
            "disk_bytes_read_per_step": read,
            "disk_bytes_written_per_step": written,
            "disk_units": len(s1["disk_units"]),
            "disk_wait_seconds_per_step": (s1["disk_wait_seconds"] - s0["disk_wait_seconds"]) / a.steps,
            "disk_reads_on_demand": s1["disk_reads_on_demand"] - s0["disk_reads_on_demand"],
            "setup_seconds": setup,
            "major_faults_per_step": (f1 - f0) / a.steps,
            "disk_cached_chunks": s1.get("disk_cached_chunks"),
            "host_rss_after_steps": mem,
            "host_rss_bytes": mem.get("VmRSS"),
            "host_peak_rss_bytes": peak_rss(),
            # Memory honesty: the peak less the runtime, against host_budget plus the staging
            # buffers (the arena's pooled and in-use page-locked and pageable staging).
            "host_runtime_rss_bytes": runtime.get("VmRSS"),
            "host_peak_over_runtime_bytes": peak_rss() - runtime.get("VmRSS", 0),
            "host_arena": ramtorch.stats()["host"],
            "host_units": s1["units"] - len(s1["resident_units"]) - len(s1["disk_units"]),
            "note": (
                "the streamed units' optimizer states on disk (units in host RAM included), their "
                "gradients in host RAM within host_budget"
                if a.optimizer_on_disk
                else "optimizer states and gradients in host RAM"
            ),
            "h2d_gbps": link.get("h2d_gbps"),
            **ceiling,
            "stats": {k: v for k, v in s1.items() if k != "itinerary"},
        }
    )
    _log(f"W1 step {secs:.3f} s, limit {limit:.3f} s ({limits}), ratio {limit / secs:.3f}; rss {mem}")
    return out


def offloaded(
    a: argparse.Namespace,
    held: dict,
    fwd,  # noqa: ANN001
    codec: str | None,
    wbytes: int,
    resident: float,
    ceiling: dict,
    link: dict,
    common: dict,
) -> dict:
    """``held["model"]`` (W2, on the GPU) moved to host RAM, offloaded with a quarter (or
    ``--host-fraction``) of it in RAM and the rest on disk, ``compress=codec``; its forward timed."""
    import ramtorch

    dev = a.device
    to_host(held["model"])
    if codec is not None:
        held["model"].requires_grad_(False)  # compressed units are frozen ones
    host_budget = int(wbytes * a.host_fraction)
    before = _status()
    t0 = time.perf_counter()
    held["model"] = ramtorch.offload(
        held["model"], gpu_budget=a.budget, device=dev, host_budget=host_budget, disk=a.disk, compress=codec
    )
    setup = time.perf_counter() - t0
    free_gpu()
    after_offload = _status()
    _log(f"offload (compress={codec}) {setup:.1f} s; rss {after_offload}")
    timed(fwd, 0, a.warmup, dev)
    s0 = ramtorch.stats(held["model"])
    times = timed(fwd, a.reps, 0, dev)
    s1 = ramtorch.stats(held["model"])
    mem = _status()
    passes = a.reps + a.warmup
    disk_bytes = (s1["disk_read_bytes"] - s0["disk_read_bytes"]) / a.reps
    streamed = s1["streamed_bytes_per_pass"]
    link_bytes = s1.get("link_bytes_per_pass", streamed)
    secs = statistics.median(times)
    limits = {"resident": resident}
    if ceiling["disk_read_gbps"]:
        limits["disk"] = disk_bytes / (ceiling["disk_read_gbps"] * 1e9)
    if link.get("h2d_gbps"):
        limits["link"] = link_bytes / (link["h2d_gbps"] * 1e9)
    limit = max(limits.values())
    raw_disk = sum(
        e.capacity for e in held["model"]._ramtorch_streamer.disk_store.extents[: len(s1["disk_units"])]
    )
    staging_bound = (ramtorch._disk.ahead() + 1) * max(
        (e.capacity for e in held["model"]._ramtorch_streamer.disk_store.extents), default=0
    )
    rec = {
        **common,
        "system": "ramtorch",
        "seconds": secs,
        "times": times,
        "limit_seconds": limit,
        "limit_parts": limits,
        "ratio_to_limit": limit / secs,
        "weight_bytes": wbytes,
        "host_budget": host_budget,
        "disk_bytes": s1["disk_bytes"],
        "disk_bytes_read_per_pass": disk_bytes,
        "disk_raw_bytes": raw_disk,
        "streamed_bytes_per_pass": streamed,
        "link_bytes_per_pass": link_bytes,
        "disk_units": len(s1["disk_units"]),
        "disk_direct": s1["disk_direct"],
        "ramtorch_disk_read_gbps": s1["disk_read_gbps"],
        "disk_wait_seconds_per_pass": (s1["disk_wait_seconds"] - s0["disk_wait_seconds"]) / a.reps,
        "disk_reads_on_demand": s1["disk_reads_on_demand"] - s0["disk_reads_on_demand"],
        "passes_timed": a.reps,
        "passes_total": passes,
        "setup_seconds": setup,
        "host_rss_before_offload": before,
        "host_rss_after_offload": after_offload,
        "host_rss_after_passes": mem,
        "host_rss_bytes": mem.get("VmRSS"),
        "host_peak_rss_bytes": peak_rss(),
        "staging_bytes_bound": staging_bound,
        "h2d_gbps": link.get("h2d_gbps"),
        **ceiling,
        "stats": {k: v for k, v in s1.items() if k != "itinerary"},
    }
    if codec is not None:
        rec["compress"] = codec
        rec["options"] = {"compress": codec}
        if ceiling["disk_read_gbps"]:
            rec["speedup_vs_raw_disk_floor"] = raw_disk / (ceiling["disk_read_gbps"] * 1e9) / secs
    _log(
        f"ramtorch (compress={codec}) forward {secs:.3f} s, limit {limit:.3f} s ({limits}), "
        f"ratio {limit / secs:.3f}; rss {mem}; current rss {rss()}"
    )
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--disk", required=True, help="directory for the store (and the ceiling probe)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--host-fraction", type=float, default=0.25, help="host_budget as a share of the model")
    ap.add_argument(
        "--host-budget",
        type=lambda v: int(float(v[:-3]) * 2**30) if v.endswith("GiB") else int(v),
        default=None,
        help="host_budget in bytes or as '16GiB' (instead of --host-fraction)",
    )
    ap.add_argument("--budget", default=None, help="gpu_budget (default: stream every unit)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--probe-gib", type=float, default=8.0)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--workload", choices=("w2", "w1-step"), default="w2")
    ap.add_argument(
        "--compress", nargs="+", default=["none"], help="W2: offload(compress=...) values: none lossless fp8"
    )
    ap.add_argument("--tokens", type=int, default=4096, help="W1 tokens per step")
    ap.add_argument("--steps", type=int, default=3, help="W1 timed steps (after one warm-up step)")
    ap.add_argument("--layers", type=int, default=8, help="W1 layers")
    ap.add_argument(
        "--w1-dims", type=int, nargs=2, default=[8192, 28672], metavar=("D", "F"), help="W1 layer shape"
    )
    ap.add_argument("--precision", default="fp32-master", help="W1: ramtorch.optim.AdamW(precision=...)")
    ap.add_argument("--optimizer-on-disk", action="store_true", help="W1: offload(optimizer_on_disk=True)")
    ap.add_argument("--pipeline", action="store_true", help="W1: ramtorch.optim.AdamW(pipeline=True)")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    dev = a.device
    os.makedirs(a.disk, exist_ok=True)
    common = {
        "workload": "W2",
        "tokens": a.seq,
        "phase": "forward",
        "device": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu",
        "commit": a.commit or git_commit(),
        "command": "python3 " + " ".join(sys.argv),
        "gpus": 1 if dev.startswith("cuda") else 0,
    }
    _log("disk ceiling")
    ceiling = disk_ceiling(a.disk, int(a.probe_gib * (1 << 30)))
    _log(f"disk: {ceiling}")
    link = link_bandwidth(dev) or {"h2d_gbps": None}
    _log(f"link: {link}")

    if a.workload == "w1-step":
        records = w1_step(a, ceiling, link, common)
        with open(a.out, "w") as f:
            json.dump(records, f, indent=1, default=str)
        return
    cfg = config(a.tiny, a.seq)
    model = build(cfg, dev)
    wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.randint(0, cfg.vocab_size, (1, a.seq), device=dev)

    def fwd() -> None:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)

    records = []
    t_res = timed(fwd, a.reps, a.warmup, dev)
    resident = statistics.median(t_res)
    records.append(
        {**common, "system": "resident", "seconds": resident, "times": t_res, "weight_bytes": wbytes}
    )
    _log(f"resident forward {resident * 1e3:.1f} ms")

    held = {"model": model}

    def fwd2() -> None:
        with torch.no_grad():
            held["model"](input_ids=ids, use_cache=False)

    for k, compress in enumerate(a.compress):
        codec = None if compress == "none" else compress
        if k:
            held["model"] = build(cfg, dev)
        records.append(offloaded(a, held, fwd2, codec, wbytes, resident, ceiling, link, common))
        held["model"] = None
        free_gpu()
    with open(a.out, "w") as f:
        json.dump(records, f, indent=1, default=str)


if __name__ == "__main__":
    main()
