"""torch's ``DistributedDataParallel`` around streamed weights (gloo, CPU, two ranks). DDP averages
gradients in hooks on autograd's accumulation into each parameter, which streamed weights'
gradients never pass: wrapped around an offloaded model, or a model of ``ramtorch.nn`` layers, that
trains, each rank stepped with its own gradients and the ranks drifted apart without a word. That
is a clear error now, pointing to ``ramtorch.distributed``; a frozen offloaded part inside a
DDP-trained model (a text encoder, a teacher) still trains as DDP trains."""

from __future__ import annotations

import datetime
import os

import pytest
import ramtorch
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import exit_rank, free_port
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())


class Head(nn.Module):
    """A trainable head over an encoder that may be offloaded (and frozen)."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        torch.manual_seed(1)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def worker(rank: int, world: int, port: int, out: str, case: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    result: dict = {}
    try:
        if case == "offloaded":
            model: nn.Module = ramtorch.offload(_encoder(), device="cpu")
        elif case == "layers":
            model = ramtorch.replace_linear(_encoder(), device="cpu")
        else:  # "frozen": an offloaded frozen encoder inside the DDP-trained model
            model = Head(ramtorch.offload(_encoder().requires_grad_(False), device="cpu"))
        ddp = DDP(model)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        g = torch.Generator().manual_seed(10 + rank)  # each rank its own batch
        try:
            for _ in range(2):
                ddp(torch.randn(4, 8, generator=g)).square().mean().backward()
                opt.step()
                opt.zero_grad()
            with torch.no_grad():  # inference through DDP is no training: allowed
                ddp(torch.randn(2, 8, generator=g))
            result["params"] = [p.detach().clone() for p in model.parameters()]
        except RuntimeError as e:
            result["error"] = str(e)
        torch.save(result, f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_rank()


@pytest.mark.parametrize("case", ["offloaded", "layers"])
def test_ddp_around_trainable_streamed_weights_is_a_clear_error(tmp_path, case: str):
    out = str(tmp_path / "r")
    mp.spawn(worker, args=(2, free_port(), out, case), nprocs=2, join=True)
    for r in range(2):
        res = torch.load(f"{out}.{r}")
        assert "error" in res, f"rank {r} trained through DDP: {res}"
        assert "DistributedDataParallel" in res["error"] and "ramtorch.distributed" in res["error"]


def test_a_frozen_offloaded_part_inside_ddp_trains_as_ddp_does(tmp_path):
    out = str(tmp_path / "r")
    mp.spawn(worker, args=(2, free_port(), out, "frozen"), nprocs=2, join=True)
    a, b = (torch.load(f"{out}.{r}") for r in range(2))
    assert "error" not in a and "error" not in b, (a.get("error"), b.get("error"))
    for p, q in zip(a["params"], b["params"]):
        torch.testing.assert_close(p, q, rtol=0, atol=0)  # averaged gradients: the same steps
    head = Head(_encoder()).head.weight
    assert not torch.equal(a["params"][-2], head)  # the head trained
