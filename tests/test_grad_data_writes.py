"""Gradients written where no version counter sees it: through ``p.grad.data`` (the manual
``zero_grad`` of older code, ``p.grad.data.clamp_(-1, 1)`` as in older DQN examples) or a numpy
view. torch uses the written gradient; so must the running sums that the engine keeps on the
device across backwards and the optimizer's updates computed during backward. Against the plain
model on the CPU."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import ramtorch
import ramtorch.optim as ropt
import torch
from ramtorch._engine import HostGrad
from torch import nn

TOL = 1e-6


def _models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 4))
    return plain, ramtorch.offload(copy.deepcopy(plain), device="cpu")


def _batch(step: int, micro: int) -> torch.Tensor:
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(100 * step + micro))


def _close(plain: nn.Module, ours: nn.Module, what: str) -> None:
    for (name, p), q in zip(plain.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(
            q.detach(), p.detach(), rtol=TOL, atol=TOL, msg=lambda m, n=name: f"{what} {n}: {m}"
        )
        if p.grad is None:
            assert q.grad is None
        else:
            torch.testing.assert_close(
                q.grad, p.grad, rtol=TOL, atol=TOL, msg=lambda m, n=name: f"{what} grad {n}: {m}"
            )


WRITES: dict[str, Callable[[torch.Tensor], None]] = {
    "data.zero_": lambda g: g.data.zero_(),
    "data.mul_": lambda g: g.data.mul_(0.5),
    "data.clamp_": lambda g: g.data.clamp_(-1e-3, 1e-3),
    "numpy": lambda g: g.numpy().__setitem__(..., 0.0),
    "data = ": lambda g: setattr(g, "data", torch.zeros_like(g)),
}


@pytest.mark.parametrize("write", list(WRITES))
def test_gradients_written_between_micro_batches_are_what_the_next_backward_adds_to(write):
    # Two micro-batches a step; between them the gradient is written; torch's SGD steps. From the
    # second step on the engine keeps each gradient's running sum on the device (the loop
    # accumulates), which must follow the write.
    plain, ours = _models()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, ours)]
    for step in range(4):
        for m in (plain, ours):
            m(_batch(step, 0)).square().mean().backward()
            for p in m.parameters():
                WRITES[write](p.grad)
            m(_batch(step, 1)).square().mean().backward()
        _close(plain, ours, f"step {step}, before the update:")
        for o in opts:
            o.step()
        for m in (plain, ours):  # the manual zero_grad of older code
            for p in m.parameters():
                p.grad.data.zero_()
    _close(plain, ours, "after four steps:")


@pytest.mark.parametrize("write", ["data.clamp_", "data.mul_", "numpy"])
def test_a_gradient_written_between_backward_and_step_is_the_one_the_optimizer_uses(write):
    # ramtorch's AdamW computes updates during backward by default and keeps them only if what
    # they read is unchanged at step(): a gradient written through .data is a change.
    plain, ours = _models()
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt = ropt.AdamW(ours.parameters(), lr=1e-2)
    for step in range(5):
        for m, o in ((plain, opt_plain), (ours, opt)):
            m(_batch(step, 0)).square().mean().backward()
            for p in m.parameters():
                WRITES[write](p.grad)
            o.step()
            o.zero_grad()
        for (name, p), q in zip(plain.named_parameters(), ours.parameters(), strict=True):
            torch.testing.assert_close(
                q.detach(), p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )


def test_the_gradients_the_engine_makes_are_plain_tensors_to_their_users():
    _, ours = _models()
    ours(_batch(0, 0)).square().mean().backward()
    g = ours[0].weight.grad
    assert type(g) is HostGrad and isinstance(g, torch.Tensor)
    assert repr(g).startswith("tensor(")
    assert type(g * 2) is torch.Tensor and type(g.clone()) is torch.Tensor
    assert type(g.data) is torch.Tensor
    v = g._version
    g.add_(1.0)
    assert g._version > v  # torch's own count still moves
    v = g._version
    _ = g.data
    assert g._version > v  # and so does a touch through .data
    # torch's multi-tensor kernels take them as they take plain tensors (clip_grad_norm_ checks).
    from torch.utils._foreach_utils import _has_foreach_support

    assert _has_foreach_support([g], g.device)


def test_clipping_the_engines_gradients_gives_torchs_bits():
    plain, ours = _models()
    for m in (plain, ours):
        m(_batch(0, 0)).square().mean().backward()
    norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3) for m in (plain, ours)]
    assert torch.equal(norms[0], norms[1])
    for p, q in zip(plain.parameters(), ours.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_a_gradient_tensor_of_the_users_is_added_into_on_the_host():
    # A .grad the user made is not the engine's: a write through its .data would go unseen by a sum
    # kept on the device, so none is kept and the gradients are added into it as they land.
    plain, ours = _models()
    for m in (plain, ours):
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
    for step in range(3):
        for m in (plain, ours):
            m(_batch(step, 0)).square().mean().backward()
            for p in m.parameters():
                p.grad.data.mul_(0.5)
        _close(plain, ours, f"step {step}:")
    assert all(type(p.grad) is torch.Tensor for p in ours.parameters())
