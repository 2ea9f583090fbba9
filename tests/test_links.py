"""Several links into one device (``offload(..., links=...)``): each copy split between the
device's own link and relays through peers. On the host device the peers are host stand-ins with
lanes of their own, so the split, the relays and their ordering run without a GPU; the choice of
CUDA peers is tested with torch's topology calls replaced. The relays' byte-exactness against
torch, on a GPU pair, is in the GPU test at the end (skipped with fewer than two GPUs)."""

from __future__ import annotations

import copy

import pytest
import ramtorch
import ramtorch.optim
import torch
from ramtorch import _core, _engine
from torch import nn


@pytest.fixture
def fresh_engines(monkeypatch):
    """A registry of engines of this test's own: links are set by the first model on a device."""
    monkeypatch.setattr(_engine, "_ENGINES", {})


def _stack(widths: list[int], dtype: torch.dtype, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Sequential(nn.Linear(a, b), nn.GELU()) for a, b in zip(widths, widths[1:])]
    return nn.Sequential(*layers).to(dtype)


def _train(model: nn.Module, widths: list[int], dtype: torch.dtype, links: int | None) -> list[torch.Tensor]:
    """Three AdamW steps of ``model`` offloaded on the CPU with ``links`` (an engine of its own):
    every output, gradient and final weight, in order."""
    _engine._ENGINES.clear()
    ramtorch.offload(model, device="cpu", links=links)
    opt = ramtorch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(2)
    seen = []
    for _ in range(3):
        y = model(torch.randn(5, widths[0], generator=g).to(dtype))
        y.float().square().mean().backward()
        seen += [y.detach().clone()] + [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    return seen + [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "widths,dtype,n",
    [
        ([512, 2048, 512, 2048], torch.float32, 3),
        ([1024, 3072, 1024], torch.bfloat16, 2),
        ([1024, 3000, 1024], torch.float32, 4),
    ],
)
def test_training_over_several_links_equals_one_link(fresh_engines, widths, dtype, n):
    """Forward, gradients and three AdamW steps over ``n`` links equal the one-link path's bit
    for bit (the relays move bytes, nothing else) and torch's up to its optimizer's rounding,
    and every path carried a share of the units in, and of their gradients out."""
    one = _train(_stack(widths, dtype, 1), widths, dtype, None)
    many = _train(_stack(widths, dtype, 1), widths, dtype, n)
    assert len(one) == len(many) and all(torch.equal(a, b) for a, b in zip(one, many))
    s = ramtorch.stats()["devices"]["cpu"]
    assert s["links"] == n and len(s["link_relay_bytes"]) == n - 1
    assert s["link_own_bytes"] > 0 and all(b > 0 for b in s["link_relay_bytes"])
    assert s["link_own_bytes"] + sum(s["link_relay_bytes"]) == s["h2d_bytes"]
    # the gradients left by every link too
    assert s["link_own_down_bytes"] > 0 and all(b > 0 for b in s["link_relay_down_bytes"])
    assert s["link_own_down_bytes"] + sum(s["link_relay_down_bytes"]) == s["d2h_bytes"]
    ref = _stack(widths, dtype, 1)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, widths[0], generator=g).to(dtype)
    assert torch.equal(ref(x), many[0])  # the first forward: the same weights, the same bytes
    ref(x).float().square().mean().backward()
    opt.step()
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    for p, q in zip(ref.parameters(), _stack(widths, dtype, 1).parameters()):
        assert not torch.equal(p, q)  # the step moved the weights
    first_step = many[1 : 1 + len(list(ref.parameters()))]  # gradients of the first pass
    for p, grad in zip(ref.parameters(), first_step):
        torch.testing.assert_close(p.grad, grad, **tol)


def test_links_are_set_by_the_first_model_on_a_device(fresh_engines):
    first = _stack([512, 2048, 512], torch.float32, 3)
    ramtorch.offload(first, device="cpu", links=2)
    ramtorch.offload(_stack([512, 2048, 512], torch.float32, 4), device="cpu", links=2)  # the same
    ramtorch.offload(_stack([512, 2048, 512], torch.float32, 5), device="cpu")  # none: what it has
    third = _stack([512, 2048, 512], torch.float32, 6)
    with pytest.raises(ValueError, match="already streams over its own link and 1 peer"):
        ramtorch.offload(third, device="cpu", links=3)
    assert getattr(third, "_ramtorch_streamer", None) is None  # refused before anything moved


@pytest.mark.parametrize("bad", [0, -1, True, "two", [torch.device("cpu")], 1.5])
def test_bad_links_on_the_host_device_are_refused(fresh_engines, bad):
    with pytest.raises(ValueError, match="links="):
        ramtorch.offload(_stack([64, 64], torch.float32, 7), device="cpu", links=bad)


def test_auto_on_the_host_device_is_the_own_link(fresh_engines):
    model = _stack([512, 2048, 512], torch.float32, 8)
    ramtorch.offload(model, device="cpu", links="auto")
    model(torch.randn(2, 512))
    assert "links" not in ramtorch.stats()["devices"]["cpu"]


def test_cuda_peers_are_chosen_from_the_topology(monkeypatch):
    """``configure_links`` on CUDA: ``"auto"`` takes the GPUs that reach the device directly; a
    list takes its GPUs, the device itself and repeats dropped, a GPU without peer access left
    out with a warning; what is not a GPU is refused."""
    access = {(0, 1): True, (0, 2): False, (0, 3): True}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: access.get((a, b), False))
    dev = torch.device("cuda", 0)
    assert _engine.configure_links(dev, None) is None
    assert _engine.configure_links(dev, "auto") == (1, 3)
    assert _engine.configure_links(dev, ["cuda:0", "cuda:3", torch.device("cuda", 1), "cuda:3"]) == (3, 1)
    with pytest.warns(UserWarning, match="cuda:2 cannot reach cuda:0 directly"):
        assert _engine.configure_links(dev, ["cuda:2", "cuda:1"]) == (1,)
    for bad, match in (
        (["cpu"], "not a CUDA device"),
        (["cuda:7"], "cuda:7 does not exist"),
        (["nonsense"], "is not a device"),
        ("cuda:1", "give 'auto', a list"),
        (3, "give 'auto', a list"),
    ):
        with pytest.raises(ValueError, match=match):
            _engine.configure_links(dev, bad)


def test_a_peer_that_cannot_be_set_up_falls_back_to_one_link(fresh_engines, monkeypatch):
    real = _core.Engine

    def failing(kind, index=0, relays=None, **kw):
        if relays:
            raise _core.CudaError("cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY (a stand-in)")
        return real(kind, index, **kw)

    monkeypatch.setattr(_core, "Engine", failing)
    model = _stack([512, 2048, 512], torch.float32, 9)
    with pytest.warns(UserWarning, match="streams over its own link only"):
        ramtorch.offload(model, device="cpu", links=2)
    x = torch.randn(3, 512)
    assert torch.equal(model(x), _stack([512, 2048, 512], torch.float32, 9)(x))
    assert "links" not in ramtorch.stats()["devices"]["cpu"]


def test_engine_arguments_are_checked():
    with pytest.raises(ValueError, match="shares"):
        _core.Engine("cpu", relays=[1], shares=[1.0])
    with pytest.raises(ValueError, match="shares must be finite"):
        _core.Engine("cpu", relays=[1], shares=[1.0, float("nan")])
    with pytest.raises(ValueError, match="chunk must be at least"):
        _core.Engine("cpu", relays=[1], chunk=100)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_links_into_one_gpu_equal_one_link(fresh_engines):
    """On a GPU pair: a model streamed into cuda:0 over its own link and through cuda:1 gives
    bitwise the outputs and gradients of the one-link path, and both links carried bytes."""
    torch.manual_seed(10)
    base = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(6)]).to(torch.bfloat16)
    one, two = copy.deepcopy(base), copy.deepcopy(base)
    ramtorch.offload(one, device="cuda:0")
    x = torch.randn(64, 4096, device="cuda:0", dtype=torch.bfloat16)
    y1 = one(x)
    y1.float().sum().backward()
    _engine._ENGINES.clear()  # a fresh engine for cuda:0, fed by two links
    ramtorch.offload(two, device="cuda:0", links=["cuda:1"])
    y2 = two(x)
    y2.float().sum().backward()
    assert torch.equal(y1, y2)
    for p, q in zip(one.parameters(), two.parameters()):
        assert torch.equal(p.grad, q.grad)
    s = ramtorch.stats()["devices"]["cuda:0"]
    assert s["links"] == 2 and s["link_own_bytes"] > 0 and s["link_relay_bytes"][0] > 0
    # Each path's share is its measured bandwidth (bytes per second: a PCIe link's is 1e10-1e11).
    assert len(s["link_shares"]) == 2 and all(1e9 < x < 1e12 for x in s["link_shares"])


def test_copies_are_split_by_the_paths_shares(fresh_engines, monkeypatch):
    """Paths measured at 3:1 (the measurement replaced: the host device has none to measure)
    carry each copy's bytes 3:1, in and out, and the results equal one link's bit for bit."""
    widths = [2048, 2048, 2048]
    one = _train(_stack(widths, torch.float32, 1), widths, torch.float32, None)
    monkeypatch.setattr(_engine, "link_shares", lambda device, relays: [3.0, 1.0])
    many = _train(_stack(widths, torch.float32, 1), widths, torch.float32, 2)
    assert len(one) == len(many) and all(torch.equal(a, b) for a, b in zip(one, many))
    s = ramtorch.stats()["devices"]["cpu"]
    assert s["link_shares"] == [3.0, 1.0]
    for own, relay in (
        (s["link_own_bytes"], s["link_relay_bytes"][0]),
        (s["link_own_down_bytes"], s["link_relay_down_bytes"][0]),
    ):
        assert abs(own / (own + relay) - 0.75) < 0.02, (own, relay)


def test_link_shares_are_equal_on_the_host_device_and_where_unmeasured(monkeypatch):
    """The host device's paths are not measured; on CUDA a measurement that fails leaves the
    split equal, with a warning naming the device."""
    assert _engine.link_shares(torch.device("cpu"), (1,)) is None

    def fails(device, relays):  # noqa: ANN001, ANN202
        raise RuntimeError("no peer")

    monkeypatch.setattr(_engine, "measure_link_shares", fails)
    with pytest.warns(UserWarning, match="cuda:0 could not be measured"):
        assert _engine.link_shares(torch.device("cuda", 0), (1,)) is None
    monkeypatch.setattr(_engine, "measure_link_shares", lambda device, relays: [5e10, 0.0])
    assert _engine.link_shares(torch.device("cuda", 0), (1,)) is None  # a path that moved nothing
