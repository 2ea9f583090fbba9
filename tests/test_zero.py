"""ZeRO-1 and ZeRO-2 on torch.distributed (gloo, CPU): two and three ranks training an offloaded model with
ramtorch.optim sharded across them equal one process training on the global batch."""

from __future__ import annotations

import copy
import datetime
import os
import sys

import pytest
import ramtorch
import ramtorch.optim as ropt
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import exit_rank, free_port
from torch import nn

STEPS = 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4))
        self.out = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(12, 8, generator=g) for _ in range(STEPS)]


def reference() -> list[torch.Tensor]:
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for x in batches():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def worker(
    rank: int,
    world: int,
    port: int,
    out: str,
    clip: bool,
    stage: int = 1,
    share: bool = False,
    micro: int = 1,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        model = ramtorch.offload(Net(), device="cpu")
        if share:
            from ramtorch.distributed import share_parameters

            share_parameters(model)  # one copy of the weights for all ranks: no broadcasts
        opt = ropt.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=1e9 if clip else None)
        opt.shard(stage=stage)
        kept = []
        for x in batches():
            mine = x.chunk(world)[rank]
            # Each rank's loss is its share of the global mean: the averaged gradients are the
            # gradients of the global batch. With micro > 1, in that many backwards (the usual
            # accumulation loop, no accumulate()).
            for part in mine.chunk(micro):
                (model(part).square().mean() * part.shape[0] * world / x.shape[0]).backward()
            kept.append(sum(p.grad is not None for p in model.parameters()))
            opt.step()
            opt.zero_grad()
        owned = sum(1 for p in model.parameters() if opt.state.get(p))
        params = [p.detach().clone() for p in model.parameters()]
        home = all(u.is_home() for u in model._ramtorch_streamer.streamed)  # never repacked
        streamed = sum(
            p.numel() * p.element_size() for u in model._ramtorch_streamer.streamed for p in u.params
        )
        d2h = ramtorch.stats()["devices"]["cpu"]["d2h_bytes"]
        torch.save(
            {"params": params, "owned": owned, "kept": kept, "home": home, "d2h": d2h, "streamed": streamed},
            f"{out}.{rank}",
        )
        dist.barrier()  # rank 0 hosts the rendezvous store: nobody tears down while it is in use
    finally:
        dist.destroy_process_group()
    exit_rank()


@pytest.mark.parametrize(
    ("world", "stage", "share", "micro"),
    [(2, 1, False, 1), (3, 1, False, 1), (2, 2, False, 1), (3, 2, False, 1), (2, 1, True, 1), (3, 2, True, 1)]
    + [(2, 2, False, 2)],
)
def test_zero_equals_one_process_on_the_global_batch(tmp_path, world, stage, share, micro):
    out = str(tmp_path / "r")
    mp.spawn(worker, args=(world, free_port(), out, False, stage, share, micro), nprocs=world, join=True)
    ref = reference()
    results = [torch.load(f"{out}.{r}") for r in range(world)]
    for res in results:
        for a, b in zip(ref, res["params"]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert all(r["home"] for r in results)
    owned = [r["owned"] for r in results]
    assert sum(owned) == len(ref) and all(n > 0 for n in owned)  # states are partitioned
    if stage == 2:
        # After backward a rank keeps the gradients it owns (the others went to their owners),
        # except those of units that were not streamed (updated in step()).
        for r in results:
            assert all(k < len(ref) for k in r["kept"])
        # Gradients were reduced before they left the compute device: only their owner copied
        # them to the host, so the ranks together copied each gradient once a step.
        assert sum(r["d2h"] for r in results) == micro * len(batches()) * results[0]["streamed"]
    else:
        assert all(r["d2h"] == micro * len(batches()) * r["streamed"] for r in results)


LRS = [1e-2, 3e-3, 1e-2, 5e-3]  # set after each step's backward, before its step()


def reference_late_lr(clip: float | None = None) -> list[torch.Tensor]:
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for x, lr in zip(batches(), LRS):
        model(x).square().mean().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.param_groups[0]["lr"] = lr
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def semantics_worker(rank: int, world: int, port: int, out: str, share: bool, clip: float | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        model = ramtorch.offload(Net(), device="cpu")
        if share:
            from ramtorch.distributed import share_parameters

            share_parameters(model)
        opt = ropt.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=clip).shard(stage=2)
        unchanged = []
        for x, lr in zip(batches(), LRS):
            before = [p.detach().clone() for p in model.parameters()]
            mine = x.chunk(world)[rank]
            (model(mine).square().mean() * mine.shape[0] * world / x.shape[0]).backward()
            opt.synchronize()  # every update computed during backward has finished
            unchanged.append(all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
            opt.param_groups[0]["lr"] = lr  # after backward: the step must use it
            opt.step()
            opt.zero_grad()
        params = [p.detach().clone() for p in model.parameters()]
        torch.save({"params": params, "unchanged": unchanged, "timings": dict(opt.timings)}, f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_rank()


@pytest.mark.parametrize(("share", "clip"), [(False, None), (True, None), (False, 0.05)])
def test_zero2_changes_nothing_before_step(tmp_path, share, clip):
    """ZeRO-2's default keeps torch's semantics: the owners compute their updates during backward
    but commit them in step(), so a rank's own weights do not change before its step() (with one
    shared copy, another rank's step() writes them), and a learning rate set between backward and
    step() is the one used; with ``max_grad_norm`` the global norm clips every rank's update."""
    out = str(tmp_path / "r")
    world = 2
    mp.spawn(semantics_worker, args=(world, free_port(), out, share, clip), nprocs=world, join=True)
    ref = reference_late_lr(clip)
    if clip is not None:  # the threshold clips: the run differs from an unclipped one
        assert any(not torch.allclose(a, b) for a, b in zip(ref, reference_late_lr()))
    results = [torch.load(f"{out}.{r}") for r in range(world)]
    for res in results:
        if not share:  # (one copy for all ranks: another rank's step() writes it)
            assert all(res["unchanged"]), res["unchanged"]
        for a, b in zip(ref, res["params"]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    # The updates were speculated during backward and committed or recomputed by step().
    assert sum(r["timings"]["speculated_updates"] for r in results) > 0


def test_zero1_with_global_norm_clipping_runs_everywhere(tmp_path):
    out = str(tmp_path / "c")
    mp.spawn(worker, args=(2, free_port(), out, True), nprocs=2, join=True)
    ref = reference()  # a clip threshold this large changes nothing
    for r in range(2):
        for a, b in zip(ref, torch.load(f"{out}.{r}")["params"]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_shard_needs_an_initialised_process_group():
    model = copy.deepcopy(Net())
    with pytest.raises(RuntimeError, match="not initialised"):
        ropt.AdamW(model.parameters()).shard()


def dying_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20))
    model = ramtorch.offload(Net(), device="cpu")
    opt = ropt.AdamW(model.parameters(), lr=1e-2).shard()
    model(torch.randn(4, 8)).square().mean().backward()
    if rank == 1:
        os._exit(3)  # dies mid-step, before its share of the reduction
    try:
        opt.step()
        msg = "no error"
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        msg = f"{type(e).__name__}: {e}"
    with open(f"{out}.{rank}", "w") as fh:
        fh.write(msg)
    os._exit(0)


def test_a_rank_dying_mid_step_is_an_error_not_a_hang(tmp_path):
    out = str(tmp_path / "d")
    ctx = mp.start_processes(
        dying_worker, args=(2, free_port(), out), nprocs=2, join=False, start_method="spawn"
    )
    for p in ctx.processes:
        p.join(timeout=90)
        assert not p.is_alive(), "a rank hung"
    msg = open(f"{out}.0").read()
    assert msg != "no error" and ("Connection" in msg or "closed" in msg or "timed out" in msg.lower()), msg


def mismatch_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from ramtorch.distributed import init

    init(backend="gloo", timeout_seconds=30)
    try:
        model = ramtorch.offload(Net(), device="cpu")
        lr = 1e-2 if rank == 0 else 2e-2  # rank 1 was launched with another learning rate
        try:
            ropt.AdamW(model.parameters(), lr=lr).shard()
            msg = "no error"
        except ValueError as e:
            msg = str(e)
        with open(f"{out}.{rank}", "w") as fh:
            fh.write(msg)
        # Rank 0 hosts the rendezvous store: no rank tears down while another still uses it.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_rank()


def test_mismatched_settings_are_detected_at_setup(tmp_path):
    out = str(tmp_path / "m")
    mp.spawn(mismatch_worker, args=(2, free_port(), out), nprocs=2, join=True)
    for r in range(2):
        msg = open(f"{out}.{r}").read()
        assert "rank 1 has different parameters or settings" in msg and "lr" in msg, msg


def gloo_threads() -> list[str]:
    """Names of this process's threads that belong to a gloo process group."""
    names = (open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    return sorted(n for n in names if "gloo" in n)


def teardown_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from ramtorch.distributed import init

    init(timeout_seconds=120)  # the default backend: gloo without CUDA
    model = ramtorch.offload(Net(), device="cpu")
    opt = ropt.AdamW(model.parameters(), lr=1e-2).shard()
    for x in batches()[:2]:
        model(x.chunk(world)[rank]).square().mean().backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    running = gloo_threads()
    dist.destroy_process_group()
    torch.save({"running": running, "left": gloo_threads()}, f"{out}.{rank}")
    # The rank ends through the interpreter's normal exit: an abort there fails the spawn.


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread names from /proc")
def test_a_group_from_init_is_gone_after_destroy_and_ranks_exit_cleanly(tmp_path):
    # TorchDynamo (imported by the first optimizer) kept the group alive past
    # destroy_process_group, with its worker threads, which could abort the exit.
    out = str(tmp_path / "t")
    mp.spawn(teardown_worker, args=(2, free_port(), out), nprocs=2, join=True)
    for r in range(2):
        res = torch.load(f"{out}.{r}")
        assert res["running"], "the check sees no gloo thread while the group is up"
        assert res["left"] == [], res["left"]


def test_init_needs_the_launcher_environment(monkeypatch):
    from ramtorch.distributed import init

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        init()


def resume_worker(rank: int, world: int, port: int, out: str, stage: int) -> None:
    """Two sharded steps, a checkpoint saved on rank 0 from the consolidated state, then fresh
    model and optimizer on every rank loaded from it, and the last two steps."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        data = batches()

        def train(model: nn.Module, opt: ropt.AdamW, xs: list[torch.Tensor]) -> None:
            for x in xs:
                mine = x.chunk(world)[rank]
                (model(mine).square().mean() * mine.shape[0] * world / x.shape[0]).backward()
                opt.step()
                opt.zero_grad()

        model = ramtorch.offload(Net(), device="cpu")
        opt = ropt.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1).shard(stage=stage)
        train(model, opt, data[:2])
        result: dict = {}
        try:
            opt.state_dict()
        except RuntimeError as e:
            result["unconsolidated"] = str(e)
        opt.consolidate_state_dict(to=0)
        path = f"{out}.ckpt"
        if rank == 0:
            result["states"] = len(opt.state_dict()["state"])
            ramtorch.save_checkpoint(path, model, opt)
        else:
            try:
                opt.state_dict()
            except RuntimeError as e:
                result["not_on_this_rank"] = str(e)
        dist.barrier()

        model = ramtorch.offload(Net(), device="cpu")
        opt = ropt.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1).shard(stage=stage)
        ramtorch.load_checkpoint(path, model, opt)
        result["owned_after_load"] = sum(1 for p in model.parameters() if opt.state.get(p))
        train(model, opt, data[2:])
        result["params"] = [p.detach().clone() for p in model.parameters()]
        torch.save(result, f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_rank()


@pytest.mark.parametrize(("world", "stage"), [(2, 1), (3, 2)])
def test_sharded_training_resumes_from_a_consolidated_checkpoint(tmp_path, world, stage):
    """The state dict of a sharded optimizer is the whole optimizer's once consolidated (and an
    error before, rather than one rank's share passed off as the optimizer); a checkpoint of it,
    loaded on every rank, continues training as if it had not stopped."""
    out = str(tmp_path / "r")
    mp.spawn(resume_worker, args=(world, free_port(), out, stage), nprocs=world, join=True)
    ref = reference()
    results = [torch.load(f"{out}.{r}") for r in range(world)]
    for res in results:
        assert "consolidate_state_dict" in res["unconsolidated"]
        for a, b in zip(ref, res["params"]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert results[0]["states"] == len(ref)  # every parameter's state, not rank 0's share
    assert all("consolidate_state_dict" in r["not_on_this_rank"] for r in results[1:])
    owned = [r["owned_after_load"] for r in results]
    assert sum(owned) == len(ref) and all(n > 0 for n in owned)  # each rank kept its share
