"""Units: which parameters cross the link together, and a unit's packed host region."""

from __future__ import annotations

import enum
import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import _arena, _engine
from . import guard


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
    """Modules that stream themselves (``ramtorch.nn.Linear`` sets ``_ramtorch_streams_itself``)
    or that are units already."""
    return getattr(m, "_ramtorch_streams_itself", False) or getattr(m, "_ramtorch_unit", None) is not None


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


def _packed_bytes(params: Sequence[torch.Tensor]) -> int:
    """Bytes of the arena region :func:`ramtorch._arena.pack_mixed` makes for ``params``."""
    total = 0
    for p in params:
        total = -(-total // 64) * 64 + _arena._nbytes(p.shape, p.dtype)
    return total


class BackwardPhase(enum.Enum):
    """A streamed unit's part in the running backward pass (``_Unit.phase``).

    =========  ===========================================  =====================================
    phase      meaning                                      next
    =========  ===========================================  =====================================
    IDLE       not reached by a backward since the last     REACHED, when a gradient (or a saved
               end of backward                              tensor, or a recomputation) needs it
    REACHED    reached by the running backward; holds no    HELD once its slot is taken; IDLE at
               slot (its backward ended, or not begun)      the end of the backward
    HELD       its backward runs on slot ``_Unit.bwd``      REACHED (``Streamer.end_backward``);
                                                            IDLE at the end of the backward
    =========  ===========================================  =====================================

    A unit's forwards are ``_Unit.fwd`` (a stack: a unit may run inside itself, and a
    recomputation inside backward runs on the backward slot). See :class:`UnitState` for the whole
    picture of one unit.
    """

    IDLE = "idle"
    REACHED = "reached"
    HELD = "held"


class UnitState(enum.Flag):
    """What a streamed unit holds now (:meth:`ramtorch._stream.streamer.Streamer.unit_state`).
    ``HOME``: nothing (its weights are in host RAM, maybe still in a released slot that the next
    use reuses without a copy). ``PREFETCHED``: a copy of it was issued ahead into a slot not yet
    claimed. ``FORWARD``: a forward of it runs. ``BACKWARD``: its backward holds a slot. Between
    passes every unit is ``HOME`` or ``PREFETCHED`` (an inference pass prefetches the next one's
    first units); anything else after an interrupted pass is a leaked slot."""

    HOME = 0
    PREFETCHED = enum.auto()
    FORWARD = enum.auto()
    BACKWARD = enum.auto()


class _Unit:
    """One streamed (or resident) unit."""

    def __init__(
        self, uid: int, name: str, module: nn.Module, entries: list[tuple[nn.Module, str, nn.Parameter]]
    ):
        self.uid = uid  # index in its model
        self.tag = _engine.next_generation()  # unique in this process: names the unit in traces
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
        self.bwd: int | None = None  # the slot of its running backward (phase HELD)
        self.phase = BackwardPhase.IDLE
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
        self.gen = _engine.next_generation()  # unique across models: slot keys of one engine never collide
        guard.register(self.params)

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
        self.gen = _engine.next_generation()

    def is_home(self) -> bool:
        lay = self.layout
        if lay is None:
            return False
        for p, ptr, e in zip(self.params, self.home, lay.entries):
            if p.device.type != "cpu" or p.data_ptr() != ptr or e is None or p.dtype != e[2]:
                return False
        return True

    def key(self) -> int:
        """Names the bytes of a device copy of this unit: equal keys, equal weights (the region's
        generation and the parameters' version counters)."""
        return hash((self.gen, tuple(p._version for p in self.params))) & ((1 << 63) - 1)

    def rebind(self) -> bool:
        """Takes the module's parameters again if one was replaced since the unit was made
        (``module.weight = nn.Parameter(...)``, ``load_state_dict(assign=True)``); returns whether
        one was (the unit must then be packed again). Call it only while the unit does not run
        (its parameters are not device views). A parameter removed, or one that another streamed
        unit holds (weights tied after ``offload``), is a ``RuntimeError``."""
        params = self.params
        for e in self.entries:
            if e.owner._parameters.get(e.name) is not params[e.index]:
                break
        else:
            return False
        own = {id(p) for p in params}
        new: list[nn.Parameter] = []
        seen: dict[int, int] = {}
        entries = []
        for e in self.entries:
            p = e.owner._parameters.get(e.name)
            if p is None:
                raise RuntimeError(
                    f"ramtorch.offload: parameter {e.name!r} of unit {self.name!r} was removed after "
                    "offload; a streamed unit's parameters can be replaced, not removed"
                )
            if id(p) not in own and guard.is_streamed(p):
                raise RuntimeError(
                    f"ramtorch.offload: parameter {e.name!r} of unit {self.name!r} was replaced by a "
                    "parameter another streamed unit holds (weights tied after offload); tie the "
                    "weights before ramtorch.offload, which keeps tied weights on the device"
                )
            if id(p) not in seen:
                seen[id(p)] = len(new)
                new.append(p)
            entries.append(_Entry(e.owner, e.name, seen[id(p)]))
        self.params, self.entries = new, entries
        self.nbytes = _packed_bytes(new)
        self.reset_backward_counts()
        return True

    def forget_copies(self) -> None:
        """Device copies made so far are not trusted anymore: a new pass copies the unit again.
        Version counters do not see every write (``param.data`` edits, numpy views, raw
        pointers), so a copy made before user code ran is never taken for the current weights."""
        self.gen = _engine.next_generation()
