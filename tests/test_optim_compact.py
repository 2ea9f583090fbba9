"""``precision="compact"``: 8-bit block-quantized moments and the bf16 weight with a bf16
compensation. The block quantization's error bounds, the compensated master against an fp32 one,
AdamW in this format against fp32-master AdamW on a small model, the out-of-place (speculative)
update, state dicts and checkpoints (bitwise), and the errors bad input gets."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import ramtorch
import ramtorch.optim as ropt
import torch
from conftest import Net
from hypothesis import given, settings
from hypothesis import strategies as st
from ramtorch import _core
from ramtorch.io import load_checkpoint, save_checkpoint
from torch import nn

BLOCK = 256
# The smallest code of each format relative to the block's scale (signed: 16 binades below 1,
# unsigned: 32), each code 2^e * (1 + k/8).
FIRST = {True: 1.25 * 2.0**-16, False: 1.25 * 2.0**-32}


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _roundtrip(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes = torch.empty(x.numel(), dtype=torch.uint8)
    scales = torch.empty(_blocks(x.numel()), dtype=torch.float32)
    _core.q8_quantize(x, codes, scales, signed)
    out = torch.empty_like(x)
    _core.q8_dequantize(codes, scales, out, signed)
    return out, codes, scales


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 3 * BLOCK + 17),
    log_scale=st.floats(-30, 30),
    signed=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_block_quantization_round_trip_error_bounds(
    n: int, log_scale: float, signed: bool, seed: int
) -> None:
    """Each value comes back within a sixteenth of itself (half a step of three mantissa bits), or
    within half the smallest code times its block's largest magnitude below that code; the
    largest magnitude of a block is its scale, stored exactly."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * (2.0**log_scale)
    if not signed:
        x = x.square()
    y, codes, scales = _roundtrip(x, signed)
    for b in range(_blocks(n)):
        xb, yb = x[b * BLOCK : (b + 1) * BLOCK], y[b * BLOCK : (b + 1) * BLOCK]
        amax = xb.abs().max()
        assert scales[b] == amax
        err = (xb - yb).abs()
        bound = torch.maximum(xb.abs() / 16, torch.full_like(xb, FIRST[signed] / 2) * amax)
        assert bool((err <= bound * (1 + 1e-3)).all())
        assert torch.equal(yb.sign() * (yb != 0), xb.sign() * (yb != 0))  # no sign flips


def test_block_quantization_keeps_zeros_and_flags_non_finite_blocks() -> None:
    x = torch.zeros(2 * BLOCK + 5)
    x[BLOCK + 3] = float("nan")
    y, _, scales = _roundtrip(x, True)
    assert bool((y[:BLOCK] == 0).all()) and scales[0] == 0
    assert bool(y[BLOCK : 2 * BLOCK].isnan().all())  # a NaN spreads to its block, not further
    assert bool((y[2 * BLOCK :] == 0).all())


def _hyper(step: int, lr: float = 1e-3, wd: float = 0.0) -> dict[str, Any]:
    return {
        "step": step,
        "lr": lr,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": wd,
        "maximize": False,
        "grad_scale": 1.0,
        "seed": step,
    }


def test_compensated_master_tracks_an_fp32_master_far_better_than_bf16() -> None:
    """The same AdamW steps (fp32 moments for all, so only the weight's format differs) on weights
    near 1, whose updates (about lr = 1e-4) are far below bf16's resolution there (2^-7 to 2^-8).
    Each write of the pair errs by at most one unit of the compensation's last place (2^-16 near
    1), stochastically rounded so that the errors do not add up in one direction: after 300 steps
    they stay within about 4 standard deviations of such a random walk, under 2^-10. A bf16 weight
    with stochastic rounding (``precision="bf16"``) wanders by more than 50x that."""
    n, steps = 4096, 300
    g = torch.Generator().manual_seed(0)
    w0 = 1.0 + 0.01 * torch.rand(n, generator=g)
    master = w0.clone()
    p_master = w0.bfloat16()
    p_comp, comp = w0.bfloat16(), (w0 - w0.bfloat16().float()).bfloat16()
    p_sr = w0.bfloat16()
    states = {k: [torch.zeros(n), torch.zeros(n)] for k in ("master", "comp", "sr")}
    for t in range(1, steps + 1):
        grad = torch.randn(n, generator=g) + 0.5
        h = _hyper(t, lr=1e-4)
        _core.optim_step("adamw", h, p_master, grad, states["master"], master=master)
        _core.optim_step("adamw", h, p_comp, grad, states["comp"], comp=comp)
        _core.optim_step("adamw", h, p_sr, grad, states["sr"])
    moved = (master - w0).abs().mean()
    assert moved > 0.01  # the weights did move, by about steps * lr
    err_comp = (p_comp.float() + comp.float() - master).abs().max()
    err_sr = (p_sr.float() - master).abs().max()
    assert err_comp <= 2.0**-10
    assert err_comp * 50 < err_sr
    assert (p_comp.float() - master).abs().max() <= 2.0**-7  # the weight: the master, rounded


def test_second_moment_follows_changes_smaller_than_a_code() -> None:
    """An AdamW second moment moves by a thousandth of itself a step (beta2 = 0.999), far less
    than a code's width, so rounded to nearest each step it would stay at its code while the
    block's scale moves, and drift. Here one element of each block has a burst of large gradients
    and then none (its moment, the block's scale, decays), the others a steady gradient (their
    moments grow towards it). After 400 steps the steady elements' stored moments, rounded
    stochastically by the kernel, are right on average over a block: within 5% of the exact
    moment, against a shortfall of more than half when the same states are stored through the
    round-to-nearest encoder (``q8_quantize``), which this test also runs."""
    blocks, steps = 8, 400
    n = blocks * BLOCK
    gen = torch.Generator().manual_seed(0)
    steady = 0.05 * (1 + 0.2 * torch.rand(n, generator=gen))
    burst = torch.zeros(n, dtype=torch.bool)
    burst[::BLOCK] = True
    p, comp = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    codes = [torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)]
    scales = [torch.zeros(_blocks(n)), torch.zeros(_blocks(n))]
    exact = torch.zeros(n, dtype=torch.float64)
    nearest = torch.zeros(n)
    for t in range(1, steps + 1):
        grad = torch.where(burst, torch.tensor(1.0 if t <= 10 else 0.0), steady)
        _core.optim_step("adamw", _hyper(t, lr=0.0), p, grad, codes, comp=comp, scales=scales)
        exact = exact * 0.999 + 0.001 * grad.double() ** 2
        nearest = _roundtrip(nearest * 0.999 + 0.001 * grad * grad, signed=False)[0]
    stored = torch.empty(n)
    _core.q8_dequantize(codes[1], scales[1], stored, False)
    keep = ~burst
    ratio = stored[keep].view(blocks, -1).double().mean(1) / exact[keep].view(blocks, -1).mean(1)
    near_ratio = nearest[keep].double().mean() / exact[keep].mean()
    assert ((ratio - 1).abs() <= 0.05).all(), ratio
    assert near_ratio < 0.5, near_ratio


def test_a_second_moment_far_below_its_block_never_makes_an_update_of_m_over_eps() -> None:
    """An element whose second moment is below the smallest code of its block (one 256th of the
    block's scale's 3.25e-7) while its first moment is not (a steady small gradient beside one
    large one): stored as 0, its update would be ``m / eps``, here about 100 times AdamW's. The
    kernel rounds such a moment up to the smallest code instead: every element moves by at most
    what fp32 AdamW moves it, and the large one as AdamW does."""
    blocks, steps, lr = 4, 5, 1e-3
    n = blocks * BLOCK
    big = torch.zeros(n, dtype=torch.bool)
    big[::BLOCK] = True
    grad = torch.where(big, torch.tensor(1.0), torch.tensor(1e-6))
    p, comp = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    codes = [torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)]
    scales = [torch.zeros(_blocks(n)), torch.zeros(_blocks(n))]
    ref = torch.zeros(n, requires_grad=True)
    opt = torch.optim.AdamW([ref], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    for t in range(1, steps + 1):
        _core.optim_step("adamw", _hyper(t, lr=lr), p, grad, codes, comp=comp, scales=scales)
        ref.grad = grad.clone()
        opt.step()
        stored = torch.empty(n)
        _core.q8_dequantize(codes[1], scales[1], stored, False)
        assert (stored > 0).all(), f"step {t}: a positive second moment stored as 0"
    moved = (p.float() + comp.float()).abs()
    want = ref.detach().abs()
    assert (moved <= want * 1.01 + 1e-9).all(), (moved.max().item(), want.max().item())
    assert torch.allclose(moved[big], want[big], rtol=0.01), (moved[big], want[big])


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(123)
    target = nn.Linear(16, 4)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 16, generator=g)
        with torch.no_grad():
            y = target(x).sin()
        loss = (model(x.to(torch.bfloat16)).float() - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # 16*300 + 300 + 300*4 + 4 parameters: the first weight spans 19 blocks with a short last one.
    return nn.Sequential(nn.Linear(16, 300), nn.GELU(), nn.Linear(300, 4)).to(torch.bfloat16)


def test_compact_adamw_tracks_fp32_master_adamw() -> None:
    """400 steps of a small bf16 MLP regression, same data, fp32-master vs compact state.

    Tolerance: the 8-bit moments differ from fp32 ones by at most 0.7% (m) and 0.35% (v) of their
    block's largest magnitude, i.e. under 7.1% / 3.6% relative for the elements that matter (those
    within a tenth of the block's largest); so each step's update differs by at most about 9% of
    its own size, with signs that vary from step to step, and the compensated master adds errors
    of 2^-16 relative. Over a run these perturbations do not add up coherently: the final loss is
    asserted within 3% of fp32-master's (a third of a single step's worst-case relative update
    error), after both fell by more than 3x, and the weights within 10% of the distance fp32-master
    moved them."""
    ref, ours = _mlp(), _mlp()
    w0 = [p.detach().float().clone() for p in ref.parameters()]
    o_ref = ropt.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.01)
    o_ours = ropt.AdamW(ours.parameters(), lr=3e-3, weight_decay=0.01, precision="compact")
    l_ref = _train(ref, o_ref, 400)
    l_ours = _train(ours, o_ours, 400)
    final_ref, final_ours = sum(l_ref[-20:]) / 20, sum(l_ours[-20:]) / 20
    assert final_ref < l_ref[0] / 3 and final_ours < l_ours[0] / 3
    assert abs(final_ours - final_ref) <= 0.03 * final_ref
    for p, q, w in zip(ref.parameters(), ours.parameters(), w0):
        moved = (p.float() - w).norm()
        assert (q.float() - p.float()).norm() <= 0.1 * moved
    st0 = o_ours.state[next(ours.parameters())]
    assert st0["exp_avg"].dtype == torch.uint8 and st0["exp_avg_sq"].dtype == torch.uint8
    assert st0["compensation"].dtype == torch.bfloat16
    assert st0["exp_avg_block_scales"].shape == (_blocks(16 * 300),)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 2 * BLOCK + 40), seed=st.integers(0, 1000), bf16=st.booleans())
def test_out_of_place_compact_step_equals_in_place_bitwise(n: int, seed: int, bf16: bool) -> None:
    """The speculative (out-of-place) update of the compact format writes the bits of the
    in-place one and leaves its inputs unchanged, for any size (blocks cut short included)."""
    g = torch.Generator().manual_seed(seed)
    nb = _blocks(n)
    dtype = torch.bfloat16 if bf16 else torch.float32
    p = torch.randn(n, generator=g).to(dtype)
    comp = (torch.randn(n, generator=g) * 1e-3).bfloat16() if bf16 else None
    m, v = (
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g),
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g),
    )
    ms, vs = torch.rand(nb, generator=g), torch.rand(nb, generator=g) * 1e-3
    grad = torch.randn(n, generator=g).bfloat16()
    live = [t.clone() if t is not None else None for t in (p, comp, m, v, ms, vs)]
    # In place.
    ip = [t.clone() if t is not None else None for t in live]
    _core.optim_step(
        "adamw", _hyper(3, wd=0.1), ip[0], grad, [ip[2], ip[3]], comp=ip[1], scales=[ip[4], ip[5]]
    )
    # Out of place, into fresh buffers.
    out = [torch.empty_like(t) if t is not None else None for t in live]
    old: dict[str, Any] = {"param": live[0], "states": [live[2], live[3]], "scales": [live[4], live[5]]}
    if bf16:
        old["comp"] = live[1]
    _core.optim_step(
        "adamw",
        _hyper(3, wd=0.1),
        out[0],
        grad,
        [out[2], out[3]],
        comp=out[1],
        scales=[out[4], out[5]],
        old=old,
    )
    for a, b in zip(ip, out):
        if a is not None:
            assert torch.equal(a, b)
    for a, b in zip(live, (p, comp, m, v, ms, vs)):
        if a is not None:
            assert torch.equal(a, b)  # the old values are read, never written


@pytest.mark.parametrize("rule", ["sgd", "lion"])
def test_sgd_and_lion_take_the_compact_format(rule: str) -> None:
    """The other rules run through the same block driver with a quantized state and a
    compensated weight: a step moves the weight and matches the fp32-state step closely."""
    torch.manual_seed(0)
    model, ref = _mlp(), _mlp()
    cls = {"sgd": ropt.SGD, "lion": ropt.Lion}[rule]
    kw: dict[str, Any] = {"lr": 1e-2, "momentum": 0.9} if rule == "sgd" else {"lr": 1e-3}
    opt = cls(model.parameters(), precision="compact", **kw)
    o_ref = cls(ref.parameters(), **kw)
    l_ours, l_ref = _train(model, opt, 30), _train(ref, o_ref, 30)
    assert l_ours[-1] < l_ours[0]
    assert abs(l_ours[-1] - l_ref[-1]) <= 0.1 * l_ref[-1]
    name = "momentum_buffer" if rule == "sgd" else "exp_avg"
    assert opt.state[next(model.parameters())][name].dtype == torch.uint8


def _offloaded(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    ref = Net().to(torch.bfloat16)
    a, b = copy.deepcopy(ref), copy.deepcopy(ref)
    ramtorch.offload(a, device="cpu")
    ramtorch.offload(b, device="cpu")
    return a, b


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x.to(torch.bfloat16)).float().square().mean().backward()
    getattr(opt, "synchronize", lambda: None)()
    opt.step()
    opt.zero_grad()


def _states(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def test_speculative_compact_updates_commit_the_bits_of_in_step_updates() -> None:
    """The default (speculative) mode computes compact updates during backward into shadows of
    the same format and commits them: bitwise the updates of ``overlap=False``."""
    ours, sync = _offloaded()
    opt = ropt.AdamW(ours.parameters(), lr=1e-2, precision="compact")
    o_sync = ropt.AdamW(sync.parameters(), lr=1e-2, precision="compact", overlap=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        x = torch.randn(5, 8, generator=g)
        _step(ours, opt, x)
        _step(sync, o_sync, x)
        for p, q in zip(ours.parameters(), sync.parameters()):
            assert torch.equal(p.detach(), q.detach())
        for a, b in zip(_states(opt), _states(o_sync)):
            assert torch.equal(a, b)
    assert opt.timings["committed_updates"] > 0


@pytest.mark.usefixtures("fresh_engine_sums")
@pytest.mark.parametrize("precision", ["compact", "fp32-master", "bf16"])
def test_accumulated_gradients_speculate_from_their_two_parts(precision: str, monkeypatch) -> None:
    """With no room for running sums, an accumulated gradient is ``.grad`` plus this backward's
    buffer until the end of backward: the speculative update reads both in the kernel's own pass
    (no summed copy first) and commits the bits of ``overlap=False``, step after step."""
    from ramtorch import _engine
    from ramtorch.optim import _state

    eng = _engine.engine_for(_engine.normalize_device("cpu"))
    eng.drop_sums()
    eng.sum_cap = 0  # (restored by the fixture)
    seen: list[bool] = []
    kernel = _state._core.optim_step

    def spy(rule: str, hyper: Any, param: Any, grad: Any, *a: Any, **kw: Any) -> None:
        seen.append(isinstance(grad, list))
        kernel(rule, hyper, param, grad, *a, **kw)

    monkeypatch.setattr(_state._core, "optim_step", spy)
    torch.manual_seed(3)
    ref = Net(d=96, layers=2).to(torch.bfloat16)
    ours, sync = copy.deepcopy(ref), copy.deepcopy(ref)
    ramtorch.offload(ours, device="cpu")
    ramtorch.offload(sync, device="cpu")
    opt = ropt.AdamW(ours.parameters(), lr=1e-2, precision=precision)
    o_sync = ropt.AdamW(sync.parameters(), lr=1e-2, precision=precision, overlap=False)
    g = torch.Generator().manual_seed(4)
    for _ in range(4):
        xs = [torch.randn(5, 8, generator=g).to(torch.bfloat16) for _ in range(3)]
        for model, o in ((ours, opt), (sync, o_sync)):
            for x in xs:
                model(x).float().square().mean().backward()
            o.step()
            o.zero_grad()
        for p, q in zip(ours.parameters(), sync.parameters()):
            assert torch.equal(p.detach(), q.detach())
        for a, b in zip(_states(opt), _states(o_sync)):
            assert torch.equal(a, b)
    assert opt.timings["committed_updates"] > 0
    assert any(seen), "no update read a gradient in two parts"
    assert eng.stats()["grad_sum_bytes"] == 0


def test_optim_step_takes_a_gradient_as_the_sum_of_two() -> None:
    """``_core.optim_step`` with ``grad=[a, b]`` writes the bits it writes with ``a + b``; parts
    it cannot add are refused by name."""
    n = 1000
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        a = (torch.randn(n, generator=g) * 1e-3).to(dtype)
        b = torch.randn(n, generator=g).to(dtype)
        outs = []
        for grad in (a + b, [a, b]):
            p = torch.linspace(-1, 1, n, dtype=torch.bfloat16)
            comp = torch.zeros(n, dtype=torch.bfloat16)
            codes = [torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)]
            scales = [torch.zeros(4), torch.zeros(4)]
            _core.optim_step("adamw", _hyper(1), p, grad, codes, comp=comp, scales=scales)
            outs.append((p, comp, *codes, *scales))
        for x, y in zip(*outs):
            assert torch.equal(x, y), dtype
    p = torch.zeros(n)
    states = [torch.zeros(n), torch.zeros(n)]
    mixed = [torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match="one dtype"):
        _core.optim_step("adamw", _hyper(1), p, mixed, states)
    with pytest.raises(ValueError, match="one or two tensors"):
        _core.optim_step("adamw", _hyper(1), p, [torch.zeros(n)] * 3, states)
    with pytest.raises(ValueError, match="grad2 has 999 elements"):
        _core.optim_step("adamw", _hyper(1), p, [torch.zeros(n), torch.zeros(n - 1)], states)


def test_state_dict_and_checkpoint_resume_bitwise(tmp_path: Any) -> None:
    """A checkpoint holds the codes, scales and compensation; a run resumed from it takes the
    steps of the uninterrupted run, bitwise."""
    a, b = _offloaded(1)
    oa = ropt.AdamW(a.parameters(), lr=1e-2, precision="compact")
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(5, 8, generator=g) for _ in range(7)]
    for x in xs[:4]:
        _step(a, oa, x)
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, a, oa)
    sd = oa.state_dict()
    keys = set(next(iter(sd["state"].values())))
    assert {
        "exp_avg",
        "exp_avg_sq",
        "exp_avg_block_scales",
        "exp_avg_sq_block_scales",
        "compensation",
    } <= keys
    for x in xs[4:]:
        _step(a, oa, x)
    ob = ropt.AdamW(b.parameters(), lr=1e-2, precision="compact")
    load_checkpoint(path, b, ob)
    for x in xs[4:]:
        _step(b, ob, x)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p.detach(), q.detach())
    for s, t in zip(_states(oa), _states(ob)):
        assert torch.equal(s, t)
    # The state dict of another precision is refused, naming what differs.
    oc = ropt.AdamW(b.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="another precision|dtype"):
        oc.load_state_dict(sd)


def _legacy_codes(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in the first compact format: per block, the scale (largest magnitude) and the code of
    the nearest value of the dynamic map to ``x / scale``."""
    table = torch.tensor(_core.q8_legacy_map(signed), dtype=torch.float64)
    flat = x.reshape(-1).double()
    n = flat.numel()
    scales = torch.zeros(_blocks(n), dtype=torch.float32)
    codes = torch.zeros(n, dtype=torch.uint8)
    for b in range(_blocks(n)):
        xb = flat[b * BLOCK : (b + 1) * BLOCK]
        amax = float(xb.abs().max())
        scales[b] = amax
        q = xb / amax if amax > 0 else xb
        codes[b * BLOCK : b * BLOCK + xb.numel()] = (
            (q[:, None] - table[None, :]).abs().argmin(1).to(torch.uint8)
        )
    return codes.view(x.shape), scales


def test_states_saved_in_the_first_compact_format_are_recoded_on_load(tmp_path: Any) -> None:
    """A state dict of the first compact format (codes of a dynamic map, scales under
    '<state>_scales') loads: each moment is read through that map and stored in the current
    format, and training goes on from it as from the same moments saved in the current format."""
    a, b = _offloaded(1)
    oa = ropt.AdamW(a.parameters(), lr=1e-2, precision="compact")
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        _step(a, oa, torch.randn(5, 8, generator=g))
    sd = oa.state_dict()
    legacy = {"param_groups": sd["param_groups"], "state": {}}
    want = {}
    for i, saved in sd["state"].items():
        one = dict(saved)
        for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            x = _dequantize(one[name], one.pop(f"{name}_block_scales"), signed)
            one[name], one[f"{name}_scales"] = _legacy_codes(x, signed)
            table = torch.tensor(_core.q8_legacy_map(signed))
            per = one[f"{name}_scales"].repeat_interleave(BLOCK)[: x.numel()]
            want[i, name] = (table[one[name].reshape(-1).long()] * per).view(x.shape)
        legacy["state"][i] = one
    # A loader's check of shapes before reading (meta tensors) accepts it.
    meta = {
        "param_groups": legacy["param_groups"],
        "state": {i: {k: v.to("meta") for k, v in d.items()} for i, d in legacy["state"].items()},
    }
    ob = ropt.AdamW(b.parameters(), lr=1e-2, precision="compact")
    ob._check_state_dict(meta)
    ob.load_state_dict(legacy)
    for i, p in enumerate(b.parameters()):
        held = ob.state[p]
        assert "exp_avg_scales" not in held and "exp_avg_sq_scales" not in held
        for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            got = _dequantize(held[name], held[f"{name}_block_scales"], signed)
            x = want[i, name]
            amax = x.abs().max()
            bound = torch.maximum(x.abs() / 16, FIRST[signed] / 2 * amax)
            assert bool(((got - x).abs() <= bound * (1 + 1e-3)).all()), name
    # The recoded state is the one a current-format dict of those moments loads as.
    oc = ropt.AdamW(copy.deepcopy(b).parameters(), lr=1e-2, precision="compact")
    current = ob.state_dict()
    oc.load_state_dict(current)
    for s, t in zip(_states(ob), _states(oc)):
        assert torch.equal(s, t)
    # The caller's dict is not changed.
    assert "exp_avg_scales" in next(iter(legacy["state"].values()))
    _step(b, ob, torch.randn(5, 8, generator=g))
    assert all(torch.isfinite(p.float()).all() for p in b.parameters())


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
    out = torch.empty(codes.numel(), dtype=torch.float32)
    _core.q8_dequantize(codes.reshape(-1).contiguous(), scales, out, signed)
    return out.view(codes.shape)


def test_bad_input_gets_clear_errors() -> None:
    n = 300
    p, grad = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n)
    codes = [torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)]
    scales = [torch.zeros(2), torch.zeros(2)]
    h = _hyper(1)
    with pytest.raises(ValueError, match="needs its scales"):
        _core.optim_step("adamw", h, p, grad, codes)
    with pytest.raises(ValueError, match="scales1 has 3 elements, expected 2"):
        _core.optim_step("adamw", h, p, grad, codes, scales=[torch.zeros(3), scales[1]])
    with pytest.raises(ValueError, match="state2 is torch.int8, expected uint8|int8"):
        _core.optim_step("adamw", h, p, grad, [codes[0], codes[1].to(torch.int8)], scales=scales)
    with pytest.raises(ValueError, match="both be block-quantized"):
        _core.optim_step("adamw", h, p, grad, [codes[0], torch.zeros(n)], scales=scales)
    with pytest.raises(ValueError, match="grad has 299 elements, expected 300"):
        _core.optim_step("adamw", h, p, grad[:299], codes, scales=scales)
    with pytest.raises(ValueError, match="compensation must be bfloat16"):
        _core.optim_step(
            "adamw", h, p.float(), grad, codes, scales=scales, comp=torch.zeros(n, dtype=torch.bfloat16)
        )
    with pytest.raises(ValueError, match="unknown rule"):
        _core.optim_step("adam", h, p, grad, codes, scales=scales)
    with pytest.raises(ValueError, match='hyperparameter "lr" is required'):
        _core.optim_step("adamw", {k: v for k, v in h.items() if k != "lr"}, p, grad, codes, scales=scales)
    with pytest.raises(ValueError, match="takes 2 states"):
        _core.optim_step("adamw", h, p, grad, codes[:1], scales=scales)
    with pytest.raises(ValueError, match="overlap"):
        _core.optim_step("adamw", h, p, grad, [codes[0], codes[0]], scales=scales)
    with pytest.raises(ValueError, match="codes"):
        _core.q8_quantize(torch.zeros(n), torch.zeros(n), torch.zeros(2), True)
    w = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    opt = ropt.AdamW([w], precision="compact")
    w.grad = torch.ones_like(w)
    with pytest.raises(ValueError, match="compact.*float16"):
        opt.step()


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="compact"):
        ropt.AdamW([nn.Parameter(torch.zeros(4))], precision="8bit")
