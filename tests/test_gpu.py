"""GPU-only behaviour: pinned memory, device memory bound, autocast with GradScaler, devices."""

from __future__ import annotations

import copy

import pytest
import ramtorch
import ramtorch.nn as rnn
import torch
from torch import nn

pytestmark = pytest.mark.gpu


def test_parameters_and_grads_are_pinned_arena_memory():
    layer = rnn.Linear(1024, 1024, device="cuda")
    assert layer.weight.device.type == "cpu" and layer.weight.is_pinned()
    layer(torch.randn(4, 1024, device="cuda")).sum().backward()
    assert layer.weight.grad.is_pinned() and layer.bias.grad.is_pinned()
    layer.zero_grad()
    layer(torch.randn(4, 1024, device="cuda")).sum().backward()
    assert layer.weight.grad.is_pinned()
    host = ramtorch.stats()["host"]
    assert host["pinned_bytes"] > 0 and host["pinning"]


def test_gpu_memory_for_weights_is_max_inflight_plus_one_layers():
    n, d = 12, 2048
    model = nn.Sequential(*[rnn.Linear(d, d, bias=False, device="cuda", max_inflight=2) for _ in range(n)])
    torch.cuda.synchronize()
    x = torch.randn(8, d, device="cuda")
    with torch.no_grad():
        model(x)
    s = ramtorch.stats()["devices"]["cuda:0"]
    layer_bytes = d * d * 4
    assert s["slots"] == 3 and s["slot_bytes"] == layer_bytes
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        model(x)
    assert torch.cuda.max_memory_allocated() - base < layer_bytes, "no weight memory beyond the slots"
    assert base < 4 * layer_bytes + 64 * 2**20


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_and_grad_scaler_match_nn_linear(dtype):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 8)).cuda()
    ours = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 8)).cuda()
    ours.load_state_dict(ref.state_dict())
    ramtorch.replace_linear(ours)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, ours)]
    scalers = [torch.amp.GradScaler("cuda", enabled=dtype == torch.float16) for _ in range(2)]
    for step in range(5):
        x = torch.randn(16, 64, device="cuda")
        losses = []
        for m, opt, sc in zip((ref, ours), opts, scalers):
            with torch.autocast("cuda", dtype=dtype):
                loss = m(x).float().pow(2).mean()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=2e-2), step
    assert ours[0].weight.dtype == torch.float32 and ours[0].weight.device.type == "cpu"


def test_input_on_the_wrong_device_names_the_layer():
    layer = rnn.Linear(4, 4, device="cuda")
    with pytest.raises(RuntimeError, match=r"Linear\(4, 4\).*input is on cpu.*cuda:0"):
        layer(torch.randn(2, 4))
    cpu_layer = rnn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="input is on cuda:0"):
        cpu_layer(torch.randn(2, 4, device="cuda"))


def test_model_cuda_moves_compute_not_weights():
    model = nn.Sequential(rnn.Linear(8, 8)).cuda()
    assert model[0].compute_device == torch.device("cuda", 0)
    assert model[0].weight.device.type == "cpu" and model[0].weight.is_pinned()
    out = model(torch.randn(2, 8, device="cuda"))
    assert out.device.type == "cuda"
    model.cpu()
    assert model(torch.randn(2, 8)).device.type == "cpu"


def test_non_default_stream():
    ref = nn.Linear(32, 32).cuda()
    ours = rnn.Linear.from_linear(ref)
    s = torch.cuda.Stream()
    x = torch.randn(4, 32, device="cuda")
    torch.cuda.current_stream().synchronize()
    with torch.cuda.stream(s):
        y = ours(x)
        y.sum().backward()
    s.synchronize()
    torch.testing.assert_close(y, ref(x))


def _mlp_stack(blocks: int, d: int, f: int) -> nn.Module:
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(d, f, bias=False), nn.GELU(), nn.Linear(f, d, bias=False))
                for _ in range(blocks)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x

    return Stack()


@pytest.mark.gpu
@pytest.mark.parametrize("resident_blocks", [0, 2])
def test_offload_peak_gpu_memory_stays_within_budget(resident_blocks):
    torch.manual_seed(0)
    model = _mlp_stack(8, 1024, 4096)  # 32 MiB a block in fp32
    block = 2 * 1024 * 4096 * 4
    budget = 3 * block + resident_blocks * block + (1 << 20)
    ref = copy.deepcopy(model).cuda()
    ramtorch.offload(model, gpu_budget=budget, device="cuda")
    s = model._ramtorch_streamer.stats()
    assert s["gpu_bytes"] <= budget
    assert len(s["resident_units"]) >= resident_blocks  # two slots can leave room for one more
    x = torch.randn(4, 1024, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        y = model(x)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= budget + (2 << 20)
    torch.testing.assert_close(y, ref(x), rtol=1e-4, atol=1e-4)
    # Training: ramtorch's share stays within the budget; on top of it come torch's own gradients
    # of resident blocks and the weight gradients in flight to the host.
    torch.cuda.reset_peak_memory_stats()
    model(x).square().mean().backward()
    torch.cuda.synchronize()
    allowance = resident_blocks * block + 3 * block + (16 << 20)
    assert torch.cuda.max_memory_allocated() - base <= budget + allowance
    ref(x).square().mean().backward()
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad.to(p.grad.device), rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.gpu
def test_offload_on_a_side_stream_matches():
    torch.manual_seed(0)
    model = _mlp_stack(4, 256, 512)
    ref = copy.deepcopy(model).cuda()
    ramtorch.offload(model, device="cuda")
    x = torch.randn(8, 256, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            y = model(x)
            y.square().mean().backward()
    torch.cuda.current_stream().wait_stream(s)
    torch.testing.assert_close(y, ref(x), rtol=1e-4, atol=1e-4)
    stats = ramtorch.stats()["devices"]["cuda:0"]
    assert stats["h2d_gbps"] > 1 and stats["stall_seconds"] >= 0


_PINNING_CHILD = r"""
import json, warnings
import torch, ramtorch
from torch import nn

warnings.simplefilter("always")
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)]).cuda()
with warnings.catch_warnings(record=True) as caught:
    ramtorch.offload(model)
    opt = ramtorch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(5):
        x = torch.randn(32, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    ramtorch.synchronize()
pin = [str(w.message) for w in caught if "page-locking" in str(w.message)]
print(json.dumps({
    "pinned_bytes": ramtorch.stats()["host"]["pinned_bytes"],
    "pin_warnings": pin,
    "weights": [p.detach().double().sum().item() for p in model.parameters()],
}))
"""


def _run_pinning_child(limited: bool) -> dict:
    import json
    import resource
    import shutil
    import subprocess
    import sys

    cmd = [sys.executable, "-c", _PINNING_CHILD]
    if limited and shutil.which("setpriv") is not None:
        # A root process may lock memory whatever its limit (CAP_IPC_LOCK): drop that capability.
        cmd = ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", *cmd]

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, 64 << 10))

    p = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, preexec_fn=limit if limited else None
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_pinning_refused_by_ulimit_warns_once_and_trains_the_same():
    """Under a small ``ulimit -l`` the arena falls back to pageable memory with one warning, and
    training gives the numbers of the pinned run."""
    pinned = _run_pinning_child(limited=False)
    assert pinned["pinned_bytes"] > 0 and not pinned["pin_warnings"]
    limited = _run_pinning_child(limited=True)
    if limited["pinned_bytes"] > 0:
        pytest.skip("this driver page-locks host memory regardless of ulimit -l (nothing to fall back from)")
    assert len(limited["pin_warnings"]) == 1, limited["pin_warnings"]
    assert limited["weights"] == pytest.approx(pinned["weights"], rel=1e-6, abs=1e-6)
