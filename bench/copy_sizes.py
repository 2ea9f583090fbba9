"""Host→device copy bandwidth of page-locked arena regions by size: whether a region's size (a
multiple of 2 MiB or not) or its allocator (ramtorch's arena, torch's pinned memory) changes
how fast the link moves it. A diagnostic: it prints, it records nothing.

    python3 bench/copy_sizes.py [--sizes-mib 416 444.53 1002 1039.5] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics

import torch


def bandwidth(src: torch.Tensor, dst: torch.Tensor, reps: int) -> float:
    """Median GB/s of ``reps`` timed copies of ``src`` into ``dst`` (after one untimed)."""
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return src.numel() / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[416, 444.53, 1002, 1039.5])
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    from ramtorch import _arena

    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    except OSError:
        thp = "unknown"
    print(f"transparent_hugepage: {thp}")
    for mib in a.sizes_mib:
        n = int(mib * (1 << 20)) // 4096 * 4096
        dst = torch.empty(n, dtype=torch.uint8, device="cuda")
        arena = _arena.host_bytes(n)
        arena.fill_(1)
        pinned = torch.ones(n, dtype=torch.uint8, pin_memory=True)
        print(
            f"{n / (1 << 20):9.2f} MiB (2 MiB multiple: {n % (2 << 20) == 0}): "
            f"arena {bandwidth(arena, dst, a.reps):6.2f} GB/s, "
            f"arena at +4 KiB {bandwidth(arena[4096:], dst[4096:], a.reps):6.2f}, "
            f"torch pinned {bandwidth(pinned, dst, a.reps):6.2f}, "
            f"arena address mod 2 MiB: {arena.data_ptr() % (2 << 20)}"
        )
        del dst, arena, pinned


if __name__ == "__main__":
    main()
