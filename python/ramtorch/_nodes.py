"""Nodes of a ``torch.distributed`` world: which ranks share one host (one copy of the shared
host parameters, ``ramtorch.distributed.share_parameters``), and the groups that join them.

A rank's node comes from the launcher, not from the host name alone, so that several nodes can be
simulated on one machine: ``GROUP_RANK`` (``torchrun``'s node rank), else ``rank //
LOCAL_WORLD_SIZE`` (launchers that set only that), else the host name. The ranks of a node must run
on one host (they map one ``memfd``); every node must hold as many ranks (a rank at local index
``i`` relays to the ranks at index ``i`` of the other nodes).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist


@dataclass
class Topology:
    """The nodes of the world as lists of global ranks (ordered by node, then rank), this rank's
    node group (``None`` with one node: the world), and per local index ``i`` the group of the
    ranks at index ``i`` of every node (``None`` with one node)."""

    nodes: list[list[int]]
    node_group: Any = None
    cross: list[Any] = field(default_factory=list)

    @property
    def multi(self) -> bool:
        """Whether the world spans more than one node."""
        return len(self.nodes) > 1

    def place(self, rank: int) -> tuple[int, int]:
        """``(node, local index)`` of global rank ``rank``."""
        for n, ranks in enumerate(self.nodes):
            if rank in ranks:
                return n, ranks.index(rank)
        raise ValueError(f"rank {rank} is in no node")

    def node_of(self, rank: int) -> list[int]:
        """The global ranks of ``rank``'s node."""
        return self.nodes[self.place(rank)[0]]


#: The topology of the current world, with the world group it was made for.
_CURRENT: tuple[Any, Topology] | None = None


def node_key(rank: int) -> str:
    """This rank's node, as the launcher says (see the module's documentation)."""
    if os.environ.get("GROUP_RANK", "").strip():
        return f"node {os.environ['GROUP_RANK'].strip()}"
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    if local:
        try:
            size = int(local)
        except ValueError:
            raise ValueError(f"LOCAL_WORLD_SIZE must be an integer, got {local!r}") from None
        if size < 1:
            raise ValueError(f"LOCAL_WORLD_SIZE must be positive, got {size}")
        return f"node {rank // size}"
    return f"host {socket.gethostname()}"


def current() -> Topology | None:
    """The topology made by :func:`topology` for the current world, if any (no collective)."""
    if _CURRENT is None or not dist.is_initialized() or _CURRENT[0] is not dist.group.WORLD:
        return None
    return _CURRENT[1]


def topology() -> Topology:
    """The nodes of the current world and their groups, made once per world (a collective the
    first time: every rank must call it). Raises ``ValueError`` when the ranks of a node run on
    different hosts or the nodes hold different numbers of ranks."""
    global _CURRENT
    found = current()
    if found is not None:
        return found
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = (node_key(rank), socket.gethostname())
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    keys: dict[str, list[int]] = {}
    hosts: dict[str, str] = {}
    for r, (key, host) in enumerate(everyone):
        keys.setdefault(key, []).append(r)
        if hosts.setdefault(key, host) != host:
            raise ValueError(
                f"ramtorch: the ranks of {key} run on hosts {hosts[key]!r} and {host!r} (rank {r}); "
                "a node's ranks share host memory and must run on one host (check GROUP_RANK / "
                "LOCAL_WORLD_SIZE, or pass a group of one host's ranks)"
            )
    nodes = sorted(keys.values(), key=lambda ranks: ranks[0])
    sizes = {len(n) for n in nodes}
    if len(sizes) > 1:
        shown = ", ".join(f"{len(n)} (ranks {n[0]}..{n[-1]})" for n in nodes)
        raise ValueError(f"ramtorch: every node must hold as many ranks; the nodes hold {shown}")
    topo = Topology(nodes)
    if topo.multi:
        # Every rank creates every group, in the same order (new_group is a collective).
        groups = [dist.new_group(ranks) for ranks in nodes]
        topo.node_group = groups[topo.place(rank)[0]]
        topo.cross = [dist.new_group([n[i] for n in nodes]) for i in range(len(nodes[0]))]
    _CURRENT = (dist.group.WORLD, topo)
    return topo


#: Failed collectives seen by this process: the survivors of a failure count alike, so that they
#: meet under one key of the rendezvous store (:func:`unresponsive`).
_FAILURES = 0


def unresponsive(wait_seconds: float = 5.0) -> list[int] | None:
    """After a collective failed: the ranks that do not answer through the rendezvous store
    within ``wait_seconds`` (dead or stalled), each surviving rank writing its own mark and
    waiting for the others'. ``[0]`` when the store itself is gone (rank 0 hosts it); ``None``
    when the store cannot tell (not reachable from here for another reason)."""
    global _FAILURES
    _FAILURES += 1
    try:
        from torch.distributed import distributed_c10d

        store = distributed_c10d._get_default_store()
        world, rank = dist.get_world_size(), dist.get_rank()
    except Exception:  # noqa: BLE001 - no store to ask: nothing to say
        return None
    prefix = f"ramtorch/alive/{_FAILURES}/"
    try:
        store.set(f"{prefix}{rank}", "1")
    except Exception:  # noqa: BLE001 - the store's host is gone
        return [0]
    import time

    deadline = time.monotonic() + wait_seconds
    missing = [r for r in range(world) if r != rank]
    while missing and time.monotonic() < deadline:
        try:
            missing = [r for r in missing if not store.check([f"{prefix}{r}"])]
        except Exception:  # noqa: BLE001 - the store's host died meanwhile
            return [0]
        if missing:
            time.sleep(0.05)
    return missing


def explain(what: str, error: BaseException) -> RuntimeError:
    """The error of a failed collective ``what``, naming the ranks that do not answer."""
    missing = unresponsive()
    if missing is None:
        who = "a rank did not answer"
    elif not missing:
        who = "every rank answers after it (a transient error, or a rank's own failure)"
    else:
        names = ", ".join(str(r) for r in missing)
        who = f"rank{'s' if len(missing) > 1 else ''} {names} did not answer (dead or stalled)"
    return RuntimeError(
        f"ramtorch: {what} failed on rank {dist.get_rank()}: {who}; {type(error).__name__}: {error}"
    )
