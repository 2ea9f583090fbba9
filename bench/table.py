"""Prints the records of one or more results files (bench/run.py --out) as a markdown table.

    python3 bench/table.py bench/results/2026-12-01-w1.json [bench/results/2026-12-01-w2.json ...]

"vs peers" gives peer time / ramtorch time at the same workload, tokens and phase (> 1: ramtorch is
faster), from the ``vs_<peer>`` fields of ``ramtorch`` records.
"""

from __future__ import annotations

import argparse
import json

SYSTEM_ORDER = (
    "ramtorch",
    "ramtorch-linear",
    "ramtorch-1.11",
    "ramtorch-1.11-linear",
    "accelerate",
    "fsdp2",
    "resident",
)
PHASE_ORDER = ("forward", "forward_backward", "forward_backward_accumulate", "step")
PEER_NAMES = {  # vs_<key> field → short name in the table
    "accelerate": "accelerate",
    "fsdp2": "fsdp2",
    "ramtorch_1_11": "1.11",
    "ramtorch_1_11_linear": "1.11-linear",
    "ramtorch_linear": "linear",
    "resident": "resident",
}


def budget_text(r: dict) -> str:
    if r["system"] != "ramtorch":
        return ""
    b = r.get("gpu_budget")
    return "none" if b is None else str(b)


def order(r: dict) -> tuple:
    sys_rank = SYSTEM_ORDER.index(r["system"]) if r["system"] in SYSTEM_ORDER else len(SYSTEM_ORDER)
    phase_rank = PHASE_ORDER.index(r["phase"]) if r["phase"] in PHASE_ORDER else len(PHASE_ORDER)
    budget = r.get("gpu_budget_bytes")
    return (r["workload"], r["tokens"], phase_rank, sys_rank, -1 if budget is None else budget)


def peers_text(r: dict) -> str:
    parts = []
    for k, name in PEER_NAMES.items():
        v = r.get(f"vs_{k}")
        if isinstance(v, (int, float)):
            parts.append(f"{name} {v:.2f}x")
    return ", ".join(parts)


def table(records: list[dict]) -> str:
    head = (
        "| workload | tokens | phase | system | budget | ms | limit ms | limit / measured | vs peers "
        "| GPU peak (GiB) |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(records, key=order):
        limit = r.get("limit_seconds")
        lim_ms = f"{limit * 1e3:.1f}" if isinstance(limit, (int, float)) else ""
        ratio = r.get("limit_over_measured")
        ratio_s = f"{ratio:.3f}" if isinstance(ratio, (int, float)) else ""
        peak = r.get("gpu_peak_bytes")
        peak_s = f"{peak / 2**30:.2f}" if isinstance(peak, (int, float)) else ""
        cells = [
            r["workload"],
            str(r["tokens"]),
            r["phase"],
            r["system"] + (f" + {r['optimizer']}" if r.get("phase") == "step" and r.get("optimizer") else ""),
            budget_text(r),
            f"{r['seconds'] * 1e3:.1f}",
            lim_ms,
            ratio_s,
            peers_text(r),
            peak_s,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+", help="JSON files written by bench/run.py")
    a = ap.parse_args()
    records: list[dict] = []
    for path in a.results:
        with open(path) as fh:
            data = json.load(fh)
        records += [r for r in data if isinstance(r, dict) and "system" in r and "seconds" in r]
    print(table(records))


if __name__ == "__main__":
    main()
