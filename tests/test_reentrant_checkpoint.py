"""Reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``, as
transformers' ``gradient_checkpointing_enable`` or peft's ``prepare_model_for_kbit_training`` may
set it) over streamed units: the checkpointed forward runs without grad and its recomputation,
inside backward, feeds a nested backward. Every streamed weight gets the plain model's gradient
and ``ramtorch.optim`` steps it as torch's optimizer steps the plain model, whether the checkpoint
wraps a whole unit (its hooks inside), runs inside a unit's forward (its hooks outside: transformers
5) or covers only part of a unit."""

from __future__ import annotations

import copy
import warnings

import pytest
import ramtorch
import ramtorch.optim
import torch
import torch.nn.functional as F
from conftest import tiny_llama_config
from torch import nn
from torch.utils.checkpoint import checkpoint

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


class Block(nn.Module):
    def __init__(self, d: int, inner: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.inner = inner

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inner == "all" and self.training:  # inside the unit's hooks (transformers 5)
            return checkpoint(self._body, x, use_reentrant=True)
        if self.inner == "part" and self.training:  # the norm outside, the MLP inside
            return x + checkpoint(self.mlp, self.norm(x), use_reentrant=True)
        return self._body(x)


class Net(nn.Module):
    def __init__(self, inner: str, outer: bool, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d, inner) for _ in range(3))
        self.out = nn.Linear(d, 3)
        self.outer = outer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            # Around the whole unit: its hooks run inside the checkpoint, without grad first.
            x = checkpoint(b, x, use_reentrant=True) if self.outer and self.training else b(x)
        return self.out(x)


def _close_grads(ref: nn.Module, ours: nn.Module, tol: float = 1e-6) -> None:
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert q.grad is not None, f"{name}: no gradient"
        torch.testing.assert_close(q.grad, p.grad.cpu(), rtol=10 * tol, atol=tol, msg=name)


@pytest.mark.parametrize(("inner", "outer"), [("all", False), ("part", False), ("none", True)])
@pytest.mark.parametrize("opt", ["ramtorch", "torch"])
@pytest.mark.parametrize("device", DEVICES)
def test_reentrant_checkpointing_trains_like_the_plain_model(inner: str, outer: bool, opt: str, device: str):
    torch.manual_seed(0)
    ref = Net(inner, outer)
    ours = ramtorch.offload(copy.deepcopy(ref), device=device)
    ref.to(device)
    tol = 1e-6 if device == "cpu" else 1e-5  # cuBLAS may pick other kernels for the recomputation
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o = (ramtorch.optim.AdamW if opt == "ramtorch" else torch.optim.AdamW)(ours.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note on use_reentrant
        for _ in range(3):
            x, y = (
                torch.randn(6, 8, generator=g).to(device),
                torch.randint(0, 3, (6,), generator=g).to(device),
            )
            for _ in range(2):  # two micro-batches accumulate
                F.cross_entropy(ref(x), y).backward()
                F.cross_entropy(ours(x), y).backward()
            ramtorch.synchronize()
            _close_grads(ref, ours, tol)
            o_ref.step()
            o.step()
            o_ref.zero_grad()
            o.zero_grad()
    ramtorch.synchronize()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q, p.cpu(), rtol=1e-4, atol=1e-5, msg=name)


def test_transformers_gradient_checkpointing_with_use_reentrant():
    transformers = pytest.importorskip("transformers")
    cfg = tiny_llama_config()
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg)
    ours = copy.deepcopy(ref)
    for m in (ref, ours):
        m.train()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ramtorch.offload(ours, device="cpu")
    ids = torch.randint(0, 64, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref(ids, labels=ids).loss.backward()
        ours(ids, labels=ids).loss.backward()
    ramtorch.synchronize()
    _close_grads(ref, ours)


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_region_spanning_more_units_than_slots_is_refused_clearly(reentrant: bool):
    """A checkpointed region recomputed in backward keeps each streamed unit it spans on its slot
    until that unit's backward, so one region over more units than the device has slots cannot
    run: the backward raises an error that names checkpointing and what to do (not the generic
    "nested deeper" one), and the model trains as the plain one afterwards."""

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            *[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(6)], nn.Linear(32, 4)
        )

    ref, ours = make(), make()
    ramtorch.offload(ours, device="cpu")
    assert ramtorch.stats(ours)["slot_count"] < 7
    x = torch.randn(8, 32)
    out = checkpoint(ours, x.clone().requires_grad_(), use_reentrant=reentrant).square().sum()
    with pytest.raises(RuntimeError, match="checkpoint each block apart"):
        out.backward()
    ours.zero_grad(set_to_none=True)
    ref(x).square().sum().backward()
    ours(x).square().sum().backward()
    for p, q in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6)
