"""ramtorch.optim against torch.optim on the same model: offloaded training, overlap with backward,
micro-batches, clipping, schedulers, state, precision modes, recompute mode."""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable

import pytest
import ramtorch
import ramtorch.optim as ropt
import torch
import torch.nn.functional as F
from conftest import Net, slow_updates
from torch import nn

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def pair(device: str, dtype: torch.dtype = torch.float32, seed: int = 0, **kw):
    torch.manual_seed(seed)
    ref = Net(**kw).to(dtype)
    ours = copy.deepcopy(ref)
    ref.to(device)
    ramtorch.offload(ours, device=device)
    return ref, ours


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().square().mean()


def assert_params_close(ref: nn.Module, ours: nn.Module, rtol: float, atol: float) -> None:
    for (name, p), (_, q) in zip(ref.named_parameters(), ours.named_parameters()):
        torch.testing.assert_close(
            q.detach().cpu().float(), p.detach().cpu().float(), rtol=rtol, atol=atol, msg=name
        )


def train_side_by_side(
    pairs: list[tuple[nn.Module, torch.optim.Optimizer]],
    steps: int,
    after_backward: Callable[[nn.Module], None] | None = None,
) -> None:
    """``steps`` training steps of every (model, optimizer) pair on the same random batches;
    ``after_backward(model)`` runs between each backward and its step."""
    for _ in range(steps):
        x = torch.randn(5, 8)
        for model, opt in pairs:
            loss_of(model, x).backward()
            if after_backward is not None:
                after_backward(model)
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["overlap", "sync", "pipeline"])
def test_ten_adamw_steps_equal_torch(device, mode):
    ref, ours = pair(device)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    kw = {"overlap": mode != "sync", "pipeline": mode == "pipeline"}
    o_ours = ropt.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, **kw)
    for _ in range(10):
        x = torch.randn(5, 8, device=device)
        for model, opt in ((ref, o_ref), (ours, o_ours)):
            loss_of(model, x).backward()
            opt.step()
            opt.zero_grad()
        if mode == "pipeline":
            o_ours.synchronize()  # reading host weights directly: wait for the last updates
        assert_params_close(ref, ours, rtol=1e-5, atol=1e-6)
    streamed = [p for p in ours.parameters() if p.device.type == "cpu"]
    assert streamed and all(not o_ours.state[p]["exp_avg"].is_cuda for p in streamed)


def test_updates_committed_during_backward_with_overlap_backward():
    """overlap="backward" (the explicit option) writes the weights during backward."""
    _, ours = pair("cpu")
    opt = ropt.AdamW(ours.parameters(), lr=1e-2, overlap="backward")
    x = torch.randn(4, 8)
    loss_of(ours, x).backward()  # first backward: nothing learned, every gradient node counted
    opt.step()
    opt.zero_grad()
    before = [p.detach().clone() for p in ours.blocks[0].parameters()]
    loss_of(ours, x).backward()
    # The block's weights changed before step() was called.
    assert any(not torch.equal(b, p) for b, p in zip(before, ours.blocks[0].parameters()))
    opt.step()


@pytest.mark.parametrize("streaming", ["offload", "per-layer Linear"])
def test_micro_batches_equal_one_big_batch(streaming):
    ref, ours = pair("cpu") if streaming == "offload" else linear_pair()
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o_ours = ropt.AdamW(ours.parameters(), lr=1e-2)
    for _ in range(3):
        xs = [torch.randn(4, 8) for _ in range(3)]
        loss_of(ref, torch.cat(xs)).backward()
        o_ref.step()
        o_ref.zero_grad()
        for i, x in enumerate(xs):
            ctx = o_ours.accumulate() if i < len(xs) - 1 else contextlib.nullcontext()
            with ctx:
                (loss_of(ours, x) / len(xs)).backward()
        o_ours.step()
        o_ours.zero_grad()
    assert_params_close(ref, ours, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pipeline", [False, True])
def test_micro_batches_in_the_usual_loop_equal_one_big_batch(pipeline):
    """The usual accumulation loop, with no accumulate(): the optimizer learns from the first
    step (whose updates run in step()) how many backwards a step has, and updates during the
    last one only. Fewer backwards in a step (an epoch's last window) update in step()."""
    ref, ours = pair("cpu")
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o_ours = ropt.AdamW(ours.parameters(), lr=1e-2, pipeline=pipeline)
    for micro in (3, 3, 3, 2, 3):
        xs = [torch.randn(4, 8) for _ in range(micro)]
        loss_of(ref, torch.cat(xs)).backward()
        o_ref.step()
        o_ref.zero_grad()
        for x in xs:
            (loss_of(ours, x) / micro).backward()
        o_ours.step()
        o_ours.zero_grad()
    o_ours.synchronize()
    assert_params_close(ref, ours, rtol=1e-5, atol=1e-6)
    assert o_ours.timings["in_backward_updates"] > 0


@pytest.mark.parametrize("pipeline", [False, True])
def test_more_micro_batches_than_any_step_before_are_refused(pipeline):
    """Updates committed during backward (overlap="backward", pipeline): a step with more
    backwards than the optimizer has seen adds gradients to weights that an update during an
    earlier backward already used: step() says so instead of training on part of the batch."""
    ref, ours = pair("cpu")
    opt = ropt.AdamW(ours.parameters(), lr=1e-2, overlap="backward", pipeline=pipeline)
    x = torch.randn(4, 8)
    for _ in range(2):  # one backward a step (the first step's updates run in step())
        loss_of(ours, x).backward()
        opt.step()
        opt.zero_grad()
    loss_of(ours, x).backward()  # updates run during this backward
    loss_of(ours, x).backward()
    with pytest.raises(RuntimeError, match=r"had 2 backward passes, more than any step before \(1\)"):
        opt.step()
    opt.zero_grad()
    loss_of(ours, x).backward()  # one backward per step again: no error
    opt.step()


def test_max_grad_norm_equals_torch_clipping():
    ref, ours = pair("cpu")
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o_ours = ropt.AdamW(ours.parameters(), lr=1e-2, max_grad_norm=0.05)
    for _ in range(4):
        x = torch.randn(6, 8) * 3
        loss_of(ref, x).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        o_ref.step()
        o_ref.zero_grad()
        loss_of(ours, x).backward()
        o_ours.step()
        o_ours.zero_grad()
    assert_params_close(ref, ours, rtol=1e-5, atol=1e-6)


def test_clipping_after_an_update_committed_in_backward_is_an_error():
    _, ours = pair("cpu")
    opt = ropt.AdamW(ours.parameters(), lr=1e-2, overlap="backward")
    x = torch.randn(4, 8)
    loss_of(ours, x).backward()
    opt.step()
    opt.zero_grad()
    loss_of(ours, x).backward()
    torch.nn.utils.clip_grad_norm_(ours.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match="changed or replaced after backward"):
        opt.step()


@pytest.mark.parametrize("kind", ["sgd", "nesterov", "lion"])
def test_sgd_and_lion_equal_their_references(kind):
    ref, ours = pair("cpu")
    if kind == "lion":
        o_ours = ropt.Lion(ours.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
        o_ref = None  # torch has no Lion: the reference is written out below
        m = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    else:
        nesterov = kind == "nesterov"
        o_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=nesterov)
        o_ours = ropt.SGD(ours.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=nesterov)
    for _ in range(5):
        x = torch.randn(5, 8)
        loss_of(ref, x).backward()
        if o_ref is None:
            with torch.no_grad():
                for n, p in ref.named_parameters():
                    g = p.grad
                    p.mul_(1 - 1e-3 * 0.1)
                    p.add_(torch.sign(m[n] * 0.9 + g * 0.1), alpha=-1e-3)
                    m[n].mul_(0.99).add_(g, alpha=0.01)
                    p.grad = None
        else:
            o_ref.step()
            o_ref.zero_grad()
        loss_of(ours, x).backward()
        o_ours.step()
        o_ours.zero_grad()
    assert_params_close(ref, ours, rtol=1e-5, atol=1e-6)


def test_scheduler_state_dict_and_resume():
    ref, ours = pair("cpu")
    opt = ropt.AdamW(ours.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    xs = [torch.randn(4, 8) for _ in range(6)]
    for x in xs[:3]:
        loss_of(ours, x).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    snap_model = copy.deepcopy(ours.state_dict())
    snap_opt = copy.deepcopy(opt.state_dict())
    snap_sched = sched.state_dict()
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-3)
    after = []
    for x in xs[3:]:
        after.append(loss_of(ours, x).item())
        loss_of(ours, x).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    _, fresh = pair("cpu", seed=1)
    fresh.load_state_dict(snap_model)
    opt2 = ropt.AdamW(fresh.parameters(), lr=1e-2)
    opt2.load_state_dict(snap_opt)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    sched2.load_state_dict(snap_sched)
    again = []
    for x in xs[3:]:
        again.append(loss_of(fresh, x).item())
        loss_of(fresh, x).backward()
        opt2.step()
        opt2.zero_grad()
        sched2.step()
    assert again == after
    st = opt2.state[next(fresh.blocks[0].parameters())]
    assert st["exp_avg"].dtype == torch.float32


def test_fp32_master_for_bf16_weights():
    ref, ours = pair("cpu")
    ours.to(torch.float32)
    torch.manual_seed(0)
    low = copy.deepcopy(Net()).to(torch.bfloat16)
    low.load_state_dict({k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()})
    master_ref = copy.deepcopy(low).float()  # fp32 master starts from the bf16 values
    ramtorch.offload(low, device="cpu")
    o_low = ropt.AdamW(low.parameters(), lr=1e-2)
    o_ref = torch.optim.AdamW(master_ref.parameters(), lr=1e-2)
    for _ in range(5):
        x = torch.randn(4, 8)
        # Same gradients for both: computed by the bf16 model, copied to the fp32 reference.
        loss_of(low, x.bfloat16()).backward()
        for p, q in zip(master_ref.parameters(), low.parameters()):
            p.grad = q.grad.float()
        o_ref.step()
        o_ref.zero_grad()
        o_low.step()
        o_low.zero_grad()
    for p, q in zip(master_ref.parameters(), low.parameters()):
        master = o_low.state[q]["master"]
        torch.testing.assert_close(master, p.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(q.detach(), master.to(torch.bfloat16))


def test_bf16_precision_tracks_fp32_training():
    ref, ours = pair("cpu")
    low = copy.deepcopy(ref).bfloat16()
    ramtorch.offload(low, device="cpu")
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o_low = ropt.AdamW(low.parameters(), lr=1e-2, precision="bf16")
    for _ in range(8):
        x = torch.randn(8, 8)
        loss_of(ref, x).backward()
        o_ref.step()
        o_ref.zero_grad()
        loss_of(low, x.bfloat16()).backward()
        o_low.step()
        o_low.zero_grad()
    p = next(low.blocks[0].parameters())
    assert o_low.state[p]["exp_avg"].dtype == torch.bfloat16 and "master" not in o_low.state[p]
    assert_params_close(ref, low, rtol=5e-2, atol=3e-2)  # bf16 weights: about 3 significant digits


def test_recompute_mode_equals_keep_mode_with_dropout():
    torch.manual_seed(0)
    keep = Net(p_drop=0.3)
    again = copy.deepcopy(keep)
    ramtorch.offload(keep, device="cpu")
    ramtorch.offload(again, device="cpu", recompute=True)
    x = torch.randn(6, 8)
    for model in (keep, again):
        torch.manual_seed(123)
        loss_of(model, x).backward()
    for (name, p), (_, q) in zip(keep.named_parameters(), again.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_bad_arguments():
    _, ours = pair("cpu")
    with pytest.raises(ValueError, match="precision"):
        ropt.AdamW(ours.parameters(), precision="fp8")
    with pytest.raises(ValueError, match="betas"):
        ropt.AdamW(ours.parameters(), betas=(1.5, 0.9))
    with pytest.raises(ValueError, match="nesterov"):
        ropt.SGD(ours.parameters(), nesterov=True)
    with pytest.raises(ValueError, match="max_grad_norm"):
        ropt.AdamW(ours.parameters(), max_grad_norm=-1.0)


def test_grad_scaler_with_overlap_off_matches_torch():
    ref, ours = pair("cpu")
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o_ours = ropt.AdamW(ours.parameters(), lr=1e-2, overlap=False)
    s_ref = torch.amp.GradScaler("cpu", init_scale=1024.0)
    s_ours = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for i in range(4):
        x = torch.randn(4, 8)
        if i == 2:
            x[0, 0] = float("inf")  # this step's gradients overflow: both scalers skip it
        for model, opt, scaler in ((ref, o_ref, s_ref), (ours, o_ours, s_ours)):
            scaler.scale(loss_of(model, x)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert s_ref.get_scale() == s_ours.get_scale()
    assert_params_close(ref, ours, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("linear", [False, True], ids=["offload", "per-layer"])
def test_grad_scaler_from_the_first_step_turns_overlap_off(linear):
    ref, ours = linear_pair() if linear else pair("cpu")
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o_ours = ropt.AdamW(ours.parameters(), lr=1e-2)  # overlap on by default
    s_ref = torch.amp.GradScaler("cpu", init_scale=1024.0)
    s_ours = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for _ in range(3):
        x = torch.randn(4, 8)
        for model, opt, scaler in ((ref, o_ref, s_ref), (ours, o_ours, s_ours)):
            scaler.scale(loss_of(model, x)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert_params_close(ref, ours, rtol=1e-5, atol=1e-6)
    assert not o_ours.overlap and o_ours.timings["in_backward_updates"] == 0


def test_grad_scaler_after_steps_committed_in_backward_is_refused():
    _, ours = pair("cpu")
    opt = ropt.AdamW(ours.parameters(), lr=1e-2, overlap="backward")
    x = torch.randn(4, 8)
    for _ in range(2):  # the second step's updates run during backward
        loss_of(ours, x).backward()
        opt.step()
        opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(loss_of(ours, x)).backward()
    with pytest.raises(RuntimeError, match="Pass overlap=False with a GradScaler"):
        scaler.step(opt)


def test_per_layer_linear_model_with_ramtorch_adamw():
    import ramtorch.nn as rnn

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3))
    ours = nn.Sequential(rnn.Linear.from_linear(ref[0]), nn.GELU(), rnn.Linear.from_linear(ref[2]))
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o_ours = ropt.AdamW(ours.parameters(), lr=1e-2)
    for _ in range(5):
        x = torch.randn(4, 8)
        for model, opt in ((ref, o_ref), (ours, o_ours)):
            loss_of(model, x).backward()
            opt.step()
            opt.zero_grad()
    assert_params_close(ref, ours, rtol=1e-5, atol=1e-6)
    assert ours[0]._is_home() and ours[2]._is_home()  # updated in place, in the host arena


# -- pipelined steps -----------------------------------------------------------------------------


def test_pipelined_step_returns_early_and_the_next_forward_waits():
    from ramtorch import _engine

    ref, ours = pair("cpu")
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    o_ours = ropt.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, pipeline=True)
    slow_updates(o_ours, 0.02)
    host = [p for p in ours.parameters() if p.device.type == "cpu"]
    pending_after_step = 0
    for _ in range(4):
        x = torch.randn(5, 8)
        for model, opt in ((ref, o_ref), (ours, o_ours)):
            loss_of(model, x).backward()
            opt.step()
            if opt is o_ours:
                pending_after_step += _engine.updating(host)
            opt.zero_grad()
        # The next forward (through the streamer) sees exactly the updated weights.
        y = torch.randn(3, 8)
        with torch.no_grad():
            torch.testing.assert_close(ours(y), ref(y), rtol=1e-5, atol=1e-6)
    # Updates were still running when step() returned (every step but the first, which learns
    # the gradient nodes during its backward and updates in step()).
    assert pending_after_step >= 3
    ramtorch.synchronize()
    assert not _engine.updating(host)
    assert_params_close(ref, ours, rtol=1e-5, atol=1e-6)


def test_pipelined_updates_run_in_the_order_the_next_forward_needs():
    _, ours = pair("cpu", layers=4)
    opt = ropt.AdamW(ours.parameters(), lr=1e-2, pipeline=True)
    x = torch.randn(4, 8)
    loss_of(ours, x).backward()
    opt.step()
    opt.zero_grad()
    opt.synchronize()
    log: list[int] = []
    gate = threading.Event()
    slow_updates(opt, 0.0, log, gate=gate)
    loss_of(ours, x).backward()  # the first job waits for the gate: every other one queues
    gate.set()
    opt.step()
    opt.synchronize()
    unit_of = {id(p): i for i, m in enumerate([ours.inp, *ours.blocks, ours.out]) for p in m.parameters()}
    units = [unit_of[i] for i in log]
    order = [u for k, u in enumerate(units) if k == 0 or units[k - 1] != u]
    # The first job is the unit whose gradients landed first (the output layer, unless the worker
    # was slow to wake); the rest were queued behind it and run newest first: the forward order.
    assert sorted(order) == [0, 1, 2, 3, 4, 5]
    assert order[1:] == sorted(order[1:])


def test_readers_wait_for_pipelined_updates():
    from ramtorch import _engine

    _, ours = pair("cpu")
    opt = ropt.AdamW(ours.parameters(), lr=1e-2, pipeline=True)
    host = [p for p in ours.parameters() if p.device.type == "cpu"]
    x = torch.randn(4, 8)
    slow_updates(opt, 0.02)
    for reader in (lambda: ours.state_dict(), lambda: opt.state_dict(), lambda: opt.zero_grad(False)):
        loss_of(ours, x).backward()
        opt.step()
        reader()
        assert not _engine.updating(host)
        opt.zero_grad()


def test_a_failed_pipelined_update_is_raised_by_its_readers(tmp_path):
    _, ours = pair("cpu")
    opt = ropt.AdamW(ours.parameters(), lr=1e-2, pipeline=True)
    x = torch.randn(4, 8)
    loss_of(ours, x).backward()
    opt.step()
    opt.zero_grad()
    opt.synchronize()
    ramtorch.save_checkpoint(tmp_path / "ckpt.safetensors", ours, opt)
    with torch.no_grad():
        expected = ours(x)
    slow_updates(opt, 0.0, fail=ours.blocks[1].up.weight)
    loss_of(ours, x).backward()
    with pytest.raises(RuntimeError, match="injected failure"):
        opt.step()
        ours(x)  # the forward reaches the unit whose update failed
    with pytest.raises(RuntimeError, match="optimizer update of parameters of shapes"):
        ours(x)  # its weights stay refused
    # Loading the weights again clears the failure.
    ramtorch.load_checkpoint(tmp_path / "ckpt.safetensors", ours, opt)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), expected)


def test_pipelined_updates_use_the_learning_rate_of_their_step():
    """A scheduler stepping right after opt.step() must not change the learning rate of the
    updates of that step still queued (pipelined)."""
    ref, ours = pair("cpu")
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o_ours = ropt.AdamW(ours.parameters(), lr=1e-2, pipeline=True)
    s_ref = torch.optim.lr_scheduler.LambdaLR(o_ref, lambda k: 0.5**k)
    s_ours = torch.optim.lr_scheduler.LambdaLR(o_ours, lambda k: 0.5**k)
    slow_updates(o_ours, 0.01)
    for _ in range(4):
        x = torch.randn(5, 8)
        for model, opt, sched in ((ref, o_ref, s_ref), (ours, o_ours, s_ours)):
            loss_of(model, x).backward()
            opt.step()
            sched.step()
            opt.zero_grad()
    ramtorch.synchronize()
    assert_params_close(ref, ours, rtol=1e-5, atol=1e-6)


def test_an_optimizer_dropped_with_pipelined_updates_pending_is_freed():
    import gc
    import weakref

    _, ours = pair("cpu")
    opt = ropt.AdamW(ours.parameters(), lr=1e-2, pipeline=True)
    x = torch.randn(4, 8)
    for _ in range(2):
        loss_of(ours, x).backward()
        opt.step()
        opt.zero_grad()
    slow_updates(opt, 0.01)
    loss_of(ours, x).backward()
    opt.step()
    worker = opt._jobs._thread
    ref = weakref.ref(opt)
    del opt
    ours(x)  # the forward waits for the pending updates, which held the optimizer
    for _ in range(100):
        gc.collect()
        if ref() is None and not worker.is_alive():
            break
        worker.join(timeout=0.05)
    assert ref() is None  # its states (host RAM) are freed
    assert not worker.is_alive()  # and its thread is gone


# -- per-layer Linear: updates during backward ---------------------------------------------------


class TwoLayer(nn.Module):
    """Per-layer Linear layers; ``share`` runs the first layer twice (two gradient contributions),
    ``ckpt`` wraps the layers in non-reentrant activation checkpointing."""

    def __init__(self, share: bool = False, ckpt: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)
        self.share, self.ckpt = share, ckpt

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.a(x))
        if self.share:
            h = F.gelu(self.a(h))
        return self.b(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ckpt:
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self.body, x, use_reentrant=False)
        return self.body(x)


def linear_pair(**kw) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = TwoLayer(**kw)
    ours = copy.deepcopy(ref)
    ramtorch.replace_linear(ours)
    return ref, ours


def test_per_layer_linear_weights_are_updated_during_backward_with_overlap_backward():
    _, ours = linear_pair()
    opt = ropt.AdamW(ours.parameters(), lr=1e-2, overlap="backward")
    x = torch.randn(4, 8)
    loss_of(ours, x).backward()  # the first step updates in step()
    opt.step()
    opt.zero_grad()
    before = ours.a.weight.detach().clone()
    loss_of(ours, x).backward()
    assert not torch.equal(before, ours.a.weight)  # changed before step() was called
    assert opt.timings["in_backward_updates"] == 4
    opt.step()


@pytest.mark.parametrize("kw", [{}, {"share": True}, {"ckpt": True}], ids=["plain", "shared", "checkpointed"])
@pytest.mark.parametrize("pipeline", [False, True])
def test_per_layer_linear_overlapped_training_equals_torch(kw, pipeline):
    ref, ours = linear_pair(**kw)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    o_ours = ropt.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, pipeline=pipeline)
    if pipeline:
        slow_updates(o_ours, 0.005)
    train_side_by_side([(ref, o_ref), (ours, o_ours)], 6)
    ramtorch.synchronize()
    assert_params_close(ref, ours, rtol=1e-5, atol=1e-6)
    if kw.get("share"):
        # The shared layer got two gradients a backward: it is updated in step(), the other
        # during backward.
        assert o_ours.timings["in_step_updates"] > 0
    assert o_ours.timings["in_backward_updates"] > 0


def test_pipelined_jobs_run_the_newest_ready_job_first() -> None:
    """The worker takes the newest job whose gradients have landed; a newer job still waiting for
    its copy does not hold it up; with none ready it takes the oldest (copies land in order)."""
    import threading

    from ramtorch.optim import _Jobs

    jobs = _Jobs()
    gate, started = threading.Event(), threading.Event()
    ran: list[str] = []

    def hold() -> None:  # holds the worker while the queue fills
        started.set()
        gate.wait()

    jobs.submit(hold)
    assert started.wait(timeout=300)  # the worker has taken it: the others queue behind it
    for name, ready in [("a", True), ("b", False), ("c", True), ("d", False)]:
        jobs.submit(lambda name=name: ran.append(name), lambda ready=ready: ready)
    gate.set()
    jobs.wait()
    assert ran == ["c", "a", "b", "d"]

    gate.clear()
    started.clear()
    ran.clear()
    jobs.submit(hold)
    assert started.wait(timeout=300)

    def broken() -> bool:
        raise RuntimeError("query failed")

    jobs.submit(lambda: ran.append("x"), lambda: False)
    jobs.submit(lambda: ran.append("y"), broken)  # the job runs and meets the error itself
    gate.set()
    jobs.wait()
    assert ran == ["y", "x"]
    jobs.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_weights_gradient_leaves_as_soon_as_its_node_has_run(device, monkeypatch):
    """The second linear layer of a block sends its weight's gradient to the host before the
    first layer's backward runs, not at the end of the block's backward. (The weights here are
    all small, whose gradients wait to cross together: the limit of small is lowered to none.)"""
    from ramtorch import _engine

    monkeypatch.setattr(_engine, "_SMALL_GRAD_BYTES", 0)
    _, ours = pair(device, layers=2)
    assert "blocks.0" in [u.name for u in ours._ramtorch_streamer.units]  # one unit: norm, up, down
    block = ours.blocks[0]
    events: list[str] = []
    names = {id(p): n for n, p in ours.named_parameters()}
    eng = ours._ramtorch_streamer.eng
    push = eng.push_grad

    def logged_push(param, grad, *args, **kw):
        events.append(names[id(param)])
        return push(param, grad, *args, **kw)

    monkeypatch.setattr(eng, "push_grad", logged_push)

    def up_hook(module, args, out):  # the gradient of up's output comes once GELU's backward ran
        if out.requires_grad:
            out.register_hook(lambda g: events.append("gradient of up's output"))

    block.up.register_forward_hook(up_hook)
    x = torch.randn(4, 8, device=device)
    loss_of(ours, x).backward()
    mark = events.index("gradient of up's output")
    assert {"blocks.0.down.weight", "blocks.0.down.bias"} <= set(events[:mark])
    assert {"blocks.0.up.weight", "blocks.0.up.bias", "blocks.0.norm.weight"} <= set(events[mark:])
    assert sorted(e for e in events if e != "gradient of up's output") == sorted(names.values())


@pytest.mark.parametrize("mode", ["overlap", "pipeline"])
def test_jobs_of_single_weights_as_they_land_equal_torch(mode, monkeypatch):
    """With every weight handed to the optimizer alone as its gradient lands (no batching of small
    ones), ten steps still equal torch's AdamW, and the jobs were of one weight each."""
    from ramtorch._stream import functions as _stream_functions

    monkeypatch.setattr(_stream_functions, "_READY_BATCH", 1)
    ref, ours = pair("cpu", p_drop=0.0)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    # Committed as they land (overlap="backward"): every update runs in a job.
    o_ours = ropt.AdamW(
        ours.parameters(), lr=1e-2, weight_decay=0.1, overlap="backward", pipeline=mode == "pipeline"
    )
    sizes: list[int] = []
    on_grads = o_ours.on_grads

    def logged(eng, params):
        sizes.append(len(params))
        return on_grads(eng, params)

    monkeypatch.setattr(o_ours, "on_grads", logged)
    train_side_by_side([(ref, o_ref), (ours, o_ours)], 10)
    o_ours.synchronize()
    assert_params_close(ref, ours, rtol=1e-5, atol=1e-6)
    assert sizes and set(sizes) == {1}
    assert o_ours.timings["in_backward_updates"] >= 9 * len(list(ours.parameters()))


def test_each_unit_hands_its_trainable_weights_over_once_every_forward_delivered():
    """With the default batching, a unit's weights go to the optimizers in one hand-off, once
    every forward of the step has delivered each trainable one's gradient (two forwards before
    one backward here; a frozen weight is not waited for)."""
    ref, ours = pair("cpu", p_drop=0.0)
    blocks = ours._ramtorch_streamer.units
    frozen = blocks[0].params[-1]
    frozen.requires_grad_(False)
    calls: list[list[int]] = []
    eng = ours._ramtorch_streamer.eng

    class Listener:
        def on_grads(self, _eng, params):
            calls.append(sorted(id(p) for p in params))

        def reduce_grad(self, _param, _grad):
            return True

        def before_finish(self, _eng):
            pass

        def after_finish(self):
            pass

        def drain(self, interrupted=False):
            pass

    listener = Listener()
    eng.add_listener(listener)  # (held weakly: gone with the test)
    for _ in range(2):
        calls.clear()
        x = torch.randn(5, 8)
        (loss_of(ours, x) + loss_of(ours, 2 * x)).backward()
        ramtorch.synchronize()
        want = [sorted(id(p) for p in u.params if p.requires_grad) for u in blocks]
        assert sorted(calls) == sorted(want)
        for p in ours.parameters():
            p.grad = None


class OddBlock(nn.Module):
    """Weights reached in every way the early-gradient hooks must get right: a layer used twice
    (two consuming nodes: its gradient waits for the end of the unit's backward), a weight used
    through a slice, a layer used only on some steps (no gradient then), a frozen weight."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.twice = nn.Linear(d, d)
        self.sliced = nn.Parameter(torch.randn(d, 2 * d) * d**-0.5)
        self.sometimes = nn.Linear(d, d)
        self.frozen = nn.Parameter(torch.randn(d), requires_grad=False)
        self.use_sometimes = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.twice(F.gelu(self.twice(x)))
        h = h @ self.sliced[:, : x.shape[-1]] + self.frozen
        if self.use_sometimes:
            h = h + self.sometimes(x)
        return x + h


class OddNet(nn.Module):
    def __init__(self, d: int = 8, layers: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(OddBlock(d) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("mode", ["torch", "overlap", "pipeline"])
def test_weights_reached_in_odd_ways_train_as_torch(mode, monkeypatch):
    """Also: a weight its unit's forward did not use gets no gradient, as in torch (it used to get
    zeros, and AdamW then decayed it)."""
    from ramtorch._stream import functions as _stream_functions

    monkeypatch.setattr(_stream_functions, "_READY_BATCH", 1)  # every weight a job of its own
    torch.manual_seed(0)
    ref = OddNet()
    ours = copy.deepcopy(ref)
    ramtorch.offload(ours, device="cpu")
    assert [u.name for u in ours._ramtorch_streamer.units] == ["blocks.0", "blocks.1", "blocks.2"]
    o_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    trained = [p for p in ours.parameters() if p.requires_grad]
    if mode == "torch":
        o_ours = torch.optim.AdamW(trained, lr=1e-2)
    else:
        o_ours = ropt.AdamW(trained, lr=1e-2, pipeline=mode == "pipeline")
    unused_seen = []

    def check(model: nn.Module) -> None:
        if not model.blocks[0].use_sometimes:  # not used on this step: no gradient
            grads = [p.grad for b in model.blocks for p in b.sometimes.parameters()]
            assert grads == [None] * len(grads)
            unused_seen.append(model)

    for step in range(8):
        for model in (ref, ours):
            for b in model.blocks:
                b.use_sometimes = step % 3 == 1
        train_side_by_side([(ref, o_ref), (ours, o_ours)], 1, check)
    assert unused_seen.count(ours) == 5
    ramtorch.synchronize()
    assert_params_close(ref, ours, rtol=1e-5, atol=1e-6)
    if mode != "torch":
        assert o_ours.timings["in_backward_updates"] > 0


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (lambda ps: ropt.AdamW(ps, lr=1e-2), lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
        (
            lambda ps: ropt.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
        ),
    ],
    ids=["adamw", "sgd"],
)
def test_parameters_the_kernels_do_not_take_are_updated_as_by_torch(ours, theirs):
    """Parameters outside host RAM or of a dtype the kernels do not take (fp64 here) go through
    torch's own update functions, with the same results as torch.optim."""
    torch.manual_seed(0)
    ref = Net().to(torch.float64)
    mine = copy.deepcopy(ref)
    o_ref, o_mine = theirs(ref.parameters()), ours(mine.parameters())
    for _ in range(3):
        x = torch.randn(4, 8, dtype=torch.float64)
        for model, opt in ((ref, o_ref), (mine, o_mine)):
            opt.zero_grad()
            loss_of(model, x).backward()
            opt.step()
    for p, q in zip(ref.parameters(), mine.parameters()):
        torch.testing.assert_close(p, q)
