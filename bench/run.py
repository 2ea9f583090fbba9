"""Runs W1 and W2 for every chosen system (each in its own process) and writes the records with the
limits and the ratios against the peers.

    python3 bench/run.py --out results.json [--workloads w1 w2] [--tokens 512 4096 16384]
        [--systems resident ramtorch accelerate ...] [--budgets none 4GiB 8GiB]
        [--baseline /path/to/ramtorch-1.11] [--ours /path/to/this/package]

Ceilings (pinned H2D/D2H/duplex bandwidth, resident compute time) are measured in the same run;
see BENCH.md for the protocol. Limits:

- forward: max(resident forward, streamed weight bytes / H2D);
- forward+backward: max(resident forward+backward, 2 × streamed / H2D, weights / D2H,
  (2 × streamed + weights) / duplex): weights cross twice, gradients once.

Streamed weight bytes are the model's weight bytes, except for a ``ramtorch`` record that reports
``streamed_bytes_per_pass`` (under a GPU budget part of the model stays resident). Each ``ramtorch``
record carries ``vs_<peer>`` = peer seconds / ramtorch seconds at the same workload, tokens and
phase (> 1: ramtorch is faster). The results file is rewritten after every system, so a run cut
short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import w1
import w2
from benchlib import multi_link_h2d_gbps

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = {"w1": list(w1.SYSTEMS), "w2": list(w2.SYSTEMS)}
BASELINE = ("ramtorch-1.11", "ramtorch-1.11-linear")  # run with PYTHONPATH=--baseline
PEERS = ("resident", "accelerate", "ramtorch-1.11", "ramtorch-1.11-linear", "ramtorch-linear", "fsdp2")


def bandwidth(device: str = "cuda") -> dict[str, float]:
    if not device.startswith("cuda"):  # smoke runs: host copy speed stands in for the link
        a, b = torch.empty(1 << 28, dtype=torch.uint8), torch.empty(1 << 28, dtype=torch.uint8)
        t = time.perf_counter()
        b.copy_(a)
        g = a.numel() / (time.perf_counter() - t) / 1e9
        return {"h2d_gbps": g, "d2h_gbps": g, "duplex_gbps": g, "host_gbps": 2 * g}
    n = 2 << 30
    h = torch.empty(n, dtype=torch.uint8).pin_memory()
    h2 = torch.empty(n, dtype=torch.uint8).pin_memory()
    d = torch.empty(n, dtype=torch.uint8, device="cuda")
    d2 = torch.empty(n, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def run(fn, reps: int = 3) -> float:
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / reps

    h2d = n / run(lambda: d.copy_(h, non_blocking=True)) / 1e9
    d2h = n / run(lambda: h.copy_(d, non_blocking=True)) / 1e9

    def both() -> None:
        with torch.cuda.stream(s1):
            d.copy_(h, non_blocking=True)
        with torch.cuda.stream(s2):
            h2.copy_(d2, non_blocking=True)

    duplex = 2 * n / run(both) / 1e9
    host = host_bandwidths()
    return {"h2d_gbps": h2d, "d2h_gbps": d2h, "duplex_gbps": duplex, "host_gbps": max(host.values()), **host}


def host_bandwidths() -> dict[str, float]:
    """Host memory bandwidth in GB/s of a 4 GiB copy (read + write), an in-place add (``a += b``:
    two reads, one write, no write-allocate), a read-only sum, all on every core, and (when this
    package is importable) of ramtorch's fp32-master AdamW kernel alone over 2^28 parameters
    (28 B of traffic each). The limit uses the best of them: an optimizer streams mostly in place,
    so a plain copy alone would understate what it can reach, and a limit below what our own kernel
    reaches alone would flatter every ratio to it."""
    a = torch.ones(1 << 30, dtype=torch.float32)
    b = torch.empty_like(a)

    def best(fn: object, nbytes: int) -> float:
        fn()  # type: ignore[operator]
        t = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()  # type: ignore[operator]
            t.append(time.perf_counter() - t0)
        return nbytes / min(t) / 1e9

    n = a.numel() * 4
    out = {
        "host_copy_gbps": best(lambda: b.copy_(a), 2 * n),
        "host_add_gbps": best(lambda: b.add_(a), 3 * n),
        "host_sum_gbps": best(lambda: a.sum(), n),
    }
    a = b = None
    try:
        from ramtorch import _core
    except ImportError:
        return out
    p = 1 << 28
    master, m, v = torch.empty(p).uniform_(-1, 1), torch.zeros(p), torch.zeros(p)
    w, g = torch.empty(p, dtype=torch.bfloat16), torch.empty(p, dtype=torch.bfloat16).normal_()
    step = [0]

    def adamw() -> None:
        step[0] += 1
        _core.adamw_step(
            w, "bfloat16", g, "bfloat16", m, v, "float32",
            master=master, numel=p, step=step[0], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
            weight_decay=1e-2,
        )  # fmt: skip

    out["host_adamw_gbps"] = best(adamw, 28 * p)
    return out


def run_system(
    workload: str, system: str, args: list[str], env_path: str | None, timeout: float
) -> list[dict]:
    env = dict(os.environ)
    if env_path is not None:
        env["PYTHONPATH"] = env_path
    cmd = [sys.executable, os.path.join(HERE, f"{workload}.py"), "--system", system, *args]
    label = f"{workload} {system} {' '.join(args)}"
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        stdout, failed = p.stdout, p.returncode != 0
        if failed:
            print(f"{label} failed ({p.returncode}):\n{p.stderr[-3000:]}", file=sys.stderr)
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        print(f"{label} timed out after {timeout:.0f} s:\n{err[-3000:]}", file=sys.stderr)
    out = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    for r in out:
        print(json.dumps(r), flush=True)
    print(f"# {label}: {len(out)} records in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    return out


def command_line() -> str:
    """This run's command, with the output file (its name kept) and package folders as placeholders."""
    args, out = sys.argv[1:], []
    for i, a in enumerate(args):
        prev = args[i - 1] if i else ""
        if prev == "--out":
            out.append(os.path.basename(a))
        else:
            out.append({"--baseline": "BASELINE", "--ours": "OURS"}.get(prev, a))
    return "python3 bench/run.py " + " ".join(out)


def peer_key(system: str) -> str:
    return "vs_" + system.replace("-", "_").replace(".", "_")


def key(r: dict) -> tuple:
    """Records comparable with each other: same workload, tokens and phase."""
    return r["workload"], r["tokens"], r["phase"]


def finish(records: list[dict], bw: dict[str, float], meta: dict) -> None:
    """Adds limits, peer ratios, ceilings and provenance to every record (in place)."""
    resident = {key(r): r["seconds"] for r in records if r["system"] == "resident"}
    # A training step computes at least what resident forward+backward does.
    for r in records:
        if r["system"] == "resident" and r["phase"] == "forward_backward":
            resident.setdefault((r["workload"], r["tokens"], "step"), r["seconds"])
            resident.setdefault((r["workload"], r["tokens"], "forward_backward_accumulate"), r["seconds"])
    peers: dict[tuple, dict[str, float]] = {}
    for r in records:
        if r["system"] in PEERS:
            peers.setdefault(key(r), {})[r["system"]] = r["seconds"]
    h2d, d2h, duplex = (bw[k] * 1e9 for k in ("h2d_gbps", "d2h_gbps", "duplex_gbps"))
    for r in records:
        w = r["weight_bytes"]
        comp = resident.get(key(r))
        if r["system"] == "resident":
            limit, streamed = r["seconds"], 0
        else:
            streamed = r.get("streamed_bytes_per_pass", w) if r["system"] == "ramtorch" else w
            if r.get("link_bytes_per_pass") and r["phase"] == "forward":
                # A compressed record: its limit is its encoded bytes over the link; its gain is
                # over the uncompressed one-link limit (the bf16 floor).
                r["bf16_floor_seconds"] = max(comp or 0.0, streamed / h2d)
                r["speedup_vs_bf16_floor"] = r["bf16_floor_seconds"] / r["seconds"]
                streamed = r["link_bytes_per_pass"]
            if r.get("links", 1) > 1 and bw.get("multi_link_h2d_gbps"):
                # Several links: the limit is the measured ceiling of them all; the gain is over
                # the one-link limit.
                r["one_link_floor_seconds"] = max(comp or 0.0, streamed / h2d)
                r["speedup_vs_one_link"] = r["one_link_floor_seconds"] / r["seconds"]
                link = streamed / (bw["multi_link_h2d_gbps"] * 1e9)
            elif r["phase"] == "forward":
                link = streamed / h2d
            else:
                link = max(2 * streamed / h2d, w / d2h, (2 * streamed + w) / duplex)
            limit = max(comp or 0.0, link)
            if r["phase"] == "step" and bw.get("host_gbps"):
                r["limit_optimizer_seconds"] = r.get("optimizer_host_bytes", 0) / (bw["host_gbps"] * 1e9)
                limit = max(limit, r["limit_optimizer_seconds"])
        r["limit_seconds"] = limit
        r["limit_over_measured"] = limit / r["seconds"]
        r["limit_compute_seconds"] = comp
        r["limit_streamed_bytes"] = streamed
        if r["system"] == "ramtorch":
            for peer, s in sorted(peers.get(key(r), {}).items()):
                r[peer_key(peer)] = s / r["seconds"]
        r.update(bw, **meta)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--workloads", nargs="+", choices=sorted(SYSTEMS), default=["w1", "w2"])
    ap.add_argument("--systems", nargs="+", default=None, help="default: every system of each workload")
    ap.add_argument("--budgets", nargs="+", default=["none"], help="ramtorch gpu_budgets: none 8GiB ...")
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 4096, 16384], help="W1 tokens per step")
    ap.add_argument(
        "--phases", nargs="+", default=["forward", "forward_backward"], help="W1 phases (and 'step')"
    )
    ap.add_argument(
        "--optimizers",
        nargs="+",
        default=["rust"],
        help="W1 phase 'step' of ramtorch: rust, rust-pipeline, rust-bf16, rust-bf16-pipeline, "
        "torch-fused (one run each)",
    )
    ap.add_argument(
        "--compress",
        nargs="+",
        default=["none"],
        help="ramtorch offload(compress=...): none lossless fp8 (one run each; forward phase only)",
    )
    ap.add_argument(
        "--links",
        nargs="+",
        default=["none"],
        help="ramtorch offload(links=...): none auto cuda:1,... (one run each; forward phase only). "
        "With any, the ceiling of host->cuda:0 over every link is measured first (multi_link_h2d_gbps)",
    )
    ap.add_argument("--seq", type=int, default=2048, help="W2 sequence length (batch 1)")
    ap.add_argument("--w2-gpu-cap", default=None, help="GPU memory cap of W2's offloading systems")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300, help="seconds allowed to one system's process")
    ap.add_argument("--baseline", default=None, help="PYTHONPATH of the original RamTorch 1.11")
    ap.add_argument("--ours", default=None, help="PYTHONPATH of this package (default: inherited)")
    ap.add_argument("--commit", default="unknown")
    # Hidden: check the harness on the CPU with tiny models.
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    known = {s for v in SYSTEMS.values() for s in v}
    if a.systems is not None and not set(a.systems) <= known:
        ap.error(f"unknown systems {sorted(set(a.systems) - known)}; known: {sorted(known)}")

    bw = bandwidth(a.device)
    if any(v != "none" for v in a.links) and a.device.startswith("cuda") and torch.cuda.device_count() > 1:
        peers = [i for i in range(1, torch.cuda.device_count()) if torch.cuda.can_device_access_peer(0, i)]
        bw["multi_link_h2d_gbps"] = multi_link_h2d_gbps(peers)
        bw["topology"] = {
            "gpus": torch.cuda.device_count(),
            "peers_of_cuda0": peers,
        }
        torch.cuda.empty_cache()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # hold neither GPU nor pinned memory while the systems run
        getattr(torch._C, "_host_emptyCache", lambda: None)()
    print(json.dumps(bw), flush=True)
    meta = {
        "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device,
        "commit": a.commit,
        "gpus": 1 if a.device.startswith("cuda") else 0,
        "command": command_line(),
    }
    common = ["--reps", str(a.reps), "--warmup", str(a.warmup)]
    if a.device != "cuda":
        common += ["--device", a.device]
    if a.tiny:
        common.append("--tiny")
    records: list[dict] = []
    for wl in a.workloads:
        systems = [s for s in SYSTEMS[wl] if a.systems is None or s in a.systems]
        if wl == "w1":
            args = ["--tokens", *map(str, a.tokens), "--phases", *a.phases, *common]
        else:
            args = ["--seq", str(a.seq), *common]
        for system in systems:
            if system in BASELINE and not a.baseline:
                print(f"# {wl} {system}: skipped (no --baseline)", file=sys.stderr)
                continue
            path = a.baseline if system in BASELINE else a.ours
            extra = list(args)
            if wl == "w2" and a.w2_gpu_cap and system != "resident":
                extra += ["--gpu-cap", a.w2_gpu_cap]
            optimizers = (
                a.optimizers if (system == "ramtorch" and wl == "w1" and "step" in a.phases) else [None]
            )
            combos = [
                (budget, codec, links)
                for budget in (a.budgets if system == "ramtorch" else [None])
                for codec in (a.compress if system == "ramtorch" else ["none"])
                for links in (a.links if system == "ramtorch" else ["none"])
            ]
            for budget, codec, links in combos:
                for k, optimizer in enumerate(optimizers):
                    more = ["--budget", budget] if budget is not None else []
                    if codec != "none":
                        more += ["--compress", codec]
                        if wl == "w1":
                            more += ["--phases", "forward"]
                    if links != "none":
                        more += ["--links", links]
                        if wl == "w1" and codec == "none":
                            more += ["--phases", "forward"]
                    if optimizer is not None:
                        more += ["--optimizer", optimizer]
                        if k > 0:  # the other phases were measured with the first optimizer
                            more += ["--phases", "step"]
                    records += run_system(wl, system, extra + more, path, a.timeout)
                    finish(records, bw, meta)
                    with open(a.out, "w") as fh:
                        json.dump(records, fh, indent=1)


if __name__ == "__main__":
    main()
