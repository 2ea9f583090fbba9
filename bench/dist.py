"""W1 training on several GPUs of one node with one copy of the weights in host RAM; prints one JSON
record per run and, with several ``--gpus``, the scaling against the smallest.

    python3 bench/dist.py --gpus 1 2 [--tokens 4096] [--stage 2] [--reps 3] [--warmup 1]
        [--no-share] [--budget none] [--out results.json] [--commit abc1234]
    python3 bench/dist.py --device cpu --tiny --gpus 1 2 --reps 2     # smoke test: gloo, tiny W1

Target: W1 training throughput with 2 GPUs at least 1.8x one GPU, host memory of the 2 ranks (sum
of their Pss) at most 1.1x that of one rank.

Each entry of ``--gpus`` is a separate run: this launcher starts N fresh worker processes (this
file with ``--worker``; ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_*`` set as ``torchrun``
would) and watches them. A rank that exits non-zero stops the run: the others get a few seconds to
report their own error, then are killed, and the launcher exits non-zero. ``--run-timeout`` bounds a
run's wall time and ``--collective-timeout`` every collective (``ramtorch.distributed.init``).
Workers' output goes to stderr; stdout carries only the JSON records.

Each rank:

1. builds W1 (``bench/w1.py``'s ``Stack``, bf16 ``Linear`` layers without bias) on its compute
   device; with shared weights only rank 0 fills them with random values (the other ranks' copies
   are overwritten by ``share_parameters`` and stay uninitialised);
2. ``ramtorch.offload(model, device=...)``: the units are packed from the device straight into
   the rank's host arena (no pageable copy);
3. ``ramtorch.distributed.share_parameters(model)`` (unless ``--no-share``): rank 0 copies its
   units into one ``memfd`` region that every rank maps; each rank's private packing goes back to
   the arena pool and ``ramtorch.empty_cache()`` returns it to the OS. So during setup every rank
   briefly holds a private packed copy (7.0 GiB for W1, pinned) next to the shared one: the
   ``host_peak_rss_bytes_per_rank`` field (VmHWM) shows it; the memory figures that count are
   measured after the timed steps;
4. ``ramtorch.optim.AdamW(params, lr=1e-5).shard(stage=--stage)`` (ZeRO; with one rank the
   optimizer is not sharded unless ``--shard-single``);
5. times full steps ``loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)`` on its own
   batch of ``--tokens`` tokens, each followed by a device synchronize and ``ramtorch.synchronize()``,
   with a barrier before each timed step.

A step's time is the slowest rank's; ``seconds`` is the median over ``--reps`` and
``tokens_per_second`` = N x tokens / seconds. Host memory is read by each rank from
``/proc/self/smaps_rollup`` after the timed steps: ``Pss`` (shared pages split between the
processes mapping them) summed over the ranks is ``host_pss_bytes_total``, the figure compared
across runs; ``Rss`` per rank is reported too (it counts the shared weights in every rank).

Backend: on CUDA the process group is ``cpu:gloo,cuda:nccl`` (``ramtorch.distributed.init``'s
default): ZeRO-2 reduces the gradients on the GPUs with NCCL, and the few host tensors (barriers,
the gradient norm when clipping) go through gloo; ``--backend`` overrides. Each rank's Rust
optimizer pool gets cores / N threads (``RAYON_NUM_THREADS``, unless set).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TARGET_THROUGHPUT_EFFICIENCY = 0.9  # 2 GPUs: 1.8x one GPU
TARGET_HOST_MEMORY_RATIO = 1.1
GRACE_SECONDS = 10.0  # after a rank fails, how long the others may take to report their own error


# ---------------------------------------------------------------------------------------------
# Launcher (no torch import: the parent holds no CUDA context and no memory worth counting).


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def commit_of(repo: Path) -> str:
    """The checked-out commit (short hash), read-only; ``unknown`` outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def worker_argv(a: argparse.Namespace, result: Path) -> list[str]:
    """The worker's command line: this file with ``--worker`` and the options that shape a run."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--result", str(result)]
    argv += ["--device", a.device, "--tokens", str(a.tokens), "--stage", str(a.stage)]
    argv += ["--d", str(a.d), "--f", str(a.f), "--layers", str(a.layers)]
    argv += ["--reps", str(a.reps), "--warmup", str(a.warmup), "--budget", a.budget]
    argv += ["--collective-timeout", str(a.collective_timeout)]
    if a.backend:
        argv += ["--backend", a.backend]
    if a.tiny:
        argv.append("--tiny")
    if a.no_share:
        argv.append("--no-share")
    if a.shard_single:
        argv.append("--shard-single")
    if a.via_host:
        argv.append("--via-host")
    return argv


def die_with_parent() -> None:
    """In a worker, before exec: SIGKILL when the launcher dies (even by SIGKILL), so that no rank
    outlives it holding tens of GiB. Linux only; elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def stop(procs: list[subprocess.Popen]) -> None:
    """Terminates the workers still running (each leads its own process group), then kills them."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    for p in live:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def launch(a: argparse.Namespace, n: int) -> dict:
    """Runs one world of ``n`` ranks; returns rank 0's record. Raises RuntimeError when a rank
    fails or the run exceeds ``--run-timeout``."""
    with tempfile.TemporaryDirectory(prefix="ramtorch-dist-") as tmp:
        result = Path(tmp, "record.json")
        env = dict(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            WORLD_SIZE=str(n),
            LOCAL_WORLD_SIZE=str(n),
            PYTHONUNBUFFERED="1",
        )
        threads = str(max(1, cpu_count() // n))
        env.setdefault("RAYON_NUM_THREADS", threads)
        env.setdefault("OMP_NUM_THREADS", threads)
        argv = worker_argv(a, result)
        print(f"# dist.py: {n} rank(s): {shlex.join(argv[1:])}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        deadline = t0 + a.run_timeout
        procs: list[subprocess.Popen] = []
        try:
            for r in range(n):
                procs.append(
                    subprocess.Popen(
                        argv,
                        env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                        stdout=sys.stderr,  # stdout stays for the records
                        start_new_session=True,  # its own process group: stop() takes its children too
                        preexec_fn=die_with_parent,
                    )
                )
            failed: list[tuple[int, int]] = []
            while True:
                codes = [p.poll() for p in procs]
                failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if failed or all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    stuck = [r for r, c in enumerate(codes) if c is None]
                    raise RuntimeError(
                        f"{n} rank(s): timed out after {a.run_timeout:.0f} s (--run-timeout); "
                        f"ranks {stuck} still running, killed"
                    )
                time.sleep(0.2)
            if failed:
                # The others usually fail on their own soon (a collective with a dead peer).
                end = min(deadline, time.monotonic() + GRACE_SECONDS)
                while time.monotonic() < end and any(p.poll() is None for p in procs):
                    time.sleep(0.2)
                codes = [p.poll() for p in procs]
                desc = ", ".join(
                    f"rank {r}: {'killed' if c is None else f'exit {c}'}" for r, c in enumerate(codes)
                )
                raise RuntimeError(f"{n} rank(s) failed ({desc}); the ranks' errors are above")
        finally:
            stop(procs)
        if not result.exists():
            raise RuntimeError(f"{n} rank(s): every rank exited 0 but rank 0 wrote no record")
        rec = json.loads(result.read_text())
        rec["run_wall_seconds"] = time.monotonic() - t0
        return rec


def scaling(base: dict, rec: dict) -> dict:
    """The record comparing run ``rec`` with the run ``base`` of fewer GPUs."""
    n, b = rec["gpus"], base["gpus"]
    tput = rec["tokens_per_second"] / base["tokens_per_second"]
    mem = rec["host_pss_bytes_total"] / base["host_pss_bytes_total"]
    target = TARGET_THROUGHPUT_EFFICIENCY * n / b
    return {
        "workload": rec["workload"],
        "phase": "scaling",
        "system": "ramtorch",
        "tokens": rec["tokens"],
        "gpus": n,
        "baseline_gpus": b,
        "throughput_ratio": tput,
        "throughput_efficiency": tput / (n / b),
        "host_memory_ratio": mem,
        "host_rss_total_ratio": rec["host_rss_bytes_total"] / base["host_rss_bytes_total"],
        "target_throughput_ratio": target,
        "target_host_memory_ratio": TARGET_HOST_MEMORY_RATIO,
        "meets_throughput_target": tput >= target,
        "meets_host_memory_target": mem <= TARGET_HOST_MEMORY_RATIO,
        "tokens_per_second": [base["tokens_per_second"], rec["tokens_per_second"]],
        "seconds": [base["seconds"], rec["seconds"]],
        "host_pss_bytes_total": [base["host_pss_bytes_total"], rec["host_pss_bytes_total"]],
        "shared": rec["shared"],
        "zero_stage": rec["zero_stage"],
        "optimizer": rec["optimizer"],
        "device": rec.get("device"),
        "commit": rec.get("commit"),
        "command": rec.get("command"),
    }


def launcher(a: argparse.Namespace) -> int:
    def terminated(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # runs launch()'s cleanup: the workers are stopped

    signal.signal(signal.SIGTERM, terminated)
    signal.signal(signal.SIGHUP, terminated)
    meta = {
        "commit": a.commit or commit_of(HERE.parent),
        "command": "python3 bench/dist.py " + shlex.join(sys.argv[1:]),
    }
    records: list[dict] = []
    runs: dict[int, dict] = {}

    def save() -> None:
        if a.out:
            Path(a.out).write_text(json.dumps(records, indent=1) + "\n")

    for n in a.gpus:
        try:
            rec = launch(a, n)
        except RuntimeError as e:
            print(f"dist.py: {e}", file=sys.stderr, flush=True)
            save()
            return 1
        rec.update(meta)
        records.append(rec)
        runs[n] = rec
        print(json.dumps(rec), flush=True)
        gib = 2**30
        print(
            f"# {n} GPU(s): step {rec['seconds'] * 1e3:.1f} ms, {rec['tokens_per_second']:.0f} tokens/s, "
            f"host Pss {rec['host_pss_bytes_total'] / gib:.2f} GiB in all "
            f"(Rss per rank {[round(x / gib, 2) for x in rec['host_rss_bytes_per_rank']]} GiB), "
            f"run {rec['run_wall_seconds']:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        save()
    if len(runs) > 1:
        base = runs[min(runs)]
        for n in sorted(runs):
            if n == base["gpus"]:
                continue
            s = scaling(base, runs[n])
            records.append(s)
            print(json.dumps(s), flush=True)
            print(
                f"# scaling {n}/{base['gpus']} GPUs: throughput {s['throughput_ratio']:.3f}x "
                f"(target >= {s['target_throughput_ratio']:.2f}: "
                f"{'met' if s['meets_throughput_target'] else 'NOT met'}), "
                f"host memory (sum of Pss) {s['host_memory_ratio']:.3f}x "
                f"(target <= {TARGET_HOST_MEMORY_RATIO}: "
                f"{'met' if s['meets_host_memory_target'] else 'NOT met'})",
                file=sys.stderr,
                flush=True,
            )
        save()
    return 0


# ---------------------------------------------------------------------------------------------
# Worker (one rank).


def smaps() -> dict[str, int]:
    """This process's ``/proc/self/smaps_rollup`` in bytes (Rss, Pss, Pss_Anon, Pss_Shmem, ...)
    plus ``VmHWM`` (peak resident set) from ``/proc/self/status``."""
    out: dict[str, int] = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0].endswith(":") and parts[2] == "kB":
            out[parts[0][:-1]] = int(parts[1]) * 1024
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            out["VmHWM"] = int(line.split()[1]) * 1024
    return out


def worker(a: argparse.Namespace) -> None:
    """One rank; rank 0 writes the run's record to ``--result``. Any error: traceback, exit 1."""
    try:
        rec = run_rank(a)
        if rec is not None:
            Path(a.result).write_text(json.dumps(rec))
    except BaseException:  # noqa: BLE001 - reported, then a hard exit: no teardown can hang
        print(f"dist.py: rank {os.environ.get('RANK')} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    # A hard exit: unpinning and unmapping tens of GiB, or tearing down NCCL, only costs time here.
    os._exit(0)


def run_rank(a: argparse.Namespace) -> dict | None:
    import ramtorch
    import ramtorch.distributed as rdist
    import ramtorch.optim as ropt
    import torch
    import torch.distributed as dist
    from benchlib import budget_arg, jsonable, parse_bytes
    from torch import nn
    from w1 import Stack, loss_of

    # ramtorch reports memory it could not pin (memlock limit, driver refusal) as a ResourceWarning,
    # which Python hides by default: show it and keep it in the record.
    caught: list[str] = []

    def show(message: Warning | str, category: type[Warning], *_: object, **__: object) -> None:
        caught.append(f"{category.__name__}: {message}")
        print(f"dist.py: rank {os.environ.get('RANK')}: {category.__name__}: {message}", file=sys.stderr)

    warnings.showwarning = show
    warnings.simplefilter("always", ResourceWarning)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = a.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(local)
        dev = f"cuda:{local}"
    else:
        dev = a.device
    backend = a.backend or ("cpu:gloo,cuda:nccl" if cuda else "gloo")
    rdist.init(backend=backend, timeout_seconds=a.collective_timeout)
    share = not a.no_share
    budget = budget_arg(a.budget)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
        if hasattr(ramtorch, "synchronize"):
            ramtorch.synchronize()

    # -- setup ---------------------------------------------------------------------------------
    t0 = time.perf_counter()
    dt = torch.bfloat16
    fill = rank == 0 or not share  # shared: the other ranks' values are replaced by rank 0's
    gen = torch.Generator(device=dev).manual_seed(0)  # --no-share: every rank the same weights

    def linear(i: int, o: int) -> nn.Module:
        lin = torch.nn.utils.skip_init(nn.Linear, i, o, bias=False, device=dev, dtype=dt)
        if fill:
            with torch.no_grad():
                lin.weight.normal_(0.0, i**-0.5, generator=gen)
        return lin

    model = Stack([nn.Sequential(linear(a.d, a.f), nn.GELU(), linear(a.f, a.d)) for _ in range(a.layers)])
    nparams = sum(p.numel() for p in model.parameters())
    wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    sync()
    t_build = time.perf_counter()
    if a.via_host:  # bench/w1.py's way: a pageable host copy first (more memory, more time)
        model.to("cpu")
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    model = ramtorch.offload(model, gpu_budget=budget, device=dev, progress=False)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()  # the built copy on the device is gone
    t_offload = time.perf_counter()
    if share:
        rdist.share_parameters(model, src_rank=0)
    gc.collect()
    if hasattr(ramtorch, "empty_cache"):
        ramtorch.empty_cache()  # the private packing, now pooled, back to the OS
    t_share = time.perf_counter()
    params = list(model.parameters())
    opt = ropt.AdamW(params, lr=1e-5)
    sharded = world > 1 or a.shard_single
    if sharded:
        opt.shard(stage=a.stage)
    dist.barrier()
    setup = {
        "build_seconds": t_build - t0,
        "offload_seconds": t_offload - t_build,
        "share_seconds": t_share - t_offload,
        "setup_seconds": time.perf_counter() - t0,
        "mem": smaps(),
        "arena": ramtorch.stats().get("host", {}) if hasattr(ramtorch, "stats") else {},
    }

    # -- timed steps ---------------------------------------------------------------------------
    g = torch.Generator(device=dev).manual_seed(1000 + rank)
    x = torch.randn(a.tokens, a.d, device=dev, dtype=dt, generator=g)

    def step() -> None:
        loss_of(model(x)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()

    t = time.perf_counter()
    for _ in range(a.warmup):  # the first step also allocates the optimizer's state
        step()
    warmup_seconds = time.perf_counter() - t
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(a.reps):
        dist.barrier()
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    dist.barrier()
    gc.collect()
    mine = {
        "rank": rank,
        "pid": os.getpid(),
        "times": times,
        "warmup_seconds": warmup_seconds,
        "setup": setup,
        "mem": smaps(),
        "arena": ramtorch.stats().get("host", {}) if hasattr(ramtorch, "stats") else {},
        "gpu_peak_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
        "optimizer_timings": dict(getattr(opt, "timings", {})),
        "owned_params": sum(p.numel() for p in params if opt.state.get(p)),
        "engine": jsonable(ramtorch.stats().get("devices", {}).get(dev))
        if hasattr(ramtorch, "stats")
        else None,
        "warnings": caught,
    }
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None

    # -- the record (rank 0) -------------------------------------------------------------------
    per_rep = [max(r["times"][k] for r in everyone) for k in range(a.reps)]
    seconds = statistics.median(per_rep)
    pss = [r["mem"].get("Pss", 0) for r in everyone]
    rss = [r["mem"].get("Rss", 0) for r in everyone]
    gpu_peak = [r["gpu_peak_bytes"] for r in everyone]
    rec: dict[str, Any] = {
        "workload": "W1",
        "tokens": a.tokens,
        "tokens_global": world * a.tokens,
        "phase": "step",
        "system": "ramtorch",
        "gpus": world,
        "world_size": world,
        "seconds": seconds,
        "seconds_all": per_rep,
        "seconds_per_rank": [r["times"] for r in everyone],
        "tokens_per_second": world * a.tokens / seconds,
        "optimizer": "ramtorch.optim.AdamW(fp32 master)",
        "zero_stage": a.stage if sharded else None,
        "shared": share,
        "host_pss_bytes_total": sum(pss),
        "host_pss_bytes_per_rank": pss,
        "host_rss_bytes_total": sum(rss),
        "host_rss_bytes_per_rank": rss,
        "host_rss_bytes": rss[0],
        "host_peak_rss_bytes_per_rank": [r["mem"].get("VmHWM", 0) for r in everyone],
        "host_pss_detail_per_rank": [
            {k: r["mem"][k] for k in ("Pss_Anon", "Pss_Shmem", "Pss_File") if k in r["mem"]} for r in everyone
        ],
        "host_pss_bytes_total_setup": sum(r["setup"]["mem"].get("Pss", 0) for r in everyone),
        "host_rss_bytes_per_rank_setup": [r["setup"]["mem"].get("Rss", 0) for r in everyone],
        "host_arena_pooled_bytes_total": sum(r["arena"].get("pooled_bytes", 0) for r in everyone),
        "arena_per_rank": [r["arena"] for r in everyone],
        "arena_per_rank_setup": [r["setup"]["arena"] for r in everyone],
        "gpu_peak_bytes": max(gpu_peak),
        "gpu_peak_bytes_per_rank": gpu_peak,
        "weight_bytes": wbytes,
        "params": nparams,
        "owned_params_per_rank": [r["owned_params"] for r in everyone],
        "setup_seconds": max(r["setup"]["setup_seconds"] for r in everyone),
        "setup_per_rank": [
            {k: v for k, v in r["setup"].items() if k not in ("mem", "arena")} for r in everyone
        ],
        "warmup_seconds": max(r["warmup_seconds"] for r in everyone),
        "optimizer_timings_per_rank": [r["optimizer_timings"] for r in everyone],
        "engine_per_rank": [r["engine"] for r in everyone],
        "warnings_per_rank": [r["warnings"] for r in everyone],
        "reps": a.reps,
        "warmup": a.warmup,
        "gpu_budget": budget,
        "gpu_budget_bytes": parse_bytes(budget),
        "backend": backend,
        "via_host": a.via_host,
        "rayon_threads": os.environ.get("RAYON_NUM_THREADS"),
        "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        "device": torch.cuda.get_device_name(dev) if cuda else a.device,
    }
    if not cuda:
        rec["device_kind"] = a.device
    if a.tiny:
        rec["tiny"] = True
        rec["workload"] = "W1-tiny"
    return rec


# ---------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2], help="world sizes, one run each")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank per step")
    ap.add_argument("--stage", type=int, choices=[1, 2], default=2, help="ZeRO stage of the optimizer")
    ap.add_argument("--no-share", action="store_true", help="every rank keeps its own copy of the weights")
    ap.add_argument(
        "--shard-single", action="store_true", help="shard the optimizer also with one rank (ZeRO of one)"
    )
    ap.add_argument(
        "--via-host",
        action="store_true",
        help="move the built model to host RAM before offload (as bench/w1.py does) instead of "
        "packing straight from the device",
    )
    ap.add_argument("--budget", default="none", help="ramtorch gpu_budget: bytes, e.g. 8GiB, or none")
    ap.add_argument("--d", type=int, default=8192)
    ap.add_argument("--f", type=int, default=28672)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument(
        "--backend", default=None, help="process group backend (default cpu:gloo,cuda:nccl / gloo)"
    )
    ap.add_argument("--collective-timeout", type=float, default=180.0, help="seconds for any collective")
    ap.add_argument("--run-timeout", type=float, default=300.0, help="seconds for one run, setup included")
    ap.add_argument("--out", default=None, help="also write every record to this file (a JSON list)")
    ap.add_argument("--commit", default=None, help="default: git rev-parse --short HEAD")
    # Hidden: the CPU smoke test, and the worker side of the launcher.
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.tiny:
        a.d, a.f, a.layers = 64, 160, 3
    if a.worker:
        worker(a)
        return
    if any(n < 1 for n in a.gpus):
        ap.error("--gpus: world sizes must be at least 1")
    if a.reps < 1 or a.warmup < 0:
        ap.error("--reps must be at least 1 and --warmup at least 0")
    sys.exit(launcher(a))


if __name__ == "__main__":
    main()
