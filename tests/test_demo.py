"""The demo (``make demo``, ``examples/demo.py``): short by default, longer on request, and it
runs to its end with the loss falling."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.py"


def _demo_module():
    spec = importlib.util.spec_from_file_location("ramtorch_demo", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_default_run_is_short():
    """A fresh two-core CPU trains the former defaults (400 steps of 16 x 128 bytes through a
    1.46 M-parameter model) at about 1.15 s a step: 8 minutes. The defaults now do about a
    twentieth of that work: under two minutes there."""
    demo = _demo_module()
    args = demo.parse_args([])
    model = demo.ByteLM(args.d_model, args.layers, args.heads, args.seq, torch.device("cpu"))
    params = sum(p.numel() for p in model.parameters())
    work = args.steps * args.batch * args.seq * params
    before = 400 * 16 * 128 * 1.46e6
    assert work < before / 15, (args, params)
    assert args.steps >= 50  # long enough to see the loss fall


def test_the_demo_runs_and_the_loss_falls():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, str(DEMO), "--steps", "30", "--d-model", "32", "--heads", "2"]
    cmd += ["--batch", "4", "--seq", "32", "--sample-bytes", "8"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "loss: first 10 steps" in out.stdout and "where a step's time went" in out.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_takes_a_number_of_steps():
    def dry_run(*extra: str) -> str:
        out = subprocess.run(
            ["make", "-n", "demo", *extra], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        return next(line for line in out.stdout.splitlines() if "examples/demo.py" in line)

    assert dry_run("STEPS=400").endswith("examples/demo.py --steps 400")
    assert "--steps" not in dry_run()
