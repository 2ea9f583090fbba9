"""The disk tier: units that do not fit in the host budget live in a store file.

``ramtorch.offload(model, host_budget=..., disk=dir)`` keeps the streamed units that fit in
``host_budget`` in host RAM (the arena) and the others in one store file under ``dir``
(``_core.DiskStore``): made for the run, allocated whole at once (a full disk is an error then,
naming the bytes it needed and had), and removed from the directory as soon as it is opened, so
that nothing is left after the process ends, crashes included.

Each disk unit owns an *extent* of the store (4 KiB aligned). Its parameters stay ``nn.Parameter``
s over the store's mapping: host-side readers and writers (``state_dict``, ``load_state_dict``,
the optimizer) see ordinary CPU tensors, which the kernel pages in and writes back;
:meth:`Extent.settle` writes an extent back and drops it from memory. Streaming does not go
through the mapping: :meth:`Extent.read` reads the extent into a page-locked staging buffer on the
store's I/O threads (``O_DIRECT`` where the file system takes it), and the copy to the device
leaves from that buffer (``ramtorch._stream.itinerary.Prefetcher``).
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from . import _arena, _core, _engine

#: Extents start at multiples of this, and reads are whole multiples of it (``O_DIRECT``).
ALIGN = 4096
#: Environment variable: I/O threads per store (default 8).
THREADS_VAR = "RAMTORCH_DISK_THREADS"
#: Environment variable: disk units read ahead of the one running (default 4).
AHEAD_VAR = "RAMTORCH_DISK_AHEAD"


def _env_int(name: str, default: int, low: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
    if value < low:
        raise ValueError(f"environment variable {name} must be at least {low}, got {value}")
    return value


def threads() -> int:
    """I/O threads per store: ``RAMTORCH_DISK_THREADS``, else 8."""
    return _env_int(THREADS_VAR, 8, 1)


def ahead() -> int:
    """Disk units read ahead along the itinerary: ``RAMTORCH_DISK_AHEAD``, else 4."""
    return _env_int(AHEAD_VAR, 4, 1)


def _meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes."""
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, _, v = line.partition(":")
            parts = v.split()
            if parts:
                out[k] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return out


def auto_host_budget(largest_unit: int) -> int:
    """The host budget when ``disk=`` comes without one: the memory the machine has available now
    (``MemAvailable``) less a reserve for the runtime (the larger of 2 GiB and a tenth of its
    memory) and the staging buffers of the reads ahead (``ahead() + 1`` of the largest unit)."""
    info = _meminfo()
    total, free = info.get("MemTotal", 0), info.get("MemAvailable", 0)
    reserve = max(2 << 30, total // 10) + (ahead() + 1) * _padded(largest_unit)
    return max(0, free - reserve)


def _padded(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


class Store:
    """One store file holding extents of the given sizes (bytes each), in order."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        sizes: Sequence[int],
        path: str | None = None,
        create: bool = True,
    ) -> None:
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += _padded(int(n))
        self.directory = os.fspath(directory)
        if not os.path.isdir(self.directory):
            raise ValueError(f"ramtorch.offload: disk={self.directory!r} is not a directory")
        if path is None:  # made for the run, its name removed at once
            self.core = _core.DiskStore(self.directory, max(total, ALIGN), threads())
        else:  # a kept store's file (ramtorch._keep), made or opened
            self.core = _core.DiskStore.open(path, max(total, ALIGN), threads(), create)
        self.map = torch.from_dlpack(self.core.mapping())
        self.extents = [Extent(self, off, _padded(int(n))) for off, n in zip(offsets, sizes)]
        #: ``offload(..., keep=True)``: the kept store this file belongs to (``ramtorch._keep``).
        self.kept: Any = None
        self.wait_seconds = 0.0  # time the compute thread waited for reads
        self.host_budget: int | None = None  # the host budget that put these units here
        #: ``offload(..., optimizer_on_disk=True)``: the optimizer states of the parameters in
        #: this store live on disk too (:class:`DiskStates`).
        self.optimizer_on_disk = False
        #: The optimizers' states of this store's parameters (:class:`DiskStates`), while alive.
        self.states: weakref.WeakSet[DiskStates] = weakref.WeakSet()
        #: With :attr:`optimizer_on_disk`: the parameters of the model's streamed units kept in
        #: host RAM, whose optimizer states live on disk too.
        self.host_params: dict[int, weakref.ref[torch.Tensor]] = {}
        _LIVE.add(self)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether CPU tensor ``t`` lies in this store's mapping."""
        base = self.map.data_ptr()
        return t.device.type == "cpu" and base <= t.data_ptr() < base + self.nbytes

    @property
    def nbytes(self) -> int:
        return int(self.core.nbytes)

    def stats(self) -> dict[str, Any]:
        """The store's counters, with the read bandwidth while reads were in flight."""
        s = dict(self.core.stats())
        busy, wbusy = s["busy_seconds"], s["write_busy_seconds"]
        states = list(self.states)
        out = {
            "disk_path": self.core.path,
            "disk_direct": bool(self.core.direct),
            "disk_bytes": self.nbytes,
            "disk_reads": s["reads"],
            "disk_read_bytes": s["read_bytes"],
            "disk_busy_seconds": round(busy, 6),
            "disk_read_gbps": round(s["read_bytes"] / busy / 1e9, 3) if busy > 0 else None,
            "disk_wait_seconds": round(self.wait_seconds, 6),
            "disk_buffered_chunks": s["buffered_chunks"],
            "disk_cached_chunks": s["cached_chunks"],
            "disk_settled_bytes": s["settled_bytes"],
            "disk_write_busy_seconds": round(wbusy, 6),
            "disk_write_gbps": round(s["settled_bytes"] / wbusy / 1e9, 3) if wbusy > 0 else None,
        }
        kept = self.kept
        if kept is not None:  # offload(keep=True): ramtorch._keep
            out.update(
                {
                    "disk_kept": kept.directory,
                    "disk_kept_opened": kept.opened,
                    "disk_commit_serial": int(kept.manifest.get("serial", 0)),
                    "disk_journal_bytes": kept.journal_bytes,
                }
            )
        if states:
            ss = [dict(d.store.core.stats()) for d in states]
            written = sum(x["settled_bytes"] for x in ss)
            sbusy = sum(x["write_busy_seconds"] for x in ss)
            out.update(
                {
                    "disk_state_bytes": sum(d.nbytes for d in states),
                    "disk_state_written_bytes": written,
                    "disk_state_write_gbps": round(written / sbusy / 1e9, 3) if sbusy > 0 else None,
                    "disk_state_updates": sum(d.updates for d in states),
                    "disk_state_staging_bound_bytes": max(d.staging_bound for d in states),
                }
            )
        return out


class Extent:
    """A unit's bytes in a :class:`Store`: ``capacity`` bytes (4 KiB multiple) at ``offset``."""

    __slots__ = ("store", "offset", "capacity", "opened")

    def __init__(self, store: Store, offset: int, capacity: int) -> None:
        self.store = store
        self.offset = offset
        self.capacity = capacity
        #: The extent holds a kept store's values, which the unit's first packing takes as its
        #: parameters' (``ramtorch._keep``) instead of writing theirs.
        self.opened = False

    def view(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the extent in the store's mapping (a ``uint8`` CPU tensor)."""
        if nbytes > self.capacity:
            raise RuntimeError(
                f"ramtorch.offload: a unit now takes {nbytes} bytes, more than the {self.capacity} "
                "its disk extent holds (its parameters were replaced by larger ones after offload)"
            )
        return self.store.map[self.offset : self.offset + nbytes]

    def settle(self) -> None:
        """Writes the extent's mapped pages back to the file and drops them from memory."""
        self.store.core.settle(self.offset, self.capacity)

    def read(self, cache: bool = False, nbytes: int | None = None) -> Read:
        """Starts reading the extent into a new page-locked staging buffer: directly (past the
        page cache) where the file system allows, the extent's pages dropped from memory after;
        with ``cache``, through the page cache and left there, for an extent whose parameters an
        optimizer is about to write (each write through the mapping would otherwise read its page
        from the disk first). ``nbytes``: read only the first ones (in whole 4 KiB blocks)."""
        n = self.capacity if nbytes is None else min(self.capacity, _padded(nbytes))
        buf = _arena.host_bytes(n)
        return Read(buf, self.store.core.read(buf, self.offset, n, cache), self.store)


class Read:
    """A read of an extent in flight: its staging buffer and its ticket."""

    __slots__ = ("buf", "ticket", "store")

    def __init__(self, buf: torch.Tensor, ticket: Any, store: Store) -> None:
        self.buf = buf
        self.ticket = ticket
        self.store = store

    def done(self) -> bool:
        return bool(self.ticket.done())

    def wait(self) -> torch.Tensor:
        """The staging buffer, once the bytes are there (the wait is counted in the store's
        ``disk_wait_seconds``); a failed read raises ``OSError`` naming the range and the file."""
        if not self.ticket.done():
            t0 = time.perf_counter()
            self.ticket.wait()
            self.store.wait_seconds += time.perf_counter() - t0
        else:
            self.ticket.wait()  # (raises the read's error, if it failed)
        return self.buf


def registration_order(model: torch.nn.Module, modules: Sequence[torch.nn.Module]) -> list[int]:
    """Indices of ``modules`` in the order ``model`` registers them (``model.modules()``): the
    usual order of a forward pass."""
    order = {id(m): k for k, m in enumerate(model.modules())}
    return sorted(range(len(modules)), key=lambda i: order.get(id(modules[i]), len(order)))


def grad_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes of the gradients training gives ``params`` (those that require one), in host RAM."""
    return sum(p.numel() * p.element_size() for p in params if p.requires_grad)


def choose(sizes: Sequence[int], host_budget: int) -> list[int]:
    """Which of the streamed units (their sizes, in the model's order) live on disk: the model's
    first units up to ``host_budget`` bytes stay in host RAM, the rest go to disk. The disk units
    then come last in a forward pass, so the store starts reading them while the host units run."""
    out: list[int] = []
    used = 0
    for k, n in enumerate(sizes):
        if out or used + n > host_budget:
            out.append(k)
        else:
            used += n
    return out


#: Every store alive (to find the store a parameter lives in).
_LIVE: weakref.WeakSet[Store] = weakref.WeakSet()


def store_of(t: torch.Tensor) -> Store | None:
    """The store whose mapping holds CPU tensor ``t``, if any."""
    if t.device.type != "cpu":
        return None
    for s in list(_LIVE):
        if s.holds(t):
            return s
    return None


def states_home(p: torch.Tensor) -> Store | None:
    """The store whose directory holds the optimizer states of parameter ``p`` when they live on
    disk (``offload(..., optimizer_on_disk=True)``: a disk unit's parameter, or a parameter of a
    streamed unit kept in host RAM), else None."""
    s = store_of(p)
    if s is not None:
        return s if s.optimizer_on_disk else None
    if p.device.type != "cpu":
        return None
    for s in list(_LIVE):
        r = s.host_params.get(id(p)) if s.optimizer_on_disk else None
        if r is not None and r() is p:
            return s
    return None


def hint_states(params: Iterable[torch.Tensor]) -> None:
    """The backward is about to read the weights of ``params`` for their update: where their
    optimizer states are on disk and updated during the backward (``DiskStates.in_backward``),
    they start being read ahead too."""
    for p in params:
        s = states_home(p)
        if s is None:
            continue
        for ds in list(s.states):
            if ds.in_backward and p in ds:
                ds.hint(p)


#: Pieces of parameters whose states are read into staging buffers ahead of their update.
STATES_AHEAD = 4
#: Pieces whose states (and, with a parameter's last piece, its weight) may be being written
#: back at once after their updates.
SETTLES_IN_FLIGHT = 4
#: Pieces whose states may be in staging buffers at once: read ahead, being updated, being
#: written back (host memory beyond the budget: this many times the largest piece).
STATES_IN_FLIGHT = STATES_AHEAD + 1 + SETTLES_IN_FLIGHT
#: A parameter's states move and are updated in pieces of at most about this many bytes (a
#: power of two of its elements, so that every piece of every state tensor starts on a 4 KiB
#: boundary in the file); a parameter smaller than a piece is one piece.
PIECE_BYTES = 256 << 20
#: The layout of a states extent (:func:`states_layout`), as a kept store's manifest records it.
STATES_LAYOUT = 2
#: Elements of a quantization block (one scale each), as the optimizer kernels have them.
_QBLOCK = 256


class _Tensor:
    """One state tensor of a parameter in its states extent: name, shape, dtype, its offset in
    the extent (4 KiB aligned), its bytes, and whether it holds one value per element of the
    parameter (else one per quantization block)."""

    __slots__ = ("name", "shape", "dtype", "offset", "nbytes", "size", "per_element")

    def __init__(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, offset: int, numel: int
    ) -> None:
        self.name, self.shape, self.dtype, self.offset = name, shape, dtype, offset
        self.size = torch.empty((), dtype=dtype).element_size()
        count = math.prod(shape)
        self.nbytes = count * self.size
        self.per_element = count == numel


def states_layout(
    numel: int, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]
) -> tuple[list[_Tensor], int]:
    """Where a parameter's state tensors (``specs``: name to shape and dtype) lie in its states
    extent: one after another, each starting on a 4 KiB boundary; and the extent's bytes."""
    out, total = [], 0
    for name, (shape, dtype) in specs.items():
        t = _Tensor(name, tuple(shape), dtype, total, numel)
        out.append(t)
        total += _padded(t.nbytes)
    return out, max(total, ALIGN)


def pieces(numel: int, layout: Sequence[_Tensor]) -> list[tuple[int, int]]:
    """The element ranges a parameter of ``numel`` elements is updated in: a power of two of
    elements (every piece of every tensor then starts on a 4 KiB boundary), about
    :data:`PIECE_BYTES` of states each; one piece when the layout cannot be cut (a tensor that
    is neither per element nor per block) or the parameter is small."""
    if numel == 0 or any(not t.per_element and t.nbytes != -(-numel // _QBLOCK) * t.size for t in layout):
        return [(0, numel)]
    per = sum(t.size if t.per_element else t.size / _QBLOCK for t in layout)
    # The smallest piece whose tensors' slices are whole 4 KiB blocks.
    low = max((ALIGN // t.size if t.per_element else ALIGN // t.size * _QBLOCK) for t in layout)
    c = low
    while c * 2 * per <= PIECE_BYTES and c * 2 <= (1 << 32):
        c *= 2
    if numel <= c:
        return [(0, numel)]
    return [(a, min(a + c, numel)) for a in range(0, numel, c)]


def _cut(numel: int, layout: Sequence[_Tensor]) -> list[_Piece]:
    """The pieces (:func:`pieces`) of a parameter of ``numel`` elements, with their ranges."""
    cuts = pieces(numel, layout)
    return [_Piece(a, b, numel, layout, len(cuts) == 1) for a, b in cuts]


def largest_piece(numel: int, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Staging bytes of the largest piece of a parameter of ``numel`` elements whose states are
    ``specs`` (name to shape and dtype), as :class:`DiskStates` cuts them."""
    return max(pc.nbytes for pc in _cut(numel, states_layout(numel, specs)[0]))


class _Piece:
    """Piece ``k`` of a parameter: elements ``[a, b)``, and for each state tensor the byte range
    of its slice in the extent (``start``, ``nbytes``: whole 4 KiB blocks), its place in the
    piece's staging buffer (``at``) and its elements (``count``)."""

    __slots__ = ("a", "b", "ranges", "nbytes")

    def __init__(self, a: int, b: int, numel: int, layout: Sequence[_Tensor], whole: bool) -> None:
        self.a, self.b = a, b
        self.ranges: list[tuple[_Tensor, int, int, int, int]] = []
        at = 0
        for t in layout:
            if t.per_element:
                lo, hi = a, b
            else:
                lo, hi = a // _QBLOCK, -(-b // _QBLOCK)
            start = t.offset + lo * t.size
            end = t.offset + (_padded(t.nbytes) if whole or b == numel else hi * t.size)
            # (One piece: the whole tensor, viewed in its shape; else a 1-D slice of it.)
            self.ranges.append((t, start, end - start, at, -1 if whole else hi - lo))
            at += end - start
        self.nbytes = at


class _PieceRead:
    """The reads of a piece's slices into one staging buffer."""

    __slots__ = ("buf", "tickets", "store")

    def __init__(self, buf: torch.Tensor, tickets: list[Any], store: Store) -> None:
        self.buf, self.tickets, self.store = buf, tickets, store

    def wait(self) -> torch.Tensor:
        """The staging buffer once every slice is there (the wait counted in the store's
        ``disk_wait_seconds``); a failed read raises ``OSError`` naming the range and the file."""
        t0 = time.perf_counter()
        waited = not all(t.done() for t in self.tickets)
        for t in self.tickets:
            t.wait()
        if waited:
            self.store.wait_seconds += time.perf_counter() - t0
        return self.buf


class DiskStates:
    """The optimizer states (moments, fp32 masters, compensation) of the streamed parameters of
    a model offloaded with ``optimizer_on_disk=True`` (on disk or in host RAM): one store file
    per optimizer next to the units' store, made whole at its first step (or its first
    ``load_state_dict``), one extent per parameter holding all its states, each tensor 4 KiB
    aligned (:func:`states_layout`). The optimizer's state tensors are views over the store's
    mapping (``state_dict`` and loads see them as CPU tensors), but an update does not go through
    the mapping: it runs piece by piece (:func:`pieces`, at most about :data:`PIECE_BYTES` of
    states each). :meth:`before` reads a piece's slices into a staging buffer (directly, past the
    page cache, started :data:`STATES_AHEAD` pieces ahead), the kernel updates the buffer, and
    :meth:`after` writes it back (directly), and after a parameter's last piece its new weight
    (through the units' mapping, for a disk unit), on the stores' I/O threads, while the next
    pieces run."""

    def __init__(
        self,
        params: Sequence[tuple[torch.Tensor, dict[str, tuple[tuple[int, ...], torch.dtype]]]],
    ) -> None:
        homes = [states_home(p) for p, _ in params]
        if any(h is None for h in homes):
            raise ValueError("DiskStates: every parameter must live in a store with optimizer_on_disk")
        if len({id(h) for h in homes}) > 1:
            dirs = list(dict.fromkeys(h.directory for h in homes))  # type: ignore[union-attr]
            raise ValueError(
                "ramtorch.optim: one optimizer over the parameters of several models offloaded with "
                f"optimizer_on_disk=True (their stores are in {', '.join(map(repr, dirs))}); its "
                "states would all go to one of them: use an optimizer per model"
            )
        directory = homes[0].directory  # type: ignore[union-attr]
        self._params = {id(p): p for p, _ in params}
        self.layouts: dict[int, list[_Tensor]] = {}
        sizes = []
        for p, specs in params:
            layout, size = states_layout(p.numel(), specs)
            self.layouts[id(p)] = layout
            sizes.append(size)
        self.pieces = {pid: _cut(self._params[pid].numel(), lay) for pid, lay in self.layouts.items()}
        #: The kept store (``ramtorch._keep``) the states belong to, if any: updates are journaled.
        self.kept = homes[0].kept  # type: ignore[union-attr]
        opened = False
        if self.kept is not None:
            self.store, opened = self.kept.open_states(sizes)
        else:
            self.store = Store(directory, sizes)
        self.extents = {id(p): ext for (p, _), ext in zip(params, self.store.extents)}
        self.homes = {id(p): h for (p, _), h in zip(params, homes)}
        for h in set(self.homes.values()):
            h.states.add(self)
        self.updates = 0
        # Extents still as the store made them: zeros (none, in a kept store's opened file).
        self._fresh = set() if opened else set(self.extents)
        #: The optimizer updates these parameters during the backward (``overlap="backward"``,
        #: ``pipeline=True``): their states are read ahead with their weights' backward reads.
        self.in_backward = False
        self.hints_in_backward = 0
        Key = tuple[int, int]  # (id of the parameter, its piece)
        self._order: list[Key] = []  # the pieces to update next, in order
        self._hinted: collections.deque[Key] = collections.deque()  # hinted, not yet staged
        self._journaled: dict[Key, Any] = {}  # kept store: journal writes of staged reads
        self._staged: dict[Key, _PieceRead] = {}  # reads begun ahead of their update
        self._current: dict[Key, torch.Tensor] = {}  # staging buffers of updates running
        self._writing: dict[Key, list[tuple[str, Any]]] = {}  # write-backs in flight
        self._dirty: set[int] = set()  # extents written through the mapping (made, loaded)
        self._lock = threading.Lock()
        # Held while reads ahead are begun, from the backward's hints (the compute thread) and
        # from updates (the optimizer's worker), so that together they keep to the bound.
        self._stage_lock = threading.Lock()
        self._pending: collections.deque[tuple[Key, list[tuple[str, Any]]]] = collections.deque()
        self.written_bytes = 0

    def __contains__(self, p: object) -> bool:
        return id(p) in self.extents

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    @property
    def staging_bound(self) -> int:
        """The most host memory the staging buffers of updates in flight take (see
        :data:`STATES_IN_FLIGHT`)."""
        largest = max((pc.nbytes for ps in self.pieces.values() for pc in ps), default=0)
        return STATES_IN_FLIGHT * largest

    def npieces(self, p: torch.Tensor) -> int:
        """How many pieces ``p``'s update runs in."""
        return len(self.pieces[id(p)])

    def make(self, p: torch.Tensor, zero: bool = True) -> dict[str, torch.Tensor]:
        """``p``'s states over its extent in the mapping, zero (a master is the caller's to fill);
        ``zero=False``: as they are (the caller writes every byte)."""
        pid = id(p)
        ext = self.extents[pid]
        out = {
            t.name: _arena.own_storage(ext.view(t.offset + t.nbytes)[t.offset :].view(t.dtype).view(t.shape))
            for t in self.layouts[pid]
        }
        with self._lock:
            fresh = pid in self._fresh
            self._fresh.discard(pid)
            self._dirty.add(pid)  # (the caller writes through the mapping)
            futs = []
            for key in [k for k in self._staged if k[0] == pid]:
                del self._staged[key]  # a read begun before is of the old bytes
            for key in [k for k in self._journaled if k[0] == pid]:
                futs.append(self._journaled.pop(key))
        for fut in futs:
            fut.result()  # (its read and journal write of the old bytes end before they change)
        if zero and not fresh:  # states made before (and dropped, for a load): zero again
            self.protect(p)
            for t in out.values():
                t.zero_()
        return out

    def protect(self, p: torch.Tensor) -> None:
        """In a kept store, before ``p``'s states are written through the mapping: their bytes
        as they are now go to the journal."""
        if self.kept is None:
            return
        ext = self.extents[id(p)]
        self._journal(p, [("states", ext.offset, ext.capacity, None)])

    def _journal(self, p: torch.Tensor, ranges: list[tuple[str, int, int, torch.Tensor | None]]) -> None:
        t0 = time.perf_counter()
        n = self.kept.protect_many(ranges)  # (nothing, for ranges saved since the last commit)
        spans = _engine.host_spans
        if n and spans is not None:
            spans.add(spans.DISK_WRITES, "journal", t0, time.perf_counter(), (p,), None, {"bytes": n})

    def plan(self, params: Iterable[torch.Tensor]) -> None:
        """The parameters (of this store, in order) the next updates go through: each update
        starts reading the next pieces' states."""
        with self._lock:
            self._order = [
                (id(p), k) for p in params if id(p) in self.extents for k in range(self.npieces(p))
            ]
        with self._stage_lock:
            for key in self._order[:STATES_AHEAD]:
                self._stage(key)

    def _stage(self, key: tuple[int, int]) -> None:
        """Starts reading piece ``key``'s slices into a staging buffer (after the write-back of
        the same piece, if one is in flight, and, for a first piece, the weight's, which a kept
        store journals with it; with what was written through the mapping written back
        first)."""
        pid, k = key
        with self._lock:
            if key in self._staged or key in self._current:
                return
            writing = [t for w, ts in self._writing.items() if w == key or k == 0 and w[0] == pid for t in ts]
            dirty = pid in self._dirty
            self._dirty.discard(pid)
        for _, t in writing:
            t.wait()
        ext = self.extents[pid]
        if dirty:
            ext.settle()
        piece = self.pieces[pid][k]
        buf = _arena.host_bytes(piece.nbytes, pin=False)  # (only the CPU's kernels touch it)
        core = self.store.core
        tickets = [
            core.read(buf[at : at + n], ext.offset + start, n, False) for _, start, n, at, _ in piece.ranges
        ]
        read = _PieceRead(buf, tickets, self.store)
        # A kept store: what the update will overwrite goes to the journal as soon as it is read,
        # while the updates before it run.
        fut = None if self.kept is None else self.kept.pool.submit(self._journal_staged, key, read)
        with self._lock:
            self._staged[key] = read
            if fut is not None:
                self._journaled[key] = fut

    def _journal_staged(self, key: tuple[int, int], read: _PieceRead) -> None:
        pid, k = key
        buf = read.wait()
        p = self._params[pid]
        ext = self.extents[pid]
        piece = self.pieces[pid][k]
        ranges: list[tuple[str, int, int, torch.Tensor | None]] = [
            ("states", ext.offset + start, n, buf[at : at + n]) for _, start, n, at, _ in piece.ranges
        ]
        w = p.detach()
        home = self.homes[pid]
        if k == 0 and home.holds(w):  # (the weight, once, before its first piece is updated)
            ranges.append(("units", w.data_ptr() - home.map.data_ptr(), w.numel() * w.element_size(), None))
        self._journal(p, ranges)

    def hint(self, p: torch.Tensor) -> None:
        """``p``'s weights' backward read has begun: its states are read next, once fewer than
        :data:`STATES_AHEAD` pieces wait in staging buffers."""
        with self._lock:
            for k in range(self.npieces(p)):
                if (id(p), k) not in self._hinted:
                    self._hinted.append((id(p), k))
        self.hints_in_backward += 1
        self._stage_hinted()

    def _stage_hinted(self) -> None:
        with self._stage_lock:
            while True:
                with self._lock:
                    if not self._hinted or len(self._staged) >= STATES_AHEAD:
                        return
                    key = self._hinted.popleft()
                self._stage(key)

    def before(self, p: torch.Tensor, k: int = 0) -> tuple[dict[str, torch.Tensor], tuple[int, int]]:
        """Before the update of ``p``'s piece ``k``: its states' slices in a staging buffer, once
        read (the reads of the next pieces begun), as the optimizer's state names map them, and
        the piece's element range."""
        key = (id(p), k)
        self._stage(key)
        with self._lock:
            try:
                i = self._order.index(key)
            except ValueError:
                nxt: list[tuple[int, int]] = [(id(p), j) for j in range(k + 1, self.npieces(p))]
            else:
                nxt = self._order[i + 1 :]
            read = self._staged.pop(key)
            if key in self._hinted:
                self._hinted.remove(key)
        with self._stage_lock:
            for q in nxt:
                with self._lock:
                    full = len(self._staged) >= STATES_AHEAD
                if full:
                    break
                self._stage(q)
        self._stage_hinted()
        buf = read.wait()
        with self._lock:
            fut = self._journaled.pop(key, None)
        if fut is not None:  # a kept store: what the update overwrites, in the journal first
            fut.result()  # (raises what the journal's write raised: nothing is updated then)
        with self._lock:
            self._current[key] = buf
        piece = self.pieces[id(p)][k]
        views = {}
        for t, _, _, at, count in piece.ranges:
            if count < 0:  # one piece, the whole tensor in its shape
                views[t.name] = buf[at : at + t.nbytes].view(t.dtype).view(t.shape)
            else:
                views[t.name] = buf[at : at + count * t.size].view(t.dtype)
        return views, (piece.a, piece.b)

    def after(self, p: torch.Tensor, k: int = 0) -> None:
        """After the update of ``p``'s piece ``k``: its states (the staging buffer) and, after the
        last piece, the new weight of a disk unit start being written back, on the stores' I/O
        threads, while the next pieces run; at most :data:`SETTLES_IN_FLIGHT` pieces' write-backs
        are in flight (this waits for the oldest past that). :meth:`flush` waits for all."""
        pid = id(p)
        key = (pid, k)
        ext = self.extents[pid]
        home = self.homes[pid]
        piece = self.pieces[pid][k]
        with self._lock:
            buf = self._current.pop(key)
        core = self.store.core
        tickets = [
            ("write back states", core.write(buf[at : at + n], ext.offset + start, n))
            for _, start, n, at, _ in piece.ranges
        ]
        n = 0
        last = k == len(self.pieces[pid]) - 1
        w = p.detach()
        if last and home.holds(w):  # (a weight in host RAM: updated in place, nothing to write)
            n = w.numel() * w.element_size()
            tickets.append(
                ("write back weight", home.core.settle_async(w.data_ptr() - home.map.data_ptr(), n))
            )
        with self._lock:
            self.written_bytes += piece.nbytes + n
            if last:
                self.updates += 1
            self._writing[key] = tickets
            self._pending.append((key, tickets))
            old = self._pending.popleft() if len(self._pending) > SETTLES_IN_FLIGHT else None
        if old is not None:
            self._wait(*old)

    def abandon(self, p: torch.Tensor, k: int = 0) -> None:
        """The update of ``p``'s piece ``k`` failed: its staging buffer is dropped (the extent
        holds the states of before it)."""
        with self._lock:
            self._current.pop((id(p), k), None)

    def _wait(self, key: tuple[int, int], tickets: list[tuple[str, Any]]) -> None:
        """Waits for a piece's write-backs (shown in the trace, if one is recording); raises the
        first one's error after waiting for all."""
        error: BaseException | None = None
        for _, t in tickets:
            try:
                t.wait()
            except OSError as e:
                error = error or e
        with self._lock:
            if self._writing.get(key) is tickets:
                del self._writing[key]
        spans = _engine.host_spans
        if spans is not None:
            p = self._params[key[0]]
            seen: dict[str, list[float]] = {}
            for label, t in tickets:
                times = t.times()
                if times is not None:
                    lo_hi = seen.setdefault(label, [times[0], times[1]])
                    lo_hi[0], lo_hi[1] = min(lo_hi[0], times[0]), max(lo_hi[1], times[1])
            for label, (t0, t1) in seen.items():
                spans.add(spans.DISK_WRITES, label, t0, t1, (p,), None)
        if error is not None:
            raise error

    def flush(self) -> None:
        """Waits until every write-back begun by :meth:`after` is on disk; raises ``OSError``
        (naming the range and the file) if one failed."""
        error: BaseException | None = None
        while True:
            with self._lock:
                if not self._pending:
                    break
                key, tickets = self._pending.popleft()
            try:
                self._wait(key, tickets)
            except OSError as e:
                error = error or e
        if error is not None:
            raise error

    def settle(self, p: torch.Tensor) -> None:
        """Writes ``p``'s states back and drops them from memory (after a load wrote them)."""
        self.extents[id(p)].settle()
        with self._lock:
            self._dirty.discard(id(p))
