"""ramtorch.save_checkpoint / load_checkpoint: round trips, exact resume, atomicity (exceptions and
SIGKILL while saving), validation of bad files, and loading in place into host-arena parameters."""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ramtorch
import ramtorch.io._progress as progress_mod
import ramtorch.io.format as fmt
import ramtorch.nn as rnn
import torch
import torch.nn.functional as F
from conftest import Doubling
from ramtorch.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn


class Tiny(nn.Module):
    """Embedding tied to the output head, a dropout, a 0-dim parameter and buffers of several dtypes."""

    def __init__(
        self, vocab: int = 11, d: int = 8, p: float = 0.0, linear: type[nn.Module] = nn.Linear
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([linear(d, d) for _ in range(2)])
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-dim
        self.register_buffer("steps", torch.tensor(0, dtype=torch.int64))  # 0-dim buffer
        self.register_buffer("mask", torch.arange(d) % 2 == 0)
        self.register_buffer("low", torch.randn(3, dtype=torch.bfloat16))
        self.register_buffer("tmp", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = h + torch.tanh(b(self.drop(h)))
        return self.head(h * self.mask) * self.scale


def tokens(n: int = 4, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, 11, (3, 5), generator=g), torch.randint(0, 11, (3, 5), generator=g))
        for _ in range(n)
    ]


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    opt.zero_grad()
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    return loss.item()


def assert_state_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def assert_optim_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        assert_state_equal(sa["state"][i], sb["state"][i])


def temps(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f".{path.name}.*.tmp"))


@pytest.fixture(autouse=True)
def keep_rng():
    """Loading restores the global RNG: keep other tests independent of that."""
    state = torch.get_rng_state()
    yield
    torch.set_rng_state(state)


# -- round trips ----------------------------------------------------------------------------------


def test_round_trip_model_and_adamw(tmp_path):
    torch.manual_seed(0)
    m = Tiny()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.8, 0.95))
    for x, y in tokens(2):
        train_step(m, opt, x, y)
    m.steps += 2
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, m, opt, extra={"step": 2, "epoch": 0, "best": float("inf"), "hist": [1.0, 0.5]})
    assert temps(path) == []

    torch.manual_seed(1)
    m2 = Tiny()
    opt2 = torch.optim.AdamW(m2.parameters())
    extra = load_checkpoint(path, m2, opt2)

    assert extra == {"step": 2, "epoch": 0, "best": math.inf, "hist": [1.0, 0.5]}
    assert_state_equal(m.state_dict(), m2.state_dict())
    assert_optim_equal(opt, opt2)
    assert m2.head.weight is m2.emb.weight  # still tied: loaded in place, Parameters not replaced
    assert opt2.param_groups[0]["betas"] == (0.8, 0.95)
    # both continue identically
    x, y = tokens(1, seed=5)[0]
    assert train_step(m, opt, x, y) == train_step(m2, opt2, x, y)
    assert_state_equal(m.state_dict(), m2.state_dict())


def test_file_is_standard_safetensors(tmp_path):
    torch.manual_seed(0)
    m = Tiny()
    m.register_buffer("empty", torch.zeros(0, 4, dtype=torch.float16))
    m.register_buffer("ints", torch.arange(6, dtype=torch.int32).reshape(2, 3).t())  # not contiguous
    opt = torch.optim.AdamW(m.parameters())
    train_step(m, opt, *tokens(1)[0])
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, m, opt)

    flat = load_file(path)  # the reference reader opens the file
    sd = m.state_dict()
    assert "model.head.weight" not in flat  # tied weight written once, as an alias
    for k, v in sd.items():
        if k != "head.weight":
            assert torch.equal(flat[f"model.{k}"], v), k
    for i, state in opt.state_dict()["state"].items():
        for name, v in state.items():
            assert torch.equal(flat[f"optim.state.{i}.{name}"], v)
    assert torch.equal(flat["rng.cpu"], torch.get_rng_state())
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    assert meta["ramtorch.checkpoint"] == "1" and meta["format"] == "pt"
    assert all(isinstance(v, str) for v in meta.values())

    m2 = Tiny()
    m2.register_buffer("empty", torch.ones(0, 4, dtype=torch.float16))
    m2.register_buffer("ints", torch.zeros(3, 2, dtype=torch.int32))
    load_checkpoint(path, m2)
    assert_state_equal(sd, m2.state_dict())


def test_sgd_and_a_custom_optimizer(tmp_path):
    class Custom(torch.optim.Optimizer):
        """State: ints, floats, tuples, nested dicts, None, int keys; group: a str, a tensor lr."""

        def __init__(self, params) -> None:
            super().__init__(params, {"lr": torch.tensor(0.1), "window": (2, 3), "name": "custom"})

        @torch.no_grad()
        def step(self) -> None:
            for g in self.param_groups:
                for p in g["params"]:
                    st = self.state[p]
                    st["n"] = st.get("n", 0) + 1
                    st["ema"] = st.get("ema", torch.zeros_like(p)).mul_(0.9).add_(p.grad)
                    st["info"] = {"last": float(p.grad.norm()), "flags": (True, None), 7: -1, "nan": math.nan}
                    p.sub_(g["lr"] * st["ema"])

    torch.manual_seed(0)
    for make in (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True), Custom):
        m = Tiny()
        opt = make([{"params": m.blocks.parameters()}, {"params": [m.emb.weight, m.scale]}])
        for x, y in tokens(2):
            train_step(m, opt, x, y)
        path = tmp_path / "ckpt.safetensors"
        save_checkpoint(path, m, opt)
        m2 = Tiny()
        opt2 = make([{"params": m2.blocks.parameters()}, {"params": [m2.emb.weight, m2.scale]}])
        load_checkpoint(path, m2, opt2)
        assert_state_equal(m.state_dict(), m2.state_dict())
        sa, sb = opt.state_dict(), opt2.state_dict()
        for ga, gb in zip(sa["param_groups"], sb["param_groups"]):
            assert ga.keys() == gb.keys()
            for k in ga:
                same = torch.equal(ga[k], gb[k]) if isinstance(ga[k], torch.Tensor) else ga[k] == gb[k]
                assert same, k
        for i in sa["state"]:
            for k, v in sa["state"][i].items():
                if k == "info":
                    assert v.keys() == sb["state"][i][k].keys()
                    assert math.isnan(sb["state"][i][k]["nan"])
                    assert {a: b for a, b in v.items() if a != "nan"} == {
                        a: b for a, b in sb["state"][i][k].items() if a != "nan"
                    }
                elif isinstance(v, torch.Tensor):
                    assert torch.equal(v, sb["state"][i][k])
                else:
                    assert v == sb["state"][i][k]
        x, y = tokens(1, seed=3)[0]
        assert train_step(m, opt, x, y) == train_step(m2, opt2, x, y)


def test_chunked_writes_and_module_extra_state(tmp_path, monkeypatch):
    class WithExtra(Tiny):
        def __init__(self) -> None:
            super().__init__()
            self.vocab: dict = {"words": ["a", "b"], "ids": torch.arange(3)}

        def get_extra_state(self) -> dict:
            return self.vocab

        def set_extra_state(self, state: dict) -> None:
            self.vocab = state

    monkeypatch.setattr(fmt, "_CHUNK", 24)  # every tensor crosses several chunks
    torch.manual_seed(0)
    m = WithExtra()
    m.register_buffer("strided", torch.randn(6, 5, dtype=torch.bfloat16).t())
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, m)
    m2 = WithExtra()
    m2.vocab = {}
    m2.register_buffer("strided", torch.zeros(5, 6, dtype=torch.bfloat16))
    load_checkpoint(path, m2)
    assert m2.vocab["words"] == ["a", "b"] and torch.equal(m2.vocab["ids"], torch.arange(3))
    assert_state_equal(
        {k: v for k, v in m.state_dict().items() if k != "_extra_state"},
        {k: v for k, v in m2.state_dict().items() if k != "_extra_state"},
    )


@pytest.mark.parametrize("linear", [nn.Linear, rnn.Linear], ids=["nn.Linear", "ramtorch.nn.Linear"])
def test_exact_resume_with_dropout(tmp_path, linear):
    data = tokens(6)
    torch.manual_seed(0)
    m = Tiny(p=0.5, linear=linear)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for x, y in data[:3]:
        train_step(m, opt, x, y)
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, m, opt, extra={"step": 3})
    expected = [train_step(m, opt, x, y) for x, y in data[3:]]

    def resume(map_rng: bool) -> list[float]:
        torch.manual_seed(1)
        m2 = Tiny(p=0.5, linear=linear)
        opt2 = torch.optim.AdamW(m2.parameters(), lr=1.0)
        torch.rand(100)  # the RNG moves on after the checkpoint
        step = load_checkpoint(path, m2, opt2, map_rng=map_rng)["step"]
        return [train_step(m2, opt2, x, y) for x, y in data[step:]]

    assert resume(map_rng=True) == expected
    assert resume(map_rng=False) != expected  # the dropout masks depend on the restored RNG


# -- atomicity ----------------------------------------------------------------------------------

CRASH_SCRIPT = r"""
import sys, time
import torch
import ramtorch.checkpoint as ck
import ramtorch.io._progress as progress_mod
import ramtorch.io.format as fmt

path, marker = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
ck.save_checkpoint(path, torch.nn.Linear(16, 16))  # the first checkpoint, complete

write = fmt._write_chunk
def stall(f, chunk):
    write(f, chunk)  # part of the second checkpoint is in the temporary file...
    f.flush()
    open(marker, "w").close()
    time.sleep(600)  # ...when the parent kills us
fmt._write_chunk = stall
ck.save_checkpoint(path, torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]))
"""


def test_sigkill_while_saving_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    marker = tmp_path / "writing"
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASH_SCRIPT, str(path), str(marker)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            if proc.poll() is not None:
                pytest.fail(f"the saving process exited early: {proc.communicate()[1].decode()}")
            if time.monotonic() > deadline:
                pytest.fail("the saving process never reached the write hook")
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL

    (tmp,) = temps(path)  # the killed save's partial file is left behind...
    assert 8 < tmp.stat().st_size
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp, nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]))  # ...incomplete

    torch.manual_seed(0)
    first = nn.Linear(16, 16)
    loaded = nn.Linear(16, 16)
    load_checkpoint(path, loaded)  # ...and the target is the first checkpoint, whole
    assert_state_equal(first.state_dict(), loaded.state_dict())

    save_checkpoint(path, loaded)  # the next save of the same target removes the stale file
    assert temps(path) == []
    load_checkpoint(path, nn.Linear(16, 16))


@pytest.mark.parametrize("where", ["write", "fsync", "replace", "interrupt"])
def test_exception_while_saving_leaves_the_previous_file_untouched(tmp_path, monkeypatch, where):
    path = tmp_path / "ckpt.safetensors"
    torch.manual_seed(0)
    save_checkpoint(path, Tiny())
    before = path.read_bytes()

    if where in ("write", "interrupt"):
        write = fmt._write_chunk

        def failing(f, chunk):
            write(f, chunk)
            if where == "interrupt":
                raise KeyboardInterrupt
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")

        monkeypatch.setattr(fmt, "_write_chunk", failing)
    else:

        def failing(*args):
            raise OSError(errno.EIO, f"{where} failed (simulated)")

        monkeypatch.setattr(os, where, failing)

    big = Tiny(d=64)
    opt = torch.optim.AdamW(big.parameters())
    train_step(big, opt, *tokens(1)[0])
    with pytest.raises(KeyboardInterrupt if where == "interrupt" else OSError):
        save_checkpoint(path, big, opt)
    monkeypatch.undo()

    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors"]  # no temporary file


def test_unstorable_values_fail_before_writing(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    with pytest.raises(TypeError, match=r"extra\.fn.*function"):
        save_checkpoint(path, Tiny(), extra={"fn": print})
    with pytest.raises(TypeError, match="extra must be a dict"):
        save_checkpoint(path, Tiny(), extra=[1, 2])
    assert list(tmp_path.iterdir()) == []


# -- validation ----------------------------------------------------------------------------------


def test_truncated_corrupt_and_missing_files(tmp_path):
    torch.manual_seed(0)
    m = Tiny()
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, m, torch.optim.AdamW(m.parameters()))
    data = path.read_bytes()
    target = Tiny()
    before = {k: v.clone() for k, v in target.state_dict().items()}

    bad = tmp_path / "bad.safetensors"
    header_len = int.from_bytes(data[:8], "little")
    corrupt_header = bytearray(data)
    corrupt_header[8 + header_len // 2] ^= 0xFF
    for content in (
        data[: len(data) // 2],
        data[:-1],
        data[:5],
        b"",
        b"not a checkpoint at all" * 10,
        corrupt_header,
    ):
        bad.write_bytes(bytes(content))
        with pytest.raises(CheckpointError, match=rf"{bad}.*not a readable safetensors checkpoint"):
            load_checkpoint(bad, target)
    assert_state_equal(before, target.state_dict())  # untouched

    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        load_checkpoint(tmp_path / "missing.safetensors", target)


def test_mismatched_model_or_optimizer(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "ckpt.safetensors"
    m = Tiny()
    save_checkpoint(path, m, torch.optim.AdamW(m.parameters()))

    wide = Tiny(d=12)
    before = {k: v.clone() for k, v in wide.state_dict().items()}
    with pytest.raises(
        CheckpointError, match=r"'emb\.weight': shape \[11, 8\] in the checkpoint, \[11, 12\]"
    ):
        load_checkpoint(path, wide)
    assert_state_equal(before, wide.state_dict())  # checked before anything was loaded

    more = Tiny()
    more.extra_layer = nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match=r"missing keys .*'extra_layer\.weight', 'extra_layer\.bias'"):
        load_checkpoint(path, more)
    fewer = Tiny()
    del fewer.blocks[1]
    with pytest.raises(CheckpointError, match=r"unexpected keys .*'blocks\.1\.weight'"):
        load_checkpoint(path, fewer)

    # strict=False: the keys both have are loaded
    load_checkpoint(path, more, strict=False)
    load_checkpoint(path, fewer, strict=False)
    assert torch.equal(more.blocks[1].weight, m.blocks[1].weight)
    assert torch.equal(fewer.blocks[0].weight, m.blocks[0].weight)

    m2 = Tiny()
    one_group = torch.optim.AdamW(m2.parameters())
    two_groups = torch.optim.AdamW([{"params": m2.blocks.parameters()}, {"params": [m2.scale]}])
    with pytest.raises(CheckpointError, match=r"parameter groups of sizes \[6\] in the checkpoint, \[4, 1\]"):
        load_checkpoint(path, m2, two_groups)
    save_checkpoint(path, m)  # no optimizer state
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        load_checkpoint(path, m2, one_group)
    with pytest.warns(UserWarning, match="holds no optimizer state"):
        load_checkpoint(path, m2, one_group, strict=False)


def test_foreign_and_future_files(tmp_path):
    plain = tmp_path / "plain.safetensors"
    save_file({"weight": torch.zeros(2, 2)}, plain)
    with pytest.raises(CheckpointError, match="not a ramtorch checkpoint"):
        load_checkpoint(plain, nn.Linear(2, 2))
    future = tmp_path / "future.safetensors"
    save_file({"model.weight": torch.zeros(2, 2)}, future, metadata={"ramtorch.checkpoint": "99"})
    with pytest.raises(CheckpointError, match="unknown checkpoint format version '99'"):
        load_checkpoint(future, nn.Linear(2, 2))


def test_rng_false_saves_no_rng_state(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, nn.Linear(2, 2), rng=False)
    assert not any(k.startswith("rng.") for k in load_file(path))
    load_checkpoint(path, nn.Linear(2, 2))


def test_progress_bar(tmp_path, capsys, monkeypatch):
    path = tmp_path / "ckpt.safetensors"
    m = Tiny()
    opt = torch.optim.AdamW(m.parameters())
    train_step(m, opt, *tokens(1)[0])
    save_checkpoint(path, m, opt)
    load_checkpoint(path, m, opt)
    assert capsys.readouterr().err == ""  # small: no bar by default

    save_checkpoint(path, m, opt, progress=True)
    load_checkpoint(path, m, opt, progress=True)
    err = capsys.readouterr().err
    assert "ramtorch.save_checkpoint" in err and "ramtorch.load_checkpoint" in err
    assert all(not mod._load_state_dict_pre_hooks for mod in m.modules())  # hooks removed

    monkeypatch.setattr(progress_mod, "_GIB", 16)  # "large" checkpoint: bar by default
    save_checkpoint(path, m, opt)
    assert "ramtorch.save_checkpoint" in capsys.readouterr().err


# -- ramtorch parameters: loaded in place ---------------------------------------------------------


def test_ramtorch_linear_loaded_in_place(tmp_path):
    torch.manual_seed(0)
    src = Tiny(linear=rnn.Linear)
    opt = torch.optim.AdamW(src.parameters())
    train_step(src, opt, *tokens(1)[0])
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, src, opt)

    dst = Tiny(linear=rnn.Linear)
    dst_opt = torch.optim.AdamW(dst.parameters())
    ptrs = [p.data_ptr() for p in dst.parameters()]
    params = list(dst.parameters())
    x, y = tokens(1, seed=1)[0]
    dst(x)  # a forward before loading: the engine's slots hold the old weights
    load_checkpoint(path, dst, dst_opt)
    assert [p.data_ptr() for p in dst.parameters()] == ptrs
    assert all(a is b for a, b in zip(params, dst.parameters()))
    assert all(b._is_home() for b in dst.blocks)  # still in the host arena
    assert_state_equal(src.state_dict(), dst.state_dict())
    assert torch.equal(src(x), dst(x))  # the new weights are streamed, not the slots' old ones
    assert train_step(src, opt, x, y) == train_step(dst, dst_opt, x, y)


@pytest.mark.skipif(not hasattr(ramtorch, "offload"), reason="ramtorch.offload is not available")
def test_offloaded_model_loaded_in_place(tmp_path):
    torch.manual_seed(0)
    src = Tiny()
    opt = torch.optim.AdamW(src.parameters())
    train_step(src, opt, *tokens(1)[0])
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, src, opt)

    dst = ramtorch.offload(Tiny(), device="cpu")
    dst_opt = torch.optim.AdamW(dst.parameters())
    x, y = tokens(1, seed=1)[0]
    dst(x)
    ptrs = [p.data_ptr() for p in dst.parameters()]
    load_checkpoint(path, dst, dst_opt)
    assert [p.data_ptr() for p in dst.parameters()] == ptrs
    assert_state_equal(src.state_dict(), dst.state_dict())
    assert torch.equal(src(x), dst(x))
    assert train_step(src, opt, x, y) == train_step(dst, dst_opt, x, y)

    # and an offloaded model saves like any other
    save_checkpoint(path, dst, dst_opt)
    again = Tiny()
    load_checkpoint(path, again)
    assert_state_equal(dst.state_dict(), again.state_dict())


@pytest.mark.gpu
def test_round_trip_on_gpu(tmp_path):
    torch.manual_seed(0)
    m = Tiny().cuda()
    opt = torch.optim.AdamW(m.parameters())
    x, y = (t.cuda() for t in tokens(1)[0])
    train_step(m, opt, x, y)
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, m, opt)
    assert f"rng.cuda.{torch.cuda.current_device()}" in load_file(path)
    m2 = Tiny().cuda()
    opt2 = torch.optim.AdamW(m2.parameters())
    load_checkpoint(path, m2, opt2)
    assert_state_equal(m.state_dict(), m2.state_dict())
    assert_optim_equal(opt, opt2)


# -- reading in place -----------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32-master", "bf16"])
def test_ramtorch_optimizer_resumes_from_states_read_in_place(tmp_path, precision):
    """An offloaded bf16 model with ramtorch's AdamW: the load replaces the optimizer's states
    (which it had from a step of its own) with the saved ones, and training goes on exactly as
    without stopping."""
    torch.manual_seed(0)
    src = ramtorch.offload(Tiny(d=16).to(torch.bfloat16), device="cpu")
    opt = ramtorch.optim.AdamW(src.parameters(), lr=1e-2, precision=precision)
    data = tokens(6)
    for x, y in data[:2]:
        train_step(src, opt, x, y)
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, src, opt)

    torch.manual_seed(1)
    dst = ramtorch.offload(Tiny(d=16).to(torch.bfloat16), device="cpu")
    dst_opt = ramtorch.optim.AdamW(dst.parameters(), lr=1e-2, precision=precision)
    train_step(dst, dst_opt, *data[5])  # states of its own, replaced by the load
    ptrs = [p.data_ptr() for p in dst.parameters()]
    load_checkpoint(path, dst, dst_opt)
    assert [p.data_ptr() for p in dst.parameters()] == ptrs
    assert_state_equal(src.state_dict(), dst.state_dict())
    assert_optim_equal(opt, dst_opt)
    for x, y in data[2:5]:
        assert train_step(src, opt, x, y) == train_step(dst, dst_opt, x, y)
    assert_state_equal(src.state_dict(), dst.state_dict())


def test_load_state_dict_copies_the_given_tensors():
    """The public load_state_dict gives the optimizer tensors of its own: stepping it leaves the
    dict it was loaded from unchanged."""
    torch.manual_seed(0)
    model = ramtorch.offload(Tiny().to(torch.bfloat16), device="cpu")
    opt = ramtorch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt, *tokens(1)[0])
    sd = opt.state_dict()
    snapshot = {i: {k: v.clone() for k, v in s.items()} for i, s in sd["state"].items()}
    opt.load_state_dict(sd)
    train_step(model, opt, *tokens(1, seed=2)[0])
    for i, s in sd["state"].items():
        for k, v in s.items():
            assert torch.equal(v, snapshot[i][k]), (i, k)


def test_modules_with_their_own_loading_or_hooks_still_get_it(tmp_path):
    torch.manual_seed(0)
    src = nn.Sequential(nn.Linear(4, 4), Doubling(4, 4), nn.Linear(4, 4))
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, src)
    dst = ramtorch.offload(nn.Sequential(nn.Linear(4, 4), Doubling(4, 4), nn.Linear(4, 4)), device="cpu")
    seen = []
    dst[2].register_load_state_dict_pre_hook(lambda module, sd, prefix, *a: seen.append(prefix))
    load_checkpoint(path, dst)
    assert torch.equal(dst[0].weight, src[0].weight)
    assert torch.equal(dst[1].weight, src[1].weight * 2)
    assert torch.equal(dst[1].bias, src[1].bias)
    assert torch.equal(dst[2].weight, src[2].weight)
    assert seen == ["2."]


def test_a_load_hook_above_a_module_still_sees_its_keys(tmp_path):
    """A load hook on the root may rewrite any key: the whole model then loads through
    load_state_dict, as torch would."""
    torch.manual_seed(0)
    src = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, src)
    dst = ramtorch.offload(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), device="cpu")

    def negate_first(module, state_dict, prefix, *args):  # noqa: ANN001, ANN002
        state_dict[prefix + "0.weight"] = -state_dict[prefix + "0.weight"]

    dst.register_load_state_dict_pre_hook(negate_first)
    load_checkpoint(path, dst)
    assert torch.equal(dst[0].weight, -src[0].weight)
    assert torch.equal(dst[1].weight, src[1].weight)


_PEAK = """
import sys, threading, time
from pathlib import Path
import torch, ramtorch
from torch import nn

def rss(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
torch.manual_seed(0)
m = ramtorch.offload(nn.Sequential(*[nn.Linear(1024, 1024, bias=False, dtype=torch.bfloat16)
                                     for _ in range(48)]), device="cpu", progress=False)
opt = ramtorch.optim.AdamW(m.parameters(), lr=1e-3)
x = torch.randn(4, 1024, dtype=torch.bfloat16)
for _ in range(2):
    m(x).float().pow(2).mean().backward(); opt.step(); opt.zero_grad()
path = sys.argv[1]
ramtorch.save_checkpoint(path, m, opt, progress=False)
want = {k: v.clone() for k, v in m.state_dict().items()}
want_opt = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
state_bytes = sum(v.numel() * v.element_size() for s in want_opt.values() for v in s.values())
with torch.no_grad():
    for p in m.parameters():
        p.zero_()
before = rss("RssAnon")
peak = [before]
stop = threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], rss("RssAnon")); stop.wait(0.001)
th = threading.Thread(target=sample, daemon=True); th.start()
ramtorch.load_checkpoint(path, m, opt, progress=False)
stop.set(); th.join()
assert all(torch.equal(m.state_dict()[k], v) for k, v in want.items())
got = opt.state_dict()["state"]
assert all(torch.equal(got[i][k], v) for i, s in want_opt.items() for k, v in s.items())
print(f"state {state_bytes} grew {peak[0] - before}")
"""


def test_resuming_holds_one_copy_of_the_optimizer_state(tmp_path):
    """Loading a checkpoint into a model and ramtorch optimizer that already hold state does not
    hold the old and new optimizer states (let alone temporary copies) at once."""
    cmd = [sys.executable, "-c", _PEAK, str(tmp_path / "c.safetensors")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    words = r.stdout.split()
    state, grew = int(words[1]), int(words[3])
    assert state > 500 << 20, r.stdout  # 48 x 1M bf16 parameters: fp32 master + moments
    assert grew < 0.15 * state, r.stdout


# -- one file, read whole ------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_file_renamed_over_the_path_while_loading_is_read_whole(tmp_path, monkeypatch, when):
    """Another checkpoint renamed over the path while loading (before or after the loader opens
    it): the model, optimizer and extra all come from one of the two files, never half of each."""
    torch.manual_seed(0)
    a, b = Tiny(), Tiny()
    opt_a, opt_b = torch.optim.AdamW(a.parameters()), torch.optim.AdamW(b.parameters())
    train_step(a, opt_a, *tokens(1)[0])
    train_step(b, opt_b, *tokens(1, seed=1)[0])
    path, other = tmp_path / "ckpt.safetensors", tmp_path / "other.safetensors"
    save_checkpoint(path, a, opt_a, extra={"which": torch.tensor(1)})
    save_checkpoint(other, b, opt_b, extra={"which": torch.tensor(2)})

    real = ramtorch._core.SafetensorsFile
    swapped: list[bool] = []

    def swap() -> None:
        if not swapped:
            os.replace(other, path)
            swapped.append(True)

    def opening(*args: object) -> object:
        if when == "before":
            swap()
        f = real(*args)
        if when == "after":
            swap()
        return f

    monkeypatch.setattr(ramtorch._core, "SafetensorsFile", opening)
    dst = Tiny()
    dst_opt = torch.optim.AdamW(dst.parameters())
    extra = load_checkpoint(path, dst, dst_opt)
    assert swapped
    src, src_opt = (a, opt_a) if extra["which"].item() == 1 else (b, opt_b)
    assert_state_equal(src.state_dict(), dst.state_dict())
    assert_optim_equal(src_opt, dst_opt)


# -- validation before writing -------------------------------------------------------------------


def rewrite(path: Path, meta: dict[str, str] | None = None, tensors: dict | None = None) -> None:
    """Rewrites checkpoint ``path`` with some metadata entries and tensors replaced."""
    with safe_open(path, framework="pt") as f:
        old_meta = f.metadata()
    data = load_file(path)
    data.update(tensors or {})
    save_file(data, path, metadata={**old_meta, **(meta or {})})


_DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({"tensors": {"rng.cpu": torch.zeros(10, dtype=torch.uint8)}}, id="rng-too-short"),
        pytest.param({"tensors": {"rng.cpu": torch.zeros(5056, dtype=torch.int64)}}, id="rng-dtype"),
        pytest.param({"meta": {"ramtorch.rng": '{"cpu": 5, "cuda": []}'}}, id="rng-key-not-a-string"),
        pytest.param({"meta": {"ramtorch.rng": '{"cpu": "rng.cpu", "cuda": [[1]]}'}}, id="rng-cuda-keys"),
        pytest.param({"meta": {"ramtorch.rng": '["rng.cpu"]'}}, id="rng-not-an-object"),
        pytest.param(
            {"meta": {"ramtorch.aliases": '{"model.head.weight": ["model.emb.weight"]}'}}, id="alias-list"
        ),
        pytest.param({"meta": {"ramtorch.aliases": '["x"]'}}, id="aliases-list"),
        pytest.param({"meta": {"ramtorch.extra": _DEEP}}, id="deep-json"),
        pytest.param({"meta": {"ramtorch.extra": '{"a": ' + "[" * 900 + "]" * 900 + "}"}}, id="deep-decode"),
        pytest.param({"meta": {"ramtorch.optimizer": _DEEP}}, id="deep-optimizer"),
        pytest.param({"meta": {"ramtorch.model": '{"keys": [1, 2], "objects": {}}'}}, id="model-keys"),
        pytest.param({"meta": {"ramtorch.extra": '{"t": {"__tensor__": ["x"]}}'}}, id="tensor-ref-list"),
    ],
)
def test_a_bad_entry_is_found_before_anything_is_written(tmp_path, bad):
    """Every part of the file is checked before the model, the optimizer or the RNG is touched:
    a bad entry is a CheckpointError naming it, and nothing changed."""
    torch.manual_seed(0)
    src = Tiny()
    opt = torch.optim.AdamW(src.parameters())
    train_step(src, opt, *tokens(1)[0])
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, src, opt, extra={"step": 3})
    rewrite(path, bad.get("meta"), bad.get("tensors"))

    torch.manual_seed(1)
    dst = Tiny()
    dst_opt = torch.optim.AdamW(dst.parameters())
    train_step(dst, dst_opt, *tokens(1, seed=2)[0])
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    before_opt = torch.optim.AdamW(Tiny().parameters())
    before_opt.load_state_dict(dst_opt.state_dict())
    rng = torch.get_rng_state()
    with pytest.raises(CheckpointError, match=str(path)):
        load_checkpoint(path, dst, dst_opt)
    assert_state_equal(before, dst.state_dict())
    assert_optim_equal(before_opt, dst_opt)
    assert torch.equal(rng, torch.get_rng_state())


def test_nested_extra_values_round_trip_up_to_the_limit(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    deep: object = [torch.tensor(1.0), 2]
    for i in range(50):
        deep = {"k": deep} if i % 3 == 0 else ((deep,) if i % 3 == 1 else {i: deep})
    save_checkpoint(path, Tiny(), extra={"deep": deep})
    got = load_checkpoint(path, Tiny())["deep"]
    for i in reversed(range(50)):
        got = got["k"] if i % 3 == 0 else (got[0] if i % 3 == 1 else got[i])
    assert torch.equal(got[0], torch.tensor(1.0)) and got[1] == 2
    too_deep: object = 1
    for _ in range(100):
        too_deep = [too_deep]
    with pytest.raises(TypeError, match="nested more than"):
        save_checkpoint(path, Tiny(), extra={"deep": too_deep})


@pytest.mark.parametrize("how", ["state-not-a-dict", "step-missing", "step-a-dict", "ids-repeated"])
def test_an_optimizer_state_the_optimizer_refuses_is_found_before_writing(tmp_path, how):
    torch.manual_seed(0)
    src = Tiny()
    opt = torch.optim.AdamW(src.parameters())
    train_step(src, opt, *tokens(1)[0])
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, src, opt)
    with safe_open(path, framework="pt") as f:
        saved = json.loads(f.metadata()["ramtorch.optimizer"])
    states = saved["state"]["__dict__"]
    if how == "state-not-a-dict":
        saved["state"] = {"__float__": "nan"}
    elif how == "step-missing":
        del states[0][1]["step"]
    elif how == "step-a-dict":
        states[0][1]["step"] = {"a": 1}
    else:
        saved["param_groups"][0]["params"][1] = saved["param_groups"][0]["params"][0]
    rewrite(path, {"ramtorch.optimizer": json.dumps(saved)})

    dst = Tiny()
    dst_opt = torch.optim.AdamW(dst.parameters())
    train_step(dst, dst_opt, *tokens(1, seed=2)[0])
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    before_opt = torch.optim.AdamW(Tiny().parameters())
    before_opt.load_state_dict(dst_opt.state_dict())
    with pytest.raises(CheckpointError, match="optimizer"):
        load_checkpoint(path, dst, dst_opt)
    assert_state_equal(before, dst.state_dict())
    assert_optim_equal(before_opt, dst_opt)
