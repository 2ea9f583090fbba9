"""Models that do what torch allows inside a forward train as they do in torch: a forward that
writes its own weights in place (an EMA codebook, a clamp, ``nn.Embedding(max_norm=...)``) keeps
the write; a forward that returns its weight, or a view of it, hands out memory of its own; the
recompute mode updates BatchNorm's running statistics once a step; a model built on the meta
device and never loaded is refused at its first forward, naming what was never loaded; and a
submodule converted after ``offload`` is refused, or named in a clear error. Each streamed model
is compared with the same plain model on the same inputs."""

from __future__ import annotations

import copy
import warnings

import pytest
import ramtorch
import ramtorch.nn as rnn
import torch
import torch.nn.functional as F
from conftest import Net
from torch import nn

# -- writes made inside a forward ------------------------------------------------------------------


class Codebook(nn.Module):
    """A block with a codebook that its forward moves towards the batch (an EMA, written in place
    as vector-quantisation layers do), and a projection it may clamp in place."""

    def __init__(self, d: int, how: str) -> None:
        super().__init__()
        self.how = how
        self.proj = nn.Linear(d, d)
        self.codebook = nn.Parameter(torch.randn(6, d), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.how == "clamp":
            with torch.no_grad():  # weight clipping, before the weight is used
                self.proj.weight.clamp_(-0.2, 0.2)
        h = self.proj(x)
        idx = torch.cdist(h.detach(), self.codebook).argmin(-1)
        out = h + self.codebook[idx]
        if self.training and self.how == "ema":
            with torch.no_grad():
                self.codebook.mul_(0.8).add_(0.2 * h.detach().mean(0))
        elif self.training and self.how == "ema_data":  # unseen by version counters
            self.codebook.data.mul_(0.8).add_(0.2 * h.detach().mean(0))
        return out


class CodebookNet(nn.Module):
    def __init__(self, how: str, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Codebook(d, how) for _ in range(3))
        self.out = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _train(model: nn.Module, steps: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    outs = []
    for k in range(steps):
        y = model(inputs[k])
        outs.append(y.detach().clone())
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()
    return outs


def _assert_same_state(ref: nn.Module, ours: nn.Module) -> None:
    for (name, a), (_, b) in zip(ref.state_dict().items(), ours.state_dict().items()):
        torch.testing.assert_close(b.cpu(), a.cpu(), rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("how", ["ema", "ema_data", "clamp"])
@pytest.mark.parametrize("max_inflight", [1, 2])
def test_a_forward_that_writes_its_weights_in_place_keeps_the_write(
    device: str, how: str, max_inflight: int
) -> None:
    torch.manual_seed(0)
    ref = CodebookNet(how)
    ours = ramtorch.offload(copy.deepcopy(ref), device=device, max_inflight=max_inflight)
    ref.to(device)
    inputs = [torch.randn(5, 8, device=device) for _ in range(3)]
    for a, b in zip(_train(ref, 3, inputs), _train(ours, 3, inputs)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    _assert_same_state(ref, ours)
    with torch.no_grad():
        ref.eval(), ours.eval()
        torch.testing.assert_close(ours(inputs[0]), ref(inputs[0]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("how", ["ema", "ema_data"])
def test_a_write_in_an_inference_forward_is_kept_too(device: str, mode: type, how: str) -> None:
    torch.manual_seed(0)
    ref = CodebookNet(how)
    ours = ramtorch.offload(copy.deepcopy(ref), device=device, max_inflight=1)
    ref.to(device)
    with mode():
        for _ in range(3):
            x = torch.randn(4, 8, device=device)
            torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-6)
    _assert_same_state(ref, ours)


def test_a_forward_that_writes_nothing_copies_nothing_back(device: str) -> None:
    torch.manual_seed(0)
    model = ramtorch.offload(Net(), device=device, max_inflight=1)
    x = torch.randn(3, 8, device=device)
    model(x).sum().backward()  # the first forward of each unit, in training mode, is compared
    before = [p._version for p in model.parameters()]
    for train in (True, True, False, False):
        model.train(train)
        y = model(x)
        if train:
            y.sum().backward()
    # A write kept on the host bumps the parameters' version counters, as torch's writes do.
    assert [p._version for p in model.parameters()] == before
    assert not any(u.writes for u in model._ramtorch_streamer.units)


class EmbeddingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 6, max_norm=1.0)
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.out = nn.Linear(6, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.out(x)


def test_embedding_max_norm_renormalises_the_host_weights_under_offload(device: str) -> None:
    torch.manual_seed(0)
    ref = EmbeddingNet()
    with torch.no_grad():
        ref.emb.weight.mul_(3.0)  # rows well above max_norm
    ours = ramtorch.offload(copy.deepcopy(ref), device=device)
    ref.to(device)
    inputs = [torch.randint(0, 12, (4, 3), device=device) for _ in range(3)]
    for a, b in zip(_train(ref, 3, inputs), _train(ours, 3, inputs)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    _assert_same_state(ref, ours)


def test_ramtorch_nn_embedding_max_norm_renormalises_its_host_weights(device: str) -> None:
    torch.manual_seed(0)
    ref = nn.Embedding(10, 4, max_norm=1.0, norm_type=2.0)
    with torch.no_grad():
        ref.weight.mul_(3.0)
    ours = rnn.Embedding(10, 4, max_norm=1.0, norm_type=2.0, device=device)
    ours.load_state_dict(ref.state_dict())
    ref.to(device)
    inputs = [torch.randint(0, 10, (5,), device=device) for _ in range(3)]
    for a, b in zip(_train(ref, 3, inputs), _train(ours, 3, inputs)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.weight, ref.weight.cpu(), rtol=1e-5, atol=1e-6)
    # The rows looked up were renormalised (in place, as torch does), the others not.
    assert ours.weight.norm(dim=1).max() > 1.5


# -- nothing escapes a slot ------------------------------------------------------------------------


class Table(nn.Module):
    """A position table (or soft prompt) returned as it is, or as a view of it."""

    def __init__(self, t: int, d: int, how: str) -> None:
        super().__init__()
        self.how = how
        self.pos = nn.Parameter(torch.randn(t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "itself":
            return self.pos
        if self.how == "tuple":
            return x, {"pos": self.pos.unsqueeze(0)}
        return self.pos.unsqueeze(0)


class Prompted(nn.Module):
    def __init__(self, how: str, t: int = 4, d: int = 8) -> None:
        super().__init__()
        self.how = how
        self.blocks = nn.ModuleList([Table(t, d, how)] + [nn.Linear(d, d) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = self.blocks[0](x)
        if self.how == "tuple":
            pos = pos[1]["pos"]
        h = x
        for b in self.blocks[1:]:  # each takes a slot: the table's is overwritten
            h = torch.tanh(b(h))
        return h + pos


@pytest.mark.parametrize("how", ["itself", "view", "tuple"])
@pytest.mark.parametrize("grad", [True, False, "inference_mode"])
def test_a_weight_returned_by_a_forward_is_not_overwritten_by_later_units(
    device: str, how: str, grad: bool | str
) -> None:
    torch.manual_seed(0)
    ref = Prompted(how)
    ours = ramtorch.offload(copy.deepcopy(ref), device=device, max_inflight=1)
    ref.to(device)
    x = torch.randn(2, 4, 8, device=device)
    with torch.inference_mode() if grad == "inference_mode" else torch.set_grad_enabled(grad):
        a, b = ref(x), ours(x)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    if grad is True:
        a.square().sum().backward()
        b.square().sum().backward()
        for (name, p), (_, q) in zip(ref.named_parameters(), ours.named_parameters()):
            torch.testing.assert_close(q.grad, p.grad.cpu(), rtol=1e-5, atol=1e-6, msg=name)


def test_a_returned_weight_does_not_change_with_the_slot_in_later_steps(device: str) -> None:
    torch.manual_seed(0)
    ref = Prompted("view")
    ours = ramtorch.offload(copy.deepcopy(ref), device=device, max_inflight=1)
    ref.to(device)
    x = torch.randn(2, 4, 8, device=device)
    with torch.no_grad():
        kept = ours.blocks[0](x)  # a unit run on its own
        expected = ref.blocks[0](x)
        ours(x)
        ours(x)
    torch.testing.assert_close(kept, expected)


class Caching(nn.Module):
    """Keeps views of its weight on itself between calls: the transpose once (a lazy cache), its
    first rows in a list every call, and a tensor of its own that is no view of the weight."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d))
        self.cache: torch.Tensor | None = None
        self.rows: list[torch.Tensor] = []
        self.own: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache is None:
            self.cache = self.weight.t()
            self.own = torch.ones(1, device=x.device)
        self.rows = [self.weight[:2]]
        return x @ self.cache + self.rows[0].sum() * self.own


class CachingNet(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Caching(d)] + [nn.Linear(d, d) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:  # each takes a slot: the caching block's is overwritten
            x = torch.tanh(b(x))
        return x


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_views_a_forward_keeps_on_its_module_do_not_read_the_reused_slot(device: str, mode: str) -> None:
    torch.manual_seed(0)
    ref = CachingNet()
    ours = ramtorch.offload(copy.deepcopy(ref), device=device, max_inflight=1)
    ref.to(device)
    x = torch.randn(3, 8, device=device)
    ctx = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    with ctx():
        with pytest.warns(UserWarning, match=r"stored views of its streamed weights \(cache, rows\)"):
            b1 = ours(x)
        own = ours.blocks[0].own
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once per unit
            b2, b3 = ours(x), ours(2 * x)
        a1, a2, a3 = ref(x), ref(x), ref(2 * x)
    for a, b in ((a1, b1), (a2, b2), (a3, b3)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    kept = ours.blocks[0]
    torch.testing.assert_close(kept.cache, ref.blocks[0].weight.t())
    torch.testing.assert_close(kept.rows[0], ref.blocks[0].weight[:2])
    assert kept.own is own  # a tensor that is not a view of the weights is left as it is


# -- recompute mode and buffers --------------------------------------------------------------------


class NormBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.bn(self.lin(x)))


class NormNet(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(NormBlock(d) for _ in range(3))
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.out(x)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_recompute_updates_batchnorm_statistics_once_a_step(device: str, momentum: float | None) -> None:
    torch.manual_seed(0)
    ref = NormNet()
    for m in ref.modules():
        if isinstance(m, nn.BatchNorm1d):
            m.momentum = momentum
    ours = ramtorch.offload(copy.deepcopy(ref), device=device, recompute=True)
    ref.to(device)
    inputs = [torch.randn(6, 8, device=device) for _ in range(3)]
    for a, b in zip(_train(ref, 3, inputs), _train(ours, 3, inputs)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert int(ours.blocks[0].bn.num_batches_tracked) == 3
    _assert_same_state(ref, ours)
    ref.eval(), ours.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(inputs[0]), ref(inputs[0]), rtol=1e-5, atol=1e-6)


# -- a model built on the meta device, never loaded ------------------------------------------------


def test_a_meta_model_never_loaded_is_refused_at_its_first_forward() -> None:
    with torch.device("meta"):
        model = Net()
    ramtorch.offload(model, device="cpu")
    with pytest.raises(RuntimeError, match=r"never loaded.*inp\.weight") as info:
        model(torch.randn(2, 8))
    assert "ramtorch.load" in str(info.value)
    # Loaded through load_state_dict (or any write) instead, it runs as the plain model.
    torch.manual_seed(1)
    ref = Net()
    model.load_state_dict(ref.state_dict())
    x = torch.randn(2, 8)
    torch.testing.assert_close(model(x), ref(x))


def test_a_meta_model_partly_set_names_what_is_still_unset() -> None:
    with torch.device("meta"):
        model = Net()
    ramtorch.offload(model, device="cpu")
    torch.manual_seed(1)
    ref = Net()
    sd = {k: v for k, v in ref.state_dict().items() if k != "blocks.2.up.bias"}
    model.load_state_dict(sd, strict=False)
    with pytest.raises(RuntimeError, match=r"\['blocks\.2\.up\.bias'\]"):
        model(torch.randn(2, 8))
    # Set through .data (no version counter sees it): its values are not zeros anymore.
    model.blocks[2].up.bias.data.copy_(ref.blocks[2].up.bias)
    x = torch.randn(2, 8)
    torch.testing.assert_close(model(x), ref(x))


# -- a submodule converted after offload -----------------------------------------------------------


def test_a_unit_converted_after_offload_is_refused_before_anything_changes() -> None:
    torch.manual_seed(0)
    ref = Net()
    model = ramtorch.offload(copy.deepcopy(ref), device="cpu")
    x = torch.randn(2, 8)
    model(x)
    with pytest.raises(RuntimeError, match=r"unit 'blocks\.1'.*torch\.float64") as info:
        model.blocks[1].double()
    assert "before calling ramtorch.offload" in str(info.value)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    model.blocks[1].to("cpu")  # to the compute device, in its own dtype: nothing to do
    model.blocks[1].float()
    torch.testing.assert_close(model(x), ref(x))


def test_a_module_inside_a_unit_converted_after_offload_is_named_at_the_next_forward() -> None:
    torch.manual_seed(0)
    ref = Net()
    model = ramtorch.offload(copy.deepcopy(ref), device="cpu")
    x = torch.randn(2, 8)
    model(x)
    model.blocks[1].up.double()
    with pytest.raises(
        RuntimeError,
        match=r"unit 'blocks\.1'.*blocks\.1\.up\.weight is torch\.float64 \(was torch\.float32\)",
    ):
        model(x)
    model.blocks[1].up.float()  # converted back: packed again, and computing as before
    torch.testing.assert_close(model(x), ref(x))
