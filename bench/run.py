"""Runs W1 for every system (each in its own process) and writes the records with the limits.

    python3 bench/run.py --out results.json [--tokens 512 4096 16384] [--baseline /path/to/ramtorch-1.11]

Ceilings (pinned H2D/D2H/duplex bandwidth, resident compute time) are measured in the same run;
see BENCH.md for the protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def bandwidth() -> dict[str, float]:
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
    return {"h2d_gbps": h2d, "d2h_gbps": d2h, "duplex_gbps": duplex}


def run_system(system: str, tokens: list[int], env_path: str | None, extra: list[str]) -> list[dict]:
    env = dict(os.environ)
    if env_path is not None:
        env["PYTHONPATH"] = env_path
    cmd = [
        sys.executable,
        os.path.join(HERE, "w1.py"),
        "--system",
        system,
        "--tokens",
        *map(str, tokens),
        *extra,
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        print(f"{system} failed:\n{p.stderr[-3000:]}", file=sys.stderr)
    out = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    for r in out:
        print(json.dumps(r), flush=True)
    return out


def command_line() -> str:
    """This run's command, with the output file and baseline folder reduced to placeholders."""
    args, out = sys.argv[1:], []
    for i, a in enumerate(args):
        prev = args[i - 1] if i else ""
        out.append({"--out": "w1.json", "--baseline": "BASELINE", "--ours": "OURS"}.get(prev, a))
    return "python3 bench/run.py " + " ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 4096, 16384])
    ap.add_argument("--baseline", default=None, help="PYTHONPATH of the original RamTorch 1.11")
    ap.add_argument("--ours", default=None, help="PYTHONPATH of this package (default: inherited)")
    ap.add_argument("--commit", default="unknown")
    a = ap.parse_args()
    bw = bandwidth()
    print(json.dumps(bw), flush=True)
    records = []
    records += run_system("resident", a.tokens, a.ours, [])
    records += run_system("ramtorch-linear", a.tokens, a.ours, [])
    if a.baseline:
        records += run_system("ramtorch-1.11-linear", a.tokens, a.baseline, [])
    resident = {(r["tokens"], r["phase"]): r["seconds"] for r in records if r["system"] == "resident"}
    for r in records:
        w = r["weight_bytes"]
        comp = resident.get((r["tokens"], r["phase"]), 0.0)
        if r["phase"] == "forward":
            link = w / (bw["h2d_gbps"] * 1e9)
        else:  # weights cross twice, gradients once; the link is full duplex
            link = max(2 * w / (bw["h2d_gbps"] * 1e9), 3 * w / (bw["duplex_gbps"] * 1e9))
        r["limit_seconds"] = max(comp, link) if r["system"] != "resident" else comp
        r["limit_over_measured"] = r["limit_seconds"] / r["seconds"]
        r.update(
            h2d_gbps=bw["h2d_gbps"],
            d2h_gbps=bw["d2h_gbps"],
            duplex_gbps=bw["duplex_gbps"],
            device=torch.cuda.get_device_name(),
            commit=a.commit,
            gpus=1,
            command="python3 bench/run.py " + " ".join(sys.argv[1:]),
        )
    with open(a.out, "w") as fh:
        json.dump(records, fh, indent=1)


if __name__ == "__main__":
    main()
