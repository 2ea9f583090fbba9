"""A unit's light trainable parameters over a frozen base (LoRA adapters, trained biases) stay on
the device instead of streaming (``ramtorch._stream.units.light_trainable``): the frozen bytes
stream, the adapters' gradients and updates stay where they are, and training equals torch's."""

from __future__ import annotations

import copy

import pytest
import ramtorch
import ramtorch.optim as ropt
import torch
from ramtorch import _engine
from ramtorch._stream import units as _units
from ramtorch.plan import predict
from torch import nn


class LoRABlock(nn.Module):
    """A frozen ``Linear`` plus a rank-``r`` update ``B(A(x))`` (B zero at first, as peft makes it)."""

    def __init__(self, d: int, r: int) -> None:
        super().__init__()
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.A = nn.Linear(d, r, bias=False)
        self.B = nn.Linear(r, d, bias=False)
        nn.init.zeros_(self.B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + self.B(self.A(x)))


class LoRAStack(nn.Module):
    def __init__(self, blocks: int = 4, d: int = 64, r: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(LoRABlock(d, r) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def test_adapters_stay_and_the_base_streams():
    m = LoRAStack()
    ramtorch.offload(m, device="cpu")
    for b in m.blocks:
        assert _engine.is_streamed(b.base.weight) and _engine.is_streamed(b.base.bias)
        assert not _engine.is_streamed(b.A.weight) and not _engine.is_streamed(b.B.weight)
    frozen = sum(p.numel() * p.element_size() for p in m.parameters() if not p.requires_grad)
    assert m._ramtorch_streamer.stats()["streamed_bytes_per_pass"] >= frozen


@pytest.mark.parametrize("opt_kind", ["ramtorch", "torch"])
def test_training_with_resident_adapters_equals_torch(opt_kind):
    torch.manual_seed(0)
    ref = LoRAStack()
    ours = copy.deepcopy(ref)
    ramtorch.offload(ours, device="cpu")
    train = [p for p in ours.parameters() if p.requires_grad]
    assert train and not any(_engine.is_streamed(p) for p in train)
    o_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    o_ours = ropt.AdamW(train, lr=1e-2) if opt_kind == "ramtorch" else torch.optim.AdamW(train, lr=1e-2)
    for _ in range(4):
        x = torch.randn(5, 64)
        for model, opt in ((ref, o_ref), (ours, o_ours)):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.equal(p, q) for p, q in zip(LoRAStack().parameters(), ours.parameters()))


def test_heavy_trainable_parameters_stream():
    """Trainable parameters that hold more than LIGHT_SHARE of their unit stream with it, and a
    unit with nothing frozen (full fine-tuning) streams whole."""
    m = LoRAStack(r=16)  # A and B: 2 x 16 x 64 of 64 x 64 + 64: about 1/2 of the unit
    ramtorch.offload(m, device="cpu")
    assert all(_engine.is_streamed(p) for p in m.parameters())
    full = LoRAStack()
    full.requires_grad_(True)
    ramtorch.offload(full, device="cpu")
    assert all(_engine.is_streamed(p) for p in full.parameters())


def test_light_trainable_rule():
    f = nn.Parameter(torch.zeros(1000), requires_grad=False)
    light = nn.Parameter(torch.zeros(62))
    heavy = nn.Parameter(torch.zeros(80))
    assert _units.light_trainable([f, light]) == [light]  # 62 <= (1062) / 16
    assert _units.light_trainable([f, heavy]) == []  # 80 > 1080 / 16
    assert _units.light_trainable([light]) == []  # nothing frozen
    assert _units.light_trainable([f]) == []  # nothing trainable


def test_the_plan_keeps_the_adapters_resident_as_offload_does():
    with torch.device("meta"):
        meta = LoRAStack()
    pred = predict(meta, None, 128)
    real = LoRAStack()
    ramtorch.offload(real, device="cpu")
    s = real._ramtorch_streamer.stats()
    assert pred.streamed_bytes_per_pass == s["streamed_bytes_per_pass"]
    frozen = sum(p.numel() * p.element_size() for p in real.parameters() if not p.requires_grad)
    assert s["streamed_bytes_per_pass"] < frozen + 64 * 4 * len(list(real.parameters()))


def test_peft_merges_into_the_streamed_base_with_adapters_kept_on_the_device():
    """peft's merge_and_unload adds get_delta_weight, computed where the adapters are, into the
    base weight in host RAM: offload gives the LoRA layers whose adapters it kept on the device a
    get_delta_weight that brings the delta to the base weight's device (on the GPU suite the two
    devices differ; here it is installed and merging still equals peft on a plain model)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    config = peft.LoraConfig(target_modules=["0", "2"], r=2, init_lora_weights=False)
    plain = peft.get_peft_model(copy.deepcopy(base), config)
    ours = copy.deepcopy(plain)
    ramtorch.offload(ours, device="cpu")
    layers = [m for m in ours.modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")]
    assert layers and all(
        type(m.__dict__.get("get_delta_weight")).__name__ == "_DeltaOnBaseDevice" for m in layers
    )
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), plain(x))
        merged, merged_ref = ours.merge_and_unload(), plain.merge_and_unload()
        torch.testing.assert_close(merged(x), merged_ref(x), rtol=1e-5, atol=1e-5)


def _tuner_config(peft: object, tuner: str, targets: list[str]) -> object:
    """A peft config of ``tuner``: LoRA, DoRA (LoRA with learned magnitudes) or IA3, adapters
    initialised away from the identity so that merging changes the weights."""
    if tuner == "ia3":
        return peft.IA3Config(
            target_modules=targets, feedforward_modules=targets[-1:], init_ia3_weights=False
        )
    return peft.LoraConfig(target_modules=targets, r=2, init_lora_weights=False, use_dora=tuner == "dora")


@pytest.mark.parametrize("tuner", ["lora", "dora", "ia3"])
def test_peft_tuners_train_and_merge_as_on_a_plain_model(tuner: str):
    """peft's tuners whose own parameters stay on the device (LoRA's adapters, DoRA's magnitudes,
    IA3's scales) while the base weights stream: they train as on a plain model, and their merges,
    which combine those parameters with the base weight (DoRA divides the magnitudes by its norm,
    IA3 multiplies it by the scales), run with them on the base weight's device
    (``_AdaptersOnBaseDevice``; on the GPU suite the two differ) and put them back after."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
    plain = peft.get_peft_model(copy.deepcopy(base), _tuner_config(peft, tuner, ["0", "2"]))
    ours = copy.deepcopy(plain)
    ramtorch.offload(ours, device="cpu")
    layers = [m for m in ours.modules() if hasattr(m, "base_layer")]
    assert layers and all(type(m.__dict__.get("merge")).__name__ == "_AdaptersOnBaseDevice" for m in layers)
    train = [p for p in ours.parameters() if p.requires_grad]
    assert train and not any(_engine.is_streamed(p) for p in train)
    o_ref = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2)
    o_ours = ropt.AdamW(train, lr=1e-2)
    for k in range(3):
        x = torch.randn(3, 256, generator=torch.Generator().manual_seed(k))
        for model, opt in ((plain, o_ref), (ours, o_ours)):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(plain.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    x = torch.randn(3, 256)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), plain(x), rtol=1e-5, atol=1e-5)
        for m in (plain, ours):
            m.base_model.merge_adapter()
        torch.testing.assert_close(ours(x), plain(x), rtol=1e-5, atol=1e-5)
        for m in (plain, ours):
            m.base_model.unmerge_adapter()
        torch.testing.assert_close(ours(x), plain(x), rtol=1e-5, atol=1e-5)
        assert [p.device for p in train] == [torch.device("cpu")] * len(train)
        merged, merged_ref = ours.merge_and_unload(), plain.merge_and_unload()
        torch.testing.assert_close(merged(x), merged_ref(x), rtol=1e-5, atol=1e-5)
