"""A FIFO, a directory or a device given where a file is expected (a checkpoint, a shard named by
an index, the index itself) is refused with a clear error, instead of blocking forever on open."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import ramtorch
import torch
from ramtorch.checkpoint import CheckpointError
from torch import nn

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


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    p = tmp_path / "model.safetensors"
    os.mkfifo(p)
    return p


def test_core_reader_refuses_a_fifo(fifo):
    e = not_hanging(lambda: ramtorch._core.SafetensorsFile(str(fifo)), fifo)
    assert isinstance(e, ValueError), repr(e)
    assert str(fifo) in str(e) and "not a regular file" in str(e)


def test_load_checkpoint_refuses_a_fifo(fifo):
    m = nn.Linear(2, 2)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    e = not_hanging(lambda: ramtorch.load_checkpoint(fifo, m), fifo)
    assert isinstance(e, CheckpointError), repr(e)
    assert str(fifo) in str(e) and "not a regular file" in str(e)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())


def test_load_refuses_a_fifo_named_by_an_index(tmp_path, fifo):
    m = nn.Linear(2, 2)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"weight": fifo.name, "bias": fifo.name}})
    )
    e = not_hanging(lambda: ramtorch.load(m, tmp_path), fifo)
    assert isinstance(e, ValueError), repr(e)
    assert str(fifo) in str(e) and "not a regular file" in str(e)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())


def test_load_refuses_a_fifo_given_as_the_file(fifo):
    e = not_hanging(lambda: ramtorch.load(nn.Linear(2, 2), fifo), fifo)
    assert isinstance(e, (ValueError, OSError)), repr(e)
    assert str(fifo) in str(e)


def test_load_refuses_an_index_that_is_a_fifo(tmp_path):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    index = tmp_path / "model.safetensors.index.json"
    os.mkfifo(index)
    e = not_hanging(lambda: ramtorch.load(nn.Linear(2, 2), tmp_path), index)
    assert isinstance(e, (ValueError, OSError)), repr(e)
    assert str(index) in str(e)


def test_a_directory_is_not_a_checkpoint(tmp_path):
    d = tmp_path / "ckpt.safetensors"
    d.mkdir()
    with pytest.raises(CheckpointError, match="not a regular file"):
        ramtorch.load_checkpoint(d, nn.Linear(2, 2))
