"""Gradients of gradients through streamed weights (a gradient penalty: WGAN-GP, R1): the input's
gradient taken with ``create_graph=True``, then a loss that includes its norm backpropagated to
the weights. The second backward reaches a weight saved by the node that consumed it by two
paths, the node's and the graph the first backward recorded; both must arrive. Against plain
torch: gradients and optimizer steps, on a conv critic, an MLP, and an LM-style head computed by
blocks of rows."""

from __future__ import annotations

import pytest
import ramtorch
import ramtorch.nn as rnn
import torch
from ramtorch._stream import rows
from torch import nn


def conv_critic() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 64, 3),
        nn.Tanh(),
        nn.Conv2d(64, 64, 3),  # 147 KiB: its gradient leaves from the node that consumes it
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(64 * 4 * 4, 1),
    )


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 256), nn.Tanh(), nn.Linear(256, 128), nn.Tanh(), nn.Linear(128, 1))


def head() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 64), nn.Tanh(), nn.Linear(64, 1024, bias=False))


def per_layer(linear: type[nn.Module]) -> nn.Module:
    return nn.Sequential(linear(12, 256), nn.Tanh(), linear(256, 128), nn.Tanh(), linear(128, 1))


MODELS = {
    "conv": (conv_critic, (3, 8, 8)),
    "mlp": (mlp, (12,)),
    "head-by-rows": (head, (12,)),
}


def test_per_layer_linears_under_a_gradient_penalty_train_as_torch():
    """``ramtorch.nn.Linear`` layers (each its own unit, no ``offload``) under the same penalty."""
    torch.manual_seed(0)
    ref = per_layer(nn.Linear)
    torch.manual_seed(0)
    ours = per_layer(rnn.Linear)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 12, generator=gen)
        penalty_loss(ref, x).backward()
        penalty_loss(ours, x).backward()
        for a, b in zip(ref.parameters(), ours.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    for a, b in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-4, atol=1e-5)


@pytest.fixture
def small_heads(monkeypatch):
    monkeypatch.setattr(rows, "MIN_BYTES", 1 << 12)
    monkeypatch.setattr(rows, "MIN_PART_BYTES", 1 << 10)
    monkeypatch.setattr(rows, "ROW_ALIGN", 8)


def penalty_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A critic's loss with a gradient penalty on its input: mean output + the squared norm of
    d(output)/d(input), minus one, squared (WGAN-GP's form)."""
    x = x.detach().requires_grad_(True)
    out = model(x)
    score = out.float().square().mean() if out.shape[-1] > 1 else out.float().mean()
    (g,) = torch.autograd.grad(score, x, create_graph=True)
    return score + 10.0 * (g.flatten(1).norm(dim=1) - 1).square().mean()


@pytest.mark.parametrize("name", list(MODELS))
def test_a_gradient_penalty_trains_as_torch(device, name, small_heads):
    make, shape = MODELS[name]
    torch.manual_seed(0)
    ref = make().to(device)
    torch.manual_seed(0)
    ours = make()
    ramtorch.offload(ours, device=device)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, *shape, generator=gen).to(device)
        penalty_loss(ref, x).backward()
        penalty_loss(ours, x).backward()
        for (n, a), b in zip(ref.named_parameters(), ours.parameters()):
            torch.testing.assert_close(b.grad.to(a.device), a.grad, rtol=1e-4, atol=1e-5, msg=n)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    for a, b in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(b.detach().to(a.device), a.detach(), rtol=1e-4, atol=1e-5)
    if name == "head-by-rows":
        assert ramtorch.stats(ours)["forwards_by_rows"] > 0  # the head was cut, and trained right
    # Plain steps after the penalty ones: still torch's.
    for _ in range(2):
        x = torch.randn(4, *shape, generator=gen).to(device)
        ref(x).float().square().mean().backward()
        ours(x).float().square().mean().backward()
        for a, b in zip(ref.parameters(), ours.parameters()):
            torch.testing.assert_close(b.grad.to(a.device), a.grad, rtol=1e-4, atol=1e-5)
        ref.zero_grad()
        ours.zero_grad()


def test_only_units_a_create_graph_backward_reached_stop_sending_early(small_heads):
    """The fallback (gradients leave from the unit's last node, summed) is taken by the units whose
    weights a ``create_graph`` backward unpacked, for good; a model that never takes gradients of
    gradients keeps sending each weight's gradient as soon as its node has run."""
    torch.manual_seed(0)
    plain, penalised = conv_critic(), conv_critic()
    for m in (plain, penalised):
        ramtorch.offload(m, device="cpu")
    x = torch.randn(2, 3, 8, 8)
    plain(x).sum().backward()
    penalty_loss(penalised, x).backward()
    assert all(u.early_grads for u in plain._ramtorch_streamer.units)
    assert not all(u.early_grads for u in penalised._ramtorch_streamer.units)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")  # torch's own
def test_backward_with_create_graph_is_refused_clearly_and_the_model_trains_on():
    """``loss.backward(create_graph=True)`` would leave a graph in each weight's ``.grad``; a
    streamed weight's ``.grad`` lives in host RAM and cannot keep one, so the backward is refused
    with a message that says what to do, leaving ``.grad`` as it was; the next backward is torch's."""
    torch.manual_seed(0)
    ref = mlp()
    torch.manual_seed(0)
    ours = mlp()
    ramtorch.offload(ours, device="cpu")
    x = torch.randn(4, 12)
    with pytest.raises(RuntimeError, match=r"create_graph=True.*torch\.autograd\.grad\(loss, inputs"):
        ours(x).square().sum().backward(create_graph=True)
    assert all(p.grad is None for p in ours.parameters())
    ref(x).square().sum().backward()
    ours(x).square().sum().backward()
    for a, b in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)
