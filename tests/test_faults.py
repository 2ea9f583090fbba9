"""Bad input and faults: clear exceptions naming the layer, never a crash or a hang."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import ramtorch
import ramtorch.nn as rnn
import torch
from torch import nn

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def test_wrong_last_dimension_names_the_layer():
    layer = rnn.Linear(8, 4)
    with pytest.raises(ValueError, match=r"Linear\(8, 4\).*last dimension must be 8.*\(3, 5\)"):
        layer(torch.randn(3, 5))
    with pytest.raises(ValueError, match="last dimension"):
        layer(torch.tensor(1.0))


def test_unsupported_dtypes_are_clear():
    layer = rnn.Linear(8, 4)
    with pytest.raises(TypeError, match="not floating point"):
        layer(torch.ones(2, 8, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"float64 does not match the weight dtype torch.float32"):
        layer(torch.ones(2, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="dtype must be one of"):
        rnn.Linear(8, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="in_features"):
        rnn.Linear(-1, 4)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        layer([1.0] * 8)


def test_missing_gpu_is_a_clear_error():
    layer = rnn.Linear(4, 4)
    bad = "cuda:63"
    with pytest.raises(RuntimeError, match=r"Linear\(4, 4\)"):
        layer.to(bad)
    assert layer.compute_device == torch.device("cpu"), "a failed move leaves the layer usable"
    layer(torch.randn(1, 4))
    with pytest.raises(RuntimeError, match="cuda:63|CUDA"):
        rnn.Linear(4, 4, device=bad)
    with pytest.raises(RuntimeError, match=r"Linear\(4, 4\).*(meta|cannot)"):
        layer.to("meta")


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"MAX_INFLIGHT": "zero"}, "MAX_INFLIGHT='zero' is not an integer"),
        ({"RAMTORCH_MAX_INFLIGHT": "0"}, "environment variable RAMTORCH_MAX_INFLIGHT must be between"),
        ({"MAX_INFLIGHT": "3", "RAMTORCH_MAX_INFLIGHT": "-2"}, "RAMTORCH_MAX_INFLIGHT"),
    ],
)
def test_invalid_max_inflight_names_the_variable(monkeypatch, env, match):
    for k in ("MAX_INFLIGHT", "RAMTORCH_MAX_INFLIGHT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        rnn.Linear(4, 4)


def test_max_inflight_precedence(monkeypatch):
    monkeypatch.setenv("MAX_INFLIGHT", "3")
    assert rnn.Linear(2, 2).max_inflight == 3
    monkeypatch.setenv("RAMTORCH_MAX_INFLIGHT", "5")
    assert rnn.Linear(2, 2).max_inflight == 5
    assert rnn.Linear(2, 2, max_inflight=1).max_inflight == 1
    with pytest.raises(ValueError, match="max_inflight must be between"):
        rnn.Linear(2, 2, max_inflight=0)
    with pytest.raises(TypeError, match="max_inflight must be an int"):
        rnn.Linear(2, 2, max_inflight=2.5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("streaming", ["replace_linear", "offload"])
def test_interrupt_mid_forward_and_mid_backward_leaves_engine_usable(device, streaming):
    """After a forward or a backward that raised, the next backward's gradients are torch's (an
    offloaded model used to lose every later gradient: the raised backward's end-of-backward
    callback never ran, and the next backward queued none)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)]).to(device)
    ref = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)]).to(device)
    ref.load_state_dict(model.state_dict())
    if streaming == "offload":
        model.cpu()
        ramtorch.offload(model, device=device)
    else:
        ramtorch.replace_linear(model)

    def interrupt(*_):
        raise KeyboardInterrupt

    h = model[3].register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(2, 16, device=device))
    h.remove()
    x = torch.randn(2, 16, device=device, requires_grad=True)
    y = model(x)
    th = y.register_hook(lambda g: g)
    hook = model[2].weight.register_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        y.sum().backward()
    hook.remove()
    th.remove()
    model.zero_grad(set_to_none=True)
    x = torch.randn(2, 16, device=device)
    model(x).sum().backward()
    ref(x).sum().backward()
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(a.grad.cpu(), b.grad.cpu())


def _run(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
    )


def test_interpreter_exit_is_clean_with_work_in_flight():
    r = _run(
        """
        import torch, ramtorch
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        layers = [ramtorch.nn.Linear(64, 64, device=dev) for _ in range(8)]
        x = torch.randn(4, 64, device=dev, requires_grad=True)
        for l in layers:
            x = l(x)
        x.sum().backward()
        y = layers[0](torch.randn(4, 64, device=dev))  # left in flight at exit
        print("done")
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "done" and "Error" not in r.stderr and "panicked" not in r.stderr


def test_dataloader_with_forked_workers_next_to_the_engine():
    r = _run(
        """
        import torch, ramtorch
        from torch.utils.data import DataLoader, TensorDataset
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        rl = ramtorch.nn.Linear
        model = torch.nn.Sequential(rl(8, 8), torch.nn.ReLU(), rl(8, 1)).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ds = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
        dl = DataLoader(ds, batch_size=32, num_workers=2, multiprocessing_context="fork")
        for epoch in range(2):
            for xb, yb in dl:
                loss = torch.nn.functional.mse_loss(model(xb.to(dev)), yb.to(dev))
                loss.backward(); opt.step(); opt.zero_grad()
        print("ok", float(loss))
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok")


def test_stats_count_the_bytes_that_moved():
    layer = rnn.Linear(32, 16)
    eng_before = ramtorch.stats()["devices"].get("cpu", {"h2d_bytes": 0, "d2h_bytes": 0, "reused_bytes": 0})
    x = torch.randn(3, 32, requires_grad=True)
    layer(x).sum().backward()
    eng = ramtorch.stats()["devices"]["cpu"]
    unit = 32 * 16 * 4 + 64  # weight, bias aligned to 64 bytes
    copied = eng["h2d_bytes"] - eng_before["h2d_bytes"]
    reused = eng["reused_bytes"] - eng_before["reused_bytes"]
    assert copied == unit, "forward copies the unit"
    assert reused == unit, "backward finds it still in its slot"
    assert eng["d2h_bytes"] - eng_before["d2h_bytes"] == (32 * 16 + 16) * 4, "weight and bias grads"
    host = ramtorch.stats()["host"]
    assert host["in_use_bytes"] <= host["reserved_bytes"]


def test_cuda_failures_are_python_exceptions_naming_the_operation():
    from ramtorch import _core

    with pytest.raises(ramtorch.CudaError, match=r"Engine\(\): CUDA is not available: .*(cuda:63|libcuda)"):
        _core.Engine("cuda", 63)
    with pytest.raises(ValueError, match="unsupported device type"):
        _core.Engine("tpu")
    eng = _core.Engine("cpu")
    with pytest.raises(ValueError, match=r"acquire: a unit of 64 bytes does not fit"):
        eng.acquire(0, 64, 2, 0)
    with pytest.raises(ValueError, match="release: no device slot 5"):
        eng.release(5, 0)


def test_importing_ramtorch_does_not_load_the_compiler():
    """``import ramtorch`` stays light: torch's compiler stack (about a second to import) loads
    only when a user compiles."""
    r = _run("import sys, ramtorch; print('torch._dynamo' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_exit_does_not_hang_on_an_optimizer_job_that_never_ends():
    """Interpreter exit waits for queued optimizer jobs, but a bounded time: a job blocked on
    something the exiting program will never do leaves with a message instead of a hang."""
    code = (
        "import threading, ramtorch.optim._jobs as j\n"
        "j.EXIT_WAIT_SECONDS = 0.5\n"
        "q = j._Jobs()\n"
        "q.submit(threading.Event().wait)\n"
        "print('submitted', flush=True)\n"
    )
    r = _run(code, timeout=300)
    assert "submitted" in r.stdout, r.stderr
    assert "did not finish" in r.stderr, r.stderr
