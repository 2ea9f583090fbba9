"""A large unit of torch's layers copied in parts and computed layer by layer as they land
(``ramtorch._stream.parts``): bitwise plain torch (each layer computes the same op on the same
bytes), on the CPU's host device (whose copies run on a thread of their own) and on a GPU; the
guard that waits for the whole copy when a module reads another's weights; the cases that go
whole. The thresholds are lowered so that small units qualify."""

from __future__ import annotations

import copy

import pytest
import ramtorch
import torch
import torch.nn.functional as F
from ramtorch._stream import parts
from torch import nn


@pytest.fixture(autouse=True)
def small_units(monkeypatch):
    monkeypatch.setattr(parts, "MIN_BYTES", 1 << 14)
    monkeypatch.setattr(parts, "MIN_PART_BYTES", 1 << 12)
    monkeypatch.setattr(parts, "DOMINANCE", 0.0)  # (units alike are cut too)
    # Other tests of this process compile: this state is the process's (tested in a process of
    # its own below).
    monkeypatch.setattr(parts, "compiled_anything", lambda: False)


class Stage(nn.Module):
    """A stage of convolutional blocks (a unit: the model repeats it)."""

    def __init__(self, c: int, blocks: int = 3, direct: bool = False) -> None:
        super().__init__()
        self.direct = direct
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c, 1))
            for _ in range(blocks)
        )
        self.out = nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        if self.direct:  # reads a layer's weight outside that layer's forward
            return F.linear(x.transpose(1, 3), self.out.weight).transpose(1, 3)
        return self.out(x.transpose(1, 3)).transpose(1, 3)


class Net(nn.Module):
    def __init__(self, direct: bool = False, stages: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stages = nn.ModuleList(Stage(32, direct=direct) for _ in range(stages))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for s in self.stages:
            x = s(x)
        return x


def cut(m: nn.Module) -> int:
    return ramtorch.stats(m)["forwards_by_parts"]


def units(m: nn.Module) -> list:
    return m._ramtorch_streamer.units


def run_both(ref: nn.Module, ours: nn.Module, device: str, steps: int = 3) -> None:
    """Forwards in both modes, backwards and SGD steps: bitwise equal."""
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for train in (True, False, True):
        ref.train(train)
        ours.train(train)
        for _ in range(steps):
            x = torch.randn(2, 32, 6, 6, generator=gen).to(device)
            y_ref, y = ref(x), ours(x)
            assert torch.equal(y, y_ref)
            if train:
                y_ref.square().mean().backward()
                y.square().mean().backward()
                for a, b in zip(ref.parameters(), ours.parameters()):
                    assert (a.grad is None) == (b.grad is None)
                    assert a.grad is None or torch.equal(b.grad.to(a.device), a.grad)
                opt_ref.step()
                opt.step()
                opt_ref.zero_grad()
                opt.zero_grad()
    for a, b in zip(ref.buffers(), ours.buffers()):
        assert torch.equal(b.to(a.device), a)  # batch norm statistics


def test_by_parts_is_bitwise_torch(device):
    ref, ours = Net().to(device), Net()
    ramtorch.offload(ours, device=device)
    plans = [parts.plan_of(u) for u in units(ours)]
    assert all(p is not None and len(p.parts) >= 2 for p in plans)
    run_both(ref, ours, device)
    # The first forward in each mode of each unit waits for all and is watched; the others are cut.
    assert cut(ours) == 3 * (3 + 3 + 3) - 3 * 2
    assert all(p.refused == set() and p.watched == {True, False} for p in plans)


def test_the_environment_sets_the_least_size_or_turns_it_off(monkeypatch):
    monkeypatch.setattr(parts, "MIN_BYTES", None)
    monkeypatch.delenv("RAMTORCH_UNIT_PARTS_MIN_BYTES", raising=False)
    ours = Net()
    ramtorch.offload(ours, device="cpu")
    assert all(parts.plan_of(u) is None for u in units(ours))  # under the default 64 MiB
    monkeypatch.setenv("RAMTORCH_UNIT_PARTS_MIN_BYTES", "16KiB")
    on = Net()
    ramtorch.offload(on, device="cpu")
    assert all(parts.plan_of(u) is not None for u in units(on))
    on(torch.randn(2, 32, 6, 6))
    on(torch.randn(2, 32, 6, 6))
    assert cut(on) == 3
    monkeypatch.setenv("RAMTORCH_UNIT_PARTS_MIN_BYTES", "off")
    off = Net()
    ramtorch.offload(off, device="cpu")
    assert all(parts.plan_of(u) is None for u in units(off))
    monkeypatch.setenv("RAMTORCH_UNIT_PARTS_MIN_BYTES", "lots")
    with pytest.raises(ValueError, match="RAMTORCH_UNIT_PARTS_MIN_BYTES"):
        ramtorch.offload(Net(), device="cpu")


def test_a_unit_is_cut_where_it_holds_several_times_the_mean_or_ends_the_pass(monkeypatch):
    """Units alike are not cut (their copies overlap the compute already), but for the one that
    ends the forward pass and the one computed before it (known from the first pass on); one that
    holds most of the bytes is."""
    monkeypatch.setattr(parts, "DOMINANCE", 2.0)

    def cuts(m: nn.Module) -> list[bool]:
        return [bool(parts.copy_parts(u)) for u in units(m)]

    alike = Net()
    ramtorch.offload(alike, device="cpu")
    assert cuts(alike) == [False, False, False]
    for _ in range(3):
        alike(torch.randn(2, 32, 6, 6))
    assert cuts(alike) == [False, True, True]
    assert cut(alike) == 2  # the first pass finds the end, the second is watched, the third cut

    class Uneven(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.stages = nn.ModuleList(Stage(32, blocks=n) for n in (1, 1, 8, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for s in self.stages:
                x = s(x)
            return x

    ref, ours = Uneven(), Uneven()
    ramtorch.offload(ours, device="cpu")
    assert cuts(ours) == [False, False, True, False]
    for _ in range(3):
        x = torch.randn(2, 32, 6, 6)
        assert torch.equal(ours(x), ref(x))
    assert cuts(ours) == [False, False, True, True]
    assert cut(ours) == 2 + 1


def test_the_units_near_the_end_follow_the_pass_that_ran_last(monkeypatch):
    """A pass that stops earlier (a model that skips its last stage) moves both flags: the unit
    that ended it and the one before it; a pass through all stages again moves them back."""
    monkeypatch.setattr(parts, "DOMINANCE", 2.0)

    class Skips(Net):
        def forward(self, x: torch.Tensor, upto: int = 3) -> torch.Tensor:
            for s in self.stages[:upto]:
                x = s(x)
            return x

    ref, ours = Skips(), Skips()
    ramtorch.offload(ours, device="cpu")

    def flags() -> list[tuple[bool, bool]]:
        return [(u.before_end, u.ends_forward) for u in units(ours)]

    x = torch.randn(2, 32, 6, 6)
    for upto, want in (
        (3, [(False, False), (True, False), (False, True)]),
        (2, [(True, False), (False, True), (False, False)]),
    ):
        for _ in range(3):
            assert torch.equal(ours(x, upto), ref(x, upto))
        assert flags() == want
    for _ in range(3):
        assert torch.equal(ours(x), ref(x))
    assert flags() == [(False, False), (True, False), (False, True)]


def test_the_unit_before_the_end_skips_units_too_small_to_cut(monkeypatch):
    """A small unit between the last large ones and the end (a final norm, a small head) ends the
    pass and is not cut; the large unit before it is."""
    monkeypatch.setattr(parts, "DOMINANCE", 2.0)

    class Headed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = Net()
            self.norm = nn.LayerNorm(32)  # its own unit, below the least size of a cut

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.body(x).transpose(1, 3)).transpose(1, 3)

    ref, ours = Headed(), Headed()
    ramtorch.offload(ours, device="cpu")
    names = [u.name for u in units(ours)]
    for _ in range(3):
        x = torch.randn(2, 32, 6, 6)
        assert torch.equal(ours(x), ref(x))
    flagged = {u.name for u in units(ours) if u.before_end}
    assert flagged == {names[2]}, (names, flagged)
    assert [bool(parts.copy_parts(u)) for u in units(ours)] == [n == names[2] for n in names]
    assert cut(ours) == 1


class Peek(Stage):
    """A stage that notes where two weights are before and after its layers run (``peek``)."""

    def __init__(self) -> None:
        super().__init__(32)
        self.peek: list[tuple[int, int]] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        note = self.peek
        if note is not None:
            note.append((self.out.weight.data_ptr(), self.blocks[0][0].weight.data_ptr()))
        y = super().forward(x)
        if note is not None:
            note.append((self.out.weight.data_ptr(), self.blocks[0][0].weight.data_ptr()))
        return y


def test_a_read_outside_the_layers_in_a_cut_forward_gets_the_hosts_bytes():
    """A branch that reads a layer's weight outside the layer, taken only after the watched
    forward: until its layer runs, the weight is the host's (never slot bytes that may not have
    landed); once a layer ran, its weights are the slot's (their part was waited for)."""
    torch.manual_seed(0)
    ref = Net()
    ref.stages = nn.ModuleList([Peek(), Peek()])
    ours = copy.deepcopy(ref)
    ramtorch.offload(ours, device="cpu")
    first = ours.stages[0]
    host = (first.out.weight.data_ptr(), first.blocks[0][0].weight.data_ptr())
    x = torch.randn(2, 32, 6, 6)
    assert torch.equal(ours(x), ref(x))  # watched, whole: clean
    for net in (ref, ours):
        net.stages[0].direct = True  # now reads out.weight with F.linear, past its layer
    first.peek = []
    assert torch.equal(ours(x), ref(x))
    assert cut(ours) == 2
    (out_before, block_before), (out_after, block_after) = first.peek
    assert out_before == host[0] and block_before == host[1]
    assert out_after == host[0]  # (its layer did not run)
    assert block_after != host[1]  # the slot's


def test_parts_follow_the_layers_and_each_layer_waits_for_its_own():
    ours = Net()
    ramtorch.offload(ours, device="cpu")
    u = units(ours)[0]
    p = parts.plan_of(u)
    assert p.parts == sorted(set(p.parts)) and p.parts[-1] < u.layout.nbytes
    for e in u.entries:
        off, shape, dtype = u.layout.entries[e.index]
        end = off + torch.Size(shape).numel() * dtype.itemsize
        upto = p.upto[id(e.owner)]
        assert upto >= end  # the part it waits for holds its bytes
        assert upto == u.layout.nbytes or upto in p.parts


def test_a_module_that_reads_a_layers_weight_itself_keeps_its_unit_whole():
    """The watched first forward sees the read outside the layer: the unit is never cut in that
    mode (and the results are torch's)."""
    ref, ours = Net(direct=True), Net(direct=True)
    ramtorch.offload(ours, device="cpu")
    run_both(ref, ours, "cpu")
    assert cut(ours) == 0
    assert all(parts.plan_of(u).refused == {True, False} for u in units(ours))


def test_a_watched_forward_waits_for_the_whole_copy_first(monkeypatch):
    """The first forward in a mode claims the whole copy before the unit's layers run; the next
    one waits part by part (more than one wait, each for a prefix)."""
    from ramtorch import _engine

    log: list[str] = []
    claim, part = _engine.DeviceEngine.claim, _engine.DeviceEngine.claim_part
    monkeypatch.setattr(
        _engine.DeviceEngine, "claim", lambda self, i, tag=0: log.append("whole") or claim(self, i, tag)
    )
    monkeypatch.setattr(
        _engine.DeviceEngine,
        "claim_part",
        lambda self, i, upto, tag=0: log.append(f"part {upto}") or part(self, i, upto, tag),
    )
    ours = Net(stages=1)
    ramtorch.offload(ours, device="cpu")
    x = torch.randn(2, 32, 6, 6)
    ours(x)
    assert log[0] == "whole" and not any(x.startswith("part") for x in log)
    log.clear()
    ours(x)
    # Per unit, waits for growing prefixes, then the whole copy at the end of its forward (what
    # follows may read any byte).
    assert log[-1] == "whole" and log[0].startswith("part")
    for run in " ".join(log).split("whole"):
        waits = [int(w) for w in run.split("part")[1:]]
        assert waits == sorted(set(waits))
    assert sum(x.startswith("part") for x in log) >= 2


def test_a_cut_forward_queues_the_copies_ahead_after_its_layers(monkeypatch):
    """Queueing a copy may wait on the host for the oldest one in flight (the engine keeps
    max_inflight), which can be the cut unit's own: its layers' kernels are queued first, so that
    they compute on its first parts meanwhile. A forward that goes whole queues them as it
    begins."""
    from ramtorch import _engine
    from ramtorch._stream.streamer import Streamer

    log: list[tuple[str, int]] = []
    part, along = _engine.DeviceEngine.claim_part, Streamer._prefetch_along
    monkeypatch.setattr(
        _engine.DeviceEngine,
        "claim_part",
        lambda self, i, upto, tag=0: log.append(("part", tag)) or part(self, i, upto, tag),
    )

    def logged(self, itin, pos, current, *rest):
        if current is not None:
            log.append(("ahead", current.tag))
        return along(self, itin, pos, current, *rest)

    monkeypatch.setattr(Streamer, "_prefetch_along", logged)
    ours = Net(stages=4)
    ramtorch.offload(ours, device="cpu")
    x = torch.randn(2, 32, 6, 6)
    ours(x)  # watched, whole; the itinerary is learnt
    assert log == []
    ours(x)  # cut, with copies ahead along the itinerary
    for u in units(ours)[:-1]:  # (the last unit has none ahead)
        mine = [k for k, tag in log if tag == u.tag]
        assert mine.count("part") >= 2 and mine[-1] == "ahead", mine
    log.clear()
    monkeypatch.setattr(parts, "by_parts", lambda *a, **k: None)
    ours(x)  # whole: its copies ahead come first
    assert [k for k, _ in log] == ["ahead"] * len(units(ours))


@pytest.mark.parametrize("case", ["user-hook", "function-mode"])
def test_what_is_not_cut_goes_whole_and_matches(case):
    ref, ours = Net(), Net()
    ramtorch.offload(ours, device="cpu")
    if case == "user-hook":
        for s in ours.stages:
            s.blocks[1][0].register_forward_pre_hook(lambda m, a: None)
    x = torch.randn(2, 32, 6, 6)
    for _ in range(3):
        if case == "function-mode":

            class Noop(torch.overrides.TorchFunctionMode):
                def __torch_function__(self, func, types, args=(), kwargs=None):
                    return func(*args, **(kwargs or {}))

            with Noop():
                y = ours(x)
        else:
            y = ours(x)
        assert torch.equal(y, ref(x))
    assert cut(ours) == 0


def _in_a_process(code: str) -> list[str]:
    """What ``code`` prints, run in a process of its own (compiling is the process's state)."""
    import os
    import subprocess
    import sys

    pkg = os.path.dirname(os.path.dirname(os.path.abspath(ramtorch.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([pkg, os.path.dirname(os.path.abspath(__file__))])}
    head = (
        "import torch, ramtorch, test_parts as t\n"
        "from ramtorch._stream import parts\n"
        "parts.MIN_BYTES, parts.MIN_PART_BYTES, parts.DOMINANCE = 1 << 14, 1 << 12, 0.0\n"
        "def hooks(m):\n"
        "    return sum(len(o._forward_pre_hooks) for u in t.units(m) for o in parts.plan_of(u).owners)\n"
    )
    out = subprocess.run([sys.executable, "-c", head + code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def test_a_process_that_compiled_goes_whole():
    """Once anything was compiled, a graph might read a unit's weights without its layers' hooks in
    between: no unit is cut, and its layers get no hooks (they would have nothing to do)."""
    code = (
        "torch.compile(lambda v: v + 1, backend='eager')(torch.ones(1))\n"
        "ref, ours = t.Net(), t.Net()\n"
        "ramtorch.offload(ours, device='cpu')\n"
        "x = torch.randn(2, 32, 6, 6)\n"
        "same = all(torch.equal(ours(x), ref(x)) for _ in range(3))\n"
        "print(same, t.cut(ours), hooks(ours))\n"
    )
    assert _in_a_process(code)[-3:] == ["True", "0", "0"]


def test_compiling_a_cut_model_takes_its_layers_hooks_off():
    """A model cut in eager mode, then compiled: it goes whole, and its layers' hooks come off at
    their first call (they have nothing to do from then on)."""
    code = (
        "ref, ours = t.Net(), t.Net()\n"
        "ramtorch.offload(ours, device='cpu')\n"
        "x = torch.randn(2, 32, 6, 6)\n"
        "eager = all(torch.equal(ours(x), ref(x)) for _ in range(3))\n"
        "cut, before = t.cut(ours), hooks(ours)\n"
        "f = torch.compile(ours, backend='eager')\n"
        "same = all(torch.equal(f(x), ref(x)) for _ in range(3))\n"
        "print(eager, same, cut > 0, before > 0, t.cut(ours) - cut, hooks(ours))\n"
    )
    assert _in_a_process(code)[-6:] == ["True", "True", "True", "True", "0", "0"]


def test_units_of_other_layers_are_not_cut():
    class Mine(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(64, 64), Mine(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    m = nn.Sequential(*[Block() for _ in range(3)])
    ramtorch.offload(m, device="cpu")
    assert all(parts.plan_of(u) is None for u in units(m))


def test_a_resnet_stage_is_cut():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[16, 32, 64, 128], layer_type="bottleneck", depths=[2, 2, 4, 2]
    )
    torch.manual_seed(0)
    ref = transformers.ResNetModel(cfg)
    ours = copy.deepcopy(ref)
    ramtorch.offload(ours, device="cpu")
    for train in (True, False):
        ref.train(train)
        ours.train(train)
        for _ in range(2):
            x = torch.randn(2, 3, 32, 32)
            assert torch.equal(ours(x).last_hidden_state, ref(x).last_hidden_state)
    assert cut(ours) > 0


@pytest.mark.gpu
def test_by_parts_on_cuda_at_the_real_thresholds(monkeypatch):
    """Stages of 72 MiB at the default thresholds: cut, bitwise the same offloaded model with its
    units whole, and the resident model's up to the kernels' rounding (cuDNN may pick other
    algorithms for weights at other addresses, and TF32 convolutions round coarsely)."""
    monkeypatch.setattr(parts, "MIN_BYTES", 64 << 20)
    monkeypatch.setattr(parts, "MIN_PART_BYTES", 16 << 20)

    class Big(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.stages = nn.ModuleList(Stage(1024, blocks=2) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for s in self.stages:
                x = s(x)
            return x

    ref = Big().cuda()
    ours = Big()
    ramtorch.offload(ours, device="cuda")
    assert all(parts.plan_of(u) is not None for u in units(ours))
    by_parts = parts.by_parts
    for train in (True, False, False, False):
        ref.train(train)
        ours.train(train)
        x = torch.randn(2, 1024, 4, 4, device="cuda")
        with torch.no_grad():
            y = ours(x)
            torch.testing.assert_close(y, ref(x), rtol=1e-2, atol=1e-2)
            if not train:  # (a forward in training mode moves the batch norms' statistics)
                monkeypatch.setattr(parts, "by_parts", lambda *a, **k: None)
                assert torch.equal(ours(x), y)
                monkeypatch.setattr(parts, "by_parts", by_parts)
    # The first forward in each mode is watched under the whole copy; the two after it are cut.
    assert cut(ours) == 3 * 2
    assert all(parts.plan_of(u).watched == {True, False} for u in units(ours))


def test_a_unit_is_cut_in_at_most_max_parts(monkeypatch):
    """Many layers make few parts: each part is a copy and an event on the transfer stream."""
    many = Net()
    ramtorch.offload(many, device="cpu")
    assert len(parts.plan_of(units(many)[0]).parts) + 1 > 3
    monkeypatch.setattr(parts, "MAX_PARTS", 3)
    ref, ours = Net(), Net()
    ramtorch.offload(ours, device="cpu")
    for u in units(ours):
        p = parts.plan_of(u)
        assert p is not None and len(p.parts) + 1 <= 3
        least = -(-u.layout.nbytes // 3)
        assert all(b - a >= least for a, b in zip([0, *p.parts], p.parts))
    run_both(ref, ours, "cpu")
    assert cut(ours) > 0


class Mlp(nn.Module):
    """Units that end with a large Linear (W1's block): the last layer of the unit that ends the
    pass is computed by blocks of rows within its part (``Plan.rows``)."""

    def __init__(self, n: int = 3, d: int = 32, f: int = 128) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, f), nn.GELU(), nn.Linear(f, f, bias=False)) for _ in range(n)
        )
        self.mix = nn.ModuleList(nn.Linear(f, d, bias=False) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b, m in zip(self.blocks, self.mix):
            x = x + m(b(x))
        return x


@pytest.fixture
def small_rows(monkeypatch):
    from ramtorch._stream import rows

    monkeypatch.setattr(rows, "MIN_BYTES", 1 << 12)
    monkeypatch.setattr(rows, "MIN_PART_BYTES", 1 << 10)
    monkeypatch.setattr(rows, "ROW_ALIGN", 8)
    return rows


def test_the_last_linear_of_a_cut_unit_goes_by_rows_and_trains_as_torch(device, small_rows):
    rows = small_rows
    ref, ours = Mlp().to(device), Mlp()
    ramtorch.offload(ours, device=device)
    plans = {u.name: parts.plan_of(u) for u in units(ours)}
    for k in range(3):
        plan = plans[f"blocks.{k}"]
        assert plan is not None and list(plan.rows) == [id(ours.blocks[k][2])]
        last = plan.rows[id(ours.blocks[k][2])].blocks
        assert len(last) >= 2 and set(b[2] for b in last[:-1]) <= set(plan.parts)
        assert plan.parts == sorted(plan.parts)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(5, 32, generator=gen).to(device)
        y_ref, y = ref(x), ours(x)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        y_ref.square().mean().backward()
        y.square().mean().backward()
        for a, b in zip(ref.parameters(), ours.parameters()):
            torch.testing.assert_close(b.grad.to(a.device), a.grad, rtol=1e-5, atol=1e-6)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    s = ramtorch.stats(ours)
    # The units' first forward is watched (whole); each later one is cut, its last Linear by rows
    # (3 x 3), beside the ``mix`` units, single Linears that go by rows on every forward (3 x 4).
    assert s["forwards_by_parts"] == 3 * 3 and s["forwards_by_rows"] == 3 * 3 + 3 * 4
    assert all(type(b[2]) is rows.RowsLinear and isinstance(b[2], nn.Linear) for b in ours.blocks)
    from ramtorch import _offload

    _offload.detach_streamer(ours)
    assert all(type(b[2]) is nn.Linear and "_ramtorch_armed" not in b[2].__dict__ for b in ours.blocks)


def test_the_last_linear_goes_whole_where_its_input_does_not_qualify(device, small_rows):
    """Under autocast (or deterministic algorithms) the layer waits for its whole part, as before."""
    ref, ours = Mlp().to(device), Mlp()
    ramtorch.offload(ours, device=device)
    x = torch.randn(5, 32).to(device)
    with torch.no_grad():
        for _ in range(3):
            with torch.autocast(device_type=device, dtype=torch.bfloat16):
                torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)
    s = ramtorch.stats(ours)
    assert s["forwards_by_parts"] > 0 and s["forwards_by_rows"] == 0  # (the mix units' neither)
