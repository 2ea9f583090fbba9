"""offload(host_budget=..., disk=...): units past the host budget live in a store file on disk.

Checked against the same model offloaded with every unit in host RAM (forward, gradients, several
optimizer steps, bitwise), which units go to disk, edits between passes, a full disk (a clear
error, the model untouched), a crash (nothing left behind), and the store's reads themselves."""

from __future__ import annotations

import copy
import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import ramtorch
import ramtorch.optim as ropt
import torch
from ramtorch import _arena, _core
from ramtorch._stream.units import _packed_bytes
from safetensors.torch import save_file
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))


class Net(nn.Module):
    def __init__(self, width: int = 48, depth: int = 6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width, dtype=dtype)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width, dtype=dtype), nn.Linear(width, width, dtype=dtype), nn.GELU())
            for _ in range(depth)
        )
        self.out = nn.Linear(width, 5, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.out(h)


def _bytes(m: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


def _unit_bytes(m: nn.Module) -> int:
    return _packed_bytes(list(m.parameters()))  # as a unit packs them (each tensor 64-byte aligned)


def _pair(tmp_path, dtype=torch.float32, host_units: int = 3, seed: int = 0):
    torch.manual_seed(seed)
    base = Net(dtype=dtype)
    ram, disk = copy.deepcopy(base), copy.deepcopy(base)
    ramtorch.offload(ram, device="cpu")
    budget = _unit_bytes(base.inp) + host_units * _unit_bytes(base.blocks[0])
    ramtorch.offload(disk, device="cpu", host_budget=budget, disk=tmp_path)
    return ram, disk


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "torch":
        return torch.optim.AdamW(params, lr=1e-2)
    if kind == "ramtorch":
        return ropt.AdamW(params, lr=1e-2)
    return ropt.AdamW(params, lr=1e-2, pipeline=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("opt", ["torch", "ramtorch", "ramtorch-pipelined"])
def test_training_on_disk_equals_the_model_in_ram(tmp_path, dtype: torch.dtype, opt: str):
    ram, disk = _pair(tmp_path, dtype)
    st = ramtorch.stats(disk)
    assert st["disk_units"] == ["blocks.3", "blocks.4", "blocks.5", "out"]
    assert os.listdir(tmp_path) == []  # the store's name is gone at once
    opts = [_optimizer(opt, m.parameters()) for m in (ram, disk)]
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(7, 16, generator=g, dtype=dtype)
        outs = []
        for m, o in zip((ram, disk), opts):
            o.zero_grad()
            y = m(x)
            y.float().square().mean().backward()
            outs.append(y)
        assert torch.equal(outs[0], outs[1])
        for (n, a), b in zip(ram.named_parameters(), disk.parameters()):
            assert torch.equal(a.grad, b.grad), n
        for o in opts:
            o.step()
    for (n, a), b in zip(ram.state_dict().items(), disk.state_dict().values()):
        assert torch.equal(a, b), n
    st = ramtorch.stats(disk)
    assert st["disk_read_bytes"] > 0 and st["disk_reads_ahead"] > 0
    assert st["host_bytes"] < _bytes(disk)
    assert st["disk_cached_chunks"] > 0  # the backward's reads of units the optimizer writes next


def test_the_first_units_fill_the_host_budget(tmp_path):
    torch.manual_seed(0)
    base = Net()
    every = copy.deepcopy(base)
    ramtorch.offload(every, device="cpu", host_budget=0, disk=tmp_path)  # every streamed unit on disk
    st = ramtorch.stats(every)
    assert sorted(st["disk_units"]) == sorted(["inp", *[f"blocks.{k}" for k in range(6)], "out"])
    assert st["host_bytes"] == 0
    roomy = copy.deepcopy(base)
    ramtorch.offload(roomy, device="cpu", host_budget=_bytes(base), disk=tmp_path)
    assert "disk_units" not in ramtorch.stats(roomy)  # everything fits: no store at all
    auto = copy.deepcopy(base)
    ramtorch.offload(auto, device="cpu", disk=tmp_path)  # no host budget: what the machine has free
    assert "disk_units" not in ramtorch.stats(auto)
    x = torch.randn(3, 16)
    assert torch.equal(every(x), base(x)) and torch.equal(roomy(x), base(x)) and torch.equal(auto(x), base(x))
    assert os.listdir(tmp_path) == []


def test_the_automatic_host_budget_is_the_free_memory_less_a_reserve(monkeypatch):
    from ramtorch import _disk

    gib = 1 << 30
    monkeypatch.setattr(_disk, "_meminfo", lambda: {"MemTotal": 128 * gib, "MemAvailable": 100 * gib})
    assert _disk.auto_host_budget(2 * gib) == 100 * gib - int(12.8 * gib) - 5 * 2 * gib
    monkeypatch.setattr(_disk, "_meminfo", lambda: {"MemTotal": 8 * gib, "MemAvailable": 1 * gib})
    assert _disk.auto_host_budget(gib) == 0


def test_edits_between_passes_and_loads_are_seen(tmp_path):
    ram, disk = _pair(tmp_path, host_units=1)
    x = torch.randn(4, 16)
    for m in (ram, disk):
        m(x)
    for m in (ram, disk):
        with torch.no_grad():
            m.blocks[4][1].weight.data.mul_(-2.0)  # no version counter sees this
    assert torch.equal(ram(x), disk(x))
    torch.manual_seed(5)
    sd = Net().state_dict()
    for m in (ram, disk):
        m.load_state_dict(sd)
    assert torch.equal(ram(x), disk(x))
    assert torch.equal(disk.blocks[5][1].weight, sd["blocks.5.1.weight"])


def test_a_model_built_without_weights_loads_into_the_disk_units(tmp_path):
    torch.manual_seed(2)
    ref = Net(dtype=torch.bfloat16)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    with torch.device("meta"):
        m = Net(dtype=torch.bfloat16)
    store = tmp_path / "store"
    store.mkdir()
    ramtorch.offload(m, device="cpu", host_budget=_unit_bytes(ref.inp), disk=store)
    assert len(ramtorch.stats(m)["disk_units"]) == 7
    ramtorch.load(m, path)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    assert torch.equal(m(x), ref(x))
    for (n, a), b in zip(ref.state_dict().items(), m.state_dict().values()):
        assert torch.equal(a, b), n
    assert ramtorch.stats(m)["disk_settled_bytes"] > 0


@pytest.mark.parametrize("compress", ["lossless", "fp8"])
def test_compressed_units_on_disk_read_their_encoded_bytes(tmp_path, compress: str):
    torch.manual_seed(6)
    base = Net(width=256, dtype=torch.bfloat16).requires_grad_(False)
    ram, disk = copy.deepcopy(base), copy.deepcopy(base)
    ramtorch.offload(ram, device="cpu", compress=compress)
    ramtorch.offload(disk, device="cpu", compress=compress, host_budget=0, disk=tmp_path)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        want = base(x)
        for _ in range(2):
            got = disk(x)
            assert torch.equal(got, ram(x))  # the same encoding, read from disk or from RAM
            if compress == "lossless":
                assert torch.equal(got, want)
    st = ramtorch.stats(disk)
    assert st["compressed_units"] and st["disk_units"]
    raw = st["streamed_bytes_per_pass"]
    assert st["disk_read_bytes"] < 2 * raw * (0.75 if compress == "lossless" else 0.6)  # two passes
    # An edit torch counts is encoded again, into the unit's encoded extent.
    with torch.no_grad():
        for m in (base, ram, disk):
            m.blocks[3][1].weight.mul_(0.5)
        assert torch.equal(disk(x), ram(x))
        if compress == "lossless":
            assert torch.equal(disk(x), base(x))


def test_a_failed_read_names_the_unit_and_the_model_recovers(tmp_path, monkeypatch):
    from ramtorch import _disk

    ram, disk = _pair(tmp_path, host_units=1)
    x = torch.randn(2, 16)
    real_wait = _disk.Read.wait

    def failing(self):  # noqa: ANN001, ANN202
        raise OSError(errno.EIO, "DiskStore.read: reading bytes 0..+4096 of the store: Input/output error")

    monkeypatch.setattr(_disk.Read, "wait", failing)
    with pytest.raises(
        OSError, match=r"reading unit 'blocks\.\d' from its disk store failed.*Input/output"
    ) as e:
        disk(x)
    assert e.value.errno == errno.EIO
    monkeypatch.setattr(_disk.Read, "wait", real_wait)
    for _ in range(2):
        assert torch.equal(disk(x), ram(x))
    loss = disk(x).square().mean()
    loss.backward()
    ref = ram(x).square().mean()
    ref.backward()
    for (n, a), b in zip(ram.named_parameters(), disk.parameters()):
        assert torch.equal(a.grad, b.grad), n


def test_the_trace_shows_disk_reads_and_waits(tmp_path):
    import json

    _, disk = _pair(tmp_path, host_units=0)
    x = torch.randn(2, 16)
    disk(x)  # (the itinerary)
    path = tmp_path / "trace.json"
    with ramtorch.trace(path):
        with torch.no_grad():
            disk(x)
    events = json.loads(path.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    tracks = {
        e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"
    }
    reads = [e for e in events if e.get("ph") == "X" and tracks.get(e["tid"]) == "disk reads"]
    names = {e["args"]["units"][0] if e["args"].get("units") else e["name"] for e in reads}
    assert len(reads) == len(ramtorch.stats(disk)["disk_units"]), names
    assert all(e["dur"] >= 0 and e["args"]["bytes"] > 0 for e in reads)


def test_inference_reads_ahead_along_the_itinerary(tmp_path):
    _, disk = _pair(tmp_path, host_units=0)
    x = torch.randn(2, 16)
    with torch.no_grad():
        for _ in range(3):
            disk(x)
    st = ramtorch.stats(disk)
    n = len(st["disk_units"])
    assert st["disk_reads"] == 3 * n
    # After the first pass, every disk unit is read ahead of its use.
    assert st["disk_reads_on_demand"] <= n


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="host_budget= needs disk="):
        ramtorch.offload(Net(), device="cpu", host_budget="1MiB")
    with pytest.raises(ValueError, match="not a directory"):
        ramtorch.offload(Net(), device="cpu", disk=tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        ramtorch.offload(Net(), device="cpu", disk=tmp_path / "file")
    with pytest.raises(TypeError, match="disk must be a directory path"):
        ramtorch.offload(Net(), device="cpu", disk=3)
    with pytest.raises(ValueError, match="host_budget"):
        ramtorch.offload(Net(), device="cpu", disk=tmp_path, host_budget="-1GiB")


def _env() -> dict[str, str]:
    # The ramtorch this process imported (a source tree, or an installed wheel), and these tests.
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(ramtorch.__file__)))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([pkg, HERE])}


def _child(code: str, tmp_path) -> subprocess.CompletedProcess:
    env = _env()
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        cwd=str(tmp_path),
    )


def test_a_full_disk_is_a_clear_error_and_the_model_is_untouched(tmp_path):
    # A file size limit stands in for a full disk: the store is allocated whole at offload, so
    # the error comes there (not as a SIGBUS on a later write), and nothing of the model moved.
    code = f"""
        import errno, resource, signal, torch, ramtorch
        from test_disk import Net
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        torch.manual_seed(0)
        m = Net(width=256)
        before = {{k: v.clone() for k, v in m.state_dict().items()}}
        try:
            ramtorch.offload(m, device="cpu", host_budget=0, disk={str(tmp_path)!r})
        except OSError as e:
            assert e.errno in (errno.EFBIG, errno.ENOSPC), e
            assert "allocating" in str(e) and "bytes" in str(e), e
            print("refused:", e)
        else:
            raise SystemExit("offload did not refuse")
        assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
        assert getattr(m, "_ramtorch_streamer", None) is None
        ramtorch.offload(m, device="cpu")  # still a model: offloaded to RAM instead
        x = torch.randn(2, 16)
        print("ok", m(x).shape)
    """
    r = _child(code, tmp_path)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "refused:" in r.stdout
    assert os.listdir(tmp_path) == []


def test_a_crash_leaves_nothing_on_disk(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    code = f"""
        import os, sys, torch, ramtorch
        from test_disk import Net
        m = Net()
        ramtorch.offload(m, device="cpu", host_budget=0, disk={str(store)!r})
        m(torch.randn(2, 16))
        print("running", flush=True)
        sys.stdin.read()  # until killed
    """
    _kill_once_running(code, store)
    assert os.listdir(store) == []


def _kill_once_running(code: str, store) -> None:
    """Runs ``code`` in a child, which prints ``running`` and goes on; then SIGKILLs it. The store
    directory is empty while it runs (the store files' names are gone at once)."""
    p = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = p.stdout.readline()  # waits as long as the child takes to start (no timeout)
        assert line.strip() == "running", line + p.stderr.read()
        assert os.listdir(store) == []
        p.send_signal(signal.SIGKILL)
    finally:
        p.kill()
        p.wait()


def test_store_reads_land_in_staging_and_errors_name_the_file(tmp_path):
    s = _core.DiskStore(str(tmp_path), 3 << 20, 2)
    m = torch.from_dlpack(s.mapping())
    m.copy_(torch.arange(m.numel()).remainder(251).to(torch.uint8))
    s.settle(0, m.numel())
    dst = _arena.host_bytes(1 << 20)
    for off, n in [(0, 1 << 20), (4096, 8192), (123, 1000)]:
        t = s.read(dst, off, n)
        t.wait()
        assert t.done() and torch.equal(dst[:n], m[off : off + n])
    with pytest.raises(ValueError, match="outside the disk store"):
        s.read(dst, (3 << 20) - 10, 4096)
    with pytest.raises(ValueError, match="not inside memory ramtorch allocated"):
        s.read(torch.empty(4096, dtype=torch.uint8), 0, 4096)
    with pytest.raises(OSError) as e:
        _core.DiskStore(str(tmp_path / "missing"), 4096, 1)
    assert e.value.errno == errno.ENOENT and "missing" in str(e.value)
    st = s.stats()
    assert st["reads"] == 3 and st["read_bytes"] == (1 << 20) + 8192 + 1000


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_disk_units_on_cuda(tmp_path, dtype: torch.dtype):
    """On the GPU: forward and a few training steps equal the model with every unit in RAM."""
    torch.manual_seed(3)
    base = Net(width=256, dtype=dtype)
    ram, disk = copy.deepcopy(base), copy.deepcopy(base)
    ramtorch.offload(ram, gpu_budget=_bytes(base) // 2)
    ramtorch.offload(disk, gpu_budget=_bytes(base) // 2, host_budget=_bytes(base) // 3, disk=tmp_path)
    assert ramtorch.stats(disk)["disk_units"]
    opts = [ropt.AdamW(m.parameters(), lr=1e-3) for m in (ram, disk)]
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(8, 16, generator=g, dtype=dtype).cuda()
        ys = []
        for m, o in zip((ram, disk), opts):
            o.zero_grad()
            y = m(x)
            y.float().square().mean().backward()
            o.step()
            ys.append(y)
        assert torch.equal(ys[0], ys[1])
    with torch.no_grad():
        assert torch.equal(ram(x), disk(x))
    for (n, a), b in zip(ram.state_dict().items(), disk.state_dict().values()):
        assert torch.equal(a, b), n


def test_the_plan_puts_the_units_offload_puts_on_disk_and_prices_their_reads(tmp_path):
    from ramtorch.plan import Ceilings, predict

    torch.manual_seed(0)
    real = Net()
    with torch.device("meta"):
        meta = Net()
    budget = _unit_bytes(real.inp) + 2 * _unit_bytes(real.blocks[0])
    ramtorch.offload(real, device="cpu", host_budget=budget, disk=tmp_path)
    c = Ceilings(disk_gbps=0.001)
    pred = predict(meta, None, 64, c, host_budget=budget)
    assert pred.disk_units == ramtorch.stats(real)["disk_units"]
    assert pred.disk_bytes == sum(_unit_bytes(m) for m in [*real.blocks[2:], real.out])
    floor = pred.disk_bytes / (c.disk_gbps * 1e9)
    assert pred.forward_seconds >= floor and pred.disk_read_seconds_per_pass == pytest.approx(floor)
    assert pred.step_seconds >= floor + pred.disk_bytes / (c.disk_write_gbps * 1e9)
    assert "on disk (host budget" in pred.summary()
    assert predict(meta, None, 64, c).disk_units == []
    # With the states on disk: every streamed unit's, out of host memory, read and written once
    # a step, after backward; the budget holds the gradients first, then weights.
    grads = ramtorch._disk.grad_bytes(real.parameters())
    states = predict(
        meta, None, 64, c, host_budget=grads + budget, optimizer_on_disk=True, precision="fp32-master"
    )
    assert states.disk_units == pred.disk_units
    held = sum(8 * p.numel() for p in real.parameters())  # fp32: two fp32 moments, no master
    assert states.disk_state_bytes == held
    # Staging: the parameters in flight (read ahead, updated, written back), the largest ones.
    # (Two fp32 moments, each 4 KiB aligned in the parameter's extent: one piece at this size.)
    largest = max(2 * (-(-4 * p.numel() // 4096) * 4096) for p in real.parameters())
    assert states.disk_state_staging_bytes == ramtorch._disk.STATES_IN_FLIGHT * largest
    assert pred.host_training_bytes - states.host_training_bytes == held
    io = held / (c.disk_gbps * 1e9) + held / (c.disk_write_gbps * 1e9)
    assert states.step_seconds >= states.forward_backward_seconds + io
    assert "the streamed units' optimizer states on disk" in states.summary()
    # A budget the gradients alone exceed: every unit on disk.
    assert len(predict(meta, None, 64, c, host_budget=budget, optimizer_on_disk=True).disk_units) == 8
    with pytest.raises(ValueError, match="needs host_budget"):
        predict(meta, None, 64, c, optimizer_on_disk=True)


def test_sharing_disk_units_between_ranks_is_refused(tmp_path):
    code = f"""
        import socket, torch, torch.distributed as dist, ramtorch
        from ramtorch.distributed import share_parameters
        from test_disk import Net
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=0, world_size=1)
        m = Net()
        ramtorch.offload(m, device="cpu", host_budget=0, disk={str(tmp_path)!r})
        try:
            share_parameters(m)
        except ValueError as e:
            assert "live on disk" in str(e), e
            print("refused")
        dist.destroy_process_group()
    """
    r = _child(code, tmp_path)
    assert r.returncode == 0 and "refused" in r.stdout, r.stdout + r.stderr[-3000:]


def test_the_auto_budget_plan_logged_counts_the_disk(tmp_path, monkeypatch, caplog):
    import logging

    from ramtorch import _offload

    m = Net()
    budget = 4 * _unit_bytes(m.blocks[0])  # (for the device's free memory): most units stream
    monkeypatch.setattr(_offload, "_auto_budget", lambda dev: budget)
    with caplog.at_level(logging.INFO, logger="ramtorch"):
        ramtorch.offload(m, gpu_budget="auto", device="cpu", host_budget=0, disk=tmp_path)
    msg = next(r.getMessage() for r in caplog.records if "gpu_budget='auto'" in r.getMessage())
    n = len(ramtorch.stats(m)["disk_units"])
    assert f"; {n} units (" in msg and "on disk, read in" in msg, msg
    assert "and their optimizer states" not in msg
    caplog.clear()
    m = Net()
    with caplog.at_level(logging.INFO, logger="ramtorch"):
        ramtorch.offload(
            m, gpu_budget="auto", device="cpu", host_budget=0, disk=tmp_path, optimizer_on_disk=True
        )
    msg = next(r.getMessage() for r in caplog.records if "gpu_budget='auto'" in r.getMessage())
    assert "and their optimizer states (" in msg and "read and written once a step" in msg, msg


def _states_pair(tmp_path, dtype: torch.dtype, precision: str, **kw):
    torch.manual_seed(3)
    base = Net(dtype=dtype)
    ram, disk = copy.deepcopy(base), copy.deepcopy(base)
    ramtorch.offload(ram, device="cpu")
    # (The budget holds every streamed unit's gradients first, then the first units' weights.)
    budget = (
        ramtorch._disk.grad_bytes(base.parameters()) + _unit_bytes(base.inp) + 3 * _unit_bytes(base.blocks[0])
    )
    ramtorch.offload(disk, device="cpu", host_budget=budget, disk=tmp_path, optimizer_on_disk=True)
    opts = [ropt.AdamW(m.parameters(), lr=1e-2, precision=precision, **kw) for m in (ram, disk)]
    return ram, disk, opts


def _train(models, opts, steps: int, dtype: torch.dtype, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(7, 16, generator=g, dtype=dtype)
        outs = []
        for m, o in zip(models, opts):
            o.zero_grad()
            y = m(x)
            y.float().square().mean().backward()
            outs.append(y)
            o.step()
        assert all(torch.equal(outs[0], y) for y in outs[1:])


@pytest.mark.parametrize(
    "dtype,precision",
    [(torch.float32, "fp32-master"), (torch.bfloat16, "fp32-master"), (torch.bfloat16, "compact")],
)
@pytest.mark.parametrize("kw", [{}, {"pipeline": True}, {"overlap": False}])
def test_optimizer_states_on_disk_train_as_in_ram(tmp_path, dtype: torch.dtype, precision: str, kw):
    ram, disk, opts = _states_pair(tmp_path, dtype, precision, **kw)
    _train((ram, disk), opts, 5, dtype)
    for o in opts:
        o.synchronize()
    for (n, a), b in zip(ram.state_dict().items(), disk.state_dict().values()):
        assert torch.equal(a, b), n
    assert ramtorch.stats(disk)["disk_units"] == ["blocks.3", "blocks.4", "blocks.5", "out"]
    # Every streamed parameter's states on disk, those of the units in host RAM included.
    on_disk = {id(p) for p in disk.parameters() if ramtorch._disk.states_home(p) is not None}
    assert len(on_disk) == 28
    ds = opts[1]._disk_states
    assert ds is not None and ds.written_bytes > 0
    ram_states = opts[0].state_dict()["state"]
    disk_states = opts[1].state_dict()["state"]
    assert ram_states.keys() == disk_states.keys()
    for i, p in enumerate(disk.parameters()):
        for k, v in ram_states[i].items():
            assert torch.equal(v, disk_states[i][k]), (i, k)
        st = opts[1].state[p]
        held = [t for k, t in st.items() if k != "step"]
        assert held
        assert all(ds.store.holds(t) == (id(p) in on_disk) for t in held), i
    assert os.listdir(tmp_path) == []  # the states' store leaves nothing behind either
    # Updated during the backward (pipelined): their states are read ahead with the backward's
    # reads of their weights; updated in step(): in step(), in its order.
    assert (ds.hints_in_backward > 0) == bool(kw.get("pipeline")), ds.hints_in_backward
    st = ramtorch.stats(disk)
    assert st["disk_state_bytes"] == ds.nbytes
    assert st["disk_state_updates"] == 5 * len(on_disk)  # every step updates each one
    assert st["disk_state_written_bytes"] >= 5 * sum(e.capacity for e in ds.extents.values())
    assert st["disk_write_gbps"] is not None and st["disk_state_write_gbps"] is not None
    largest = max(pc.nbytes for ps in ds.pieces.values() for pc in ps)  # (a parameter is one piece)
    assert largest == max(e.capacity for e in ds.extents.values())
    assert st["disk_state_staging_bound_bytes"] == ramtorch._disk.STATES_IN_FLIGHT * largest


@pytest.mark.parametrize("kw", [{}, {"pipeline": True}])
def test_the_host_budget_holds_the_gradients_and_every_streamed_units_states_go_to_disk(tmp_path, caplog, kw):
    torch.manual_seed(5)
    base = Net()
    grads = ramtorch._disk.grad_bytes(base.parameters())
    # A budget that holds the gradients and every weight: no unit on disk, the states still are.
    whole = copy.deepcopy(base)
    ramtorch.offload(
        whole, device="cpu", host_budget=grads + 2 * _bytes(base), disk=tmp_path, optimizer_on_disk=True
    )
    assert ramtorch.stats(whole)["disk_units"] == []
    ram = copy.deepcopy(base)
    ramtorch.offload(ram, device="cpu")
    opts = [ropt.AdamW(m.parameters(), lr=1e-2, **kw) for m in (ram, whole)]
    _train((ram, whole), opts, 3, torch.float32)
    for o in opts:
        o.synchronize()
    ds = opts[1]._disk_states
    assert ds is not None and len(ds.extents) == len(list(base.parameters()))
    # Updated during the backward: the units' backward copies start their states' reads.
    assert (ds.hints_in_backward > 0) == bool(kw), ds.hints_in_backward
    for p in whole.parameters():
        assert all(ds.store.holds(t) for k, t in opts[1].state[p].items() if k != "step")
    for (n, a), b in zip(ram.state_dict().items(), whole.state_dict().values()):
        assert torch.equal(a, b), n
    # A budget of the gradients' bytes: training puts every unit on disk; without
    # optimizer_on_disk it holds weights only (inference needs no gradients), nearly all of them.
    trained = copy.deepcopy(base)
    ramtorch.offload(trained, device="cpu", host_budget=grads, disk=tmp_path, optimizer_on_disk=True)
    assert len(ramtorch.stats(trained)["disk_units"]) == 8
    plain = copy.deepcopy(base)
    ramtorch.offload(plain, device="cpu", host_budget=grads, disk=tmp_path)
    assert len(ramtorch.stats(plain).get("disk_units", [])) <= 1  # (units pack 64-byte aligned)
    # Gradients past the budget: every unit on disk, and a warning that training holds them.
    small = copy.deepcopy(base)
    with caplog.at_level(logging.WARNING, logger="ramtorch"):
        ramtorch.offload(small, device="cpu", host_budget=grads // 2, disk=tmp_path, optimizer_on_disk=True)
    assert len(ramtorch.stats(small)["disk_units"]) == 8
    assert "less than the streamed units' gradients" in caplog.text


@pytest.mark.usefixtures("small_params_streamed")
@pytest.mark.parametrize(
    "dtype,precision,width",
    [(torch.float32, "fp32-master", 48), (torch.bfloat16, "bf16", 48), (torch.bfloat16, "compact", 560)],
)
@pytest.mark.parametrize("kw", [{}, {"pipeline": True}])
def test_states_updated_in_pieces_train_as_in_ram(tmp_path, monkeypatch, dtype, precision, width, kw):
    # The smallest pieces the layout allows (1024 elements of fp32 states, 2048 of bf16, 2^18
    # with block-quantized moments): a parameter's update runs in several pieces, each drawing
    # the stochastic rounding of the whole tensor's update (bf16 and compact round so).
    monkeypatch.setattr(ramtorch._disk, "PIECE_BYTES", 1)
    torch.manual_seed(4)
    base = Net(width=width, depth=2, dtype=dtype)
    ram, disk = copy.deepcopy(base), copy.deepcopy(base)
    ramtorch.offload(ram, device="cpu")
    budget = ramtorch._disk.grad_bytes(base.parameters()) + _unit_bytes(base.inp)
    ramtorch.offload(disk, device="cpu", host_budget=budget, disk=tmp_path, optimizer_on_disk=True)
    opts = [
        ropt.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, precision=precision, **kw) for m in (ram, disk)
    ]
    _train((ram, disk), opts, 4, dtype)
    for o in opts:
        o.synchronize()
    for (n, a), b in zip(ram.state_dict().items(), disk.state_dict().values()):
        assert torch.equal(a, b), n
    ram_states, disk_states = (o.state_dict()["state"] for o in opts)
    for i in ram_states:
        for k, v in ram_states[i].items():
            assert torch.equal(v, disk_states[i][k]), (i, k)
    ds = opts[1]._disk_states
    w = disk.blocks[0][1].weight
    assert ds.npieces(w) == (
        2 if precision == "compact" else -(-w.numel() // (1024 if dtype == torch.float32 else 2048))
    )
    assert ds.npieces(disk.out.bias) == 1
    st = ramtorch.stats(disk)
    assert st["disk_state_updates"] == 4 * len(list(disk.parameters()))  # (a parameter, not a piece)
    largest = max(pc.nbytes for ps in ds.pieces.values() for pc in ps)
    assert largest < max(e.capacity for e in ds.extents.values())  # staging holds pieces
    assert st["disk_state_staging_bound_bytes"] == ramtorch._disk.STATES_IN_FLIGHT * largest
    # The plan predicts that bound before anything is allocated.
    from ramtorch.plan import predict

    with torch.device("meta"):
        meta = Net(width=width, depth=2, dtype=dtype)
    pred = predict(meta, None, 7, host_budget=budget, optimizer_on_disk=True, precision=precision)
    assert pred.disk_state_staging_bytes == st["disk_state_staging_bound_bytes"]


def test_optimizer_states_on_disk_load_and_resume(tmp_path):
    ram, disk, opts = _states_pair(tmp_path, torch.bfloat16, "fp32-master")
    _train((ram, disk), opts, 2, torch.bfloat16)
    saved_model = copy.deepcopy(ram.state_dict())
    saved_opt = copy.deepcopy(opts[0].state_dict())
    # A fresh optimizer on the disk model loads the RAM model's states: into its disk extents.
    disk.load_state_dict(saved_model)
    fresh = ropt.AdamW(disk.parameters(), lr=1e-2)
    fresh.load_state_dict(saved_opt)
    ds = fresh._disk_states
    assert ds is not None
    p = disk.out.weight
    assert ds.store.holds(fresh.state[p]["exp_avg"]) and ds.store.holds(fresh.state[p]["master"])
    _train((ram, disk), [opts[0], fresh], 3, torch.bfloat16, seed=2)
    for (n, a), b in zip(ram.state_dict().items(), disk.state_dict().values()):
        assert torch.equal(a, b), n


def test_optimizer_on_disk_needs_a_disk(tmp_path):
    with pytest.raises(ValueError, match="optimizer_on_disk=True needs disk="):
        ramtorch.offload(Net(), device="cpu", optimizer_on_disk=True)
    with pytest.raises(TypeError, match="optimizer_on_disk must be a bool"):
        ramtorch.offload(Net(), device="cpu", disk=tmp_path, optimizer_on_disk="yes")


def test_one_optimizer_over_two_models_with_states_on_disk_is_refused(tmp_path):
    # Each model's states belong in its own store (its directory, its kept store's journal).
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = Net(), Net()
    for m, d in ((a, "a"), (b, "b")):
        ramtorch.offload(m, device="cpu", host_budget=0, disk=tmp_path / d, optimizer_on_disk=True)
    opt = ropt.AdamW([*a.parameters(), *b.parameters()], lr=1e-2)
    x = torch.randn(3, 16)
    (a(x).sum() + b(x).sum()).backward()
    with pytest.raises(ValueError, match="an optimizer per model"):
        opt.step()
    assert all(not opt.state[p] for p in a.parameters())  # nothing half made
    for m in (a, b):  # an optimizer each trains
        o = ropt.AdamW(m.parameters(), lr=1e-2)
        o.step()
        o.synchronize()


def test_the_trace_shows_the_write_backs_of_states_on_disk(tmp_path):
    import json

    ram, disk, opts = _states_pair(tmp_path, torch.float32, "fp32-master")
    _train((ram, disk), opts, 1, torch.float32)
    path = tmp_path / "trace.json"
    with ramtorch.trace(path):
        _train((disk,), opts[1:], 1, torch.float32, seed=4)
    events = json.loads(path.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    tracks = {
        e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"
    }
    writes = [e for e in events if e.get("ph") == "X" and tracks.get(e["tid"]) == "disk write-backs"]
    # Each of the 28 parameters: its states; each of the 14 of the disk units: its weight too.
    states = {e["name"].rsplit(" ", 1)[1] for e in writes if e["name"].startswith("write back states ")}
    weights = {e["name"].rsplit(" ", 1)[1] for e in writes if e["name"].startswith("write back weight ")}
    assert states == {"inp", "out", *(f"blocks.{k}" for k in range(6))}
    assert weights == {"blocks.3", "blocks.4", "blocks.5", "out"}
    assert len(writes) == 28 + 14
    assert all(e["dur"] >= 0 for e in writes)


def test_a_full_disk_for_the_states_is_a_clear_error_and_nothing_is_updated(tmp_path):
    # The states' store is allocated whole at the first step: a disk too small for it is an
    # OSError there, before any parameter is updated (a file size limit stands in for it).
    code = f"""
        import errno, resource, signal, torch, ramtorch, ramtorch.optim as ropt
        from test_disk import Net
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        torch.manual_seed(0)
        m = Net(width=256)
        ramtorch.offload(m, device="cpu", host_budget=0, disk={str(tmp_path)!r}, optimizer_on_disk=True)
        units = ramtorch.stats(m)["disk_bytes"]
        resource.setrlimit(resource.RLIMIT_FSIZE, (units + 4096, units + 4096))
        opt = ropt.AdamW(m.parameters(), lr=1e-2)
        m(torch.randn(2, 16)).square().mean().backward()
        before = {{k: v.clone() for k, v in m.state_dict().items()}}
        try:
            opt.step()
        except OSError as e:
            assert e.errno in (errno.EFBIG, errno.ENOSPC), e
            assert "allocating" in str(e) and "bytes" in str(e), e
            print("refused:", e)
        else:
            raise SystemExit("step did not refuse")
        assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
        assert not opt.state or all(not s for s in opt.state.values())
        print("ok")
    """
    r = _child(code, tmp_path)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "refused:" in r.stdout
    assert os.listdir(tmp_path) == []


def test_a_crash_while_training_with_states_on_disk_leaves_nothing(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    code = f"""
        import torch, ramtorch, ramtorch.optim as ropt
        from test_disk import Net
        m = Net(width=256)
        ramtorch.offload(m, device="cpu", host_budget=0, disk={str(store)!r}, optimizer_on_disk=True)
        opt = ropt.AdamW(m.parameters(), lr=1e-2)
        first = True
        while True:  # until killed, most likely inside a step
            m(torch.randn(2, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if first:
                assert opt._disk_states is not None
                print("running", flush=True)
                first = False
    """
    _kill_once_running(code, store)
    assert os.listdir(store) == []


@pytest.mark.parametrize("seed", range(4))
def test_states_on_disk_on_random_shapes_dtypes_and_budgets(tmp_path, seed: int):
    import random

    rng = random.Random(seed)
    dtype = rng.choice([torch.float32, torch.bfloat16])
    precision = rng.choice(["fp32-master", "bf16", "compact"] if dtype == torch.bfloat16 else ["fp32-master"])
    width, depth = rng.randrange(8, 200), rng.randrange(1, 5)
    torch.manual_seed(seed)
    base = Net(width=width, depth=depth, dtype=dtype)
    ram, disk = copy.deepcopy(base), copy.deepcopy(base)
    ramtorch.offload(ram, device="cpu")
    host_units = rng.randrange(0, depth + 1)
    budget = _unit_bytes(base.inp) + host_units * _unit_bytes(base.blocks[0])
    if rng.random() < 0.5:  # (else the gradients take the budget: every unit on disk)
        budget += ramtorch._disk.grad_bytes(base.parameters())
    ramtorch.offload(disk, device="cpu", host_budget=budget, disk=tmp_path, optimizer_on_disk=True)
    kw = rng.choice([{}, {"pipeline": True}, {"overlap": False}])
    opts = [
        ropt.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, precision=precision, **kw) for m in (ram, disk)
    ]
    _train((ram, disk), opts, 3, dtype, seed=seed)
    for o in opts:
        o.synchronize()
    for (n, a), b in zip(ram.state_dict().items(), disk.state_dict().values()):
        assert torch.equal(a, b), (n, dtype, precision, width, depth, host_units, kw)
    assert opts[1]._disk_states is not None


def test_states_read_ahead_in_the_backward_stay_within_the_bound(tmp_path, monkeypatch):
    # Pipelined: every unit's weights read for the backward hint their states; only
    # STATES_AHEAD of them wait in staging buffers at once (each may be GBs), besides the one
    # whose update is starting.
    ram, disk, opts = _states_pair(tmp_path, torch.bfloat16, "fp32-master", pipeline=True)
    seen: list[int] = []
    buffers: list[int] = []  # parameters whose states are in staging buffers, read to written
    stage = ramtorch._disk.DiskStates._stage

    def counting(self, pid):
        stage(self, pid)
        seen.append(len(self._staged))
        buffers.append(len({*self._staged, *self._current, *self._writing}))

    monkeypatch.setattr(ramtorch._disk.DiskStates, "_stage", counting)
    monkeypatch.setattr(ramtorch._disk, "STATES_AHEAD", 1)
    _train((ram, disk), opts, 3, torch.bfloat16)
    for o in opts:
        o.synchronize()
    assert opts[1]._disk_states.hints_in_backward > 0
    assert seen and max(seen) == 2  # the one about to be updated, and one ahead
    assert max(buffers) <= 1 + 1 + ramtorch._disk.SETTLES_IN_FLIGHT  # (STATES_IN_FLIGHT, ahead 1)
    for (n, a), b in zip(ram.state_dict().items(), disk.state_dict().values()):
        assert torch.equal(a, b), n
