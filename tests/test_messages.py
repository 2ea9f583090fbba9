"""Errors that say what was wrong and what to do: a ``torch.save`` file given to ``ramtorch.load``,
a checkpoint of another model, torch optimizer arguments ramtorch does not implement, a budget in
fractions of a byte, and a budget too small, whose parts add up to the total."""

from __future__ import annotations

import re

import pytest
import ramtorch
import ramtorch.optim
import torch
from ramtorch._units import parse_bytes
from safetensors.torch import save_file
from torch import nn


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy-pickle"])
def test_loading_a_torch_save_file_says_it_is_not_safetensors(tmp_path, zipped):
    model = nn.Linear(4, 4)
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path, _use_new_zipfile_serialization=zipped)
    with pytest.raises(ValueError) as e:
        ramtorch.load(model, path)
    msg = str(e.value)
    assert "not a safetensors file" in msg and "torch.load" in msg and "load_state_dict" in msg, msg
    assert "header length" not in msg and str(path) in msg


def test_a_checkpoint_of_another_model_is_a_short_message(tmp_path):
    other = nn.Sequential(*(nn.Linear(8, 8) for _ in range(40)))
    save_file(other.state_dict(), tmp_path / "other.safetensors")

    class Mine(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(40))

    with pytest.raises(RuntimeError) as e:
        ramtorch.load(Mine(), tmp_path / "other.safetensors")
    msg = str(e.value)
    assert "0 of 80 keys of the model matched" in msg, msg
    assert "the file has keys like ['0.bias', '0.weight'" in msg, msg
    assert len(msg) < 400, len(msg)


def test_a_partial_match_lists_a_few_keys_and_counts_the_rest(tmp_path):
    save_file(nn.Sequential(*(nn.Linear(8, 8) for _ in range(10))).state_dict(), tmp_path / "ten.safetensors")
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(40)))
    with pytest.raises(RuntimeError) as e:
        ramtorch.load(model, tmp_path / "ten.safetensors")
    msg = str(e.value)
    assert "(20 of 80 matched)" in msg and "and 52 more" in msg and len(msg) < 400, msg
    with pytest.warns(UserWarning, match="and 52 more"):
        out = ramtorch.load(model, tmp_path / "ten.safetensors", strict=False)
    assert len(out["missing"]) == 60  # the returned lists are whole


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [
        ({"amsgrad": True}, "amsgrad=True is not supported: AMSGrad"),
        ({"fused": True}, "fused=True is not supported"),
        ({"capturable": True}, "capturable=True is not supported"),
    ],
)
def test_torch_adamw_arguments_ramtorch_lacks_name_adamw(kwargs, what):
    params = [nn.Parameter(torch.zeros(4))]
    with pytest.raises(ValueError) as e:
        ramtorch.optim.AdamW(params, lr=1e-3, **kwargs)
    assert f"ramtorch.optim.AdamW: {what}" in str(e.value) and "_HostOptimizer" not in str(e.value)


def test_torch_defaults_are_accepted_and_unknown_arguments_named():
    params = [nn.Parameter(torch.zeros(4))]
    # A loop written for torch.optim.AdamW, with its defaults spelt out, runs as it is.
    ramtorch.optim.AdamW(
        params, amsgrad=False, fused=None, foreach=None, capturable=False, differentiable=False
    )
    ramtorch.optim.SGD(params, lr=0.1, foreach=False)
    with pytest.raises(TypeError) as e:
        ramtorch.optim.AdamW(params, betas2=0.9)
    msg = str(e.value)
    assert "ramtorch.optim.AdamW got an unexpected keyword argument 'betas2'" in msg and "betas" in msg
    assert "_HostOptimizer" not in msg
    with pytest.raises(TypeError, match=r"ramtorch\.optim\.SGD .*'amsgrad'"):
        ramtorch.optim.SGD(params, lr=0.1, amsgrad=False)


@pytest.mark.parametrize("bad", [1.5, 0.5, "0.5", "1.5 B", "0.0001KiB"])
def test_a_budget_in_fractions_of_a_byte_is_an_error(bad):
    with pytest.raises(ValueError) as e:
        parse_bytes(bad, "gpu_budget")
    msg = str(e.value)
    assert f"gpu_budget={bad!r}" in msg and "fraction of a byte" in msg and "'8GiB'" in msg, msg
    with pytest.raises(ValueError, match="fraction of a byte"):
        ramtorch.offload(nn.Sequential(nn.Linear(2, 2)), gpu_budget=bad, device="cpu")


def test_whole_budgets_still_parse():
    assert parse_bytes(8e9, "gpu_budget") == 8_000_000_000
    assert parse_bytes(2.0, "gpu_budget") == 2
    assert parse_bytes("1.33MiB", "gpu_budget") == int(1.33 * (1 << 20))  # a unit: rounded down
    assert parse_bytes("0.5KiB", "gpu_budget") == 512


def _sizes(msg: str) -> list[float]:
    """The sizes a message names, in bytes."""
    scale = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    return [float(n) * scale[u] for n, u in re.findall(r"([0-9.]+) (B|KiB|MiB|GiB)\b", msg)]


def test_a_too_small_budget_adds_up():
    # One unit (the whole model): the least that works keeps it resident; two slots of it would
    # be twice as much, and the message must not add them to it.
    model = nn.Sequential(nn.Linear(256, 256, bias=False))
    size = 256 * 256 * 4
    with pytest.raises(ValueError) as e:
        ramtorch.offload(model, gpu_budget=size // 2, device="cpu")
    msg = str(e.value)
    assert "it needs at least 256.0 KiB (to keep its only unit resident;" in msg, msg
    assert "2 slots x 256.0 KiB = 512.0 KiB" in msg, msg

    # Blocks that stream: the parts of the sum are printed, and they add up to the total.
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(64))
            self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))

    with pytest.raises(ValueError) as e:
        ramtorch.offload(M(), gpu_budget=1000, device="cpu")
    msg = str(e.value)
    total, *parts = _sizes(msg.split("is too small")[1])
    assert "2 slots x" in msg and len(parts) == 2, msg
    assert abs(parts[0] + 2 * parts[1] - total) <= 0.01 * total, msg
