"""The cost of an update whose gradient comes in two parts (``.grad`` plus this backward's buffer,
which speculative updates read before the end of backward adds them): one host AdamW update of a
tensor of an 8B decoder's MLP shape, out of place as a speculation runs it, with

- ``one``: a gradient of one tensor (the floor);
- ``torch_sum``: the two parts summed by torch first, then the kernel (how speculations read them
  before ``c8c0d5c``);
- ``kernel_sum``: the two parts given to the kernel, which adds them as it reads them.

    python bench/two_part_grad.py --precision compact --reps 5

Prints one JSON record per way: the best and median seconds of ``--reps`` after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import git_commit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", choices=["compact", "fp32-master", "bf16"], default="compact")
    ap.add_argument("--rows", type=int, default=14336)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--commit", default=None)
    a = ap.parse_args()

    import ramtorch.optim as ropt
    from ramtorch import _arena, _core
    from ramtorch.optim import _speculation

    g = torch.Generator().manual_seed(0)
    shape = (a.rows, a.cols)
    p = torch.nn.Parameter(_arena.host_empty(shape, torch.bfloat16))
    with torch.no_grad():
        p.copy_(torch.randn(shape, generator=g))
    opt = ropt.AdamW([p], lr=1e-3, precision=a.precision, overlap=False)
    p.grad = torch.randn(shape, generator=g).to(torch.bfloat16)
    opt.step()  # makes the states
    group = opt.param_groups[0]
    state = opt.state[p]
    shadow = _speculation.Shadows().get(p, state, opt._host_keys())
    if shadow is None:
        raise SystemExit("the host cannot spare a spare copy of the states")
    parts = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(2)]

    def update(grad: torch.Tensor | list[torch.Tensor]) -> Callable[[], None]:
        return lambda: opt._update_host_into(p, grad, group, 2, shadow)

    ways = {
        "one": update(parts[0]),
        "torch_sum": lambda: update(parts[0] + parts[1])(),
        "kernel_sum": update(parts),
    }
    times: dict[str, list[float]] = {w: [] for w in ways}
    for w in ways.values():
        w()  # warm-up
    for _ in range(a.reps):  # the ways take turns
        for name, w in ways.items():
            s = time.perf_counter()
            w()
            times[name].append(time.perf_counter() - s)
    for name, ts in times.items():
        rec = {
            "bench": "two_part_grad",
            "precision": a.precision,
            "numel": p.numel(),
            "way": name,
            "seconds": min(ts),
            "seconds_median": statistics.median(ts),
            "seconds_all": ts,
            "threads": torch.get_num_threads(),
            "cpu_kernels": _core.optim_isa(),
            "commit": a.commit or git_commit(),
            "command": "python3 bench/two_part_grad.py " + " ".join(sys.argv[1:]),
        }
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
