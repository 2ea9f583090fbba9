"""``torch.compile`` of streamed models on the GPU: an offloaded model with units outside its blocks
(all streamed, or some kept resident by ``gpu_budget``), per-layer ``ramtorch.nn.Linear`` and an
offloaded transformers Llama give the plain model's outputs, gradients and optimizer steps."""

from __future__ import annotations

import copy

import pytest
import ramtorch
import torch
import torch._dynamo
import torch.nn.functional as F
from conftest import Net, tiny_llama_config
from torch import nn

pytestmark = pytest.mark.gpu

TOL = 2e-5


def close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> None:
    torch.testing.assert_close(a.detach().float().cpu(), b.detach().float().cpu(), rtol=tol, atol=tol)


def compare(ref: nn.Module, ours: nn.Module, what: str, tol: float = TOL) -> None:
    for (name, p), (_, q) in zip(ref.named_parameters(), ours.named_parameters()):
        if what == "grad":
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                close(p.grad, q.grad, tol)
        else:
            # Adam divides by the gradients' size: a last-bit difference in a small gradient shows
            # in the step more than in the gradient.
            close(p, q, 1e-4)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _train_and_compare(
    ref: nn.Module, ours: nn.Module, batches: list[torch.Tensor], call=None, tol: float = TOL
) -> None:
    """Forward, backward and an AdamW step of the plain model (eager, torch's AdamW on the GPU) and
    of the compiled streamed one (ramtorch's AdamW on the host), compared at every stage."""
    compiled = torch.compile(ours)
    call = call or (lambda m, x: m(x))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    opt = ramtorch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.01)
    for x in batches:
        y_ref, y = call(ref, x), call(compiled, x)
        close(y_ref, y, tol)
        y_ref.float().square().mean().backward()
        y.float().square().mean().backward()
        compare(ref, ours, "grad", tol)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        compare(ref, ours, "param")
    with torch.no_grad():
        for _ in range(2):  # an inference pass prefetches the next one's first units
            close(call(ref, batches[0]), call(compiled, batches[0]), tol)


def _offloaded_pair(budget: str | None) -> tuple[nn.Module, nn.Module]:
    """A plain model on the GPU and its offloaded copy; ``budget="resident"``: room for some units
    to stay resident next to the slots, so both kinds are in one compiled model."""
    torch.manual_seed(0)
    ref = Net(d=64, layers=4)
    ours = copy.deepcopy(ref)
    ref.cuda()
    gpu_budget = None
    if budget == "resident":
        gpu_budget = 4 * sum(p.numel() * 4 for p in ref.blocks[0].parameters())
    ramtorch.offload(ours, gpu_budget=gpu_budget, device="cuda")
    return ref, ours


@pytest.mark.parametrize("budget", [None, "resident"])
def test_compiled_offloaded_model_matches_eager_on_cuda(budget):
    ref, ours = _offloaded_pair(budget)
    _train_and_compare(ref, ours, [torch.randn(8, 8, device="cuda") for _ in range(3)])


class _PerLayer(nn.Module):
    def __init__(self, plain: nn.Module | None = None) -> None:
        super().__init__()
        if plain is None:
            self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 8)
        else:
            self.up = ramtorch.nn.Linear.from_linear(plain.up, device="cuda")
            self.down = ramtorch.nn.Linear.from_linear(plain.down, device="cuda")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def test_compiled_per_layer_linear_matches_eager_on_cuda():
    torch.manual_seed(0)
    ref = _PerLayer().cuda()
    ours = _PerLayer(ref)
    _train_and_compare(ref, ours, [torch.randn(8, 32, device="cuda") for _ in range(3)])


def test_compiled_offloaded_llama_matches_eager_on_cuda():
    transformers = pytest.importorskip("transformers")
    cfg = tiny_llama_config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg)
    ours = copy.deepcopy(ref)
    ref.cuda()
    ramtorch.offload(ours, device="cuda")
    batches = [torch.randint(0, 128, (2, 16), device="cuda") for _ in range(2)]
    # Attention and RMSNorm: inductor's fused CUDA kernels round differently from eager's (6e-5 seen).
    _train_and_compare(ref, ours, batches, call=lambda m, ids: m(ids, use_cache=False).logits, tol=1e-4)


@pytest.mark.parametrize("budget", [None, "resident"])
def test_reduce_overhead_mode_matches_eager_on_cuda(budget):
    """``mode="reduce-overhead"`` (CUDA graphs of the compiled regions): the streamed weights are
    device views of rotating slots, so a region's graph sees its weights at other addresses from
    pass to pass; torch must record again or replay on the right data, never on stale weights."""
    ref, ours = _offloaded_pair(budget)
    compiled = torch.compile(ours, mode="reduce-overhead")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = ramtorch.optim.AdamW(ours.parameters(), lr=1e-2)
    xs = [torch.randn(8, 8, device="cuda") for _ in range(3)]
    for x in xs:
        with torch.no_grad():
            for _ in range(3):  # replays after the recording passes
                close(ref(x), compiled(x).clone())
        torch.compiler.cudagraph_mark_step_begin()
        y = compiled(x)
        ref(x).square().mean().backward()
        y.square().mean().backward()
        compare(ref, ours, "grad")
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        compare(ref, ours, "param")
        torch.compiler.cudagraph_mark_step_begin()
