"""The planner and cost model: same plan as offload, sensible predictions, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import ramtorch
import torch
from ramtorch.plan import Ceilings, build_meta_model, predict
from torch import nn


class Stack(nn.Module):
    def __init__(self, blocks: int = 6, d: int = 64, f: int = 256) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, f, bias=False), nn.GELU(), nn.Linear(f, d, bias=False))
            for _ in range(blocks)
        )
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


def meta_stack(**kw) -> nn.Module:
    with torch.device("meta"):
        return Stack(**kw)


@pytest.mark.parametrize("budget", [None, 300_000, 700_000, 10_000_000])
def test_plan_on_meta_equals_what_offload_does(budget):
    pred = predict(meta_stack(), budget, 128)
    real = Stack()
    ramtorch.offload(real, gpu_budget=budget, device="cpu")
    s = real._ramtorch_streamer.stats()
    assert sorted(u.name for u in pred.units if u.resident) == sorted(s["resident_units"])
    assert (pred.slots, pred.slot_bytes) == (s["slot_count"], s["slot_bytes"])
    assert pred.streamed_bytes_per_pass == s["streamed_bytes_per_pass"]


def test_predictions_follow_bytes_and_compute():
    c = Ceilings(h2d_gbps=10.0, tflops=1.0, efficiency=1.0)
    m = meta_stack(blocks=8, d=256, f=1024)
    none = predict(m, None, 16, c)
    more = predict(m, 9_000_000, 16, c)
    # Link-bound: the forward takes the streamed bytes over the link, plus the last compute.
    assert none.forward_seconds == pytest.approx(none.streamed_bytes_per_pass / 10e9, rel=0.1)
    assert more.streamed_bytes_per_pass < none.streamed_bytes_per_pass
    assert more.forward_seconds < none.forward_seconds
    # Compute-bound: many tokens, the forward approaches 2 * params * tokens / rate.
    big = predict(m, None, 1 << 16, c)
    params = sum(p.numel() for p in m.parameters())
    assert big.forward_seconds == pytest.approx(2 * params * (1 << 16) / 1e12, rel=0.1)
    assert big.forward_backward_seconds > 2.5 * big.forward_seconds
    assert big.step_seconds >= big.forward_backward_seconds


def test_more_links_divide_the_link_time():
    """``Ceilings(links=n)``: a link-bound forward takes the streamed bytes over n links; a
    compute-bound one does not change; the plan says how many links it assumed."""
    m = meta_stack(blocks=8, d=256, f=1024)
    one = predict(m, None, 16, Ceilings(h2d_gbps=10.0, tflops=1.0, efficiency=1.0))
    two = predict(m, None, 16, Ceilings(h2d_gbps=10.0, tflops=1.0, efficiency=1.0, links=2))
    assert two.forward_seconds == pytest.approx(two.streamed_bytes_per_pass / 20e9, rel=0.1)
    assert two.forward_seconds < 0.6 * one.forward_seconds
    assert two.forward_backward_seconds < one.forward_backward_seconds
    assert any("2 links into the GPU" in n for n in two.notes) and not any("links" in n for n in one.notes)
    big = [predict(m, None, 1 << 16, Ceilings(tflops=1.0, efficiency=1.0, links=k)) for k in (1, 2)]
    assert big[1].forward_seconds == pytest.approx(big[0].forward_seconds, rel=0.02)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="links must be an int"):
            Ceilings(links=bad)


def test_prediction_against_a_small_measured_run_on_cpu():
    """A sanity check of the model on this machine: ceilings measured here, then an offloaded CPU
    forward timed. The CPU shares its cores between copies and compute, so only the order of
    magnitude is checked here; the GPU validation is in BENCHMARKS.md."""
    torch.manual_seed(0)
    model = Stack(blocks=6, d=512, f=2048)
    a = torch.randn(2048, 2048)
    t = time.perf_counter()
    for _ in range(3):
        a @ a
    tflops = 3 * 2 * 2048**3 / (time.perf_counter() - t) / 1e12
    src = torch.empty(1 << 26, dtype=torch.uint8)
    dst = torch.empty_like(src)
    t = time.perf_counter()
    dst.copy_(src)
    gbps = src.numel() / (time.perf_counter() - t) / 1e9
    with torch.device("meta"):
        meta = Stack(blocks=6, d=512, f=2048)
    pred = predict(meta, None, 1024, Ceilings(h2d_gbps=gbps, tflops=tflops, efficiency=1.0))
    ramtorch.offload(model, device="cpu")
    x = torch.randn(1024, 512)
    with torch.no_grad():
        model(x)
        t = time.perf_counter()
        for _ in range(3):
            model(x)
        measured = (time.perf_counter() - t) / 3
    assert pred.forward_seconds / 4 < measured < pred.forward_seconds * 4


def test_cli_prints_the_plan_and_rejects_bad_models(tmp_path):
    (tmp_path / "factory.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def make():\n"
        "    return nn.ModuleDict({'blocks': nn.ModuleList(nn.Linear(64, 64) for _ in range(4))})\n"
        "def bad():\n    return 3\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "ramtorch", "plan", "--model"]
    ok = subprocess.run(
        [*cmd, "factory:make", "--budget", "60KB", "--tokens", "8"], capture_output=True, text=True, env=env
    )
    assert ok.returncode == 0, ok.stderr
    assert "predicted forward" in ok.stdout and "resident" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "ramtorch", "plan", "--model", "factory:bad"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert bad.returncode == 2 and "not an nn.Module" in bad.stderr
    small = subprocess.run([*cmd, "factory:make", "--budget", "1KB"], capture_output=True, text=True, env=env)
    assert small.returncode == 2 and "at least" in small.stderr


def test_auto_budget_needs_cuda():
    with pytest.raises(ValueError, match="auto"):
        ramtorch.offload(Stack(), gpu_budget="auto", device="cpu")


def test_build_meta_model_errors():
    with pytest.raises(ValueError, match="config.json"):
        build_meta_model("no_colon_here")


@pytest.mark.parametrize("field", ["h2d_gbps", "d2h_gbps", "tflops", "efficiency", "host_gbps"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_ceilings_must_be_positive_and_finite(field, value):
    with pytest.raises(ValueError, match=field):
        Ceilings(**{field: value})
    with pytest.raises(ValueError, match="efficiency"):
        Ceilings(efficiency=1.5)


@pytest.mark.parametrize("flag", ["--h2d-gbps", "--tflops", "--efficiency"])
@pytest.mark.parametrize("value", ["0", "-3", "nan"])
def test_cli_rejects_bad_ceilings_with_a_clear_error(flag, value, capsys):
    from ramtorch.__main__ import main

    assert main(["plan", "--model", "no_such_module:make", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ramtorch plan: ") and flag[2:].replace("-", "_") in err and "Traceback" not in err


# -- host memory in training -------------------------------------------------------------------------


def _state_bytes(opt: torch.optim.Optimizer, p: torch.Tensor) -> int:
    return sum(
        v.numel() * v.element_size()
        for k, v in opt.state[p].items()
        if k != "step" and isinstance(v, torch.Tensor)
    )


@pytest.mark.parametrize("precision", ["fp32-master", "bf16", "compact"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(7,), (300, 17), (1024, 3)])
def test_the_plan_counts_the_optimizer_states_ramtorch_keeps(precision, dtype, shape):
    """The bytes the plan prices for a parameter's AdamW states are those the optimizer holds
    after a step, for every precision (the compact format's per-block scales included)."""
    from ramtorch.plan import optimizer_bytes

    p = nn.Parameter(torch.randn(shape).to(dtype))
    p.grad = torch.randn(shape).to(dtype)
    opt = ramtorch.optim.AdamW([p], lr=1e-3, precision=precision, overlap=False)
    opt.step()
    held, moved = optimizer_bytes(p, precision)
    assert held == _state_bytes(opt, p)
    size = p.numel() * p.element_size()
    assert moved >= 2 * held + 2 * size  # every state read and written, the gradient read
    with torch.device("meta"):
        meta = nn.Parameter(torch.empty(shape, dtype=dtype))
    assert optimizer_bytes(meta, precision) == (held, moved)


def test_the_step_bytes_match_the_documented_figures():
    from ramtorch.plan import optimizer_bytes

    p = torch.empty(256 * 1024, dtype=torch.bfloat16, device="meta")
    per = {prec: optimizer_bytes(p, prec)[1] / p.numel() for prec in ("fp32-master", "bf16", "compact")}
    assert per["fp32-master"] == 28  # the issue of record: 28 bytes a bf16 parameter a step
    assert per["bf16"] == 14
    assert per["compact"] == pytest.approx(14.06, abs=0.01)


def test_host_memory_of_training_streamed_and_host_states():
    m = meta_stack(blocks=4, d=64, f=256)
    params = sum(p.numel() for p in m.parameters())
    full = predict(m, None, 16)
    weights = sum(u.bytes for u in full.units if not u.resident)
    assert full.host_weight_bytes == weights > 0
    # fp32 parameters with fp32 masters: a gradient (4) and two fp32 moments (8) per streamed one.
    streamed = sum(u.params for u in full.units if not u.resident)
    assert full.host_training_bytes == streamed * 12
    # Everything resident: no host bytes, unless the states live in host RAM.
    big = predict(m, "1GiB", 16)
    assert big.host_weight_bytes == 0 and big.host_training_bytes == 0
    assert big.resident_training_bytes == params * 12
    host = predict(m, "1GiB", 16, states="host")
    # Moments and the page-locked gradient (12), and the host copy of the weight the kernels
    # update (4): the memory that a resident parameter's states="host" holds (optim._resident).
    assert host.host_training_bytes == params * 16
    assert host.resident_training_bytes == params * 4  # the gradients stay on the device
    assert host.summary().count("states in host RAM") == 2


def test_the_plan_says_whether_training_fits_in_host_memory(tmp_path):
    with torch.device("meta"):
        m = Stack(blocks=4, d=64, f=256).to(torch.bfloat16)
    need = {}
    for precision in ("fp32-master", "bf16", "compact"):
        pred = predict(m, None, 16, precision=precision)
        need[precision] = pred.host_weight_bytes + pred.host_training_bytes
        assert pred.fits_host is None and "fit" not in pred.summary()
    # bf16 weights: 2 + 2 (gradient) + 12 (master, moments) bytes with fp32 masters, 2 + 2 + 4
    # with bf16 moments, 2 + 2 + 2.03 + 2 (compensation) compact.
    assert need["fp32-master"] > need["compact"] > need["bf16"]
    small = predict(m, None, 16, host_memory=need["fp32-master"])  # no room left for the reserve
    assert small.fits_host is False and "does NOT fit" in small.summary()
    room = predict(m, None, 16, host_memory=need["fp32-master"] + (2 << 30))
    assert room.fits_host is True and "fits in" in room.summary()
    assert predict(m, None, 16, host_memory="auto").host_memory > 0
    for bad in ({"precision": "fp8"}, {"states": "disk"}, {"host_memory": "lots"}):
        with pytest.raises(ValueError):
            predict(m, None, 16, **bad)


def test_cli_prices_the_optimizer_and_checks_host_memory(tmp_path):
    (tmp_path / "factory2.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def make():\n"
        "    return nn.ModuleDict({'blocks': nn.ModuleList(nn.Linear(64, 64) for _ in range(4))})\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "ramtorch", "plan", "--model", "factory2:make"]
    out = subprocess.run(
        [*cmd, "--precision", "compact", "--host-memory", "1KiB", "--json"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["precision"] == "compact" and got["fits_host"] is False and got["host_memory"] == 1024
    assert got["host_bytes_per_param"] > 0
    bad = subprocess.run([*cmd, "--precision", "fp8"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "--precision" in bad.stderr
