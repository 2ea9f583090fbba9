"""``copy.deepcopy`` of an offloaded model: a model of its own, offloaded with the same options
(an EMA model through ``torch.optim.swa_utils.AveragedModel``, a frozen reference model), equal to
a copy of the plain model made at the same point, and the original unchanged by it."""

from __future__ import annotations

import copy
import pickle

import pytest
import ramtorch
import torch
import transformers
from conftest import Net
from torch import nn


def _x(seed: int) -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    opt.zero_grad()
    model(_x(seed)).pow(2).mean().backward()
    opt.step()


def _hooks(model: nn.Module) -> list[int]:
    return [len(v) for m in model.modules() for k, v in m.__dict__.items() if k.endswith("hooks")]


def _budget(m: nn.Module) -> int:
    block = sum(p.numel() * p.element_size() for p in m.blocks[0].parameters())
    return int(3.6 * block)


MAKERS = {
    "offload": lambda m: ramtorch.offload(m, device="cpu"),
    "budget": lambda m: ramtorch.offload(m, device="cpu", gpu_budget=_budget(m)),
    "recompute": lambda m: ramtorch.offload(m, device="cpu", recompute=True, max_inflight=1),
}


@pytest.mark.parametrize("make", list(MAKERS))
def test_a_deep_copy_is_an_offloaded_model_of_its_own(make: str) -> None:
    torch.manual_seed(0)
    plain = Net(d=16, layers=4)
    ours = MAKERS[make](copy.deepcopy(plain))
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    for k in range(2):
        _step(plain, opt_plain, k)
        _step(ours, opt_ours, k)
    hooks = _hooks(ours)
    cls = type(ours)

    mine = copy.deepcopy(ours)
    theirs = copy.deepcopy(plain)

    assert mine is not ours and type(mine) is cls and _hooks(ours) == hooks
    assert mine._ramtorch_streamer is not None and mine._ramtorch_streamer is not ours._ramtorch_streamer
    assert ramtorch.stats(mine)["streamed_units"] == ramtorch.stats(ours)["streamed_units"]
    assert not any(p.grad is not None for p in mine.parameters())
    with torch.no_grad():
        torch.testing.assert_close(mine(_x(9)), theirs(_x(9)), rtol=0, atol=0)
    # Each trains on its own: the original follows the plain model, the copy the plain copy.
    opt_mine = torch.optim.SGD(mine.parameters(), lr=0.1)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.1)
    for k in range(2, 4):
        _step(plain, opt_plain, k)
        _step(ours, opt_ours, k)
        _step(theirs, opt_theirs, 10 + k)
        _step(mine, opt_mine, 10 + k)
    with torch.no_grad():
        torch.testing.assert_close(ours(_x(9)), plain(_x(9)), rtol=0, atol=0)
        torch.testing.assert_close(mine(_x(9)), theirs(_x(9)), rtol=0, atol=0)
    for a, b in zip(ours.state_dict().values(), plain.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_averaged_model_of_an_offloaded_model_follows_torch() -> None:
    torch.manual_seed(1)
    plain = Net(d=16, layers=4)
    ours = ramtorch.offload(copy.deepcopy(plain), device="cpu")
    avg = torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
    ema_plain = torch.optim.swa_utils.AveragedModel(plain, multi_avg_fn=avg)
    ema_ours = torch.optim.swa_utils.AveragedModel(ours, multi_avg_fn=avg)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    for k in range(4):
        _step(plain, opt_plain, k)
        _step(ours, opt_ours, k)
        ema_plain.update_parameters(plain)
        ema_ours.update_parameters(ours)
        with torch.no_grad():
            torch.testing.assert_close(ema_ours(_x(k)), ema_plain(_x(k)), rtol=0, atol=0)
    assert ema_ours.module._ramtorch_streamer is not ours._ramtorch_streamer


def test_a_deep_copy_of_a_transformers_model_generates_as_the_original() -> None:
    torch.manual_seed(2)
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
    )
    ours = ramtorch.offload(transformers.LlamaForCausalLM(cfg), device="cpu")
    ref = copy.deepcopy(ours).requires_grad_(False).eval()
    assert ref.device == torch.device("cpu")
    ids = torch.randint(3, 50, (1, 6), generator=torch.Generator().manual_seed(0))
    kw = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        torch.testing.assert_close(ref.generate(ids, **kw), ours.generate(ids, **kw), rtol=0, atol=0)
        torch.testing.assert_close(ref(ids).logits, ours(ids).logits, rtol=0, atol=0)


def test_a_deep_copy_copies_the_streamed_weights_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The streamed weights go from the model's host region into the copy's: deepcopy makes no
    plain copy of them first (host memory would hold them twice)."""
    torch.manual_seed(4)
    ours = ramtorch.offload(Net(d=16, layers=3), device="cpu")
    streamed = {id(p) for u in ours._ramtorch_streamer.units if not u.resident for p in u.params}
    copied: list[int] = []
    real = nn.Parameter.__deepcopy__

    def recorded(self: nn.Parameter, memo: dict[int, object]) -> nn.Parameter:
        copied.append(id(self))
        return real(self, memo)

    monkeypatch.setattr(nn.Parameter, "__deepcopy__", recorded)
    mine = copy.deepcopy(ours)
    assert streamed and not streamed & set(copied)
    assert not mine.__dict__.get("_ramtorch_unwritten")
    with torch.no_grad():
        torch.testing.assert_close(mine(_x(3)), ours(_x(3)), rtol=0, atol=0)


def test_a_deep_copy_keeps_ramtorch_layers_inside_streaming() -> None:
    """A ``ramtorch.nn.Linear`` inside an offloaded model copies as such layers do: streaming on
    the device's shared streamer, its weights its own."""
    import ramtorch.nn as rnn

    torch.manual_seed(5)
    ours = ramtorch.offload(
        nn.Sequential(nn.Linear(8, 16), rnn.Linear(16, 16, device="cpu"), nn.Linear(16, 4)), device="cpu"
    )
    mine = copy.deepcopy(ours)
    assert type(mine[1]) is rnn.Linear and mine[1].weight.data_ptr() != ours[1].weight.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(mine(_x(4)), ours(_x(4)), rtol=0, atol=0)
        mine[1].weight.mul_(2)
        assert not torch.equal(mine(_x(4)), ours(_x(4)))


def test_copies_that_cannot_be_made_are_clear_errors() -> None:
    torch.manual_seed(3)
    ours = ramtorch.offload(Net(d=16, layers=2), device="cpu")
    with pytest.raises(TypeError, match="shallow-copied"):
        copy.copy(ours)
    with pytest.raises(TypeError, match="pickled"):
        pickle.dumps(ours)
    squeezed = ramtorch.offload(Net(d=16, layers=2), device="cpu", compress="lossless")
    with pytest.raises(TypeError, match="compress"):
        copy.deepcopy(squeezed)

    copies: list[nn.Module] = []

    def inside(module: nn.Module, args: object, out: object) -> None:
        copies.append(copy.deepcopy(ours))

    handle = ours.blocks[0].register_forward_hook(inside)
    with pytest.raises(RuntimeError, match="inside its forward"):
        ours(_x(0))
    handle.remove()
    assert not copies
    with torch.no_grad():
        ours(_x(1))  # the original still streams after the refused copy
