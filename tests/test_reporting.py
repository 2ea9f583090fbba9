"""What ramtorch tells about an offloaded model: ``ramtorch.stats(model)`` and entries that name
their model (and leave with it), ``ramtorch.plan`` after ``import ramtorch``, the plan logged at
INFO by every ``offload``, and the strides that packing does not keep."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
import warnings

import pytest
import ramtorch
import torch
from ramtorch._offload import detach_streamer
from torch import nn


class Tagged(nn.Module):
    """A parameter on the root and blocks in a list: the root is a unit of its own, so the model
    and its streamer refer to each other."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(8))
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x * self.gain


def test_stats_of_one_model_and_named_entries():
    a = ramtorch.offload(Tagged(), device="cpu")
    b = ramtorch.offload(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)), device="cpu")
    try:
        b(torch.randn(2, 8))
        sa, sb = ramtorch.stats(a), ramtorch.stats(b)
        assert sa["model"] == "Tagged" and sa["units"] == 4 and sa["resident_units"] == ["<root>"]
        assert sb["model"] == "Sequential" and sb["passes"] == 1 and sa["passes"] == 0
        entries = ramtorch.stats()["models"]
        # In the order the models were offloaded, each naming its model.
        assert [e["model"] for e in entries][-2:] == ["Tagged", "Sequential"]
        assert entries[-1] == sb
        with pytest.raises(ValueError, match="not offloaded"):
            ramtorch.stats(nn.Linear(2, 2))
    finally:
        detach_streamer(a)
        detach_streamer(b)


def test_a_freed_model_has_no_entry():
    gc.collect()
    gc.disable()  # the entry must go with the model, not wait for a collection
    try:
        before = len(ramtorch.stats()["models"])
        model = ramtorch.offload(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), device="cpu")
        model(torch.randn(2, 8)).sum().backward()
        assert len(ramtorch.stats()["models"]) == before + 1
        del model
        assert len(ramtorch.stats()["models"]) == before
    finally:
        gc.enable()


def test_a_model_in_a_reference_cycle_has_no_entry_once_collected():
    gc.collect()
    before = len(ramtorch.stats()["models"])
    model = ramtorch.offload(Tagged(), device="cpu")  # the root is a unit: model and streamer cycle
    model(torch.randn(2, 8)).sum().backward()
    assert len(ramtorch.stats()["models"]) == before + 1
    del model
    gc.collect()
    assert len(ramtorch.stats()["models"]) == before


def test_plan_is_reachable_after_import_ramtorch():
    code = (
        "import ramtorch, torch\n"
        "with torch.device('meta'):\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))\n"
        "print(ramtorch.plan.predict(m, None, 16).slots)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "3", out.stderr
    assert "plan" in ramtorch.__all__


def test_offload_logs_its_plan_at_info(caplog):
    with caplog.at_level(logging.INFO, logger="ramtorch"):
        model = ramtorch.offload(Tagged(), device="cpu")
    try:
        lines = [r.getMessage() for r in caplog.records if r.name == "ramtorch" and r.levelno == logging.INFO]
        assert any(
            "ramtorch.offload of Tagged on cpu: 4 units, 1 resident" in m and "<root>" in m for m in lines
        ), lines
        assert any("streamed through 3 slots" in m and "streamed per pass" in m for m in lines), lines
    finally:
        detach_streamer(model)


class Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(4, 4, 3, padding=1) for _ in range(2))
        self.proj = nn.Linear(4, 4)
        # A transposed weight, as a tied or imported layer may have.
        self.proj.weight = nn.Parameter(torch.randn(4, 4).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c in self.convs:
            x = c(x)
        return self.proj(x.mean((2, 3)))


def test_offload_says_that_streamed_weights_lose_their_strides():
    torch.manual_seed(0)
    plain = Convs().to(memory_format=torch.channels_last)
    model = Convs()
    model.load_state_dict(plain.state_dict())
    model = model.to(memory_format=torch.channels_last)
    model.proj.weight = nn.Parameter(plain.proj.weight.detach().clone().t().contiguous().t())
    assert model.convs[0].weight.is_contiguous(memory_format=torch.channels_last)
    with pytest.warns(UserWarning, match="not contiguous") as rec:
        ramtorch.offload(model, device="cpu")
    try:
        msg = str(rec[0].message)
        assert "convs.0.weight" in msg and "proj.weight" in msg and "not their strides" in msg, msg
        # What the warning says: values and shapes kept, strides not.
        assert model.convs[0].weight.is_contiguous() and model.proj.weight.is_contiguous()
        x = torch.randn(2, 4, 5, 5).to(memory_format=torch.channels_last)
        torch.testing.assert_close(model(x), plain(x))
    finally:
        detach_streamer(model)


def test_contiguous_weights_offload_without_a_word():
    m = Convs()
    m.proj.weight = nn.Parameter(m.proj.weight.detach().contiguous())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = ramtorch.offload(m, device="cpu")
    detach_streamer(model)
