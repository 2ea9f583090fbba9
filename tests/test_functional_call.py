"""``torch.func.functional_call`` on an offloaded model: the tensors given for the call stand for
those parameters (the module computes on them; the unit's other parameters stream), gradients
reach both, the model is itself again after the call, and ``torch.func``'s transforms work over a
call given every parameter. Against the same calls on plain torch."""

from __future__ import annotations

import pytest
import ramtorch
import ramtorch.nn as rnn
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap


def mlp(linear: type[nn.Module] = nn.Linear) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(linear(12, 256), nn.Tanh(), linear(256, 128), nn.Tanh(), linear(128, 3))


def twins(kind: str) -> tuple[nn.Module, nn.Module]:
    if kind == "per-layer":
        return mlp(), mlp(rnn.Linear)
    ref, ours = mlp(), mlp()
    ramtorch.offload(ours, device="cpu")
    return ref, ours


KINDS = ["offload", "per-layer"]


def step_both(
    ref: nn.Module,
    ours: nn.Module,
    opt_ref: torch.optim.Optimizer,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
) -> None:
    """One training step of each model on ``x`` (mean square of the output), gradients zeroed."""
    for model, o in ((ref, opt_ref), (ours, opt)):
        model(x).square().mean().backward()
        o.step()
        o.zero_grad()


def trains_alike(ref: nn.Module, ours: nn.Module, gen: torch.Generator) -> None:
    """The model is itself again after the calls: its own parameters, trained as torch's."""
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    for _ in range(2):
        step_both(ref, ours, opt_ref, opt, torch.randn(5, 12, generator=gen))
    for a, b in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("given", ["all", "some"])
def test_functional_call_computes_on_the_given_tensors(kind, given):
    ref, ours = twins(kind)
    names = [n for n, _ in ref.named_parameters()]
    chosen = names if given == "all" else names[::2]
    gen = torch.Generator().manual_seed(1)
    shapes = {n: p.shape for n, p in ref.named_parameters()}
    new = {n: torch.randn(shapes[n], generator=gen).requires_grad_() for n in chosen}
    mine = {n: t.detach().clone().requires_grad_() for n, t in new.items()}
    x = torch.randn(5, 12, generator=gen)
    y_ref = functional_call(ref, new, (x,))
    y = functional_call(ours, mine, (x,))
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    y_ref.square().sum().backward()
    y.square().sum().backward()
    for n in chosen:  # the given tensors get their gradients
        torch.testing.assert_close(mine[n].grad, new[n].grad, rtol=1e-5, atol=1e-6)
    for (n, a), b in zip(ref.named_parameters(), ours.parameters()):  # the model's, for the rest
        if n in chosen:
            assert a.grad is None and b.grad is None, n
        else:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)
    trains_alike(ref, ours, gen)


@pytest.mark.parametrize("kind", KINDS)
def test_torch_func_grad_over_functional_call(kind):
    """``torch.func.grad`` of a loss of ``functional_call`` given every parameter (a MAML inner
    step, per-sample gradients): nothing of ramtorch's runs inside the transform."""
    ref, ours = twins(kind)
    x = torch.randn(5, 12)

    def loss(model: nn.Module):
        return lambda p: functional_call(model, p, (x,)).square().mean()

    p_ref = {n: t.detach() for n, t in ref.named_parameters()}
    p_ours = {n: t.detach().clone() for n, t in ours.named_parameters()}
    g_ref = grad(loss(ref))(p_ref)
    g = grad(loss(ours))(p_ours)
    for n in g_ref:
        torch.testing.assert_close(g[n], g_ref[n], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_vmap_and_jacrev_over_functional_call(kind):
    """Per-sample gradients (``vmap`` of ``grad``) and a Jacobian (``jacrev``) with respect to the
    parameters given to ``functional_call``: torch's."""
    ref, ours = twins(kind)
    x = torch.randn(4, 12)

    def per_sample(model: nn.Module) -> dict[str, torch.Tensor]:
        p = {n: t.detach().clone() for n, t in model.named_parameters()}

        def f(p: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
            return functional_call(model, p, (xi.unsqueeze(0),)).square().sum()

        return vmap(grad(f), in_dims=(None, 0))(p, x)

    def jacobian(model: nn.Module) -> dict[str, torch.Tensor]:
        p = {n: t.detach().clone() for n, t in model.named_parameters()}
        return jacrev(lambda p: functional_call(model, p, (x,)))(p)

    for fn in (per_sample, jacobian):
        want, got = fn(ref), fn(ours)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6)


def test_calls_interleaved_with_training_passes():
    """Training steps and functional_calls (every parameter given, then some) alternate on a model
    of seven units and three slots: the calls find copies prefetched along the last pass's
    itinerary that they do not take, and the steps after them stream as before."""

    def make() -> nn.Module:
        blocks = [nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(6)]
        return nn.Sequential(*blocks, nn.Linear(64, 4))

    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(0)
    ours = make()
    ramtorch.offload(ours, device="cpu")
    st = ramtorch.stats(ours)
    assert st["units"] == 7 and st["slot_count"] == 3
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    names = [n for n, _ in ref.named_parameters()]
    gen = torch.Generator().manual_seed(2)
    for r in range(4):
        x = torch.randn(8, 64, generator=gen)
        step_both(ref, ours, opt_ref, opt, x)
        given = names if r % 2 == 0 else names[::3]
        base = {n: t.detach() * 0.9 for n, t in ref.named_parameters() if n in given}
        p_ref = {n: t.clone().requires_grad_() for n, t in base.items()}
        p_ours = {n: t.clone().requires_grad_() for n, t in base.items()}
        y_ref, y = functional_call(ref, p_ref, (x,)), functional_call(ours, p_ours, (x,))
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
        y_ref.sum().backward()
        y.sum().backward()
        for n in given:
            torch.testing.assert_close(p_ours[n].grad, p_ref[n].grad, rtol=1e-5, atol=1e-6)
        for a, b in zip(ref.parameters(), ours.parameters()):
            assert (a.grad is None) == (b.grad is None)
            if a.grad is not None:
                torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)
        opt_ref.zero_grad()
        opt.zero_grad()
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("given", ["all", "some"])
def test_another_modules_parameters_are_for_the_call_only(kind, given):
    """``functional_call(model, dict(other.named_parameters()))``: another module's ``Parameter``s
    stand for the model's for that call (outputs and gradients as torch's), the other module is
    left as it was (its parameters' storage and values), and the model is itself again after the
    call, for forwards and for a training step. Before, such a ``Parameter`` was adopted as a
    replacement of the model's weight, moving the other module's parameter into the model's
    storage, and the model then refused its own parameter when the call put it back."""
    ref, ours = twins(kind)
    other = mlp()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5).add_(0.01)
    names = [n for n, _ in ref.named_parameters()]
    chosen = set(names if given == "all" else names[1::2])
    params = {n: p for n, p in other.named_parameters() if n in chosen}
    before = {n: (p.data_ptr(), p.device, p.detach().clone()) for n, p in params.items()}
    x = torch.randn(5, 12, generator=torch.Generator().manual_seed(3))
    for _ in range(2):
        y_ref, y = functional_call(ref, params, (x,)), functional_call(ours, params, (x,))
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
        y_ref.square().sum().backward()
        want = {n: p.grad.clone() for n, p in params.items()}
        other.zero_grad()
        y.square().sum().backward()
        for n, p in params.items():
            torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-6)
        other.zero_grad()
        ref.zero_grad()
        ours.zero_grad()
    for n, p in params.items():
        ptr, dev, val = before[n]
        assert (p.data_ptr(), p.device) == (ptr, dev), n
        torch.testing.assert_close(p.detach(), val, rtol=0, atol=0)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-6)
    trains_alike(ref, ours, torch.Generator().manual_seed(4))
