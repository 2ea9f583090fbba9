"""Weights edited between passes, in any way (``.data`` writes, ``.data = ...``, ``nn.init``,
``load_state_dict``, PEFT's ``merge_and_unload``, an EMA), are what the next pass computes with,
without the user calling anything; and ``torch.autograd.grad`` on streamed weights is a clear
error. Every streamed model is compared with the same plain model."""

from __future__ import annotations

import copy

import pytest
import ramtorch
import ramtorch.nn as rnn
import torch
from conftest import Net
from torch import nn


def _blocks(m: nn.Module) -> nn.ModuleList:
    return m.blocks


def _data_mul(m: nn.Module) -> None:
    for p in m.parameters():
        p.data.mul_(0.5)


def _data_assign(m: nn.Module) -> None:
    g = torch.Generator().manual_seed(1)
    for b in _blocks(m):
        b.up.weight.data = torch.randn(b.up.weight.shape, generator=g)
    m.out.bias.data = torch.randn(m.out.bias.shape, generator=g)


def _init(m: nn.Module) -> None:
    g = torch.Generator().manual_seed(2)
    for b in _blocks(m):
        nn.init.normal_(b.down.weight, std=0.3, generator=g)
        b.up.weight.data.normal_(std=0.3, generator=g)  # as transformers' _init_weights does


def _copy_no_grad(m: nn.Module) -> None:
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g))


def _load_state_dict(m: nn.Module) -> None:
    torch.manual_seed(4)
    m.load_state_dict(Net().state_dict())


# Each edit is applied to the plain model and to the streamed one alike.
def _replace_parameter(m: nn.Module) -> None:
    g = torch.Generator().manual_seed(5)
    m.blocks[1].up.weight = nn.Parameter(torch.randn(m.blocks[1].up.weight.shape, generator=g))


def _assign_state_dict(m: nn.Module) -> None:
    torch.manual_seed(6)
    m.load_state_dict(Net().state_dict(), assign=True)


EDITS = {
    "data_mul": _data_mul,
    "data_assign": _data_assign,
    "init": _init,
    "copy_no_grad": _copy_no_grad,
    "load_state_dict": _load_state_dict,
    "replace_parameter": _replace_parameter,
    "assign_state_dict": _assign_state_dict,
}

# How the streamed model is made from a copy of the plain one.
MAKERS = {
    "offload": lambda m: ramtorch.offload(m, device="cpu"),
    "offload_budget": lambda m: ramtorch.offload(m, device="cpu", gpu_budget=_budget(m)),
    "linear": lambda m: ramtorch.replace_linear(m, device="cpu"),
}


def _budget(m: nn.Module) -> int:
    """A budget that keeps one block (and the small units) resident and streams three blocks."""
    block = sum(p.numel() * p.element_size() for p in m.blocks[0].parameters())
    return int(3.6 * block)


def _pair(make: str, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    plain = Net(d=16, layers=4)
    streamed = MAKERS[make](copy.deepcopy(plain))
    if make == "offload_budget":
        info = streamed._ramtorch_streamer.stats()
        assert "blocks.2" in info["resident_units"] and info["streamed_units"] == 3
    return plain, streamed


def _x(seed: int) -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("make", list(MAKERS))
@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edit_between_inference_passes_is_seen(make: str, edit: str) -> None:
    plain, streamed = _pair(make)
    with torch.no_grad():
        for k in range(2):  # the end of an inference pass prefetches the next one's first units
            torch.testing.assert_close(streamed(_x(k)), plain(_x(k)), rtol=0, atol=0)
        EDITS[edit](plain)
        EDITS[edit](streamed)
        for k in range(2, 4):
            torch.testing.assert_close(streamed(_x(k)), plain(_x(k)), rtol=0, atol=0)


@pytest.mark.parametrize("make", list(MAKERS))
@pytest.mark.parametrize("edit", ["data_mul", "data_assign", "init"])
def test_an_edit_between_an_evaluation_and_a_training_step_is_seen(make: str, edit: str) -> None:
    plain, streamed = _pair(make)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, streamed)]
    for step in range(3):
        with torch.no_grad():
            torch.testing.assert_close(streamed(_x(step)), plain(_x(step)), rtol=0, atol=0)
        for m in (plain, streamed):
            EDITS[edit](m)
        losses = []
        for m, opt in zip((plain, streamed), opts):
            loss = m(_x(10 + step)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    for p, q in zip(plain.parameters(), streamed.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def _ema(ema: nn.Module, model: nn.Module, decay: float = 0.5) -> None:
    for e, p in zip(ema.parameters(), model.parameters()):
        e.data.mul_(decay).add_(p.data, alpha=1 - decay)


@pytest.mark.parametrize("make", list(MAKERS))
@pytest.mark.parametrize("optimizer", ["ramtorch", "torch"])
def test_an_ema_model_follows_training(make: str, optimizer: str) -> None:
    plain, streamed = _pair(make)
    plain_ema = copy.deepcopy(plain)
    streamed_ema = MAKERS[make](copy.deepcopy(plain))
    if optimizer == "ramtorch":
        opts = [
            torch.optim.AdamW(plain.parameters(), lr=1e-2),
            ramtorch.optim.AdamW(streamed.parameters(), lr=1e-2),
        ]
    else:
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, streamed)]
    for step in range(4):
        for m, ema, opt in zip((plain, streamed), (plain_ema, streamed_ema), opts):
            m(_x(step)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            _ema(ema, m)
        with torch.no_grad():
            torch.testing.assert_close(streamed_ema(_x(100)), plain_ema(_x(100)), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(streamed(_x(101)), plain(_x(101)), rtol=1e-5, atol=1e-6)
        # Swap the EMA weights in for an evaluation and back, as EMA helpers do.
        for m, ema in ((plain, plain_ema), (streamed, streamed_ema)):
            saved = [p.detach().clone() for p in m.parameters()]
            for p, e in zip(m.parameters(), ema.parameters()):
                p.data.copy_(e.data)
            with torch.no_grad():
                out = m(_x(200 + step))
            for p, s in zip(m.parameters(), saved):
                p.data.copy_(s)
            if m is plain:
                want = out
            else:
                torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_peft_lora_merge_and_unload_is_seen() -> None:
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = Net(d=16, layers=4)
    config = peft.LoraConfig(target_modules=["up", "down"], r=4, init_lora_weights=False)
    plain = peft.get_peft_model(copy.deepcopy(base), config)
    torch.manual_seed(0)
    streamed = peft.get_peft_model(copy.deepcopy(base), config)
    streamed.load_state_dict(plain.state_dict())
    ramtorch.offload(streamed, device="cpu")
    with torch.no_grad():
        for k in range(2):
            torch.testing.assert_close(streamed(_x(k)), plain(_x(k)), rtol=0, atol=0)
        plain_merged = plain.merge_and_unload()
        streamed_merged = streamed.merge_and_unload()
        # The merged model has no LoRA left: it is the base model with the adapters folded in.
        assert not any("lora" in n for n, _ in streamed_merged.named_parameters())
        for k in range(2, 5):
            want = plain_merged(_x(k))
            torch.testing.assert_close(streamed_merged(_x(k)), want, rtol=0, atol=0)
            assert not torch.allclose(want, base(_x(k)))  # the merge did change the model


def test_peft_merge_and_unload_of_an_offloaded_base_model() -> None:
    """The model inside the PEFT model is offloaded, with its adapters (the PEFT model's own root
    runs no streaming hook); merging replaces the adapter layers after offload."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = Net(d=16, layers=4)
    config = peft.LoraConfig(target_modules=["up", "down"], r=4, init_lora_weights=False)
    torch.manual_seed(1)
    plain = peft.get_peft_model(copy.deepcopy(base), config)
    torch.manual_seed(1)
    streamed = peft.get_peft_model(copy.deepcopy(base), config)
    streamed.load_state_dict(plain.state_dict())
    ramtorch.offload(streamed.base_model.model, device="cpu")
    with torch.no_grad():
        for k in range(2):
            torch.testing.assert_close(streamed(_x(k)), plain(_x(k)), rtol=0, atol=0)
        plain_merged = plain.merge_and_unload()
        streamed_merged = streamed.merge_and_unload()
        for k in range(2, 5):
            torch.testing.assert_close(streamed_merged(_x(k)), plain_merged(_x(k)), rtol=0, atol=0)


def test_a_free_standing_layer_sees_data_edits_between_calls() -> None:
    torch.manual_seed(0)
    plain = nn.Linear(8, 4)
    layer = rnn.Linear.from_linear(plain, device="cpu")
    with torch.no_grad():
        for k in range(4):
            torch.testing.assert_close(layer(_x(k)), plain(_x(k)), rtol=0, atol=0)
            for m in (plain, layer):
                if k % 2:
                    m.bias.data = torch.full((4,), float(k))
                else:
                    m.weight.data.add_(1.0)


def test_h2d_bytes_per_pass_are_what_the_passes_stream() -> None:
    """The inference passes of an offloaded model copy each streamed unit once per pass, and a
    training step copies what it did before (the units ending the forward start the backward
    without a copy)."""
    torch.manual_seed(0)
    model = ramtorch.offload(Net(d=32, layers=8), device="cpu")
    per_pass = model._ramtorch_streamer.stats()["streamed_bytes_per_pass"]
    eng = "cpu"

    def h2d() -> int:
        return ramtorch.stats()["devices"][eng]["h2d_bytes"]

    with torch.no_grad():
        model(_x(0))
        before = h2d()
        for k in range(3):
            model(_x(k))
        assert h2d() - before == 3 * per_pass


@pytest.mark.parametrize("make", ["offload", "linear"])
def test_autograd_grad_on_streamed_weights_is_a_clear_error(make: str) -> None:
    _, streamed = _pair(make)
    loss = streamed(_x(0)).square().mean()
    weight = streamed.blocks[0].up.weight
    with pytest.raises(RuntimeError, match=r"streamed.*backward\(\)"):
        torch.autograd.grad(loss, [weight])
    with pytest.raises(RuntimeError, match=r"streamed.*backward\(\)"):
        torch.autograd.grad(loss, weight, allow_unused=True, retain_graph=True)


@pytest.mark.parametrize("make", ["offload", "linear"])
def test_backward_with_streamed_inputs_is_a_clear_error(make: str) -> None:
    """``backward(inputs=[...])`` naming a streamed weight would leave its ``.grad`` untouched."""
    plain, streamed = _pair(make)
    weight = streamed.blocks[0].up.weight
    with pytest.raises(RuntimeError, match=r"backward\(inputs=\.\.\.\).*streamed"):
        streamed(_x(0)).square().mean().backward(inputs=[weight])
    with pytest.raises(RuntimeError, match=r"backward\(inputs=\.\.\.\).*streamed"):
        torch.autograd.backward(streamed(_x(0)).square().mean(), inputs=weight)
    # Inputs that are not streamed weights still work, and so does a plain backward afterwards.
    xs = [_x(1).requires_grad_() for _ in range(2)]
    for m, x in zip((plain, streamed), xs):
        m(x).square().mean().backward(inputs=[x])
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-6, atol=1e-6)
    assert weight.grad is None and plain.blocks[0].up.weight.grad is None
    for m in (plain, streamed):
        m(_x(2)).square().mean().backward()
    for (name, p), q in zip(plain.named_parameters(), streamed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-6, msg=name)


def test_autograd_grad_on_inputs_and_resident_weights_still_works() -> None:
    plain, streamed = _pair("offload_budget")
    xs = [_x(0).requires_grad_() for _ in range(2)]
    grads = []
    for m, x in zip((plain, streamed), xs):
        loss = m(x).square().mean()
        grads.append(torch.autograd.grad(loss, [x, m.blocks[2].up.weight]))  # blocks.2 is resident
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_weights_tied_after_offload_are_a_clear_error() -> None:
    plain, streamed = _pair("offload")
    with torch.no_grad():
        streamed(_x(0))
        own = streamed.blocks[1].up.weight
        streamed.blocks[1].up.weight = streamed.blocks[0].up.weight
        with pytest.raises(RuntimeError, match="tied after offload"):
            streamed(_x(1))
        streamed.blocks[1].up.weight = own  # untied again: the model works as before
        torch.testing.assert_close(streamed(_x(2)), plain(_x(2)), rtol=0, atol=0)


def test_streamed_embedding_and_conv2d_see_data_edits_between_calls() -> None:
    torch.manual_seed(0)
    plain = nn.ModuleList([nn.Embedding(10, 6), nn.Conv2d(1, 2, 3)])
    streamed = nn.ModuleList([rnn.Embedding(10, 6, device="cpu"), rnn.Conv2d(1, 2, 3, device="cpu")])
    streamed.load_state_dict(plain.state_dict())
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with torch.no_grad():
        for k in range(4):
            for a, b in zip(plain, streamed):
                x = ids if isinstance(a, nn.Embedding) else a.weight.new_ones(1, 1, 5, 5) * k
                torch.testing.assert_close(b(x), a(x), rtol=0, atol=0)
            for m in (plain, streamed):
                for p in m.parameters():
                    p.data.add_(0.25)


def test_weights_unchanged_lets_inference_passes_prefetch_across_and_stays_correct():
    torch.manual_seed(0)
    plain = Net(d=32, layers=6)
    model = ramtorch.offload(copy.deepcopy(plain), device="cpu")
    streamer = model._ramtorch_streamer
    x = torch.randn(4, 8)
    with torch.no_grad():
        model(x)
        assert not streamer.ahead  # by default nothing of the next pass is copied at a pass's end
        with ramtorch.weights_unchanged(model) as m:
            assert m is model
            for _ in range(3):
                torch.testing.assert_close(model(x), plain(x))
                assert streamer.ahead  # the next pass's first units, copied at this pass's end
                hits = streamer.counters["prefetch_hits"]
            model(x)
            assert streamer.counters["prefetch_hits"] > hits
        # The block is over: an edit no version counter sees is seen by the next pass again.
        for p, q in zip(model.parameters(), plain.parameters()):
            p.data.mul_(0.5)
            q.data.mul_(0.5)
        torch.testing.assert_close(model(x), plain(x))
        assert not streamer.ahead


def test_weights_unchanged_needs_an_offloaded_model():
    with pytest.raises(ValueError, match="not offloaded"):
        with ramtorch.weights_unchanged(nn.Linear(2, 2)):
            pass


def test_parameters_replaced_by_larger_ones_are_a_clear_error_at_every_pass() -> None:
    """A unit whose parameters are replaced after offload by wider ones (fp32 into a bf16 model)
    no longer fits the device slots planned for it: each pass says so by name, and replacing them
    with parameters of the planned size makes the model run again, equal to the plain one."""
    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)]).bfloat16()
    m = ramtorch.offload(copy.deepcopy(plain), device="cpu")
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        m(x)
        m.load_state_dict({k: v.float() for k, v in plain.state_dict().items()}, assign=True)
        for _ in range(2):  # not only at the pass that takes the new parameters in
            with pytest.raises(RuntimeError, match=r"unit '0' now takes 1.1 KiB, more than the 576 B"):
                m(x.float())
        m.load_state_dict(plain.state_dict(), assign=True)
        assert torch.equal(m(x), plain(x))


@pytest.mark.parametrize("max_inflight", [1, 2])
def test_the_host_queues_copies_ahead_only_where_the_pass_waits_for_them(max_inflight: int) -> None:
    """An offloaded model's passes wait at their end for their own copies, so the host may queue
    ``COPIES_AHEAD`` of them; the free-standing layers' streamer has no pass end and keeps
    ``max_inflight``. Either way an edit right after a forward reaches the next forward only."""
    from ramtorch import _engine
    from ramtorch._stream.shared import for_device

    assert _engine.COPIES_AHEAD is not None and _engine.COPIES_AHEAD > max_inflight
    torch.manual_seed(0)
    plain = Net(d=16, layers=4)
    streamed = ramtorch.offload(copy.deepcopy(plain), device="cpu", max_inflight=max_inflight)
    assert streamed._ramtorch_streamer._copies_ahead() == _engine.COPIES_AHEAD
    layers = ramtorch.replace_linear(copy.deepcopy(plain), device="cpu", max_inflight=max_inflight)
    with torch.no_grad():
        layers(_x(0))
    shared = for_device(torch.device("cpu"))
    assert shared._copies_ahead() == shared.max_inflight >= max_inflight
    with torch.no_grad():
        for k in range(3):
            torch.testing.assert_close(streamed(_x(k)), plain(_x(k)), rtol=0, atol=0)
            _data_mul(plain)
            _data_mul(streamed)
