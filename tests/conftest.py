"""Shared fixtures and helpers of the test modules: which devices the tests run on, the small
models the optimizer and trace tests train, slowed-down optimizer updates, a module with its own
loading, a guard against loads that hang, and snapshots of a model's, an optimizer's and the RNG's
state, free ports and an exit for spawned ranks, a tiny Llama configuration, and greedy generation.
Test modules take these from here, never from each other."""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fresh_engine_sums():
    """The engines start with no learned accumulation (no device sums kept) and the automatic
    room for sums; restored after. Earlier tests' loops may have taught the engines to keep sums."""
    from ramtorch import _config, _engine

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        eng = _engine.engine_for(_engine.normalize_device(dev))
        eng.drop_sums()
        eng._keep_sums = False
        eng._fresh_backwards = 0
        eng.sum_cap = None
        eng._sum_limits.clear()  # models of earlier tests that the collector has not freed yet
        eng._streaming = False
        eng._stream_reserve = 0
        eng._plan, eng._plan_pos = [], {}
        eng._host_summed.clear()
        eng.stream_sums_on_host = False
        eng.streamed_sum_share = _config.streamed_sum_share()
        eng.share_choice = _engine.ShareChoice()
        eng._plan_share = None
    yield
    for dev in devices:
        eng = _engine.engine_for(_engine.normalize_device(dev))
        eng.sum_cap = None
        eng.drop_sums()


@pytest.fixture
def small_params_streamed(monkeypatch):
    """Small parameters stream with their units, as every parameter did before they stayed on the
    device (``RAMTORCH_SMALL_PARAM_BYTES=0``): for tests of the streamed gradients' own
    guarantees (an interrupted backward leaves ``.grad`` as it was, which torch's accumulation
    into a resident parameter does not promise)."""
    monkeypatch.setenv("RAMTORCH_SMALL_PARAM_BYTES", "0")


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    if request.param == "cuda":
        request.applymarker(pytest.mark.gpu)
    return request.param


class Block(nn.Module):
    def __init__(self, d: int, p_drop: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(p_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, d: int = 16, layers: int = 4, p_drop: float = 0.0) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d, p_drop) for _ in range(layers))
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def slow_updates(
    opt: torch.optim.Optimizer,
    seconds: float,
    log: list | None = None,
    fail: object = None,
    gate: object = None,
):
    """Makes every host update of ``opt`` take ``seconds`` longer (and optionally record the
    parameter, raise for one, or hold the first update until ``gate`` is set), so that the
    updates of a step outlast its backward."""
    import time

    inner = opt._update_host

    def update(p, grad, group, scale):
        if gate is not None:
            gate.wait()
        time.sleep(seconds)
        if log is not None:
            log.append(id(p))
        if p is fail:
            raise ValueError("injected failure")
        inner(p, grad, group, scale)

    opt._update_host = update  # type: ignore[method-assign]


class Doubling(nn.Linear):
    """Loads its weight doubled: a module with its own loading, which must still be called."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: ANN001, ANN002
        state_dict = dict(state_dict)
        state_dict[prefix + "weight"] = state_dict[prefix + "weight"] * 2
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


#: How long a load may take before the test calls it hung (generous: CI machines are slow).
HUNG_AFTER_S = 300.0


def not_hanging(call: Callable[[], object], fifo: Path) -> BaseException | None:
    """Runs ``call`` in a thread and returns what it raised (None: nothing). If it is still blocked
    after HUNG_AFTER_S (opening ``fifo`` for reading), a writer opens and closes ``fifo`` to free it
    and the test fails."""
    raised: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            raised.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            raised.append(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(HUNG_AFTER_S)
    if th.is_alive():
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        th.join(HUNG_AFTER_S)
        pytest.fail(f"loading blocked on the FIFO {fifo} for {HUNG_AFTER_S} s")
    return raised[0]


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict, torch.Tensor]:
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    osd = opt.state_dict()
    state = {
        i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for i, s in osd["state"].items()
    }
    return sd, {"state": state, "param_groups": osd["param_groups"]}, torch.get_rng_state()


def changes(
    before: tuple[dict, dict, torch.Tensor], model: torch.nn.Module, opt: torch.optim.Optimizer
) -> str:
    """What differs from ``before`` ("" if nothing)."""
    sd, osd, rng = before
    now = model.state_dict()
    if sd.keys() != now.keys() or not all(torch.equal(sd[k], now[k]) for k in sd):
        return "the model changed"
    cur = opt.state_dict()
    if osd["param_groups"] != cur["param_groups"] or osd["state"].keys() != cur["state"].keys():
        return "the optimizer changed"
    for i, s in osd["state"].items():
        for k, v in s.items():
            w = cur["state"][i][k]
            if not (torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w):
                return f"optimizer state {i}.{k} changed"
    if not torch.equal(rng, torch.get_rng_state()):
        return "the RNG changed"
    return ""


# -- processes of multi-rank tests ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_rank() -> None:
    """Ends a rank whose work is done and written, skipping the interpreter's native teardown.
    A rank that called ``dist.init_process_group`` itself (not ``ramtorch.distributed.init``)
    before the first torch optimizer imported TorchDynamo keeps its gloo threads after
    destroy_process_group and can abort at exit ("terminate called without an active
    exception"), a torch problem that plain torch training shows too (see BENCHMARKS.md).
    These tests check what the ranks computed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- transformers -----------------------------------------------------------------------------------


def tiny_llama_config(**overrides: object) -> object:
    """A transformers ``LlamaConfig`` small enough for CPU tests (2 layers of width 32, grouped
    KV heads), with ``overrides`` applied."""
    import transformers

    kw: dict[str, object] = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    kw.update(overrides)
    return transformers.LlamaConfig(**kw)


def greedy(
    model: nn.Module, ids: torch.Tensor, new: int = 16, **kw: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ``generate()`` of ``new`` tokens after ``ids``: the sequences and the stacked scores."""
    out = model.generate(  # type: ignore[operator]
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        **kw,
    )
    return out.sequences, torch.stack(out.scores)
