"""Which parameters form units by default: blocks kept in an ``nn.Sequential`` (torchvision's ViT
``encoder.layers``, the stages of Swin and ConvNeXt) under a parent that holds a parameter of its
own (ViT's ``class_token``), and the ``unit=`` that budget errors and the plan name when one unit
holds most of the model."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import ramtorch
import ramtorch.plan
import torch
from ramtorch._offload import detach_streamer
from torch import nn


class MLPBlock(nn.Sequential):
    """torchvision's ``MLPBlock``: a subclass of ``nn.Sequential`` (a small network, not a list of
    blocks)."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))


class EncoderBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.self_attention = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = MLPBlock(d, 2 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = x + y
        return x + self.mlp(self.ln_2(x))


class Encoder(nn.Module):
    def __init__(self, seq: int, layers: int, d: int, heads: int) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.randn(1, seq, d) * 0.02)
        self.layers = nn.Sequential(
            OrderedDict((f"encoder_layer_{i}", EncoderBlock(d, heads)) for i in range(layers))
        )
        self.ln = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.layers(x + self.pos_embedding))


class TinyViT(nn.Module):
    """Shaped as torchvision's ``VisionTransformer``: a ``class_token`` parameter on the root, a
    position table on the encoder, the blocks in ``encoder.layers``, an ``nn.Sequential``."""

    def __init__(
        self, image: int = 8, patch: int = 4, d: int = 32, layers: int = 4, classes: int = 5
    ) -> None:
        super().__init__()
        self.patch = patch
        self.conv_proj = nn.Conv2d(3, d, kernel_size=patch, stride=patch)
        self.class_token = nn.Parameter(torch.zeros(1, 1, d))
        self.encoder = Encoder((image // patch) ** 2 + 1, layers, d, heads=4)
        self.heads = nn.Sequential(OrderedDict(head=nn.Linear(d, classes)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.heads(self.encoder(x)[:, 0])


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_vit_blocks_in_a_sequential_stream_one_by_one():
    torch.manual_seed(0)
    plain = TinyViT()
    model = TinyViT()
    model.load_state_dict(plain.state_dict())
    ramtorch.offload(model, device="cpu")
    s = model._ramtorch_streamer.stats()
    try:
        names = [u.name for u in model._ramtorch_streamer.units if not u.resident]
        blocks = [f"encoder.layers.encoder_layer_{i}" for i in range(4)]
        assert all(b in names for b in blocks), names
        # The parameters on the parents of the blocks stay resident; nothing else does.
        assert sorted(s["resident_units"]) == ["<root>", "encoder"]
        x = torch.randn(3, 3, 8, 8)
        torch.testing.assert_close(model(x), plain(x))
        model(x).square().sum().backward()
        plain(x).square().sum().backward()
        ours, want = _grads(model), _grads(plain)
        for n in want:
            torch.testing.assert_close(ours[n], want[n], msg=n)
    finally:
        detach_streamer(model)


def test_vit_fits_a_budget_of_two_block_slots():
    model = TinyViT(layers=6)
    block = sum(p.numel() * 4 for p in model.encoder.layers[0].parameters())
    rest = sum(p.numel() * 4 for p in model.parameters()) - 6 * block
    # The resident parts, two slots of one block and a little room: far below the whole model.
    ramtorch.offload(model, gpu_budget=rest + 2 * block + 4096, device="cpu")
    try:
        s = model._ramtorch_streamer.stats()
        assert s["streamed_units"] >= 4 and s["slot_bytes"] < 2 * block
        model(torch.randn(2, 3, 8, 8)).sum().backward()
    finally:
        detach_streamer(model)


def test_a_sequential_of_mixed_layers_is_not_a_list_of_blocks():
    from ramtorch._stream.units import find_unit_roots

    stem = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8)
    )
    model = nn.Sequential(OrderedDict(stem=stem, head=nn.Linear(8, 2)))
    assert find_unit_roots(model, None) == []
    # torchvision's MLPBlock subclasses nn.Sequential: a network, not a list of blocks.
    assert find_unit_roots(nn.Sequential(OrderedDict(mlp=MLPBlock(4, 8))), None) == []


class Loose(nn.Module):
    """Blocks registered one by one as attributes, under a root that holds a parameter: no list
    says they are blocks, so by default the whole model is one unit."""

    def __init__(self, d: int = 64, layers: int = 4) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        for i in range(layers):
            setattr(self, f"block{i}", EncoderBlock(d, 4))
        self.layers = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.layers):
            x = getattr(self, f"block{i}")(x)
        return x * self.scale


def test_a_budget_error_names_the_unit_argument_that_splits_a_big_unit():
    model = Loose()
    total = sum(p.numel() * 4 for p in model.parameters())
    with pytest.raises(ValueError) as e:
        ramtorch.offload(model, gpu_budget=total * 3 // 4, device="cpu")
    msg = str(e.value)
    assert "unit='EncoderBlock'" in msg and "4 EncoderBlock modules" in msg, msg
    assert "'<root>' holds 100% of the weights" in msg, msg
    # The advice works: with it, the same budget streams the blocks.
    model = Loose()
    ramtorch.offload(model, gpu_budget=total * 3 // 4, unit="EncoderBlock", device="cpu")
    try:
        assert model._ramtorch_streamer.stats()["streamed_units"] >= 2
        model(torch.randn(2, 3, 64)).sum().backward()
    finally:
        detach_streamer(model)


def test_the_plan_names_the_unit_argument_that_splits_a_big_unit():
    with torch.device("meta"):
        model = Loose()
    notes = ramtorch.plan.predict(model, None, 16).notes
    assert any("unit='EncoderBlock'" in n for n in notes), notes
    with pytest.raises(ValueError, match="unit='EncoderBlock'"):
        ramtorch.plan.predict(model, "1KiB", 16)
    # With the blocks split, nothing to say.
    assert not any("unit=" in n for n in ramtorch.plan.predict(model, None, 16, unit="EncoderBlock").notes)
    # A model whose blocks are found by default gets no such note either.
    with torch.device("meta"):
        vit = TinyViT()
    assert not any("unit=" in n for n in ramtorch.plan.predict(vit, None, 16).notes)


class CNBlock(nn.Module):
    """ConvNeXt's block: a parameter of its own (``layer_scale``) beside its layers."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(d, d, 3, padding=1, groups=d)
        self.pwconv = nn.Linear(d, d)
        self.layer_scale = nn.Parameter(torch.full((d, 1, 1), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pwconv(self.dwconv(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return x + self.layer_scale * y


class TinyConvNeXt(nn.Module):
    """Stages of blocks in ``nn.Sequential``s of unequal length, between downsampling layers, and a
    parameter on the root."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(2))
        self.features = nn.Sequential(
            nn.Sequential(nn.Conv2d(3, 8, 1), nn.GroupNorm(1, 8)),
            nn.Sequential(*(CNBlock(8) for _ in range(2))),
            nn.Conv2d(8, 16, 1),
            nn.Sequential(*(CNBlock(16) for _ in range(3))),
        )
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3))) + self.bias


def test_convnext_stages_stream_block_by_block():
    torch.manual_seed(0)
    plain = TinyConvNeXt()
    model = TinyConvNeXt()
    model.load_state_dict(plain.state_dict())
    ramtorch.offload(model, device="cpu")
    try:
        units = {u.name: u.resident for u in model._ramtorch_streamer.units}
        blocks = [f"features.1.{i}" for i in range(2)] + [f"features.3.{i}" for i in range(3)]
        assert all(units.get(b) is False for b in blocks), units
        assert units["<root>"] is True and "features" not in units
        x = torch.randn(2, 3, 6, 6)
        torch.testing.assert_close(model(x), plain(x))
    finally:
        detach_streamer(model)


def test_a_slots_views_are_made_once_and_anew_where_one_changed_in_place() -> None:
    from ramtorch import _engine

    flat = torch.zeros(64, dtype=torch.uint8)
    lay = _engine.Layout(flat, [flat[:32].view(torch.float32).view(2, 4), flat[32:48].view(torch.float32)])
    slot = torch.arange(64, dtype=torch.uint8)
    first = lay.slot_views(slot)
    assert lay.slot_views(slot) is first
    assert torch.equal(first[0], slot[:32].view(torch.float32).view(2, 4))
    assert first[1].data_ptr() == slot.data_ptr() + 32
    first[0].t_()  # metadata changed in place: not the layout's view any more
    again = lay.slot_views(slot)
    assert again is not first and again[0].shape == (2, 4) and again[0].is_contiguous()
    other = torch.zeros(64, dtype=torch.uint8)  # another slot: views of its own
    assert lay.slot_views(other)[0].data_ptr() == other.data_ptr()
    _engine.forget_slot_views()
    assert not lay._made


def test_replacing_the_slots_drops_every_view_of_the_old_ones() -> None:
    """Views kept for a model that does not run again would hold the old slots' memory."""
    from ramtorch import _engine

    torch.manual_seed(0)
    small = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
    ramtorch.offload(small, device="cpu")
    x = torch.randn(2, 16)
    small(x)
    held = [u.layout for u in small._ramtorch_streamer.units if u.layout is not None and u.layout._made]
    assert held, "a forward keeps its units' views of the slots"
    eng = _engine.engine_for(torch.device("cpu"))
    old = list(eng._slots)
    eng.reserve(eng._slot_bytes + (1 << 16), len(old))  # as a model of larger units does
    eng._ensure_slots()
    assert eng._slots and all(s is not t for s in old for t in eng._slots)
    assert all(not lay._made for lay in held)
    ref = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
    ref.load_state_dict(small.state_dict())
    torch.testing.assert_close(small(x), ref(x))
