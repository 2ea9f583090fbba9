"""How fast host parameters' AdamW updates run on the CPU's cores, on the GPU through the link
(``ramtorch.optim._gpu_step.DeviceStepper``: operands up, the Triton kernel, results down), and on
both at once (each taking half the tensors), for tensors of an 8B decoder's MLP shape.

    python3 bench/gpu_updates.py --precision compact --tensors 8 --reps 3

``--resident``: the weights and gradients are on the GPU (``states="host"``): the GPU updates
them in place and only the states (and master) cross the link, plus the new weight into its host
copy; the CPU updates the host copies from host copies of the gradients, as the optimizer does.

Prints one JSON record per way; ``params_per_second`` is the figure to compare, and
``link_gbps`` the bytes the GPU path moved over its seconds.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import threading
import time

import torch
from benchlib import git_commit, host_cpus
from ramtorch import _arena, _core
from ramtorch.optim import _gpu_step


def make(n: int, precision: str, seed: int, resident: bool = False) -> dict:
    """One tensor's operands in page-locked arena memory, as the optimizer holds them."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * 0.02

    def host(t: torch.Tensor) -> torch.Tensor:
        out = _arena.host_empty(tuple(t.shape), t.dtype)
        out.copy_(t)
        return out

    ops = {
        "param": host(w.to(torch.bfloat16)),
        "grad": host((torch.randn(n, generator=g) * 1e-3).to(torch.bfloat16)),
    }
    ops["master"] = ops["comp"] = ops["scales"] = None
    if precision == "compact":
        ops["comp"] = host(torch.zeros(n, dtype=torch.bfloat16))
        ops["states"] = [host(torch.zeros(n, dtype=torch.uint8)) for _ in range(2)]
        ops["scales"] = [host(torch.zeros(-(-n // 256))) for _ in range(2)]
    elif precision == "fp32-master":
        ops["master"] = host(w)
        ops["states"] = [host(torch.zeros(n)) for _ in range(2)]
    else:
        ops["states"] = [host(torch.zeros(n, dtype=torch.bfloat16)) for _ in range(2)]
    if resident:
        ops["dparam"], ops["dgrad"] = ops["param"].cuda(), ops["grad"].cuda()
    return ops


HYPER = {
    "lr": 1e-4,
    "beta1": 0.9,
    "beta2": 0.999,
    "eps": 1e-8,
    "weight_decay": 0.01,
    "maximize": False,
    "grad_scale": 1.0,
    "seed": 7,
}


def cpu(ops: dict, step: int) -> None:
    _core.optim_step(
        "adamw",
        {**HYPER, "step": step},
        ops["param"],
        ops["grad"],
        ops["states"],
        master=ops["master"],
        comp=ops["comp"],
        scales=ops["scales"],
    )


def gpu(stepper: _gpu_step.DeviceStepper, ops: dict, step: int) -> None:
    kw = {}
    param, grad = ops["param"], ops["grad"]
    if "dparam" in ops:  # in place on the device, the host copy mirrored
        param, grad = ops["dparam"], ops["dgrad"]
        kw = {"here": (param, grad), "mirror": ops["param"]}
    events = stepper.step(
        "adamw",
        {**HYPER, "step": step},
        param,
        [grad],
        ops["states"],
        master=ops["master"],
        comp=ops["comp"],
        scales=ops["scales"],
        **kw,
    )
    for ev in events:
        ev.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", choices=["compact", "fp32-master", "bf16"], default="compact")
    ap.add_argument("--numel", type=int, default=4096 * 14336, help="elements a tensor")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--resident", action="store_true", help="weights and gradients on the GPU")
    ap.add_argument("--commit", default=None)
    a = ap.parse_args()
    tensors = [make(a.numel, a.precision, k, a.resident) for k in range(a.tensors)]
    stepper = _gpu_step.DeviceStepper(torch.device("cuda"))
    common = {
        "bench": "gpu_updates",
        "precision": a.precision,
        "resident": a.resident,
        "numel": a.numel,
        "tensors": a.tensors,
        "device": torch.cuda.get_device_name(),
        "cpu_kernels": _core.optim_isa(),
        "host_cpus": host_cpus(),
        "commit": a.commit or git_commit(),
        "command": "python3 bench/gpu_updates.py " + shlex.join(sys.argv[1:]),
    }
    step = [0]

    def cpu_all(ts: list[dict]) -> None:
        for ops in ts:
            cpu(ops, step[0])

    def gpu_all(ts: list[dict]) -> None:
        for ops in ts:
            gpu(stepper, ops, step[0])

    def both() -> None:
        half = len(tensors) // 2
        t = threading.Thread(target=gpu_all, args=(tensors[half:],))
        t.start()
        cpu_all(tensors[:half])
        t.join()

    ways = {"cpu": lambda: cpu_all(tensors), "gpu": lambda: gpu_all(tensors), "both": both}
    for name, fn in ways.items():
        step[0] += 1
        fn()  # warm-up (compiles the kernel, touches the pages)
        times = []
        up0, down0 = stepper.up_bytes, stepper.down_bytes
        for _ in range(a.reps):
            step[0] += 1
            s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - s)
        sec = min(times)
        moved = (stepper.up_bytes - up0 + stepper.down_bytes - down0) / a.reps
        rec = {
            **common,
            "way": name,
            "seconds": sec,
            "seconds_all": times,
            "params_per_second": a.numel * a.tensors / sec,
            "link_gbps": moved / sec / 1e9 if moved else None,
        }
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
