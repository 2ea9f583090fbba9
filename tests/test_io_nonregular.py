"""A FIFO, a directory or a device given where a file is expected (a checkpoint, a shard named by
an index, the index itself) is refused with a clear error, instead of blocking forever on open."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import ramtorch
import torch
from conftest import not_hanging
from ramtorch.checkpoint import CheckpointError
from torch import nn


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
