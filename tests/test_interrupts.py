"""Interrupts (Ctrl-C, an exception in a hook) at any point of a streamed pass leave the engine and
the model consistent: training continues and matches plain PyTorch."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import ramtorch
import torch
from ramtorch import _engine
from ramtorch._stream import shared as _shared
from torch import nn


class Blocks(nn.Module):
    """A small model of a few blocks (the streamed units of ``ramtorch.offload``)."""

    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _pair(kind: str, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """``(ramtorch model, torch reference)`` with equal weights."""
    torch.manual_seed(seed)
    ref = Blocks()
    model = copy.deepcopy(ref)
    if kind == "offload":
        model = ramtorch.offload(model, device="cpu", max_inflight=2)
    else:
        model = ramtorch.replace_linear(model, device="cpu", max_inflight=2)
    return model, ref


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x, y = _batch(step)
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()


def _assert_same(model: nn.Module, ref: nn.Module, atol: float = 1e-5) -> None:
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k].cpu(), want[k], atol=atol, rtol=1e-4, msg=k)


class _Flaky:
    """Stands in for an engine's ``_core``: the ``nth`` call of ``method`` raises ``exc``, before
    the real call or right after it returned (the interrupt lands between the engine's answer and
    the code that records it)."""

    def __init__(self, core: Any, method: str, nth: int, after: bool, exc: type[BaseException]) -> None:
        self._inner, self._method, self._left, self._after, self._exc = core, method, nth, after, exc
        self.fired = False

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._inner, name)
        if name != self._method:
            return real

        def call(*args: Any, **kwargs: Any) -> Any:
            self._left -= 1
            fire = self._left == 0
            if fire and not self._after:
                self.fired = True
                raise self._exc("injected")
            out = real(*args, **kwargs)
            if fire:
                self.fired = True
                raise self._exc("injected")
            return out

        return call


def _train_through_faults(
    kind: str, points: list[tuple[str, int, bool]], exc: type[BaseException] = KeyboardInterrupt
) -> None:
    """Trains ``kind`` with an injected fault at each of ``points`` (one step each), then a few
    clean steps; the weights must equal torch's trained on the steps that completed."""
    model, ref = _pair(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    eng = _engine.engine_for(torch.device("cpu"))
    step = 0
    for method, nth, after in points:
        real = eng._core
        flaky = _Flaky(real, method, nth, after, exc)
        eng._core = flaky
        completed = False
        try:
            _step(model, opt, step)
            completed = True
        except exc:
            pass
        finally:
            eng._core = real
        assert completed != flaky.fired, (method, nth, after)
        if completed:
            _step(ref, ref_opt, step)
        step += 1
        # The next step must work, and both models agree after it.
        _step(model, opt, step)
        _step(ref, ref_opt, step)
        step += 1
        _assert_same(model, ref)
    for _ in range(3):
        _step(model, opt, step)
        _step(ref, ref_opt, step)
        step += 1
    _assert_same(model, ref)


_POINTS = [
    (method, nth, after)
    for method in ("prefetch", "claim", "release", "copy_to_host")
    for nth in (1, 2, 3, 5, 8)
    for after in (False, True)
]


@pytest.mark.parametrize("kind", ["offload", "linear"])
@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_fault_at_each_engine_call_keeps_training_right(kind: str, exc: type[BaseException]) -> None:
    _train_through_faults(kind, _POINTS, exc)


def _raise_once(obj: Any, name: str, nth: int, after: bool) -> Callable[[], bool]:
    """Makes the ``nth`` call of ``obj.name`` (a Python helper) raise KeyboardInterrupt."""
    real = getattr(obj, name)
    state = {"left": nth, "fired": False}

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        state["left"] -= 1
        fire = state["left"] == 0
        if fire and not after:
            state["fired"] = True
            raise KeyboardInterrupt
        out = real(*args, **kwargs)
        if fire:
            state["fired"] = True
            raise KeyboardInterrupt
        return out

    setattr(obj, name, wrapper)
    return lambda: bool(state["fired"])


@pytest.mark.parametrize("kind", ["offload", "linear"])
@pytest.mark.parametrize(
    "helper",
    [
        "_take",
        "_prefetch",
        "_prefetch_along",
        "_give",
        "_end_forward",
        "prefetch",
        "_drop_ahead",
        "release",
        "claim",
    ],
)
def test_interrupt_in_python_helpers_keeps_training_right(kind: str, helper: str) -> None:
    model, ref = _pair(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    eng = _engine.engine_for(torch.device("cpu"))
    # An offloaded model streams on its own streamer; per-layer Linears on the device's shared one.
    streamer = getattr(model, "_ramtorch_streamer", None) or _shared.for_device(torch.device("cpu"))
    target = eng if hasattr(eng, helper) and not hasattr(streamer, helper) else streamer
    step = 0
    for nth in (1, 2, 4, 7):
        for after in (False, True):
            fired = _raise_once(target, helper, nth, after)
            completed = False
            try:
                _step(model, opt, step)
                completed = True
            except KeyboardInterrupt:
                pass
            finally:
                target.__dict__.pop(helper, None)
            assert completed != fired()
            if completed:
                _step(ref, ref_opt, step)
            step += 1
            _step(model, opt, step)
            _step(ref, ref_opt, step)
            step += 1
    _assert_same(model, ref)


# -- an interrupted backward whose first units were already updated -----------------------------


def _optimizers(name: str, model: nn.Module, ref: nn.Module) -> tuple[Any, torch.optim.Optimizer]:
    """Optimizers that commit updates during backward (overlap="backward"), so that an interrupted
    backward leaves some units updated (the default changes nothing before step())."""
    if name == "sgd":
        ours = ramtorch.optim.SGD(model.parameters(), lr=0.1, overlap="backward")
        return ours, torch.optim.SGD(ref.parameters(), lr=0.1)
    kw = {"lr": 0.01, "weight_decay": 0.01}
    ours = ramtorch.optim.AdamW(model.parameters(), overlap="backward", **kw)
    return ours, torch.optim.AdamW(ref.parameters(), **kw)


class _Boom(Exception):
    pass


def _interrupted_backward(model: nn.Module, opt: Any, step: int, exc: type[BaseException]) -> None:
    """A step whose backward raises (from a hook) once the units after the second block are done."""
    x, y = _batch(step)
    opt.zero_grad()

    def arm(_m: nn.Module, _a: Any, out: torch.Tensor) -> None:
        def boom(_g: torch.Tensor) -> None:
            raise exc("injected in backward")

        out.register_hook(boom)

    handle = model.blocks[1].register_forward_hook(arm)
    try:
        loss = nn.functional.mse_loss(model(x), y)
    finally:
        handle.remove()
    with pytest.raises(exc):
        loss.backward()


def _apply_same_updates(
    before: dict[str, torch.Tensor], model: nn.Module, opt: Any, ref: nn.Module, ref_opt: Any, step: int
) -> int:
    """Gives ``ref`` the updates the interrupted ``step`` made to ``model``: the parameters it
    changed get torch's update for that step, the others none. Returns how many changed."""
    opt.synchronize()  # the updates queued during that backward are done
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    x, y = _batch(step)
    ref_opt.zero_grad()
    nn.functional.mse_loss(ref(x), y).backward()
    for name, p in ref.named_parameters():
        if name not in changed:
            p.grad = None
    ref_opt.step()
    return len(changed)


@pytest.mark.parametrize("kind", ["offload", "linear"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("exc", [KeyboardInterrupt, _Boom])
def test_updates_of_an_interrupted_backward_reach_the_next_forward(kind, optimizer, exc) -> None:
    model, ref = _pair(kind)
    opt, ref_opt = _optimizers(optimizer, model, ref)
    step = 0
    for _ in range(3):  # the first steps update in step(); then during backward
        _step(model, opt, step)
        _step(ref, ref_opt, step)
        step += 1
    _assert_same(model, ref)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _interrupted_backward(model, opt, step, exc)
    changed = _apply_same_updates(before, model, opt, ref, ref_opt, step)
    assert 0 < changed < len(before), "the test wants a backward interrupted after some updates"
    step += 1
    _assert_same(model, ref)
    for _ in range(3):
        _step(model, opt, step)
        _step(ref, ref_opt, step)
        step += 1
        _assert_same(model, ref)


@pytest.mark.parametrize("kind", ["offload", "linear"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_synchronize_after_an_interrupted_backward_writes_no_gradient(kind, optimizer) -> None:
    model, ref = _pair(kind)
    opt, ref_opt = _optimizers(optimizer, model, ref)
    step = 0
    for _ in range(3):
        _step(model, opt, step)
        _step(ref, ref_opt, step)
        step += 1
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _interrupted_backward(model, opt, step, KeyboardInterrupt)
    ramtorch.synchronize()
    assert all(p.grad is None for p in model.parameters()), "an interrupted backward's gradients"
    _apply_same_updates(before, model, opt, ref, ref_opt, step)
    step += 1
    for _ in range(2):
        _step(model, opt, step)
        _step(ref, ref_opt, step)
        step += 1
        _assert_same(model, ref)


# -- two threads, two models, one engine -----------------------------------------------------------


@pytest.mark.parametrize("kinds", [("offload", "offload"), ("linear", "linear"), ("offload", "linear")])
def test_two_threads_training_two_models_are_right_or_refused(kinds: tuple[str, str]) -> None:
    """Two threads each train their own model on the same device: each model either matches
    torch trained on the steps it completed, or its thread got the clear error; never silently
    wrong weights."""
    import threading

    steps = 30
    pairs = [_pair(kind, seed=s) for s, kind in enumerate(kinds)]
    results: list[dict[str, Any]] = [{"done": 0, "error": None} for _ in pairs]
    start = threading.Barrier(len(pairs))

    def train(k: int) -> None:
        model = pairs[k][0]
        opt = ramtorch.optim.AdamW(model.parameters(), lr=0.01)
        start.wait(timeout=300)
        try:
            for step in range(steps):
                _step(model, opt, step)
                results[k]["done"] += 1
            opt.synchronize()
        except RuntimeError as e:
            results[k]["error"] = e
            opt.synchronize()

    threads = [threading.Thread(target=train, args=(k,)) for k in range(len(pairs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
        assert not t.is_alive()
    for (model, ref), res in zip(pairs, results):
        err = res["error"]
        if err is not None:
            assert "thread" in str(err) and "at once" in str(err), err
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
        for step in range(res["done"]):
            _step(ref, ref_opt, step)
        _assert_same(model, ref)


# -- real SIGINTs at random times --------------------------------------------------------------


class _Sigint:
    """Sends SIGINT to this process after a delay, from a timer thread; it raises
    KeyboardInterrupt in the main thread only while armed (a late signal is dropped)."""

    def __init__(self) -> None:
        import signal
        import threading

        self._signal, self._threading = signal, threading
        self.armed = False
        self.delivered = 0
        self._timer: Any = None

    def __enter__(self) -> _Sigint:
        def handler(_sig: int, _frame: Any) -> None:
            if self.armed:
                self.delivered += 1
                raise KeyboardInterrupt

        self._old = self._signal.signal(self._signal.SIGINT, handler)
        return self

    def arm(self, delay: float) -> None:
        import os

        self.armed = True
        self._timer = self._threading.Timer(delay, os.kill, (os.getpid(), self._signal.SIGINT))
        self._timer.start()

    def disarm(self) -> None:
        self.armed = False
        self._timer.cancel()
        self._timer.join(timeout=300)

    def __exit__(self, *_: Any) -> None:
        if self._timer is not None:
            self.disarm()
        self._signal.signal(self._signal.SIGINT, self._old)


@pytest.mark.parametrize("setup", ["offload", "pipelined", "linear"])
def test_random_sigints_during_training_leave_it_right(setup: str) -> None:
    """Real SIGINTs land at random points of forward, backward and step. The design guarantees
    each parameter's update of a step is applied whole or not at all (an interrupted step may
    have updated some parameters: those whose gradients were complete during backward, or
    those step() reached); torch gets exactly the updates each parameter got, and the weights
    must match after every interrupt and at the end. The optimizer is plain SGD: AdamW's step
    count of a parameter is bumped before its kernel runs, so an interrupt between the two
    is not covered here."""
    import random
    import time

    model, ref = _pair("linear" if setup == "linear" else "offload", seed=3)
    opt = ramtorch.optim.SGD(model.parameters(), lr=0.05, pipeline=setup == "pipelined")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    rng = random.Random(1234)
    times = []
    for step in range(5):  # warm up (the first steps update in step()) and time a step
        t = time.perf_counter()
        _step(model, opt, step)
        times.append(time.perf_counter() - t)
        _step(ref, ref_opt, step)
    took = sorted(times)[2]
    step = 5
    interrupted = 0
    with _Sigint() as sig:
        for _ in range(100):
            torch.set_grad_enabled(True)  # an interrupt inside torch.no_grad's entry leaves it off
            before = {k: v.clone() for k, v in model.state_dict().items()}
            try:
                try:
                    sig.arm(rng.uniform(0.0, took))
                    _step(model, opt, step)
                finally:
                    sig.armed = False  # a signal landing before this line is caught just below
            except KeyboardInterrupt:
                interrupted += 1
            except RuntimeError as e:
                # An interrupt between the end of a backward (whose updates ran) and step()
                # looks to the optimizer like a second micro-batch outside accumulate(): the
                # next step() says so and applies nothing; training goes on after it.
                assert "from another backward" in str(e), e
            sig.disarm()
            torch.set_grad_enabled(True)
            _apply_same_updates(before, model, opt, ref, ref_opt, step)
            step += 1
            _assert_same(model, ref)
    assert interrupted >= 30, f"only {interrupted} of 100 steps were interrupted"
    for _ in range(3):
        _step(model, opt, step)
        _step(ref, ref_opt, step)
        step += 1
    _assert_same(model, ref)


def test_a_forward_without_backward_does_not_lock_out_other_threads() -> None:
    """A forward with gradients that no backward follows (an evaluation outside ``no_grad``) holds
    no training step: another thread may still synchronize, load and run inference."""
    import threading

    torch.manual_seed(0)
    model = ramtorch.offload(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), device="cpu")
    ref = copy.deepcopy(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    ref.load_state_dict(model.state_dict())
    x = torch.randn(2, 8)
    model(x)  # with gradients, never backpropagated
    errors: list[BaseException] = []
    out: list[torch.Tensor] = []

    def other() -> None:
        try:
            ramtorch.synchronize()
            with torch.no_grad():
                out.append(model(x))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    th = threading.Thread(target=other)
    th.start()
    th.join(300)
    assert not th.is_alive() and not errors, errors
    torch.testing.assert_close(out[0], ref(x).detach())


def test_ctrl_c_inside_a_linear_layers_forward_holds_nothing(monkeypatch) -> None:
    """A KeyboardInterrupt inside ``ramtorch.nn.Linear``'s own forward (between its hooks, where
    torch calls no forward hook) leaves the real parameters in place and the device's forwards
    free: another thread's forward runs, and so does the next step, equal to torch."""
    import threading

    import torch.nn.functional as F

    torch.manual_seed(0)
    ref = nn.Linear(8, 4)
    layer = ramtorch.nn.Linear.from_linear(ref, device="cpu")
    x = torch.randn(3, 8)
    real = F.linear
    calls = {"n": 0}

    def interrupted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "linear", interrupted)
    with pytest.raises(KeyboardInterrupt):
        layer(x)
    assert type(layer.weight) is nn.Parameter and layer.weight.device.type == "cpu"
    assert not _engine.engine_for(torch.device("cpu")).forwards._tokens
    out: list[torch.Tensor] = []

    def other() -> None:
        with torch.no_grad():  # inference: a forward with gradients is this thread's step
            out.append(layer(x))

    th = threading.Thread(target=other)
    th.start()
    th.join(300)
    assert not th.is_alive() and out
    torch.testing.assert_close(out[0], ref(x).detach())
    layer(x).sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad)
