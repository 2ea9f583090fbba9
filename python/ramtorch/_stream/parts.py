"""A large unit computed by parts as its copy lands.

A unit's compute waits for its whole copy. When one unit holds most of a model's bytes (a ResNet's
third stage: 78% of them), the compute waits that long with nothing to do, and what follows the
last byte is that unit's whole compute. So a unit of at least ``MIN_BYTES`` made of torch's own
layers (:data:`TRUSTED`, with their own forwards) is copied in parts, cut at its layers'
boundaries in the order its bytes lie (the engine's ``prefetch(parts=...)``, an event after each
part), and each layer's forward waits only for the part that holds its weights (``claim_part``,
from a pre-hook on the layer). The first layers compute while the last ones cross. What each layer
computes is unchanged: the same op on the same bytes.

This holds only if nothing reads a layer's weights outside that layer's forward: a module around
the layers that calls ``F.conv2d(x, self.conv.weight)`` would read bytes that have not landed. So
the first forward of the unit in each mode (training, evaluation) waits for the whole copy and
runs under a ``TorchFunctionMode`` (:class:`Guard`) that sees each op given one of the unit's
weights; the unit is cut from its next forward in that mode on only if each such op ran inside
that weight's layer. (Watching every forward costs the host a Python call per op, which made a
ResNet's pass slower than the whole copy.) In a cut forward each layer's weights become the
slot's only in that layer's pre-hook, after its part is waited for: before, they are the host's,
so a read that the watched forward did not see (a branch taken later) gets the host's bytes or
fails on their device, never bytes that have not landed. Not cut either: a forward inside
another torch function mode, a recomputation, a unit whose layers carry other forward hooks or a
forward of their own (they may read the weights before ours waits), a unit streamed in a codec
that decodes only whole (none of ``compress=``'s: both decode part by part, each part once the
encoded bytes it reads have crossed), and a process that has compiled anything with
``torch.compile`` (a graph may read the weights without the layers' hooks in between).

The layer whose bytes come last in a cut unit, where it is a large ``nn.Linear``, is cut further
into blocks of its rows (``Plan.rows``, the blocks of :mod:`.rows`): its forward computes each
block of the output's columns once that block's rows have landed, so what follows the last byte
of a unit that ends the pass (an MLP block: W1's) is one block's product.

Only three kinds of unit are cut (:func:`wanted`): one that holds several times the mean bytes of
its model's streamed units (:data:`DOMINANCE`), the one that ends the forward pass (what follows
the pass's last byte is then its last part's compute, not all of it), and the large streamed unit
computed before that one (:func:`before_end`). That last one matters where a unit's compute is
near its copy's time (a unit streamed in fp8 crosses in half the time of its raw bytes): whole,
it starts computing only once its last byte has landed, and the last unit's compute then waits
for it after the link has gone quiet (W1 in fp8: 1.2 ms of a 72 ms pass). Elsewhere, where units
are alike, each one's copy lands while the one before computes and a cut gains nothing. A
ResNet's forward on an H200 took 40.4 ms cut against 47.1 ms whole (BENCHMARKS.md).
``RAMTORCH_UNIT_PARTS_MIN_BYTES`` (bytes, or a size such as ``"64MiB"``; ``"off"``) sets the least
size of a unit that is cut.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .. import _config
from . import rows

if TYPE_CHECKING:
    from .units import _Unit

#: A unit of at least this many bytes may be copied and computed by parts; ``None``: the
#: environment's ``RAMTORCH_UNIT_PARTS_MIN_BYTES``, else 64 MiB (see the module's docstring).
MIN_BYTES: int | None = None
#: A unit is cut only where it holds at least this many times the mean bytes of its model's
#: streamed units. Where units are alike (a transformer's layers), each one's copy lands while
#: the one before computes and a cut gains nothing; where one holds most of the bytes (a ResNet's
#: third stage), the compute before it ends long before its copy does.
DOMINANCE = 2.0
#: Each part holds at least this many bytes (several layers where they are small).
MIN_PART_BYTES = 16 << 20
#: A unit's copy is cut in at most this many parts. Each part is a copy and an event that the
#: host queues, in the pre-hook of an earlier unit (ahead of its kernels): a ResNet stage of
#: 1.3 GB in 72 parts held the host 7.35 ms there (an H200, events with blocking sync then).
MAX_PARTS = 16
#: Layers whose forward reads their own parameters and nothing else's (exactly these classes, or
#: subclasses that keep their forward).
TRUSTED: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.LayerNorm,
    nn.GroupNorm,
)


class Plan:
    """How a unit is cut: the byte offsets where its copy's parts end (all but the last), what
    each layer's forward waits for (by ``id`` of the layer), and the modes (training or not) in
    which a forward read a weight outside its layer (never cut again)."""

    __slots__ = ("parts", "upto", "owners", "binds", "rows", "refused", "watched")

    def __init__(
        self,
        parts: list[int],
        upto: dict[int, int],
        owners: list[nn.Module],
        binds: dict[int, list[tuple[str, int]]],
        by_rows: dict[int, rows.Blocks] | None = None,
    ) -> None:
        self.parts = parts
        self.upto = upto
        self.owners = owners
        self.binds = binds  # id of a layer -> (name, index into the unit's weights) of its own
        # id of a layer (the unit's last, a large Linear) -> its blocks of rows (.rows)
        self.rows = by_rows or {}
        self.refused: set[bool] = set()
        self.watched: set[bool] = set()  # modes whose first forward was watched and clean


def _trusted(m: nn.Module) -> bool:
    return any(isinstance(m, base) and type(m).forward is base.forward for base in TRUSTED)


def plan_of(u: _Unit) -> Plan | None:
    """``u``'s cut (kept while its layout is), or ``None`` where it goes whole."""
    return u.per_layout("parts", _cut)


def _cut(u: _Unit) -> Plan | None:
    layout = u.layout
    assert layout is not None
    nbytes = layout.nbytes
    least = MIN_BYTES if MIN_BYTES is not None else _config.unit_parts_min_bytes()
    if least is None or u.tree is not None or not rows.decodes_by_parts(u) or u.gather or nbytes < least:
        return None
    ends: dict[int, int] = {}
    owners: dict[int, nn.Module] = {}
    binds: dict[int, list[tuple[str, int]]] = {}
    spans: dict[tuple[int, str], tuple[int, int]] = {}
    for e in u.entries:
        entry = layout.entries[e.index]
        if entry is None or not _trusted(e.owner):
            return None
        off, shape, dtype = entry
        n = dtype.itemsize
        for s in shape:
            n *= s
        key = id(e.owner)
        owners[key] = e.owner
        ends[key] = max(ends.get(key, 0), off + n)
        binds.setdefault(key, []).append((e.name, e.index))
        spans[(key, e.name)] = (off, off + n)
    if len(owners) < 2:
        return None
    least = max(MIN_PART_BYTES, -(-nbytes // MAX_PARTS))
    parts: list[int] = []
    start = 0
    for end in sorted(set(ends.values())):
        if end - start >= least and end < nbytes:
            parts.append(end)
            start = end
    # The layer whose bytes come last, where it is a large Linear, is also computed by blocks of
    # rows as they land (.rows): in the unit that ends a pass (W1's block, an MLP) what follows
    # the last byte is then one block's product, not the layer's.
    last = max(ends, key=lambda k: ends[k])
    by_rows: dict[int, rows.Blocks] = {}
    m, w = owners[last], spans.get((last, "weight"))
    own = {n for n, _ in binds[last]}
    if type(m) in (nn.Linear, rows.RowsLinear) and w is not None and own <= {"weight", "bias"}:
        bias = spans.get((last, "bias"))
        blocks = rows.row_blocks(w, m.weight.shape[0], bias[1] if bias and bias[0] > w[0] else 0)
        if blocks is not None:
            by_rows[last] = rows.Blocks(blocks, [])
            lo = parts[-1] if parts else 0
            parts += sorted({b[2] for b in blocks if lo < b[2] < nbytes})
    if not parts:
        return None
    upto = {k: next((p for p in parts if p >= end), nbytes) for k, end in ends.items()}
    return Plan(parts, upto, list(owners.values()), binds, by_rows)


def wanted(u: _Unit) -> bool:
    """Whether a cut of ``u`` gains anything: it holds several times the mean bytes of its model's
    streamed units (the compute before it ends long before its copy does), it ends the forward
    pass (what it computes after the pass's last byte is then one part's share, not its whole),
    or it is the large unit computed before that one (:func:`before_end`)."""
    return u.ends_forward or u.before_end or u.nbytes >= DOMINANCE * u.mean_unit_bytes


def before_end(itin: list[int], by_uid: dict[int, _Unit]) -> _Unit | None:
    """The streamed unit computed last before the unit that ends the forward pass ``itin`` (uids
    in the order the pass ran them), skipping units too small to cut (a final norm) and those that
    do not stream (resident, gathered); ``None`` if there is none."""
    least = MIN_BYTES if MIN_BYTES is not None else _config.unit_parts_min_bytes()
    if least is None or not itin:
        return None
    last = itin[-1]
    for uid in reversed(itin[:-1]):
        u = by_uid.get(uid)
        if u is None or uid == last or u.resident or u.gather:
            continue
        if u.nbytes >= least:
            return u
    return None


def copy_parts(u: _Unit) -> list[int]:
    """Byte offsets where ``u``'s copy is cut into parts (none for a unit that goes whole)."""
    p = plan_of(u)
    return [] if p is None or not wanted(u) else p.parts


def compiled_anything() -> bool:
    """Whether this process has compiled a frame with ``torch.compile`` (whose graphs may read a
    unit's weights without running the layers' hooks in between)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return utils is not None and utils.counters["frames"].get("total", 0) > 0


def _hooks_are_ours(m: nn.Module) -> bool:
    return len(m._forward_pre_hooks) == 1 and len(m._forward_hooks) == 1 and "forward" not in m.__dict__


def by_parts(u: _Unit, module: nn.Module) -> tuple[Plan, bool] | None:
    """``(plan, watch)`` when ``u``'s forward now runs by parts (``watch``: this forward waits for
    the whole copy and is watched), else ``None``."""
    p = plan_of(u)
    if p is None or not u.parts_handles or not wanted(u):
        return None
    if u.fwd or compiled_anything() or torch._C._is_torch_function_mode_enabled():
        return None
    mode = bool(getattr(module, "training", False))
    if mode in p.refused:
        return None
    hooks = nn.modules.module
    if hooks._global_forward_pre_hooks or hooks._global_forward_hooks:
        return None
    if not _hooks_are_ours(module) or not all(_hooks_are_ours(m) for m in p.owners):
        return None
    return p, mode not in p.watched


def _tensors(x: Any) -> Any:
    """The tensors in an op's arguments (inside lists, tuples and dicts)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


class Guard(TorchFunctionMode):
    """Watches a unit's first forward in a mode: whether each op given one of the unit's weights
    runs inside that weight's layer (the innermost of the unit's layers whose forward is
    running)."""

    def __init__(self, weights: dict[int, set[int]]) -> None:
        super().__init__()
        self.weights = weights  # id of a weight tensor -> ids of the layers that own it
        self.stack: list[int] = []  # ids of the unit's layers whose forward is running
        self.clean = True

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.clean:
            for t in _tensors((args, kwargs)):
                owners = self.weights.get(id(t))
                if owners is not None and (not self.stack or self.stack[-1] not in owners):
                    self.clean = False
                    break
        return func(*args, **kwargs)
