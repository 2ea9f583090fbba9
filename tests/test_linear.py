"""ramtorch.nn.Linear against torch.nn.Linear: forward, gradients, training, state."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import ramtorch
import ramtorch.nn as rnn
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def twins(i: int, o: int, bias: bool, dtype: torch.dtype, device: str, seed: int = 0):
    torch.manual_seed(seed)
    ref = nn.Linear(i, o, bias=bias, dtype=dtype)
    torch.manual_seed(seed)
    ours = rnn.Linear(i, o, bias=bias, dtype=dtype)
    return ref.to(device), ours.to(device)


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    tol = TOL[dtype] * scale
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(), rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    i=st.integers(1, 48),
    o=st.integers(1, 48),
    lead=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    bias=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    transpose=st.booleans(),
)
def test_forward_and_gradients_match_nn_linear(device, i, o, lead, bias, dtype, transpose):
    ref, ours = twins(i, o, bias, dtype, device)
    assert torch.equal(ref.weight.cpu(), ours.weight), "same initialisation as nn.Linear"
    x = torch.randn(*lead, i, dtype=dtype, device=device)
    if transpose and x.dim() >= 2:  # non-contiguous input
        x = x.transpose(0, -1).contiguous().transpose(0, -1)
    xr = x.detach().clone().requires_grad_()
    xo = x.detach().clone().requires_grad_()
    yr, yo = ref(xr), ours(xo)
    assert yo.shape == yr.shape and yo.dtype == yr.dtype and yo.device == yr.device
    close(yr, yo, dtype)
    g = torch.randn_like(yr)
    yr.backward(g)
    yo.backward(g)
    close(xr.grad, xo.grad, dtype, scale=4)
    close(ref.weight.grad, ours.weight.grad, dtype, scale=4)
    assert ours.weight.grad.device.type == "cpu" and ours.weight.grad.dtype == dtype
    if bias:
        close(ref.bias.grad, ours.bias.grad, dtype, scale=4)


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_accumulate_over_backwards_and_zero_grad(device):
    ref, ours = twins(16, 8, True, torch.float32, device)
    for _ in range(3):
        x = torch.randn(5, 16, device=device)
        ref(x).pow(2).sum().backward()
        ours(x).pow(2).sum().backward()
        close(ref.weight.grad, ours.weight.grad, torch.float32)
        close(ref.bias.grad, ours.bias.grad, torch.float32)
    for set_to_none in (True, False):
        ref.zero_grad(set_to_none=set_to_none)
        ours.zero_grad(set_to_none=set_to_none)
        x = torch.randn(5, 16, device=device)
        ref(x).sum().backward()
        ours(x).sum().backward()
        close(ref.weight.grad, ours.weight.grad, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_layer_used_twice_in_one_graph(device):
    ref, ours = twins(12, 12, True, torch.float32, device)
    x = torch.randn(3, 12, device=device)
    ref(torch.tanh(ref(x))).sum().backward()
    ours(torch.tanh(ours(x))).sum().backward()
    close(ref.weight.grad, ours.weight.grad, torch.float32)
    close(ref.bias.grad, ours.bias.grad, torch.float32)


def test_cpu_autocast_bf16():
    ref, ours = twins(32, 16, True, torch.float32, "cpu")
    x = torch.randn(4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yr, yo = ref(x), ours(x)
    assert yo.dtype == yr.dtype == torch.bfloat16
    close(yr, yo, torch.bfloat16)
    yr.float().sum().backward()
    yo.float().sum().backward()
    assert ours.weight.grad.dtype == torch.float32
    close(ref.weight.grad, ours.weight.grad, torch.bfloat16, scale=2)


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_and_frozen_weights_skip_gradient_traffic(device):
    _, ours = twins(8, 8, True, torch.float32, device)
    eng = lambda: ramtorch.stats()["devices"][str(ours.compute_device)]  # noqa: E731
    x = torch.randn(2, 8, device=device, requires_grad=True)
    with torch.no_grad():
        ours(x)
    before = eng()["d2h_copies"]
    ours.requires_grad_(False)
    ours(x).sum().backward()
    assert eng()["d2h_copies"] == before
    assert ours.weight.grad is None and x.grad is not None


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_hooks_run(device):
    ref, ours = twins(6, 4, True, torch.float32, device)
    seen = []
    for m in (ref, ours):
        m.weight.register_hook(lambda g: g * 3)
        m.bias.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    x = torch.randn(2, 6, device=device)
    ref(x).sum().backward()
    ours(x).sum().backward()
    close(ref.weight.grad, ours.weight.grad, torch.float32)
    assert len(seen) == 2
    close(seen[0], seen[1], torch.float32)


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 32, layers: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(
                nn.ModuleDict(
                    {
                        "norm": nn.LayerNorm(d),
                        # No qkv bias: the key bias has an exactly-zero gradient (softmax ignores a
                        # shift of all keys), so Adam would amplify rounding noise in it.
                        "qkv": nn.Linear(d, 3 * d, bias=False),
                        "proj": nn.Linear(d, d),
                        "up": nn.Linear(d, 4 * d),
                        "down": nn.Linear(4 * d, d, bias=False),
                    }
                )
            )
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for b in self.blocks:
            q, k, v = b["qkv"](b["norm"](h)).chunk(3, dim=-1)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + b["proj"](a)
            h = h + b["down"](torch.nn.functional.gelu(b["up"](h)))
        return self.head(h)


@pytest.mark.parametrize("device", DEVICES)
def test_replace_linear_and_twenty_adamw_steps_match(device):
    torch.manual_seed(0)
    ref = TinyLM().to(device)
    ours = copy.deepcopy(ref)
    ramtorch.replace_linear(ours, skip=("blocks.1.proj",))
    kinds = {n: type(m).__name__ for n, m in ours.named_modules()}
    assert kinds["blocks.0.qkv"] == "Linear" and isinstance(ours.blocks[0]["qkv"], rnn.Linear)
    assert not isinstance(ours.blocks[1]["proj"], rnn.Linear)
    assert ours.blocks[0]["qkv"].weight.device.type == "cpu"
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt_o = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        idx = torch.randint(0, 50, (4, 16), generator=gen).to(device)
        tgt = torch.randint(0, 50, (4, 16), generator=gen).to(device)
        losses = []
        for model, opt in ((ref, opt_r), (ours, opt_o)):
            loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), tgt.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    # Losses agree to 1e-5 (above). Parameters: on CPU the kernels are the same as nn.Linear's; on
    # CUDA a gradient reduction may sum in another order, and Adam (update ~ lr * sign for tiny
    # gradients) turns last-bit differences into larger ones, so the parameter check is looser there.
    atol = 1e-6 if device == "cpu" else 5e-5
    for (n, pr), po in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(pr.detach().cpu(), po.detach().cpu(), rtol=1e-5, atol=atol, msg=n)


def test_replace_linear_keeps_tied_and_attention_layers():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight

    m = Tied()
    with pytest.warns(UserWarning, match="head"):
        ramtorch.replace_linear(m)
    assert m.head.weight is m.emb.weight
    assert not isinstance(m.attn.out_proj, rnn.Linear)
    small = ramtorch.replace_linear(nn.Sequential(nn.Linear(4, 4), nn.Linear(64, 64)), min_params=100)
    assert not isinstance(small[0], rnn.Linear) and isinstance(small[1], rnn.Linear)
    assert isinstance(ramtorch.replace_linear(nn.Linear(3, 3)), rnn.Linear)


@pytest.mark.parametrize("device", DEVICES)
def test_weight_changes_between_steps_are_seen(device):
    ref, ours = twins(10, 10, True, torch.float32, device)
    x = torch.randn(3, 10, device=device)
    ours(x).sum().backward()
    with torch.no_grad():
        ours.weight.mul_(2)
        ref.weight.mul_(2)
    close(ref(x), ours(x), torch.float32)
    ours.weight.data.add_(1.0)  # an edit no version counter sees: needs synchronize()
    ref.weight.data.add_(1.0)
    ramtorch.synchronize()
    close(ref(x), ours(x), torch.float32)
    ours.load_state_dict(ref.state_dict())
    close(ref(x), ours(x), torch.float32)
    ours.weight = nn.Parameter(torch.ones(10, 10))  # a new Parameter: moved into the arena
    ref.weight = nn.Parameter(torch.ones(10, 10, device=device))
    close(ref(x), ours(x), torch.float32)
    assert ours._is_home()


def test_state_dict_save_load_deepcopy_pickle():
    _, ours = twins(7, 5, True, torch.float32, "cpu")
    sd = ours.state_dict()
    assert set(sd) == {"weight", "bias"}
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    other = rnn.Linear(7, 5)
    other.load_state_dict(loaded)
    assert torch.equal(other.weight, ours.weight) and other._is_home()
    for clone in (copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))):
        assert torch.equal(clone.weight, ours.weight)
        assert clone.weight.data_ptr() != ours.weight.data_ptr() and clone._is_home()
        x = torch.randn(2, 7)
        torch.testing.assert_close(clone(x), ours(x))
    whole = io.BytesIO()
    torch.save(nn.Sequential(ours), whole)
    whole.seek(0)
    back = torch.load(whole, weights_only=False)
    assert torch.equal(back[0].weight, ours.weight) and back[0]._is_home()


def test_dtype_conversions_stay_in_the_arena():
    ref, ours = twins(16, 16, True, torch.float32, "cpu")
    ours(torch.randn(2, 16)).sum().backward()
    for conv, dt in (
        (lambda m: m.half(), torch.float16),
        (lambda m: m.bfloat16(), torch.bfloat16),
        (lambda m: m.to(torch.float64), torch.float64),
        (lambda m: m.float(), torch.float32),
    ):
        before = ramtorch.stats()["host"]["regions"]
        conv(ours)
        assert ours.weight.dtype == ours.bias.dtype == dt and ours._is_home()
        assert ours.weight.grad.dtype == dt
        assert ramtorch.stats()["host"]["regions"] >= before - 3
        torch.testing.assert_close(ours.weight.float(), ref.weight.float(), rtol=1e-2, atol=1e-2)
    ours.share_memory()  # must not move the weights out of the arena
    assert ours._is_home()


def test_grads_are_arena_memory_after_zero_grad():
    _, ours = twins(256, 256, True, torch.float32, "cpu")
    x = torch.randn(4, 256)
    ours(x).sum().backward()
    ours.zero_grad()
    used = ramtorch.stats()["host"]["in_use_bytes"]
    ours(x).sum().backward()
    assert ramtorch.stats()["host"]["in_use_bytes"] - used >= 256 * 257 * 4


def test_layers_prefetch_their_learned_successors_and_relearn():
    torch.manual_seed(0)
    refs = [nn.Linear(12, 12) for _ in range(5)]
    ours = [rnn.Linear.from_linear(r) for r in refs]
    x = torch.randn(4, 12)
    before = dict(ramtorch._engine.engine_for(torch.device("cpu")).layer_counters)
    for order in ([0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [4, 2, 0, 1, 3], [4, 2, 0, 1, 3], [0, 1, 2, 3, 4]):
        a, b = x, x
        for i in order:
            a, b = torch.tanh(refs[i](a)), torch.tanh(ours[i](b))
        close(a, b, torch.float32)
        a.square().sum().backward()
        b.square().sum().backward()
        for r, o in zip(refs, ours):
            close(r.weight.grad, o.weight.grad, torch.float32)
    after = ramtorch._engine.engine_for(torch.device("cpu")).layer_counters
    assert after["prefetch_hits"] > before["prefetch_hits"]
    assert after["prefetch_wasted"] > before["prefetch_wasted"]  # the order changed twice


def test_a_stack_of_layers_prefetches_along_its_itinerary_on_the_second_pass():
    """The layers of a stack share their device's streamer: the first pass learns their order,
    the second finds the next layers' weights already copied (prefetch hits), forward and backward,
    and matches torch."""
    torch.manual_seed(0)
    refs = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
    ours = nn.Sequential(*[rnn.Linear.from_linear(r) for r in refs])
    counters = ramtorch._engine.engine_for(torch.device("cpu")).layer_counters
    x = torch.randn(3, 16)
    ours(x).sum().backward()
    refs(x).sum().backward()
    before = dict(counters)
    with torch.no_grad():
        close(refs(x), ours(x), torch.float32)
    assert counters["prefetch_hits"] - before["prefetch_hits"] >= 4
    before = dict(counters)
    ours(x).sum().backward()
    refs(x).sum().backward()
    assert counters["prefetch_hits"] - before["prefetch_hits"] >= 8
    for r, o in zip(refs, ours):
        close(r.weight.grad, o.weight.grad, torch.float32)
        close(r.bias.grad, o.bias.grad, torch.float32)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize(("fin", "fout"), [(0, 4), (4, 0), (0, 0)])
def test_zero_feature_linear_matches_torch(fin: int, fout: int) -> None:
    torch.manual_seed(0)
    ref = nn.Linear(fin, fout)
    layer = rnn.Linear.from_linear(ref)
    x = torch.randn(2, 3, fin)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    ys = [m(v) for m, v in zip((layer, ref), xs)]
    torch.testing.assert_close(ys[0], ys[1])
    for y in ys:
        (y.sum() * 2).backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad)
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad)
