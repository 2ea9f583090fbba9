"""Small gradients (a norm's, a bias's) cross the link in batches, one unit's at a time: the
gradients must equal torch's all the same, whatever mix of sizes, dtypes, shared parameters and
accumulating backwards a model has, and each ``.grad`` stays a tensor of its own."""

from __future__ import annotations

import copy
import io

import pytest
import ramtorch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ramtorch import _engine
from torch import nn

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# Gradient sums kept on the device (a loop seen to accumulate) take a path of their own.
pytestmark = pytest.mark.usefixtures("fresh_engine_sums")


class Block(nn.Module):
    """A linear layer, norms (one fp32 in a bf16 model, when ``mixed``), a shared bias used twice."""

    def __init__(self, d: int, mixed: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.norm2 = nn.LayerNorm(d)
        self.shift = nn.Parameter(torch.randn(d) * 0.1)
        self.mixed = mixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.lin(x) + self.shift)
        if self.mixed:
            h = self.norm2(h.float()).to(x.dtype)
        else:
            h = self.norm2(h)
        return torch.tanh(h) + self.shift  # ``shift`` has two consumers in the unit


class Model(nn.Module):
    def __init__(self, d: int, layers: int, mixed: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, mixed) for _ in range(layers))
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _pair(device: str, d: int, layers: int, dtype: torch.dtype, mixed: bool, seed: int):
    torch.manual_seed(seed)
    ref = Model(d, layers, mixed).to(dtype)
    if mixed:
        for b in ref.blocks:
            b.norm2.float()
    ours = copy.deepcopy(ref)
    ref.to(device)
    ramtorch.offload(ours, device=device)
    return ref, ours


def _copies(device: str) -> int:
    return int(_engine.engine_for(_engine.normalize_device(device)).stats()["d2h_copies"])


@pytest.mark.parametrize("device", DEVICES)
def test_small_gradients_cross_in_batches_and_equal_torch(device: str) -> None:
    ref, ours = _pair(device, d=24, layers=3, dtype=torch.float32, mixed=False, seed=0)
    x = torch.randn(5, 24, device=device)
    before = _copies(device)
    ref(x).square().mean().backward()
    ours(x).square().mean().backward()
    copies = _copies(device) - before
    params = list(ours.parameters())
    small = sum(1 for p in params if p.numel() * p.element_size() <= _engine._SMALL_GRAD_BYTES)
    assert small == len(params), "every gradient of this model is small"
    # Four blocks' worth of units at most (the blocks and the head), not one copy per parameter.
    assert copies <= 4 * 2, f"{copies} gradient copies for {len(params)} parameters"
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert q.grad is not None, name
        assert q.grad.device.type == "cpu"
        torch.testing.assert_close(q.grad, p.grad.cpu(), msg=name)
        # A storage of its own (torch.save would refuse several dtypes over one storage).
        assert q.grad.untyped_storage().nbytes() == q.grad.numel() * q.grad.element_size(), name


@settings(max_examples=8, deadline=None)
@given(
    d=st.integers(1, 40),
    layers=st.integers(1, 4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    mixed=st.booleans(),
    backwards=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_batched_gradients_equal_torch_over_steps_and_accumulation(
    d: int, layers: int, dtype: torch.dtype, mixed: bool, backwards: int, seed: int
) -> None:
    """Several optimizer steps, each of ``backwards`` accumulating backwards: the same as torch."""
    ref, ours = _pair("cpu", d, layers, dtype, mixed, seed)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
    for step in range(3):
        for k in range(backwards):
            x = torch.randn(3, d, dtype=dtype, generator=torch.Generator().manual_seed(seed + 7 * step + k))
            ref(x).float().square().mean().backward()
            ours(x).float().square().mean().backward()
        for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=f"step {step}: {name}", **tol)
        opt_ref.step()
        opt_ours.step()
        opt_ref.zero_grad()
        opt_ours.zero_grad()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), msg=name, **tol)


def test_batched_gradients_save_and_load() -> None:
    ref, ours = _pair("cpu", d=8, layers=2, dtype=torch.bfloat16, mixed=True, seed=3)
    ours(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    grads = {n: p.grad for n, p in ours.named_parameters()}
    buf = io.BytesIO()
    torch.save(grads, buf)
    buf.seek(0)
    back = torch.load(buf)
    for n, g in grads.items():
        assert back[n].dtype == g.dtype, n
        assert torch.equal(back[n], g), n


def test_an_interrupted_backward_leaves_no_batched_gradient() -> None:
    """A backward that raises after some small gradients were batched writes no ``.grad``; the
    next step is exact."""
    ref, ours = _pair("cpu", d=8, layers=3, dtype=torch.float32, mixed=False, seed=5)
    x = torch.randn(4, 8)

    def boom(_g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("stop")

    h = ours.blocks[0].lin.weight.register_hook(boom)
    with pytest.raises(RuntimeError, match="stop"):
        ours(x).square().mean().backward()
    h.remove()
    ours(x).square().mean().backward()  # the next forward drops what the interrupted one left
    assert all(q.grad is not None for q in ours.parameters())
    ref(x).square().mean().backward()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_accumulated_small_gradients_cross_in_batches() -> None:
    """A loop that accumulates keeps each gradient's running sum on the device; the small sums
    cross in batches too, and the sums equal torch's."""
    ref, ours = _pair("cpu", d=24, layers=3, dtype=torch.float32, mixed=False, seed=1)
    xs = [torch.randn(5, 24, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    for step in range(3):
        copies = []
        for x in xs:
            before = _copies("cpu")
            ref(x).square().mean().backward()
            ours(x).square().mean().backward()
            copies.append(_copies("cpu") - before)
        for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=f"step {step}: {name}")
        if step > 0:  # the engine has seen the loop accumulate: sums on the device
            assert _engine.engine_for(torch.device("cpu"))._sums, "sums kept on the device"
            assert max(copies) <= 4 * 2, f"gradient copies per backward: {copies}"
        ref.zero_grad()
        ours.zero_grad()


class Twice(nn.Module):
    """A unit called twice in one forward: each of its small weights gets two gradients a backward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
        self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(self.a(x)))


def test_a_unit_called_twice_accumulates_batched_gradients_like_torch() -> None:
    torch.manual_seed(4)
    ref = Twice()
    ours = copy.deepcopy(ref)
    ramtorch.offload(ours, device="cpu")
    for step in range(3):
        for _ in range(3):  # accumulating: from the second step on the sums stay on the device
            x = torch.randn(3, 8)
            ref(x).square().mean().backward()
            ours(x).square().mean().backward()
        for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=f"step {step}: {name}")
        ref.zero_grad()
        ours.zero_grad()


class _FailingCore:
    """An engine's Rust half whose gradient copies fail while ``fail`` is set."""

    def __init__(self, core: object) -> None:
        self._inner = core
        self.fail = True

    def copy_to_host(self, *a: object, **k: object) -> int:
        if self.fail:
            raise RuntimeError("copy_to_host: injected failure")
        return self._inner.copy_to_host(*a, **k)

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


@pytest.mark.parametrize("big", [False, True], ids=["batched", "alone"])
def test_a_failed_gradient_copy_raises_and_the_next_step_is_exact(big: bool) -> None:
    """A gradient copy the engine refuses (a batch's, or a large gradient's own) makes backward
    raise with the engine's message; nothing of that backward reaches ``.grad``, and the next
    backward equals torch's."""
    d = 160 if big else 8  # a 160 x 160 fp32 weight (100 KiB) crosses alone
    ref, ours = _pair("cpu", d=d, layers=2, dtype=torch.float32, mixed=False, seed=6)
    eng = _engine.engine_for(torch.device("cpu"))
    failing = _FailingCore(eng._core)
    eng._core = failing
    try:
        x = torch.randn(3, d)
        with pytest.raises(RuntimeError, match="injected failure"):
            ours(x).square().mean().backward()
        failing.fail = False
        assert all(q.grad is None for q in ours.parameters()), "no partial gradient"
        ours(x).square().mean().backward()
    finally:
        eng._core = failing._inner
    ref(x).square().mean().backward()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
