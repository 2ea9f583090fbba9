"""Small parameters (norms, biases) stay on the device instead of streaming with their unit
(``ramtorch._stream.units.small_params``): the large weights stream, the small ones' gradients
accumulate and their updates run where they are, and forward, gradients, accumulation, optimizer
steps, batch-norm statistics and ``state_dict`` equal torch's."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import ramtorch
import ramtorch.optim as ropt
import torch
import torch.nn.functional as F
from hypothesis import event, given, settings
from hypothesis import strategies as st
from ramtorch import _config, _engine
from ramtorch._stream import units as _units
from ramtorch.plan import predict
from torch import nn

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


class MLPBlock(nn.Module):
    """A pre-norm MLP block: a LayerNorm and two biased Linears of 256 KiB weights in fp32."""

    def __init__(self, d: int = 128) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MLP(nn.Module):
    def __init__(self, blocks: int = 3, d: int = 128) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(d) for _ in range(blocks))
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


class ConvBlock(nn.Module):
    """Two 3x3 convolutions of 64 channels (144 KiB weights) with batch norms: a ResNet's block."""

    def __init__(self, c: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class CNN(nn.Module):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(ConvBlock() for _ in range(blocks)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def _small(m: nn.Module) -> list[str]:
    return [n for n, p in m.named_parameters() if p.numel() * p.element_size() <= _config.small_param_bytes()]


def _input(kind: str, k: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(k)
    x = torch.randn(4, 64, 6, 6, generator=g) if kind == "cnn" else torch.randn(6, 128, generator=g)
    return x.to(device)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_small_parameters_stay_and_the_large_weights_stream(kind):
    m = MLP() if kind == "mlp" else CNN()
    names = _small(m)
    assert names and len(names) < len(list(m.parameters()))
    ramtorch.offload(m, device="cpu")
    for n, p in m.named_parameters():
        assert _engine.is_streamed(p) == (n not in names), n
    large = sum(p.numel() * p.element_size() for n, p in m.named_parameters() if n not in names)
    assert m._ramtorch_streamer.stats()["streamed_bytes_per_pass"] == large


def _train(ref: nn.Module, ours: nn.Module, kind: str, opt: type, device: str, exact: bool) -> None:
    """Two micro-batches a step (the second adds to ``.grad``), four AdamW steps of ``opt`` on
    both models; every gradient and, at the end, every entry of ``state_dict`` (weights and
    batch-norm statistics) compared, bit for bit where ``exact``. ``eps=1e-3``: with torch's
    1e-8 an element whose gradient is rounding noise moves by about ``lr`` either way, so two
    implementations (a GPU's fused kernels and a CPU's) part by ``lr`` there and nowhere else."""

    def same(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
        if exact:
            assert torch.equal(a.to(b.device), b), name
        else:
            torch.testing.assert_close(a.to(b.device), b, rtol=1e-4, atol=1e-5, msg=name)

    o_ref, o_ours = opt(ref.parameters(), lr=1e-2, eps=1e-3), opt(ours.parameters(), lr=1e-2, eps=1e-3)
    for step in range(4):
        for micro in range(2):
            x = _input(kind, 2 * step + micro, device)
            for model in (ref, ours):
                model(x).square().mean().backward()
        for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
            same(q.grad, p.grad, name)
        for o in (o_ref, o_ours):
            o.step()
            o.zero_grad()
    assert list(ours.state_dict()) == list(ref.state_dict())
    for (name, p), q in zip(ref.state_dict().items(), ours.state_dict().values()):
        same(q, p, name)


@pytest.fixture(autouse=True)
def _no_tf32() -> Iterator[None]:
    """cuDNN may pick another convolution algorithm for a slot's weight than for the plain model's;
    in TF32 two algorithms part by about 1e-3, in fp32 by rounding."""
    conv, matmul = torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    yield
    torch.backends.cudnn.allow_tf32 = conv
    torch.set_float32_matmul_precision(matmul)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_training_with_small_parameters_resident_equals_torch(kind, device):
    """Against the plain model with torch's AdamW: bit for bit on the CPU."""
    torch.manual_seed(0)
    ref = (MLP() if kind == "mlp" else CNN()).to(device)
    ours = copy.deepcopy(ref).cpu()
    ramtorch.offload(ours, device=device)
    small = _small(ours)
    assert small and not any(_engine.is_streamed(p) for n, p in ours.named_parameters() if n in small)
    _train(ref, ours, kind, torch.optim.AdamW, device, exact=device == "cpu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_ramtorch_adamw_trains_them_as_when_they_streamed(kind, device, monkeypatch):
    """ramtorch's AdamW updates resident parameters with torch's kernels and streamed ones with
    its own, with the same numerics: the model trains bit for bit as with every parameter
    streamed (``RAMTORCH_SMALL_PARAM_BYTES=0``), on the CPU (a GPU may contract into FMAs)."""
    torch.manual_seed(0)
    plain = MLP() if kind == "mlp" else CNN()
    ours = copy.deepcopy(plain)
    ramtorch.offload(ours, device=device)
    monkeypatch.setenv(_config.SMALL_PARAM_BYTES_VAR, "0")
    streamed = copy.deepcopy(plain)
    ramtorch.offload(streamed, device=device)
    assert all(_engine.is_streamed(p) for p in streamed.parameters())
    assert not all(_engine.is_streamed(p) for p in ours.parameters())
    _train(streamed, ours, kind, ropt.AdamW, device, exact=device == "cpu")


def test_a_zero_size_streams_them(monkeypatch):
    monkeypatch.setenv(_config.SMALL_PARAM_BYTES_VAR, "0")
    m = MLP()
    ramtorch.offload(m, device="cpu")
    assert all(_engine.is_streamed(p) for p in m.parameters())
    monkeypatch.setenv(_config.SMALL_PARAM_BYTES_VAR, "off")
    assert _config.small_param_bytes() == 0
    monkeypatch.setenv(_config.SMALL_PARAM_BYTES_VAR, "2KiB")
    m = MLP()
    ramtorch.offload(m, device="cpu")
    for n, p in m.named_parameters():  # the 2 KiB up-projection biases stream, the 512 B ones stay
        assert _engine.is_streamed(p) == (p.numel() * 4 > 2048), n


@pytest.mark.parametrize("value", ["lots", "-1", "1.5"])
def test_a_bad_size_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(_config.SMALL_PARAM_BYTES_VAR, value)
    with pytest.raises(ValueError, match=_config.SMALL_PARAM_BYTES_VAR):
        ramtorch.offload(MLP(), device="cpu")


def test_the_share_rule():
    """Small parameters stay only while they hold at most SMALL_SHARE of the model's bytes (a model
    of small tensors alone streams them) and of a gpu_budget; a tied one counts once."""
    big = nn.Parameter(torch.zeros(64 * 1024))  # 256 KiB
    small = [nn.Parameter(torch.zeros(256)) for _ in range(8)]  # 1 KiB each
    assert _units.small_params([big, *small], set(), None) == small
    assert _units.small_params([big, *small, small[0]], set(), None) == small
    assert _units.small_params([big, *small], {id(small[0])}, None) == small[1:]
    assert _units.small_params(small, set(), None) == []
    assert _units.small_params([big, *small], set(), 32 * 8 * 1024) == small
    assert _units.small_params([big, *small], set(), 32 * 8 * 1024 - 1) == []
    frozen_int = nn.Parameter(torch.zeros(4, dtype=torch.int32), requires_grad=False)
    assert _units.small_params([big, frozen_int], set(), None) == []


def test_the_plan_keeps_them_resident_as_offload_does():
    with torch.device("meta"):
        meta = MLP()
    pred = predict(meta, None, 128)
    real = MLP()
    ramtorch.offload(real, device="cpu")
    assert pred.streamed_bytes_per_pass == real._ramtorch_streamer.stats()["streamed_bytes_per_pass"]


def test_a_model_built_on_the_meta_device_loads_its_small_parameters(tmp_path):
    """A meta-built model's resident small parameters are allocated on the device and filled by
    ``ramtorch.load`` as the streamed ones are."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    ref = MLP()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(tmp_path / "m.safetensors"))
    with torch.device("meta"):
        m = MLP()
    ramtorch.offload(m, device="cpu")
    ramtorch.load(m, str(tmp_path / "m.safetensors"))
    assert not _engine.is_streamed(m.blocks[0].norm.weight)
    for (name, p), q in zip(ref.state_dict().items(), m.state_dict().values()):
        assert torch.equal(q, p), name
    x = _input("mlp", 0, "cpu")
    with torch.no_grad():
        assert torch.equal(m(x), ref(x))


def test_an_interrupted_backward_leaves_the_streamed_grads_and_the_next_step_equals_torch():
    """A backward that raises after the weights' gradients were computed: the streamed
    parameters' ``.grad`` stay as they were (the engine drops what it had not written); the
    resident small parameters' are torch's business, as on a plain model (autograd accumulated
    some of them before the error, in its own order). After ``zero_grad`` the next backward gives
    torch's gradients everywhere."""
    torch.manual_seed(0)
    ref = MLP()
    ours = copy.deepcopy(ref)
    ramtorch.offload(ours, device="cpu")
    x = _input("mlp", 0, "cpu")
    for model in (ref, ours):
        model(x).square().mean().backward()
    before = [q.grad.clone() for q in ours.parameters()]

    class Boom(Exception):
        pass

    for model in (ref, ours):
        y = _input("mlp", 1, "cpu").requires_grad_()
        out = model(y).square().mean()
        y.register_hook(lambda g: (_ for _ in ()).throw(Boom()))  # the input's gradient comes last
        with pytest.raises(Boom):
            out.backward()
    ramtorch.synchronize()
    streamed = [(q, b) for q, b in zip(ours.parameters(), before) if _engine.is_streamed(q)]
    assert streamed and all(torch.equal(q.grad, b) for q, b in streamed)
    for model in (ref, ours):
        model.zero_grad()
        model(_input("mlp", 2, "cpu")).square().mean().backward()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(q.grad, p.grad), name


@pytest.mark.parametrize(
    "dtype,precision", [(torch.float32, "fp32-master"), (torch.bfloat16, "compact"), (torch.bfloat16, "bf16")]
)
def test_a_checkpoint_of_streamed_small_parameters_resumes_with_them_resident(
    tmp_path, monkeypatch, dtype, precision
):
    """A checkpoint written while the small parameters streamed (``RAMTORCH_SMALL_PARAM_BYTES=0``,
    or an earlier version) loads into a model that keeps them on the device, and training goes on
    bit for bit as without the checkpoint."""

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = MLP().to(dtype)
        ramtorch.offload(m, device="cpu")
        return m, ropt.AdamW(m.parameters(), lr=1e-2, precision=precision)

    def step(m: nn.Module, o: torch.optim.Optimizer, k: int) -> None:
        m(_input("mlp", k, "cpu").to(dtype)).float().square().mean().backward()
        o.step()
        o.zero_grad()

    monkeypatch.setenv(_config.SMALL_PARAM_BYTES_VAR, "0")
    m, o = build()
    assert all(_engine.is_streamed(p) for p in m.parameters())
    for k in range(3):
        step(m, o, k)
    ramtorch.save_checkpoint(str(tmp_path / "ckpt"), m, o)
    for k in range(3, 5):
        step(m, o, k)
    monkeypatch.delenv(_config.SMALL_PARAM_BYTES_VAR)
    resumed, ro = build()
    assert not all(_engine.is_streamed(p) for p in resumed.parameters())
    ramtorch.load_checkpoint(str(tmp_path / "ckpt"), resumed, ro)
    for k in range(3, 5):
        step(resumed, ro, k)
    for (name, a), b in zip(m.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


class _Mixed(nn.Module):
    """Blocks of a LayerNorm and a biased Linear of random widths: some weights above the small
    size, some below, a final bias of its own."""

    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(a), nn.Linear(a, b)) for a, b in zip(widths, widths[1:])
        )
        self.shift = nn.Parameter(torch.zeros(widths[-1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x + self.shift


@settings(max_examples=16, deadline=None)
@given(
    widths=st.lists(st.integers(8, 400), min_size=3, max_size=5),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    micro=st.integers(1, 3),
    limit=st.sampled_from(["1KiB", "4KiB", "64KiB"]),
    recompute=st.booleans(),
)
def test_random_models_train_as_torch_whatever_stays(widths, dtype, micro, limit, recompute):
    """Random widths, dtypes, micro-batches, sizes of a small parameter and activation
    recomputation: whichever parameters stay on the device, every ``.grad`` and every weight after
    SGD steps with momentum equals torch's on the plain model, bit for bit (CPU)."""
    import os

    torch.manual_seed(sum(widths))
    ref = _Mixed(widths).to(dtype)
    ours = copy.deepcopy(ref)
    old = os.environ.get(_config.SMALL_PARAM_BYTES_VAR)
    os.environ[_config.SMALL_PARAM_BYTES_VAR] = limit
    try:
        ramtorch.offload(ours, device="cpu", recompute=recompute)
    finally:
        if old is None:
            del os.environ[_config.SMALL_PARAM_BYTES_VAR]
        else:
            os.environ[_config.SMALL_PARAM_BYTES_VAR] = old
    resident = sum(not _engine.is_streamed(p) for p in ours.blocks.parameters())  # (shift: a container's)
    event(f"{'some' if resident else 'no'} small parameters resident")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, ours)]
    for step in range(3):
        for k in range(micro):
            x = torch.randn(4, widths[0], generator=torch.Generator().manual_seed(10 * step + k)).to(dtype)
            for m in (ref, ours):
                m(x).float().square().mean().backward()
        for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
            assert torch.equal(q.grad, p.grad), name
        for o in opts:
            o.step()
            o.zero_grad()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(q.detach(), p.detach()), name


def test_the_plan_log_counts_the_parameters_kept_on_the_device(caplog):
    import logging

    m = MLP()
    with caplog.at_level(logging.INFO, logger="ramtorch"):
        ramtorch.offload(m, device="cpu")
    kept = [p for p in m.parameters() if not _engine.is_streamed(p)]
    lines = [r.getMessage() for r in caplog.records if r.name == "ramtorch"]
    said = f"{len(kept)} parameters ("
    assert kept and any(said in s and "kept on the device outside the units" in s for s in lines), lines
