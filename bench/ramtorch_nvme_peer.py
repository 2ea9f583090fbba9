"""Peer: the W1 training step with every block's weights on disk, on the ORIGINAL RamTorch 1.11's
NVMe tier (``OffloadModel(..., nvme_layers=..., nvme_path=...)``); writes one JSON record (a list
of one) to ``--out`` and prints it.

The counterpart of ``bench/disk_tier.py --workload w1-step --host-fraction 0`` (ours). The original
imports as ``ramtorch`` too, so this runs in its own process with only the original wheel and
``bench/`` on ``PYTHONPATH``; the script checks that the ``ramtorch`` it imported is 1.11.

What is measured, in this order:

1. **Disk ceiling** of ``--disk``: ``disk_tier.disk_ceiling`` (``O_DIRECT`` write, then reads over
   a grid of thread counts and request sizes; the best read is the ceiling), or the ceiling of an
   earlier ``disk_tier.py`` run read from ``--ceiling FILE`` so both systems are held to the same
   figures.
2. **Resident forward+backward** of W1 on the device (the compute floor), as ``disk_tier`` does.
3. **The original's NVMe tier**: W1 (``bench/w1.py``'s ``build``: ``layers`` blocks of
   ``Linear(d, f) -> GELU -> Linear(f, d)``, bf16, no bias) wrapped as the existing
   ``ramtorch-1.11`` peer of ``bench/w1.py`` does (``OffloadModel``, one chunk per block,
   ``window=2``, its defaults otherwise: ``keep_activations=False``, i.e. each chunk's forward is
   recomputed in backward, and ``grad_accum="stream"``), plus ``nvme_layers`` = every block and
   ``nvme_path`` = a scratch file in ``--disk``. The optimizer is the one the original documents
   for ``OffloadModel`` ("use ``fused=True``", README and ``docs/offload.md``):
   ``torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)``, torch's other defaults
   (betas (0.9, 0.999), eps 1e-8, weight decay 0.01). The weights are bf16, so there is no fp32
   master: the mapped bf16 weights ARE the masters, and the moments are bf16. A step is
   ``opt.zero_grad()``, ``model.step(x, loss_fn=loss_of)`` (forward, then backward into the
   original's gradient accumulators), ``model.flush_grads()`` (accumulators to ``.grad``),
   ``opt.step()``, then a device synchronize: one warm-up step, then ``--steps`` timed steps.

Where the original keeps what (``ramtorch/offload.py``, ``ramtorch/nvme_store.py``): the NVMe
chunks' weights are copied once, at construction, into one scratch file and rebound to
``torch.UntypedStorage.from_file(shared=True)`` views of it (an mmap; no ``O_DIRECT``, no GDS). Its
loader thread copies a chunk from the mapping (page faults: disk or page cache) into one pinned
staging buffer, then to the GPU. The optimizer updates the mapped weights in place; the kernel
writes the dirty pages back when it chooses. Gradient accumulators (pinned), the ``.grad``
buffers ``flush_grads`` fills (pinned) and the AdamW moments stay in host RAM: only the weights
are on disk. The record checks this from the tensors' storages (``weights_on_file``,
``optimizer_state_on_file``).

**Page cache.** On a machine whose RAM holds the scratch file, the original's reads come from the
page cache and its writes stay dirty in it, so a bare run measures RAM, not the disk. By default
(``--page-out``; ``bench/airllm_peer.py`` likewise drops its files' cache before every pass),
before every step (the warm-up included) and after the last, the script ``fsync``s the scratch
file (the write-back of the previous step's updated weights, which the original leaves to the
kernel; timed and kept as ``writeback_times``) and then asks the kernel to reclaim the mapping's
pages (``madvise(MADV_PAGEOUT)`` for the mapped ones, from every CPU in turn, and
``posix_fadvise(DONTNEED)`` for the read-ahead no page table maps), checking with ``mincore`` how
much of the file stayed resident (``resident_fraction_after_page_out``).
The step of the record is then the original's own step reading its weights from the disk, and
``seconds_with_writeback`` adds the write-back that step caused. ``--no-page-out`` measures the
original untouched (page cache and lazy write-back as the kernel decides). ``/proc/self/io`` read
and write bytes and major faults per step say how much really went to the device either way.

The limit (as ``disk_tier``'s W1 step): max(resident forward+backward, the bytes the step read
from the disk (measured: ``/proc/self/io`` ``read_bytes``) / disk read ceiling + the updated
weights (every weight, every step) / disk write ceiling). ``mapped_bytes_read_per_step`` is what
the loader copied out of the mapping (each chunk in forward and again in backward, but for the
chunks still resident at the turn); what of it the page cache served between forward and backward
is not in the limit. ``ratio_to_limit`` divides the limit by ``seconds_with_writeback`` when the
page-out ran, else by ``seconds`` (``ratio_basis`` says which).

**The training gate and SSD wear.** The original refuses to TRAIN on its NVMe tier unless the user
is a sudoer (root, or in the sudo/wheel group) AND ``RAMTORCH_NVME_ACKNOWLEDGE=1`` is set; it then
prints a drive-wear warning unless ``RAMTORCH_NVME_QUIET=1``. Its reason is real: every optimizer
step rewrites every disk-resident weight (here the whole model, 7.5 GB a step at the default W1
shape), which wears consumer SSDs (rated a few hundred TB written) fast. Run this only on a drive
you may wear, for a few steps. ``--acknowledge`` sets both variables in this process before the
original is imported; without it both are removed from this process's environment, so consent is
given only on the command line (which the record keeps) and the original's gate refuses. Where the
original refuses or fails (the gate, an unsupported configuration, out of memory...), the record
carries the exception as ``error`` (and ``error_stage``), no time figure, and the script exits 0.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import time

import torch
from benchlib import git_commit, peak_rss
from disk_tier import _status, disk_ceiling, major_faults, timed
from torch import nn
from w1 import build, loss_of

SYSTEM = "ramtorch-1.11-nvme"
ACK_ENV = "RAMTORCH_NVME_ACKNOWLEDGE"
QUIET_ENV = "RAMTORCH_NVME_QUIET"
MADV_PAGEOUT = 21  # linux/mman.h (kernel >= 5.4)
PAGE = os.sysconf("SC_PAGE_SIZE")


def _log(msg: str) -> None:
    print(f"[ramtorch_nvme_peer] {msg}", file=sys.stderr, flush=True)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def io_counters() -> dict[str, int]:
    """``/proc/self/io``: ``read_bytes`` / ``write_bytes`` are what this process sent to the
    storage layer (writes counted when a page is dirtied), ``rchar`` / ``wchar`` its read/write
    calls' bytes (page cache included; mapped access is in neither)."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = int(v)
    return out


def meminfo(keys: tuple[str, ...] = ("Dirty", "Writeback", "Cached", "MemAvailable")) -> dict[str, int]:
    """Bytes of the system's ``/proc/meminfo`` fields ``keys``."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in keys:
                out[k] = int(v.split()[0]) * 1024
    return out


def fs_type(path: str) -> str:
    """File system type of the mount holding ``path`` (``/proc/mounts``, longest prefix)."""
    path = os.path.realpath(path)
    best, kind = "", "unknown"
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, parts[2]
    return kind


class Mapping:
    """The original's scratch-file mapping, found from a mapped parameter's storage (every NVMe
    tensor is a view of one ``UntypedStorage.from_file`` storage): page it out, count its
    resident pages."""

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.addr = storage.data_ptr()
        self.nbytes = storage.nbytes()
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        self._libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)

    def page_out(self) -> None:
        """``madvise(MADV_PAGEOUT)`` over the mapping: the kernel reclaims its clean mapped pages."""
        if self._libc.madvise(self.addr, self.nbytes, MADV_PAGEOUT) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise(MADV_PAGEOUT): {os.strerror(err)}")

    def resident_fraction(self) -> float:
        """Share of the mapping's pages in memory (``mincore``)."""
        pages = -(-self.nbytes // PAGE)
        vec = (ctypes.c_ubyte * pages)()
        if self._libc.mincore(self.addr, self.nbytes, vec) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mincore: {os.strerror(err)}")
        return int(torch.frombuffer(vec, dtype=torch.uint8).bitwise_and(1).sum()) / pages

    def evict(self, path: str, attempts: int = 3) -> float:
        """Drops the file's pages from memory (they must be clean: ``fsync`` first); returns the
        share still resident. ``MADV_PAGEOUT`` from every CPU in turn (a page just faulted in can
        sit in one CPU's LRU batch, which only that CPU drains, and cannot be reclaimed before),
        then ``posix_fadvise(DONTNEED)`` for the read-ahead no page table maps; again, after a
        pause, while pages remain."""
        cpus = os.sched_getaffinity(0)
        frac = 1.0
        try:
            for k in range(attempts):
                if k:
                    time.sleep(0.2)
                for cpu in sorted(cpus):
                    os.sched_setaffinity(0, {cpu})
                    self.page_out()
                os.sched_setaffinity(0, cpus)
                drop_unmapped(path)
                frac = self.resident_fraction()
                if frac == 0.0:
                    break
        finally:
            os.sched_setaffinity(0, cpus)
        return frac


def fsync_seconds(path: str) -> float:
    """Seconds to ``fsync`` ``path``: the write-back of its dirty pages (mapped writes included)."""
    t = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t


def drop_unmapped(path: str) -> None:
    """``posix_fadvise(DONTNEED)`` on ``path``: drops its clean cached pages that no process maps
    (the kernel's read-ahead of the mapping; ``MADV_PAGEOUT`` reaches only mapped pages)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def load_ceiling(path: str, tokens: int) -> tuple[dict, float | None]:
    """The disk ceiling (``disk_*`` fields) of an earlier ``disk_tier.py`` run's records, and its
    resident W1 forward+backward seconds at ``tokens`` when it has one."""
    with open(path) as f:
        records = json.load(f)
    ceiling: dict = {}
    resident = None
    for r in records:
        if not ceiling and r.get("disk_read_gbps"):
            ceiling = {
                k: v
                for k, v in r.items()
                if k.startswith("disk_probe") or k in ("disk_read_gbps", "disk_write_gbps")
            }
        if r.get("system") == "resident" and r.get("workload") == "W1" and r.get("tokens") == tokens:
            resident = r.get("seconds")
    if not ceiling:
        raise ValueError(f"no disk_read_gbps in {path}")
    return {**ceiling, "disk_ceiling_from": os.path.basename(path)}, resident


def gates(acknowledge: bool) -> dict[str, str | None]:
    """Sets (``acknowledge``) or removes the original's two NVMe training variables in this
    process's environment; returns their values."""
    for k in (ACK_ENV, QUIET_ENV):
        if acknowledge:
            os.environ[k] = "1"
        else:
            os.environ.pop(k, None)
    return {k: os.environ.get(k) for k in (ACK_ENV, QUIET_ENV)}


def storage_files(tensors: list[torch.Tensor]) -> set[str | None]:
    """The files behind these tensors' storages (None: ordinary memory)."""
    return {getattr(t.untyped_storage(), "filename", None) for t in tensors}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--disk", required=True, help="directory for the original's scratch file and the disk probe"
    )
    ap.add_argument("--out", required=True, help="JSON file: a list of one record")
    ap.add_argument("--tokens", type=int, default=4096, help="W1 tokens per step")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    ap.add_argument("--layers", type=int, default=8, help="W1 layers (one chunk each, all on the NVMe tier)")
    ap.add_argument(
        "--w1-dims", type=int, nargs=2, default=[8192, 28672], metavar=("D", "F"), help="W1 layer shape"
    )
    ap.add_argument("--reps", type=int, default=3, help="resident forward+backward repetitions")
    ap.add_argument("--warmup", type=int, default=1, help="resident forward+backward warm-ups")
    ap.add_argument(
        "--no-resident", action="store_true", help="skip the resident forward+backward (no compute floor)"
    )
    ap.add_argument(
        "--probe-gib", type=float, default=8.0, help="disk probe size; 0: no probe (no disk limit)"
    )
    ap.add_argument(
        "--ceiling", default=None, help="take the disk ceiling (and resident time) from a disk_tier.py JSON"
    )
    ap.add_argument(
        "--page-out",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="before each step and after the last: fsync the scratch file (timed), drop its cached pages",
    )
    ap.add_argument("--window", type=int, default=2, help="OffloadModel(window=...)")
    ap.add_argument(
        "--optimizer",
        choices=("fused", "foreach"),
        default="fused",
        help="torch.optim.AdamW implementation (the original recommends fused)",
    )
    ap.add_argument(
        "--acknowledge",
        action="store_true",
        help=f"set {ACK_ENV}=1 and {QUIET_ENV}=1: consent to SSD wear (a step rewrites every weight on disk)",
    )
    ap.add_argument("--commit", default=None)
    ap.add_argument("--device", default="cuda", help="compute device (cpu: a smoke run)")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def run(a: argparse.Namespace, rec: dict, stage: list[str]) -> None:
    """Fills ``rec``; ``stage[0]`` names the stage running (for an error record)."""
    dev = a.device
    d, f, layers = (64, 128, 4) if a.tiny else (*a.w1_dims, a.layers)
    rec.update(layers=layers, d=d, f=f, dtype="bfloat16")

    stage[0] = "disk ceiling"
    resident: float | None = None
    ceiling: dict = {}
    if a.ceiling:
        ceiling, resident = load_ceiling(a.ceiling, a.tokens)
    elif a.probe_gib > 0:
        _log("disk ceiling")
        ceiling = disk_ceiling(a.disk, int(a.probe_gib * (1 << 30)))
    rec.update(ceiling)
    _log(f"disk: {ceiling}")

    stage[0] = "import"
    import ramtorch  # the original: PYTHONPATH=<RamTorch 1.11 folder>:bench
    from ramtorch import OffloadModel

    version = getattr(ramtorch, "__version__", "unknown")
    rec["baseline_version"] = version
    if not version.startswith("1.11"):
        raise RuntimeError(f"imported ramtorch {version}, not the original 1.11: put it first on PYTHONPATH")
    is_sudoer = getattr(getattr(ramtorch, "offload", None), "_is_sudoer", None)
    rec["sudoer"] = is_sudoer() if callable(is_sudoer) else None

    stage[0] = "build"
    model = build("resident", d, f, layers, dev)
    wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rec.update(weight_bytes=wbytes, params=sum(p.numel() for p in model.parameters()))
    x = torch.randn(a.tokens, d, device=dev, dtype=torch.bfloat16)

    if not a.no_resident and resident is None:
        stage[0] = "resident forward+backward"

        def fb() -> None:
            model.zero_grad(set_to_none=True)
            loss_of(model(x)).backward()

        t_res = timed(fb, a.reps, a.warmup, dev)
        resident = statistics.median(t_res)
        rec["resident_times"] = t_res
        model.zero_grad(set_to_none=True)
        _log(f"resident forward+backward {resident * 1e3:.1f} ms")
    if resident is not None:
        rec["resident_forward_backward_seconds"] = resident

    stage[0] = "OffloadModel (NVMe tier)"
    path = os.path.join(a.disk, f"ramtorch-1.11-nvme-{os.getpid()}.bin")
    blocks: list[nn.Module] = list(model.blocks)
    chunk_bytes = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks]
    options = {
        "window": a.window,
        "nvme_layers": list(range(len(blocks))),
        "nvme_path": os.path.basename(path),
    }
    rec.update(offload_options=options, chunks=len(blocks), disk_fs=fs_type(a.disk))
    t0 = time.perf_counter()
    om = OffloadModel(blocks, device=dev, window=a.window, nvme_layers=range(len(blocks)), nvme_path=path)
    gc.collect()  # the chunks' device copies (the blocks now hold mapped weights)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        rec["setup_seconds"] = time.perf_counter() - t0
        rec["nvme_layers"] = sorted(om.nvme_layers)
        rec["nvme_file_bytes"] = os.path.getsize(path)
        params = list(om.parameters())
        rec["weights_on_file"] = storage_files(params) == {path}
        mapping = Mapping(params[0].untyped_storage())

        stage[0] = "optimizer"
        opt = torch.optim.AdamW(params, lr=1e-5, **{a.optimizer: True})
        keys = ("lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "fused")
        rec["optimizer"] = f"torch.optim.AdamW({a.optimizer}, CPU)"
        rec["optimizer_options"] = {k: opt.defaults.get(k) for k in keys}

        writebacks: list[float] = []
        residency: list[float] = []
        parts: dict[str, list[float]] = {"forward_backward": [], "optimizer_step": []}

        def settle() -> None:
            """Before a step (--page-out): write back what the last one dirtied, drop the pages."""
            if not a.page_out:
                return
            writebacks.append(fsync_seconds(path))
            residency.append(mapping.evict(path))

        def step() -> None:
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            om.step(x, loss_fn=loss_of)  # forward, then backward into the gradient accumulators
            om.flush_grads()  # accumulators -> .grad (host, pinned on CUDA)
            _sync(dev)
            t1 = time.perf_counter()
            opt.step()  # fused CPU AdamW on the mapped weights, in place
            _sync(dev)
            parts["forward_backward"].append(t1 - t0)
            parts["optimizer_step"].append(time.perf_counter() - t1)

        stage[0] = "page-out (fsync, madvise MADV_PAGEOUT, mincore)"
        settle()
        stage[0] = "first step"
        if writebacks:
            rec["setup_writeback_seconds"] = writebacks.pop()  # the file's first write, at construction
        first = timed(step, 1, 0, dev)
        rec["first_step_seconds"] = first[0]
        _log(f"first step {first[0]:.3f} s")
        rec["optimizer_state_on_file"] = any(
            s is not None
            for s in storage_files(
                [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim()]
            )
        )
        rec["optimizer_state_bytes"] = sum(
            t.numel() * t.element_size()
            for st in opt.state.values()
            for t in st.values()
            if torch.is_tensor(t)
        )
        rec["grad_bytes"] = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
        acc = getattr(om, "_state", None)  # the original's per-chunk gradient accumulators (private)
        if acc is not None:
            rec["grad_accumulator_bytes"] = sum(
                t.numel() * t.element_size() for s in acc for t in s.grad_acc.values()
            )

        stage[0] = "timed steps"
        settle()
        if writebacks:
            rec["first_step_writeback_seconds"] = writebacks.pop()
        residency.clear()
        parts = {k: [] for k in parts}
        s0, io0, f0 = dict(om.stats), io_counters(), major_faults()
        times = []
        for _ in range(a.steps):
            times += timed(step, 1, 0, dev)
            settle()  # after every timed step: its write-back is timed with it (and the pages dropped)
        io1, f1, s1 = io_counters(), major_faults(), dict(om.stats)
        secs = statistics.median(times)
        rec.update(seconds=secs, times=times, step_parts_seconds=parts)
        n = a.steps
        nvme_loads = (s1["nvme_loads"] - s0["nvme_loads"]) / n
        mapped_read = nvme_loads * chunk_bytes[0] if len(set(chunk_bytes)) == 1 else None
        disk_read = (io1["read_bytes"] - io0["read_bytes"]) / n  # from the storage, measured
        rec.update(
            nvme_loads_per_step=nvme_loads,
            loads_per_step=(s1["loads"] - s0["loads"]) / n,
            acquire_wait_seconds_per_step=(s1["acquire_wait_s"] - s0["acquire_wait_s"]) / n,
            chunk_bytes=chunk_bytes[0],
            mapped_bytes_read_per_step=mapped_read,
            disk_bytes_written_per_step=wbytes,  # every weight is updated in place each step
            disk_bytes_read_per_step=disk_read,
            io_write_bytes_per_step=(io1["write_bytes"] - io0["write_bytes"]) / n,
            major_faults_per_step=(f1 - f0) / n,
            offload_stats=s1,
            meminfo_after_steps=meminfo(),
        )
        if a.page_out:
            with_wb = [t + w for t, w in zip(times, writebacks, strict=True)]
            rec.update(
                writeback_times=writebacks,
                seconds_with_writeback=statistics.median(with_wb),
                times_with_writeback=with_wb,
                resident_fraction_after_page_out=max(residency),
            )
            if max(residency) > 0.01:  # e.g. pages still in another CPU's LRU batch: not reclaimable
                rec["page_out_warning"] = (
                    f"up to {max(residency):.1%} of the file stayed in memory after MADV_PAGEOUT; "
                    "reads of those pages came from RAM (disk_bytes_read_per_step is measured)"
                )
        limits: dict[str, float] = {}
        if resident is not None:
            limits["resident_forward_backward"] = resident
        if ceiling.get("disk_read_gbps"):
            limits["disk"] = disk_read / (ceiling["disk_read_gbps"] * 1e9) + wbytes / (
                ceiling["disk_write_gbps"] * 1e9
            )
        if limits:
            limit = max(limits.values())
            basis = "seconds_with_writeback" if a.page_out else "seconds"
            rec.update(
                limit_seconds=limit, limit_parts=limits, ratio_to_limit=limit / rec[basis], ratio_basis=basis
            )
        mem = _status()
        rec.update(host_rss_after_steps=mem, host_rss_bytes=mem.get("VmRSS"))
        shown = ("seconds_with_writeback", "limit_seconds", "ratio_to_limit")
        _log(f"step {secs:.3f} s; {json.dumps({k: rec.get(k) for k in shown})}")
    finally:
        om.close()  # joins the original's threads and unlinks the scratch file


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    env = gates(a.acknowledge)  # before the original is imported
    os.makedirs(a.disk, exist_ok=True)
    dev = a.device
    rec: dict = {
        "system": SYSTEM,
        "workload": "W1",
        "phase": "step",
        "tokens": a.tokens,
        "device": torch.cuda.get_device_name()
        if dev.startswith("cuda") and torch.cuda.is_available()
        else dev,
        "gpus": 1 if dev.startswith("cuda") else 0,
        "commit": a.commit or git_commit(),
        "command": "python3 " + " ".join(sys.argv),
        "env_gates": env,
        "page_out": a.page_out,
        "note": (
            "The original RamTorch 1.11 OffloadModel NVMe tier: every block's bf16 weights (the masters: "
            "no fp32 copy) in one mmap'd scratch file in --disk, read through the page cache (into a pinned "
            "staging buffer, then to the GPU, on CUDA); updated in place by torch.optim.AdamW and written "
            "back by the kernel. Gradient accumulators, .grad buffers (both pinned on CUDA) and AdamW "
            "moments (bf16) in host RAM. "
            + (
                "Before every step the scratch file was fsynced (timed: writeback_times) and its pages "
                "reclaimed (madvise MADV_PAGEOUT), so each step read its weights from the disk. "
                if a.page_out
                else "Page cache untouched: reads may come from RAM and writes stay dirty in it. "
            )
            + f"Env gates: {ACK_ENV}={env[ACK_ENV]}, {QUIET_ENV}={env[QUIET_ENV]}"
            + (
                " (set by --acknowledge)."
                if a.acknowledge
                else " (not acknowledged: the original refuses training)."
            )
        ),
    }
    stage = ["start"]
    try:
        run(a, rec, stage)
    except Exception as e:  # noqa: BLE001 - the peer's refusal or failure is the result
        rec["error"] = f"{type(e).__name__}: {e}"
        rec["error_stage"] = stage[0]
        _log(f"{stage[0]}: {rec['error']}")
    rec["host_peak_rss_bytes"] = peak_rss()
    text = json.dumps([rec], indent=1, default=str)
    with open(a.out, "w") as f:
        f.write(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
