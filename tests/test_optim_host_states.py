"""``states="host"``: parameters that are not streamed (a model on the GPU, units kept resident)
keep their optimizer states in host RAM and are updated by the Rust kernels of host parameters,
with their gradients copied to the host as backward produces them and their updates speculated
during backward, under torch's step semantics.

Without CUDA such a parameter is a plain CPU tensor that the streaming engine does not hold: it
takes the same path (hooks, speculation, commit or update in ``step()``) without copies, which
these tests check against ``torch.optim.AdamW`` and against the host-parameter path. With the
``copies`` fixture the CPU parameters are treated as living elsewhere: their updates go through
host copies of their weights and gradients and the new weights are copied back, as on a GPU but
without streams. The CUDA copies and their events are checked by the tests marked ``gpu``."""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import ramtorch
import ramtorch.optim as ropt
import torch
from conftest import Net, changes, snapshot
from ramtorch.optim import _resident
from torch import nn

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
#: How the updates are scheduled: the default (speculation measured against updates in step()),
#: speculation kept on, every update in step().
SCHEDULES = ["default", "speculate", "in-step"]
STEPS = 5


@pytest.fixture(params=["in place", "host copies"])
def copies(request, monkeypatch) -> str:
    """Parametrizes a test over CPU parameters updated where they are, and treated as living
    elsewhere (through host copies of weight and gradient, the weight copied back)."""
    if request.param == "host copies":
        monkeypatch.setattr(_resident, "_elsewhere", lambda p: True)
    return request.param


def _model(device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Net().to(dtype).to(device)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    p = next(model.parameters())
    return model(x.to(device=p.device, dtype=p.dtype)).float().square().mean()


def _ours(model: nn.Module, schedule: str = "speculate", **kw: Any) -> ropt.AdamW:
    kw.setdefault("lr", 1e-2)
    kw.setdefault("weight_decay", 0.1)
    opt = ropt.AdamW(model.parameters(), states="host", overlap=schedule != "in-step", **kw)
    if schedule == "speculate":
        opt.overlap = True  # kept speculating (the default measures and may choose step())
    return opt


def _assert_close(ref: nn.Module, ours: nn.Module, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        torch.testing.assert_close(
            q.detach().cpu().float(), p.detach().cpu().float(), rtol=rtol, atol=atol, msg=name
        )


def _assert_bitwise(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.detach().cpu(), q.detach().cpu()), name


def _assert_same_states(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys(), i
        for k, v in sa[i].items():
            assert torch.equal(v.cpu(), sb[i][k].cpu()), (i, k)


def _settle(opt: torch.optim.Optimizer) -> None:
    """Lets the speculative updates of the last backward finish before ``step()`` (which drops those
    not begun, and updates their parameters itself): what a long backward gives them, here."""
    jobs = getattr(opt, "_jobs", None)
    if jobs is not None:
        jobs.wait()


def _train(
    pairs: list[tuple[nn.Module, torch.optim.Optimizer]],
    steps: int,
    seed: int = 1,
    settle: bool = False,
    **kw: Any,
) -> None:
    """``steps`` steps of each (model, optimizer) on the same batches; ``settle``: the speculative
    updates finish before each ``step()`` (else they race it, as in training)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 8, generator=g)
        for model, opt in pairs:
            _loss(model, x).backward()
            if settle:
                _settle(opt)
            opt.step()
            opt.zero_grad(**kw)


@pytest.mark.parametrize("settle", [False, True], ids=["racing", "settled"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_adamw_with_host_states_equals_torch(schedule, settle, copies):
    ref = _model()
    ours = copy.deepcopy(ref)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    o_ours = _ours(ours, schedule)
    _train([(ref, o_ref), (ours, o_ours)], STEPS, settle=settle)
    _assert_close(ref, ours)
    n = len(list(ours.parameters()))
    speculated, committed = o_ours.timings["speculated_updates"], o_ours.timings["committed_updates"]
    if schedule == "speculate":  # what has begun by step() is committed
        assert committed == speculated <= n * (STEPS - 1)
        if settle:  # every step after the first
            assert committed == n * (STEPS - 1)
    for p in ours.parameters():
        assert (o_ours._slots[id(p)].host_copy is not None) == (copies == "host copies")
    if schedule == "in-step":
        assert o_ours.timings["in_backward_updates"] == 0
    for p in ours.parameters():
        assert set(o_ours.state[p]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("precision", ["fp32-master", "bf16", "compact"])
@pytest.mark.parametrize("schedule", ["speculate", "in-step"])
def test_bf16_weights_update_as_host_parameters_do(precision, schedule, copies):
    """The same bits, weights and states, as the host-parameter path (the same kernels)."""
    host = _model(dtype=torch.bfloat16)
    ours = copy.deepcopy(host)
    o_host = ropt.AdamW(host.parameters(), lr=1e-2, weight_decay=0.1, precision=precision, overlap=False)
    o_ours = _ours(ours, schedule, precision=precision)
    _train([(host, o_host), (ours, o_ours)], STEPS, settle=True)
    _assert_bitwise(host, ours)
    _assert_same_states(o_host, o_ours)
    assert (o_ours.timings["committed_updates"] > 0) == (schedule == "speculate")
    if precision == "fp32-master":
        for p in ours.parameters():
            master = o_ours.state[p]["master"]
            assert master.dtype == torch.float32 and torch.equal(master.to(torch.bfloat16), p.detach())


@pytest.mark.parametrize(
    "mode", [{"overlap": "backward"}, {"pipeline": True}], ids=["overlap-backward", "pipeline"]
)
@pytest.mark.parametrize("precision", ["fp32-master", "bf16", "compact"])
def test_updates_committed_during_backward_equal_updates_in_step(mode, precision, copies):
    """``overlap="backward"`` and ``pipeline=True``: each parameter is updated in place as its
    gradient lands (no spare buffers), its new weight copied back; the same bits, weights and
    states, as every update in ``step()``, and ``step()`` makes none of them again."""
    a = _model(dtype=torch.bfloat16)
    b = copy.deepcopy(a)
    kw = dict(lr=1e-2, weight_decay=0.1, precision=precision, states="host")
    o_a = ropt.AdamW(a.parameters(), overlap=False, **kw)
    o_b = ropt.AdamW(b.parameters(), **mode, **kw)
    _train([(a, o_a), (b, o_b)], STEPS)
    _assert_bitwise(a, b)
    _assert_same_states(o_a, o_b)
    n = len(list(b.parameters()))
    assert o_b.timings["in_backward_updates"] == n * (STEPS - 1)  # all but the first step's
    assert o_b.timings["in_step_updates"] == n
    assert o_b.speculation_bytes == 0


def test_updates_committed_during_backward_refuse_what_they_cannot_honour():
    """A learning rate changed, or a gradient clipped, between backward and ``step()`` after the
    updates used them: ``step()`` raises, naming what changed."""
    m = _model()
    opt = ropt.AdamW(m.parameters(), lr=1e-2, states="host", overlap="backward")
    x = torch.randn(5, 8)
    _loss(m, x).backward()
    opt.step()  # the first step learns the schedule: its updates run in step()
    opt.zero_grad()
    _loss(m, x).backward()
    opt.param_groups[0]["lr"] = 5e-3
    with pytest.raises(RuntimeError, match=r"hyperparameters \(lr\)"):
        opt.step()
    opt.zero_grad()
    _loss(m, x).backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-4)
    with pytest.raises(RuntimeError, match="gradient was changed"):
        opt.step()


def test_nothing_changes_before_step():
    model = _model()
    opt = _ours(model)
    _train([(model, opt)], 2)
    _loss(model, torch.randn(5, 8)).backward()
    opt._jobs.wait()  # the speculative updates are computed
    assert opt.timings["speculated_updates"] > 0
    before = snapshot(model, opt)
    grads = [p.grad.clone() for p in model.parameters()]
    assert changes(before, model, opt) == ""
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    opt.step()
    assert changes(before, model, opt) == "the model changed"


def test_state_dict_round_trip_resumes_bitwise(copies):
    a = _model(dtype=torch.bfloat16)
    o_a = _ours(a)
    _train([(a, o_a)], 3)
    b = copy.deepcopy(a)
    o_b = _ours(b)
    sd = o_a.state_dict()
    for st in sd["state"].values():
        assert st["master"].dtype == torch.float32 and st["exp_avg"].dtype == torch.float32
    o_b.load_state_dict(sd)
    _assert_same_states(o_a, o_b)
    _train([(a, o_a), (b, o_b)], 3, seed=2, settle=True)
    _assert_bitwise(a, b)
    _assert_same_states(o_a, o_b)


def test_a_torch_state_dict_loads_and_training_goes_on_as_torch():
    ref = _model()
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    _train([(ref, o_ref)], 2)
    ours = copy.deepcopy(ref)
    o_ours = _ours(ours)
    o_ours.load_state_dict(o_ref.state_dict())
    _train([(ref, o_ref), (ours, o_ours)], 3, seed=2)
    _assert_close(ref, ours)
    torch_sd, our_sd = o_ref.state_dict(), o_ours.state_dict()
    for i, st in torch_sd["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(our_sd["state"][i][k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_either_way_equals_torch(set_to_none):
    ref = _model()
    ours = copy.deepcopy(ref)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    o_ours = _ours(ours)
    _train([(ref, o_ref), (ours, o_ours)], STEPS, settle=True, set_to_none=set_to_none)
    _assert_close(ref, ours)
    assert all((p.grad is None) == set_to_none for p in ours.parameters())
    assert o_ours.timings["committed_updates"] > 0


@pytest.mark.parametrize("schedule", ["speculate", "in-step"])
def test_two_micro_batches_a_step_equal_torch(schedule, copies):
    ref = _model()
    ours = copy.deepcopy(ref)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    o_ours = _ours(ours, schedule)
    g = torch.Generator().manual_seed(4)
    n = len(list(ours.parameters()))
    for step in range(STEPS):
        xs = [torch.randn(3, 8, generator=g) for _ in range(2)]
        for model, opt in ((ref, o_ref), (ours, o_ours)):
            for k, x in enumerate(xs):
                (_loss(model, x) / 2).backward()
                if opt is o_ours and schedule == "speculate" and step > 0:
                    # Only the last backward of a step speculates (the first step learns there
                    # are two backwards a step).
                    assert len(o_ours._rspec) == (n if k == 1 else 0)
            _settle(opt)
            opt.step()
            opt.zero_grad()
    _assert_close(ref, ours)
    assert o_ours._micro == 2
    assert o_ours.timings["committed_updates"] == o_ours.timings["speculated_updates"]
    assert (o_ours.timings["committed_updates"] > 0) == (schedule == "speculate")


def test_weights_written_between_steps_are_what_the_next_update_reads(copies):
    """A load or an edit of the weights between steps (an fp32 weight is its own master): the host
    copy is made again from the parameter."""
    ref = _model()
    ours = copy.deepcopy(ref)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    o_ours = _ours(ours)
    _train([(ref, o_ref), (ours, o_ours)], 2, settle=True)
    with torch.no_grad():
        for model in (ref, ours):
            model.out.weight.mul_(0.5)
            model.inp.bias.copy_(torch.arange(16.0))
    _train([(ref, o_ref), (ours, o_ours)], 3, seed=2, settle=True)
    _assert_close(ref, ours)


def test_param_groups_with_their_own_learning_rates_equal_torch():
    ref = _model()
    ours = copy.deepcopy(ref)

    def groups(m: nn.Module) -> list[dict[str, Any]]:
        return [
            {"params": list(m.inp.parameters()) + list(m.blocks.parameters()), "lr": 1e-2},
            {"params": list(m.out.parameters()), "lr": 3e-3, "weight_decay": 0.0},
        ]

    o_ref = torch.optim.AdamW(groups(ref), lr=1e-2, weight_decay=0.1)
    o_ours = ropt.AdamW(groups(ours), lr=1e-2, weight_decay=0.1, states="host")
    o_ours.overlap = True
    _train([(ref, o_ref), (ours, o_ours)], STEPS, settle=True)
    _assert_close(ref, ours)
    assert o_ours.timings["committed_updates"] > 0


def test_a_learning_rate_set_after_backward_is_used():
    ref = _model()
    ours = copy.deepcopy(ref)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    o_ours = _ours(ours)
    g = torch.Generator().manual_seed(5)
    for step in range(STEPS):
        x = torch.randn(5, 8, generator=g)
        for model, opt in ((ref, o_ref), (ours, o_ours)):
            _loss(model, x).backward()
            _settle(opt)
            opt.param_groups[0]["lr"] = 1e-2 / (step + 1)  # after the speculative updates
            opt.step()
            opt.zero_grad()
    _assert_close(ref, ours)
    assert o_ours.timings["recomputed_updates"] > 0


@pytest.mark.parametrize("clip", ["torch", "optimizer"])
def test_clipping_equals_torch(clip):
    ref = _model()
    ours = copy.deepcopy(ref)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    o_ours = _ours(ours)
    g = torch.Generator().manual_seed(6)
    for _ in range(STEPS):
        x = torch.randn(5, 8, generator=g)
        for model, opt in ((ref, o_ref), (ours, o_ours)):
            _loss(model, x).backward()
            _settle(opt)
            if clip == "optimizer" and opt is o_ours:
                o_ours.clip_grad_norm_(0.05)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
    _assert_close(ref, ours)
    assert o_ours.timings["recomputed_updates"] > 0  # the speculations used unclipped gradients


def test_grad_scaler_equals_torch():
    ref = _model()
    ours = copy.deepcopy(ref)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o_ours = ropt.AdamW(ours.parameters(), lr=1e-2, states="host")
    s_ref = torch.amp.GradScaler("cpu", init_scale=1024.0)
    s_ours = torch.amp.GradScaler("cpu", init_scale=1024.0)
    g = torch.Generator().manual_seed(7)
    for i in range(STEPS):
        x = torch.randn(4, 8, generator=g)
        if i == 2:
            x[0, 0] = float("inf")  # this step's gradients overflow: both scalers skip it
        for model, opt, scaler in ((ref, o_ref, s_ref), (ours, o_ours, s_ours)):
            scaler.scale(_loss(model, x)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert s_ref.get_scale() == s_ours.get_scale()
    _assert_close(ref, ours)


def test_a_step_skipped_after_backward_is_skipped():
    ref = _model()
    ours = copy.deepcopy(ref)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    o_ours = _ours(ours)
    g = torch.Generator().manual_seed(8)
    for step in range(STEPS):
        x = torch.randn(5, 8, generator=g)
        for model, opt in ((ref, o_ref), (ours, o_ours)):
            _loss(model, x).backward()
            if step != 2:  # a non-finite loss, say: no step
                opt.step()
            opt.zero_grad()
    _assert_close(ref, ours)


def test_resident_units_of_an_offloaded_model_take_the_host_state_path():
    """Units that ``offload`` keeps resident (plain CPU parameters here) next to streamed ones."""
    torch.manual_seed(0)
    ref = Net(d=16, layers=4)
    ours = ramtorch.offload(copy.deepcopy(ref), device="cpu", gpu_budget="12KiB")
    resident = [p for u in ours._ramtorch_streamer.units if u.resident for p in u.params]
    assert resident and len(resident) < len(list(ours.parameters()))
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    o_ours = _ours(ours)
    _train([(ref, o_ref), (ours, o_ours)], STEPS, settle=True)
    ramtorch.synchronize()
    _assert_close(ref, ours)
    assert set(o_ours._slots) == {id(p) for p in resident}  # the streamed ones stay the engine's
    assert o_ours._micro == 1 and o_ours.timings["committed_updates"] > 0


def test_bad_arguments_are_refused():
    model = _model()
    with pytest.raises(ValueError, match="states must be 'device'.*or 'host'.*'disk'"):
        ropt.AdamW(model.parameters(), states="disk")
    with pytest.raises(ValueError, match="states"):
        ropt.SGD(model.parameters(), states=None)  # type: ignore[arg-type]
    opt = ropt.Lion(model.parameters(), states="host")
    with pytest.raises(ValueError, match="upload_wait"):
        opt.upload_wait = "never"
    with pytest.raises(ValueError, match="states='host'"):
        opt.shard()


def test_sgd_and_lion_with_host_states_equal_host_parameters():
    for rule, kw in ((ropt.SGD, {"momentum": 0.9, "nesterov": True}), (ropt.Lion, {})):
        host = _model(dtype=torch.bfloat16)
        ours = copy.deepcopy(host)
        o_host = rule(host.parameters(), lr=1e-2, overlap=False, **kw)
        o_ours = rule(ours.parameters(), lr=1e-2, states="host", **kw)
        o_ours.overlap = True
        _train([(host, o_host), (ours, o_ours)], STEPS, settle=True)
        _assert_bitwise(host, ours)
        assert o_ours.timings["committed_updates"] > 0


def test_the_gradient_hooks_go_with_the_optimizer():
    model = _model()
    opt = _ours(model)
    assert all(len(p._post_accumulate_grad_hooks or {}) == 1 for p in model.parameters())
    del opt
    gc.collect()
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    _loss(model, torch.randn(5, 8)).backward()  # no optimizer: nothing happens


# -- on a GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("upload_wait", ["step", "forward"])
def test_gpu_host_states_equal_torch(schedule, upload_wait):
    ref = _model("cuda")
    ours = copy.deepcopy(ref)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    o_ours = _ours(ours, schedule)
    o_ours.upload_wait = upload_wait
    _train([(ref, o_ref), (ours, o_ours)], STEPS, settle=schedule == "speculate")
    o_ours.synchronize()
    _assert_close(ref, ours)
    for p in ours.parameters():
        assert p.is_cuda and all(not v.is_cuda for v in o_ours.state[p].values())
        slot = o_ours._slots[id(p)]
        assert slot.host_copy is not None and slot.host_copy.is_pinned()
    if schedule == "speculate":
        assert o_ours.timings["committed_updates"] > 0


@pytest.mark.gpu
def test_gpu_bf16_host_states_equal_the_host_path_on_the_same_gradients():
    """A bf16 model on the GPU against its copy on the CPU, fed the GPU's gradients: the same
    kernels on the same inputs give the same bits."""
    gpu = _model("cuda", torch.bfloat16)
    cpu = copy.deepcopy(gpu).cpu()
    o_gpu = _ours(gpu)
    o_cpu = ropt.AdamW(cpu.parameters(), lr=1e-2, weight_decay=0.1, overlap=False)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        _loss(gpu, torch.randn(5, 8, generator=g)).backward()
        _settle(o_gpu)
        for p, q in zip(gpu.parameters(), cpu.parameters()):
            q.grad = p.grad.cpu()
        o_gpu.step()
        o_cpu.step()
        o_gpu.zero_grad()
        o_cpu.zero_grad()
    _assert_bitwise(cpu, gpu)
    _assert_same_states(o_cpu, o_gpu)
    assert o_gpu.timings["committed_updates"] > 0


@pytest.mark.gpu
def test_gpu_nothing_changes_before_step():
    model = _model("cuda", torch.bfloat16)
    opt = _ours(model)
    _train([(model, opt)], 2)
    _loss(model, torch.randn(5, 8)).backward()
    opt._jobs.wait()
    before = snapshot(model, opt)
    assert changes(before, model, opt) == ""
    opt.step()
    assert changes(before, model, opt) == "the model changed"


@pytest.mark.gpu
def test_gpu_accumulation_and_the_next_forward_see_the_new_weights():
    ref = _model("cuda")
    ours = copy.deepcopy(ref)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    o_ours = _ours(ours)
    o_ours.upload_wait = "forward"
    g = torch.Generator().manual_seed(4)
    for _ in range(STEPS):
        xs = [torch.randn(3, 8, generator=g) for _ in range(2)]
        for model, opt in ((ref, o_ref), (ours, o_ours)):
            for x in xs:
                (_loss(model, x) / 2).backward()
            _settle(opt)
            opt.step()
            opt.zero_grad()
        y = torch.randn(3, 8, generator=g)
        torch.testing.assert_close(_loss(ours, y), _loss(ref, y), rtol=1e-5, atol=1e-6)
    _assert_close(ref, ours)
    assert o_ours.timings["committed_updates"] > 0
