"""Several nodes, simulated on one machine: two nodes of two CPU ranks each (gloo), the launcher's
``GROUP_RANK`` / ``LOCAL_WORLD_SIZE`` saying which ranks form a node. Each node keeps one shared host
copy of the weights, ZeRO shards states and gradients over all four ranks, and training equals one
process on the global batch; a consolidated checkpoint resumes on one node; a dead node is an error
on the others, not a hang."""

from __future__ import annotations

import datetime
import os
import re
import time

import pytest
import ramtorch
import ramtorch.optim as ropt
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import exit_rank, free_port
from test_zero import Net, batches, reference
from torch import nn

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE


def _init(rank: int, world: int, port: int, per_node: int, env: str = "group_rank") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ["LOCAL_RANK"] = str(rank % per_node)
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    if env == "group_rank":
        os.environ["GROUP_RANK"] = str(rank // per_node)
    else:
        os.environ.pop("GROUP_RANK", None)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))


def _train(model: nn.Module, opt: ropt.AdamW, xs: list[torch.Tensor], rank: int, world: int) -> None:
    for x in xs:
        mine = x.chunk(world)[rank]
        (model(mine).square().mean() * mine.shape[0] * world / x.shape[0]).backward()
        opt.step()
        opt.zero_grad()


def train_worker(rank: int, world: int, port: int, out: str, stage: int, env: str) -> None:
    _init(rank, world, port, PER_NODE, env)
    try:
        from ramtorch.distributed import share_parameters

        model = Net()  # the other ranks' weights are changed: node 0's must win
        if rank:
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_()
        model = ramtorch.offload(model, device="cpu")
        share_parameters(model)
        first = next(model.parameters())
        start = first.detach().clone()
        # One copy per node: a write on rank 0 is seen by its node's other rank, not by the other
        # node's ranks (their own copy).
        dist.barrier()
        if rank == 0:
            with torch.no_grad():
                first.view(-1)[0] = 1234.5
        dist.barrier()
        seen = float(first.view(-1)[0])
        dist.barrier()
        if rank == 0:
            with torch.no_grad():
                first.view(-1)[0] = start.view(-1)[0]
        dist.barrier()
        opt = ropt.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1).shard(stage=stage)
        _train(model, opt, batches(), rank, world)
        owned = sum(1 for p in model.parameters() if opt.state.get(p))
        from ramtorch import _nodes

        topo = _nodes.current()
        torch.save(
            {
                "seen": seen,
                "start": start,
                "owned": owned,
                "nodes": topo.nodes if topo else None,
                "params": [p.detach().clone() for p in model.parameters()],
            },
            f"{out}.{rank}",
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_rank()


@pytest.mark.parametrize(("stage", "env"), [(1, "group_rank"), (2, "local_world_size")])
def test_two_nodes_of_two_ranks_train_as_one_process(tmp_path, stage, env):
    out = str(tmp_path / "n")
    mp.spawn(train_worker, args=(WORLD, free_port(), out, stage, env), nprocs=WORLD, join=True)
    results = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    assert all(r["nodes"] == [[0, 1], [2, 3]] for r in results)
    # Node 0's weights everywhere (node 1's first rank built others), one copy per node.
    for r in results:
        torch.testing.assert_close(r["start"], results[0]["start"], rtol=0, atol=0)
    assert [r["seen"] == 1234.5 for r in results] == [True, True, False, False]
    # Training: the rank-0 model (Net() seeds itself as the reference does) on the global batch.
    ref = reference()
    for r in results:
        for a, b in zip(ref, r["params"]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    owned = [r["owned"] for r in results]
    assert sum(owned) == len(ref) and all(n > 0 for n in owned)  # states sharded over all four


def resume_worker(rank: int, world: int, port: int, out: str, per_node: int, phase: int) -> None:
    """Phase 0: two nodes train two steps and rank 0 saves a consolidated checkpoint. Phase 1: one
    node (``world`` ranks) loads it and trains the last two."""
    _init(rank, world, port, per_node)
    try:
        from ramtorch.distributed import share_parameters

        data = batches()
        model = ramtorch.offload(Net(), device="cpu")
        share_parameters(model)
        opt = ropt.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1).shard(stage=2)
        path = f"{out}.ckpt"
        if phase == 0:
            _train(model, opt, data[:2], rank, world)
            opt.consolidate_state_dict(to=0)
            if rank == 0:
                ramtorch.save_checkpoint(path, model, opt)
        else:
            ramtorch.load_checkpoint(path, model, opt)
            _train(model, opt, data[2:], rank, world)
            torch.save([p.detach().clone() for p in model.parameters()], f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_rank()


def test_a_checkpoint_of_two_nodes_resumes_on_one(tmp_path):
    out = str(tmp_path / "c")
    mp.spawn(resume_worker, args=(WORLD, free_port(), out, PER_NODE, 0), nprocs=WORLD, join=True)
    mp.spawn(resume_worker, args=(2, free_port(), out, 2, 1), nprocs=2, join=True)
    ref = reference()
    for r in range(2):
        for a, b in zip(ref, torch.load(f"{out}.{r}")):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def dying_node_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(
        LOCAL_RANK=str(rank % PER_NODE), LOCAL_WORLD_SIZE=str(PER_NODE), GROUP_RANK=str(rank // PER_NODE)
    )
    from ramtorch.distributed import init, share_parameters

    init(backend="gloo", timeout_seconds=30)
    model = ramtorch.offload(Net(), device="cpu")
    share_parameters(model)
    opt = ropt.AdamW(model.parameters(), lr=1e-2).shard()
    model(torch.randn(4, 8)).square().mean().backward()
    if rank >= PER_NODE:
        os._exit(3)  # node 1 dies mid-step, before its share of the reduction
    try:
        opt.step()
        msg = "no error"
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        msg = f"{type(e).__name__}: {e}"
    with open(f"{out}.{rank}.tmp", "w") as fh:
        fh.write(msg)
    os.replace(f"{out}.{rank}.tmp", f"{out}.{rank}")
    # Rank 0 hosts the rendezvous store: it stays until the other survivor has told its error too
    # (which reads the heartbeats there), as a real job's surviving ranks would.
    while not all(os.path.exists(f"{out}.{r}") for r in range(PER_NODE)):
        time.sleep(0.1)
    os._exit(0)


def test_a_dead_node_is_an_error_on_the_other_and_leaves_no_shared_memory(tmp_path):
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    out = str(tmp_path / "d")
    ctx = mp.start_processes(
        dying_node_worker, args=(WORLD, free_port(), out), nprocs=WORLD, join=False, start_method="spawn"
    )
    for p in ctx.processes:
        p.join(timeout=180)
        assert not p.is_alive(), "a rank hung"
    for r in range(PER_NODE):
        msg = open(f"{out}.{r}").read()
        assert msg != "no error", msg
        # the error names the dead node's ranks
        assert re.search(r"ranks? 2, 3 did not answer", msg), msg
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert not {n for n in after - before if "ramtorch" in n}, after - before
