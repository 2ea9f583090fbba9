"""Quantized weights on the GPU: torchao int8 and float8 weights stream by their inner tensors (the
quantized bytes cross the link), and QLoRA (frozen int8 base + peft LoRA) trains through
``offload`` + ``ramtorch.optim.AdamW`` like the un-offloaded model."""

from __future__ import annotations

import copy
import warnings

import pytest
import ramtorch
import torch
import torch.nn.functional as F
from torch import nn

pytestmark = pytest.mark.gpu

torchao = pytest.importorskip("torchao")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_


class Net(nn.Module):
    def __init__(self, d: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(32, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
            for _ in range(layers)
        )
        self.out = nn.Linear(d, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = x + b(x)
        return self.out(x)


def _net(config: object) -> Net:
    torch.manual_seed(0)
    m = Net().to(torch.bfloat16)
    quantize_(m, config, filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear) and fqn.startswith("blocks"))
    return m


def _configs() -> list[object]:
    configs: list[object] = [Int8WeightOnlyConfig()]
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        from torchao.quantization import Float8WeightOnlyConfig

        configs.append(Float8WeightOnlyConfig())
    return configs


@pytest.mark.parametrize("config", _configs(), ids=lambda c: type(c).__name__)
def test_quantized_forward_streams_quantized_bytes(config: object):
    ref = _net(config).cuda()
    m = _net(config)
    ramtorch.offload(m, device="cuda")
    w = m.blocks[0][1].weight
    assert type(w) is type(ref.blocks[0][1].weight) and w.device.type == "cpu"
    x = torch.randn(3, 5, 32, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        with torch.no_grad():
            torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)
    streamed = m._ramtorch_streamer.stats()["streamed_bytes_per_pass"]
    bf16 = sum(p.numel() * 2 for p in m.parameters())
    assert streamed < 0.7 * bf16


def test_qlora_trains_like_the_plain_model_on_the_gpu():
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=r".*blocks\.\d+\.[13]", lora_dropout=0.0, init_lora_weights=False
    )
    ref = peft.get_peft_model(_net(Int8WeightOnlyConfig()), cfg)
    m = copy.deepcopy(ref)
    ref.cuda()
    ramtorch.offload(m, device="cuda")
    lora = [p for p in m.parameters() if p.requires_grad]
    lora_ref = [p for p in ref.parameters() if p.requires_grad]
    o, o_ref = ramtorch.optim.AdamW(lora, lr=1e-3), torch.optim.AdamW(lora_ref, lr=1e-3)
    torch.manual_seed(1)
    for _ in range(3):
        x = torch.randn(8, 32, device="cuda", dtype=torch.bfloat16)
        y = torch.randint(0, 7, (8,), device="cuda")
        out, out_ref = m(x), ref(x)
        torch.testing.assert_close(out, out_ref, rtol=2e-2, atol=2e-2)
        F.cross_entropy(out.float(), y).backward()
        F.cross_entropy(out_ref.float(), y).backward()
        ramtorch.synchronize()
        for p, q in zip(lora, lora_ref):
            torch.testing.assert_close(p.grad.float(), q.grad.float().cpu(), rtol=5e-2, atol=5e-3)
        o.step()
        o_ref.step()
        o.zero_grad()
        o_ref.zero_grad()
    ramtorch.synchronize()
    for p, q in zip(lora, lora_ref):
        torch.testing.assert_close(p.float(), q.float().cpu(), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("config", _configs(), ids=lambda c: type(c).__name__)
def test_quantize_after_offload_streams_the_quantized_weights(config: object):
    """``quantize_`` on an offloaded model (which quantizes its host weights): the next pass streams
    the quantized bytes and computes what the plain model quantized the same way computes."""
    torch.manual_seed(0)
    plain = Net().to(torch.bfloat16)
    m = ramtorch.offload(copy.deepcopy(plain), device="cuda")
    x = torch.randn(3, 5, 32, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        m(x)  # a pass on the full-precision weights first
    before = m._ramtorch_streamer.stats()["streamed_bytes_per_pass"]

    def blocks(mod: nn.Module, fqn: str) -> bool:
        return isinstance(mod, nn.Linear) and fqn.startswith("blocks")

    quantize_(plain, config, filter_fn=blocks)
    quantize_(m, config, filter_fn=blocks)
    ref = plain.cuda()
    for _ in range(2):
        with torch.no_grad():
            torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)
    assert m._ramtorch_streamer.stats()["streamed_bytes_per_pass"] < 0.7 * before
