"""Units kept resident by ``gpu_budget`` train as streamed ones do: ``ramtorch.optim`` gives a
parameter it updates on its device (not in host RAM) the numerics of a host parameter, an fp32
master and fp32 states for bf16 weights (or, with ``precision="bf16"``, bf16 states and
stochastic rounding), and the plan says which device memory the budget leaves out.

On CPU, units kept resident stay in ordinary CPU memory and go through the host kernels; the
device path is exercised by treating the resident units' parameters as device parameters (what
they are on a GPU). ``tests/test_gpu_resident.py`` runs the same comparison on a GPU."""

from __future__ import annotations

import copy

import pytest
import ramtorch
import ramtorch.optim
import ramtorch.plan
import torch
from conftest import Net
from ramtorch.optim import _optimizer

STEPS = 6


def _batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)) for _ in range(n)]


def _train(model, opt, batches) -> None:
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x.to(torch.bfloat16)).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    ramtorch.synchronize()


def _resident_params(model) -> list[torch.nn.Parameter]:
    units = model._ramtorch_streamer.units
    return [p for u in units if u.resident for p in u.params]


def _pair(budget: str = "8KiB"):
    torch.manual_seed(0)
    base = Net(d=16, layers=4).to(torch.bfloat16)
    streamed = ramtorch.offload(copy.deepcopy(base), device="cpu")
    split = ramtorch.offload(copy.deepcopy(base), device="cpu", gpu_budget=budget)
    resident = _resident_params(split)
    assert resident and len(resident) < len(list(split.parameters()))
    return streamed, split, resident


@pytest.fixture
def as_device(monkeypatch):
    """Makes the optimizer treat the given parameters as on a device (not host RAM)."""

    def use(params: list[torch.nn.Parameter]) -> None:
        ids = {id(p) for p in params}
        inner = _optimizer._is_host
        monkeypatch.setattr(_optimizer, "_is_host", lambda p: id(p) not in ids and inner(p))

    return use


def _assert_same_weights(a, b, ulps: int = 1) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        # bf16 has 8 significant bits: a master that differs in the last fp32 bits can round to
        # the neighbouring bf16 value.
        torch.testing.assert_close(p.float(), q.float(), rtol=ulps * 2**-7, atol=1e-6, msg=name)


def test_resident_units_get_fp32_masters_and_the_same_update(as_device):
    streamed, split, resident = _pair()
    as_device(resident)
    batches = _batches()
    ref = ramtorch.optim.AdamW(streamed.parameters(), lr=1e-2)
    opt = ramtorch.optim.AdamW(split.parameters(), lr=1e-2)
    _train(streamed, ref, batches)
    _train(split, opt, batches)
    for p in resident:
        st = opt.state[p]
        assert st["master"].dtype == torch.float32
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32
        torch.testing.assert_close(st["master"].to(torch.bfloat16), p.detach())
    _assert_same_weights(split, streamed)
    # The masters agree to fp32 rounding, far below one bf16 step.
    for p, q in zip(split.parameters(), streamed.parameters()):
        if id(p) in {id(r) for r in resident}:
            torch.testing.assert_close(opt.state[p]["master"], ref.state[q]["master"], rtol=1e-5, atol=1e-6)


def test_resident_units_state_dict_round_trip_keeps_fp32(as_device):
    streamed, split, resident = _pair()
    as_device(resident)
    batches = _batches()
    opt = ramtorch.optim.AdamW(split.parameters(), lr=1e-2)
    _train(split, opt, batches[:3])
    saved = copy.deepcopy(opt.state_dict())
    opt2 = ramtorch.optim.AdamW(split.parameters(), lr=1e-2)
    opt2.load_state_dict(saved)
    for p in resident:
        assert opt2.state[p]["master"].dtype == opt2.state[p]["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(opt2.state[p]["master"], opt.state[p]["master"], rtol=0, atol=0)


@pytest.mark.parametrize("rule", ["SGD", "Lion"])
def test_other_rules_on_resident_units(as_device, rule):
    streamed, split, resident = _pair()
    as_device(resident)
    batches = _batches()
    kw = {"lr": 1e-2, "momentum": 0.9} if rule == "SGD" else {"lr": 1e-3}
    cls = getattr(ramtorch.optim, rule)
    ref, opt = cls(streamed.parameters(), **kw), cls(split.parameters(), **kw)
    _train(streamed, ref, batches)
    _train(split, opt, batches)
    assert all(opt.state[p]["master"].dtype == torch.float32 for p in resident)
    _assert_same_weights(split, streamed)


def test_resident_units_bf16_precision_rounds_stochastically(as_device):
    streamed, split, resident = _pair()
    as_device(resident)
    batches = _batches()
    ref = ramtorch.optim.AdamW(streamed.parameters(), lr=1e-2, precision="bf16")
    opt = ramtorch.optim.AdamW(split.parameters(), lr=1e-2, precision="bf16")
    _train(streamed, ref, batches)
    _train(split, opt, batches)
    for p in resident:
        assert "master" not in opt.state[p]
        assert opt.state[p]["exp_avg"].dtype == opt.state[p]["exp_avg_sq"].dtype == torch.bfloat16
    # Stochastic rounding draws different bits on the two paths, and with bf16 moments the runs
    # drift apart by a fraction of one step's move (lr) plus a few bf16 steps at the weight's
    # magnitude; the weights moved by up to STEPS * lr.
    lr = 1e-2
    for (name, p), q in zip(split.named_parameters(), streamed.parameters()):
        q = q.detach().float()
        ulp = 2.0 ** (torch.floor(torch.log2(q.abs().clamp_min(2**-8))) - 7)
        d = (p.detach().float() - q).abs()
        assert bool((d <= 4 * ulp + lr).all()) and float(d.mean()) <= lr / 2, (name, d.max(), d.mean())


def test_stochastic_rounding_on_the_device_path_is_unbiased():
    x = torch.full((1 << 16,), 1.0 + 2**-10, dtype=torch.float32)  # a quarter of a bf16 step up
    out = torch.empty_like(x, dtype=torch.bfloat16)
    _optimizer._round_stochastic(x, out, seed=7)
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert float(out.float().mean()) == pytest.approx(1.0 + 2**-10, abs=2**-13)
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -3.0])
    got = torch.empty_like(special, dtype=torch.bfloat16)
    _optimizer._round_stochastic(special, got, seed=1)
    torch.testing.assert_close(got.float(), special, equal_nan=True)


def test_budget_does_not_change_training_on_cpu():
    """Without the patch (units resident in CPU memory go through the host kernels)."""
    streamed, split, _ = _pair()
    batches = _batches()
    ref = ramtorch.optim.AdamW(streamed.parameters(), lr=1e-2)
    opt = ramtorch.optim.AdamW(split.parameters(), lr=1e-2)
    _train(streamed, ref, batches)
    _train(split, opt, batches)
    for p, q in zip(split.parameters(), streamed.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_plan_names_the_training_memory_the_budget_leaves_out():
    torch.manual_seed(0)
    model = Net(d=16, layers=4).to(torch.bfloat16)
    pred = ramtorch.plan.predict(model, "8KiB", 16)
    resident = {u.name for u in pred.units if u.resident}
    assert resident
    mods = dict(model.named_modules())
    params = [p for name in resident for p in mods[name].parameters()]
    # Per bf16 parameter: its gradient (2 bytes), fp32 master (4) and two fp32 moments (8).
    assert pred.resident_training_bytes == sum(p.numel() * 14 for p in params)
    text = pred.summary()
    assert "not counted" in text and "gradients and optimizer states of the resident units" in text
    assert ramtorch.plan.predict(model, None, 16).resident_training_bytes == 0
