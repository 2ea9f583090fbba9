"""GPU: weights edited between passes (through ``param.data``, PEFT's merge) are what the next pass
computes with, while the GPU still runs the previous pass's kernels; each pass streams its units
once."""

from __future__ import annotations

import copy

import pytest
import ramtorch
import torch
from conftest import Net
from torch import nn

pytestmark = pytest.mark.gpu


def _x(seed: int) -> torch.Tensor:
    return torch.randn(64, 8, generator=torch.Generator().manual_seed(seed)).cuda()


@pytest.mark.parametrize("budget", [None, "resident"])
def test_data_edits_between_passes_are_seen_on_the_gpu(budget: str | None) -> None:
    torch.manual_seed(0)
    plain = Net(d=512, layers=6).cuda()
    block = sum(p.numel() * 4 for p in plain.blocks[0].parameters())
    gpu_budget = None if budget is None else int(4.5 * block)
    streamed = ramtorch.offload(copy.deepcopy(plain).cpu(), gpu_budget=gpu_budget, device="cuda")
    with torch.no_grad():
        for k in range(6):
            # No synchronisation: the edit lands while the last pass's kernels may still run.
            out = streamed(_x(k))
            torch.testing.assert_close(out, plain(_x(k)), rtol=1e-5, atol=1e-5)
            for m in (plain, streamed):
                for p in m.parameters():
                    p.data.mul_(0.9)
                w = m.blocks[k % 6].up.weight
                w.data = torch.full_like(w.data, k / 100)  # a new tensor where the weight lives


def test_peft_merge_and_unload_on_the_gpu() -> None:
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = Net(d=256, layers=4)
    config = peft.LoraConfig(target_modules=["up", "down"], r=8, init_lora_weights=False)
    torch.manual_seed(1)
    plain = peft.get_peft_model(copy.deepcopy(base), config).cuda()
    torch.manual_seed(1)
    streamed = peft.get_peft_model(copy.deepcopy(base), config)
    streamed.load_state_dict(plain.state_dict())
    ramtorch.offload(streamed, device="cuda")
    with torch.no_grad():
        for k in range(2):
            torch.testing.assert_close(streamed(_x(k)), plain(_x(k)), rtol=1e-5, atol=1e-5)
        plain_merged, streamed_merged = plain.merge_and_unload(), streamed.merge_and_unload()
        for k in range(2, 4):
            torch.testing.assert_close(streamed_merged(_x(k)), plain_merged(_x(k)), rtol=1e-5, atol=1e-5)


def test_each_inference_pass_streams_its_units_once() -> None:
    torch.manual_seed(0)
    model = ramtorch.offload(nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]), device="cuda")
    per_pass = sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.randn(16, 1024, device="cuda")
    with torch.no_grad():
        model(x)
        torch.cuda.synchronize()
        before = ramtorch.stats()["devices"]["cuda:0"]["h2d_bytes"]
        for _ in range(4):
            model(x)
        torch.cuda.synchronize()
        assert ramtorch.stats()["devices"]["cuda:0"]["h2d_bytes"] - before == 4 * per_pass
