"""ramtorch.optim refuses what it cannot use: optimizer states that do not fit their parameters
(``load_state_dict`` and ``load_checkpoint``), and hyperparameters out of range, each with a clear
error that names what is wrong, leaving the optimizer as it was."""

from __future__ import annotations

import copy
import math
import subprocess
import sys
import textwrap

import pytest
import ramtorch
import ramtorch.optim as ropt
import torch
from torch import nn


def model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).to(dtype)


def train(m: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 8, generator=g).to(next(m.parameters()).dtype)
        opt.zero_grad()
        m(x).float().square().mean().backward()
        opt.step()


def states_of(opt: torch.optim.Optimizer) -> dict[int, dict[str, torch.Tensor]]:
    return {
        i: {k: v.clone() for k, v in s.items()} for i, s in copy.deepcopy(opt.state_dict())["state"].items()
    }


def assert_states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for i in a:
        assert a[i].keys() == b[i].keys(), i
        for k in a[i]:
            assert a[i][k].dtype == b[i][k].dtype and torch.equal(a[i][k], b[i][k]), (i, k)


# -- states that do not fit their parameters -------------------------------------------------------

# Run in a child process: before states were validated on load, the step after such a load wrote
# past the end of the state buffers (a heap corruption that can kill the process).
_REVERSED = """
import sys, torch, ramtorch, ramtorch.optim as ropt
from torch import nn

def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8))

def step(m, opt, seed):
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    m(torch.randn(5, 64, generator=g)).square().mean().backward()
    opt.step()

src = model()
opt = ropt.AdamW(src.parameters(), lr=1e-2)
step(src, opt, 0)
sd = opt.state_dict()

dst = model()
ref = model()
reversed_opt = ropt.AdamW(list(dst.parameters())[::-1], lr=1e-2)
ref_opt = torch.optim.AdamW(list(ref.parameters())[::-1], lr=1e-2)
mode = sys.argv[1]
try:
    if mode == "load_state_dict":
        reversed_opt.load_state_dict(sd)
    else:
        path = sys.argv[2]
        ramtorch.save_checkpoint(path, src, opt)
        ramtorch.load_checkpoint(path, dst, reversed_opt)
except ValueError as e:
    print("REFUSED:", e, flush=True)
    assert not reversed_opt.state, "the optimizer was changed by a refused load"
else:
    print("ACCEPTED", flush=True)
for s in range(3):  # the optimizer goes on as if nothing had been loaded, as torch's does
    step(dst, reversed_opt, s + 1)
    step(ref, ref_opt, s + 1)
for p, q in zip(dst.parameters(), ref.parameters()):
    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
print("OK")
"""


@pytest.mark.parametrize("how", ["load_state_dict", "load_checkpoint"])
def test_state_of_parameters_in_another_order_is_refused(tmp_path, how):
    """A state dict of an optimizer that lists the same parameters in another order: same group
    sizes, states of other shapes. Refused with the parameter named; no step writes outside a
    state buffer; the optimizer is left as it was and trains on like torch's."""
    script = tmp_path / "reversed.py"
    script.write_text(textwrap.dedent(_REVERSED))
    res = subprocess.run(
        [sys.executable, str(script), how, str(tmp_path / "ckpt.safetensors")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, f"exit status {res.returncode}\n{res.stdout}\n{res.stderr[-4000:]}"
    assert "REFUSED:" in res.stdout, res.stdout
    msg = res.stdout.split("REFUSED:", 1)[1]
    assert "parameter 0" in msg and "(8,)" in msg and "(256, 64)" in msg, msg
    assert "OK" in res.stdout


def _trained(precision: str = "fp32-master", dtype: torch.dtype = torch.float32):
    m = ramtorch.offload(model(dtype=dtype), device="cpu")
    opt = ropt.AdamW(m.parameters(), lr=1e-2, precision=precision)
    train(m, opt, 2)
    return m, opt


def _edit(sd: dict, index: int, key: str, value) -> dict:
    sd = copy.deepcopy(sd)
    if value is None:
        del sd["state"][index][key]
    else:
        sd["state"][index][key] = value
    return sd


@pytest.mark.parametrize(
    "change, match",
    [
        (
            lambda st: ("exp_avg", st["exp_avg"].flatten()),
            r"'exp_avg' has shape \(128,\), expected \(16, 8\)",
        ),
        (lambda st: ("exp_avg_sq", st["exp_avg_sq"][:8]), r"'exp_avg_sq' has shape \(8, 8\)"),
        (lambda st: ("exp_avg", None), r"no 'exp_avg'"),
        (lambda st: ("exp_avg_sq", st["exp_avg_sq"].double()), r"'exp_avg_sq' has dtype torch.float64"),
        (lambda st: ("exp_avg", st["exp_avg"].tolist()), r"'exp_avg' is a list, not a tensor"),
        (lambda st: ("step", torch.ones(3)), r"'step'"),
        (lambda st: ("master", st["exp_avg"].clone()), r"'master'"),
    ],
    ids=["flat", "fewer-rows", "missing", "float64", "not-a-tensor", "step", "master-of-fp32"],
)
def test_mismatched_states_are_refused(change, match):
    """Each mismatch, in the state of the first parameter (a (16, 8) weight), is a ValueError that
    names the parameter and the state; the optimizer keeps its own states."""
    m, opt = _trained()
    sd = opt.state_dict()
    key, value = change(sd["state"][0])
    before = states_of(opt)
    with pytest.raises(ValueError, match=match) as err:
        opt.load_state_dict(_edit(sd, 0, key, value))
    assert "parameter 0 (shape (16, 8)" in str(err.value)
    assert_states_equal(before, states_of(opt))
    opt.load_state_dict(sd)  # the right one still loads
    assert_states_equal(before, states_of(opt))


def test_states_of_another_precision_are_refused():
    """bf16 states (precision="bf16") do not fit an fp32-master optimizer, nor the reverse: the
    kernels would read them as the other kind."""
    _, low = _trained("bf16", torch.bfloat16)
    _, master = _trained("fp32-master", torch.bfloat16)
    with pytest.raises(ValueError, match=r"'exp_avg' has dtype torch.bfloat16, expected torch.float32"):
        master.load_state_dict(low.state_dict())
    with pytest.raises(ValueError, match=r"'master' copy, which a torch.bfloat16 parameter has not"):
        low.load_state_dict(master.state_dict())


def test_checkpoint_with_mismatched_state_leaves_model_and_optimizer_untouched(tmp_path):
    """load_checkpoint checks the optimizer states against the parameters before it reads
    anything: the model's weights and the optimizer's states stay as they were."""
    m, opt = _trained()
    path = tmp_path / "ckpt.safetensors"
    ramtorch.save_checkpoint(path, m, opt)
    other = ramtorch.offload(model(seed=1), device="cpu")
    other_opt = ropt.AdamW(list(other.parameters())[::-1], lr=1e-2)
    train(other, other_opt, 1, seed=3)
    weights = {k: v.clone() for k, v in other.state_dict().items()}
    before = states_of(other_opt)
    with pytest.raises(ValueError, match=r"parameter 0 \(shape \(4,\)"):
        ramtorch.load_checkpoint(path, other, other_opt)
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in weights.items())
    assert_states_equal(before, states_of(other_opt))


def test_sgd_and_lion_states_are_checked():
    for make in (lambda ps: ropt.SGD(ps, lr=0.1, momentum=0.9), lambda ps: ropt.Lion(ps, lr=1e-3)):
        src = model()
        opt = make(src.parameters())
        train(src, opt, 1)
        key = "momentum_buffer" if isinstance(opt, ropt.SGD) else "exp_avg"
        dst = model()
        with pytest.raises(ValueError, match=rf"parameter 0 \(shape \(4,\).*'{key}' has shape \(16, 8\)"):
            make(list(dst.parameters())[::-1]).load_state_dict(opt.state_dict())


def test_states_of_parameters_kept_off_the_host_are_checked():
    """Parameters torch updates (here fp64, which the kernels do not take) get their states'
    shapes checked too: a mismatch is an error at load, not in the next step."""
    src = model(dtype=torch.float64)
    opt = ropt.AdamW(src.parameters())
    train(src, opt, 1)
    dst = model(dtype=torch.float64)
    with pytest.raises(ValueError, match=r"'exp_avg' has shape \(16, 8\), expected \(4,\)"):
        ropt.AdamW(list(dst.parameters())[::-1]).load_state_dict(opt.state_dict())
    dst.load_state_dict(src.state_dict())
    fine = ropt.AdamW(dst.parameters())
    fine.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch's loading shares the tensors
    train(dst, fine, 1)
    train(src, opt, 1)
    for p, q in zip(src.parameters(), dst.parameters()):
        torch.testing.assert_close(p, q)


# -- hyperparameters -----------------------------------------------------------------------------

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda ps: ropt.AdamW(ps, lr=INF), "lr"),
        (lambda ps: ropt.AdamW(ps, lr=NAN), "lr"),
        (lambda ps: ropt.AdamW(ps, lr=-1e-3), "lr"),
        (lambda ps: ropt.AdamW(ps, betas=(0.9,)), "betas"),
        (lambda ps: ropt.AdamW(ps, betas=(0.9, 0.99, 0.5)), "betas"),
        (lambda ps: ropt.AdamW(ps, betas=(1.0, 0.99)), "betas"),
        (lambda ps: ropt.AdamW(ps, betas=(0.9, -0.1)), "betas"),
        (lambda ps: ropt.AdamW(ps, betas=(NAN, 0.99)), "betas"),
        (lambda ps: ropt.AdamW(ps, eps=0.0), "eps"),
        (lambda ps: ropt.AdamW(ps, eps=-1e-8), "eps"),
        (lambda ps: ropt.AdamW(ps, eps=NAN), "eps"),
        (lambda ps: ropt.AdamW(ps, weight_decay=NAN), "weight_decay"),
        (lambda ps: ropt.AdamW(ps, weight_decay=-0.1), "weight_decay"),
        (lambda ps: ropt.AdamW(ps, weight_decay=INF), "weight_decay"),
        (lambda ps: ropt.SGD(ps, lr=NAN), "lr"),
        (lambda ps: ropt.SGD(ps, momentum=NAN), "momentum"),
        (lambda ps: ropt.SGD(ps, momentum=-0.9), "momentum"),
        (lambda ps: ropt.SGD(ps, momentum=0.9, dampening=NAN), "dampening"),
        (lambda ps: ropt.SGD(ps, dampening=-0.5), "dampening"),
        (lambda ps: ropt.SGD(ps, weight_decay=NAN), "weight_decay"),
        (lambda ps: ropt.SGD(ps, momentum=0.9, nesterov=True, dampening=0.1), "nesterov"),
        (lambda ps: ropt.Lion(ps, lr=INF), "lr"),
        (lambda ps: ropt.Lion(ps, betas=(0.9,)), "betas"),
        (lambda ps: ropt.Lion(ps, betas=(0.9, 1.0)), "betas"),
        (lambda ps: ropt.Lion(ps, weight_decay=NAN), "weight_decay"),
        (lambda ps: ropt.AdamW([{"params": ps, "lr": NAN}]), "lr"),
        (lambda ps: ropt.SGD([{"params": ps, "momentum": -1.0}]), "momentum"),
    ],
)
def test_bad_hyperparameters_are_refused(make, match):
    with pytest.raises(ValueError, match=match) as err:
        make(list(model().parameters()))
    assert type(err.value) is ValueError


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda ps: ropt.AdamW(ps, lr="0.1"), "lr"),
        (lambda ps: ropt.AdamW(ps, betas=0.9), "betas"),
        (lambda ps: ropt.SGD(ps, momentum=None), "momentum"),
    ],
)
def test_hyperparameters_of_the_wrong_type_are_refused(make, match):
    with pytest.raises(TypeError, match=match):
        make(list(model().parameters()))


def test_add_param_group_checks_its_hyperparameters():
    m = model()
    opt = ropt.AdamW(m[0].parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": list(m[2].parameters()), "lr": INF})
    with pytest.raises(ValueError, match="betas"):
        opt.add_param_group({"params": list(m[2].parameters()), "betas": (0.9,)})
    assert len(opt.param_groups) == 1  # nothing added
    opt.add_param_group({"params": list(m[2].parameters()), "lr": 1e-2})
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 1e-2]


def test_good_hyperparameters_still_match_torch():
    """The edge values that are allowed (lr 0, a beta of 0, a tensor lr) train as torch's do."""
    for kw in ({"lr": 0.0}, {"betas": (0.0, 0.5)}, {"lr": torch.tensor(1e-2)}, {"weight_decay": 0.0}):
        ours, ref = model(), model()
        opt, ref_opt = ropt.AdamW(ours.parameters(), **kw), torch.optim.AdamW(ref.parameters(), **kw)
        train(ours, opt, 2)
        train(ref, ref_opt, 2)
        for p, q in zip(ours.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["fp32-master", "compact"])
def test_states_that_cannot_fit_in_host_memory_are_refused_before_they_are_made(monkeypatch, precision):
    """The first step checks the states it is about to make against the host memory available:
    a clear MemoryError, nothing allocated and nothing changed, instead of the process being
    killed when the kernels first write the pages."""
    from ramtorch.optim import _speculation

    p = nn.Parameter(torch.randn(64, 1024).to(torch.bfloat16))
    p.grad = torch.randn(64, 1024).to(torch.bfloat16)
    before = p.detach().clone()
    opt = ropt.AdamW([p], lr=1e-3, precision=precision)
    gib = 1 << 30
    monkeypatch.setattr(_speculation, "_meminfo", lambda: (gib + 1000, 64 * gib))  # 1000 bytes free
    with pytest.raises(MemoryError, match=r"need [\d.]+ [KM]iB of host memory, but 1\.00 GiB is available"):
        opt.step()
    assert not opt.state.get(p) and torch.equal(p.detach(), before)
    monkeypatch.setattr(_speculation, "_meminfo", lambda: (2 * gib, 64 * gib))  # room for them
    opt.step()
    assert opt.state[p] and not torch.equal(p.detach(), before)


def test_pooled_arena_memory_is_given_back_before_states_are_refused(monkeypatch):
    """Memory the arena keeps pooled (an earlier optimizer's states) counts as taken for the OS:
    before refusing new states, the first step gives the pool back and looks again."""
    from ramtorch import _core
    from ramtorch.optim import _speculation

    p = nn.Parameter(torch.randn(64, 1024).to(torch.bfloat16))
    p.grad = torch.randn(64, 1024).to(torch.bfloat16)
    opt = ropt.AdamW([p], lr=1e-3)
    gib = 1 << 30
    freed = []
    monkeypatch.setattr(_core, "arena_empty_cache", lambda: freed.append(True))
    # 1000 bytes free until the pool is given back, then room for the states.
    monkeypatch.setattr(_speculation, "_meminfo", lambda: ((2 if freed else 1) * gib + 1000, 64 * gib))
    opt.step()
    assert freed and opt.state[p]
