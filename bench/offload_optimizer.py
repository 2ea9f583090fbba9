r"""Optimizer offload for weights that stay on the GPU: a full training step (forward, backward,
AdamW step) of a transformers decoder resident on the GPU in bf16 (random weights), with the
optimizer state in host RAM or on the GPU, one process per system. Writes a JSON list of records
(``BENCH.md`` names) to ``--out``.

    python3 bench/offload_optimizer.py --out $OUT/offload-optimizer.json [--systems a,b] \
        [--warmup 7] [--reps 3] [--steps 3] [--commit abc1234]

Systems (``--systems``, comma-separated; all by default):

- ``ramtorch-host``: ``ramtorch.optim.AdamW(states="host")`` (fp32 master and moments in host RAM,
  gradients copied as backward produces them, updates speculated during backward, new weights
  copied back in ``step()``; the compute stream waits for them at the end of ``step()``).
- ``ramtorch-host-forward``: the same with ``opt.upload_wait = "forward"`` (each module's forward
  waits for its own weights only).
- ``ramtorch-host-bf16``: ``states="host", precision="bf16"`` (bf16 moments, stochastic rounding:
  the state format torchao's offload keeps for bf16 weights).
- ``ramtorch-host-gpu``, ``ramtorch-host-bf16-gpu``: ``ramtorch-host`` and ``ramtorch-host-bf16``
  with ``gpu_updates=True`` (the GPU makes a share of the updates beside the CPU, same bits).
- ``...-overlap`` (``ramtorch-host-overlap``, ``ramtorch-host-bf16-overlap``,
  ``ramtorch-host-bf16-gpu-overlap``): the same with ``overlap="backward"`` (each update
  committed in place during backward; an option that changes the semantics).
- ``torchao``: ``torchao.optim.CPUOffloadOptimizer(params, torch.optim.AdamW, fused=True)``.
- ``torchao-offload-gradients``: the same with ``offload_gradients=True``.
- ``resident``: everything on the GPU, ``torch.optim.AdamW(fused=True)`` on the bf16 weights (the
  ceiling); also records forward+backward alone (the compute floor).
- ``ramtorch-device``: ``ramtorch.optim.AdamW()`` with its default ``states="device"`` (fp32 master
  and moments on the GPU, torch's fused kernels).

Each system: ``--warmup`` steps (enough for ramtorch's default schedule to measure speculation
against updates in ``step()`` and choose), then ``--reps`` repetitions of ``--steps`` steps run
back to back (so that copies still running at the end of one step may overlap the next forward),
each ended by a synchronisation; the record's ``ms`` is the median over the repetitions of the
time per step. Needs no network: the model is built from a config.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

SYSTEMS = (
    "ramtorch-host",
    "ramtorch-host-forward",
    "ramtorch-host-bf16",
    "ramtorch-host-gpu",
    "ramtorch-host-bf16-gpu",
    "ramtorch-host-overlap",
    "ramtorch-host-bf16-overlap",
    "ramtorch-host-bf16-gpu-overlap",
    "torchao",
    "torchao-offload-gradients",
    "resident",
    "ramtorch-device",
)


def _rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def build(a: argparse.Namespace) -> Any:
    """A Qwen2 or Llama decoder with random weights, built on ``--device`` in bf16."""
    import torch
    import transformers

    common: dict[str, Any] = dict(
        hidden_size=a.hidden,
        intermediate_size=a.inter,
        num_hidden_layers=a.layers,
        num_attention_heads=a.hidden // 128,
        num_key_value_heads=max(1, a.hidden // 512),
        vocab_size=a.vocab,
        max_position_embeddings=max(32768, a.tokens),
        tie_word_embeddings=False,
    )
    cfg = (transformers.Qwen2Config if a.arch == "qwen2" else transformers.LlamaConfig)(**common)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(a.device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.train()
    return model


def make_optimizer(system: str, model: Any, lr: float) -> tuple[Any, dict[str, Any]]:
    """The optimizer of ``system`` and the record fields that describe it."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if system.startswith("ramtorch"):
        import ramtorch.optim as ropt

        if system == "ramtorch-device":
            opt = ropt.AdamW(params, lr=lr)
            return opt, {
                "system": "ramtorch",
                "optimizer": "ramtorch.optim.AdamW(fp32 master on the GPU, resident weights)",
            }
        precision = "bf16" if system.startswith("ramtorch-host-bf16") else "fp32-master"
        gpu_updates = "-gpu" in system
        overlap: bool | str = "backward" if system.endswith("-overlap") else True
        opt = ropt.AdamW(
            params, lr=lr, states="host", precision=precision, gpu_updates=gpu_updates, overlap=overlap
        )
        fields: dict[str, Any] = {"system": "ramtorch"}
        state = "bf16 moments, stochastic rounding" if precision == "bf16" else "fp32 master"
        fields["optimizer"] = f"ramtorch.optim.AdamW({state}, offload, resident weights)"
        if system == "ramtorch-host-forward":
            opt.upload_wait = "forward"
            fields["options"] = {"upload_wait": "forward"}
        if precision != "fp32-master":
            fields["options"] = {**fields.get("options", {}), "precision": precision}
        if gpu_updates:
            fields["options"] = {**fields.get("options", {}), "gpu_updates": True}
        if overlap == "backward":
            fields["options"] = {**fields.get("options", {}), "overlap": "backward"}
        return opt, fields
    if system.startswith("torchao"):
        from torchao.optim import CPUOffloadOptimizer

        grads = system == "torchao-offload-gradients"
        opt = CPUOffloadOptimizer(params, torch.optim.AdamW, offload_gradients=grads, fused=True, lr=lr)
        fields = {
            "system": "torchao-cpu-offload",
            "optimizer": (
                "torchao.optim.CPUOffloadOptimizer(torch.optim.AdamW fused, bf16 states on the host)"
            ),
        }
        if grads:
            fields["options"] = {"offload_gradients": True}
        return opt, fields
    if system == "resident":
        opt = torch.optim.AdamW(params, lr=lr, fused=True)
        return opt, {"system": "resident", "optimizer": "torch.optim.AdamW(fused, bf16 states on the GPU)"}
    raise ValueError(f"unknown system {system!r}")


def child(a: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    t0 = time.perf_counter()
    model = build(a)
    params = sum(p.numel() for p in model.parameters())
    try:
        opt, fields = make_optimizer(a.child, model, a.lr)
    except ImportError as e:
        return [{"system": "torchao-cpu-offload", "status": "unavailable", "error": repr(e)}]
    setup = time.perf_counter() - t0
    ids = torch.randint(0, a.vocab, (1, a.tokens), device=a.device)
    cuda = a.device.startswith("cuda")

    def device_sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def forward_backward() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    def step() -> None:
        forward_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync() -> None:
        if hasattr(opt, "synchronize"):
            opt.synchronize()
        device_sync()

    for _ in range(a.warmup):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    per_step = []
    for _ in range(a.reps):
        t = time.perf_counter()
        for _ in range(a.steps):
            step()
        sync()
        per_step.append((time.perf_counter() - t) / a.steps)
    base: dict[str, Any] = {
        "workload": f"resident-decoder-{a.arch}",
        "arch": a.arch,
        "params": params,
        "layers": a.layers,
        "hidden": a.hidden,
        "intermediate": a.inter,
        "vocab": a.vocab,
        "tokens": a.tokens,
        "batch": 1,
        "device": torch.cuda.get_device_name() if cuda else a.device,
        "gpus": 1,
        "commit": a.commit,
    }
    ms = statistics.median(per_step) * 1e3
    rec = {
        **base,
        **fields,
        "phase": "step",
        "bench_system": a.child,
        "ms": ms,
        "seconds": ms / 1e3,
        "ms_reps": [t * 1e3 for t in per_step],
        "steps_per_rep": a.steps,
        "warmup_steps": a.warmup,
        "setup_seconds": setup,
        "gpu_peak_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
        "host_rss_bytes": _rss(),
        "model_tflops": 6 * params * a.tokens / (ms / 1e3) / 1e12,
    }
    timings = getattr(opt, "timings", None)
    if isinstance(timings, dict):
        rec["optimizer_timings"] = dict(timings)
        rec["speculation_bytes"] = opt.speculation_bytes
        auto = getattr(opt, "_auto", None)
        rec["schedule_chosen"] = getattr(auto, "choice", None) or opt._mode.value
    out = [rec]
    if a.child == "resident":  # the compute floor: forward and backward alone
        device_sync()
        times = []
        for _ in range(a.reps):
            t = time.perf_counter()
            for _ in range(a.steps):
                forward_backward()
                model.zero_grad(set_to_none=True)
            device_sync()
            times.append((time.perf_counter() - t) / a.steps)
        fb = statistics.median(times) * 1e3
        out.append({**base, "system": "resident", "phase": "forward_backward", "ms": fb, "seconds": fb / 1e3})
    return out


def _git_commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSON file of records to write")
    ap.add_argument("--commit", default=None, help="the commit measured (default: git's HEAD)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    ap.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--inter", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup", type=int, default=7)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="steps back to back in each timed repetition")
    ap.add_argument("--device", default="cuda", help="cuda (what it measures) or cpu (a smoke test)")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds for each system's process")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.commit is None:
        a.commit = _git_commit()
    if a.child is not None:
        print(json.dumps(child(a)), flush=True)
        return

    systems = [s for s in a.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        ap.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    records: list[dict[str, Any]] = []
    for system in systems:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            *sys.argv[1:],
            "--commit",
            a.commit,
            "--child",
            system,
        ]
        print(f"{system} ...", file=sys.stderr, flush=True)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
            lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
            if done.returncode == 0 and lines:
                got = json.loads(lines[-1])
            else:
                tail = (done.stderr or done.stdout)[-3000:]
                got = [
                    {"bench_system": system, "status": "failed", "returncode": done.returncode, "error": tail}
                ]
        except subprocess.TimeoutExpired:
            got = [{"bench_system": system, "status": "timed out", "timeout_seconds": a.timeout}]
        for rec in got:
            rec.setdefault("bench_system", system)
            rec.setdefault("commit", a.commit)
            rec["command"] = command_line()
            shown = f"{rec['ms']:.1f} ms ({rec.get('phase')})" if "ms" in rec else rec.get("status")
            print(f"  {system}: {shown}", file=sys.stderr, flush=True)
        records += got
        with open(a.out, "w") as fh:  # written after each system: a later failure keeps the rest
            json.dump(records, fh, indent=1)


def command_line() -> str:
    """This run's command as typed from the repository's root, the output file by its name only."""
    args = sys.argv[1:]
    shown = [os.path.basename(x) if i and args[i - 1] == "--out" else x for i, x in enumerate(args)]
    return " ".join(["python3", f"bench/{os.path.basename(__file__)}", *shown])


if __name__ == "__main__":
    main()
