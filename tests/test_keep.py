"""Kept disk stores (``ramtorch.offload(..., disk=..., keep=True)``): a store that is a checkpoint
of the model, opened again without copying; commits and resumes that train as if never stopped;
the undo journal that brings a store killed in the middle of a step back to its last commit."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import ramtorch
import ramtorch.optim as ropt
import torch
from ramtorch import _disk, _keep
from safetensors.torch import save_file
from test_disk import Net, _env, _unit_bytes

HERE = os.path.dirname(os.path.abspath(__file__))


def _offload(m: Net, store, **kw):
    budget = _unit_bytes(m.inp) + 2 * _unit_bytes(m.blocks[0])
    if kw.get("optimizer_on_disk"):  # (training: the budget holds the streamed units' gradients first)
        budget += _disk.grad_bytes(m.parameters())
    kw.setdefault("host_budget", budget)
    return ramtorch.offload(m, device="cpu", disk=store, keep=True, **kw)


def _state(m) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _opt_state(o) -> dict:
    o.synchronize()
    sd = o.state_dict()["state"]
    return {i: {k: v.clone() for k, v in st.items()} for i, st in sd.items()}


def _equal_opt(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for i in a:
        assert a[i].keys() == b[i].keys(), i
        for k in a[i]:
            assert torch.equal(a[i][k], b[i][k]), (i, k)


def test_a_kept_store_is_the_model_when_opened_again(tmp_path):
    torch.manual_seed(0)
    m = _offload(Net(), tmp_path)
    want = _state(m)
    x = torch.randn(3, 16)
    y = m(x)
    files = sorted(os.listdir(tmp_path))
    assert _keep.UNITS in files and _keep.MANIFEST in files and _keep.JOURNAL in files
    del m

    torch.manual_seed(1)  # other values: the store's (and the last commit's) replace them
    m2 = _offload(Net(), tmp_path)
    _equal(_state(m2), want)
    assert torch.equal(m2(x), y)
    store = m2._ramtorch_streamer.disk_store
    assert store.kept is not None and store.kept.opened
    on_disk = [p for p in m2.parameters() if store.holds(p)]
    assert len(on_disk) == 18  # blocks 2-5 (a norm and a linear, 2 parameters each) and out
    # A model built on the meta device opens it too; host_budget=None keeps the store's units.
    with torch.device("meta"):
        m3 = Net()
    _offload(m3, tmp_path, host_budget=None)
    _equal(_state(m3), want)
    assert torch.equal(m3(x), y)


def test_loading_the_files_a_store_holds_reads_nothing(tmp_path):
    torch.manual_seed(0)
    src = Net()
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(path))
    store = tmp_path / "store"
    store.mkdir()
    with torch.device("meta"):
        m = Net()
    _offload(m, store)
    r = ramtorch.load(m, path)
    assert r["bytes"] > 0 and not r.get("from_store")
    _equal(_state(m), _state(src))
    del m
    with torch.device("meta"):
        m2 = Net()
    _offload(m2, store)
    r = ramtorch.load(m2, path)
    assert r["bytes"] == 0 and r["from_store"] is True
    _equal(_state(m2), _state(src))
    # Files changed since: read again.
    src.out.bias.data += 1
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(path))
    del m2
    with torch.device("meta"):
        m3 = Net()
    _offload(m3, store)
    r = ramtorch.load(m3, path)
    assert r["bytes"] > 0
    _equal(_state(m3), _state(src))


def test_a_store_of_another_model_is_a_clear_error(tmp_path):
    _offload(Net(), tmp_path)
    with pytest.raises(ValueError, match="another model"):
        _offload(Net(width=40), tmp_path)
    with pytest.raises(ValueError, match="another model"):
        _offload(Net(depth=7), tmp_path)
    with pytest.raises(ValueError, match="keep=True needs disk"):
        ramtorch.offload(Net(), device="cpu", keep=True)
    with pytest.raises(ValueError, match="no unit goes to disk"):
        ramtorch.offload(Net(), device="cpu", disk=tmp_path, keep=True, host_budget="1GiB")


def test_training_a_kept_store_needs_its_states_on_disk(tmp_path):
    m = _offload(Net(), tmp_path)
    opt = ropt.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(2, 16)).sum().backward()
    with pytest.raises(ValueError, match="optimizer_on_disk=True"):
        opt.step()
    with pytest.raises(ValueError, match="no kept store"):
        ramtorch.commit(ramtorch.offload(Net(), device="cpu"))


def _batches(n: int, seed: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(7, 16, generator=g) for _ in range(n)]


def _step(m, o, x) -> None:
    o.zero_grad()
    m(x).square().mean().backward()
    o.step()


@pytest.mark.parametrize(
    "dtype,precision,kw",
    [
        (torch.float32, "fp32-master", {}),
        (torch.bfloat16, "fp32-master", {"pipeline": True}),
        (torch.bfloat16, "compact", {}),
    ],
)
def test_commit_and_resume_train_as_if_never_stopped(tmp_path, dtype, precision, kw):
    torch.manual_seed(2)
    base = Net(dtype=dtype)
    xs = [x.to(dtype) for x in _batches(5)]
    ram = ramtorch.offload(copy.deepcopy(base), device="cpu")
    ro = ropt.AdamW(ram.parameters(), lr=1e-2, precision=precision, **kw)
    for x in xs:
        _step(ram, ro, x)

    m = _offload(copy.deepcopy(base), tmp_path, optimizer_on_disk=True)
    o = ropt.AdamW(m.parameters(), lr=1e-2, precision=precision, **kw)
    assert ramtorch.resume(m, o) is None  # nothing committed yet
    for k, x in enumerate(xs[:3]):
        _step(m, o, x)
        ramtorch.commit(m, o, extra={"step": k + 1})
    _step(m, o, xs[3])  # not committed: lost
    o.synchronize()
    st = ramtorch.stats(m)
    assert st["disk_kept"] == str(tmp_path) and not st["disk_kept_opened"]
    assert st["disk_commit_serial"] == 4  # offload's commit, then three
    assert st["disk_journal_bytes"] > 0  # the uncommitted step's old bytes
    del m, o

    m2 = _offload(Net(dtype=dtype), tmp_path, optimizer_on_disk=True)
    o2 = ropt.AdamW(m2.parameters(), lr=1e-2, precision=precision, **kw)
    extra = ramtorch.resume(m2, o2)
    assert extra == {"step": 3}
    for x in xs[3:]:
        _step(m2, o2, x)
    _equal(_state(m2), _state(ram))
    _equal_opt(_opt_state(o2), _opt_state(ro))
    ds = o2._disk_states
    assert ds is not None and ds.kept is not None and ds.kept.states_opened
    held = [t for p, st in o2.state.items() for k, t in st.items() if k != "step" and ds.store.holds(t)]
    assert len(held) >= 8  # the states of the disk units' parameters stayed in the store


def test_a_store_committed_in_the_first_compact_format_resumes_recoded(tmp_path):
    """Committed moments of the first compact format (codes of its dynamic map, scales named
    '<state>_scales' in the commit) are read through that map and rewritten in the store in the
    current format by ``ramtorch.resume``; training goes on from them."""
    from safetensors import safe_open
    from test_optim_compact import FIRST, _dequantize, _legacy_codes

    torch.manual_seed(2)
    xs = [x.to(torch.bfloat16) for x in _batches(5)]
    m = _offload(Net(dtype=torch.bfloat16), tmp_path, optimizer_on_disk=True)
    o = ropt.AdamW(m.parameters(), lr=1e-2, precision="compact")
    for x in xs[:3]:
        _step(m, o, x)
    ramtorch.commit(m, o)
    o.synchronize()
    # The committed moments rewritten in the first format, in place in the store.
    want: dict[tuple[int, str], torch.Tensor] = {}
    for i, p in enumerate(m.parameters()):
        st = o.state[p]
        for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            x = _dequantize(st[name], st[f"{name}_block_scales"], signed)
            codes, scales = _legacy_codes(x, signed)
            st[name].copy_(codes)
            st[f"{name}_block_scales"].copy_(scales)
            table = torch.tensor(ramtorch._core.q8_legacy_map(signed))
            want[i, name] = table[codes.reshape(-1).long()] * scales.repeat_interleave(256)[: x.numel()]
    o.synchronize()
    del m, o
    # ... and the commit's record of them under the first format's names.
    rest = next(f for f in os.listdir(tmp_path) if f.startswith("rest-"))
    with safe_open(str(tmp_path / rest), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert '"exp_avg_block_scales"' in meta["ramtorch.extra"]
    meta["ramtorch.extra"] = meta["ramtorch.extra"].replace("_block_scales", "_scales")
    save_file(tensors, str(tmp_path / rest), metadata=meta)

    m2 = _offload(Net(dtype=torch.bfloat16), tmp_path, optimizer_on_disk=True)
    o2 = ropt.AdamW(m2.parameters(), lr=1e-2, precision="compact")
    ramtorch.resume(m2, o2)
    ds = o2._disk_states
    assert ds is not None and ds.kept is not None and ds.kept.states_opened
    for i, p in enumerate(m2.parameters()):
        st = o2.state[p]
        assert "exp_avg_scales" not in st
        assert ds.store.holds(st["exp_avg"]) and ds.store.holds(st["exp_avg_block_scales"])
        for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            got = _dequantize(st[name], st[f"{name}_block_scales"], signed).reshape(-1)
            x = want[i, name]
            bound = torch.maximum(x.abs() / 16, FIRST[signed] / 2 * x.abs().max())
            assert bool(((got - x).abs() <= bound * (1 + 1e-3)).all()), (i, name)
    for x in xs[3:]:
        _step(m2, o2, x)
    assert all(bool(torch.isfinite(p.float()).all()) for p in m2.parameters())


def _child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=_env(), capture_output=True, text=True
    )


@pytest.mark.parametrize("precision", ["fp32-master", "compact"])
def test_a_sigkill_during_a_step_reopens_at_the_last_commit(tmp_path, precision):
    # The child trains 2 committed steps, then is killed in the middle of the third: after the
    # first updates of disk parameters wrote their weights and states in place. With fp32
    # masters the states move in pieces of 1024 elements, and the kill comes in the middle of a
    # parameter: its first pieces updated, the others not.
    code = f"""
        import os, signal, torch, ramtorch, ramtorch.optim as ropt
        from ramtorch import _disk
        from test_disk import Net
        from test_keep import _offload, _batches, _step
        _disk.PIECE_BYTES = 1
        torch.manual_seed(2)
        m = _offload(Net(dtype=torch.bfloat16), {str(tmp_path)!r}, optimizer_on_disk=True)
        o = ropt.AdamW(m.parameters(), lr=1e-2, precision={precision!r})
        xs = [x.bfloat16() for x in _batches(3)]
        for k in range(2):
            _step(m, o, xs[k])
            ramtorch.commit(m, o, extra={{"step": k + 1}})
        after = _disk.DiskStates.after
        calls = []
        def dying(self, p, k=0):
            after(self, p, k)
            calls.append((p, k))
            if {precision!r} == "compact" and len(calls) == 3 or k == 1 and self.npieces(p) > 2:
                self.flush()  # the new bytes are in the files
                os.kill(os.getpid(), signal.SIGKILL)
        _disk.DiskStates.after = dying
        _step(m, o, xs[2])
        print("not killed")
    """
    r = _child(code)
    assert r.returncode == -9, r.stdout + r.stderr[-3000:]

    torch.manual_seed(2)
    base = Net(dtype=torch.bfloat16)
    ram = ramtorch.offload(base, device="cpu")
    ro = ropt.AdamW(ram.parameters(), lr=1e-2, precision=precision)
    xs = [x.bfloat16() for x in _batches(3)]
    for x in xs[:2]:
        _step(ram, ro, x)

    m = _offload(Net(dtype=torch.bfloat16), tmp_path, optimizer_on_disk=True)
    o = ropt.AdamW(m.parameters(), lr=1e-2, precision=precision)
    assert ramtorch.resume(m, o) == {"step": 2}
    _equal(_state(m), _state(ram))
    _equal_opt(_opt_state(o), _opt_state(ro))
    _step(m, o, xs[2])
    _step(ram, ro, xs[2])
    _equal(_state(m), _state(ram))
    _equal_opt(_opt_state(o), _opt_state(ro))


def test_a_store_killed_while_loading_is_made_anew(tmp_path):
    m = _offload(Net(), tmp_path)
    m._ramtorch_streamer.disk_store.kept.mark_dirty("ramtorch.load")  # as a load does first
    del m
    torch.manual_seed(4)
    fresh = Net()
    want = _state(fresh)
    with pytest.warns(UserWarning, match="made anew"):
        m2 = _offload(fresh, tmp_path)
    _equal(_state(m2), want)  # the model's own values, not the store's
    assert not m2._ramtorch_streamer.disk_store.kept.opened


def test_the_journal_ignores_a_torn_record(tmp_path):
    m = _offload(Net(), tmp_path)
    kept = m._ramtorch_streamer.disk_store.kept
    want = _state(m)
    ext = m._ramtorch_streamer.disk_store.extents[0]
    kept.protect("units", ext.offset, ext.capacity)
    with torch.no_grad():
        ext.view(ext.capacity).fill_(7)  # an update after its record: undone on reopening
    ext.settle()
    # A record whose header never landed (torn): the bytes it would undo were never written.
    end = kept._end
    os.pwrite(kept._journal, b"\x01" * 4096, end + 4096)
    os.pwrite(kept._journal, b'{"file": "units", "offs', end)
    del m
    m2 = _offload(Net(), tmp_path)
    _equal(_state(m2), want)
    assert isinstance(_disk.store_of(next(iter(m2.blocks[5].parameters()))), _disk.Store)


def test_a_full_disk_for_the_journal_is_a_clear_error_and_the_commit_survives(tmp_path):
    # A file size limit stands in for a full disk: the store files fit under it, the journal of
    # a step does not. The step fails with an OSError before the update whose old bytes could
    # not be saved; reopening gives the last commit.
    code = f"""
        import errno, resource, signal, torch, ramtorch, ramtorch.optim as ropt
        from test_disk import Net
        from test_keep import _offload, _batches, _step
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        torch.manual_seed(2)
        m = _offload(Net(width=256), {str(tmp_path)!r}, optimizer_on_disk=True)
        o = ropt.AdamW(m.parameters(), lr=1e-2)
        xs = _batches(2)
        _step(m, o, xs[0])
        ramtorch.commit(m, o, extra={{"step": 1}})
        before = o._disk_states.updates
        biggest = max(s.nbytes for s in (o._disk_states.store, m._ramtorch_streamer.disk_store))
        resource.setrlimit(resource.RLIMIT_FSIZE, (biggest + 4096, resource.RLIM_INFINITY))
        try:
            _step(m, o, xs[1])
        except OSError as e:
            assert e.errno in (errno.EFBIG, errno.ENOSPC), e
            assert "journal of the kept store" in str(e), e
            print("refused:", e)
        else:
            raise SystemExit("the step did not fail")
        assert o._disk_states.updates > before  # some of this step's ran
    """
    r = _child(code)
    assert r.returncode == 0 and "refused:" in r.stdout, r.stdout + r.stderr[-3000:]

    torch.manual_seed(2)
    ram = ramtorch.offload(Net(width=256), device="cpu")
    ro = ropt.AdamW(ram.parameters(), lr=1e-2)
    xs = _batches(2)
    _step(ram, ro, xs[0])
    m = _offload(Net(width=256), tmp_path, optimizer_on_disk=True)
    o = ropt.AdamW(m.parameters(), lr=1e-2)
    assert ramtorch.resume(m, o) == {"step": 1}
    _equal(_state(m), _state(ram))
    _equal_opt(_opt_state(o), _opt_state(ro))


def test_the_trace_shows_the_journal(tmp_path):
    import json

    m = _offload(Net(), tmp_path, optimizer_on_disk=True)
    o = ropt.AdamW(m.parameters(), lr=1e-2)
    xs = _batches(2)
    _step(m, o, xs[0])
    ramtorch.commit(m, o)
    path = tmp_path / "trace.json"
    with ramtorch.trace(path):
        _step(m, o, xs[1])
        o.synchronize()
    events = json.loads(path.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    tracks = {
        e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"
    }
    journal = [
        e
        for e in events
        if e.get("ph") == "X"
        and tracks.get(e["tid"]) == "disk write-backs"
        and e["name"].startswith("journal")
    ]
    # Each of the 28 parameters, journaled once: its states (every streamed unit's are on
    # disk), with its weight for the 18 of the units on disk (the others' are in the commit).
    assert len(journal) == 28
    assert {e["name"].rsplit(" ", 1)[1] for e in journal} == {
        "inp",
        "out",
        *(f"blocks.{k}" for k in range(6)),
    }
    assert all(e["dur"] >= 0 for e in journal)


def test_a_kept_store_closes_its_files_when_its_model_is_gone(tmp_path):
    import gc

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    m = _offload(Net(), tmp_path)
    del m
    gc.collect()
    before = fds()
    for _ in range(3):
        m = _offload(Net(), tmp_path)
        m(torch.randn(2, 16))
        del m
        gc.collect()
    assert fds() <= before
