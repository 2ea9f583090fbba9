"""Host memory shared by the processes of one node: ``_arena.shared_bytes``/``attach_shared`` and
``ramtorch.distributed.share_parameters`` (gloo, CPU). Each scenario runs in fresh subprocesses
(this file is also their entry point)."""

from __future__ import annotations

import datetime
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ramtorch import _arena
from torch import nn

HERE = Path(__file__).resolve()
MIB = 1 << 20


def _env() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    src = str(HERE.parent.parent / "python")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(scenario: str, world: int, out: Path, timeout: float = 60) -> list[dict]:
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE), scenario, str(r), str(world), str(port), str(out)],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + timeout
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for r, p in enumerate(procs):
        f = out / f"{scenario}-{r}.json"
        assert p.returncode == 0 and f.exists(), f"rank {r} failed ({p.returncode}):\n{logs[r]}"
        results.append(json.loads(f.read_text()))
    return results


# ---------------------------------------------------------------------------------------------
# Scenarios, run by each rank.


def _small_model(width: int = 32) -> nn.Module:
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 4))


def _forward(model: nn.Module) -> list:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(123))
    with torch.no_grad():
        return model(x).tolist()


def _scenario_write(rank: int, world: int) -> dict:
    from ramtorch.distributed import share_parameters

    torch.manual_seed(rank)  # different values on every rank: the source's must win
    model = _small_model()
    before = _forward(model)
    flat = share_parameters(model, src_rank=0)
    assert flat is not None and flat.dtype == torch.uint8
    shared_out = _forward(model)
    ptr_in_region = all(_arena.in_region(p, flat) for p in model.parameters())
    dist.barrier()
    if rank == 1:
        with torch.no_grad():
            model[0].weight[0, 0] = 42.0
            model[2].bias.add_(1.0)
    dist.barrier()
    seen = model[0].weight[0, 0].item()
    after = _forward(model)
    dist.barrier()  # nobody drops its mapping while another still reads
    return {
        "before": before,
        "shared": shared_out,
        "after": after,
        "seen": seen,
        "in_region": ptr_in_region,
    }


def _pss_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    raise AssertionError("no Pss in smaps_rollup")


def _scenario_memory(rank: int, world: int) -> dict:
    from ramtorch.distributed import share_parameters

    gc.collect()
    dist.barrier()  # every process alive and initialised: shared libraries' Pss is settled
    baseline = _pss_kib()
    dist.barrier()
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)])  # ~64 MiB of float32
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    dist.barrier()
    unshared = _pss_kib()
    share_parameters(model)
    gc.collect()
    dist.barrier()
    shared = _pss_kib()
    with torch.no_grad():
        out = model(torch.ones(2, 2048)).tolist()
    dist.barrier()
    return {"baseline": baseline, "unshared": unshared, "shared": shared, "nbytes": nbytes, "out": out}


def _scenario_mismatch(rank: int, world: int) -> dict:
    from ramtorch.distributed import share_parameters

    model = _small_model(width=33 if rank == world - 1 else 32)
    ptrs = [p.data_ptr() for p in model.parameters()]
    try:
        share_parameters(model)
    except ValueError as e:
        untouched = ptrs == [p.data_ptr() for p in model.parameters()]
        return {"error": str(e), "untouched": untouched}
    return {"error": None}


SCENARIOS = {"write": _scenario_write, "memory": _scenario_memory, "mismatch": _scenario_mismatch}


def _worker(scenario: str, rank: int, world: int, port: str, out: str) -> None:
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    result = SCENARIOS[scenario](rank, world)
    Path(out, f"{scenario}-{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # rank 0 hosts the rendezvous store: nobody tears down while it is in use
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Tests.


def test_shared_bytes_attach_in_process():
    t, name = _arena.shared_bytes(10_000)
    assert t.dtype == torch.uint8 and t.device.type == "cpu" and t.numel() == 10_000
    assert name.startswith(f"/proc/{os.getpid()}/fd/")
    assert int(t.sum()) == 0
    u = _arena.attach_shared(name, 10_000)
    t[5] = 7
    u[-1] = 9
    assert int(u[5]) == 7 and int(t[-1]) == 9
    with pytest.raises(ValueError, match="holds 10000 bytes, expected 10001"):
        _arena.attach_shared(name, 10_001)
    with pytest.raises(ValueError, match="not a shared region name"):
        _arena.attach_shared("/dev/shm/nope", 10_000)
    with pytest.raises(ValueError, match="cannot open shared region"):
        _arena.attach_shared(f"/proc/{os.getpid()}/fd/999999", 10_000)


@pytest.mark.parametrize("world", [2, 3])
def test_writes_are_seen_by_every_rank(world, tmp_path):
    res = _spawn("write", world, tmp_path)
    src = res[0]
    for r, x in enumerate(res):
        assert x["in_region"], f"rank {r}: parameters are not views of the shared region"
        assert x["shared"] == src["before"], f"rank {r} does not see the source's values"
        assert x["seen"] == 42.0, f"rank {r} does not see rank 1's write"
        assert x["after"] == src["after"], f"rank {r}'s forward differs after the write"
    if world > 1:
        assert res[1]["before"] != src["before"], "ranks started with the same values: test is vacuous"
    assert src["after"] != src["shared"]


def test_host_memory_is_one_copy(tmp_path):
    world = 3
    res = _spawn("memory", world, tmp_path)
    copy_kib = res[0]["nbytes"] / 1024
    assert res[0]["nbytes"] >= 64 * MIB
    base = sum(x["baseline"] for x in res)
    unshared = sum(x["unshared"] for x in res) - base
    shared = sum(x["shared"] for x in res) - base
    # The measurement sees every private copy before sharing...
    assert unshared > 0.9 * world * copy_kib, (unshared, copy_kib)
    # ...and about one copy in all after.
    assert shared < 1.3 * copy_kib, f"{shared / 1024:.1f} MiB for a {copy_kib / 1024:.1f} MiB model"
    assert shared > 0.7 * copy_kib, (shared, copy_kib)
    assert all(x["out"] == res[0]["out"] for x in res)
    print(f"Pss over {world} ranks: {shared / 1024:.1f} MiB shared vs {unshared / 1024:.1f} MiB unshared")


def test_mismatched_models_fail_on_every_rank(tmp_path):
    world = 3
    res = _spawn("mismatch", world, tmp_path)
    for r, x in enumerate(res):
        assert x["error"] is not None, f"rank {r} did not raise"
        assert "'0.weight'" in x["error"] and f"rank {world - 1}" in x["error"], x["error"]
        assert x["untouched"], f"rank {r}'s parameters were touched"


def _shmem_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1])
    raise AssertionError("no Shmem in /proc/meminfo")


CREATOR = """
import sys, time
from ramtorch import _arena
t, name = _arena.shared_bytes(int(sys.argv[1]))
t.fill_(0xAB)
print(name, flush=True)
time.sleep(120)
"""

ATTACHER = """
import sys
from ramtorch import _arena
n = int(sys.argv[2])
t = _arena.attach_shared(sys.argv[1], n)
ok = lambda: int(t[0]) == 0xAB and int(t[-1]) == 0xAB and int(t[::4096].min()) == 0xAB
print("attached" if ok() else "bad", flush=True)
sys.stdin.readline()
print("alive" if ok() else "bad", flush=True)
sys.stdin.readline()
"""


def test_crash_leaves_nothing_behind():
    n = 128 * MIB
    shm_before = sorted(os.listdir("/dev/shm"))
    s0 = _shmem_kib()
    run = dict(env=_env(), stdout=subprocess.PIPE, text=True)
    creator = subprocess.Popen([sys.executable, "-c", CREATOR, str(n)], **run)
    attacher = None
    try:
        assert creator.stdout is not None
        name = creator.stdout.readline().strip()
        assert name.startswith(f"/proc/{creator.pid}/fd/"), name
        attacher = subprocess.Popen(
            [sys.executable, "-c", ATTACHER, name, str(n)], stdin=subprocess.PIPE, **run
        )
        assert attacher.stdout is not None and attacher.stdin is not None
        assert attacher.stdout.readline().strip() == "attached"
        held = _shmem_kib() - s0
        assert held > 0.8 * n / 1024, f"{held} KiB of shared memory for a {n >> 20} MiB region"
        os.kill(creator.pid, signal.SIGKILL)
        creator.wait(timeout=300)  # generous: CI is a loaded two-core machine
        assert sorted(os.listdir("/dev/shm")) == shm_before
        attacher.stdin.write("\n")
        attacher.stdin.flush()
        assert attacher.stdout.readline().strip() == "alive", "data lost with its creator"
        assert _shmem_kib() - s0 > 0.8 * n / 1024, "freed while still mapped"
        attacher.stdin.write("\n")
        attacher.stdin.flush()
        assert attacher.wait(timeout=300) == 0
        freed = False
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if _shmem_kib() - s0 < 0.2 * n / 1024:
                freed = True
                break
            time.sleep(0.1)
        assert freed, f"{(_shmem_kib() - s0) >> 10} MiB still held after every process exited"
        assert sorted(os.listdir("/dev/shm")) == shm_before
    finally:
        for p in (creator, attacher):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


if __name__ == "__main__":
    _worker(*sys.argv[1:2], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:6])
