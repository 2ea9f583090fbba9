"""On a GPU, units kept resident by ``gpu_budget`` train as streamed ones do: ``ramtorch.optim``
gives their bf16 parameters an fp32 master and fp32 states on the device (the host parameters'
numerics), so a model with a budget reaches the weights of the same model without one, up to
rounding. The CPU counterpart is ``tests/test_resident_numerics.py``."""

from __future__ import annotations

import copy

import pytest
import ramtorch
import ramtorch.optim
import torch
from conftest import Net

pytestmark = pytest.mark.gpu

STEPS = 8


def _train(model, opt, batches) -> list[float]:
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    ramtorch.synchronize()
    return losses


@pytest.mark.parametrize("precision", ["fp32-master", "bf16"])
def test_resident_units_match_streamed_units(precision):
    torch.manual_seed(0)
    base = Net(d=256, layers=6).to(torch.bfloat16)
    streamed = ramtorch.offload(copy.deepcopy(base), device="cuda")
    block = next(u.nbytes for u in streamed._ramtorch_streamer.units if u.name == "blocks.0")
    split = ramtorch.offload(copy.deepcopy(base), device="cuda", gpu_budget=6 * block)
    units = split._ramtorch_streamer.units
    resident = [p for u in units if u.resident for p in u.params]
    assert any(u.resident for u in units if u.name.startswith("blocks"))
    assert any(not u.resident for u in units)
    assert all(p.is_cuda for p in resident)

    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(8, 8, generator=g).to("cuda", torch.bfloat16), torch.randn(8, 3, generator=g).to("cuda"))
        for _ in range(STEPS)
    ]
    ref = ramtorch.optim.AdamW(streamed.parameters(), lr=1e-3, precision=precision)
    opt = ramtorch.optim.AdamW(split.parameters(), lr=1e-3, precision=precision)
    want = _train(streamed, ref, batches)
    got = _train(split, opt, batches)

    for p in resident:
        st = opt.state[p]
        if precision == "fp32-master":
            assert st["master"].is_cuda and st["master"].dtype == torch.float32
            assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32
        else:
            assert "master" not in st and st["exp_avg"].dtype == torch.bfloat16
    assert got == pytest.approx(want, rel=2e-2, abs=1e-3)
    for (name, p), q in zip(split.named_parameters(), streamed.parameters()):
        p, q = p.detach().float().cpu(), q.detach().float().cpu()
        d = (p - q).abs()
        ulp = 2.0 ** (torch.floor(torch.log2(q.abs().clamp_min(2**-8))) - 7)
        # The device (torch) and host (ramtorch kernel) updates round their fp32 arithmetic
        # differently, and Adam's m / sqrt(v) carries that into every step: weights meet to a few
        # bf16 steps, never further apart.
        if precision == "fp32-master":
            assert bool((d <= 2 * ulp + 1e-6).all()) and float((d / ulp).mean()) <= 1.0, name
        else:  # stochastic rounding also draws different bits on the two paths
            assert bool((d <= 8 * ulp + 1e-3).all()) and float(d.mean()) <= 5e-4, name
