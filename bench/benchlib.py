"""Helpers shared by the workload scripts (w1.py, w2.py): timing, memory, budgets, ramtorch stats."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import time
from collections.abc import Callable

import torch

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def budget_arg(text: str | None) -> int | str | None:
    """``--budget`` as ramtorch.offload takes it: None ("none"), int bytes (all digits) or a string."""
    if text is None or text.strip().lower() in ("", "none", "null"):
        return None
    text = text.strip()
    return int(text) if text.isdigit() else text


def links_arg(text: str | None) -> str | list[str] | None:
    """``--links``: ``auto``, a comma-separated list of devices, or ``none``."""
    if text is None or text.lower() == "none":
        return None
    return "auto" if text.lower() == "auto" else [t.strip() for t in text.split(",") if t.strip()]


def multi_link_h2d_gbps(peers: list[int], nbytes: int = 2 << 30, chunk: int = 64 << 20) -> float:
    """Host→``cuda:0`` bandwidth over its own link and through each GPU of ``peers`` at once
    (host → peer, then peer → ``cuda:0``), the bytes split equally, the relayed ones in ``chunk``
    pieces through two staging buffers a peer: the ceiling of ``offload(links=...)``, measured
    with torch alone."""
    paths = 1 + len(peers)
    share = nbytes // paths // chunk * chunk
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    own = torch.cuda.Stream("cuda:0")
    lanes = [[torch.cuda.Stream(f"cuda:{p}") for _ in range(2)] for p in peers]
    staging = [[torch.empty(chunk, dtype=torch.uint8, device=f"cuda:{p}") for _ in range(2)] for p in peers]

    def once() -> None:
        own_len = nbytes - share * len(peers)
        with torch.cuda.stream(own):
            dst[:own_len].copy_(host[:own_len], non_blocking=True)
        at = own_len
        for i in range(len(peers)):
            for k, off in enumerate(range(0, share, chunk)):
                lane, buf = lanes[i][k % 2], staging[i][k % 2]
                with torch.cuda.stream(lane):
                    buf.copy_(host[at + off : at + off + chunk], non_blocking=True)
                    dst[at + off : at + off + chunk].copy_(buf, non_blocking=True)
            at += share
        for d in range(torch.cuda.device_count()):
            torch.cuda.synchronize(d)

    once()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        once()
        times.append(time.perf_counter() - t)
    return nbytes / min(times) / 1e9


def parse_bytes(value: int | str | None) -> int | None:
    """``8GiB`` → 8589934592, ``"1e9"`` → 1000000000, 123 → 123, None → None."""
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", value)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _status_bytes(field: str) -> int:
    """A byte figure of /proc/self/status (``VmRSS``, ``VmHWM``); 0 where it is missing."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def host_cpus() -> dict[str, object]:
    """The CPUs this process may run on: how many logical CPUs, how many physical cores they are
    (hyperthread siblings counted once, from sysfs), and the model name. The optimizer's kernels
    are bound by the execution units, so a rate "on 16 cores" reads differently on 8 physical
    cores with two threads each."""
    cpus = sorted(os.sched_getaffinity(0))
    cores = set()
    for c in cpus:
        base = f"/sys/devices/system/cpu/cpu{c}/topology/"
        try:
            with open(base + "physical_package_id") as f, open(base + "core_id") as g:
                cores.add((f.read().strip(), g.read().strip()))
        except OSError:
            cores.add(("?", str(c)))
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"logical": len(cpus), "physical": len(cores), "model": model}


def rss() -> int:
    """Resident set size of this process in bytes."""
    return _status_bytes("VmRSS")


def peak_rss() -> int:
    """Peak resident set size of this process in bytes."""
    return _status_bytes("VmHWM")


def llama_config(
    hidden: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int, positions: int
) -> object:
    """A transformers ``LlamaConfig`` (untied head, sdpa attention) of this shape, for random weights."""
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=positions,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def git_commit() -> str:
    """The checkout's short commit, or ``"unknown"`` outside a git checkout."""
    try:
        cmd = ["git", "rev-parse", "--short", "HEAD"]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def gpu_peak(device: str) -> int:
    return torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0


def gpu_allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device.startswith("cuda") else 0


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def timeit(fn: Callable[[], object], reps: int, device: str) -> tuple[float, list[float]]:
    """Median and all wall times of ``reps`` calls of ``fn``, each ended by a device synchronize."""
    times = []
    sync(device)
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times), times


def warm(fn: Callable[[], object], n: int, device: str) -> None:
    for _ in range(n):
        fn()
    sync(device)


#: Environment variables that change what ramtorch does (records made with one set carry it in
#: ``"options"``: they are not the default).
OPTION_VARS = ("RAMTORCH_UNIT_PARTS_MIN_BYTES", "RAMTORCH_SMALL_PARAM_BYTES", "RAMTORCH_STREAMED_SUM_SHARE")


def env_options() -> dict[str, str]:
    """The options this process runs with through the environment (``OPTION_VARS`` that are set),
    as ``{"unit_parts_min_bytes": "64MiB"}``."""
    return {v.removeprefix("RAMTORCH_").lower(): os.environ[v] for v in OPTION_VARS if os.environ.get(v)}


def jsonable(obj: object) -> object:
    """``obj`` with everything json cannot write turned into numbers, lists or strings."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    try:
        json.dumps(obj)
        return obj
    except TypeError:
        return str(obj)


def find_key(tree: object, *keys: str) -> object | None:
    """First value stored under any of ``keys`` in a nested dict (breadth first), else None."""
    level = [tree]
    while level:
        nxt = []
        for d in level:
            if isinstance(d, dict):
                for k in keys:
                    if k in d:
                        return d[k]
                nxt += [v for v in d.values() if isinstance(v, dict)]
        level = nxt
    return None


def ramtorch_stats() -> dict:
    """``ramtorch.stats()`` made writable as JSON, or {} when the package has no stats()."""
    import ramtorch

    fn = getattr(ramtorch, "stats", None)
    if fn is None:
        return {}
    try:
        return jsonable(fn())
    except Exception as e:  # a benchmark records what it can
        return {"error": repr(e)}


def ramtorch_fields(before: dict, after: dict, reps: int, phase: str, weight_bytes: int) -> dict:
    """Fields a ``ramtorch`` record carries next to the raw stats: the offloaded model's plan
    (``stats()["models"]``: resident units, GPU bytes, bytes streamed per pass) and what the
    device counters measured over the timed repetitions (bytes copied and reused per repetition,
    achieved H2D bandwidth, seconds the compute stream waited on copies and the host waited on the
    engine)."""
    out: dict = {"stats": after}
    models = after.get("models") or []
    if models:
        m = models[-1]
        out["resident_blocks"] = [n for n in m.get("resident_units", []) if n.startswith("blocks")]
        out["resident_units"] = m.get("resident_units", [])
        out["ramtorch_gpu_bytes"] = m.get("gpu_bytes")
        out["streamed_bytes_per_pass"] = m.get("streamed_bytes_per_pass")
        out["streamed_bytes_source"] = "stats.models.streamed_bytes_per_pass"
        if m.get("compress"):
            # offload(compress=...): the bytes that crossed the link, and their share of the raw ones.
            out["compress"] = m["compress"]
            out["link_bytes_per_pass"] = m.get("link_bytes_per_pass")
            if m.get("link_bytes_per_pass") and m.get("streamed_bytes_per_pass"):
                out["compressed_ratio"] = m["link_bytes_per_pass"] / m["streamed_bytes_per_pass"]
            out["options"] = {"compress": m["compress"]}
    devs0, devs1 = before.get("devices") or {}, after.get("devices") or {}
    for name, d1 in devs1.items():
        if not name.startswith("cuda"):
            continue
        if d1.get("links"):  # offload(links=...): how many links fed the device, bytes per path
            out["links"] = d1["links"]
            out["link_relays"] = d1.get("link_relays")
            out["link_own_bytes"] = d1.get("link_own_bytes")
            out["link_relay_bytes"] = d1.get("link_relay_bytes")
            out["link_shares"] = d1.get("link_shares")  # each path's measured bytes per second
            out.setdefault("options", {})["links"] = d1.get("link_relays")
        d0 = devs0.get(name, {})
        # (throttle_wait: the host blocked on copies in flight; sync_wait: on the lanes draining at
        # the end of each backward.)
        for k in (
            "h2d_bytes",
            "reused_bytes",
            "d2h_bytes",
            "stall_seconds",
            "throttle_wait_seconds",
            "sync_wait_seconds",
        ):
            if _num(d1.get(k)) and reps > 0:
                out[f"{k}_per_rep"] = (d1[k] - d0.get(k, 0)) / reps
        out["ramtorch_h2d_gbps"] = d1.get("h2d_gbps")
        out["ramtorch_d2h_gbps"] = d1.get("d2h_gbps")
    if out.get("streamed_bytes_per_pass") is None:
        out.pop("streamed_bytes_per_pass", None)
        out.pop("streamed_bytes_source", None)
    return out


def _num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def host_pace(device: str) -> dict[str, float]:
    """How fast this machine's host runs the work that paces a host-bound step: nanoseconds an
    iteration of a plain Python loop, and (on CUDA) microseconds to queue a small op on the idle
    current stream; medians of 5. The same code measured 300-400 ms a step on different machines
    of one kind where the host, not the link, set the pace: this tells such machines apart."""
    loops = []
    for _ in range(5):
        t = time.perf_counter()
        acc = 0
        for i in range(200_000):
            acc += i & 7
        loops.append((time.perf_counter() - t) / 200_000 * 1e9)
    out = {"python_loop_ns": round(statistics.median(loops), 2)}
    if device.startswith("cuda") and torch.cuda.is_available():
        x = torch.ones(256, device=device)
        y = torch.empty_like(x)
        launches = []
        for _ in range(5):
            torch.cuda.synchronize(device)
            t = time.perf_counter()
            for _ in range(500):
                torch.add(x, x, out=y)
            launches.append((time.perf_counter() - t) / 500 * 1e6)
        torch.cuda.synchronize(device)
        out["launch_us"] = round(statistics.median(launches), 2)
    return out


def measure(
    fn: Callable[[], object],
    *,
    system: str,
    phase: str,
    reps: int,
    warmup: int,
    device: str,
    weight_bytes: int,
    params: int,
    fields: dict,
    consecutive: Callable[[], object] | None = None,
) -> dict:
    """Warms ``fn`` up, times it and returns the record: ``fields`` (workload, tokens, …) plus the
    common measurements, and ramtorch's own figures when ``system`` is ``ramtorch``.

    With ``consecutive`` (a function that waits for all of ``fn``'s work, e.g. an optimizer's
    pending updates), the calls run back to back, as in a training loop, and the record's time is
    the steady-state time of one: the clock starts when the last warm-up call returns and stops
    when the last timed call returns (each time after a device synchronize), so both ends are at
    the same point of the loop: work a call leaves running (a pipelined optimizer's last updates)
    is inside the window once, from the warm-up call, and the last timed call's is outside. Then
    ``consecutive`` waits for it, untimed."""
    warm(fn, warmup, device)
    if consecutive is not None and warmup < 1:
        raise ValueError("consecutive timing needs a warm-up call (the loop's steady state)")
    reset_peak(device)
    base = gpu_allocated(device)
    before = ramtorch_stats() if system == "ramtorch" else {}
    if consecutive is None:
        s, times = timeit(fn, reps, device)
    else:
        sync(device)
        t = time.perf_counter()
        ends = []
        for _ in range(reps):
            fn()
            sync(device)
            ends.append(time.perf_counter() - t)
        consecutive()
        sync(device)
        s = ends[-1] / reps
        times = [b - a for a, b in zip([0.0, *ends[:-1]], ends)]
    rec = {
        **fields,
        "phase": phase,
        "system": system,
        "seconds": s,
        "seconds_all": times,
        "timing": "per call" if consecutive is None else "steady state of consecutive calls",
        "gpu_peak_bytes": gpu_peak(device),
        "gpu_peak_above_base_bytes": gpu_peak(device) - base,
        "host_rss_bytes": rss(),
        "weight_bytes": weight_bytes,
        "params": params,
        "host_pace": host_pace(device),
    }
    if system == "ramtorch":
        rec.update(ramtorch_fields(before, ramtorch_stats(), reps, phase, weight_bytes))
    return rec
