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
    # (Trainable plain parameters over the frozen quantized ones stay on the device.)
    plain = sum(
        p.numel() * p.element_size()
        for p in m.parameters()
        if type(p) is nn.Parameter and ramtorch._engine.is_streamed(p)
    )
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


# ---------------------------------------------------------------------------------------------
# Quantizing an offloaded model, loading it from a checkpoint, and its state dict


def quant_config(kind: str) -> object:
    from torchao.quantization import Float8WeightOnlyConfig

    return Int8WeightOnlyConfig() if kind == "int8" else Float8WeightOnlyConfig()


def plain_net(kind: str, seed: int = 0) -> Net:
    """An unquantized ``Net`` in the dtype ``kind``'s quantization takes (float8: bf16)."""
    torch.manual_seed(seed)
    m = Net()
    return m.to(torch.bfloat16) if kind == "float8" else m


def quantize(m: nn.Module, kind: str) -> None:
    """The blocks' and the output's Linear weights quantized (``inp`` stays plain)."""
    quantize_(m, quant_config(kind), filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear) and fqn != "inp")


def inputs(kind: str, *shape: int) -> torch.Tensor:
    torch.manual_seed(5)
    return torch.randn(*shape, dtype=torch.bfloat16 if kind == "float8" else torch.float32)


def assert_streams_from_its_region(m: nn.Module) -> None:
    """Each quantized weight of the blocks has its inner tensors in its unit's host region."""
    for b in m.blocks:
        u = next(u for u in m._ramtorch_streamer.units if u.module is b)
        for lin in (b.up, b.down):
            w = lin.weight
            assert type(w).__name__ in ("Int8Tensor", "Float8Tensor")
            assert any(p is w for p in u.params)
            assert all(ramtorch._arena.in_region(getattr(w, n), u.flat) for n in w.__tensor_flatten__()[0])


@pytest.mark.parametrize("kind", ["int8", "float8"])
def test_quantize_after_offload_streams_the_quantized_weights(kind: str):
    plain = plain_net(kind)
    m = ramtorch.offload(copy.deepcopy(plain), device="cpu")
    x = inputs(kind, 3, 16)
    with torch.no_grad():
        m(x), m(x)  # units packed and copied in full precision, the itinerary learnt
    full_bytes = m._ramtorch_streamer.stats()["streamed_bytes_per_pass"]
    quantize(plain, kind)
    quantize(m, kind)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    out, out_ref = m(xs[0]), plain(xs[1])
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    out.float().square().sum().backward()
    out_ref.float().square().sum().backward()
    ramtorch.synchronize()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=0, atol=0)
    trained = [(n, p, q) for (n, p), q in zip(m.named_parameters(), plain.parameters()) if p.requires_grad]
    assert len(trained) == 2 + 3 * 4 + 1  # inp, the blocks' norms and biases, out's bias
    for name, p, q in trained:
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    # The quantized bytes stream, from the units' regions, packed again at the pass after quantize_.
    assert_streams_from_its_region(m)
    q, _ = inner_bytes(m)
    rest = sum(p.numel() * p.element_size() for p in m.parameters() if type(p) is nn.Parameter)
    streamed = m._ramtorch_streamer.stats()["streamed_bytes_per_pass"]
    assert q + rest <= streamed < q + rest + 64 * len(list(m.parameters()))
    assert streamed < 0.6 * full_bytes
    with torch.no_grad():
        torch.testing.assert_close(m(x), plain(x), rtol=0, atol=0)


def test_quantize_inside_weights_unchanged_is_seen_by_the_next_pass():
    plain = plain_net("int8")
    m = ramtorch.offload(copy.deepcopy(plain), device="cpu")
    x = inputs("int8", 2, 16)
    with torch.no_grad(), ramtorch.weights_unchanged(m):
        m(x), m(x)  # the first units of the next pass are prefetched
        quantize(plain, "int8")
        quantize(m, "int8")  # parameters replaced: seen by identity, whatever was promised
        torch.testing.assert_close(m(x), plain(x), rtol=0, atol=0)
    assert_streams_from_its_region(m)


def test_a_parameter_set_after_offload_that_cannot_stream_is_refused_by_name():
    m = ramtorch.offload(plain_net("int8"), device="cpu")
    x = inputs("int8", 2, 16)
    m(x)
    m.blocks[2].up.weight = nn.Parameter(Opaque(m.blocks[2].up.weight.detach().clone()), requires_grad=False)
    opaque = r"'blocks\.2\.up\.weight' .*Opaque.*after offload.*__tensor_flatten__"
    with pytest.raises(TypeError, match=opaque):
        m(x)
    m = ramtorch.offload(plain_net("int8"), device="cpu")
    quantize(m, "int8")
    m.blocks[1].down.weight.requires_grad_(True)
    grads = r"'blocks\.1\.down\.weight' .*Int8Tensor.*after offload.*requires grad"
    with pytest.raises(ValueError, match=grads):
        m(x)


def save_checkpoint_file(kind: str, path: object) -> Net:
    """A plain (unquantized) ``Net`` saved to the safetensors file ``path``, and returned."""
    from safetensors.torch import save_file

    plain = plain_net(kind, seed=3)
    save_file(plain.state_dict(), str(path))
    return plain


def meta_net(kind: str) -> Net:
    with torch.device("meta"):
        m = Net()
    return m.to(torch.bfloat16) if kind == "float8" else m


@pytest.mark.parametrize("kind", ["int8", "float8"])
def test_meta_model_loaded_then_quantized_matches_the_quantized_plain_model(tmp_path, kind: str):
    path = tmp_path / "model.safetensors"
    plain = save_checkpoint_file(kind, path)
    quantize(plain, kind)
    m = meta_net(kind)
    ramtorch.offload(m, device="cpu")
    out = ramtorch.load(m, path)
    assert out["missing"] == [] and out["unexpected"] == []
    quantize(m, kind)
    x = inputs(kind, 4, 16)
    with torch.no_grad():
        torch.testing.assert_close(m(x), plain(x), rtol=0, atol=0)
    assert_streams_from_its_region(m)


def test_quantized_weights_are_refused_by_offload_on_meta_and_by_load(tmp_path):
    path = tmp_path / "model.safetensors"
    save_checkpoint_file("int8", path)
    # Quantized on the meta device: offload cannot allocate it, nor would a plain checkpoint fill it.
    m = meta_net("int8")
    quantize(m, "int8")
    with pytest.raises(TypeError, match=r"'blocks\.0\.up\.weight' .*Int8Tensor.*meta device.*quantize_"):
        ramtorch.offload(m, device="cpu")
    # Quantized between offload and load (its zeros): refused before anything is written.
    m = meta_net("int8")
    ramtorch.offload(m, device="cpu")
    quantize(m, "int8")
    refused = r"ramtorch\.load: 7 tensors .*'blocks\.0\.up\.weight'.*Int8Tensor.*nothing was written"
    with pytest.raises(RuntimeError, match=refused):
        ramtorch.load(m, path)
    assert all(torch.count_nonzero(p) == 0 for p in m.parameters() if type(p) is nn.Parameter)


@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize("kind", ["int8", "float8"])
def test_quantized_state_dict_round_trips_into_an_offloaded_quantized_model(kind: str, assign: bool):
    import io

    src = plain_net(kind)
    quantize(src, kind)
    saved = ramtorch.offload(copy.deepcopy(src), device="cpu")
    buf = io.BytesIO()
    torch.save(saved.state_dict(), buf)
    x = inputs(kind, 4, 16)
    fresh_plain, fresh = plain_net(kind, seed=1), plain_net(kind, seed=1)
    quantize(fresh_plain, kind)
    quantize(fresh, kind)
    ramtorch.offload(fresh, device="cpu")
    with torch.no_grad():
        assert not torch.equal(fresh(x), src(x))
        fresh(x)  # its own weights copied, the next pass's first units prefetched
    for model in (fresh_plain, fresh):
        buf.seek(0)
        model.load_state_dict(torch.load(buf), assign=assign)
    with torch.no_grad():
        torch.testing.assert_close(fresh_plain(x), src(x), rtol=0, atol=0)
        torch.testing.assert_close(fresh(x), src(x), rtol=0, atol=0)
    assert_streams_from_its_region(fresh)
