"""On a GPU, embedding tables streamed by rows (``ramtorch._stream.gather``) compute what
``nn.Embedding`` computes on the device, with indices given on the GPU or on the CPU, move the
rows they read, and hold no device memory of the table's size. The CPU counterpart is
``tests/test_gather.py``."""

from __future__ import annotations

import copy

import pytest
import ramtorch
import ramtorch.nn as rnn
import torch
from torch import nn

pytestmark = pytest.mark.gpu

OPTIONS = [{}, {"padding_idx": 3}, {"scale_grad_by_freq": True}, {"max_norm": 1.0}]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("where", ["cuda", "cpu"], ids=["ids-on-gpu", "ids-on-cpu"])
def test_layer_embedding_matches_torch_on_cuda(options, where):
    torch.manual_seed(0)
    ours = rnn.Embedding(1000, 64, gather_rows=True, device="cuda", **options)
    ref = nn.Embedding(1000, 64, **options)
    ref.load_state_dict(ours.state_dict())
    ref.cuda()
    ids = torch.randint(0, 1000, (4, 33))
    ids[0, :3] = 3
    for _ in range(2):
        y_ref = ref(ids.cuda())
        y = ours(ids.to(where))
        assert y.device.type == "cuda"
        assert torch.equal(y_ref, y)
        w = torch.randn_like(y)
        (y_ref * w).sum().backward()
        (y * w).sum().backward()
        torch.cuda.synchronize()
        assert torch.equal(ref.weight.grad.cpu(), ours.weight.grad)
        assert torch.equal(ref.weight.detach().cpu(), ours.weight.detach())


@pytest.mark.usefixtures("small_params_streamed")
def test_offloaded_model_moves_the_rows_read_on_cuda():
    """An offloaded model's input embedding crosses the link by rows: the row counters grow by the
    distinct rows read, the slots are sized for the other units, and training matches torch. Small
    parameters stream too, so that every parameter is updated on the host as when this tolerance
    (1e-6 after three Adam steps) was set: with the biases and the small head updated on the GPU,
    the table parted from torch's by more (which kernel's bits differ was not traced)."""
    torch.manual_seed(0)
    vocab, d = 50_000, 256  # a 49 MiB table
    ref = nn.Sequential(nn.Embedding(vocab, d), nn.Linear(d, d), nn.Linear(d, 8)).cuda()
    ours = ramtorch.offload(copy.deepcopy(ref).cpu(), device="cuda")
    assert [u.name for u in ours._ramtorch_streamer.units if u.gather] == ["0"]
    table = vocab * d * 4
    assert ramtorch.stats(ours)["slot_bytes"] < table // 100
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    counters = ramtorch._engine.engine_for(torch.device("cuda", torch.cuda.current_device())).row_counters
    for _ in range(3):
        ids = torch.randint(0, vocab, (8, 128), device="cuda")
        before = dict(counters)
        loss_ref = ref(ids).square().mean()
        loss = ours(ids).square().mean()
        torch.testing.assert_close(loss, loss_ref, rtol=0, atol=0)
        loss_ref.backward()
        loss.backward()
        rows = ids.unique().numel()
        assert counters["row_h2d_bytes"] - before["row_h2d_bytes"] == rows * d * 4
        assert counters["row_d2h_bytes"] - before["row_d2h_bytes"] == rows * d * 4
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    ramtorch.synchronize()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach().cpu(), rtol=1e-6, atol=1e-7, msg=name)


def _counters() -> dict:
    return ramtorch._engine.engine_for(torch.device("cuda", torch.cuda.current_device())).row_counters


@pytest.mark.parametrize("where", ["cuda", "cpu"], ids=["ids-on-gpu", "ids-on-cpu"])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_lookups_without_gradient_read_the_table_in_place(where, padding_idx):
    """A frozen table, and any table under no_grad, is read by the GPU where it lies (mapped
    host memory): outputs equal nn.Embedding's on the device bitwise, nothing is gathered on the
    host, and a later training forward of a trainable table gathers its rows again."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Embedding(50_000, 256, padding_idx=padding_idx), nn.Linear(256, 8)).cuda()
    ours = ramtorch.offload(copy.deepcopy(ref).cpu(), device="cuda")
    assert [u.name for u in ours._ramtorch_streamer.units if u.gather] == ["0"]
    c = _counters()
    for grad in (False, True):
        ours[0].weight.requires_grad_(grad)
        ref[0].weight.requires_grad_(grad)
        ids = torch.randint(0, 50_000, (4, 100))
        ids[0, :5] = 3
        before = dict(c)
        with torch.no_grad():
            assert torch.equal(ours(ids.to(where)), ref(ids.cuda()))
        assert c["mapped_lookups"] == before["mapped_lookups"] + 1
        assert c["rows_gathered"] == before["rows_gathered"]
    # Trainable, with gradients: the rows are gathered (the backward needs them).
    before = dict(c)
    ids = torch.randint(0, 50_000, (4, 100), device="cuda")
    y, y_ref = ours(ids), ref(ids)
    assert torch.equal(y, y_ref)
    assert c["mapped_lookups"] == before["mapped_lookups"] and c["rows_gathered"] > before["rows_gathered"]
    y.square().sum().backward()
    y_ref.square().sum().backward()
    torch.cuda.synchronize()
    assert torch.equal(ours[0].weight.grad, ref[0].weight.grad.cpu())
    # Frozen with gradients for the rest of the model: read in place, the rest trains.
    ours[0].weight.requires_grad_(False)
    before = dict(c)
    ours(ids).square().sum().backward()
    assert c["mapped_lookups"] == before["mapped_lookups"] + 1


def test_an_index_out_of_range_on_the_cpu_raises_before_reading_in_place():
    ours = ramtorch.offload(nn.Sequential(nn.Embedding(50_000, 256), nn.Linear(256, 8)), device="cuda")
    ours[0].weight.requires_grad_(False)
    with pytest.raises(IndexError, match="50000"):
        ours(torch.tensor([[1, 50_000]]))


def test_a_table_in_pageable_memory_gathers(monkeypatch):
    """Where the table cannot be read in place (its memory not mapped), lookups gather."""
    from ramtorch._stream import gather

    monkeypatch.setattr(gather, "mapped_table", lambda table, device: None)
    ours = ramtorch.offload(nn.Sequential(nn.Embedding(50_000, 256), nn.Linear(256, 8)), device="cuda")
    c = _counters()
    before = dict(c)
    with torch.no_grad():
        ours(torch.randint(0, 50_000, (2, 10), device="cuda"))
    assert c["mapped_lookups"] == before["mapped_lookups"] and c["rows_gathered"] > before["rows_gathered"]


def test_a_table_written_after_the_forward_returns_is_not_read_by_it():
    """The forward of a model whose lookup read its table in place returns only once the GPU has
    read the rows: a write to the table right after (an optimizer step, a ``.data`` edit) does
    not reach that forward's output, as it would not for a table on the GPU."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Embedding(50_000, 256), nn.Linear(256, 8)).cuda()
    ours = ramtorch.offload(copy.deepcopy(ref).cpu(), device="cuda")
    ours[0].weight.requires_grad_(False)
    ids = torch.randint(0, 50_000, (8, 512), device="cuda")
    with torch.no_grad():
        want = ref(ids)
        for _ in range(3):
            torch.cuda._sleep(50_000_000)  # the GPU busy with earlier work when the lookup is queued
            got = ours(ids)
            saved = ours[0].weight.detach().clone()
            ours[0].weight.data.zero_()
            torch.cuda.synchronize()
            assert torch.equal(got, want)
            ours[0].weight.data.copy_(saved)
