"""torch's optimizer semantics under the default schedule: nothing changes before ``step()``, and
``step()`` uses the gradients and hyperparameters as they are when it is called, bitwise as
``overlap=False`` does, while updates are still computed during backward (speculatively, into
spare buffers that ``step()`` commits)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import ramtorch
import ramtorch.optim as ropt
import torch
from conftest import Net
from torch import nn

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _models(device: str, dtype: torch.dtype = torch.float32, copies: int = 2, seed: int = 0, **kw: Any):
    torch.manual_seed(seed)
    ref = Net(**kw).to(dtype)
    out = [ref]
    for _ in range(copies):
        m = copy.deepcopy(ref)
        ramtorch.offload(m, device=device)
        out.append(m)
    ref.to(device)
    return out


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x.to(next(model.parameters()).dtype)).float().square().mean()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().cpu().clone() for p in model.parameters()]


def _assert_bitwise(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.detach().cpu(), q.detach().cpu()), name


def _assert_close(ref: nn.Module, ours: nn.Module, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(
            q.detach().cpu().float(), p.detach().cpu().float(), rtol=rtol, atol=atol, msg=name
        )


def _opt_states(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        v.detach().clone() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)
    ]


def _run(
    models: list[nn.Module],
    opts: list[torch.optim.Optimizer],
    batches: list[list[torch.Tensor]],
    between: Callable[[int, nn.Module, torch.optim.Optimizer, torch.Tensor], bool] | None = None,
) -> None:
    """Trains each model with its optimizer on ``batches`` (each a list of micro-batches);
    ``between(i, model, opt, loss)`` runs after the backwards of step i and returns whether to
    call ``step()``."""
    for i, micro in enumerate(batches):
        for model, opt in zip(models, opts):
            losses = []
            for x in micro:
                loss = _loss(model, x) / len(micro)
                loss.backward()
                losses.append(loss.detach())
            # Let the speculations of this backward finish (step() drops those not begun, which
            # a slow machine would leave too many of for the counts the tests check).
            getattr(opt, "synchronize", lambda: None)()
            go = True if between is None else between(i, model, opt, sum(losses))
            if go:
                opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("device", DEVICES)
def test_nothing_changes_before_step(device: str) -> None:
    """After backward (with updates computed during it), the weights and optimizer states are
    those of before; step() then makes them those of overlap=False, bitwise."""
    _, ours, sync = _models(device)
    opt = ropt.AdamW(ours.parameters(), lr=1e-2)
    o_sync = ropt.AdamW(sync.parameters(), lr=1e-2, overlap=False)
    for _ in range(4):
        x = torch.randn(5, 8, device=device)
        before, states = _params(ours), _opt_states(opt)
        _loss(ours, x).backward()
        _loss(sync, x).backward()
        opt.synchronize()  # whatever runs on has finished: still nothing changed
        for b, p in zip(before, ours.parameters()):
            assert torch.equal(b, p.detach().cpu())
        for a, b in zip(states, _opt_states(opt)):
            assert torch.equal(a, b)
        opt.step()
        o_sync.step()
        opt.zero_grad()
        o_sync.zero_grad()
        _assert_bitwise(sync, ours)
    assert opt.timings["committed_updates"] > 0  # the updates were computed during backward
    assert opt.speculation_bytes > 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_skipped_on_a_non_finite_loss_changes_nothing(device: str) -> None:
    """fairseq/Megatron style: skip step() when the loss is not finite. No NaN reaches a weight."""
    ref, ours, sync = _models(device)
    opts = [
        torch.optim.AdamW(ref.parameters(), lr=1e-2),
        ropt.AdamW(ours.parameters(), lr=1e-2),
        ropt.AdamW(sync.parameters(), lr=1e-2, overlap=False),
    ]
    batches = [[torch.randn(5, 8, device=device)] for _ in range(6)]
    batches[3] = [torch.full((5, 8), math.nan, device=device)]
    batches[4] = [torch.full((5, 8), math.inf, device=device)]

    def skip_non_finite(i: int, model: nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor) -> bool:
        return bool(torch.isfinite(loss))

    _run([ref, ours, sync], opts, batches, skip_non_finite)
    assert all(torch.isfinite(p).all() for p in ours.parameters())
    _assert_bitwise(sync, ours)
    _assert_close(ref, ours)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rule", ["adamw", "sgd"])
def test_hyperparameters_set_between_backward_and_step_are_used(device: str, rule: str) -> None:
    """Warmup code placed after backward: the step uses the learning rate set then."""
    ref, ours, sync = _models(device)

    def make(params: Any, kind: str) -> torch.optim.Optimizer:
        if rule == "sgd":
            cls = torch.optim.SGD if kind == "torch" else ropt.SGD
            kw: dict[str, Any] = {"lr": 0.1, "momentum": 0.9}
        else:
            cls = torch.optim.AdamW if kind == "torch" else ropt.AdamW
            kw = {"lr": 1e-2}
        if kind == "sync":
            kw["overlap"] = False
        return cls(params, **kw)

    opts = [make(ref.parameters(), "torch"), make(ours.parameters(), "ours"), make(sync.parameters(), "sync")]

    def warmup(i: int, model: nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor) -> bool:
        for g in opt.param_groups:
            g["lr"] = 0.02 * (i + 1)
            g["weight_decay"] = 0.01 * i
        return True

    _run([ref, ours, sync], opts, [[torch.randn(5, 8, device=device)] for _ in range(5)], warmup)
    _assert_bitwise(sync, ours)
    _assert_close(ref, ours)


def test_a_tensor_learning_rate_changed_in_place_is_used() -> None:
    _, ours, sync = _models("cpu")
    lr_a, lr_b = torch.tensor(1e-2), torch.tensor(1e-2)
    opts = [ropt.AdamW(ours.parameters(), lr=lr_a), ropt.AdamW(sync.parameters(), lr=lr_b, overlap=False)]

    def halve(i: int, model: nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor) -> bool:
        opt.param_groups[0]["lr"].mul_(0.5)
        return True

    _run([ours, sync], opts, [[torch.randn(5, 8)] for _ in range(4)], halve)
    _assert_bitwise(sync, ours)


@pytest.mark.parametrize("device", DEVICES)
def test_a_backward_with_no_step_changes_nothing(device: str) -> None:
    """A gradient probe (backward, look, zero_grad) between steps leaves no trace."""
    ref, ours = _models(device, copies=1)
    o_ref, o_ours = torch.optim.AdamW(ref.parameters(), lr=1e-2), ropt.AdamW(ours.parameters(), lr=1e-2)
    for i in range(5):
        x = torch.randn(5, 8, device=device)
        if i >= 2:
            before = _params(ours)
            _loss(ours, torch.randn(5, 8, device=device) * 3).backward()  # the probe
            o_ours.synchronize()
            assert all(torch.equal(b, p.detach().cpu()) for b, p in zip(before, ours.parameters()))
            o_ours.zero_grad()
        for model, opt in ((ref, o_ref), (ours, o_ours)):
            _loss(model, x).backward()
            opt.step()
            opt.zero_grad()
    _assert_close(ref, ours)


@pytest.mark.parametrize("device", DEVICES)
def test_a_growing_number_of_micro_batches_trains_as_torch(device: str) -> None:
    """2 backwards a step, then 4: no error, the same weights as torch (and overlap=False)."""
    ref, ours, sync = _models(device)
    opts = [
        torch.optim.AdamW(ref.parameters(), lr=1e-2),
        ropt.AdamW(ours.parameters(), lr=1e-2),
        ropt.AdamW(sync.parameters(), lr=1e-2, overlap=False),
    ]
    counts = [2, 2, 4, 4, 3, 1, 4]
    batches = [[torch.randn(3, 8, device=device) for _ in range(n)] for n in counts]
    _run([ref, ours, sync], opts, batches)
    _assert_bitwise(sync, ours)
    _assert_close(ref, ours)


def test_gradients_rewritten_after_backward_are_used() -> None:
    """torch's clip_grad_norm_ (in place), a hook scaling .grad, a GradScaler from the third
    step: each step uses the gradients as step() sees them."""
    _, ours, sync = _models("cpu")
    opts = [ropt.AdamW(ours.parameters(), lr=1e-2), ropt.AdamW(sync.parameters(), lr=1e-2, overlap=False)]

    def clip(i: int, model: nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor) -> bool:
        if i % 2 == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        else:
            for p in model.parameters():
                p.grad.mul_(0.5)
        return True

    _run([ours, sync], opts, [[torch.randn(5, 8) * 4] for _ in range(4)], clip)
    _assert_bitwise(sync, ours)
    # Clipping through the optimizer (no gradient rewritten) and max_grad_norm.
    for kw in ({}, {"max_grad_norm": 1e-3}, {"max_grad_norm": 1e6}):
        _, a, b = _models("cpu", seed=1)
        oa, ob = (
            ropt.AdamW(a.parameters(), lr=1e-2, **kw),
            ropt.AdamW(b.parameters(), lr=1e-2, overlap=False, **kw),
        )

        def opt_clip(
            i: int, model: nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor, kw: dict[str, Any] = kw
        ) -> bool:
            if not kw:
                opt.clip_grad_norm_(1e-3 if i % 2 else 1e6)
            return True

        _run([a, b], [oa, ob], [[torch.randn(5, 8) * 4] for _ in range(5)], opt_clip)
        _assert_bitwise(b, a)
        if kw.get("max_grad_norm") == 1e6:
            assert oa.timings["committed_updates"] > 0  # nothing clipped: the speculation stands


def test_a_grad_scaler_after_steps_equals_overlap_false() -> None:
    _, ours, sync = _models("cpu")
    opts = [ropt.AdamW(ours.parameters(), lr=1e-2), ropt.AdamW(sync.parameters(), lr=1e-2, overlap=False)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in opts]
    for i in range(5):
        x = torch.randn(5, 8)
        for model, opt, scaler in zip((ours, sync), opts, scalers):
            if i < 2:
                _loss(model, x).backward()
                opt.step()
            else:
                scaler.scale(_loss(model, x)).backward()
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
    _assert_bitwise(sync, ours)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "rule,dtype,precision",
    [
        ("adamw", torch.bfloat16, "fp32-master"),
        ("adamw", torch.bfloat16, "bf16"),
        ("adamw", torch.float16, "fp32-master"),
        ("sgd", torch.bfloat16, "bf16"),
        ("sgd", torch.float32, "fp32-master"),
        ("lion", torch.bfloat16, "fp32-master"),
        ("lion", torch.float32, "fp32-master"),
    ],
)
def test_every_rule_and_precision_equals_overlap_false_bitwise(
    device: str, rule: str, dtype: torch.dtype, precision: str
) -> None:
    hidden = int(torch.randint(3, 40, ()).item())
    _, ours, sync = _models(device, dtype=dtype, seed=hidden, d=hidden)
    cls = {"adamw": ropt.AdamW, "sgd": ropt.SGD, "lion": ropt.Lion}[rule]
    kw: dict[str, Any] = {"lr": 1e-2, "precision": precision}
    if rule == "sgd":
        kw.update(momentum=0.9, nesterov=True)
    opts = [cls(ours.parameters(), **kw), cls(sync.parameters(), overlap=False, **kw)]
    _run([ours, sync], opts, [[torch.randn(4, 8, device=device)] for _ in range(5)])
    _assert_bitwise(sync, ours)
    assert opts[0].timings["committed_updates"] > 0


def test_overlap_must_be_a_known_mode() -> None:
    _, ours = _models("cpu", copies=1)
    with pytest.raises(ValueError, match="overlap must be True, False or 'backward'"):
        ropt.AdamW(ours.parameters(), overlap="yes")  # type: ignore[arg-type]


def test_a_state_dict_loaded_between_backward_and_step_is_used() -> None:
    """load_state_dict after backward replaces the states the speculation read: step() uses the
    loaded ones."""
    _, ours, sync = _models("cpu")
    oa, ob = ropt.AdamW(ours.parameters(), lr=1e-2), ropt.AdamW(sync.parameters(), lr=1e-2, overlap=False)
    _run([ours, sync], [oa, ob], [[torch.randn(5, 8)] for _ in range(2)])
    saved = copy.deepcopy(oa.state_dict())
    _run([ours, sync], [oa, ob], [[torch.randn(5, 8)] for _ in range(2)])
    x = torch.randn(5, 8)
    for model, opt in ((ours, oa), (sync, ob)):
        _loss(model, x).backward()
        opt.load_state_dict(saved)
        opt.step()
        opt.zero_grad()
    _assert_bitwise(sync, ours)


def test_the_default_keeps_the_cheaper_of_speculation_and_step() -> None:
    """The default measures what speculation adds to a step (its first step left out), then what
    updating in step() adds, and keeps the cheaper; choosing step() frees the spare buffers."""
    from ramtorch.optim._speculation import AutoChoice

    a = AutoChoice()
    a.observe_speculative(9.0)  # the first speculative step: pages touched, not counted
    assert a.wants_speculation()
    a.observe_speculative(0.5)
    a.observe_speculative(0.4)
    assert not a.wants_speculation() and a.choice is None  # now measuring step()
    a.observe_in_step(0.3)
    a.observe_in_step(0.2)
    assert not a.wants_speculation() and a.choice == "in step"
    b = AutoChoice()
    for t in (9.0, 0.1, 0.1):
        b.observe_speculative(t)
    for t in (0.3, 0.2):
        b.observe_in_step(t)
    assert b.wants_speculation() and b.choice == "speculate"

    _, ours, sync = _models("cpu")
    opt = ropt.AdamW(ours.parameters(), lr=1e-2)
    o_sync = ropt.AdamW(sync.parameters(), lr=1e-2, overlap=False)
    _run([ours, sync], [opt, o_sync], [[torch.randn(5, 8)] for _ in range(9)])
    _assert_bitwise(sync, ours)
    assert opt._auto is not None and opt._auto.choice in ("speculate", "in step")
    assert opt.timings["committed_updates"] > 0
    if opt._auto.choice == "in step":
        assert opt.speculation_bytes == 0
    # A mode the user sets is kept.
    opt.overlap = "backward"
    assert opt._auto is None


def test_out_of_place_kernels_check_their_old_values() -> None:
    """The bindings' old_* buffers are checked as the operands are: an old value that overlaps an
    operand, or has another dtype, or stands for an operand the step does not read, is refused
    with the step left undone; a valid one gives the in-place step's bits."""
    from ramtorch import _core

    n = 4096
    g = torch.randn(n)
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    kw: dict[str, Any] = dict(
        param_dtype="float32", grad_dtype="float32", state_dtype="float32", numel=n, step=1,
        lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
    )  # fmt: skip
    before = p.clone()
    with pytest.raises(ValueError, match="overlap"):
        _core.adamw_step(param=p, grad=g, exp_avg=m, exp_avg_sq=v, old_state1=m, **kw)
    with pytest.raises(ValueError, match="old_param"):
        _core.adamw_step(
            param=p, grad=g, exp_avg=m, exp_avg_sq=v, old_param=torch.zeros(n, dtype=torch.bfloat16), **kw
        )
    assert torch.equal(p, before)
    # Out of place into fresh buffers = in place.
    op, om, ov = torch.full((n,), 7.0), torch.full((n,), 7.0), torch.full((n,), 7.0)
    _core.adamw_step(
        param=op, grad=g, exp_avg=om, exp_avg_sq=ov, old_param=p, old_state1=m, old_state2=v, **kw
    )
    _core.adamw_step(param=p, grad=g, exp_avg=m, exp_avg_sq=v, **kw)
    assert torch.equal(op, p) and torch.equal(om, m) and torch.equal(ov, v)


def test_overlap_backward_refuses_hyperparameters_changed_after_backward() -> None:
    """overlap="backward" commits during backward: a learning rate set after backward cannot be
    used, and step() says so instead of training on the old one silently. A scheduler stepped
    after step() (the usual place) is used by the next step, with no error."""
    _, ours = _models("cpu", copies=1)
    opt = ropt.AdamW(ours.parameters(), lr=1e-2, overlap="backward")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for _ in range(3):
        _loss(ours, torch.randn(5, 8)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    assert opt.timings["in_backward_updates"] > 0
    _loss(ours, torch.randn(5, 8)).backward()
    opt.param_groups[0]["lr"] = 0.5
    with pytest.raises(RuntimeError, match=r"hyperparameters \(lr\) were changed between backward and step"):
        opt.step()
