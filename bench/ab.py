"""A/B of two builds of ramtorch on the same machine: the same workloads, each in its own process,
run in the order A B B A (so drift over the run weighs on both alike), reported per row as B / A.

    python3 bench/ab.py --a /path/to/old/site --b /path/to/new/site --out ab.json [--rounds 1]
        [--rows w1-linear w1-offload w1-step w2-forward arch-resnet arch-resnet-train arch-llama]
        [--tokens 4096]
        [--b-extra=--weights-unchanged]

Rows (BENCH.md names): W1 forward and forward+backward for ``ramtorch-linear`` (per-layer Linear)
and ``ramtorch`` (offload); the W1 training step with the pipelined fp32-master AdamW; W2 forward
(offload, no budget); ``bench/arch.py``'s ResNet at full depth (forward, forward+backward) and an
8-layer Llama (forward+backward, fresh and accumulating), each next to the same model resident. Each
row's figure is the median of its reps in each process; the row's
``b_over_a`` is the mean of B's processes over the mean of A's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

ROWS = {
    "w1-linear": ("w1", ["--system", "ramtorch-linear", "--phases", "forward", "forward_backward"]),
    "w1-offload": ("w1", ["--system", "ramtorch", "--phases", "forward", "forward_backward"]),
    "w1-step": ("w1", ["--system", "ramtorch", "--phases", "step", "--optimizer", "rust-pipeline"]),
    "w2-forward": ("w2", ["--system", "ramtorch"]),
    # ``bench/arch.py`` models (their resident runs are rows too: a control for the machine's noise).
    "arch-resnet": ("arch", ["--arch", "resnet", "--full-depth", "--phases", "forward", "forward_backward"]),
    "arch-resnet-train": (
        "arch",
        ["--arch", "resnet", "--full-depth", "--phases", "forward_backward", "forward_backward_accumulate"],
    ),
    "arch-llama": (
        "arch",
        ["--arch", "llama", "--layers", "8", "--phases", "forward_backward", "forward_backward_accumulate"],
    ),
}


def run(workload: str, args: list[str], path: str, timeout: float) -> list[dict]:
    if workload == "arch":  # writes its records to a file, not as JSON lines
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "arch.json")
            run_process(workload, [*args, "--out", out], path, timeout, from_stdout=False)
            if not os.path.exists(out):
                return []
            with open(out) as fh:
                return [r for r in json.load(fh) if r.get("seconds") is not None]
    return run_process(workload, args, path, timeout)


def run_process(
    workload: str, args: list[str], path: str, timeout: float, from_stdout: bool = True
) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([path, HERE]))
    cmd = [sys.executable, os.path.join(HERE, f"{workload}.py"), *args]
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        print(f"# {' '.join(args)}: timed out after {timeout:.0f} s", file=sys.stderr, flush=True)
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if p.returncode != 0:
        print(f"# {' '.join(args)} failed ({p.returncode}):\n{p.stderr[-3000:]}", file=sys.stderr, flush=True)
    recs = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    got = f"{len(recs)} records" if from_stdout else "done"
    took = time.perf_counter() - t
    print(f"# {workload} {' '.join(args)}: {got} in {took:.1f} s", file=sys.stderr, flush=True)
    return recs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="PYTHONPATH of build A (the old one)")
    ap.add_argument("--b", required=True, help="PYTHONPATH of build B (the new one)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=list(ROWS))
    ap.add_argument("--rounds", type=int, default=1, help="repetitions of the A B B A order")
    ap.add_argument("--tokens", type=int, default=4096, help="W1 tokens per step")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument(
        "--b-extra",
        default="",
        help="arguments added to B's processes only (with --a and --b the same build: an A/B of an "
        "option, e.g. --b-extra=--weights-unchanged)",
    )
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    common = ["--reps", str(a.reps), "--warmup", str(a.warmup)]
    if a.device != "cuda":
        common += ["--device", a.device]
    tiny = ["--tiny"] if a.tiny else []
    seconds: dict[tuple, dict[str, list[float]]] = {}
    records: list[dict] = []
    cmd = "python3 bench/ab.py " + " ".join(
        {"--a": "OLD", "--b": "NEW", "--out": os.path.basename(x)}.get(p, x)
        for p, x in zip([""] + sys.argv[1:], sys.argv[1:])
    )

    def summary() -> list[dict]:
        out = []
        for (row, workload, tokens, phase, system), s in seconds.items():
            ratio = statistics.mean(s["b"]) / statistics.mean(s["a"]) if s["a"] and s["b"] else None
            out.append(
                {"row": row, "workload": workload, "tokens": tokens, "phase": phase, "system": system,
                 "a_seconds": s["a"], "b_seconds": s["b"], "b_over_a": ratio}
            )  # fmt: skip
        return out

    for _ in range(a.rounds):
        for row in a.rows:
            workload, args = ROWS[row]
            extra = ["--tokens", str(a.tokens)] if workload in ("w1", "arch") else []
            if workload == "arch":
                extra += ["--timeout", str(a.timeout)] + (["--smoke"] if a.tiny else [])
            for build in ("a", "b", "b", "a"):
                more = a.b_extra.split() if build == "b" else []
                own = [] if workload == "arch" else tiny
                for r in run(workload, args + extra + common + own + more, getattr(a, build), a.timeout + 30):
                    r["build"] = build
                    records.append(r)
                    k = (row, r["workload"], r.get("tokens"), r["phase"], r["system"])
                    seconds.setdefault(k, {"a": [], "b": []})[build].append(r["seconds"])
                # Rewritten after every process: a run cut short keeps what it measured.
                with open(a.out, "w") as fh:
                    json.dump({"command": cmd, "commit": a.commit, "summary": summary(), "records": records},
                              fh, indent=1)  # fmt: skip
    for s in summary():
        print(f"{s['row']:11s} {s['phase']:17s} {s['system']:16s} A {s['a_seconds']} B {s['b_seconds']} "
              f"B/A {s['b_over_a']}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
