"""Embedding tables that move the rows a lookup reads, not the table.

A *gathered* unit is an ``nn.Embedding`` streamed by rows: at each forward its indices are read
on the host (one small device→host copy, which waits for the work queued before it, unless the
indices are on the CPU already), the distinct rows they name are gathered from the host table
into a page-locked staging buffer (``torch.index_select``, on all cores) and copied to the
compute device, and the module's own forward runs on those rows with its indices remapped into
them (its ``padding_idx`` too), so ``F.embedding`` computes exactly what it computes on the whole
table. A lookup of ``B`` distinct rows moves ``B`` rows, and no device slot of the table's size
is held.

Backward: ``F.embedding``'s backward over the gathered rows is the gradient of those rows (dense,
summed over repeated indices, scaled by ``scale_grad_by_freq``, zero for ``padding_idx``). It is
copied to the host (:class:`RowGrads`, one per engine) and, at the end of the backward, added
into the rows of the table's dense ``.grad`` (zeros elsewhere, as torch writes it for
``sparse=False``; added to a ``.grad`` that exists). The zeroed table-size buffer that a fresh
``.grad`` needs is made early and off the critical path: a forward with gradients of a table
whose ``.grad`` is ``None`` has it allocated and zero-filled (on all cores) on a worker thread
(:class:`_Zeroer`) while the model computes; the end of the backward takes it (the job long
done) and writes only the rows. A table keeps at most one such buffer: unused (a ``.grad`` set
before the backward), it waits, zeroed, for the next fresh backward.

The hand-off to the optimizers is the streamed units' (``GradientHooks._delivered`` →
``DeviceEngine.grads_complete``); the engine's gradient copies and ``.grad`` writes are not
involved: :class:`RowGrads` is an engine listener (``before_finish`` writes the rows, ``drain``
drops them after an interrupted backward). Where the engine must see the whole gradient on the
device (a gradient hook on the table, ``Tensor.register_hook``; ``torch.distributed``, whose
ZeRO-2 reduces gradients on the device), the rows are scattered into a dense device gradient and
take the engine's path (``push_grad``) instead.

``max_norm`` renormalises the gathered rows in place on the device; the rows are written back into
the host table after the forward, as ``nn.Embedding`` writes its table.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .. import _arena, _config, _engine

if TYPE_CHECKING:
    from .streamer import Streamer

from .units import _Unit

#: A forward whose distinct rows take at least this fraction of the table's bytes copies the whole
#: table through a slot instead, where the slots are large enough (an offloaded model whose
#: largest other unit is larger than the table): one contiguous copy, prefetched ahead, against a
#: host gather and a copy of nearly as many bytes.
WHOLE_TABLE_FRACTION = 0.5


def ineligible(module: nn.Module) -> str | None:
    """Why ``module`` cannot stream by rows (``None`` when it can): it must be an
    ``nn.Embedding`` whose forward is ``nn.Embedding.forward`` (a subclass that computes more
    around the lookup, as scaled word embeddings do, keeps the whole-table path), holding one
    plain 2-D weight."""
    if not isinstance(module, nn.Embedding):
        return "not an nn.Embedding"
    if type(module).forward is not nn.Embedding.forward or "forward" in module.__dict__:
        return f"{type(module).__name__} has a forward of its own"
    if module.sparse:
        return "it has sparse=True"
    params = list(module.parameters())
    if len(params) != 1 or params[0] is not module.weight:
        return "holds parameters other than its weight"
    w = module.weight
    if type(w) is not nn.Parameter or w.dim() != 2 or w.layout != torch.strided:
        return "its weight is not a plain 2-D tensor"
    return None


def table_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s table (its weight)."""
    w = module.weight
    return int(w.numel()) * w.element_size()


def wanted(module: nn.Module, choice: bool | None) -> bool:
    """Whether ``module`` streams by rows: ``choice`` (``None``: when its table takes at least
    ``RAMTORCH_GATHER_MIN_BYTES``, see :func:`ramtorch._config.gather_min_bytes`), and only an
    eligible module (:func:`ineligible`)."""
    if choice is False or ineligible(module) is not None:
        return False
    return choice is True or table_bytes(module) >= _config.gather_min_bytes()


def choose(units: Sequence[_Unit], choice: bool | None) -> None:
    """Marks the units that stream by rows (``_Unit.gather``): a unit that is one embedding's own
    weight (not a container, not tied: tied weights left their units before) and
    :func:`wanted`."""
    for u in units:
        e = u.entries[0] if u.entries else None
        u.gather = (
            e is not None
            and not u.container
            and len(u.entries) == 1
            and len(u.params) == 1
            and e.owner is u.module
            and wanted(u.module, choice)
        )


def keep_resident(units: Sequence[_Unit], left: int) -> list[_Unit]:
    """The units streamed by rows that stay resident instead in ``left`` bytes of budget (what
    the other units' plan left over), largest first; their ``gather`` is cleared. A resident
    block saves its bytes every pass, a resident table only the rows it would gather: tables
    come after the other units."""
    kept = []
    for u in sorted((u for u in units if u.gather), key=lambda u: -u.nbytes):
        if u.nbytes <= left:
            u.gather = False
            kept.append(u)
            left -= u.nbytes
    return kept


# -- the indices -------------------------------------------------------------------------------------


def check_indices(ids: Any, rows: int, device: torch.device, label: str) -> None:
    """Refuses, naming ``label``, what ``nn.Embedding`` refuses: indices that are not an integer
    tensor (``RuntimeError``, as torch's); and indices on a device other than the CPU or ``device``.
    The range is checked on the host copy (:func:`host_indices`)."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{label}: indices must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in (torch.long, torch.int):
        raise RuntimeError(
            f"{label}: indices must be a tensor of torch.long or torch.int (as nn.Embedding's), "
            f"got {ids.dtype}"
        )
    dev = ids.device
    if dev.type != "cpu" and dev != device:
        raise RuntimeError(
            f"{label}: indices are on {dev} but the embedding computes on {device} (indices on the "
            "CPU are taken too, without a device→host copy)"
        )


def reads_in_place(device: torch.device, grad_wanted: bool, max_norm: float | None, on_disk: bool) -> bool:
    """Whether a lookup reads the table in place (mapped host memory, see :func:`mapped_table`)
    instead of gathering its rows on the host: on a CUDA device, when the forward needs no
    gradient of the table (a frozen table, ``torch.no_grad()``, generation), does not renormalise
    rows in place (``max_norm``) and the table is in page-locked RAM (not on disk).

    Measured on an H200 (``bench/mapped.py``, BENCHMARKS.md): ``F.embedding`` on the mapped table
    reads 512 rows of 8 KiB in 98 us and 4096 in 673, against 206 and 1086 for the host gather and
    its copy; 1 and 8 rows take 17 and 24 us against 16 and 17. And the indices never go to the
    host: the gather's device-to-host copy of them waits for the work queued before it. A lookup
    that needs the rows' gradient keeps the gather, which hands the rows to the backward."""
    return device.type == "cuda" and not grad_wanted and max_norm is None and not on_disk


def mapped_table(table: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """The host ``table`` as ``device``'s kernels read it in place (``_arena.device_view``), or
    ``None`` where its memory cannot be read so (not page-locked: the lookup then gathers)."""
    try:
        return _arena.device_view(table.detach(), device)
    except (RuntimeError, ValueError):
        return None


def host_indices(ids: torch.Tensor, rows: int, label: str) -> torch.Tensor:
    """``ids`` on the host (a copy from the device waits for the work queued before it), checked
    against the table's ``rows``: an index out of range is an ``IndexError``, as on the CPU with
    ``nn.Embedding``, naming the first bad value."""
    host = ids.detach().to("cpu")
    if host.numel():
        lo, hi = int(host.min()), int(host.max())
        if lo < 0 or hi >= rows:
            bad = lo if lo < 0 else hi
            raise IndexError(
                f"{label}: index {bad} is out of range for a table of {rows} rows (indices must be "
                f"in [0, {rows - 1}])"
            )
    return host


def distinct(host_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct rows ``host_ids`` read (int64, sorted) and ``host_ids`` remapped into them."""
    index, inverse = torch.unique(host_ids.reshape(-1).long(), sorted=True, return_inverse=True)
    return index, inverse.reshape(host_ids.shape)


@dataclass
class Lookup:
    """One forward's gathered rows: the distinct table rows read (host, sorted), the indices
    remapped into them (on the compute device), the rows on the device, and the remapped
    padding row (``None`` when the lookup does not read it)."""

    index: torch.Tensor
    remapped: torch.Tensor
    rows: torch.Tensor
    padding_idx: int | None


def lookup(
    table: torch.Tensor,
    index: torch.Tensor,
    inverse: torch.Tensor,
    device: torch.device,
    padding_idx: int | None,
) -> Lookup:
    """Gathers the rows ``index`` of ``table`` (host) into a staging buffer (page-locked when
    ``device`` is a GPU) and copies them, and the remapped indices ``inverse``, to ``device`` on
    the current stream."""
    cuda = device.type == "cuda"
    staging = torch.empty((index.numel(), table.shape[1]), dtype=table.dtype, pin_memory=cuda)
    with torch.no_grad():
        torch.index_select(table.detach(), 0, index, out=staging)
    # From page-locked memory the copy is asynchronous; torch's host allocator keeps the staging
    # buffer from reuse until the copy is done.
    rows = staging.to(device, non_blocking=True) if cuda else staging
    # Page-locked too: from pageable memory the copy would make this thread wait for the stream,
    # and the rows' copy ahead of it shares the link with the prefetches already queued.
    remapped = inverse.pin_memory().to(device, non_blocking=True) if cuda else inverse
    pad = None
    if padding_idx is not None and index.numel():
        pos = int(torch.searchsorted(index, padding_idx))
        if pos < index.numel() and int(index[pos]) == padding_idx:
            pad = pos
    return Lookup(index, remapped, rows, pad)


# -- autograd --------------------------------------------------------------------------------------


class _GatherRows(torch.autograd.Function):
    """The gathered rows of a unit's table, for its forward; backward sends their gradient (the
    rows' gradient, dense over the gathered rows) to the host rows of the table's ``.grad``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        anchor: torch.Tensor,
        unit: _Unit,
        streamer: Streamer,
        index: torch.Tensor,
        rows: torch.Tensor,
    ) -> Any:
        ctx.unit, ctx.streamer, ctx.index = unit, streamer, index
        ctx.set_materialize_grads(False)
        return rows.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> Any:  # type: ignore[override]
        ctx.streamer.rows_backward(ctx.unit, ctx.index, grad)
        return None, None, None, None, None


def gathered_rows(
    u: _Unit, streamer: Streamer, found: Lookup, param: nn.Parameter, fetch: bool, recompute: bool
) -> torch.Tensor:
    """The tensor that stands for the table in ``u``'s forward: the gathered rows through
    :class:`_GatherRows` when this forward's gradient is wanted (``fetch``), a leaf like the
    parameter in a recomputation inside backward, else the rows as they are."""
    if fetch:
        return _GatherRows.apply(u.anchor, u, streamer, found.index, found.rows)
    if recompute and torch.is_grad_enabled():
        return found.rows.detach().requires_grad_(param.requires_grad)
    return found.rows


def needs_dense(param: nn.Parameter) -> bool:
    """Whether ``param``'s gradient must reach the engine whole, on the device: it has gradient
    hooks (they see the dense gradient, as in torch), or ``torch.distributed`` runs (ZeRO-2
    reduces gradients on the device)."""
    if getattr(param, "_backward_hooks", None):
        return True
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def dense_grad(param: nn.Parameter, index: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The whole-table gradient on ``grad``'s device: ``grad``'s rows at ``index``, zeros elsewhere."""
    full = torch.zeros(tuple(param.shape), dtype=grad.dtype, device=grad.device)
    full.index_copy_(0, index.to(grad.device), grad)
    return full


# -- row gradients to the host ----------------------------------------------------------------------


def zeroed_grad(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zero arena tensor of ``shape`` and ``dtype`` for a table's ``.grad``: allocated as is and
    zero-filled by torch on all cores (the arena zeroes a recycled block on one thread)."""
    buf = _arena.host_empty(tuple(shape), dtype)
    buf.zero_()
    return buf


class _Zeroer:
    """The thread that makes zeroed gradient buffers ahead of the backwards that need them (one
    per process, started on first use; each job's ``zero_`` uses every core, so one thread). Its
    jobs' errors come back through their futures, at the end of the backward that takes them.
    A child forked after it started makes its own (the parent's thread is not in the child)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pool: ThreadPoolExecutor | None = None
        self.pid = 0
        # The jobs this process queued (a forked child's start empty).
        self.queued: weakref.WeakSet[Future[torch.Tensor]] = weakref.WeakSet()

    def submit(self, shape: Sequence[int], dtype: torch.dtype) -> Future[torch.Tensor] | None:
        """Queues the making of a zeroed ``shape``/``dtype`` buffer (:func:`zeroed_grad`);
        ``None`` once the interpreter exits (no new jobs are taken then)."""
        with self.lock:
            if self.pool is None or self.pid != os.getpid():
                # The executor's worker is not daemonic: interpreter exit waits for a job to end
                # rather than stopping the thread inside a torch kernel.
                self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ramtorch-grad-zeros")
                self.pid = os.getpid()
            try:
                job = self.pool.submit(zeroed_grad, tuple(shape), dtype)
            except RuntimeError:  # interpreter shutdown: the backward makes its buffer itself
                return None
            self.queued.add(job)
            return job

    def ours(self, job: Future[torch.Tensor]) -> bool:
        """Whether ``job`` will end in this process: done, or queued by this process (a child
        forked with a job queued has no thread to run it)."""
        return job.done() or job in self.queued

    def after_fork_in_child(self) -> None:
        """In a forked child: a fresh lock (the parent's may have been held) and no pool (its
        thread is not here); jobs the parent queued are not this process's (:meth:`ours`)."""
        self.lock = threading.Lock()
        self.pool = None
        self.queued = weakref.WeakSet()


_ZEROER = _Zeroer()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_ZEROER.after_fork_in_child)


def _words(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` (2-D) seen as 8-byte words, for copies that move bits rather than values, where its
    rows allow it (contiguous, whole words, aligned); else ``None``."""
    if t.element_size() >= 8 or not t.is_contiguous() or (t.shape[1] * t.element_size()) % 8:
        return None
    try:
        return t.view(torch.int64)
    except RuntimeError:
        return None


def copy_rows(g: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """``g[index] = rows`` for distinct ``index``, as whole words where the rows allow it (a
    copy of all the rows in one kernel)."""
    dst, src = _words(g), _words(rows)
    if dst is None or src is None:
        dst, src = g, rows
    dst.index_copy_(0, index, src)


def put_rows(g: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, fresh: bool) -> None:
    """Adds ``rows`` into the rows ``index`` (distinct) of ``g``, bit for bit what
    ``g.index_add_(0, index, rows)`` computes (NaN payloads aside). Into a ``fresh`` (zero) ``g``
    the rows are copied: each is a sum that began at +0 (as torch's embedding backward computes
    it), and ``0 + x`` is ``x``; else the rows read are summed with ``rows`` (torch's add, as
    ``index_add_``'s) and written back. Each step is one torch kernel over all the rows, which
    torch spreads over its threads; ``index_add_`` adds row after row."""
    if fresh:
        copy_rows(g, index, rows)
        return
    summed = torch.index_select(g, 0, index)
    summed.add_(rows)
    copy_rows(g, index, summed)


class RowGrads:
    """Row gradients of gathered tables on their way to the host, one per engine. They are copied
    device→host as they come (:meth:`push`) and added into ``.grad`` at the end of the backward
    (:meth:`before_finish`, called by the engine, as an engine listener); a backward that raised
    before its end leaves them here, and they are dropped (:meth:`drop_interrupted`,
    :meth:`drain`): an interrupted backward writes no ``.grad``.

    A table whose ``.grad`` is ``None`` at a forward with gradients gets its zeroed ``.grad``
    buffer made on :class:`_Zeroer`'s thread meanwhile (:meth:`prepare`); :meth:`flush` takes it.
    At most one per table is kept (in :attr:`zeros` until taken)."""

    #: Reads only its own tables' row gradients, not the engine's records of the others.
    reads_gradients = False

    def __init__(self, eng: _engine.DeviceEngine) -> None:
        self.device = eng.device
        self.counters = eng.row_counters
        # (parameter, host row index, host rows, copy event or None, pushing thread)
        self.pending: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor, Any, threading.Thread]] = []
        self.lock = threading.Lock()
        # Per table, its zeroed ``.grad`` buffer being made or made (kept while the table lives).
        self.zeros: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def prepare(self, param: nn.Parameter) -> None:
        """A forward with gradients gathered rows of ``param``: where its ``.grad`` is ``None``
        (the backward will make one), its zeroed buffer is made now, in the background, unless one
        is made or being made already."""
        if param.grad is not None:
            return
        with self.lock:
            if param in self.zeros:
                return
            job = _ZEROER.submit(tuple(param.shape), param.dtype)
            if job is not None:
                self.zeros[param] = job

    def take_zeros(self, param: nn.Parameter) -> torch.Tensor:
        """A zero buffer for ``param``'s new ``.grad``: the one :meth:`prepare` had made (waited
        for; its job's error raised here, and the job forgotten so the next forward tries again),
        or one made now."""
        with self.lock:
            job = self.zeros.get(param)
            if job is not None and not _ZEROER.ours(job):
                del self.zeros[param]
                job = None
        if job is None:
            return zeroed_grad(tuple(param.shape), param.dtype)
        try:
            buf = job.result()
        except Exception:
            with self.lock:
                if self.zeros.get(param) is job:
                    del self.zeros[param]
            raise
        # Taken only once it is ours alone: an interrupt before this line leaves it kept.
        with self.lock:
            if self.zeros.get(param) is job:
                del self.zeros[param]
        if buf.shape != param.shape or buf.dtype != param.dtype:  # the table was replaced since
            return zeroed_grad(tuple(param.shape), param.dtype)
        return buf

    def drop_zeros(self) -> None:
        """Forgets the zeroed buffers kept for later backwards (their memory goes back to the
        arena once their jobs end)."""
        with self.lock:
            self.zeros = WeakIdKeyDictionary()

    def push(self, param: nn.Parameter, index: torch.Tensor, grad: torch.Tensor) -> None:
        """Queues the copy of ``grad`` (the gradient of ``param``'s rows ``index``, distinct) to
        the host."""
        grad = grad.detach().to(dtype=param.dtype).contiguous()
        event = None
        if grad.device.type == "cuda":
            host = torch.empty(tuple(grad.shape), dtype=grad.dtype, pin_memory=True)
            host.copy_(grad, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(grad.device))
        else:
            host = grad
        with self.lock:
            self.pending.append((param, index, host, event, threading.current_thread()))
            self.counters["row_d2h_bytes"] += host.numel() * host.element_size()

    def flush(self) -> None:
        """Waits for the copies and adds the rows into the parameters' ``.grad`` (a zero ``.grad``
        made first where there is none, usually the one :meth:`prepare` had made), then runs their
        post-accumulate-grad hooks."""
        with self.lock:
            pending, self.pending = self.pending, []
        if not pending:
            return
        done: dict[int, nn.Parameter] = {}
        with torch.no_grad():
            for param, index, host, event, _ in pending:
                if event is not None:
                    event.synchronize()
                g = param.grad
                fresh = g is None
                if g is None:
                    g = _engine.host_grad(self.take_zeros(param))
                    param.grad = g
                put_rows(g, index, host, fresh)
                done[id(param)] = param
        for param in done.values():
            post = getattr(param, "_post_accumulate_grad_hooks", None)
            if post:
                for hook in list(post.values()):
                    hook(param)

    def drop_interrupted(self) -> None:
        """Outside backward: rows this thread pushed belong to a backward that raised before its
        end, and are dropped."""
        if not self.pending or torch._C._current_graph_task_id() != -1:
            return
        me = threading.current_thread()
        with self.lock:
            self.pending = [e for e in self.pending if e[4] is not me and e[4].is_alive()]

    # -- engine listener ---------------------------------------------------------------------------

    def on_grads(self, eng: _engine.DeviceEngine, params: Sequence[nn.Parameter]) -> None:
        """(Engine listener) nothing: the optimizers listen to the hand-off."""

    def reduces_grad(self, p: torch.Tensor) -> bool:
        """(Engine listener) no gradient is reduced."""
        return False

    def reduce_grad(self, p: torch.Tensor, grad: torch.Tensor) -> bool | None:
        """(Engine listener) nothing to reduce."""
        return None

    def before_finish(self, eng: _engine.DeviceEngine) -> None:
        """(Engine listener) the end of a backward on ``eng``: the rows go into ``.grad``."""
        self.flush()

    def after_finish(self) -> None:
        """(Engine listener) nothing."""

    def drain(self, interrupted: bool = False) -> None:
        """(Engine listener) after an interrupted backward the rows are dropped."""
        if interrupted:
            with self.lock:
                self.pending = []


_ROW_GRADS: weakref.WeakKeyDictionary[_engine.DeviceEngine, RowGrads] = weakref.WeakKeyDictionary()
_ROW_GRADS_LOCK = threading.Lock()


def row_grads(eng: _engine.DeviceEngine) -> RowGrads:
    """The row gradients of ``eng`` (made, and registered as its listener, on first use)."""
    rg = _ROW_GRADS.get(eng)
    if rg is None:
        with _ROW_GRADS_LOCK:
            rg = _ROW_GRADS.get(eng)
            if rg is None:
                rg = _ROW_GRADS[eng] = RowGrads(eng)
                eng.add_listener(rg)
    return rg


def drop_interrupted(eng: _engine.DeviceEngine) -> None:
    """Drops the row gradients an interrupted backward left on ``eng`` (see :class:`RowGrads`)."""
    rg = _ROW_GRADS.get(eng)
    if rg is not None:
        rg.drop_interrupted()


def prepare_grad(eng: _engine.DeviceEngine, param: nn.Parameter) -> None:
    """A forward with gradients on ``eng`` gathered rows of ``param`` for the host path: its zeroed
    ``.grad`` buffer is started now where the backward will need one (:meth:`RowGrads.prepare`)."""
    if param.grad is None and not needs_dense(param):
        row_grads(eng).prepare(param)


def drop_zeros() -> None:
    """Forgets the zeroed ``.grad`` buffers kept for later backwards, on every engine."""
    for rg in list(_ROW_GRADS.values()):
        rg.drop_zeros()
