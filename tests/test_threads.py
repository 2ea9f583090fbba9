"""Several threads running inference on streamed weights at once: the forwards of one device run
one after the other (``DeviceEngine.forwards``), and each thread gets exactly the outputs it gets
alone. Before, two threads in one model took the same unit's slot twice ("prefetch: unit ... is
already held in device slot 2") or ran out of slots."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import ramtorch
import ramtorch.nn as rnn
import torch
from torch import nn

THREADS = 4
PASSES = 12
#: How long a thread may take; only a hang comes near it (CI machines are slow and loaded).
JOIN_SECONDS = 300.0


def _run_threads(bodies: list[Callable[[], None]]) -> list[BaseException]:
    """Runs each body on a thread of its own, started together; returns what they raised."""
    errors: list[BaseException] = []
    start = threading.Barrier(len(bodies))

    def run(body: Callable[[], None]) -> None:
        try:
            start.wait()
            body()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(b,), daemon=True) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_SECONDS)
    assert not any(t.is_alive() for t in threads), "a thread hangs"
    return errors


def _inference(model: nn.Module, x: torch.Tensor, want: torch.Tensor) -> Callable[[], None]:
    def body() -> None:
        with torch.no_grad():
            for _ in range(PASSES):
                got = model(x)
                assert torch.equal(got, want), "a thread's output differs from the single-threaded one"

    return body


def _stack(seed: int, width: int = 96, depth: int = 6) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)])


def _offloaded(seed: int) -> tuple[nn.Module, nn.Module]:
    ref = _stack(seed)
    model = ramtorch.offload(_stack(seed), device="cpu", unit=nn.Linear)
    return ref, model


def test_threads_of_inference_on_one_offloaded_model_match_one_thread():
    ref, model = _offloaded(0)
    xs = [torch.randn(3, 96) for _ in range(THREADS)]
    with torch.no_grad():
        wants = [ref(x) for x in xs]
    errors = _run_threads([_inference(model, x, w) for x, w in zip(xs, wants)])
    assert not errors, errors[0]
    with torch.no_grad():  # the model works on afterwards, in this thread
        assert torch.equal(model(xs[0]), wants[0])


def test_threads_of_inference_on_free_standing_layers_match_one_thread():
    torch.manual_seed(1)
    ref = nn.Sequential(nn.Embedding(50, 64), *[nn.Linear(64, 64) for _ in range(5)])
    model = nn.Sequential(rnn.Embedding(50, 64), *[rnn.Linear(64, 64) for _ in range(5)])
    model.load_state_dict(ref.state_dict())
    xs = [torch.randint(0, 50, (2, 7)) for _ in range(THREADS)]
    with torch.no_grad():
        wants = [ref(x) for x in xs]
    errors = _run_threads([_inference(model, x, w) for x, w in zip(xs, wants)])
    assert not errors, errors[0]


def test_threads_on_two_offloaded_models_of_one_device_and_a_unit_run_on_its_own():
    """Models of one device share its slots; a unit called on its own takes part too."""
    (ref_a, a), (ref_b, b) = _offloaded(2), _offloaded(3)
    x = torch.randn(3, 96)
    with torch.no_grad():
        want_a, want_b = ref_a(x), ref_b(x)
        want_unit = ref_a[2](x)

    def unit() -> None:
        with torch.no_grad():
            for _ in range(PASSES):
                assert torch.equal(a[2](x), want_unit)

    bodies = [_inference(a, x, want_a), _inference(b, x, want_b), unit, _inference(a, x, want_a)]
    errors = _run_threads(bodies)
    assert not errors, errors[0]


class _Fails(nn.Module):
    """Raises ``error`` in its forward while ``armed``."""

    def __init__(self, error: type[BaseException]) -> None:
        super().__init__()
        self.lin = nn.Linear(96, 96)
        self.error = error
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.armed:
            raise self.error("cut")
        return y


class _Cut(BaseException):
    """Skips torch's forward hooks, as Ctrl-C does."""


@pytest.mark.parametrize("error", [RuntimeError, _Cut], ids=["exception", "thread-died-mid-pass"])
def test_a_forward_that_raises_or_a_thread_that_died_in_one_does_not_block_the_others(error):
    torch.manual_seed(4)
    ref = nn.Sequential(nn.Linear(96, 96), _Fails(error), nn.Linear(96, 96))
    model = ramtorch.offload(
        nn.Sequential(nn.Linear(96, 96), _Fails(error), nn.Linear(96, 96)), device="cpu", unit=nn.Linear
    )
    model.load_state_dict(ref.state_dict())
    x = torch.randn(3, 96)
    with torch.no_grad():
        want = ref(x)

    def failing() -> None:
        model[1].armed = True
        try:
            with torch.no_grad():
                model(x)
        finally:
            model[1].armed = False

    errors = _run_threads([failing])
    assert len(errors) == 1 and isinstance(errors[0], error)
    errors = _run_threads([_inference(model, x, want) for _ in range(2)])
    assert not errors, errors[0]
