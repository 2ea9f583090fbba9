"""Units: which parameters cross the link together, and a unit's packed host region."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import fnmatch
import functools
import operator
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .. import _arena, _codec, _config, _disk, _engine
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


def _block_list(m: nn.Module) -> bool:
    """Whether ``m`` holds a model's blocks: an ``nn.ModuleList`` of at least two modules, or an
    ``nn.Sequential`` whose children that hold parameters are at least two, all of one class
    (torchvision's ViT ``encoder.layers``, the stages of Swin, ConvNeXt and ResNet). A
    ``Sequential`` of mixed layers (``Conv2d``, ``BatchNorm2d``, ...) is a small network, not a
    list of blocks."""
    if isinstance(m, nn.ModuleList):
        return len(m) >= 2
    if type(m) is not nn.Sequential:
        return False
    kinds = [type(c) for c in m.children() if any(True for _ in c.parameters())]
    return len(kinds) >= 2 and len(set(kinds)) == 1


def _within(name: str, outer: str) -> bool:
    """Whether the module named ``name`` is ``outer`` or lies inside it (``""``: the model)."""
    return not outer or name == outer or name.startswith(outer + ".")


def _block_lists(model: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """The lists of blocks (see :func:`_block_list`) in ``model`` that hold parameters, as
    ``(parameter count, name, module)``, largest first, none inside another one taken before it:
    the largest, then every other one outside it (an encoder-decoder's two stacks)."""
    found = sorted(
        ((_pcount(m), name, m) for name, m in model.named_modules() if _block_list(m)), key=lambda x: -x[0]
    )
    taken: list[tuple[int, str, nn.Module]] = []
    for n, name, m in found:
        if n > 0 and not any(_within(name, t) or _within(t, name) for _, t, _ in taken):
            taken.append((n, name, m))
    return taken


def find_unit_roots(model: nn.Module, unit: Any) -> list[tuple[str, nn.Module]]:
    """The block modules: the outermost modules of the named classes, or by default the children
    of the model's lists of blocks (an ``nn.ModuleList``, or an ``nn.Sequential`` of blocks of one
    class: see :func:`_block_list`): the largest list (by parameter count) and every other list
    outside it (an encoder-decoder's encoder and decoder). A block that holds most of the weights
    (a ResNet's third stage) stays one unit: split into its small blocks, copies of a few MiB
    each, its stream would wait on the latency of each copy (a measured ResNet-152x4 ran at
    0.54 of the link limit so, against 0.71 whole)."""
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
    roots = [
        (f"{lname}.{k}" if lname else k, child)
        for _, lname, lst in _block_lists(model)
        for k, child in lst.named_children()
    ]
    return roots


def repeated_block_class(module: nn.Module) -> tuple[str, int] | None:
    """The class of the blocks inside ``module`` that could each be a unit: among classes of
    which at least two instances holding parameters are siblings (children of one module), the
    one whose outermost instances hold the most parameters. Returns ``(class name, number of
    outermost instances)``, or ``None`` when ``module`` repeats nothing."""
    candidates: set[type] = set()
    for m in module.modules():
        seen: dict[type, int] = {}
        for c in m.children():
            if any(True for _ in c.parameters()):
                seen[type(c)] = seen.get(type(c), 0) + 1
        candidates.update(t for t, n in seen.items() if n >= 2)
    best: tuple[int, str, int] | None = None
    for cls in candidates:
        outer: list[nn.Module] = []
        inside: set[int] = set()
        for m in module.modules():
            if type(m) is cls and id(m) not in inside:
                outer.append(m)
                inside.update(id(x) for x in m.modules())
        if len(outer) < 2:
            continue
        n = sum(_pcount(m) for m in outer)
        if best is None or n > best[0]:
            best = (n, cls.__name__, len(outer))
    return None if best is None else (best[1], best[2])


def unit_hint(units: Sequence[tuple[str, nn.Module, int]]) -> str | None:
    """A sentence naming the ``unit=`` that splits the largest of ``units`` (``(name, module,
    bytes)`` of the units that may stream) when it holds most of their bytes and repeats a block
    class inside: one unit that big leaves nothing to stream past it. ``None`` otherwise."""
    total = sum(n for _, _, n in units)
    if not units or total <= 0:
        return None
    name, module, nbytes = max(units, key=lambda u: u[2])
    if nbytes * 2 <= total:
        return None
    found = repeated_block_class(module)
    if found is None:
        return None
    cls, count = found
    return (
        f"unit {name!r} holds {100 * nbytes // total}% of the weights and streams as one piece; "
        f"unit={cls!r} (offload(..., unit={cls!r}), or --unit {cls} in python -m ramtorch plan) "
        f"makes each of its {count} {cls} modules a unit"
    )


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
    model: nn.Module, unit: Any, budget: int | None = None
) -> tuple[list[tuple[str, nn.Module, list[tuple[nn.Module, str, nn.Parameter]], bool]], list[nn.Parameter]]:
    """Groups the model's parameters into units. Returns ``(units, shared)``: each unit as
    ``(name, module, [(owner, param_name, param)], container)`` and the parameters that stay
    resident on the device instead of streaming with their unit: those used by more than one unit
    (tied weights), a unit's trainable parameters when the rest of it is frozen and they are
    light (:func:`light_trainable`: LoRA adapters, trained biases or norms over a frozen base),
    and small ones (:func:`small_params`: norms, biases; ``budget`` is the ``gpu_budget``).

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
        for p in light_trainable([p for _, _, p in entries]):
            shared.setdefault(id(p), p)
    for p in small_params([p for _, _, entries, _ in units for _, _, p in entries], set(shared), budget):
        shared[id(p)] = p
    return units, list(shared.values())


#: All small parameters together stay on the device only while they hold at most this share of
#: the model's parameter bytes, and of a ``gpu_budget`` (norms and biases hold well under 1% of a
#: transformer's or a ResNet's).
SMALL_SHARE = 1 / 32


def small_params(params: list[nn.Parameter], taken: set[int], budget: int | None) -> list[nn.Parameter]:
    """The parameters among ``params`` (those of every unit, a tied one more than once; none of
    ``taken``) that stay resident on the device because they are small: plain floating-point
    tensors of at most ``RAMTORCH_SMALL_PARAM_BYTES`` (64 KiB) each, while all of them together
    hold at most :data:`SMALL_SHARE` of the model's bytes and of ``budget``; else none.

    Streamed, a small parameter costs the host more than its bytes cost the link: its gradient
    takes the backward's per-gradient path (a hook, a pending record, a place in a batch copied
    down, a host tensor of its own) and its update a kernel call on the host, for a few KiB. A
    ResNet's backward would hand 310 of its 465 gradients (its batch norms') that way, and was
    bound by the host. On the device, autograd accumulates their gradients and the optimizer updates them
    there with torch's kernels, with the numerics of a host parameter (as it does a resident
    unit's), as DeepSpeed keeps parameters under its persistence threshold whole on every GPU."""
    limit = _config.small_param_bytes()
    if limit <= 0:
        return []
    seen: set[int] = set()
    total = 0
    small: list[nn.Parameter] = []
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel() * p.element_size()
        total += n
        if (
            id(p) not in taken
            and n <= limit
            and p.is_floating_point()
            and type(p.data) is torch.Tensor
            and not is_traceable_wrapper_subclass(p)
        ):
            small.append(p)
    held = sum(p.numel() * p.element_size() for p in small)
    if held > SMALL_SHARE * total or (budget is not None and held > SMALL_SHARE * budget):
        return []
    return small


#: A unit's trainable parameters stay on the device when the rest of it is frozen and they hold at
#: most this share of its bytes (LoRA adapters of rank 16 on a 7B model's layer hold about 1%).
LIGHT_SHARE = 1 / 16


def light_trainable(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters of one unit (``params``) that stay resident on the device: its trainable
    ones, when some of the unit is frozen and they hold at most ``LIGHT_SHARE`` of its bytes.

    Streamed, such parameters would cost more than their bytes say: each one's gradient crosses
    back by a copy of its own and its update runs on the host, a kernel call per small tensor
    (a LoRA step of a 7B-shaped model spent 100 ms of its 700 on them). On the device autograd
    accumulates their gradients and the optimizer updates them there, while the frozen bytes
    stream as before."""
    train = [p for p in params if p.requires_grad]
    if not train or len(train) == len(params):
        return []

    def nbytes(ps: list[nn.Parameter]) -> int:
        return sum(p.numel() * p.element_size() for p in ps)

    return train if nbytes(train) <= LIGHT_SHARE * nbytes(params) else []


def materialize(p: torch.Tensor, value: torch.Tensor) -> None:
    """Gives parameter ``p``, on the meta device, the storage of ``value`` (same shape and dtype),
    keeping ``p``'s identity (every module and optimizer holding it sees the change):
    ``p.data = value`` cannot move a tensor off the meta device."""
    new = nn.Parameter(value, requires_grad=p.requires_grad)
    new.__dict__.update(p.__dict__)
    try:
        torch.utils.swap_tensors(p, new)
    except RuntimeError as e:
        raise RuntimeError(
            f"ramtorch.offload: a parameter of shape {list(p.shape)} on the meta device cannot be "
            f"allocated in place ({e}); build the model without references to its meta parameters"
        ) from e


@dataclass
class _Sub:
    """A tensor subclass parameter (torchao quantized weights, float8) streamed by its inner
    tensors: how to rebuild it (``__tensor_unflatten__``) around them. ``inner`` maps each inner
    tensor's name to its index among the unit's packed tensors, or to the ``_Sub`` of an inner
    subclass."""

    cls: type
    ctx: Any
    size: torch.Size
    stride: tuple[int, ...]
    inner: dict[str, int | _Sub]

    def build(self, leaves: Sequence[Any]) -> torch.Tensor:
        """The subclass around ``leaves`` (the unit's packed tensors, on the host or in a slot)."""
        inner = {n: x.build(leaves) if isinstance(x, _Sub) else leaves[x] for n, x in self.inner.items()}
        return self.cls.__tensor_unflatten__(inner, self.ctx, self.size, self.stride)  # type: ignore[attr-defined]


def _is_plain(p: torch.Tensor) -> bool:
    return type(p) is nn.Parameter or type(p) is torch.Tensor or not is_traceable_wrapper_subclass(p)


def _subclass_tree(t: torch.Tensor, leaves: list[torch.Tensor]) -> _Sub:
    """``t``'s inner tensors, appended to ``leaves`` (inner subclasses flattened in turn)."""
    names, ctx = t.__tensor_flatten__()  # type: ignore[attr-defined]
    inner: dict[str, int | _Sub] = {}
    for n in names:
        x = getattr(t, n)
        if is_traceable_wrapper_subclass(x):
            inner[n] = _subclass_tree(x, leaves)
        else:
            inner[n] = len(leaves)
            leaves.append(x)
    return _Sub(type(t), ctx, t.size(), tuple(t.stride()), inner)


def stream_tensors(params: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[int | _Sub] | None]:
    """The plain tensors that carry ``params`` across the link, and per parameter its index among
    them or, for a tensor subclass, its :class:`_Sub`; ``None`` when every parameter is plain (the
    tensors are then the parameters themselves)."""
    if all(_is_plain(p) for p in params):
        return list(params), None
    leaves: list[torch.Tensor] = []
    tree: list[int | _Sub] = []
    for p in params:
        if _is_plain(p):
            tree.append(len(leaves))
            leaves.append(p)
        else:
            tree.append(_subclass_tree(p, leaves))
    return leaves, tree


def _inner_checks(t: torch.Tensor, out: list[tuple[torch.Tensor, str, torch.Tensor]]) -> None:
    """Appends ``(holder, name, inner)`` for every inner tensor of ``t`` (inner subclasses'
    too): what :meth:`_Unit.stream_leaves` checks by identity instead of flattening again."""
    if _is_plain(t):
        return
    names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    for n in names:
        x = getattr(t, n)
        out.append((t, n, x))
        _inner_checks(x, out)


def _set_inner(t: torch.Tensor, sub: _Sub, leaves: Sequence[torch.Tensor]) -> None:
    """Points the subclass tensor ``t``'s inner tensors at ``leaves`` (in place: ``t`` may be a
    parameter the optimizer, hooks or the user hold)."""
    for n, x in sub.inner.items():
        if isinstance(x, _Sub):
            _set_inner(getattr(t, n), x, leaves)
        else:
            setattr(t, n, leaves[x])


def move_param(p: nn.Parameter, device: torch.device) -> None:
    """Moves ``p`` (plain, or a tensor subclass: by its inner tensors) and its gradient to ``device``."""
    leaves, tree = stream_tensors([p])
    if tree is None:
        p.data = p.data.to(device)
    else:
        assert isinstance(tree[0], _Sub)
        _set_inner(p, tree[0], [t.to(device) for t in leaves])
    if p.grad is not None:
        p.grad = p.grad.to(device)


def check_streamable(
    name: str, p: torch.Tensor, replaced: bool = False, who: str = "ramtorch.offload"
) -> None:
    """Refuses, naming ``name``, a parameter that cannot live in a unit's host region: a tensor
    subclass whose storage is not plain dense tensors reachable through ``__tensor_flatten__``, or
    one that requires grad (streamed subclasses are frozen weights). ``replaced``: the parameter
    was set on its module after ``offload`` (e.g. by torchao's ``quantize_``), and the message
    says so. ``who`` starts the message."""
    what = f"{who}: parameter {name!r} ({type(p).__module__}.{type(p).__qualname__})"
    if replaced:
        what += ", set on its module after offload,"
    if _is_plain(p):
        if p.is_quantized or p.layout != torch.strided:
            raise TypeError(
                f"{what} is a {'quantized' if p.is_quantized else str(p.layout)} tensor; streamed "
                "parameters are dense tensors or tensor subclasses with dense inner tensors "
                "(torchao quantized weights)"
            )
        try:
            p.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError) as e:
            raise TypeError(
                f"{what} is a tensor subclass without storage of its own and without "
                "__tensor_flatten__/__tensor_unflatten__: ramtorch cannot tell which bytes to stream"
            ) from e
        return
    if p.requires_grad:
        raise ValueError(
            f"{what} is a tensor subclass that requires grad: ramtorch keeps subclassed (quantized) "
            "weights in host memory as frozen weights only, as QLoRA uses them. Freeze it "
            "(p.requires_grad_(False)) and train adapters (peft LoRA) or plain parameters next to it"
        )
    leaves: list[torch.Tensor] = []
    try:
        sub = _subclass_tree(p, leaves)
        _set_inner(p, sub, leaves)  # the attributes must be settable: the unit points them at its region
        rebuilt = sub.build(leaves)
    except Exception as e:
        raise TypeError(
            f"{what} is a tensor subclass that ramtorch cannot stream by its inner tensors "
            f"(__tensor_flatten__, setting them, __tensor_unflatten__ failed: {e})"
        ) from e
    if type(rebuilt) is not type(p) or rebuilt.shape != p.shape or rebuilt.dtype != p.dtype:
        raise TypeError(f"{what}: __tensor_unflatten__ of its inner tensors does not give it back")
    for t in leaves:
        if (
            (type(t) is not torch.Tensor and type(t) is not nn.Parameter)
            or t.is_quantized
            or t.layout != torch.strided
        ):
            raise TypeError(
                f"{what} holds an inner tensor of type {type(t).__name__} (layout {t.layout}); "
                "only subclasses whose inner tensors are plain dense tensors can be streamed"
            )


def _packed_bytes(params: Sequence[torch.Tensor]) -> int:
    """Bytes of the arena region :func:`ramtorch._arena.pack_mixed` makes for ``params`` (a tensor
    subclass counts the bytes of its inner tensors: what crosses the link)."""
    total = 0
    for p in stream_tensors(params)[0]:
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


class _Reparametrizing(threading.local):
    """How many ``torch.nn.utils.stateless._reparametrize_module`` blocks this thread is in."""

    depth = 0


_REPARAM = _Reparametrizing()


def _count_reparametrizing() -> None:
    """Wraps ``torch.nn.utils.stateless._reparametrize_module`` (the block in which
    ``torch.func.functional_call`` swaps the given tensors into a module's ``_parameters`` and
    swaps the module's own back after the call) so that this thread knows when it is inside one:
    there a ``Parameter`` of another module passed to ``functional_call`` is for that call only,
    not a replacement (``module.weight = nn.Parameter(...)``) to adopt. Without the function
    (another torch), such parameters are taken as replacements."""
    from torch.nn.utils import stateless

    inner = getattr(stateless, "_reparametrize_module", None)
    if inner is None or getattr(inner, "_ramtorch_counted", False):
        return

    @contextlib.contextmanager
    def counted(*args: Any, **kwargs: Any) -> Iterator[None]:
        with inner(*args, **kwargs):
            _REPARAM.depth += 1
            try:
                yield
            finally:
                _REPARAM.depth -= 1

    functools.update_wrapper(counted, inner)
    counted._ramtorch_counted = True  # type: ignore[attr-defined]
    stateless._reparametrize_module = counted


_count_reparametrizing()


def is_override(t: object, own: object = None) -> bool:
    """Whether ``t``, found in a module's ``_parameters`` while its unit does not run in place of
    the unit's parameter ``own``, was put there for one call by ``torch.func.functional_call``
    (``torch.nn.utils.stateless``), which swaps the given tensors in for parameters and swaps the
    parameters back after the call: a tensor that is not a ``Parameter`` (``module.weight =
    tensor`` is refused by torch, so nothing else puts one there), or any tensor but ``own``
    inside ``functional_call`` (a ``Parameter`` of another module passed to it)."""
    # (Checked for every entry of a unit on each forward: a plain Parameter is settled first.)
    if t is own:
        return False
    if type(t) is nn.Parameter:
        return own is not None and _REPARAM.depth > 0
    return isinstance(t, torch.Tensor) and (
        not isinstance(t, nn.Parameter) or (own is not None and _REPARAM.depth > 0)
    )


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
        self.take(entries)
        self.resident = False
        self.container = False  # holds other units: stays resident (it would hold a slot all pass)
        # An embedding table streamed by rows (see .gather): its forwards gather the rows they
        # read; ``gathers`` holds, per running forward, what its pre-hook replaced (``None`` for a
        # forward that took the whole table through a slot).
        self.gather = False
        self.gathers: list[Any] = []
        # What is worked out from its layout, by name (see per_layout): how a large Linear is cut
        # into blocks of rows (.rows), how a large unit of torch's layers is cut into parts
        # (.parts).
        self._per_layout: dict[str, tuple[Any, Any]] = {}
        # The running forward's [slot, plan, bytes waited for, device weights] while it goes by
        # parts (.parts), and the guard that watches its first forward in a mode.
        self.parts_armed: list[Any] | None = None
        # The mean bytes of its model's streamed units (set by offload; 0: not known): a unit is
        # computed by parts only where it holds several times that (.parts.DOMINANCE).
        self.mean_unit_bytes = 0.0
        # Whether it ended the last forward pass (the streamer's itinerary), and the hooks on its
        # layers that compute it by parts (.parts; installed once it may be cut, none after the
        # process compiled anything).
        self.ends_forward = False
        # Whether it is the large unit computed before that one (.parts.before_end).
        self.before_end = False
        self.parts_handles: list[Any] = []
        self.parts_probe: Any = None
        # The itinerary and position whose copies ahead a forward computed as its copy lands
        # (by rows or parts) queues after its kernels (see Streamer._pre_forward).
        self.ahead_after: tuple[list[int], int] | None = None
        # A table read in place (.gather.reads_in_place): (its memory's address, numel, dtype)
        # and its device view (None: the memory is not mapped), made at its first such lookup.
        self.mapped: tuple[tuple[int, int, torch.dtype], torch.Tensor | None] | None = None
        self.gen = 0
        # Per parameter, where its packed tensors are, when some parameter is a tensor subclass
        # (see :func:`stream_tensors`); ``None`` (the fast path) when each parameter is one tensor.
        self.tree: list[int | _Sub] | None = None
        # stream_leaves(): (parameters, (holder, name, inner) checks, leaves, all plain).
        self._leaf_cache: tuple[list[Any], list[Any], list[torch.Tensor], bool] | None = None
        self.flat: torch.Tensor | None = None
        self.layout: _engine.Layout | None = None
        self.home: list[int] = []
        # offload(compress=...): the codec asked for (``None``: stream raw), the encoded region that
        # streams in place of ``flat`` (``None`` where the codec saves too little), what it was
        # encoded from (the region and the parameters' version counters) and its serial (in
        # ``key``: a slot holding an older encoding is never taken for this one).
        self.codec: str | None = None
        self.enc: _codec.Encoded | None = None
        self.enc_for: tuple[int, tuple[int, ...]] | None = None
        self.enc_serial = 0
        # offload(host_budget=..., disk=...): the unit's extent of the disk store, whose mapping
        # holds its parameters (``None``: they live in the host arena). See ramtorch._disk.
        self.disk: _disk.Extent | None = None
        # With a codec too: the extent its encoded bytes are kept in (read in place of ``disk``'s).
        self.enc_disk: _disk.Extent | None = None
        # Running forwards (a unit may be called inside itself): (slot, whether it took the slot,
        # saved-tensor hooks, slot address, the parameters it replaced, its _Fetch node, its
        # profiler range, the slot tensor and its version counter when the forward began, and
        # whether the forward is probed for writes no version counter sees).
        self.fwd: list[tuple[Any, ...]] = []
        # Whether its forward writes its weights in a way no version counter sees (through
        # ``.data``): then every forward's slot is copied back to the host. Found by comparing the
        # slot with the host region after its first forward in each mode (``probed``: training,
        # evaluation).
        self.writes = False
        self.probed: set[bool] = set()
        # Whether its forward stores views of its weights on its modules (``Streamer.
        # _own_stashes``): then every forward's module attributes are checked, not only the
        # first in each mode.
        self.stashes = False
        self.bwd: int | None = None  # the slot of its running backward (phase HELD)
        self.bwd_range: Any = None  # its backward's profiler range (ramtorch._profile), if one is open
        self.phase = BackwardPhase.IDLE
        self.anchor = torch.empty(0, requires_grad=True)
        # Weight-gradient nodes created since the last backward ended, and how many have run: when
        # they are equal every gradient of this unit for the step is on its way to the host.
        self.fetches = 0
        # Per parameter: how many forwards of the step have delivered its gradient; parameters
        # whose gradients are all delivered, not yet handed to the optimizers (and their
        # elements); how many parameters every forward has delivered, of how many trainable.
        self.delivered = [0] * len(self.params)
        self.ready: list[nn.Parameter] = []
        self.ready_numel = 0
        self.done = 0
        self.trainable = 0
        # Whether its weights' gradients may leave from the node that consumes each one (the
        # graph walk's hooks) rather than only from its ``_Fetch`` node: cleared for good once a
        # backward with ``create_graph`` unpacks one of its weights (see
        # ``GradientHooks._unpack``), whose graph then reaches the weight by a second path.
        self.early_grads = True

    def overridden(self) -> frozenset[int]:
        """Positions in ``entries`` whose module holds a tensor ``functional_call`` put in for the
        running call (see :func:`is_override`); call it only while the unit does not run."""
        return frozenset(
            k
            for k, e in enumerate(self.entries)
            if is_override(e.owner._parameters.get(e.name), self.params[e.index])
        )

    def per_layout(self, name: str, make: Callable[[_Unit], Any]) -> Any:
        """``make(self)``, kept under ``name`` while the unit's layout is the one it was made for
        (``None`` before the unit is packed)."""
        layout = self.layout
        if layout is None:
            return None
        kept = self._per_layout.get(name)
        if kept is not None and kept[0] is layout:
            return kept[1]
        value = make(self)
        self._per_layout[name] = (layout, value)
        return value

    def take(self, entries: Sequence[tuple[nn.Module, str, nn.Parameter]]) -> None:
        """The unit's parameters are ``entries`` (``(owner, name, parameter)``; one held under two
        names counts once) from now on; pack it before it streams again."""
        params: list[nn.Parameter] = []
        out: list[_Entry] = []
        seen: dict[int, int] = {}
        for owner, pname, p in entries:
            if id(p) not in seen:
                seen[id(p)] = len(params)
                params.append(p)
            out.append(_Entry(owner, pname, seen[id(p)]))
        self.params, self.entries = params, out
        self.nbytes = _packed_bytes(params)
        self.reset_backward_counts()

    def pack(self) -> None:
        """Moves the parameters (and their grads) into one arena region; a tensor subclass moves
        by its inner tensors."""
        if self.disk is not None and self.flat is not None:
            # Packed again into the same extent: what lives there now is copied out first (the
            # new layout may overlap the old one).
            with torch.no_grad():
                for t in stream_tensors(self.params)[0]:
                    if _arena.in_region(t, self.flat):
                        t.data = t.data.clone()
        leaves, tree = stream_tensors(self.params)
        specs = [(tuple(t.shape), t.dtype) for t in leaves]
        flat, views = _arena.pack_mixed(specs, None if self.disk is None else self.disk.view)
        # A kept store's extent, opened: its bytes are the parameters' values (ramtorch._keep).
        adopt = self.disk is not None and self.disk.opened
        if adopt:
            assert self.disk is not None
            self.disk.opened = False
        with torch.no_grad():
            if tree is None:
                for p, v in zip(self.params, views):
                    if p.is_meta:  # built on the meta device: allocated here, zeroed, filled by a load
                        if not adopt:
                            v.zero_()
                        materialize(p, v)
                        continue
                    if not adopt:
                        v.copy_(p.detach())
                    grad = p.grad
                    p.data = v
                    if grad is not None:
                        g = _arena.host_empty(tuple(p.shape), p.dtype)
                        g.copy_(grad)
                        p.grad = g
            else:
                if not adopt:
                    for t, v in zip(leaves, views):
                        v.copy_(t.detach())
                self._place(tree, views)
        if self.disk is not None:
            self.disk.settle()  # written to the file, and out of memory
        self.tree = tree
        self.flat = flat
        self.layout = _engine.Layout(flat, views)
        self.home = [v.data_ptr() for v in views]
        self.gen = _engine.next_generation()  # unique across models: slot keys of one engine never collide
        guard.register(self.params)

    def encoding(self) -> _codec.Encoded | None:
        """The encoded region that streams in place of ``flat``, or ``None`` (stream raw). Encoded
        again when the weights changed in a way torch counts (a version counter, a parameter set
        anew, the region moved); writes through ``.data`` between passes are not seen (see
        ``offload(compress=...)``). While a parameter requires grad the unit streams raw: trained
        weights change every step."""
        if self.codec is None or self.flat is None or self.layout is None or self.tree is not None:
            return None
        if any(p.requires_grad for p in self.params):
            self.enc = self.enc_for = None
            return None
        stamp = (id(self.flat), tuple(p._version for p in self.params))
        if self.enc_for != stamp:
            enc = _codec.encode(self.codec, self.flat, self.layout.entries, self.layout.nbytes)
            if self.enc_disk is not None and self.disk is not None:
                # A unit on disk keeps its encoded bytes on disk too, in an extent of their own
                # (read there in place of its raw extent); nothing of it stays in memory.
                if enc is not None:
                    with torch.no_grad():
                        self.enc_disk.view(enc.nbytes).copy_(enc.data[: enc.nbytes])
                    self.enc_disk.settle()
                    enc = dataclasses.replace(enc, data=self.enc_disk.view(enc.nbytes))
                self.disk.settle()  # (the raw bytes the encoder read)
            self.enc = enc
            self.enc_for = stamp
            self.enc_serial = _engine.next_generation()
        return self.enc

    def disk_read(self, cache: bool) -> _disk.Read:
        """Starts reading what crosses the link for this unit on disk: its encoded extent (the
        encoded bytes, see :meth:`encoding`) or its raw one. A read for an update to come
        (``cache``) also starts reading the parameters' optimizer states ahead, where they are on
        disk and updated during the backward (:func:`ramtorch._disk.hint_states`)."""
        assert self.disk is not None
        if cache:
            _disk.hint_states(self.params)
        enc = self.encoding() if self.enc_disk is not None else None
        if enc is not None and self.enc_disk is not None:
            return self.enc_disk.read(cache, enc.nbytes)
        return self.disk.read(cache)

    def source(self) -> tuple[torch.Tensor, int]:
        """The host bytes that cross the link for this unit: its encoded region (see
        :meth:`encoding`) or its raw region."""
        enc = self.encoding()
        if enc is not None:
            return enc.data, enc.nbytes
        assert self.flat is not None and self.layout is not None
        return self.flat, self.layout.nbytes

    def _place(self, tree: list[int | _Sub], views: Sequence[torch.Tensor]) -> None:
        """Points the parameters at ``views`` (their packed tensors), plain or subclass."""
        for p, x in zip(self.params, tree):
            if isinstance(x, _Sub):
                _set_inner(p, x, views)
            else:
                grad = p.grad
                p.data = views[x]
                if grad is not None:
                    g = _arena.host_empty(tuple(p.shape), p.dtype)
                    g.copy_(grad)
                    p.grad = g

    def device_params(self, views: Sequence[Any]) -> list[Any]:
        """Per parameter, its tensor made of ``views`` (the packed tensors in a slot): the view
        itself, or a tensor subclass rebuilt around its inner views. For units with a ``tree``."""
        assert self.tree is not None
        return [x.build(views) if isinstance(x, _Sub) else views[x] for x in self.tree]

    def reset_backward_counts(self) -> None:
        self.fetches = 0
        self.delivered = [0] * len(self.params)
        self.ready = []
        self.ready_numel = 0
        self.done = 0

    def count_fetch(self) -> None:
        """One more forward of the step fetched the weights for autograd: every parameter's
        gradient is owed once more (none is delivered by every forward now)."""
        self.fetches += 1
        self.done = 0
        self.trainable = sum(p.requires_grad for p in self.params)

    def uncount_fetch(self) -> None:
        """Takes back :meth:`count_fetch` (the forward raised: it delivers no gradient)."""
        self.fetches -= 1
        self.done = sum(n == self.fetches for n, p in zip(self.delivered, self.params) if p.requires_grad)

    def adopt(self, flat: torch.Tensor, copy: bool) -> None:
        """Moves the unit into ``flat`` (a ``uint8`` region of at least ``nbytes``, e.g. shared
        host memory), with the same layout; ``copy`` writes the current values there first."""
        assert self.layout is not None
        views = [None if v is None else _arena.own_storage(v) for v in self.layout.views(flat)]
        with torch.no_grad():
            if self.tree is None:
                for p, v in zip(self.params, views):
                    assert v is not None
                    if copy:
                        v.copy_(p.detach())
                    p.data = v
            else:
                if copy:
                    for t, v in zip(stream_tensors(self.params)[0], views):
                        assert v is not None
                        v.copy_(t.detach())
                self._place(self.tree, views)  # type: ignore[arg-type]
        self.flat = flat
        self.layout = _engine.Layout(flat, views)
        self.home = [v.data_ptr() for v in views if v is not None]
        self.gen = _engine.next_generation()

    def is_home(self) -> bool:
        lay = self.layout
        if lay is None:
            return False
        if self.tree is not None:
            return self._is_home_tree(lay)
        # (A device tensor's address is never one of the host region's: no device check.)
        params = self.params
        return (
            len(params) == len(self.home)
            and [p.data_ptr() for p in params] == self.home
            and [p.dtype for p in params] == lay.dtypes
        )

    def stream_leaves(self) -> tuple[list[torch.Tensor], bool]:
        """``stream_tensors(self.params)``'s tensors, and whether every parameter is plain. Cached
        while each parameter, and each inner tensor of a subclass parameter, is the object it was
        (checked by identity on every call): flattening a quantized weight again
        (``__tensor_flatten__``) on every pass cost more host time than the pass's kernels on
        small units. A write into an inner tensor keeps the object (its ``data_ptr`` and version
        are read by the callers); a new one is seen."""
        c = self._leaf_cache
        params = self.params
        if c is not None and len(c[0]) == len(params) and all(map(operator.is_, c[0], params)):
            for h, n, x in c[1]:
                if getattr(h, n, None) is not x:
                    break
            else:
                return c[2], c[3]
        leaves, tree = stream_tensors(params)
        checks: list[tuple[torch.Tensor, str, torch.Tensor]] = []
        for p in params:
            _inner_checks(p, checks)
        self._leaf_cache = (list(params), checks, leaves, tree is None)
        return leaves, tree is None

    def _is_home_tree(self, lay: _engine.Layout) -> bool:
        leaves, plain = self.stream_leaves()
        n = len(leaves)
        if plain or n != len(self.home):
            return False
        # (As for plain parameters: a device tensor's address is never one of the host region's.)
        dtypes = lay.dtypes[:n]
        return (
            [t.data_ptr() for t in leaves] == self.home
            and None not in dtypes
            and [t.dtype for t in leaves] == dtypes
        )

    def key(self) -> int:
        """Names the bytes of a device copy of this unit: equal keys, equal weights (the region's
        generation and the parameters' version counters)."""
        if self.tree is not None:
            # A subclass's own version counter does not see in-place edits of its inner tensors.
            tensors = self.stream_leaves()[0]
            return hash((self.gen, tuple(t._version for t in tensors))) & ((1 << 63) - 1)
        serial = self.enc_serial if self.enc is not None else 0
        return hash((self.gen, serial, tuple(p._version for p in self.params))) & ((1 << 63) - 1)

    def rebind(self) -> bool:
        """Takes the module's parameters again if one was replaced since the unit was made
        (``module.weight = nn.Parameter(...)``, ``load_state_dict(assign=True)``); returns whether
        one was (the unit must then be packed again). Call it only while the unit does not run
        (its parameters are not device views). A parameter removed, or one that another streamed
        unit holds (weights tied after ``offload``), is a ``RuntimeError``."""
        params = self.params
        for e in self.entries:
            p = e.owner._parameters.get(e.name)
            if p is not params[e.index] and not is_override(p, params[e.index]):
                break
        else:
            return False  # (a tensor functional_call put in for one call is not a replacement)
        own = {id(p) for p in params}
        new: list[nn.Parameter] = []
        seen: dict[int, int] = {}
        entries = []
        for e in self.entries:
            p = e.owner._parameters.get(e.name)
            if is_override(p, params[e.index]):
                p = params[e.index]  # for one call: the unit keeps its own
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
            if id(p) not in own and id(p) not in seen:
                # A new parameter (torchao's quantize_ after offload): the same checks as offload's,
                # before anything of the unit changes.
                check_streamable(self._qualified_name(e), p, replaced=True)
            if id(p) not in seen:
                seen[id(p)] = len(new)
                new.append(p)
            entries.append(_Entry(e.owner, e.name, seen[id(p)]))
        self.params, self.entries = new, entries
        self.nbytes = _packed_bytes(new)
        self.reset_backward_counts()
        return True

    def _qualified_name(self, e: _Entry) -> str:
        """``e``'s parameter name as the model names it (the unit's name, the path to its owner)."""
        path = next((n for n, m in self.module.named_modules() if m is e.owner), None)
        parts = [x for x in (self.name if self.name != "<root>" else "", path) if x]
        return ".".join([*parts, e.name])

    def forget_copies(self) -> None:
        """Device copies made so far are not trusted anymore: a new pass copies the unit again.
        Version counters do not see every write (``param.data`` edits, numpy views, raw
        pointers), so a copy made before user code ran is never taken for the current weights."""
        self.gen = _engine.next_generation()
