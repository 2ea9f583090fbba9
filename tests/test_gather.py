"""Embedding tables streamed by rows (``ramtorch._stream.gather``): a lookup copies the distinct
rows it reads, and its backward adds their gradient into the rows of the table's dense ``.grad``.

They compute exactly what ``nn.Embedding`` computes (outputs, fresh and accumulated gradients,
``padding_idx``, ``scale_grad_by_freq``, ``max_norm``, optimizer steps, a transformers decoder
tied and untied); the bytes that cross per pass are the rows read; bad indices raise as
``nn.Embedding``'s do, naming the table. The CUDA counterpart is ``tests/test_gpu_gather.py``."""

from __future__ import annotations

import copy
import logging

import pytest
import ramtorch
import ramtorch.nn as rnn
import ramtorch.optim
import torch
from conftest import tiny_llama_config
from hypothesis import given, settings
from hypothesis import strategies as st
from ramtorch._stream import gather
from torch import nn

CPU = torch.device("cpu")


def _row_counters() -> dict[str, int]:
    return dict(ramtorch._engine.engine_for(CPU).row_counters)


class EmbedNet(nn.Module):
    """An input embedding, blocks and a head: the embedding is a unit of its own."""

    def __init__(self, vocab: int = 50, d: int = 8, **emb_kwargs: object) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, **emb_kwargs)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.head = nn.Linear(d, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def _pair(gather: bool = True, **emb_kwargs: object) -> tuple[EmbedNet, EmbedNet]:
    torch.manual_seed(0)
    ref = EmbedNet(**emb_kwargs)
    ours = ramtorch.offload(copy.deepcopy(ref), device="cpu", gather_rows=gather)
    return ref, ours


def _assert_same_grads(ref: nn.Module, ours: nn.Module) -> None:
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name


IDS = torch.tensor([[1, 3, 5, 5, 49], [3, 2, 1, 0, 7]])
OPTIONS = [
    {},
    {"padding_idx": 3},
    {"padding_idx": 40},  # a padding row that the lookups do not read
    {"scale_grad_by_freq": True},
    {"padding_idx": 5, "scale_grad_by_freq": True},
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_offloaded_embedding_matches_torch(options):
    """Outputs, gradients of one backward and gradients accumulated over two (no zero_grad in
    between) equal ``nn.Embedding``'s exactly; the table is streamed by rows."""
    ref, ours = _pair(**options)
    units = {u.name: u for u in ours._ramtorch_streamer.units}
    assert units["emb"].gather and not units["head"].gather
    for _ in range(2):
        y_ref, y = ref(IDS), ours(IDS)
        assert torch.equal(y_ref, y)
        y_ref.square().sum().backward()
        y.square().sum().backward()
        _assert_same_grads(ref, ours)
    g = ours.emb.weight.grad
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[IDS.unique()] = False
    assert not g[untouched].any()  # dense, zeros in the rows not read
    if "padding_idx" in options:
        assert not g[options["padding_idx"]].any()


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
def test_layer_embedding_matches_torch(options):
    """``ramtorch.nn.Embedding(gather_rows=True)`` is ``nn.Embedding``, with indices given on the
    CPU or on its device (here both are the CPU) and passed by keyword."""
    torch.manual_seed(0)
    ours = rnn.Embedding(50, 6, gather_rows=True, **options)
    ref = nn.Embedding(50, 6, **options)
    ref.load_state_dict(ours.state_dict())
    assert ours._ramtorch_unit.gather
    for _ in range(2):
        y_ref, y = ref(IDS), ours(input=IDS)
        assert torch.equal(y_ref, y)
        (y_ref * torch.arange(6.0)).sum().backward()
        (y * torch.arange(6.0)).sum().backward()
        assert torch.equal(ref.weight.grad, ours.weight.grad)


def test_two_forwards_in_one_backward_and_a_frozen_pass():
    """Two lookups of one table before one backward add up; a lookup under no_grad delivers
    nothing; a gradient hook on the table sees the whole (dense) gradient, as in torch."""
    ref, ours = _pair()
    other = torch.tensor([[49, 48, 1]])
    loss_ref = ref(IDS).sum() + ref(other).square().sum()
    loss = ours(IDS).sum() + ours(other).square().sum()
    with torch.no_grad():
        assert torch.equal(ref(other), ours(other))
    loss_ref.backward()
    loss.backward()
    _assert_same_grads(ref, ours)

    seen = []
    ours.emb.weight.register_hook(lambda g: seen.append(tuple(g.shape)))
    ref.emb.weight.register_hook(lambda g: None)
    ref(IDS).sum().backward()
    ours(IDS).sum().backward()
    assert seen == [(50, 8)]
    _assert_same_grads(ref, ours)


def test_max_norm_renormalises_the_rows_read_in_the_table():
    """``max_norm`` rewrites the rows a lookup reads, in the table, as ``nn.Embedding`` does."""
    ref, ours = _pair(max_norm=1.0)
    with torch.no_grad():
        ref.emb.weight.mul_(3)
        ours.emb.weight.mul_(3)
    for _ in range(2):
        y_ref, y = ref(IDS), ours(IDS)
        assert torch.equal(y_ref, y)
        y_ref.sum().backward()
        y.sum().backward()
        assert torch.equal(ref.emb.weight, ours.emb.weight)
        _assert_same_grads(ref, ours)


@pytest.mark.parametrize("which", ["torch", "ramtorch"])
def test_optimizer_steps_match(which):
    """Several AdamW steps (torch's, and ramtorch's which overlaps the updates with backward)
    reach the same weights as on the plain model."""
    ref, ours = _pair()
    if which == "torch":
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    else:
        opt_ref = ramtorch.optim.AdamW(ref.parameters(), lr=1e-2)
        opt = ramtorch.optim.AdamW(ours.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids = torch.randint(0, 50, (3, 7), generator=gen)
        for model, o in ((ref, opt_ref), (ours, opt)):
            model(ids).square().mean().backward()
            o.step()
            o.zero_grad()
    ramtorch.synchronize()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(p, q), name


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 40),
    dim=st.integers(1, 6),
    shape=st.lists(st.integers(0, 5), min_size=1, max_size=3),
    padding=st.one_of(st.none(), st.integers(-40, 39)),
    freq=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_match_torch(rows, dim, shape, padding, freq, seed):
    if padding is not None and not -rows <= padding < rows:
        padding = None
    torch.manual_seed(seed)
    ours = rnn.Embedding(rows, dim, padding_idx=padding, scale_grad_by_freq=freq, gather_rows=True)
    ref = nn.Embedding(rows, dim, padding_idx=padding, scale_grad_by_freq=freq)
    ref.load_state_dict(ours.state_dict())
    ids = torch.randint(0, rows, tuple(shape))
    w = torch.randn(*shape, dim)
    y_ref, y = ref(ids), ours(ids)
    assert torch.equal(y_ref, y)
    (y_ref * w).sum().backward()
    (y * w).sum().backward()
    assert torch.equal(ref.weight.grad, ours.weight.grad)


def test_bytes_per_pass_are_the_rows_read():
    """A pass copies the distinct rows it reads (forward) and sends their gradient back
    (backward); no device slot holds the table."""
    torch.manual_seed(0)
    vocab, d = 4096, 32
    ours = ramtorch.offload(EmbedNet(vocab, d), device="cpu", gather_rows=True)
    table = vocab * d * 4
    streamer = ours._ramtorch_streamer
    assert streamer.slot_bytes < table // 8
    eng = ramtorch._engine.engine_for(CPU)
    ids = torch.tensor([[7, 7, 100, 4095, 3], [3, 3, 3, 100, 9]])  # 5 distinct rows
    before, h2d = _row_counters(), eng.stats()["h2d_bytes"]
    ours(ids).sum().backward()
    after = _row_counters()
    assert after["row_lookups"] - before["row_lookups"] == 1
    assert after["rows_gathered"] - before["rows_gathered"] == 5
    assert after["row_h2d_bytes"] - before["row_h2d_bytes"] == 5 * d * 4
    assert after["row_d2h_bytes"] - before["row_d2h_bytes"] == 5 * d * 4
    # What the engine copied is the other units (forward and backward), never the table.
    assert eng.stats()["h2d_bytes"] - h2d <= 2 * streamer.stats()["streamed_bytes_per_pass"]
    stats = ramtorch.stats(ours)
    assert stats["gathered_units"] == ["emb"]
    assert stats["row_lookups"] == 1 and stats["gathered_bytes"] == 5 * d * 4
    assert stats["streamed_bytes_per_pass"] < table // 8


def test_rows_covering_most_of_a_small_table_copy_it_whole():
    """Where the slots hold the table, a lookup whose rows take half of it or more copies the
    whole table instead; both ways compute what torch computes."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 64), nn.Linear(64, 64))
    ours = ramtorch.offload(copy.deepcopy(ref), device="cpu", gather_rows=True)
    for ids, gathered in ((torch.arange(10), False), (torch.tensor([1, 1, 2]), True)):
        before = _row_counters()["row_lookups"]
        assert torch.equal(ref(ids), ours(ids))
        ref(ids).sum().backward()
        ours(ids).sum().backward()
        assert (_row_counters()["row_lookups"] - before == 2) == gathered
        _assert_same_grads(ref, ours)


def test_plan_gathers_large_tables_that_the_budget_does_not_hold(monkeypatch, caplog):
    """By default a table of at least RAMTORCH_GATHER_MIN_BYTES streams by rows, unless the budget
    keeps it resident after the other units; the plan log says which."""
    monkeypatch.setenv("RAMTORCH_GATHER_MIN_BYTES", "4KiB")
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="ramtorch"):
        big = ramtorch.offload(EmbedNet(64, 16), device="cpu")  # 4 KiB table
    assert [u.name for u in big._ramtorch_streamer.units if u.gather] == ["emb"]
    assert "embedding tables streamed by the rows each pass reads (emb (4.0 KiB))" in caplog.text
    small = ramtorch.offload(EmbedNet(63, 16), device="cpu")
    assert not any(u.gather for u in small._ramtorch_streamer.units)
    roomy = ramtorch.offload(EmbedNet(64, 16), device="cpu", gpu_budget="1MiB")
    assert not any(u.gather for u in roomy._ramtorch_streamer.units)
    assert "emb" in ramtorch.stats(roomy)["resident_units"]
    monkeypatch.setenv("RAMTORCH_GATHER_MIN_BYTES", "lots")
    with pytest.raises(ValueError, match="RAMTORCH_GATHER_MIN_BYTES"):
        ramtorch.offload(EmbedNet(), device="cpu")
    with pytest.raises(TypeError, match="gather_rows must be a bool or None"):
        ramtorch.offload(EmbedNet(), device="cpu", gather_rows="yes")  # type: ignore[arg-type]


def test_tied_and_subclassed_tables_keep_the_whole_table_path():
    """A table tied to another module's weight stays on the device, as before; a subclass of
    nn.Embedding with a forward of its own streams whole."""

    class Scaled(nn.Embedding):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) * 2.0

    class Tied(EmbedNet):
        def __init__(self) -> None:
            super().__init__(50, 8)
            self.out = nn.Linear(8, 50, bias=False)
            self.out.weight = self.emb.weight

    tied = ramtorch.offload(Tied(), device="cpu", gather_rows=True)
    assert not any(u.gather for u in tied._ramtorch_streamer.units)
    assert tied.emb.weight.device.type == "cpu"  # (the compute device here)
    model = nn.Sequential(Scaled(50, 8), nn.Linear(8, 2))
    ramtorch.offload(model, device="cpu", gather_rows=True)
    assert not any(u.gather for u in model._ramtorch_streamer.units)


def test_bad_indices_raise_naming_the_table():
    _, ours = _pair()
    layer = rnn.Embedding(5, 2, gather_rows=True)
    with pytest.raises(IndexError, match=r"embedding 'emb': index 50 is out of range for a table of 50 rows"):
        ours(torch.tensor([[1, 50]]))
    with pytest.raises(IndexError, match=r"index -1 is out of range"):
        ours(torch.tensor([[-1, 2]]))
    with pytest.raises(
        RuntimeError, match=r"embedding 'emb': indices must be .*torch.long.*got torch.float32"
    ):
        ours(torch.tensor([[1.0, 2.0]]))
    with pytest.raises(IndexError, match=r"^ramtorch.nn.Embedding: index 5 is out of range"):
        layer(torch.tensor([5]))
    with pytest.raises(TypeError, match="indices must be a torch.Tensor, got list"):
        layer([1, 2])
    with pytest.raises(TypeError, match="gather_rows must be a bool or None"):
        rnn.Embedding(5, 2, gather_rows=1)  # type: ignore[arg-type]
    # The failures left nothing behind: the next passes compute and train.
    ref, _ = _pair()
    assert torch.equal(ours(IDS), ref(IDS))
    ours(IDS).sum().backward()
    ref(IDS).sum().backward()
    _assert_same_grads(ref, ours)
    assert torch.equal(layer(torch.tensor([4])), layer.weight[4:5])


def test_interrupted_backward_writes_no_rows():
    """A backward that raises after the table's rows left for the host writes no ``.grad``; the
    next step is whole."""
    ref, ours = _pair()

    class Boom(Exception):
        pass

    def fail(_grad: torch.Tensor) -> None:
        raise Boom

    # Made before the model's forward, this branch's nodes run after the model's (autograd runs
    # later nodes first), so the failure comes once the table's rows have left.
    x = torch.ones(3, requires_grad=True)
    z = (x * 2).sum()
    z.register_hook(fail)
    before = _row_counters()["row_d2h_bytes"]
    with pytest.raises(Boom):
        (ours(IDS).sum() + z).backward()
    assert _row_counters()["row_d2h_bytes"] > before
    assert all(p.grad is None for p in ours.parameters())
    ref(IDS).sum().backward()
    ours(IDS).sum().backward()
    _assert_same_grads(ref, ours)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits (fp32), so that ``-0.0`` and ``0.0`` differ."""
    return t.detach().view(torch.int32)


def _offloaded_pair(vocab: int, seed: int) -> tuple[EmbedNet, EmbedNet]:
    torch.manual_seed(seed)
    ref = EmbedNet(vocab, 8)
    return ref, ramtorch.offload(copy.deepcopy(ref), device="cpu", gather_rows=True)


def _dirty_pool(shape: tuple[int, int], count: int = 3) -> set[int]:
    """Leaves ``count`` arena blocks of ``shape`` (fp32) full of non-zero bytes in the pool, where
    the next allocations of that size come from; returns their addresses."""
    bufs = [ramtorch._arena.host_empty(shape, torch.float32).fill_(7.0) for _ in range(count)]
    return {b.data_ptr() for b in bufs}


def test_fresh_grad_is_the_zeroed_buffer_made_during_the_forward():
    """A forward with gradients of tables whose ``.grad`` is None has their zero ``.grad`` made in
    the background (from recycled, dirty memory here); the backward writes the rows into it:
    two models' tables, each ``.grad`` bit for bit ``nn.Embedding``'s, zeros outside the rows."""
    rg = gather.row_grads(ramtorch._engine.engine_for(CPU))
    pairs = [_offloaded_pair(1000, 0), _offloaded_pair(1200, 1)]
    dirty = _dirty_pool((1000, 8)) | _dirty_pool((1200, 8))
    ids = [torch.tensor([[1, 3, 5, 5, 999], [3, 2, 1, 0, 7]]), torch.tensor([[1199, 4, 4, 600]])]
    loss_ref = sum(ref(i).square().sum() for (ref, _), i in zip(pairs, ids))
    loss = sum(ours(i).square().sum() for (_, ours), i in zip(pairs, ids))
    made = [rg.zeros[ours.emb.weight].result() for _, ours in pairs]
    assert {b.data_ptr() for b in made} <= dirty  # recycled blocks, zero-filled
    loss_ref.backward()
    loss.backward()
    for (ref, ours), buf in zip(pairs, made):
        g = ours.emb.weight.grad
        assert g.data_ptr() == buf.data_ptr()
        assert ours.emb.weight not in rg.zeros  # taken
        assert torch.equal(_bits(g), _bits(ref.emb.weight.grad))
        _assert_same_grads(ref, ours)


def test_a_grad_set_before_the_backward_keeps_the_buffer_for_the_next_fresh_one():
    """A ``.grad`` set between the forward and the backward is added to, as torch adds; the
    buffer made at the forward is kept (one per table, no new one at the next forward) and is the
    next fresh backward's ``.grad``."""
    rg = gather.row_grads(ramtorch._engine.engine_for(CPU))
    ref, ours = _offloaded_pair(1000, 2)
    table = ours.emb.weight
    y_ref, y = ref(IDS), ours(IDS)
    job = rg.zeros[table]
    start = torch.randn(1000, 8)
    ref.emb.weight.grad, table.grad = start.clone(), start.clone()
    y_ref.sum().backward()
    y.sum().backward()
    assert torch.equal(_bits(table.grad), _bits(ref.emb.weight.grad))
    _assert_same_grads(ref, ours)
    assert rg.zeros[table] is job  # kept, zeroed, for a later fresh backward
    for step in range(2):
        ref.zero_grad()
        ours.zero_grad()
        y_ref, y = ref(IDS + step), ours(IDS + step)
        assert step or rg.zeros[table] is job
        y_ref.square().sum().backward()
        y.square().sum().backward()
        if step == 0:
            assert table.grad.data_ptr() == job.result().data_ptr()
        assert torch.equal(_bits(table.grad), _bits(ref.emb.weight.grad))
        _assert_same_grads(ref, ours)


def test_a_failed_zeroing_job_raises_at_the_end_of_the_backward(monkeypatch):
    """The background job's error is the backward's; the next step makes its buffer again and
    matches torch."""
    ref, ours = _offloaded_pair(1000, 3)

    def fail(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        raise MemoryError("no memory for the gradient")

    monkeypatch.setattr(gather, "zeroed_grad", fail)
    y = ours(IDS)
    with pytest.raises(MemoryError, match="no memory for the gradient"):
        y.sum().backward()
    assert ours.emb.weight.grad is None
    monkeypatch.undo()
    for p in ours.parameters():
        p.grad = None
    ref(IDS).sum().backward()
    ours(IDS).sum().backward()
    _assert_same_grads(ref, ours)


def test_put_rows_is_index_add():
    """Rows written into a zero gradient, or added into one that exists, are bit for bit
    ``index_add_``'s, in the dtypes tables use (whole-word copies and the fallback)."""
    gen = torch.Generator().manual_seed(0)
    index = torch.tensor([0, 3, 4, 9])
    for dtype, dim in ((torch.float32, 8), (torch.bfloat16, 6), (torch.float16, 3), (torch.float64, 2)):
        rows = torch.randn(4, dim, generator=gen).to(dtype)
        rows[1, 0] = 0.0
        for start in (torch.zeros(10, dim, dtype=dtype), torch.randn(10, dim, generator=gen).to(dtype)):
            want = start.clone().index_add_(0, index, rows)
            got = start.clone()
            gather.put_rows(got, index, rows, fresh=not start.any())
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), dtype
        t = torch.randn(10, 2 * dim, generator=gen).to(dtype)[:, ::2]  # rows not contiguous
        want = t.clone().index_add_(0, index, rows)
        gather.put_rows(t, index, rows, fresh=False)
        assert torch.equal(t, want)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_transformers_decoder_matches_torch(tied):
    """A small Llama with random weights, offloaded with its input embedding streamed by rows
    (untied; tied, the table stays on the device): logits, gradients and three AdamW steps
    match the plain model."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tiny_llama_config(tie_word_embeddings=tied)
    ref = transformers.LlamaForCausalLM(config).eval()
    ours = ramtorch.offload(copy.deepcopy(ref), device="cpu", gather_rows=True)
    gathered = [u.name for u in ours._ramtorch_streamer.units if u.gather]
    assert gathered == ([] if tied else ["model.embed_tokens"])
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        ids = torch.randint(0, config.vocab_size, (2, 9), generator=gen)
        out_ref = ref(input_ids=ids, labels=ids)
        out = ours(input_ids=ids, labels=ids)
        torch.testing.assert_close(out.logits, out_ref.logits, rtol=0, atol=0)
        out_ref.loss.backward()
        out.loss.backward()
        for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)


def test_which_lookups_read_the_table_in_place():
    """Reading a table in place (mapped host memory) is chosen on a GPU for lookups whose rows'
    gradient is not needed, without max_norm, with the table in RAM; the CPU device gathers."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert gather.reads_in_place(cuda, False, None, False)
    assert not gather.reads_in_place(cuda, True, None, False)  # the backward needs the rows
    assert not gather.reads_in_place(cuda, False, 1.0, False)  # max_norm writes rows in place
    assert not gather.reads_in_place(cuda, False, None, True)  # on disk: not page-locked
    assert not gather.reads_in_place(cpu, False, None, False)
    # Host memory that cannot be mapped (no CUDA here) gives no view: the lookup gathers.
    assert gather.mapped_table(torch.zeros(4, 4), cuda) is None


def test_the_plan_says_how_each_unit_reaches_the_gpu(monkeypatch):
    """plan's ``transfer`` per unit: a gathered table that trains is ``rows`` (gathered when it
    trains, read in place otherwise), a frozen one ``mapped``, a table the budget keeps
    ``resident``, the other streamed units ``copy``; the summary's note says so."""
    from ramtorch.plan import predict

    monkeypatch.setenv("RAMTORCH_GATHER_MIN_BYTES", "4KiB")

    def transfers(model: nn.Module, budget: int | None = None) -> dict[str, str]:
        return {u.name: u.transfer for u in predict(model, budget, 16).units}

    got = transfers(EmbedNet(64, 16))
    assert got["emb"] == "rows" and set(got.values()) == {"rows", "copy"}
    frozen = EmbedNet(64, 16)
    frozen.emb.requires_grad_(False)
    assert transfers(frozen)["emb"] == "mapped"
    assert "every lookup reads them in place" in predict(frozen, None, 16).summary()
    assert transfers(EmbedNet(64, 16), 1 << 20)["emb"] == "resident"
