"""``ramtorch.offload``: any model streamed unit by unit through module hooks.

A *unit* is a module whose parameters cross the link together: by default each block of the
model's largest ``nn.ModuleList`` plus, outside those blocks, every module that holds parameters of
its own. Each streamed unit's parameters are packed into one host-arena region; they stay CPU
``nn.Parameter``s (optimizers, ``state_dict`` and ``torch.save`` see them as usual).

How a unit runs:

- **forward pre-hook**: the unit's region is in a device slot (prefetched along the learned
  itinerary, or copied now); the compute stream waits for that copy; device views of the slot
  replace the unit's parameters for the duration of its forward. With grad enabled the views come
  out of :class:`_Fetch` (whose backward sends the weight gradients to the host) and tensors saved
  for backward that point into the slot are packed as references, not kept: backward fetches the
  unit again. Inputs pass through :class:`_PostBackward`, whose backward marks the unit's backward
  as done.
- **forward post-hook** (always called, even if the forward raised): parameters restored, slot
  released after the queued kernels, and a hook on the outputs' gradients prefetches the unit for
  backward. The unit's autograd graph is walked from its outputs to find, for each weight, the
  one node that consumes it (``TBackward`` of a linear layer, say); a hook on that node sends the
  weight's gradient to the host as soon as it is computed, while the rest of the unit's backward
  runs on, and hands it to the optimizers once every forward of the step has delivered it.
  Weights used by several nodes wait for :class:`_Fetch`'s backward, at the end of the unit's.

The *itinerary* is the order in which units ran in the last forward (and the last backward); the
next pass prefetches along it, ``MAX_INFLIGHT`` copies ahead at most, and slots are evicted
farthest-next-use first (a released slot keeps its unit, so the units that end a forward pass start
the backward pass without a copy). A pass that strays from the itinerary is still correct: every
use checks the unit's key (its identity and its parameters' version counters) and copies when the
slot holds anything else; the itinerary is then relearned.
"""

from __future__ import annotations

import fnmatch
import inspect
import itertools
import math
import re
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from . import _arena, _config, _core, _engine

_GIB = 1 << 30
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9}
_UNITS.update({"t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})

#: Trace mark codes (see :mod:`ramtorch._trace`).
MARK_FWD_BEGIN, MARK_FWD_END, MARK_BWD_BEGIN, MARK_BWD_END = 1, 2, 3, 4

#: A unit's graph walk (see :meth:`Streamer._hook_weight_consumers`) gives up past this many nodes:
#: its weights' gradients then leave at the end of the unit's backward.
_WALK_LIMIT = 4096
#: Gradients handed to the optimizers as they land are batched up to this many elements (small
#: tensors such as norm weights would otherwise each be a job of their own).
_READY_BATCH = 1 << 22


def parse_bytes(value: int | float | str | None, what: str = "gpu_budget") -> int | None:
    """``None`` → ``None``; ints are bytes; strings such as ``"24GiB"``, ``"1.5 GB"``, ``"512MiB"``."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a byte count or a string such as '24GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0 or (isinstance(value, float) and not math.isfinite(value)):
            raise ValueError(f"{what} must be a non-negative byte count, got {value!r}")
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"{what}={value!r} is not a size; use bytes or a number with a unit "
                "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
            )
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise TypeError(f"{what} must be a byte count or a string such as '24GiB', got {type(value).__name__}")


def _fmt(n: int) -> str:
    return f"{n / _GIB:.2f} GiB" if n >= (1 << 28) else f"{n / (1 << 20):.1f} MiB"


# ---------------------------------------------------------------------------------------------
# Units


@dataclass
class _Entry:
    owner: nn.Module
    name: str
    index: int  # into the unit's unique parameter list


def _unit_classes(unit: Any) -> tuple[tuple[type, ...], tuple[str, ...]] | None:
    if unit is None:
        return None
    items = list(unit) if isinstance(unit, (list, tuple, set)) else [unit]
    types, names = [], []
    for u in items:
        if isinstance(u, type) and issubclass(u, nn.Module):
            types.append(u)
        elif isinstance(u, str):
            names.append(u)
        else:
            raise TypeError(f"unit= takes nn.Module classes or class names, got {u!r}")
    return tuple(types), tuple(names)


def _is_unit_class(m: nn.Module, spec: tuple[tuple[type, ...], tuple[str, ...]]) -> bool:
    types, names = spec
    return isinstance(m, types) or any(fnmatch.fnmatchcase(type(m).__name__, n) for n in names)


def _pcount(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def find_unit_roots(model: nn.Module, unit: Any) -> list[tuple[str, nn.Module]]:
    """The block modules: the outermost modules of the named classes, or the children of the
    model's largest ``nn.ModuleList`` (by parameter count)."""
    spec = _unit_classes(unit)
    if spec is not None:
        roots: list[tuple[str, nn.Module]] = []
        skip: list[str] = []
        for name, m in model.named_modules():
            if any(name.startswith(s + ".") for s in skip):
                continue
            if _is_unit_class(m, spec):
                roots.append((name, m))
                skip.append(name)
        if not roots:
            raise ValueError(f"unit={unit!r}: no module of the model matches")
        return roots
    best: tuple[int, str, nn.Module] | None = None
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) >= 2:
            n = _pcount(m)
            if n > 0 and (best is None or n > best[0]):
                best = (n, name, m)
    if best is None:
        return []
    _, lname, lst = best
    return [(f"{lname}.{k}" if lname else k, child) for k, child in lst.named_children()]


def _skip_module(m: nn.Module) -> bool:
    from .nn.linear import Linear

    return isinstance(m, Linear) or getattr(m, "_ramtorch_unit", None) is not None


def _subtree_entries(m: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    entries = []
    for sub in m.modules():
        if _skip_module(sub):
            continue
        for pname, p in sub.named_parameters(recurse=False):
            entries.append((sub, pname, p))
    return entries


def collect_units(
    model: nn.Module, unit: Any
) -> tuple[list[tuple[str, nn.Module, list[tuple[nn.Module, str, nn.Parameter]], bool]], list[nn.Parameter]]:
    """Groups the model's parameters into units. Returns ``(units, shared)``: each unit as
    ``(name, module, [(owner, param_name, param)], container)`` and the parameters used by more
    than one unit (tied weights), which stay resident on the device.

    Outside the blocks, a module that holds parameters forms a unit with everything under it,
    unless it contains blocks: then its own parameters form a *container* unit, which stays
    resident (it would hold a slot for the whole pass), and its children are visited."""
    roots = find_unit_roots(model, unit)
    root_ids = {id(m) for _, m in roots}
    units: list[tuple[str, nn.Module, list[tuple[nn.Module, str, nn.Parameter]], bool]] = []
    for name, m in roots:
        units.append((name, m, _subtree_entries(m), False))

    def visit(name: str, m: nn.Module) -> None:
        if id(m) in root_ids or _skip_module(m):
            return
        direct = [(m, pname, p) for pname, p in m.named_parameters(recurse=False)]
        has_blocks = any(id(x) in root_ids for x in m.modules())
        if not has_blocks:
            entries = _subtree_entries(m)
            if entries and (direct or not list(m.children())):
                units.append((name or "<root>", m, entries, False))
                return
        elif direct:
            units.append((name or "<root>", m, direct, True))
        for cname, child in m.named_children():
            visit(f"{name}.{cname}" if name else cname, child)

    visit("", model)
    users: dict[int, set[int]] = {}
    for k, (_, _, entries, _) in enumerate(units):
        for _, _, p in entries:
            users.setdefault(id(p), set()).add(k)
    shared: dict[int, nn.Parameter] = {}
    for _, _, entries, _ in units:
        for _, _, p in entries:
            if len(users[id(p)]) > 1:
                shared[id(p)] = p
    return units, list(shared.values())


_GENERATIONS = itertools.count(1)


def _packed_bytes(params: Sequence[torch.Tensor]) -> int:
    """Bytes of the arena region :func:`ramtorch._arena.pack_mixed` makes for ``params``."""
    total = 0
    for p in params:
        total = -(-total // 64) * 64 + _arena._nbytes(p.shape, p.dtype)
    return total


class _Unit:
    """One streamed (or resident) unit."""

    def __init__(
        self, uid: int, name: str, module: nn.Module, entries: list[tuple[nn.Module, str, nn.Parameter]]
    ):
        self.uid = uid  # index in its model
        self.tag = next(_GENERATIONS)  # unique in this process: names the unit in traces
        self.name = name
        self.module = module
        self.params: list[nn.Parameter] = []
        self.entries: list[_Entry] = []
        seen: dict[int, int] = {}
        for owner, pname, p in entries:
            if id(p) not in seen:
                seen[id(p)] = len(self.params)
                self.params.append(p)
            self.entries.append(_Entry(owner, pname, seen[id(p)]))
        self.nbytes = _packed_bytes(self.params)
        self.resident = False
        self.container = False  # holds other units: stays resident (it would hold a slot all pass)
        self.gen = 0
        self.flat: torch.Tensor | None = None
        self.layout: _engine.Layout | None = None
        self.home: list[int] = []
        # Running forwards (a unit may be called inside itself): (slot, saved-tensor hooks, slot address).
        self.fwd: list[tuple[int, Any, int]] = []
        self.bwd: int | None = None
        self.in_bwd = False
        self.anchor = torch.empty(0, requires_grad=True)
        # Weight-gradient nodes created since the last backward ended, and how many have run: when
        # they are equal every gradient of this unit for the step is on its way to the host.
        self.fetches = 0
        # Per parameter: how many forwards of the step have delivered its gradient; parameters
        # whose gradients are all delivered, not yet handed to the optimizers.
        self.delivered = [0] * len(self.params)
        self.ready: list[nn.Parameter] = []

    def pack(self) -> None:
        """Moves the parameters (and their grads) into one arena region."""
        flat, views = _arena.pack_mixed([(tuple(p.shape), p.dtype) for p in self.params])
        with torch.no_grad():
            for p, v in zip(self.params, views):
                v.copy_(p.detach())
                grad = p.grad
                p.data = v
                if grad is not None:
                    g = _arena.host_empty(tuple(p.shape), p.dtype)
                    g.copy_(grad)
                    p.grad = g
        self.flat = flat
        self.layout = _engine.Layout(flat, views)
        self.home = [v.data_ptr() for v in views]
        self.gen = next(_GENERATIONS)  # unique across models: slot keys of one engine never collide

    def reset_backward_counts(self) -> None:
        self.fetches = 0
        self.delivered = [0] * len(self.params)
        self.ready = []

    def adopt(self, flat: torch.Tensor, copy: bool) -> None:
        """Moves the unit into ``flat`` (a ``uint8`` region of at least ``nbytes``, e.g. shared
        host memory), with the same layout; ``copy`` writes the current values there first."""
        assert self.layout is not None
        views = self.layout.views(flat)
        with torch.no_grad():
            for p, v in zip(self.params, views):
                assert v is not None
                if copy:
                    v.copy_(p.detach())
                p.data = v
        self.flat = flat
        self.layout = _engine.Layout(flat, views)
        self.home = [v.data_ptr() for v in views if v is not None]
        self.gen = next(_GENERATIONS)

    def is_home(self) -> bool:
        lay = self.layout
        if lay is None:
            return False
        for p, ptr, e in zip(self.params, self.home, lay.entries):
            if p.device.type != "cpu" or p.data_ptr() != ptr or e is None or p.dtype != e[2]:
                return False
        return True

    def key(self) -> int:
        return hash((self.gen, tuple(p._version for p in self.params))) & ((1 << 63) - 1)


# ---------------------------------------------------------------------------------------------
# Autograd pieces


class _Fetch(torch.autograd.Function):
    """Device views of a unit's parameters; backward sends their gradients to the host (those not
    sent already by a hook on the node that consumed them)."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, unit: _Unit, streamer: Streamer, *views: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.unit, ctx.streamer = unit, streamer
        ctx.sent = set()  # indices whose gradient of this backward left early
        # A weight the forward did not use gets no gradient (None), as in torch, not zeros: the
        # optimizers then leave it alone instead of decaying it.
        ctx.set_materialize_grads(False)
        return tuple(v.detach() for v in views)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:  # type: ignore[override]
        ctx.streamer.weights_backward(ctx.unit, grads, ctx.sent)
        return (None, None, None) + (None,) * len(grads)


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs: its backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx: Any, unit: _Unit, streamer: Streamer, *xs: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.unit, ctx.streamer = unit, streamer
        ctx.set_materialize_grads(False)  # an input the unit did not use gets no gradient, as in torch
        return xs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:  # type: ignore[override]
        ctx.streamer.end_backward(ctx.unit)
        return (None, None) + grads


def _leaves(views: Sequence[torch.Tensor | None], params: Sequence[nn.Parameter]) -> list[Any]:
    """Device weights for a recomputation: leaves that require grad like the parameters, so the
    recomputed forward saves the same tensors as the original one (no gradient reaches them)."""
    return [v if v is None else v.detach().requires_grad_(p.requires_grad) for v, p in zip(views, params)]


class _SlotRef:
    """A saved tensor that lives in a unit's slot: re-created from the unit at unpack time."""

    __slots__ = ("dtype", "offset", "size", "stride", "unit")

    def __init__(self, unit: _Unit, t: torch.Tensor) -> None:
        self.unit = unit
        self.dtype = t.dtype
        self.offset = t.storage_offset()
        self.size = tuple(t.shape)
        self.stride = tuple(t.stride())


# ---------------------------------------------------------------------------------------------
# The streamer of one offloaded model


class Streamer:
    """Runs the units of one offloaded model on one compute device."""

    def __init__(
        self,
        model: nn.Module,
        units: list[_Unit],
        device: torch.device,
        max_inflight: int,
        slots: int,
        slot_bytes: int,
        budget: int | None,
        resident_bytes: int,
    ) -> None:
        self.model_ref = weakref.ref(model)
        self.units = units
        self.device = device
        self.max_inflight = max_inflight
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.budget = budget
        self.resident_bytes = resident_bytes
        self.eng = _engine.engine_for(device)
        if slots:
            self.eng.reserve(slot_bytes, slots)
        self.by_uid = {u.uid: u for u in units}
        self.streamed = [u for u in units if not u.resident]
        self.fwd_itin: list[int] = []
        self.bwd_itin: list[int] = []
        self.cur_fwd: list[int] = []
        self.cur_bwd: list[int] = []
        self.fwd_pos = 0
        self.bwd_pos = 0
        self.ahead: dict[int, tuple[int, int]] = {}  # uid -> (slot, key): prefetched, not claimed
        self.held = 0  # slots held by running units (forward or backward)
        self.slot_owner: dict[int, _Unit] = {}  # slot storage address -> unit using it in forward
        self.in_pass = False
        self.bwd_callback_queued = False
        self.lock = threading.RLock()
        self.counters = {"prefetches": 0, "prefetch_hits": 0, "prefetch_wasted": 0, "passes": 0}
        self.hook_handles: list[Any] = []

    # -- slots ------------------------------------------------------------------------------------

    def _free_slots(self) -> int:
        return self.slots - self.held - len(self.ahead)

    def drop_prefetched(self) -> None:
        """Releases slots prefetched but not yet used."""
        with self.lock:
            self._drop_ahead()

    def __del__(self) -> None:
        # Slots belong to the device's engine, shared with other models: give back what this
        # model's prefetches still hold.
        try:
            for slot, _ in self.ahead.values():
                self.eng.release(slot)
            self.ahead.clear()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _drop_ahead(self, uid: int | None = None) -> None:
        items = list(self.ahead.items()) if uid is None else [(uid, self.ahead[uid])]
        for k, (slot, _) in items:
            del self.ahead[k]
            self.eng.release(slot)
            self.counters["prefetch_wasted"] += 1

    def _prefetch(self, u: _Unit, key: int, keep: list[int]) -> int:
        assert u.layout is not None and u.flat is not None
        if self._free_slots() <= 0 and self.ahead:
            self._drop_ahead()
        if self._free_slots() <= 0:
            raise RuntimeError(
                f"ramtorch.offload: all {self.slots} device slots are held while unit {u.name!r} "
                "needs one (units nested deeper than the slots allow); raise gpu_budget or "
                "max_inflight"
            )
        try:
            slot, _ = self.eng.prefetch(key, u.flat, u.layout.nbytes, self.max_inflight, keep, u.tag)
        except _core.SlotsExhausted:
            # The device's slots are shared with other models and layers: ask every holder of a
            # speculative prefetch to give it back, then try once more.
            self.eng.reclaim()
            slot, _ = self.eng.prefetch(key, u.flat, u.layout.nbytes, self.max_inflight, keep, u.tag)
        return slot

    def _take(self, u: _Unit, keep: list[int]) -> int:
        """A claimed slot holding ``u``'s current weights."""
        # A pipelined optimizer step may still be writing these weights.
        _engine.wait_updates(u.params)
        if not u.is_home():
            self._drop_ahead()
            u.pack()
        key = u.key()
        hit = self.ahead.pop(u.uid, None)
        if hit is not None and hit[1] != key:
            self.eng.release(hit[0])
            self.counters["prefetch_wasted"] += 1
            hit = None
        if hit is not None:
            slot = hit[0]
            self.counters["prefetch_hits"] += 1
        else:
            slot = self._prefetch(u, key, keep)
        self.held += 1
        self.eng.claim(slot, u.tag)
        return slot

    def _give(self, slot: int) -> None:
        self.held -= 1
        self.eng.release(slot)

    def _lookahead(self, itin: list[int], pos: int) -> list[_Unit]:
        out: list[_Unit] = []
        depth = min(self.max_inflight, max(self.slots - 1, 0))
        for uid in itin[pos:]:
            if len(out) >= depth:
                break
            u = self.by_uid[uid]
            if not u.resident and u not in out:
                out.append(u)
        return out

    def _prefetch_along(self, itin: list[int], pos: int, current: _Unit | None) -> None:
        nxt = self._lookahead(itin, pos)
        keep = [u.key() for u in nxt]
        for u in nxt:
            if u is current or u.uid in self.ahead or u.fwd or u.bwd is not None:
                continue
            if self._free_slots() <= 0 or not u.is_home() or _engine.updating(u.params):
                break
            key = u.key()
            try:
                slot, _ = self.eng.prefetch(key, u.flat, u.layout.nbytes, self.max_inflight, keep, u.tag)
            except _core.SlotsExhausted:
                break  # speculative: never worth an error
            self.ahead[u.uid] = (slot, key)
            self.counters["prefetches"] += 1

    @staticmethod
    def _advance(itin: list[int], pos: int, uid: int) -> int:
        if pos < len(itin) and itin[pos] == uid:
            return pos + 1
        try:
            return itin.index(uid, pos) + 1
        except ValueError:
            return len(itin)

    # -- passes -------------------------------------------------------------------------------------

    def begin_pass(self) -> None:
        """Root forward pre-hook: a new forward pass begins."""
        if torch._C._current_graph_task_id() != -1:
            return  # a recomputation inside backward
        with self.lock:
            interrupted = self.eng.drop_interrupted()
            if self.bwd_callback_queued:
                # A backward raised before its end, so its end-of-backward callback never ran:
                # without this the next backward would not queue one, and no gradient would
                # ever reach ``.grad`` again.
                self.bwd_callback_queued = False
                self.cur_bwd = []
                interrupted = True
            if interrupted:
                for u in self.streamed:
                    u.reset_backward_counts()
            for u in reversed(self.streamed):
                # A forward interrupted by a BaseException (Ctrl-C) skips the post-hooks, which
                # torch calls on Exceptions only: its units still hold their slots.
                while u.fwd:
                    self._end_forward(u, *u.fwd.pop()[:5])
            self._release_backward()
            self.in_pass = True
            self.cur_fwd = []
            self.fwd_pos = 0

    def end_pass(self) -> None:
        if not self.in_pass:
            return
        with self.lock:
            self.in_pass = False
            self.fwd_itin = self.cur_fwd
            self.cur_fwd = []
            self.counters["passes"] += 1
            if not torch.is_grad_enabled() and self.fwd_itin:
                # Inference: passes follow one another (generation, evaluation); the first units
                # of the next pass come in while this one's last kernels run. Their keys are
                # checked when the next pass claims them.
                self._prefetch_along(self.fwd_itin, 0, None)

    # -- forward --------------------------------------------------------------------------------

    def pre_forward(self, u: _Unit, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        # Inside backward this is a recomputation (activation checkpointing): the unit's backward
        # slot serves it, and stays held until the unit's backward is done.
        recompute = torch._C._current_graph_task_id() != -1
        with self.lock:
            if recompute:
                if u.bwd is None:
                    self._begin_backward_locked(u)
                assert u.bwd is not None
                slot, own = u.bwd, False
            else:
                if self.in_pass:
                    self.cur_fwd.append(u.uid)
                    self.fwd_pos = self._advance(self.fwd_itin, self.fwd_pos, u.uid)
                    itin, pos = self.fwd_itin, self.fwd_pos
                else:
                    itin, pos = [], 0
                slot = self._take(u, [x.key() for x in self._lookahead(itin, pos)])
                own = True
                if itin:
                    self._prefetch_along(itin, pos, u)
            assert u.layout is not None
            buf = self.eng.slot(slot)
            views = u.layout.views(buf)
        self.eng.mark(u.tag, MARK_FWD_BEGIN)
        grad = torch.is_grad_enabled()
        wants = grad and not recompute and any(p.requires_grad for p in u.params)
        fetch = None
        if wants:
            u.fetches += 1
            dev = _Fetch.apply(u.anchor, u, self, *views)
            fetch = dev[0].grad_fn
            dev = [d if p.requires_grad else d.detach() for d, p in zip(dev, u.params)]
        elif recompute and grad:
            dev = _leaves(views, u.params)
        else:
            dev = views
        before = [e.owner._parameters[e.name] for e in u.entries]
        for e in u.entries:
            e.owner._parameters[e.name] = dev[e.index]  # type: ignore[assignment]
        addr = buf.untyped_storage().data_ptr()
        ctx = None
        if grad and not recompute:
            outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if outer is None:
                # Tensors saved for backward that live in the slot are kept as references.
                self.slot_owner[addr] = u
                ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                ctx.__enter__()
            # Under another saved-tensor hook (a checkpointed region) that hook decides; the
            # recomputation in backward runs on the unit's backward slot.
        u.fwd.append((slot, own, ctx, addr, before, fetch))
        if grad and not recompute:
            flat_args, _ = tree_flatten((args, kwargs))
            if any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat_args):
                args, kwargs = self._wrap_inputs(u, args, kwargs)
        return args, kwargs

    def _wrap_inputs(self, u: _Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        kws = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        if not pos and not kws:
            return args, kwargs
        outs = _PostBackward.apply(u, self, *[args[i] for i in pos], *[kwargs[k] for k in kws])
        args = list(args)
        for i, o in zip(pos, outs[: len(pos)]):
            args[i] = o
        kwargs = dict(kwargs)
        for k, o in zip(kws, outs[len(pos) :]):
            kwargs[k] = o
        return tuple(args), kwargs

    def post_forward(self, u: _Unit, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not u.fwd:
            return output  # the pre-hook failed before taking a slot
        slot, own, ctx, addr, before, fetch = u.fwd.pop()
        self._end_forward(u, slot, own, ctx, addr, before)
        self.eng.mark(u.tag, MARK_FWD_END)
        if own:
            if torch.is_grad_enabled():
                flat = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                for t in flat:
                    t.register_hook(self._pre_backward_hook(u))
                if fetch is not None:
                    self._hook_weight_consumers(u, fetch, [t.grad_fn for t in flat if t.grad_fn is not None])
        return output

    def _end_forward(self, u: _Unit, slot: int, own: bool, ctx: Any, addr: int, before: list[Any]) -> None:
        """Undoes a :meth:`pre_forward` of ``u`` (an entry popped from ``u.fwd``): saved-tensor
        hooks off, parameters back, its slot released (if it took one)."""
        if ctx is not None:
            ctx.__exit__(None, None, None)
            self.slot_owner.pop(addr, None)
        for e, t in zip(u.entries, before):
            e.owner._parameters[e.name] = t
        if own:
            with self.lock:
                self._give(slot)

    # -- weight gradients as they are computed ------------------------------------------------------

    def _hook_weight_consumers(self, u: _Unit, fetch: Any, roots: list[Any]) -> None:
        """Walks the unit's graph from its outputs down to ``fetch`` (its :class:`_Fetch` node) and
        hooks the node that consumes each weight, where exactly one does: that weight's gradient
        leaves for the host as soon as the node has run, not at the end of the unit's backward.
        The walk stops at the unit's inputs (:class:`_PostBackward`), at other units' weights and at
        leaves, and gives up past ``_WALK_LIMIT`` nodes. Not under ``torch.compile`` (a walk over
        autograd nodes is nothing to trace): compiled units send their gradients at their end."""
        if torch.compiler.is_compiling():
            return
        stop = (_PostBackward._backward_cls, _Fetch._backward_cls)
        seen: set[Any] = set()
        stack = list(roots)
        found: dict[int, list[tuple[Any, int]]] = {}
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if len(seen) > _WALK_LIMIT:
                return
            for j, (nxt, idx) in enumerate(node.next_functions):
                if nxt is None:
                    continue
                if nxt is fetch:
                    found.setdefault(idx, []).append((node, j))
                elif not isinstance(nxt, stop) and nxt.next_functions:
                    stack.append(nxt)
        for i, edges in found.items():
            if len(edges) == 1 and u.params[i].requires_grad:
                node, j = edges[0]
                node.register_hook(self._early_grad_hook(u, fetch, i, j))

    def _early_grad_hook(self, u: _Unit, fetch: Any, i: int, j: int) -> Callable[..., None]:
        def hook(grad_inputs: tuple[torch.Tensor | None, ...], _grad_outputs: Any) -> None:
            g = grad_inputs[j]
            if g is None:
                return  # not needed by this backward: _Fetch's backward does not run either
            fetch.sent.add(i)
            self.eng.push_grad(u.params[i], g, self.max_inflight, u.tag)
            self._delivered(u, i)

        return hook

    def _delivered(self, u: _Unit, i: int) -> None:
        """Parameter ``i`` of ``u`` got its gradient from one more forward of the step; once every
        forward has delivered it, it goes to the optimizers (batched: see ``_READY_BATCH``)."""
        u.delivered[i] += 1
        if u.delivered[i] != u.fetches:
            return
        u.ready.append(u.params[i])
        complete = all(n == u.fetches for n, p in zip(u.delivered, u.params) if p.requires_grad)
        if complete or sum(p.numel() for p in u.ready) >= _READY_BATCH:
            ready, u.ready = u.ready, []
            self.eng.grads_complete(ready)

    # -- saved tensors ------------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        if t.device == self.device:
            u = self.slot_owner.get(t.untyped_storage().data_ptr())
            if u is not None:
                return _SlotRef(u, t)
        return t

    def _unpack(self, obj: Any) -> torch.Tensor:
        if isinstance(obj, _SlotRef):
            return self.weight_for_backward(obj)
        return obj

    def weight_for_backward(self, ref: _SlotRef) -> torch.Tensor:
        u = ref.unit
        with self.lock:
            if u.bwd is None:
                self._begin_backward_locked(u)
            assert u.bwd is not None
            buf = self.eng.slot(u.bwd)
        return buf.view(ref.dtype).as_strided(ref.size, ref.stride, ref.offset)

    # -- backward -----------------------------------------------------------------------------

    def _pre_backward_hook(self, u: _Unit) -> Any:
        def hook(grad: torch.Tensor) -> None:
            with self.lock:
                if not u.in_bwd:
                    self._begin_backward_locked(u)

        return hook

    def _begin_backward_locked(self, u: _Unit) -> None:
        if not self.bwd_callback_queued:
            self.bwd_callback_queued = True
            self.cur_bwd = []
            self.bwd_pos = 0
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)
        first = not u.in_bwd
        u.in_bwd = True
        if first:
            self.cur_bwd.append(u.uid)
            self.bwd_pos = self._advance(self.bwd_itin, self.bwd_pos, u.uid)
        if u.bwd is None:
            u.bwd = self._take(u, [x.key() for x in self._lookahead(self.bwd_itin, self.bwd_pos)])
            self.eng.mark(u.tag, MARK_BWD_BEGIN)
            # Code that runs the unit's submodules during its backward (a checkpointed region
            # inside the unit recomputing) must find the weights on the device.
            assert u.layout is not None
            views = _leaves(u.layout.views(self.eng.slot(u.bwd)), u.params)
            for e in u.entries:
                e.owner._parameters[e.name] = views[e.index]  # type: ignore[assignment]
        self._prefetch_along(self.bwd_itin, self.bwd_pos, u)

    def weights_backward(self, u: _Unit, grads: Sequence[torch.Tensor | None], sent: set[int]) -> None:
        """:class:`_Fetch`'s backward: gradients of the unit's weights not ``sent`` already leave for
        the host."""
        for i, (p, g) in enumerate(zip(u.params, grads)):
            if i in sent:
                sent.discard(i)  # (a graph kept for another backward hooks them again)
                continue
            if not p.requires_grad:
                continue
            if g is not None:
                self.eng.push_grad(p, g, self.max_inflight, u.tag)
            self._delivered(u, i)
        self.end_backward(u)

    def end_backward(self, u: _Unit) -> None:
        with self.lock:
            if u.bwd is not None:
                self.eng.mark(u.tag, MARK_BWD_END)
                self._restore(u)
                self._give(u.bwd)
                u.bwd = None

    @staticmethod
    def _restore(u: _Unit) -> None:
        if not u.fwd:
            for e in u.entries:
                e.owner._parameters[e.name] = u.params[e.index]

    def _release_backward(self) -> None:
        for u in self.streamed:
            if u.bwd is not None:
                self._restore(u)
                self._give(u.bwd)
                u.bwd = None
            u.in_bwd = False

    def end_of_backward(self) -> None:
        with self.lock:
            self._release_backward()
            self._drop_ahead()
            self.bwd_callback_queued = False
            if self.cur_bwd:
                self.bwd_itin = self.cur_bwd
            self.cur_bwd = []
            for u in self.streamed:
                u.reset_backward_counts()
        self.eng.finish()

    # -- reporting --------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        streamed = [u for u in self.units if not u.resident]
        return {
            "device": str(self.device),
            "gpu_budget": self.budget,
            "units": len(self.units),
            "resident_units": [u.name for u in self.units if u.resident],
            "streamed_units": len(streamed),
            "resident_bytes": self.resident_bytes,
            "slot_count": self.slots,
            "slot_bytes": self.slot_bytes,
            "gpu_bytes": self.resident_bytes + self.slots * self.slot_bytes,
            "streamed_bytes_per_pass": sum(u.nbytes for u in streamed),
            "host_bytes": sum(u.nbytes for u in streamed),
            "itinerary": [self.by_uid[k].name for k in self.fwd_itin],
            **self.counters,
        }


# ---------------------------------------------------------------------------------------------
# Planning


@dataclass
class Plan:
    """Which units stay resident and how the rest stream."""

    resident: list[int]
    slots: int
    slot_bytes: int
    resident_bytes: int
    streamed_bytes: int


def _align(n: int) -> int:
    return -(-n // 64) * 64


def plan(
    sizes: Sequence[int], forced: Iterable[int], budget: int | None, max_inflight: int, forced_bytes: int = 0
) -> Plan:
    """Picks resident units for ``budget`` bytes: most bytes resident (fewest streamed per pass),
    then most slots. ``forced`` units must be resident; ``forced_bytes`` (buffers, tied weights) are
    held on the device too. Raises ``ValueError`` with the smallest budget that works."""
    forced = set(forced)
    want_slots = max_inflight + 1
    base = forced_bytes + sum(sizes[i] for i in forced)
    free = sorted((i for i in range(len(sizes)) if i not in forced), key=lambda i: -sizes[i])
    if budget is None:
        slot = _align(max((sizes[i] for i in free), default=0))
        return Plan(sorted(forced), want_slots if free else 0, slot, base, sum(sizes[i] for i in free))
    best: tuple[tuple[int, int], Plan] | None = None
    minimum: int | None = None
    for count in range(want_slots, 1, -1):
        for k in range(len(free) + 1):
            res, rest = free[:k], free[k:]
            slot = _align(sizes[rest[0]]) if rest else 0
            need = base + sum(sizes[i] for i in res) + (count * slot if rest else 0)
            if count == 2:
                minimum = need if minimum is None else min(minimum, need)
            if need > budget:
                continue
            left = budget - need
            extra = []
            for i in rest[1:]:
                if sizes[i] <= left:
                    extra.append(i)
                    left -= sizes[i]
            resident = res + extra
            streamed = sum(sizes[i] for i in rest) - sum(sizes[i] for i in extra)
            p = Plan(
                sorted(forced | set(resident)),
                count if streamed or len(rest) > len(extra) else 0,
                slot if len(rest) > len(extra) else 0,
                base + sum(sizes[i] for i in resident),
                streamed,
            )
            score = (streamed, -count)
            if best is None or score < best[0]:
                best = (score, p)
    if best is None:
        raise ValueError(
            f"gpu_budget of {_fmt(budget)} is too small for this model: it needs at least "
            f"{_fmt(minimum or base)} ({_fmt(base)} resident that cannot stream, plus two slots of "
            f"the largest streamed unit, {_fmt(_align(sizes[free[0]]) if free else 0)} each)"
        )
    return best[1]


def spread_resident(sizes: Sequence[int], resident: set[int], forced: set[int]) -> set[int]:
    """Among units of equal size (the blocks), which ones stay resident does not change the
    bytes: spread them evenly along the model's order, so each run of resident blocks is short
    and its compute overlaps the copy of the next streamed block instead of idling the link."""
    out = set(resident)
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(sizes):
        if i not in forced:
            groups.setdefault(n, []).append(i)
    for members in groups.values():
        chosen = [i for i in members if i in resident]
        if not chosen or len(chosen) == len(members):
            continue
        n, r = len(members), len(chosen)
        out -= set(chosen)
        out |= {members[min(n - 1, int((j + 0.5) * n / r))] for j in range(r)}
    return out


# ---------------------------------------------------------------------------------------------
# Entry point


def offload(
    model: nn.Module,
    gpu_budget: int | str | None = None,
    unit: Any = None,
    device: torch.device | str | int | None = None,
    *,
    max_inflight: int | None = None,
    progress: bool | None = None,
    recompute: bool | Callable[[str], bool] = False,
) -> nn.Module:
    """Keeps ``model``'s parameters in host RAM and streams them to ``device`` unit by unit.

    Args:
        model: any ``nn.Module``; changed in place and returned. Its training loop, optimizer,
            ``state_dict`` and autocast keep working; inputs go on ``device``.
        gpu_budget: bytes ramtorch may hold on the device (resident units plus streaming slots),
            as an int or a string such as ``"24GiB"``. Units that fit stay resident, the rest
            stream. ``None``: stream every unit, with ``max_inflight + 1`` slots of the largest.
            ``"auto"``: the device's free memory less a reserve for activations (a fifth, at
            least 2 GiB); the chosen plan and its predicted times are printed.
        unit: the block classes (types or class-name patterns) that form units; default: each
            child of the model's largest ``nn.ModuleList``. Modules outside the blocks that hold
            parameters are units of their own.
        device: compute device; default the current CUDA device, or CPU without CUDA.
        max_inflight: copies in flight (default ``RAMTORCH_MAX_INFLIGHT``/``MAX_INFLIGHT``, else 2).
        progress: show a progress bar while moving weights into host RAM (default: for models
            over 1 GiB).
        recompute: backward mode of the streamed units: ``False`` keeps their activations for
            backward; ``True`` (or a predicate on the unit's name) recomputes the unit's forward in
            backward instead (activation checkpointing, non-reentrant, with the RNG state of the
            forward restored, so dropout draws the same mask). The recomputation runs on the
            weights fetched for the unit's backward: it costs compute, not PCIe bytes.

    Parameters shared by several units (tied weights), parameters of modules that contain other
    units, and buffers stay on the device and count against the budget.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"ramtorch.offload: model must be an nn.Module, got {type(model).__name__}")
    if getattr(model, "_ramtorch_streamer", None) is not None:
        raise RuntimeError("ramtorch.offload: this model is already offloaded")
    inflight = _config.max_inflight(max_inflight)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = _engine.normalize_device(device)
    auto = isinstance(gpu_budget, str) and gpu_budget.strip().lower() == "auto"
    budget = _auto_budget(dev) if auto else parse_bytes(gpu_budget)
    for name, p in model.named_parameters():
        if p.device.type == "meta":
            raise ValueError(f"ramtorch.offload: parameter {name!r} is on the meta device (no data to keep)")
    for name, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad:
            raise ValueError(
                f"ramtorch.offload: {name or 'the model'} is an {type(m).__name__} with sparse=True; "
                "streamed weights take dense gradients only: build it with sparse=False"
            )

    raw_units, shared = collect_units(model, unit)
    units = [_Unit(k, name, m, entries) for k, (name, m, entries, _) in enumerate(raw_units)]
    shared_ids = {id(p) for p in shared}
    for u, raw in zip(units, raw_units):
        u.container = raw[3]
        # Tied parameters stay resident: drop them from the streamed unit.
        keep = [i for i, p in enumerate(u.params) if id(p) not in shared_ids]
        if len(keep) != len(u.params):
            remap = {old: new for new, old in enumerate(keep)}
            u.entries = [_Entry(e.owner, e.name, remap[e.index]) for e in u.entries if e.index in remap]
            u.params = [u.params[i] for i in keep]
            u.nbytes = _packed_bytes(u.params)
    units = [u for u in units if u.params]
    for k, u in enumerate(units):
        u.uid = k
    buffers = [b for b in model.buffers()]
    fixed = sum(_arena._nbytes(p.shape, p.dtype) for p in shared)
    fixed += sum(_arena._nbytes(b.shape, b.dtype) for b in buffers)
    pl = plan(
        [u.nbytes for u in units], [k for k, u in enumerate(units) if u.container], budget, inflight, fixed
    )
    resident_ids = spread_resident(
        [u.nbytes for u in units], set(pl.resident), {k for k, u in enumerate(units) if u.container}
    )

    total = sum(u.nbytes for u in units)
    show = progress if progress is not None else total > _GIB
    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="ramtorch.offload", leave=False)
    with torch.no_grad():
        for p in shared:
            p.data = p.data.to(dev)
        for mod in model.modules():
            for bname, b in mod._buffers.items():
                if b is not None:
                    mod._buffers[bname] = b.to(dev)
        for u in units:
            if u.uid in resident_ids:
                u.resident = True
                for p in u.params:
                    p.data = p.data.to(dev)
                    if p.grad is not None:
                        p.grad = p.grad.to(dev)
            else:
                u.pack()
            if bar is not None:
                bar.update(u.nbytes)
    if bar is not None:
        bar.close()

    if auto:
        _report_auto_plan(model, units, pl, budget, dev)
    if recompute:
        wants = recompute if callable(recompute) else (lambda name: True)
        for u in units:
            if not u.resident and wants(u.name):
                _checkpoint_forward(u.module)
    streamer = Streamer(model, units, dev, inflight, pl.slots, pl.slot_bytes, budget, pl.resident_bytes)
    handles = streamer.hook_handles
    handles.append(
        model.register_forward_pre_hook(
            lambda m, a, k: _check_kv_cache(k) or streamer.begin_pass(), with_kwargs=True
        )
    )
    handles.append(model.register_forward_hook(lambda m, a, o: streamer.end_pass(), always_call=True))
    for u in units:
        if u.resident:
            continue
        u.module._ramtorch_unit = u  # type: ignore[assignment]
        handles.append(
            u.module.register_forward_pre_hook(
                lambda m, a, k, u=u: streamer.pre_forward(u, m, a, k), with_kwargs=True
            )
        )
        handles.append(
            u.module.register_forward_hook(
                lambda m, a, k, o, u=u: streamer.post_forward(u, m, a, k, o),
                with_kwargs=True,
                always_call=True,
            )
        )
    # A pipelined optimizer step may still be writing the weights that state_dict() hands out.
    params = [p for u in units for p in u.params]
    handles.append(model.register_state_dict_pre_hook(lambda *_: _engine.wait_updates(params)))
    model._ramtorch_streamer = streamer  # type: ignore[assignment]
    if type(model)._apply is nn.Module._apply:
        model._apply = _guarded_apply(model, streamer)  # type: ignore[method-assign]
    # Copies would share (deepcopy: fail on) the engine, the hooks and the units of this model;
    # a class that says how to copy or pickle itself (ramtorch.nn's layers) keeps its way.
    cls = type(model)
    if not hasattr(cls, "__deepcopy__"):
        model.__deepcopy__ = _refuse_copy  # type: ignore[method-assign]
    pickling = (cls.__reduce_ex__, cls.__reduce__, cls.__getstate__)
    if pickling == (object.__reduce_ex__, object.__reduce__, nn.Module.__getstate__):
        model.__reduce_ex__ = _refuse_copy  # type: ignore[method-assign]
    _report_compute_device(model)
    _STREAMERS.add(streamer)
    streamer.eng.add_holder(streamer)
    return model


_DEVICE_VIEWS: dict[type, type] = {}


def _racy_offloaded_cache(cache: Any) -> bool:
    """Whether ``cache`` is a transformers KV cache that lives in host RAM (``offloading``, as
    ``cache_implementation="offloaded"`` makes) from a transformers release before 5.20. Those
    prefetch a layer's keys and values on a side stream without waiting for the copies of an
    earlier layer back to the host, whose device memory the prefetch may then reuse: when the
    GPU runs behind the host, as it does while weights stream in, the cache is silently
    corrupted (transformers 5.20 added the wait)."""
    if getattr(cache, "offloading", False) is not True or not hasattr(cache, "prefetch_stream"):
        return False
    module = sys.modules.get("transformers")
    version = getattr(module, "__version__", "")
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) < (5, 20)


def _check_kv_cache(kwargs: dict[str, Any]) -> None:
    """Refuses a KV cache that streaming would corrupt (see :func:`_racy_offloaded_cache`)."""
    for key in ("past_key_values", "cache"):
        if _racy_offloaded_cache(kwargs.get(key)):
            version = getattr(sys.modules.get("transformers"), "__version__", "?")
            raise RuntimeError(
                f"ramtorch: the KV cache in host RAM of transformers {version} "
                '(cache_implementation="offloaded") has a stream race that corrupts the cache '
                "when the GPU runs behind the host, as it does while weights stream: upgrade to "
                "transformers 5.20 or later, or keep the KV cache on the GPU"
            )


def _report_compute_device(model: nn.Module) -> None:
    """Models with a ``device`` property that reads their first parameter (transformers'
    ``PreTrainedModel``) would report "cpu" once the weights live in host RAM, and
    ``generate()`` would then move its inputs there. Such a model gets a subclass of its own class
    whose ``device`` is the compute device (``detach_streamer`` restores the class)."""
    cls = type(model)
    if not isinstance(inspect.getattr_static(cls, "device", None), property):
        return
    view = _DEVICE_VIEWS.get(cls)
    if view is None:
        base = inspect.getattr_static(cls, "device")

        def device(self: nn.Module) -> torch.device:
            streamer = self.__dict__.get("_ramtorch_streamer")
            return streamer.device if streamer is not None else base.fget(self)

        view = type(
            cls.__name__,
            (cls,),
            {"device": property(device), "__module__": cls.__module__, "__qualname__": cls.__qualname__},
        )
        view._ramtorch_base_class = cls  # type: ignore[attr-defined]
        _DEVICE_VIEWS[cls] = view
    model.__class__ = view


def _auto_budget(dev: torch.device) -> int:
    """``gpu_budget="auto"``: the device's free memory, less a reserve for activations and the
    caching allocator's slack (a fifth of it, at least 2 GiB)."""
    if dev.type != "cuda":
        raise ValueError("gpu_budget='auto' needs a CUDA device (on CPU there is nothing to budget)")
    free, _ = torch.cuda.mem_get_info(dev)
    return max(0, free - max(2 * _GIB, free // 5))


def _report_auto_plan(model: nn.Module, units: list[_Unit], pl: Plan, budget: int, dev: torch.device) -> None:
    """Prints the plan ``gpu_budget="auto"`` chose, with the predicted pass time (``ramtorch.plan``)."""
    import sys

    from . import plan as _plan

    pred = _plan.predict(model, budget, 4096)
    resident = sum(1 for u in units if u.resident)
    print(
        f"ramtorch.offload(gpu_budget='auto') on {dev}: budget {_fmt(budget)}, {resident} of {len(units)} "
        f"units resident ({_fmt(pl.resident_bytes)}), {pl.slots} slots of {_fmt(pl.slot_bytes)}, "
        f"{_fmt(pl.streamed_bytes)} streamed per pass; predicted at 4096 tokens: forward "
        f"{pred.forward_seconds * 1e3:.0f} ms, forward+backward {pred.forward_backward_seconds * 1e3:.0f} ms "
        "(python -m ramtorch plan for other shapes)",
        file=sys.stderr,
    )


def _checkpoint_forward(module: nn.Module) -> None:
    """Runs ``module``'s forward under non-reentrant activation checkpointing (inside the unit's
    hooks, so the recomputation finds the weights the unit's backward fetched)."""
    from torch.utils.checkpoint import checkpoint

    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward  # type: ignore[method-assign]


def _refuse_copy(*_: Any) -> Any:
    """``copy.deepcopy``, ``copy.copy`` and pickling (``torch.save(model)``) of an offloaded model."""
    raise TypeError(
        "ramtorch.offload: an offloaded model cannot be copied or pickled (its hooks and host memory "
        "belong to this process's streaming engine). Copy its weights instead: build a fresh model, "
        "load this one's state_dict() into it (or use ramtorch.save_checkpoint / load_checkpoint), "
        "and offload the copy if it should stream too."
    )


def _guarded_apply(model: nn.Module, streamer: Streamer) -> Any:
    """``model.to()``/``.cuda()``/``.half()`` after offload: moving to the compute device is a
    no-op (streamed weights stay in RAM, the rest is there already); anything else is refused
    rather than silently pulling the host parameters onto a device."""
    ref = weakref.ref(model)

    def _apply(fn: Any, recurse: bool = True) -> nn.Module:
        m = ref()
        dtype = next((p.dtype for p in m.parameters()), torch.float32) if m is not None else torch.float32
        probe = fn(torch.empty(0, dtype=dtype))
        same = probe.dtype == dtype and probe.device.type == streamer.device.type
        if same and probe.device.type == "cuda":
            same = (probe.device.index or torch.cuda.current_device()) == streamer.device.index
        if not same:
            raise RuntimeError(
                f"ramtorch.offload: this model streams to {streamer.device} with its weights in host "
                f"RAM; it cannot be moved or converted to {probe.device}/{probe.dtype} afterwards. "
                "Convert the model before calling ramtorch.offload (device= picks where it computes)."
            )
        return m  # type: ignore[return-value]

    return _apply


def detach_streamer(model: nn.Module) -> None:
    """Removes ``model``'s streaming hooks (its parameters stay where they are)."""
    streamer = getattr(model, "_ramtorch_streamer", None)
    if streamer is None:
        return
    streamer.eng.synchronize()
    for name in ("_apply", "__deepcopy__", "__reduce_ex__"):
        model.__dict__.pop(name, None)
    for h in streamer.hook_handles:
        h.remove()
    for u in streamer.units:
        if getattr(u.module, "_ramtorch_unit", None) is u:
            del u.module._ramtorch_unit
    _STREAMERS.discard(streamer)
    streamer.eng.remove_holder(streamer)
    model._ramtorch_streamer = None
    base = type(model).__dict__.get("_ramtorch_base_class")
    if base is not None:
        model.__class__ = base


_STREAMERS: weakref.WeakSet[Streamer] = weakref.WeakSet()


def streamers() -> list[Streamer]:
    """Live offloaded models' streamers."""
    return list(_STREAMERS)
