"""Small updates side by side (``ramtorch.optim._parallel``): the same bits as one at a time, in
``step()``, in speculations and in their commits; errors and grad mode carried; the thread count's
environment variable checked."""

from __future__ import annotations

import threading

import pytest
import ramtorch
import ramtorch.optim as ropt
import torch
from ramtorch.optim import _parallel
from torch import nn


class Block(nn.Module):
    """A frozen ``Linear`` with many small trainable tensors (LoRA-like adapters, a bias)."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(width, width, bias=False)
        self.base.requires_grad_(False)
        self.a = nn.ParameterList(nn.Parameter(torch.randn(rank, width) * 0.1) for _ in range(6))
        self.b = nn.ParameterList(nn.Parameter(torch.randn(width, rank) * 0.1) for _ in range(6))
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for a, c in zip(self.a, self.b):
            y = y + (x @ a.t()) @ c.t()
        return torch.tanh(y + self.bias)


class Big(nn.Module):
    """One trainable tensor of ``ALONE_NUMEL`` elements (updated alone, on the caller's thread)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(_parallel.ALONE_NUMEL // width, width) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


class Adapted(nn.Module):
    """Blocks of many small trainable tensors around frozen weights, then a large tensor."""

    def __init__(self, blocks: int = 3, width: int = 64, rank: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, rank) for _ in range(blocks))
        self.big = Big(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.big(x).float().square().mean()


def train(
    threads: int, monkeypatch: pytest.MonkeyPatch, steps: int = 4, **kw
) -> tuple[nn.Module, ropt.AdamW]:
    """``steps`` steps of ``Adapted`` offloaded to the CPU device (bf16 for ``precision=``), with
    ``threads`` update threads."""
    monkeypatch.setenv(_parallel.THREADS_VAR, str(threads))
    torch.manual_seed(0)
    model = Adapted().to(torch.bfloat16 if "precision" in kw else torch.float32)
    ramtorch.offload(model, device="cpu")
    opt = ropt.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(5, 64, generator=g).to(model.big.weight.dtype)
        model(x).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    return model, opt


def states_of(opt: ropt.AdamW) -> list[torch.Tensor]:
    return [
        t
        for g in opt.param_groups
        for p in g["params"]
        for t in opt.state[p].values()
        if isinstance(t, torch.Tensor)
    ]


@pytest.mark.parametrize(
    "kw",
    [{"overlap": False}, {}, {"overlap": "backward"}, {"precision": "compact"}, {"precision": "bf16"}],
    ids=["in-step", "speculate", "backward", "compact", "bf16"],
)
def test_side_by_side_equals_one_at_a_time(kw, monkeypatch):
    """Four threads give the bits of none, for every schedule and state format (compact and bf16
    state need bf16 parameters: the model is cast for them)."""
    runs = []
    for threads in (0, 4):
        model, opt = train(threads, monkeypatch, **kw)
        runs.append(([p.detach().clone() for p in model.parameters()], [t.clone() for t in states_of(opt)]))
    (p0, s0), (p1, s1) = runs
    assert len(p0) == len(p1) and len(s0) == len(s1) and s0
    for a, b in zip(p0 + s0, p1 + s1):
        assert torch.equal(a, b)


def test_speculations_commit_side_by_side(monkeypatch):
    """The default schedule's speculations ran (and were committed) with the pool on."""
    _, opt = train(4, monkeypatch, steps=5)
    assert opt.timings["speculated_updates"] > 0
    assert opt.timings["committed_updates"] == opt.timings["speculated_updates"]


def test_run_raises_the_first_error_after_all_finish(monkeypatch):
    monkeypatch.setenv(_parallel.THREADS_VAR, "3")
    seen: list[int] = []
    lock = threading.Lock()

    def fn(k: int) -> None:
        with lock:
            seen.append(k)
        if k in (5, 9):
            raise ValueError(f"item {k}")

    with pytest.raises(ValueError, match="item 5"):
        _parallel.run(fn, list(range(12)), lambda k: 1)
    assert sorted(seen) == list(range(12))  # every item ran


def test_run_stops_at_a_first_error(monkeypatch):
    """The first item runs alone: an error it raises (a bad hyperparameter) stops the rest."""
    monkeypatch.setenv(_parallel.THREADS_VAR, "3")
    seen: list[int] = []

    def fn(k: int) -> None:
        seen.append(k)
        raise ValueError("bad lr")

    with pytest.raises(ValueError, match="bad lr"):
        _parallel.run(fn, list(range(8)), lambda k: 1)
    assert seen == [0]


def test_run_carries_grad_mode(monkeypatch):
    monkeypatch.setenv(_parallel.THREADS_VAR, "2")
    modes: list[bool] = []
    with torch.no_grad():
        _parallel.run(lambda k: modes.append(torch.is_grad_enabled()), list(range(6)), lambda k: 1)
    assert modes == [False] * 6
    _parallel.run(lambda k: modes.append(torch.is_grad_enabled()), list(range(6)), lambda k: 1)
    assert modes[6:] == [True] * 6


def test_thread_count(monkeypatch):
    monkeypatch.setenv(_parallel.THREADS_VAR, "1")
    assert _parallel.threads() == 0
    monkeypatch.setenv(_parallel.THREADS_VAR, "6")
    assert _parallel.threads() == 6
    for bad in ("two", "-1", "1000"):
        monkeypatch.setenv(_parallel.THREADS_VAR, bad)
        with pytest.raises(ValueError, match=_parallel.THREADS_VAR):
            _parallel.threads()
    monkeypatch.delenv(_parallel.THREADS_VAR)
    monkeypatch.setattr(_parallel, "_cores", lambda: 2)
    assert _parallel.threads() == 0
    monkeypatch.setattr(_parallel, "_cores", lambda: 16)
    assert _parallel.threads() == 4
    monkeypatch.setattr(_parallel, "_cores", lambda: 128)
    assert _parallel.threads() == 8
