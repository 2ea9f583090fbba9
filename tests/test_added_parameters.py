"""Parameters added to an offloaded model after ``ramtorch.offload`` (peft's ``get_peft_model``,
``register_parameter``, a submodule set in place of another) are not in any streamed unit: the next
forward refuses them with an error that names them and their unit, instead of leaving them in host
RAM unstreamed. Models offloaded with their adapters already in place, and other offloaded models,
are unaffected; the registration hooks hold no model alive and go once no offloaded model is left."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import ramtorch
import torch
from conftest import Net
from torch import nn
from torch.nn.modules import module as torch_module

ADDED = "after ramtorch.offload"


def _pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    plain = Net()
    return plain, ramtorch.offload(copy.deepcopy(plain), device="cpu")


def _x() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def test_peft_after_offload_is_refused_naming_the_adapters_and_their_unit():
    peft = pytest.importorskip("peft")
    _, m = _pair()
    cfg = peft.LoraConfig(r=2, target_modules=["up"], lora_dropout=0.0)
    model = peft.get_peft_model(m, cfg)
    with pytest.raises(RuntimeError, match=ADDED) as err:
        model(_x())
    msg = str(err.value)
    assert "blocks.0.up.lora_A.default.weight" in msg and "'blocks.0'" in msg, msg
    assert "before ramtorch.offload" in msg and "get_peft_model" in msg, msg
    with pytest.raises(RuntimeError, match=ADDED):  # every pass, not only the first
        model(_x())


def test_peft_before_offload_trains_like_the_plain_model():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=2, target_modules=["up", "down"], lora_dropout=0.0, init_lora_weights=False)
    ref = peft.get_peft_model(Net(), cfg)
    m = copy.deepcopy(ref)
    m = ramtorch.offload(m, device="cpu")
    opts = [torch.optim.SGD([p for p in x.parameters() if p.requires_grad], lr=0.1) for x in (ref, m)]
    for _ in range(2):
        outs = [x(_x()) for x in (ref, m)]
        torch.testing.assert_close(outs[1], outs[0])
        for o in outs:
            o.square().mean().backward()
        for o in opts:
            o.step()
            o.zero_grad()
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=name)


@pytest.mark.parametrize("how", ["register_parameter", "setattr"])
def test_parameter_registered_after_offload_is_refused_by_name(how: str):
    _, m = _pair()
    extra = nn.Parameter(torch.ones(32))
    if how == "register_parameter":
        m.blocks[1].up.register_parameter("extra", extra)
    else:
        m.blocks[1].up.extra = extra
    with pytest.raises(RuntimeError, match=ADDED) as err:
        m(_x())
    assert "blocks.1.up.extra" in str(err.value) and "'blocks.1'" in str(err.value)
    # A unit run on its own is checked too.
    with pytest.raises(RuntimeError, match=ADDED):
        m.blocks[1](torch.randn(2, 16))


def test_parameter_added_to_a_unit_outside_the_blocks_is_refused():
    _, m = _pair()
    m.out.register_parameter("extra", nn.Parameter(torch.ones(3)))
    with pytest.raises(RuntimeError, match=ADDED) as err:
        m(_x())
    assert "out.extra" in str(err.value) and "'out'" in str(err.value)


def test_submodule_replaced_after_offload_is_refused_by_name():
    _, m = _pair()
    m.blocks[2].up = nn.Linear(16, 32)
    with pytest.raises(RuntimeError, match=ADDED) as err:
        m(_x())
    assert "blocks.2.up.weight" in str(err.value) and "blocks.2.up.bias" in str(err.value)


def test_module_moved_into_another_unit_after_offload_is_refused():
    _, m = _pair()
    m.blocks[0].up = m.blocks[1].up  # now in two streamed units, which each swap their own weights
    with pytest.raises(RuntimeError, match=ADDED) as err:
        m(_x())
    assert "blocks.0.up.weight" in str(err.value) and "'blocks.0'" in str(err.value)


def test_parameter_added_inside_a_module_added_after_offload_is_refused():
    plain, m = _pair()
    m.blocks[0].side = nn.Module()  # no parameters: nothing to stream, runs as before
    torch.testing.assert_close(m(_x()), plain(_x()))
    m.blocks[0].side.register_parameter("w", nn.Parameter(torch.ones(2)))
    with pytest.raises(RuntimeError, match=ADDED) as err:
        m(_x())
    assert "blocks.0.side.w" in str(err.value)


def test_removing_the_added_parameter_lets_the_model_run_again():
    plain, m = _pair()
    m.blocks[3].down.register_parameter("extra", nn.Parameter(torch.ones(2)))
    with pytest.raises(RuntimeError, match=ADDED):
        m(_x())
    del m.blocks[3].down.extra
    torch.testing.assert_close(m(_x()), plain(_x()))


def test_replacing_a_parameter_and_parameters_on_the_compute_device_outside_units_still_work():
    plain, m = _pair()
    for x in (plain, m):
        g = torch.Generator().manual_seed(5)
        x.blocks[1].up.weight = nn.Parameter(torch.randn(32, 16, generator=g))  # taken into its unit
        x.scale = nn.Parameter(torch.ones(1))  # on the root, outside the units, on the compute device
    torch.testing.assert_close(m(_x()), plain(_x()))


def test_other_offloaded_models_are_unaffected():
    plain_a, a = _pair(0)
    plain_b, b = _pair(1)
    a.blocks[0].up.register_parameter("extra", nn.Parameter(torch.ones(2)))
    torch.testing.assert_close(b(_x()), plain_b(_x()))
    with pytest.raises(RuntimeError, match=ADDED):
        a(_x())
    torch.testing.assert_close(b(_x()), plain_b(_x()))


def _our_hooks() -> int:
    return sum(
        getattr(h, "__module__", "").startswith("ramtorch")
        for d in (
            torch_module._global_parameter_registration_hooks,
            torch_module._global_module_registration_hooks,
        )
        for h in d.values()
    )


def test_hooks_hold_no_model_and_go_with_the_last_offloaded_model():
    from ramtorch import _offload
    from ramtorch._stream import added

    _, m = _pair()
    _, other = _pair(1)
    assert _our_hooks() == 2  # installed once, whatever the number of models
    blocks, streamer = m.blocks, m._ramtorch_streamer
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None  # the registration hooks' map keeps no model alive
    blocks[0].up.register_parameter("extra", nn.Parameter(torch.ones(2)))  # inert
    assert not streamer.touched
    del blocks, streamer
    gc.collect()
    assert not any(p.streamer() is None for p in added._PLACES.values())  # entries go with their modules
    _offload.detach_streamer(other)
    other.blocks[0].up.register_parameter("extra", nn.Parameter(torch.ones(2)))
    other(_x())  # detached: a plain model again
    gc.collect()
    if not any(s.model_ref() is not None for s in _offload.streamers()):  # models of other tests
        assert _our_hooks() == 0
