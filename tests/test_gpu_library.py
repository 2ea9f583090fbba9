"""On a GPU: torch.profiler sees ramtorch's ranges next to the CUDA copies they issue, and
``RAMTORCH_NVTX=1`` runs a training step with NVTX ranges (results equal to the plain model's)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import ramtorch
import torch
from conftest import Net
from torch.profiler import ProfilerActivity, profile

pytestmark = pytest.mark.gpu


def test_profiler_shows_ranges_and_device_copies():
    torch.manual_seed(0)
    ref = Net(d=256).cuda()
    model = copy.deepcopy(ref).cpu()
    ramtorch.offload(model, device="cuda")
    x = torch.randn(8, 8, device="cuda")
    model(x).sum().backward()
    ref(x).sum().backward()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = model(x)
        out.sum().backward()
        torch.cuda.synchronize()
    expect = ref(x)
    expect.sum().backward()
    torch.testing.assert_close(out, expect)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad.cpu())
    names = {e.name for e in prof.events()}
    for name in ("ramtorch.forward blocks.0", "ramtorch.backward blocks.0", "ramtorch.copy_to_device"):
        assert name in names
    assert any("Memcpy HtoD" in n or "memcpy" in n.lower() for n in names), sorted(names)[:50]


def test_nvtx_env_runs_a_step_equal_to_torch():
    code = textwrap.dedent(
        """
        import copy, torch, ramtorch
        from ramtorch import _profile
        from conftest import Net
        assert _profile.NVTX and _profile.active()
        torch.manual_seed(0)
        ref = Net(d=64).cuda()
        model = copy.deepcopy(ref).cpu()
        ramtorch.offload(model, device="cuda")
        x = torch.randn(4, 8, device="cuda")
        out = model(x); out.sum().backward()
        exp = ref(x); exp.sum().backward()
        torch.testing.assert_close(out, exp)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad.cpu())
        print("ok")
        """
    )
    env = dict(os.environ, RAMTORCH_NVTX="1")
    here = os.path.dirname(__file__)
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
