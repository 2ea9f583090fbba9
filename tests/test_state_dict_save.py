"""An offloaded model's state dict saves with torch.save and safetensors like the plain model's,
also when a unit packs tensors of several dtypes (a bf16 weight next to an fp32 norm) or quantized
weights (torchao), and loads back into the plain model to the same outputs."""

from __future__ import annotations

import copy
import io

import pytest
import ramtorch
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d).to(torch.bfloat16)
        self.norm = nn.LayerNorm(d)  # fp32, in the same unit as the bf16 weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x.to(torch.bfloat16)).float())


class Mixed(nn.Module):
    def __init__(self, d: int = 16, layers: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def test_torch_save_of_a_mixed_dtype_unit_round_trips():
    torch.manual_seed(0)
    plain = Mixed()
    model = ramtorch.offload(copy.deepcopy(plain), device="cpu")
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)  # refused before: one storage seen as bf16 and fp32
    buf.seek(0)
    fresh = Mixed()
    fresh.load_state_dict(torch.load(buf))
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), plain(x), rtol=0, atol=0)
        torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)


def test_safetensors_save_of_an_offloaded_state_dict(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    torch.manual_seed(0)
    plain = Mixed()
    model = ramtorch.offload(copy.deepcopy(plain), device="cpu")
    path = tmp_path / "m.safetensors"
    safetensors_torch.save_file(model.state_dict(), str(path))
    fresh = Mixed()
    fresh.load_state_dict(safetensors_torch.load_file(str(path)))
    for (name, p), q in zip(plain.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(p, q), name


def test_quantized_weights_save_with_torch_save_and_are_refused_by_save_pretrained(tmp_path):
    quant = pytest.importorskip("torchao.quantization")
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    quant.quantize_(plain, quant.Int8WeightOnlyConfig())
    for p in plain.parameters():
        p.requires_grad_(False)
    model = ramtorch.offload(copy.deepcopy(plain), device="cpu", unit=nn.Linear)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    fresh = copy.deepcopy(plain)
    fresh.load_state_dict(loaded, assign=True)
    x = torch.randn(2, 64)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), plain(x), rtol=0, atol=0)
    with pytest.raises(TypeError, match="tensor subclass.*torch.save"):
        ramtorch.save_pretrained(model, tmp_path / "out")
