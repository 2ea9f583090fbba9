"""Where the compute stream sat idle in a ``torch.profiler`` Chrome trace (one written by
``bench/profile_arch.py --torch-trace --out DIR``): each device stream's kernels and copies, the
compute stream's gaps split by whether the next kernel was launched only after the previous one
ended (the host was late: host-bound) or had been queued before (it waited on something else, such
as a copy), the launch-to-start lead, and the pass in tenths. A diagnostic: it prints.

    python3 bench/trace_gaps.py traces/resnet-torch.json.gz
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from typing import Any


def load(path: str) -> list[dict[str, Any]]:
    with gzip.open(path) if path.endswith(".gz") else open(path) as f:
        return json.load(f)["traceEvents"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--min-gap-us", type=float, default=5.0)
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    ev = load(a.trace)
    spans = [e for e in ev if e.get("ph") == "X"]
    device = [e for e in spans if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    launch = {e["args"].get("correlation"): e for e in spans if e.get("cat") == "cuda_runtime"}
    streams: dict[Any, list[dict[str, Any]]] = collections.defaultdict(list)
    for e in device:
        streams[(e["pid"], e["tid"])].append(e)
    for key, v in streams.items():
        v.sort(key=lambda e: e["ts"])
        kinds = dict(collections.Counter(e["cat"] for e in v))
        span = (v[-1]["ts"] + v[-1]["dur"] - v[0]["ts"]) / 1e3
        busy = sum(e["dur"] for e in v) / 1e3
        print(f"stream {key}: {kinds}, span {span:.1f} ms, busy {busy:.1f} ms")
    comp = max(streams.values(), key=lambda v: sum(e["dur"] for e in v if e["cat"] == "kernel"))
    t0 = comp[0]["ts"]
    late = queued = 0.0
    n_late = n_queued = 0
    gaps = []
    leads = []
    for prev, nxt in zip(comp, comp[1:]):
        end = prev["ts"] + prev["dur"]
        gap = nxt["ts"] - end
        lc = launch.get(nxt["args"].get("correlation"))
        if lc is not None:
            leads.append(nxt["ts"] - lc["ts"])
        if gap <= a.min_gap_us:
            continue
        host_late = lc is not None and lc["ts"] + lc["dur"] > end - 1
        if host_late:
            late += gap
            n_late += 1
        else:
            queued += gap
            n_queued += 1
        gaps.append((gap, (end - t0) / 1e3, nxt["name"][:60], "launched late" if host_late else "queued"))
    print(
        f"compute-stream gaps over {a.min_gap_us:g} us: launched late {late / 1e3:.1f} ms in {n_late}, "
        f"queued and waiting {queued / 1e3:.1f} ms in {n_queued}"
    )
    if leads:
        leads.sort()
        q = [leads[int(len(leads) * f)] for f in (0.1, 0.5, 0.9)]
        print(f"launch-to-start lead: p10 {q[0]:.0f} us, p50 {q[1]:.0f} us, p90 {q[2]:.0f} us")
    step = max(1, len(comp) // 10)
    for i in range(0, len(comp), step):
        seg = comp[i : i + step]
        span = seg[-1]["ts"] + seg[-1]["dur"] - seg[0]["ts"]
        busy = sum(e["dur"] for e in seg)
        ls = sorted(
            e["ts"] - launch[e["args"]["correlation"]]["ts"]
            for e in seg
            if e["args"].get("correlation") in launch
        )
        lead = ls[len(ls) // 2] / 1e3 if ls else float("nan")
        print(
            f"  at {(seg[0]['ts'] - t0) / 1e3:7.1f} ms: {len(seg)} ops, busy {busy / max(span, 1e-9):4.0%} "
            f"of {span / 1e3:6.1f} ms, median lead {lead:.2f} ms"
        )
    gaps.sort(reverse=True)
    for gap, at, name, why in gaps[: a.top]:
        print(f"  gap {gap / 1e3:.2f} ms at {at:.2f} ms before {name} ({why})")


if __name__ == "__main__":
    main()
