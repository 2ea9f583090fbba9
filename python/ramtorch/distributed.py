"""Several processes of one node sharing one copy of a model's host parameters.

:func:`share_parameters` puts every CPU floating-point parameter of a model into one host region that
all ranks of a ``torch.distributed`` group on this node map (a ``memfd``: one copy in RAM, each process
pinning its own mapping when a GPU is present). After it returns, the ranks' parameters are views of
the same memory: **a write by any rank (an in-place optimizer step, ``p.data.copy_(...)``) is seen by
every rank**, with no broadcast; ranks must order such writes with their reads themselves (for
instance with a barrier, or by each rank updating a disjoint shard, as ZeRO-1 does).

Nothing is left in ``/dev/shm``: the kernel frees the region once the last process drops its views or
exits, crashes included.
"""

from __future__ import annotations

import datetime
import importlib
import os
import socket

import torch
import torch.distributed as dist
from torch import nn

from . import _arena, _nodes
from ._stream.units import _set_inner, _Sub, check_streamable, stream_tensors

__all__ = ["init", "share_parameters"]

_ALIGN = 64


def init(backend: str | None = None, timeout_seconds: float = 300.0) -> tuple[int, int]:
    """Initialises ``torch.distributed`` from the environment that ``torchrun`` (or a launcher
    setting ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``) provides;
    returns ``(rank, world_size)``. With CUDA the backend defaults to NCCL for CUDA tensors and
    gloo for host tensors (``"cpu:gloo,cuda:nccl"``: ZeRO reduces gradients on the GPUs, and a few
    host tensors, such as the global gradient norm, go through gloo), and the current device
    becomes ``cuda:LOCAL_RANK``; without CUDA, gloo. ``timeout_seconds`` bounds every
    collective: a rank that dies mid-step makes the others raise after it instead of hanging.
    Already initialised: returns the current rank and size."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"ramtorch.distributed.init: environment variables {', '.join(missing)} are not set "
            "(launch with torchrun, or call torch.distributed.init_process_group yourself)"
        )
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # TorchDynamo, imported lazily by the first torch optimizer, keeps references to the process
    # groups that exist when it is imported; destroy_process_group then leaves the gloo worker
    # threads running, and one releasing a finished collective's tensors while the interpreter
    # finalizes aborts the process ("terminate called without an active exception"). Imported
    # before the group exists, it holds none and destroy_process_group ends the threads.
    importlib.import_module("torch._dynamo")

    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_seconds))
    return dist.get_rank(), dist.get_world_size()


def _candidates(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters to share: CPU, floating point, each once (tied weights share one entry)."""
    return [
        (name, p)
        for name, p in model.named_parameters()
        if p.device.type == "cpu" and p.dtype.is_floating_point
    ]


def _stored(p: torch.Tensor) -> str:
    """How ``p``'s bytes are held: ``""`` for a plain tensor, else its subclass and inner tensors."""
    leaves, tree = stream_tensors([p])
    if tree is None:
        return ""
    return f"{type(p).__qualname__} of " + ", ".join(f"{list(t.shape)} {t.dtype}" for t in leaves)


def _first_difference(mine: list[tuple[str, tuple[int, ...], str, str]], ref: list) -> str | None:
    """Describes the first parameter where ``mine`` and ``ref`` (the source's) differ, or None."""
    for i in range(max(len(mine), len(ref))):
        a = mine[i] if i < len(mine) else None
        b = ref[i] if i < len(ref) else None
        if a == b:
            continue
        if a is None:
            return f"parameter {b[0]!r} (shape {list(b[1])}, {b[2]}) is missing"
        if b is None:
            return f"parameter {a[0]!r} (shape {list(a[1])}, {a[2]}) is extra"
        if a[0] != b[0]:
            return f"parameter #{i} is {a[0]!r} where the source has {b[0]!r}"
        if a[1:3] == b[1:3]:
            mine_, src = a[3] or "a plain tensor", b[3] or "a plain tensor"
            return f"parameter {a[0]!r} is stored as {mine_} where the source has {src}"
        return (
            f"parameter {a[0]!r} has shape {list(a[1])}, {a[2]} where the source has shape "
            f"{list(b[1])}, {b[2]}"
        )
    return None


def share_parameters(
    model: nn.Module, *, src_rank: int | None = None, group: dist.ProcessGroup | None = None
) -> torch.Tensor | None:
    """Makes the ranks of each node use one shared host copy of ``model``'s CPU floating-point
    parameters: every rank of ``group`` (a group of one host's ranks), or by default every rank of
    this rank's node, the nodes of the world found from the launcher (``GROUP_RANK``, else ``rank //
    LOCAL_WORLD_SIZE``, else the host name; see :mod:`ramtorch._nodes`), one copy per node.

    The values are those of rank ``src_rank`` (a global rank; default: the group's first rank, or
    global rank 0 across nodes: each node's first rank fills its node's copy, and the copies of
    the other nodes are then overwritten with node 0's bytes, so that every node starts from the
    same weights, as ``DistributedDataParallel`` broadcasts rank 0's at construction).

    Collective: every rank of ``group`` (by default, of the world) must call it, with a model of
    identical parameter names, shapes and dtypes (checked first: a :class:`ValueError` naming the
    first difference is raised on every rank, before any parameter is touched). The source rank
    copies its parameters into one new shared region (64-byte aligned, in ``named_parameters()``
    order), the others map it, and every rank points its parameters' ``.data`` at views of it;
    then a barrier. Gradients, buffers and
    parameters not on the CPU or not floating point are left alone. Frozen tensor-subclass weights
    (torchao quantized weights, as in QLoRA) are shared by their inner tensors and stay the same
    subclass; a subclass that cannot be (one without dense inner tensors reachable through
    ``__tensor_flatten__``, or one that requires grad) is an error naming the parameter, raised on
    every rank before any parameter is touched.

    After this, a write to a shared parameter by any rank is seen by all ranks of its node (order
    writes and reads across ranks yourself, e.g. with a barrier; ``ramtorch.optim``'s ZeRO sends
    an owner's new weights to one rank of every other node). Returns the flat ``uint8`` region
    (``None`` when there is nothing to share); the parameters keep it alive, so it may be dropped.

    ``torch.distributed`` must be initialised by the caller (gloo or nccl; with nccl, set the
    current CUDA device first, as for any object collective). The ranks of a node must run on one
    host as the same user, and the source rank's region must stay alive until the other ranks have
    mapped it, which the function ensures before returning.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("share_parameters: torch.distributed is not initialised")
    rank = dist.get_rank()
    topo = _nodes.topology() if group is None else None
    across = topo is not None and topo.multi
    if across:
        assert topo is not None
        if src_rank is None:
            src_rank = 0
        if src_rank not in range(dist.get_world_size()):
            raise ValueError(f"share_parameters: src_rank {src_rank} is not in the group")
        # Each node's first rank fills its node's copy (then node 0's bytes replace it).
        node_src, node_group = topo.node_of(rank)[0], topo.node_group
    else:
        if src_rank is None:
            src_rank = dist.get_global_rank(group, 0) if group is not None else 0
        node_src, node_group = src_rank, group
    world = dist.get_world_size(group)
    src_index = dist.get_group_rank(group, src_rank) if group is not None else src_rank
    if not 0 <= src_index < world:
        raise ValueError(f"share_parameters: src_rank {src_rank} is not in the group")

    params = _candidates(model)
    # An offloaded model's streamed units keep their packed layout: each unit is one slice of the
    # region, so it still crosses the link in one copy. Other CPU parameters follow, tensor
    # subclasses by their inner tensors.
    streamer = getattr(model, "_ramtorch_streamer", None)
    units = list(streamer.streamed) if streamer is not None else []
    in_units = {id(p) for u in units for p in u.params}
    rest = [(n, p) for n, p in params if id(p) not in in_units]
    problem: tuple[str, str] | None = None
    on_disk = [u.name for u in units if u.disk is not None]
    if on_disk:
        problem = (
            "ValueError",
            f"share_parameters: units {on_disk[:4]}{' ...' if len(on_disk) > 4 else ''} live on disk "
            "(ramtorch.offload(disk=...)), which ranks cannot share yet; offload without disk=, or "
            "give each rank its own store",
        )
    for name, p in rest:
        if problem is not None:
            break
        try:
            check_streamable(name, p, who="ramtorch.distributed.share_parameters")
        except (TypeError, ValueError) as e:
            problem = (type(e).__name__, str(e))
            break
    fingerprint = [] if problem else [(name, tuple(p.shape), str(p.dtype), _stored(p)) for name, p in params]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (socket.gethostname(), rank, fingerprint, problem), group=group)

    for _, r, _, prob in gathered:
        if prob is not None:
            kind = TypeError if prob[0] == "TypeError" else ValueError
            raise kind(prob[1] if r == rank else f"{prob[1]} (on rank {r})")
    src_host, _, ref, _ = gathered[src_index]
    for host, r, fp, _ in gathered:
        if not across and host != src_host:
            raise RuntimeError(
                f"share_parameters: rank {r} runs on host {host!r}, the source rank {src_rank} on "
                f"{src_host!r}; the ranks of a group share host memory and must run on one host "
                "(across nodes, leave group=None: each node gets its copy)"
            )
        diff = _first_difference(fp, ref)
        if diff is not None:
            raise ValueError(
                f"share_parameters: the model of rank {r} differs from that of source rank {src_rank}: {diff}"
            )
    if not params:
        dist.barrier(group=group)
        return None
    origin = src_rank  # whose weights every node ends with
    group, src_rank = node_group, node_src  # from here on: this node's copy
    world = dist.get_world_size(group)

    unit_offsets, total = [], 0
    for u in units:
        total = -(-total // _ALIGN) * _ALIGN
        unit_offsets.append(total)
        total += u.nbytes
    leaves, tree = stream_tensors([p for _, p in rest])
    offsets = []
    for p in leaves:
        total = -(-total // _ALIGN) * _ALIGN
        offsets.append(total)
        total += p.numel() * p.element_size()

    flat: torch.Tensor | None = None
    error = ""
    msg: list = [None]
    if rank == src_rank:
        try:
            flat, name = _arena.shared_bytes(total)
            msg = [name]
        except Exception as e:  # reported to every rank below
            error = f"rank {rank} could not create the shared region: {e}"
            msg = [""]
    dist.broadcast_object_list(msg, src=src_rank, group=group)
    if rank != src_rank:
        if not msg[0]:
            error = "the source rank could not create the shared region"
        else:
            try:
                flat = _arena.attach_shared(msg[0], total)
            except Exception as e:  # reported to every rank below
                error = f"rank {rank} could not map the shared region: {e}"
    errors: list = [None] * world
    dist.all_gather_object(errors, error, group=group)
    failed = [e for e in errors if e]
    if failed:
        raise RuntimeError("share_parameters: " + "; ".join(failed))
    assert flat is not None

    # Each tensor gets a storage of its own over its bytes (torch.save and safetensors refuse one
    # storage seen as several dtypes, as an int8 weight next to its fp32 scales would be).
    views = [
        _arena.own_storage(flat[off : off + p.numel() * p.element_size()].view(p.dtype).view(p.shape))
        for off, p in zip(offsets, leaves)
    ]
    with torch.no_grad():
        for u, off in zip(units, unit_offsets):
            u.adopt(flat[off : off + u.nbytes], copy=rank == src_rank)
        if rank == src_rank:
            for t, v in zip(leaves, views):
                v.copy_(t.detach())
        for k, (_, p) in enumerate(rest):
            x = k if tree is None else tree[k]
            if isinstance(x, _Sub):
                _set_inner(p, x, views)  # the same subclass tensor, its inner tensors shared
            else:
                p.data = views[x]
    if across:
        assert topo is not None
        # Every node starts from the source's weights: the source sends its node's copy to the
        # rank at its local index on every other node, which writes it into its node's copy.
        dist.barrier(group=group)  # this node's copy is filled
        if topo.place(rank)[1] == topo.place(origin)[1]:
            dist.broadcast(flat, src=origin, group=_cross(topo, origin))
    for _, p in params:
        # ZeRO: the owner's update reaches the ranks of its node without a broadcast (and one
        # rank of every other node, which writes it into its node's copy)
        p._ramtorch_shared = True
    # Every rank has mapped the region and the source has filled it before anyone returns.
    dist.barrier(group=None if across else group)
    return flat


def _cross(topo: _nodes.Topology, rank: int) -> dist.ProcessGroup:
    """The group of the ranks at ``rank``'s local index on every node."""
    return topo.cross[topo.place(rank)[1]]
