"""ramtorch.offload against the same model unstreamed: forward, gradients, optimizer steps, budget,
itinerary, telemetry, checkpointing, torch.compile, trace."""

from __future__ import annotations

import copy
import json

import pytest
import ramtorch
import ramtorch.nn as rnn
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ramtorch._offload import parse_bytes, plan
from torch import nn
from torch.utils.checkpoint import checkpoint

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TOL = {torch.float32: 2e-5, torch.float64: 1e-10, torch.bfloat16: 3e-2}


class Block(nn.Module):
    """Pre-norm transformer block with torch's MultiheadAttention (it reads its out_proj's weight
    directly, not through out_proj's forward) and a GELU MLP. No attention biases: the key bias
    has a zero gradient in exact arithmetic, and Adam would amplify the rounding noise in it."""

    def __init__(self, d: int, heads: int, ckpt: bool = False) -> None:
        super().__init__()
        self.n1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True, bias=False)
        self.n2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 3 * d)
        self.down = nn.Linear(3 * d, d)
        self.ckpt = ckpt

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.n2(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.n1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        if self.ckpt:
            return x + checkpoint(self._mlp, x, use_reentrant=False)
        return x + self._mlp(x)


class TinyLM(nn.Module):
    """Embedding tied to the output head, blocks in a ModuleList, final norm."""

    def __init__(
        self,
        vocab: int = 37,
        d: int = 16,
        layers: int = 4,
        heads: int = 2,
        ckpt: bool = False,
        outer: bool = False,
    ) -> None:
        super().__init__()
        self.outer_ckpt = outer
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(64, d) * 0.02)
        self.blocks = nn.ModuleList([Block(d, heads, ckpt) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.order: list[int] | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids) + self.pos[: ids.shape[1]]
        order = self.order if self.order is not None else range(len(self.blocks))
        for i in order:
            if self.outer_ckpt:
                x = checkpoint(self.blocks[i], x, use_reentrant=False)
            else:
                x = self.blocks[i](x)
        return self.head(self.norm(x))


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, groups=2), nn.BatchNorm2d(8), nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
        )  # fmt: skip
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def twins(make, device: str, dtype: torch.dtype = torch.float32, seed: int = 0, **kw):
    torch.manual_seed(seed)
    ref = make().to(dtype)
    ours = copy.deepcopy(ref)
    ref.to(device)
    ramtorch.offload(ours, device=device, **kw)
    return ref, ours


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> None:
    tol = TOL[dtype] * scale
    torch.testing.assert_close(a.detach().float().cpu(), b.detach().float().cpu(), rtol=tol, atol=tol)


def compare_grads(
    ref: nn.Module, ours: nn.Module, dtype: torch.dtype = torch.float32, scale: float = 1.0
) -> None:
    for (name, p), (_, q) in zip(ref.named_parameters(), ours.named_parameters()):
        if p.grad is None:
            assert q.grad is None, name
            continue
        assert q.grad is not None, f"{name} has no gradient"
        close(p.grad, q.grad, dtype, scale)


def train(model: nn.Module, batches, steps: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for ids in batches[:steps]:
        loss = model(ids).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def model_stats(model: nn.Module) -> dict:
    return model._ramtorch_streamer.stats()


# -- correctness ---------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    d=st.sampled_from([8, 12, 16]),
    layers=st.integers(2, 5),
    seq=st.integers(1, 9),
    batch=st.integers(1, 3),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    budget_blocks=st.sampled_from([None, 0, 1, 3]),
)
def test_transformer_forward_and_gradients_match(device, d, layers, seq, batch, dtype, budget_blocks):
    if budget_blocks is None:
        budget = None
    else:
        probe, _ = twins(lambda: TinyLM(d=d, layers=layers), "cpu", dtype)
        block = sum(p.numel() * p.element_size() for p in probe.blocks[0].parameters()) + 1024
        budget = 64 * 1024 + (3 + budget_blocks) * block
    ref, ours = twins(lambda: TinyLM(d=d, layers=layers), device, dtype, gpu_budget=budget)
    ids = torch.randint(0, 37, (batch, seq), device=device)
    close(ref(ids), ours(ids), dtype)
    ref(ids).square().mean().backward()
    ours(ids).square().mean().backward()
    compare_grads(ref, ours, dtype)
    for name, p in ours.named_parameters():
        streamed = "blocks" in name and name.split(".")[1] not in model_stats(ours)["resident_units"]
        if streamed and not any(name.startswith(r + ".") for r in model_stats(ours)["resident_units"]):
            assert p.device.type == "cpu", name


@pytest.mark.parametrize("device", DEVICES)
def test_training_steps_match_torch(device):
    ref, ours = twins(TinyLM, device)
    batches = [torch.randint(0, 37, (2, 8), device=device) for _ in range(6)]
    a = train(ref, batches, 6)
    b = train(ours, batches, 6)
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)
    for (name, p), (_, q) in zip(ref.named_parameters(), ours.named_parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=1e-4, atol=5e-5, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_cnn_with_batchnorm_buffers(device):
    ref, ours = twins(TinyCNN, device)
    x = torch.randn(4, 3, 8, 8, device=device)
    for _ in range(2):
        close(ref(x), ours(x))
        ref(x).square().mean().backward()
        ours(x).square().mean().backward()
    compare_grads(ref, ours)
    for (_, b), (_, c) in zip(ref.named_buffers(), ours.named_buffers()):
        close(b, c) if b.is_floating_point() else torch.testing.assert_close(b.cpu(), c.cpu())
    ref.eval(), ours.eval()
    close(ref(x), ours(x))


@pytest.mark.parametrize("device", DEVICES)
def test_order_change_is_relearned_without_wrong_results(device):
    ref, ours = twins(lambda: TinyLM(layers=5), device)
    ids = torch.randint(0, 37, (2, 6), device=device)
    orders = [None, None, [4, 3, 2, 1, 0], [4, 3, 2, 1, 0], [0, 2, 4], None]
    for order in orders:
        ref.order = ours.order = order
        ref.zero_grad(), ours.zero_grad()
        close(ref(ids), ours(ids))
        ref(ids).square().mean().backward()
        ours(ids).square().mean().backward()
        compare_grads(ref, ours)
        want = [f"blocks.{i}" for i in (order if order is not None else range(5))]
        assert [n for n in model_stats(ours)["itinerary"] if n.startswith("blocks")] == want
    s = model_stats(ours)
    assert s["prefetch_hits"] > 0 and s["prefetch_wasted"] > 0


def test_mixed_requires_grad_and_frozen_blocks():
    ref, ours = twins(TinyLM, "cpu")
    for m in (ref, ours):
        for p in m.blocks[1].parameters():
            p.requires_grad_(False)
        m.emb.weight.requires_grad_(False)
    ids = torch.randint(0, 37, (2, 5))
    ref(ids).square().mean().backward()
    ours(ids).square().mean().backward()
    compare_grads(ref, ours)
    assert all(p.grad is None for p in ours.blocks[1].parameters())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["inside", "around"])
def test_activation_checkpointing_gives_the_same_gradients(device, where):
    ref, ours = twins(lambda: TinyLM(ckpt=where == "inside", outer=where == "around"), device)
    ids = torch.randint(0, 37, (3, 7), device=device)
    ref(ids).square().mean().backward()
    ours(ids).square().mean().backward()
    compare_grads(ref, ours)


def test_gradient_accumulation_and_no_grad_forward():
    ref, ours = twins(TinyLM, "cpu")
    ids = [torch.randint(0, 37, (2, 5)) for _ in range(3)]
    for x in ids:
        ref(x).square().mean().backward()
        ours(x).square().mean().backward()
        with torch.no_grad():
            close(ref(x), ours(x))
    compare_grads(ref, ours)


def test_torch_compile_runs_and_matches():
    ref, ours = twins(TinyLM, "cpu")
    compiled = torch.compile(ours, backend="aot_eager")
    ids = torch.randint(0, 37, (2, 6))
    close(ref(ids), compiled(ids))
    ref(ids).square().mean().backward()
    compiled(ids).square().mean().backward()
    compare_grads(ref, ours)


def test_state_dict_round_trip_and_load_in_place():
    ref, ours = twins(TinyLM, "cpu")
    ids = torch.randint(0, 37, (2, 5))
    ours(ids)  # fills the slots: stale copies must not be reused after the load below
    other = TinyLM()
    ours.load_state_dict(other.state_dict())
    close(other(ids), ours(ids))
    sd = ours.state_dict()
    assert all(v.device.type in ("cpu", "cuda") for v in sd.values())
    ref.load_state_dict({k: v.cpu() for k, v in sd.items()})
    close(ref(ids), ours(ids))


def test_a_forward_that_raises_leaves_the_model_usable():
    ref, ours = twins(TinyLM, "cpu")
    with pytest.raises(IndexError):
        ours(torch.full((1, 3), 99))  # out of the vocabulary: the embedding raises
    with pytest.raises(RuntimeError):
        ours(torch.randint(0, 37, (1, 100)))  # longer than the position table
    ids = torch.randint(0, 37, (2, 4))
    close(ref(ids), ours(ids))
    assert all(isinstance(p, nn.Parameter) for p in ours.parameters())


def test_pass_and_unit_states_settle_between_passes():
    """Between passes every streamed unit holds nothing (HOME, or PREFETCHED after an inference
    pass, which prefetches the next one's first units). A forward interrupted by Ctrl-C (which
    skips torch's post-hooks) leaves its unit in FORWARD until the next pass begins and releases
    it; training then matches torch."""
    from ramtorch._stream.streamer import PassState
    from ramtorch._stream.units import UnitState

    ref, ours = twins(TinyLM, "cpu")
    s = ours._ramtorch_streamer
    params = list(ours.parameters())
    ids = torch.randint(0, 37, (2, 5))

    def states() -> set:
        return {s.unit_state(u) for u in s.streamed}

    ours(ids).square().mean().backward()
    assert s.state is PassState.IDLE and states() == {UnitState.HOME}
    with torch.no_grad():
        ours(ids)
    assert s.state is PassState.IDLE and states() <= {UnitState.HOME, UnitState.PREFETCHED}

    def interrupt(*_):
        raise KeyboardInterrupt

    handle = ours.blocks[2].attn.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        ours(ids)
    handle.remove()
    assert PassState.FORWARD in s.state
    assert UnitState.FORWARD in s.unit_state(ours.blocks[2]._ramtorch_unit)

    for p in params:
        p.grad = None
    close(ref(ids), out := ours(ids))
    assert s.state is PassState.IDLE and states() <= {UnitState.HOME, UnitState.PREFETCHED}
    ref(ids).square().mean().backward()
    out.square().mean().backward()
    compare_grads(ref, ours)
    assert s.state is PassState.IDLE and states() == {UnitState.HOME}


# -- budget --------------------------------------------------------------------------------------


def block_bytes(model: TinyLM) -> int:
    return model._ramtorch_streamer.by_uid[0].nbytes


def test_budget_keeps_k_blocks_resident_and_streams_the_rest():
    torch.manual_seed(0)
    probe = TinyLM(layers=6, d=32)
    ramtorch.offload(probe, device="cpu")
    s0 = model_stats(probe)
    blk = block_bytes(probe)
    fixed = s0["resident_bytes"]
    for k in (0, 2, 4):
        torch.manual_seed(0)
        m = TinyLM(layers=6, d=32)
        budget = fixed + 4096 + 2 * 3 * blk + k * blk  # small units + 3 slots + k blocks
        ramtorch.offload(m, gpu_budget=budget, device="cpu")
        s = model_stats(m)
        blocks_resident = [n for n in s["resident_units"] if n.startswith("blocks")]
        assert len(blocks_resident) >= k
        assert s["gpu_bytes"] <= budget
        n_stream = 6 - len(blocks_resident)
        assert s["streamed_bytes_per_pass"] <= n_stream * blk + 4096
        before = ramtorch.stats()["devices"]["cpu"]["h2d_bytes"]
        with torch.no_grad():
            m(torch.randint(0, 37, (1, 4)))
        moved = ramtorch.stats()["devices"]["cpu"]["h2d_bytes"] - before
        assert moved == s["streamed_bytes_per_pass"]


def test_budget_too_small_names_the_minimum():
    m = TinyLM(layers=3, d=32)
    with pytest.raises(ValueError, match="at least"):
        ramtorch.offload(m, gpu_budget="1KiB", device="cpu")
    assert all(p.device.type == "cpu" for p in m.parameters())
    assert not hasattr(m, "_ramtorch_streamer") or m._ramtorch_streamer is None


def test_budget_planner_properties():
    sizes = [100, 100, 100, 100, 500]
    p = plan(sizes, [], None, 2)
    assert (p.slots, p.slot_bytes, p.resident) == (3, 512, [])
    # The 500-byte unit resident shrinks the slots: more fits.
    p = plan(sizes, [], 500 + 3 * 128, 2)
    assert 4 in p.resident and p.slot_bytes == 128
    assert p.resident_bytes + p.slots * p.slot_bytes <= 500 + 3 * 128
    p = plan(sizes, [], 10_000, 2)
    assert p.streamed_bytes == 0 and p.slots == 0
    with pytest.raises(ValueError, match="at least"):
        plan(sizes, [], 100, 2)


def test_resident_blocks_are_spread_along_the_model():
    from ramtorch._offload import spread_resident

    sizes = [10] * 8 + [3]
    assert spread_resident(sizes, {0, 1}, set()) == {2, 6}
    assert spread_resident(sizes, {0, 1, 2, 3, 8}, set()) == {1, 3, 5, 7, 8}
    assert spread_resident(sizes, set(range(9)), set()) == set(range(9))
    assert spread_resident([10, 10, 10], {0}, {0}) == {0}  # forced units stay


def test_parse_bytes():
    assert parse_bytes("24GiB") == 24 << 30
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes(1234) == 1234
    assert parse_bytes(None) is None
    for bad in ("lots", "-1GiB", "12 parsecs"):
        with pytest.raises(ValueError, match="gpu_budget"):
            parse_bytes(bad, "gpu_budget")
    with pytest.raises(TypeError):
        parse_bytes(True)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(TypeError, match="nn.Module"):
        ramtorch.offload("model")  # type: ignore[arg-type]
    m = TinyLM()
    with pytest.raises(TypeError, match="unit="):
        ramtorch.offload(m, unit=3, device="cpu")
    with pytest.raises(ValueError, match="no module"):
        ramtorch.offload(m, unit="NoSuchBlock", device="cpu")
    ramtorch.offload(m, unit=Block, device="cpu")
    with pytest.raises(RuntimeError, match="already offloaded"):
        ramtorch.offload(m, device="cpu")
    assert m.to("cpu") is m  # its compute device: nothing moves
    with pytest.raises(RuntimeError, match="cannot be moved or converted"):
        m.double()
    sparse = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"^ramtorch.offload: 0 is an Embedding with sparse=True"):
        ramtorch.offload(sparse, device="cpu")


class SparseLookup(nn.Module):
    """A table read with ``F.embedding(..., sparse=True)``: its gradient is sparse."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4))

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        return F.embedding(i, self.table, sparse=True)


def test_a_sparse_gradient_of_a_streamed_weight_is_a_clear_error():
    model = nn.Sequential(SparseLookup(), nn.Linear(4, 4))
    ramtorch.offload(model, device="cpu")
    with pytest.raises(RuntimeError, match="streamed parameter of shape \\(10, 4\\) got a torch.sparse_coo"):
        model(torch.tensor([1, 2, 3])).sum().backward()
    # The model is still usable once the sparse read is gone.
    model[0].forward = lambda i: F.embedding(i, model[0].table)  # type: ignore[method-assign]
    model(torch.tensor([1, 2, 3])).sum().backward()
    assert model[0].table.grad is not None and model[0].table.grad.layout == torch.strided


# -- telemetry -------------------------------------------------------------------------------------


def test_telemetry_counts_add_up():
    ref, ours = twins(lambda: TinyLM(layers=4), "cpu")
    s = model_stats(ours)
    streamer = ours._ramtorch_streamer
    streamed = [u for u in streamer.units if not u.resident]
    dev0 = dict(ramtorch.stats()["devices"]["cpu"])
    ids = torch.randint(0, 37, (2, 5))
    ours(ids).square().mean().backward()
    dev1 = ramtorch.stats()["devices"]["cpu"]
    grad_bytes = sum(p.numel() * p.element_size() for u in streamed for p in u.params)
    assert dev1["d2h_bytes"] - dev0["d2h_bytes"] == grad_bytes
    copied = dev1["h2d_bytes"] - dev0["h2d_bytes"]
    reused = dev1["reused_bytes"] - dev0["reused_bytes"]
    # First step, nothing learned yet (no prefetch): forward takes every streamed unit once and
    # backward once more, each take a copy or a reuse of a slot that still held the unit.
    assert copied + reused == 2 * s["streamed_bytes_per_pass"]
    assert reused > 0  # the last units of the forward pass start the backward pass without a copy
    assert dev1["h2d_gbps"] > 0 and dev1["d2h_gbps"] > 0
    assert dev1["stall_seconds"] >= 0


def test_trace_writes_a_chrome_trace(tmp_path):
    _, ours = twins(TinyLM, "cpu")
    ids = torch.randint(0, 37, (2, 5))
    path = tmp_path / "step.json"
    with ramtorch.trace(path):
        ours(ids).square().mean().backward()
    data = json.loads(path.read_text())
    names = [e["name"] for e in data["traceEvents"] if e["ph"] == "X"]
    assert any(n.startswith("h2d blocks.0") for n in names)
    assert any(n.startswith("d2h blocks.3") for n in names)
    assert any(n == "forward blocks.2" for n in names)
    assert any(n == "backward blocks.1" for n in names)
    assert all(e["dur"] >= 0 for e in data["traceEvents"] if e["ph"] == "X")


# -- per-layer Embedding and Conv2d -------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_embedding_and_conv2d_layers_match_torch(device):
    torch.manual_seed(0)
    emb = rnn.Embedding(11, 6, padding_idx=0, device=device)
    conv = rnn.Conv2d(3, 4, 3, stride=2, padding=1, device=device)
    r_emb, r_conv = nn.Embedding(11, 6, padding_idx=0), nn.Conv2d(3, 4, 3, stride=2, padding=1)
    r_emb.load_state_dict(emb.state_dict())
    r_conv.load_state_dict(conv.state_dict())
    r_emb.to(device), r_conv.to(device)
    assert emb.weight.device.type == "cpu" and conv.weight.device.type == "cpu"
    ids = torch.tensor([[0, 3, 3, 10]], device=device)
    x = torch.randn(2, 3, 9, 9, device=device, requires_grad=True)
    for a, b, inp in ((emb, r_emb, ids), (conv, r_conv, x)):
        close(a(inp), b(inp))
        a(inp).square().sum().backward()
        b(inp).square().sum().backward()
        compare_grads(b, a)
    c2 = copy.deepcopy(conv)
    close(c2(x), r_conv(x))


def test_a_stack_of_conv2d_layers_prefetches_and_survives_an_interrupt():
    """Per-layer Conv2d and Embedding share their device's streamer with per-layer Linear: a
    second pass over a stack finds the next layers prefetched, a Ctrl-C inside one layer's forward
    (which skips torch's forward hooks) leaves nothing held once the next forward runs, and
    training matches torch."""
    torch.manual_seed(0)
    refs = nn.Sequential(*[nn.Conv2d(4, 4, 3, padding=1) for _ in range(5)])
    ours = nn.Sequential(*[rnn.Conv2d(4, 4, 3, padding=1) for _ in range(5)])
    ours.load_state_dict(refs.state_dict())
    counters = ramtorch._engine.engine_for(torch.device("cpu")).layer_counters
    x = torch.randn(2, 4, 6, 6)
    with torch.no_grad():
        ours(x)
        before = dict(counters)
        close(refs(x), ours(x))
    assert counters["prefetch_hits"] - before["prefetch_hits"] >= 3

    def interrupt(*_):
        raise KeyboardInterrupt

    params = list(ours.parameters())
    handle = ours[2].register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        ours(x).sum().backward()
    handle.remove()
    assert all(p.grad is None for p in params)
    for _ in range(2):
        refs(x).square().mean().backward()
        ours(x).square().mean().backward()
    compare_grads(refs, ours)
    streamer = ours[0]._layer_streamer
    assert streamer.held == 0 and not any(u.fwd for u in streamer.units)


def test_progress_bar_when_moving_into_host_ram(capsys):
    m = TinyLM()
    ramtorch.offload(m, device="cpu", progress=True)
    err = capsys.readouterr().err
    assert "ramtorch.offload" in err


def test_several_offloaded_models_share_the_device_slots():
    """Slots belong to the device's engine: models (and per-layer prefetches) that hold speculative
    prefetches must give them back to whoever needs a slot."""
    pairs = [twins(lambda: TinyLM(layers=3), "cpu", seed=s) for s in range(3)]
    ids = torch.randint(0, 37, (2, 5))
    for _ in range(3):
        for ref, ours in pairs:
            with torch.no_grad():
                close(ref(ids), ours(ids))  # inference passes leave prefetches for the next one
        for ref, ours in pairs:
            ref(ids).square().mean().backward()
            ours(ids).square().mean().backward()
            compare_grads(ref, ours)


def test_a_larger_model_after_an_idle_one_gets_new_slots():
    """A pass that raised can leave prefetches of the units it did not reach, which hold slots. A
    second model with larger units makes the device's slots grow: the idle model's prefetches are
    given back instead of the larger model failing (``cannot replace device slots``)."""
    small = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    ramtorch.offload(small, device="cpu", unit=nn.Linear)

    def fail(*_: object) -> None:
        raise ValueError("injected")

    with torch.no_grad():
        small(torch.randn(2, 8))  # learns the itinerary
        handle = small[1].register_forward_pre_hook(fail)
        with pytest.raises(ValueError, match="injected"):
            small(torch.randn(2, 8))
        handle.remove()
    assert small._ramtorch_streamer.ahead  # the unit after the one that raised is on its way
    big = nn.Sequential(*[nn.Linear(64, 64) for _ in range(3)])
    ref = copy.deepcopy(big)
    ramtorch.offload(big, device="cpu", unit=nn.Linear)
    x = torch.randn(2, 64)
    with torch.no_grad():
        torch.testing.assert_close(big(x), ref(x))
        assert small(torch.ones(2, 8)).shape == (2, 8)


class TakesTwo(nn.Module):
    """A block called with a second input it does not use."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(TakesTwo() for _ in range(2))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x, y)
        return x


def test_an_input_a_unit_does_not_use_gets_no_gradient():
    """As in torch: None, not zeros (it used to get zeros through the unit's input wrapper)."""
    ref, ours = twins(TwoInputs, "cpu")
    for model in (ref, ours):
        x, y = torch.randn(2, 4, requires_grad=True), torch.randn(2, 4, requires_grad=True)
        model(x, y).sum().backward()
        assert x.grad is not None and y.grad is None


def test_shallow_copying_or_pickling_an_offloaded_model_is_a_clear_error(tmp_path):
    """A shallow copy would share the engine, hooks and units of the model, and a pickle cannot
    hold them; the error says how to copy the weights instead (a deep copy is a model of its own:
    tests/test_copy.py)."""
    import pickle

    from ramtorch._offload import detach_streamer

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    ramtorch.offload(model, device="cpu")
    for attempt in (copy.copy, pickle.dumps, lambda m: torch.save(m, tmp_path / "m.pt")):
        with pytest.raises(TypeError, match="cannot be pickled or shallow-copied.*state_dict"):
            attempt(model)
    torch.save(model.state_dict(), tmp_path / "sd.pt")  # the weights save as usual
    detach_streamer(model)
    twin = copy.deepcopy(model)  # a plain model copies again
    x = torch.randn(2, 4)
    torch.testing.assert_close(twin(x), model(x))


@pytest.mark.parametrize("text", ["9" * 400, "9" * 300 + "TiB", "1e999"])
def test_huge_or_unparseable_budget_strings_are_a_value_error(text):
    with pytest.raises(ValueError, match="gpu_budget"):
        parse_bytes(text, "gpu_budget")
    with pytest.raises(ValueError, match="gpu_budget"):
        ramtorch.offload(nn.Sequential(nn.Linear(2, 2)), gpu_budget=text, device="cpu")
