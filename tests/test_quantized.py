"""Quantized and subclassed weights: torchao int8 weights stream by their inner tensors (fewer bytes
on the link), QLoRA (frozen int8 base + peft LoRA adapters) trains through ``offload`` as the plain
model does, and subclasses that cannot be streamed are refused by name."""

from __future__ import annotations

import copy
import warnings

import pytest
import ramtorch
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

torchao = pytest.importorskip("torchao")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d: int = 64, layers: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.out = nn.Linear(d, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def quantized_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    m = Net()
    # The input projection stays plain: units mix plain and quantized parameters.
    quantize_(
        m, Int8WeightOnlyConfig(), filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear) and fqn != "inp"
    )
    return m


def inner_bytes(m: nn.Module) -> tuple[int, int]:
    """(bytes of the quantized weights' inner tensors, bytes they would take in their dtype)."""
    q = full = 0
    for p in m.parameters():
        if hasattr(p, "__tensor_flatten__"):
            q += sum(getattr(p, n).numel() * getattr(p, n).element_size() for n in p.__tensor_flatten__()[0])
            full += p.numel() * p.element_size()
    return q, full


def test_int8_weights_stream_by_their_inner_tensors():
    ref = quantized_net()
    m = copy.deepcopy(ref)
    assert type(m.blocks[0].up.weight).__name__ == "Int8Tensor"
    ramtorch.offload(m, device="cpu")
    # The parameter stays the same quantized tensor, its inner tensors now in the unit's region.
    w = m.blocks[0].up.weight
    assert type(w).__name__ == "Int8Tensor" and w.qdata.dtype == torch.int8
    u = next(u for u in m._ramtorch_streamer.units if u.module is m.blocks[0])
    assert all(ramtorch._arena.in_region(getattr(w, n), u.flat) for n in w.__tensor_flatten__()[0])
    torch.manual_seed(1)
    x = torch.randn(4, 7, 16)
    for _ in range(2):
        torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)
    # What crosses the link is the int8 data and its scales, not the bf16/fp32 weight.
    stats = m._ramtorch_streamer.stats()
    q, full = inner_bytes(m)
    plain = sum(p.numel() * p.element_size() for p in m.parameters() if type(p) is nn.Parameter)
    assert stats["streamed_bytes_per_pass"] < q + plain + 64 * 4 * len(list(m.parameters()))
    assert stats["streamed_bytes_per_pass"] >= q + plain
    assert q < full / 3
    # state_dict hands out the quantized tensors with their values.
    sd, sd_ref = m.state_dict(), ref.state_dict()
    for k, v in sd_ref.items():
        assert type(sd[k]) is type(v), k
        plain = (lambda t: t.dequantize()) if hasattr(v, "qdata") else (lambda t: t)
        torch.testing.assert_close(plain(sd[k]), plain(v), rtol=0, atol=0)


def test_float8_weights_stream_by_their_inner_tensors():
    from torchao.quantization import Float8WeightOnlyConfig

    torch.manual_seed(0)
    ref = Net().to(torch.bfloat16)
    quantize_(
        ref, Float8WeightOnlyConfig(), filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear) and fqn != "inp"
    )
    for p in ref.parameters():
        p.requires_grad_(False)
    m = copy.deepcopy(ref)
    ramtorch.offload(m, device="cpu")
    assert type(m.blocks[1].down.weight).__name__ == "Float8Tensor"
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    out, out_ref = m(xs[0]), ref(xs[1])
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    out.float().square().sum().backward()
    out_ref.float().square().sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=0, atol=0)
    q, full = inner_bytes(m)
    plain = sum(p.numel() * p.element_size() for p in m.parameters() if type(p) is nn.Parameter)
    assert q + plain <= m._ramtorch_streamer.stats()["streamed_bytes_per_pass"] < full / 2 + plain + 4096


def test_in_place_edit_of_a_quantized_weight_is_seen_by_the_next_pass():
    ref = quantized_net()
    m = copy.deepcopy(ref)
    ramtorch.offload(m, device="cpu")
    x = torch.randn(2, 16)
    with torch.no_grad():
        m(x), m(x)  # the first units of the next pass are prefetched
        for model in (m, ref):
            model.blocks[0].up.weight.qdata.mul_(-1)
            model.blocks[2].down.weight.scale.mul_(3)
        torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)


def test_input_gradients_through_frozen_int8_weights():
    ref = quantized_net()
    for p in ref.parameters():
        p.requires_grad_(False)
    m = copy.deepcopy(ref)
    ramtorch.offload(m, device="cpu")
    torch.manual_seed(2)
    x = torch.randn(3, 16)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    m(xs[0]).square().sum().backward()
    ref(xs[1]).square().sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=0, atol=0)


def test_quantized_weight_that_requires_grad_is_refused_by_name():
    m = quantized_net()
    m.blocks[1].down.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"blocks\.1\.down\.weight.*Int8Tensor.*requires grad"):
        ramtorch.offload(m, device="cpu")


class Opaque(torch.Tensor):
    """A wrapper subclass without ``__tensor_flatten__``: nothing says where its bytes are."""

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> Opaque:
        t = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=data.device)
        t.data_ = data
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        if func is torch.ops.aten.detach.default:
            return Opaque(args[0].data_)
        unwrap = lambda t: t.data_ if isinstance(t, Opaque) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def test_unstreamable_subclass_is_refused_by_name():
    torch.manual_seed(0)
    m = Net()
    m.blocks[2].up.weight = nn.Parameter(Opaque(m.blocks[2].up.weight.detach().clone()), requires_grad=False)
    with pytest.raises(TypeError, match=r"blocks\.2\.up\.weight.*Opaque.*__tensor_flatten__"):
        ramtorch.offload(m, device="cpu")


class Scaled(torch.Tensor):
    """A minimal traceable wrapper subclass (int8 data and a per-row scale) whose ops run on the
    dequantized tensor; autograd saves the subclass itself for backward (``linear``'s weight)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor) -> Scaled:
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=scale.dtype, device=data.device)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor) -> None:
        self.data_, self.scale = data, scale

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["data_", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, size, stride) -> Scaled:  # noqa: ANN001
        return Scaled(inner["data_"], inner["scale"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        def unwrap(t):  # noqa: ANN001, ANN202
            return t.data_.to(t.scale.dtype) * t.scale if isinstance(t, Scaled) else t

        if func is torch.ops.aten.detach.default:
            return Scaled(args[0].data_, args[0].scale)
        if func is torch.ops.aten.t.default:  # stays quantized: linear saves it for backward
            return Scaled(args[0].data_.t(), args[0].scale.t())
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def scaled_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    m = Net(d=32, layers=6)
    for b in m.blocks:
        for lin in (b.up, b.down):
            w = lin.weight.detach()
            scale = w.abs().amax(1, keepdim=True) / 127
            q = torch.round(w / scale).to(torch.int8)
            lin.weight = nn.Parameter(Scaled(q, scale), requires_grad=False)
    return m


def test_saved_subclass_weights_in_slots_are_kept_by_reference():
    ref, m = scaled_net(), scaled_net()
    # The slots a unit's weights were saved from are reused by the next units before backward
    # needs them again.
    ramtorch.offload(m, device="cpu", max_inflight=3)
    torch.manual_seed(3)
    x = torch.randn(5, 16)
    opt_m = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    opt_r = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    for _ in range(2):
        xs = [x.clone().requires_grad_(True) for _ in range(2)]
        # Two forwards before one backward: the units sit in other slots when backward reads
        # what the first forward saved.
        (m(xs[0]).square().mean() + m(2 * xs[0]).square().mean()).backward()
        (ref(xs[1]).square().mean() + ref(2 * xs[1]).square().mean()).backward()
        torch.testing.assert_close(xs[0].grad, xs[1].grad)
        ramtorch.synchronize()
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            if p.requires_grad:
                torch.testing.assert_close(p.grad, q.grad, msg=name)
        opt_m.step(), opt_r.step(), opt_m.zero_grad(), opt_r.zero_grad()


def lora_pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    peft = pytest.importorskip("peft")
    base = quantized_net(seed)
    cfg = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["up", "down"], lora_dropout=0.0, init_lora_weights=False
    )
    ref = peft.get_peft_model(base, cfg)
    return ref, copy.deepcopy(ref)


@pytest.mark.parametrize(("opt", "recompute"), [("torch", False), ("ramtorch", False), ("ramtorch", True)])
def test_qlora_trains_like_the_plain_model(opt: str, recompute: bool):
    ref, m = lora_pair()
    assert all(not p.requires_grad for n, p in m.named_parameters() if "lora_" not in n)
    ramtorch.offload(m, device="cpu", recompute=recompute)
    assert type(m.base_model.model.blocks[0].up.base_layer.weight).__name__ == "Int8Tensor"
    lora = [p for p in m.parameters() if p.requires_grad]
    lora_ref = [p for p in ref.parameters() if p.requires_grad]
    assert len(lora) == 12
    if opt == "torch":
        o = torch.optim.AdamW(lora, lr=1e-2)
    else:
        o = ramtorch.optim.AdamW(lora, lr=1e-2)
    o_ref = torch.optim.AdamW(lora_ref, lr=1e-2)
    torch.manual_seed(4)
    for _ in range(3):
        x, y = torch.randn(6, 16), torch.randint(0, 5, (6,))
        out, out_ref = m(x), ref(x)
        torch.testing.assert_close(out, out_ref)
        F.cross_entropy(out, y).backward()
        F.cross_entropy(out_ref, y).backward()
        ramtorch.synchronize()
        for p, q in zip(lora, lora_ref):
            torch.testing.assert_close(p.grad, q.grad)
        o.step()
        o_ref.step()
        o.zero_grad()
        o_ref.zero_grad()
    ramtorch.synchronize()
    for p, q in zip(lora, lora_ref):
        torch.testing.assert_close(p, q)
    with torch.no_grad():
        x = torch.randn(2, 16)
        torch.testing.assert_close(m(x), ref(x))
