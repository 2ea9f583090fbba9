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
import threading
import time
import weakref
from typing import Any

import torch.distributed as dist


def _weak(group: Any) -> Any:
    """A callable that returns ``group``: a weak reference, or for the marker torch returns to a
    rank outside a group (which holds nothing), the marker itself."""
    try:
        return weakref.ref(group)
    except TypeError:
        return lambda: group


class Topology:
    """The nodes of the world as lists of global ranks (ordered by node, then rank), this rank's
    node group (``None`` with one node: the world), and per local index ``i`` the group of the
    ranks at index ``i`` of every node (empty with one node). The groups are held weakly: torch's
    registry keeps them while the world lives, and ``destroy_process_group`` ends them (with their
    threads) whatever this object's lifetime."""

    def __init__(
        self, nodes: list[list[int]], node_group: Any = None, cross: list[Any] | None = None
    ) -> None:
        self.nodes = nodes
        self._node_group = None if node_group is None else _weak(node_group)
        self._cross = [_weak(g) for g in cross or []]

    @property
    def node_group(self) -> Any:
        return None if self._node_group is None else self._node_group()

    @property
    def cross(self) -> list[Any]:
        return [r() for r in self._cross]

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


#: The topology of the current world, with (a weak reference to) the world group it was made for.
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
    if _CURRENT is None or not dist.is_initialized() or _CURRENT[0]() is not dist.group.WORLD:
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
    if len(nodes) > 1:
        # Every rank creates every group, in the same order (new_group is a collective).
        groups = [dist.new_group(ranks) for ranks in nodes]
        cross = [dist.new_group([n[i] for n in nodes]) for i in range(len(nodes[0]))]
        topo = Topology(nodes, groups[topo.place(rank)[0]], cross)
    _CURRENT = (weakref.ref(dist.group.WORLD), topo)
    return topo


#: Seconds between two beats of a rank's heartbeat (:func:`start_heartbeat`).
BEAT_SECONDS = 0.5
#: The heartbeat thread of this process, with the world group it beats for.
_HEART: tuple[Any, threading.Thread] | None = None


def _store() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def start_heartbeat() -> None:
    """Starts this rank's heartbeat (once per world): a daemon thread that writes a counter to the
    rendezvous store every :data:`BEAT_SECONDS`, so that :func:`unresponsive` can tell a rank that
    is dead or frozen from one that is alive but blocked in a collective. It stops when the store
    goes away or the world changes."""
    global _HEART
    if not dist.is_initialized():
        return
    world = weakref.ref(dist.group.WORLD)  # (held weakly: destroy_process_group ends the group)
    if _HEART is not None and _HEART[0]() is world() and _HEART[1].is_alive():
        return
    try:
        store, rank = _store(), dist.get_rank()
    except Exception:  # noqa: BLE001 - no store: no heartbeat
        return

    def beat() -> None:
        n = 0
        while dist.is_initialized() and world() is not None and dist.group.WORLD is world():
            n += 1
            try:
                store.set(f"ramtorch/heartbeat/{rank}", str(n))
            except Exception:  # noqa: BLE001 - the store is gone: nobody to tell
                return
            time.sleep(BEAT_SECONDS)

    t = threading.Thread(target=beat, name="ramtorch-heartbeat", daemon=True)
    t.start()
    _HEART = (world, t)


def unresponsive(wait_seconds: float = 6 * BEAT_SECONDS) -> list[int] | None:
    """After a collective failed: the ranks whose heartbeat (:func:`start_heartbeat`) does not move
    within ``wait_seconds`` (dead or frozen; a rank blocked in a collective still beats). ``[0]``
    when the store itself is gone (rank 0 hosts it); ``None`` when it cannot tell (no store, or no
    heartbeats)."""
    try:
        store, world, rank = _store(), dist.get_world_size(), dist.get_rank()
    except Exception:  # noqa: BLE001 - no store to ask: nothing to say
        return None
    keys = {r: f"ramtorch/heartbeat/{r}" for r in range(world) if r != rank}

    def read() -> dict[int, bytes | None]:
        return {r: store.get(k) if store.check([k]) else None for r, k in keys.items()}

    try:
        first = read()
        if all(v is None for v in first.values()) and keys:
            return None  # no rank beats: heartbeats were never started
        deadline = time.monotonic() + wait_seconds
        silent = set(keys)
        while silent and time.monotonic() < deadline:
            time.sleep(BEAT_SECONDS / 2)
            now = read()
            silent = {r for r in silent if now[r] is None or now[r] == first[r]}
    except Exception:  # noqa: BLE001 - the store's host is gone
        return [0]
    return sorted(silent)


def explain(what: str, error: BaseException) -> RuntimeError:
    """The error of a failed collective ``what``, naming the ranks that do not answer."""
    missing = unresponsive()
    if missing is None:
        who = "a rank did not answer"
    elif not missing:
        who = "every rank is alive (a transient error, or a rank's own failure)"
    elif missing == [0] and dist.get_rank() != 0:
        who = "rank 0, which hosts the rendezvous store, did not answer (dead or stalled)"
    else:
        names = ", ".join(str(r) for r in missing)
        who = f"rank{'s' if len(missing) > 1 else ''} {names} did not answer (dead or stalled)"
    where = f"rank {dist.get_rank()}"
    return RuntimeError(f"ramtorch: {what} failed on {where}: {who}; {type(error).__name__}: {error}")
