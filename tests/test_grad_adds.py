"""Gradients accumulated on the host (no room for a running sum on the device): each is added
into a copy of ``.grad`` as its copy lands, while the backward goes on, and ``.grad`` is written at
the end of backward. Against torch, bit for bit on the CPU: several steps, several backwards a
step, every way ``.grad`` can be left between backwards, and an interrupted backward."""

from __future__ import annotations

import contextlib
import copy
import gc
import warnings
import weakref
from collections.abc import Iterator

import pytest
import ramtorch
import torch
from conftest import Net
from hypothesis import given, settings
from hypothesis import strategies as st
from ramtorch import _engine
from torch import nn

pytestmark = pytest.mark.usefixtures("fresh_engine_sums")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _engine_of(device: str) -> _engine.DeviceEngine:
    return _engine.engine_for(_engine.normalize_device(device))


class Twice(nn.Module):
    """A streamed unit called twice a forward: two gradients of each weight a backward."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.mid = nn.Linear(d, d)
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(self.mid(torch.relu(self.mid(h))))


def _pair(kind: str, device: str, dtype: torch.dtype, d: int, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    if kind == "linear":
        ref = nn.Sequential(nn.Linear(8, d), nn.ReLU(), nn.Linear(d, d), nn.Tanh(), nn.Linear(d, 3)).to(dtype)
        ours = nn.Sequential(
            ramtorch.nn.Linear(8, d, dtype=dtype),
            nn.ReLU(),
            ramtorch.nn.Linear(d, d, dtype=dtype),
            nn.Tanh(),
            ramtorch.nn.Linear(d, 3, dtype=dtype),
        )
        with torch.no_grad():
            for p, q in zip(ref.parameters(), ours.parameters()):
                q.copy_(p)
        return ref.to(device), ours.to(device)  # (per-layer Linear: computes where it is moved)
    ref = (Twice(d) if kind == "twice" else Net(d=d, layers=2)).to(dtype)
    ours = copy.deepcopy(ref)
    ramtorch.offload(ours, device=device)
    return ref.to(device), ours


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().square().mean()


def _backward_both(ref: nn.Module, ours: nn.Module, **kw: object) -> None:
    """One micro-batch through both models, on the same random input (``kw``: ``torch.randn``'s)."""
    x = torch.randn(5, 8, **kw)
    _loss(ref, x).backward()
    _loss(ours, x).backward()


def _steps_equal(ref: nn.Module, ours: nn.Module, steps: int, micro: int, **kw: object) -> None:
    """``steps`` times: ``micro`` backwards, gradients compared, ``zero_grad``."""
    for _ in range(steps):
        for _ in range(micro):
            _backward_both(ref, ours, **kw)
        _grads_equal(ref, ours)
        ref.zero_grad()
        ours.zero_grad()


def _grads_equal(ref: nn.Module, ours: nn.Module) -> None:
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is None:
            continue
        assert q.grad.device == q.device, name  # on the host, or on the device (resident)
        if p.grad.device.type == "cpu":
            assert torch.equal(q.grad, p.grad), name
        else:  # a streamed layer's weight gradient may come from another cuBLAS kernel
            tol = 1e-2 if p.dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(q.grad.cpu(), p.grad.cpu(), rtol=tol, atol=tol / 10, msg=name)


@contextlib.contextmanager
def _adds_by(how: str) -> Iterator[None]:
    """Host adds of every size by the engine's kernel (``"kernel"``), or as the engine picks."""
    least = _engine._KERNEL_ADD_MIN_BYTES
    if how == "kernel":
        _engine._KERNEL_ADD_MIN_BYTES = 0
    try:
        yield
    finally:
        _engine._KERNEL_ADD_MIN_BYTES = least


def _no_device_sums(device: str) -> _engine.DeviceEngine:
    eng = _engine_of(device)
    eng.drop_sums()
    eng.sum_cap = 0  # (restored by the fixture)
    # Optimizers of earlier tests, unreachable but not yet collected, would still listen (and
    # optimizers that listen read the buffers themselves: no adds are made for them).
    gc.collect()
    assert not eng._gradient_readers()
    return eng


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["offload", "linear", "twice"])
@pytest.mark.parametrize("zero", ["none", "in_place", "user_tensor"])
@pytest.mark.parametrize("adds", ["default", "kernel"])
def test_host_accumulation_adds_as_gradients_land_and_equals_torch(device, kind, zero, adds):
    with _adds_by(adds):
        _host_accumulation_equals_torch(device, kind, zero)


def _host_accumulation_equals_torch(device: str, kind: str, zero: str) -> None:
    eng = _no_device_sums(device)
    ref, ours = _pair(kind, device, torch.float32, d=160)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.05)
    before = eng.stats()["grad_adds_as_landed"]
    for _ in range(3):
        if zero == "user_tensor":  # a .grad the engine did not write: keeps its memory
            for m in (ref, ours):
                for p in m.parameters():
                    p.grad = torch.full_like(p, 0.25)  # where the parameter lives
            kept = {id(p): p.grad for p in ours.parameters()}
        for _ in range(3):
            x = torch.randn(6, 8)
            _loss(ref, x.to(device)).backward()
            _loss(ours, x.to(device)).backward()
        _grads_equal(ref, ours)
        if zero == "user_tensor":
            assert all(p.grad is kept[id(p)] for p in ours.parameters())
        opt_ref.step()
        opt_ours.step()
        opt_ref.zero_grad(set_to_none=zero == "none")
        opt_ours.zero_grad(set_to_none=zero == "none")
    for p, q in zip(ref.parameters(), ours.parameters()):
        if device == "cpu":
            assert torch.equal(p.detach(), q.detach())
    assert eng.stats()["grad_sum_bytes"] == 0
    assert eng.stats()["grad_adds_as_landed"] > before  # the large weights were added as they landed


@settings(max_examples=10, deadline=None)
@given(
    d=st.integers(128, 260),
    micro=st.integers(2, 4),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    kind=st.sampled_from(["offload", "linear", "twice"]),
    adds=st.sampled_from(["default", "kernel"]),
)
def test_random_shapes_and_dtypes_add_on_the_host_as_torch(d, micro, dtype, kind, adds):
    _no_device_sums("cpu")
    ref, ours = _pair(kind, "cpu", dtype, d=d, seed=d)
    with _adds_by(adds):
        _steps_equal(ref, ours, steps=2, micro=micro, dtype=dtype)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 70_000),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    scale=st.sampled_from([1e-3, 1.0, 1e4]),
    seed=st.integers(0, 2**16),
)
def test_the_engines_add_is_torchs(n, dtype, scale, seed):
    # (float16 is left to torch by the engine: this checks that path's bits too)
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(n, generator=g) * scale).to(dtype)
    b = (torch.randn(n, generator=g) * scale).to(dtype)
    if n > 8:  # specials: they stay what torch makes of them
        a[:4] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0])
        b[4:8] = torch.tensor([float("inf"), 1e-30, -0.0, 65504.0])
    want = a.clone().add_(b)
    with _adds_by("kernel"):
        got = a.clone()
        v = got._version
        _engine.host_add_(got, b)
        if dtype in _engine._ADD_DTYPES:
            c = a.clone()
            _engine._core.add_(c, b, str(dtype).removeprefix("torch."), n)
            assert torch.equal(
                c.view(torch.int16 if dtype != torch.float32 else torch.int32),
                want.view(torch.int16 if dtype != torch.float32 else torch.int32),
            )
    assert got._version == v + 1  # as torch's add_ counts a write
    assert torch.equal(
        got.view(torch.int16 if dtype != torch.float32 else torch.int32),
        want.view(torch.int16 if dtype != torch.float32 else torch.int32),
    )


def test_the_engines_add_leaves_what_it_cannot_take_to_torch():
    base = torch.arange(12.0)
    with _adds_by("kernel"):
        x = base.clone()
        with pytest.raises(RuntimeError, match="single memory location"):  # overlapping: as torch
            _engine.host_add_(x[2:], x[:-2])
        assert torch.equal(x, base)
        t = torch.ones(4, 3).t()  # not contiguous
        _engine.host_add_(t, torch.ones(3, 4))
        assert torch.equal(t, torch.full((3, 4), 2.0))
        d = torch.ones(5, dtype=torch.float64)  # a dtype the kernel does not take
        _engine.host_add_(d, torch.ones(5, dtype=torch.float64))
        assert torch.equal(d, torch.full((5,), 2.0, dtype=torch.float64))
        m = torch.ones(5)  # mixed dtypes: torch promotes
        _engine.host_add_(m, torch.ones(5, dtype=torch.bfloat16))
        assert torch.equal(m, torch.full((5,), 2.0))


@pytest.mark.usefixtures("small_params_streamed")
def test_an_interrupted_backward_leaves_grad_as_it_was():
    eng = _no_device_sums("cpu")
    ref, ours = _pair("offload", "cpu", torch.float32, d=160)
    _backward_both(ref, ours)
    before = {id(p): p.grad.clone() for p in ours.parameters()}
    adds = eng.stats()["grad_adds_as_landed"]

    class Boom(Exception):
        pass

    y = torch.randn(5, 8, requires_grad=True)
    out = _loss(ours, y)
    handle = y.register_hook(lambda g: (_ for _ in ()).throw(Boom()))  # after every weight's gradient
    with pytest.raises(Boom):
        out.backward()
    handle.remove()
    ramtorch.synchronize()
    assert eng.stats()["grad_adds_as_landed"] > adds  # the adds ran, into buffers that are dropped
    for p in ours.parameters():
        assert torch.equal(p.grad, before[id(p)])
    _backward_both(ref, ours)
    _grads_equal(ref, ours)


@pytest.mark.parametrize("sums", [False, True])
def test_a_view_of_a_users_grad_sees_the_sum(sums):
    """A ``.grad`` the user made keeps its memory, so that views of it (a flat gradient buffer)
    see every backward's sum. Its gradients are added into it on the host, whether or not the
    device has room for sums: a sum kept on the device would not see a write through ``.data``
    of a tensor that is not the engine's (``test_grad_data_writes.py``)."""
    if not sums:
        _no_device_sums("cpu")
    ref, ours = _pair("offload", "cpu", torch.float32, d=160)
    for m in (ref, ours):
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
    views = [p.grad.view(-1) for p in ours.parameters()]
    for _ in range(4):
        _backward_both(ref, ours)
    _grads_equal(ref, ours)
    assert _engine_of("cpu").stats()["grad_sum_bytes"] == 0
    for v, p in zip(views, ours.parameters()):
        assert torch.equal(v, p.grad.view(-1))


def test_a_grad_written_during_backward_is_reported():
    _no_device_sums("cpu")
    _, ours = _pair("offload", "cpu", torch.float32, d=160)
    _loss(ours, torch.randn(5, 8)).backward()
    w = ours.blocks[0].fc.weight if hasattr(ours.blocks[0], "fc") else max(ours.parameters(), key=torch.numel)
    y = torch.randn(5, 8, requires_grad=True)
    out = _loss(ours, y)

    def write(g: torch.Tensor) -> None:  # runs after every weight's gradient is complete
        w.grad.mul_(2)

    handle = y.register_hook(write)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out.backward()
    handle.remove()
    assert any("written during backward" in str(c.message) for c in caught)


class Checkpointed(Net):
    def __init__(self, d: int, reentrant: bool) -> None:
        super().__init__(d=d, layers=2)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = self.inp(x)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.reentrant)
        return self.out(x)


@pytest.mark.parametrize("reentrant", [False, True])
def test_recomputed_units_add_on_the_host_as_torch(reentrant):
    """Activation checkpointing: a unit's forward runs again inside backward."""
    _no_device_sums("cpu")
    torch.manual_seed(3)
    ref = Checkpointed(160, reentrant)
    ours = copy.deepcopy(ref)
    ramtorch.offload(ours, device="cpu")
    _steps_equal(ref, ours, steps=2, micro=3, requires_grad=reentrant)


@pytest.mark.usefixtures("small_params_streamed")
def test_a_failed_add_raises_and_leaves_grad_as_it_was(monkeypatch):
    eng = _no_device_sums("cpu")
    ref, ours = _pair("offload", "cpu", torch.float32, d=160)
    _backward_both(ref, ours)
    before = {id(p): p.grad.clone() for p in ours.parameters()}

    def fail(*_a: object) -> None:
        raise OSError("host memory went away")

    monkeypatch.setattr(eng, "_run_adds", fail)
    with pytest.raises(RuntimeError, match="adding a gradient into .grad on the host failed") as info:
        _loss(ours, torch.randn(5, 8)).backward()
    assert isinstance(info.value.__cause__, OSError)
    for p in ours.parameters():
        assert torch.equal(p.grad, before[id(p)])
    monkeypatch.undo()
    _backward_both(ref, ours)
    _grads_equal(ref, ours)


@pytest.mark.usefixtures("small_params_streamed")
def test_the_engine_forgets_the_grads_it_wrote_with_their_parameters():
    eng = _no_device_sums("cpu")
    ref, ours = _pair("offload", "cpu", torch.float32, d=160)
    _backward_both(ref, ours)
    params = list(ours.parameters())
    assert all(eng._wrote(p, p.grad) for p in params)
    n = len(eng._written)
    del ours, params, ref
    gc.collect()
    assert len(eng._written) <= n - 3


def test_the_engines_add_writes_through_a_view_into_a_larger_tensor():
    """A ``.grad`` that is a stretch of a flat buffer (contiguous, at an offset): the kernel adds
    into that stretch only, and the buffer's other elements stay."""
    flat = torch.zeros(3 * 4096, dtype=torch.bfloat16)
    view = flat[4096:8192].view(64, 64)
    src = torch.full((64, 64), 1.5, dtype=torch.bfloat16)
    with _adds_by("kernel"):
        _engine.host_add_(view, src)
    assert torch.equal(flat[4096:8192], torch.full((4096,), 1.5, dtype=torch.bfloat16))
    assert not flat[:4096].any() and not flat[8192:].any()


def test_the_per_parameter_map_drops_only_its_own_dead_entries():
    m = _engine._ByParam()
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    m.set(a, 1)
    m.set(b, 2)
    m.set(a, 3)  # (the same parameter again: its entry is replaced)
    assert m.get(a) == 3 and m.get(b) == 2 and len(m) == 2
    assert m.get(nn.Parameter(torch.zeros(2))) is None
    # A parameter that died while another took its id: the newcomer's entry stays.
    ka = id(a)
    ref_a = m._d[ka][0]
    m._d[ka] = (weakref.ref(b), 9)  # as if ``b`` had been given ``a``'s id
    del a
    gc.collect()
    assert ref_a() is None and m._d[ka][1] == 9
    del b
    gc.collect()
    assert len(m) == 1  # (b's own entry went; the stand-in under a's id is b's too, now dead)
    assert all(e[0]() is None for e in m._d.values())
