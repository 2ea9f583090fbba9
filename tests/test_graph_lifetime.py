"""The autograd graph of an offloaded model's forward lives as long as torch's would: a forward run
with grad enabled whose output is dropped without a backward (an evaluation loop without
``torch.no_grad``) frees its graph and activations at once. Saved tensors that do not live in a
slot are kept detached by the saved-tensor hooks: a node that saves its own output (``tanh``)
would otherwise hold its own ``grad_fn``, a cycle through autograd's C++ objects that Python's
collector cannot free. A stale graph kept alive that way also held a weight's gradient
accumulator with the weight's old shape, which broke a backward after
``resize_token_embeddings``."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import ramtorch
import torch
from conftest import tiny_llama_config
from torch import nn


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    # Its output comes from a tanh, a node that saves its own output.
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])


def _graph_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)


@pytest.mark.parametrize("kind", ["mlp", "llama"])
def test_a_forward_without_backward_frees_its_graph(kind: str):
    if kind == "mlp":
        model, x = _mlp(), torch.randn(8, 32)
    else:
        import transformers

        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=True))
        x = torch.randint(0, 64, (2, 12))
    ramtorch.offload(model, device="cpu")
    base = _graph_tensors()
    for _ in range(3):
        out = model(x)
        out = out if isinstance(out, torch.Tensor) else out.logits
        ref = weakref.ref(out)
        del out
        gc.collect()
        assert ref() is None, "the output of a dropped forward is still alive"
    assert _graph_tensors() == base
    # Training still works, and matches the first figures of a fresh run after the dropped ones.
    model.zero_grad(set_to_none=True)
    out = model(x)
    (out if isinstance(out, torch.Tensor) else out.logits).float().square().mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_resize_token_embeddings_after_a_forward_without_backward():
    """transformers' ``resize_token_embeddings`` on a model with tied embeddings, after a forward
    with grad enabled whose output was dropped: the next training steps equal torch's."""
    import transformers

    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=True))
    ours = copy.deepcopy(ref)
    ramtorch.offload(ours, device="cpu")
    ids = torch.randint(0, 64, (2, 12))
    ref(ids)
    ours(ids)
    for m in (ref, ours):
        torch.manual_seed(3)
        m.resize_token_embeddings(80, mean_resizing=False)
    x = torch.randint(0, 80, (2, 12), generator=torch.Generator().manual_seed(1))
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    for _ in range(2):
        for m, o in ((ref, opt_ref), (ours, opt)):
            m(x, labels=x).loss.backward()
            o.step()
            o.zero_grad()
    torch.testing.assert_close(ours(x).logits, ref(x).logits, rtol=1e-4, atol=1e-5)
