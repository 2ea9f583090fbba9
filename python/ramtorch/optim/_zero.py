"""ZeRO as a strategy of the optimizer: which rank owns (keeps the state of, and updates) each
parameter, the reduction of gradients onto their owners, the publication of new weights to the
other ranks, and the gathering of every rank's states on one (``consolidate_state_dict``)."""

from __future__ import annotations

from typing import Any

import torch

from .. import _nodes


def _first_diff(a: str, b: str) -> str:
    """Where two settings descriptions part, with some context."""
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"rank 0 has ...{a[max(0, i - 40) : i + 40]}... where it has ...{b[max(0, i - 40) : i + 40]}..."


class Zero:
    """An optimizer's parameters sharded over the ranks of ``group`` (a process group; None: the
    world), balanced by size; ``stage`` 1 (reduce and update in ``step()``) or 2 (reduce during
    backward, as each unit's gradients land)."""

    def __init__(self, group: Any, owner: dict[int, int], stage: int) -> None:
        self.group = group
        self.owner = owner  # id(param) -> rank updating it
        self.stage = stage
        # The other ranks' states gathered here by consolidate_state_dict(), by parameter index,
        # until the next update.
        self.consolidated: dict[int, dict[str, Any]] | None = None

    @classmethod
    def plan(cls, opt: torch.optim.Optimizer, group: Any, stage: int) -> Zero:
        """Shards ``opt``'s parameters over the ranks of ``group``, once every rank is found to
        shard the same parameters with the same settings (a collective)."""
        name = type(opt).__name__
        if stage not in (1, 2):
            raise ValueError(f"{name}.shard(): stage must be 1 or 2, got {stage!r}")
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{name}.shard(): torch.distributed is not initialised")
        world = dist.get_world_size(group)
        # Every rank must shard the same parameters with the same settings: compare before any
        # collective of a step could pair up wrong tensors.
        mine = (
            name,
            stage,
            opt.precision,  # type: ignore[attr-defined]
            [
                (tuple(p.shape), str(p.dtype), {k: v for k, v in g.items() if k != "params"})
                for g in opt.param_groups
                for p in g["params"]
            ],
        )
        theirs: list[Any] = [None] * world
        dist.all_gather_object(theirs, repr(mine), group=group)
        for r, other in enumerate(theirs):
            if other != theirs[0]:
                raise ValueError(
                    f"{name}.shard(): rank {r} has different parameters or settings "
                    f"than rank 0 (optimizer, stage, precision, shapes, dtypes, hyperparameters): "
                    f"{_first_diff(theirs[0], other)}"
                )
        loads = [0] * world
        owner: dict[int, int] = {}
        for g in opt.param_groups:
            for p in g["params"]:
                r = min(range(world), key=lambda k: (loads[k], k))
                owner[id(p)] = r
                loads[r] += p.numel()
        _nodes.start_heartbeat()  # a failed collective can then name the ranks that are gone
        return cls(group, owner, stage)

    def world(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(self.group)

    def rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self.group)

    def global_rank(self, r: int) -> int:
        import torch.distributed as dist

        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def owns(self, p: torch.Tensor) -> bool:
        """Whether this rank updates ``p``."""
        import torch.distributed as dist

        return self.owner[id(p)] == dist.get_rank(self.group)

    def reduce_one(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """Averages ``grad`` (``p``'s gradient) onto ``p``'s owner."""
        import torch.distributed as dist

        owner = self.owner[id(p)]
        dst = dist.get_global_rank(self.group, owner) if self.group is not None else owner
        try:
            dist.reduce(grad, dst=dst, op=dist.ReduceOp.SUM, group=self.group)
        except (RuntimeError, dist.DistError) as e:
            raise _nodes.explain("ZeRO's gradient reduction", e) from e
        if owner == dist.get_rank(self.group):
            grad.div_(dist.get_world_size(self.group))

    def reduce(self, param_groups: list[dict[str, Any]], skip: set[int]) -> None:
        """Averages every gradient onto its owner but those of ``skip`` (ids, reduced already)."""
        for g in param_groups:
            for p in g["params"]:
                if p.grad is not None and id(p) not in skip:
                    self.reduce_one(p, p.grad)

    def publish(self, param_groups: list[dict[str, Any]]) -> None:
        """Sends each owner's new weights to the other ranks. A parameter in shared host memory
        (``ramtorch.distributed.share_parameters``) needs nothing sent within its owner's node;
        across nodes the owner sends it to the rank at its local index on every other node, which
        writes it into that node's copy."""
        import torch.distributed as dist

        try:
            self._publish(param_groups)
        except (RuntimeError, dist.DistError) as e:
            raise _nodes.explain("ZeRO's publication of new weights", e) from e

    def _publish(self, param_groups: list[dict[str, Any]]) -> None:
        import torch.distributed as dist

        topo = _nodes.current()
        for g in param_groups:
            for p in g["params"]:
                if not p.requires_grad:
                    continue
                src = self.global_rank(self.owner[id(p)])
                if getattr(p, "_ramtorch_shared", False):
                    if topo is not None and topo.multi:
                        # (ranks outside the group skip the call: torch returns at once for them)
                        dist.broadcast(p.data, src=src, group=topo.cross[topo.place(src)[1]])
                    continue
                dist.broadcast(p.data, src=src, group=self.group)
        dist.barrier(group=self.group)

    def all_reduce_sum(self, total: float) -> float:
        """The sum of ``total`` over the ranks (a global gradient norm's squares)."""
        import torch.distributed as dist

        t = torch.tensor([total], dtype=torch.float64)
        try:
            dist.all_reduce(t, group=self.group)
        except (RuntimeError, dist.DistError) as e:
            raise _nodes.explain("ZeRO's gradient norm", e) from e
        return float(t.item())

    def kept_indices(self, param_groups: list[dict[str, Any]]) -> set[int]:
        """Indices of the parameters whose state this rank keeps."""
        params = [p for g in param_groups for p in g["params"]]
        return {i for i, p in enumerate(params) if self.owns(p)}

    def sharded_state_error(self, name: str) -> RuntimeError:
        """The error of a state dict asked of a rank that holds its share only."""
        return RuntimeError(
            f"{name} is sharded over {self.world()} ranks (ZeRO): rank "
            f"{self.rank()} holds the state of its share of the parameters only. "
            "Call opt.consolidate_state_dict(to=0) on every rank, then opt.state_dict() or "
            "ramtorch.save_checkpoint(...) on rank 0 (before the next step)"
        )

    def gather(self, local: dict[int, dict[str, Any]], to: int) -> None:
        """Gathers every rank's ``local`` states (torch's state dict ``state``) on rank ``to``,
        into :attr:`consolidated` there (a collective)."""
        import torch.distributed as dist

        world, me = self.world(), self.rank()
        # What each rank holds, by parameter index: tensors by shape and dtype, other values as is.
        mine = {
            i: {
                k: ("tensor", tuple(v.shape), str(v.dtype)) if torch.is_tensor(v) else ("value", v)
                for k, v in st.items()
            }
            for i, st in local.items()
        }
        described: list[Any] = [None] * world
        dist.all_gather_object(described, mine, group=self.group)

        gathered: dict[int, dict[str, Any]] = {}
        for r in range(world):
            if r == to:
                continue
            for i in sorted(described[r]):
                if me == r:
                    for k in sorted(local[i]):
                        if torch.is_tensor(local[i][k]):
                            dist.send(local[i][k].contiguous(), dst=self.global_rank(to), group=self.group)
                elif me == to:
                    st: dict[str, Any] = {}
                    for k, d in sorted(described[r][i].items()):
                        if d[0] == "tensor":
                            t = torch.empty(d[1], dtype=getattr(torch, d[2].removeprefix("torch.")))
                            dist.recv(t, src=self.global_rank(r), group=self.group)
                            st[k] = t
                        else:
                            st[k] = d[1]
                    gathered[i] = st
        self.consolidated = gathered if me == to else None
        dist.barrier(group=self.group)
