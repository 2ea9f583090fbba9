"""The autograd side of a unit: functions around its forward, saved tensors kept as references
into its slot, and the graph walk that sends each weight's gradient as soon as it is computed."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .. import _engine
from . import rows
from .compiling import run_eagerly
from .units import _Unit

if TYPE_CHECKING:
    from .streamer import Streamer


#: A unit's graph walk (see :meth:`Streamer._hook_weight_consumers`) gives up past this many nodes:
#: its weights' gradients then leave at the end of the unit's backward.
_WALK_LIMIT = 4096
#: Gradients handed to the optimizers as they land are batched up to this many elements (small
#: tensors such as norm weights would otherwise each be a job of their own).
_READY_BATCH = 1 << 22


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
    recomputed forward saves the same tensors as the original one (no gradient reaches them). A
    frozen tensor subclass (a quantized weight) is such a leaf already, as made: detaching it
    would rebuild it through its ``__torch_dispatch__`` (0.1 ms a weight on the host)."""
    return [
        v
        if v is None or (type(v) is not torch.Tensor and not p.requires_grad and not v.requires_grad)
        else v.detach().requires_grad_(p.requires_grad)
        for v, p in zip(views, params)
    ]


class _SlotRef:
    """A saved tensor that lives in a unit's slot: re-created from the unit at unpack time."""

    __slots__ = ("dtype", "offset", "size", "stride", "unit")

    def __init__(self, unit: _Unit, t: torch.Tensor, offset: int) -> None:
        self.unit = unit
        self.dtype = t.dtype
        self.offset = offset  # in elements of ``dtype``, from the slot's start
        self.size = tuple(t.shape)
        self.stride = tuple(t.stride())


class _SubRef:
    """A saved tensor subclass some of whose inner tensors live in a unit's slot: rebuilt around
    them (each a :class:`_SlotRef`) at unpack time."""

    __slots__ = ("cls", "ctx", "inner", "size", "stride")

    def __init__(self, t: torch.Tensor, inner: dict[str, Any], ctx: Any) -> None:
        self.cls = type(t)
        self.ctx = ctx
        self.inner = inner
        self.size = t.size()
        self.stride = tuple(t.stride())


class _EarlyGrad:
    """The hook on the node that consumes weight ``i`` of unit ``u`` (as its input ``j``): sends
    that weight's gradient to the host as soon as the node has run. One object per hooked node and
    pass (a closure would be a function and five cells: a ResNet's backward hooks 465 nodes, and
    what a pass allocates and keeps alive sets how often Python's full collections run)."""

    __slots__ = ("fetch", "hooks", "i", "j", "u")

    def __init__(self, hooks: GradientHooks, u: _Unit, fetch: Any, i: int, j: int) -> None:
        self.hooks = hooks
        self.u = u
        self.fetch = fetch
        self.i = i
        self.j = j

    def __call__(self, grad_inputs: tuple[torch.Tensor | None, ...], _grad_outputs: Any) -> None:
        g = grad_inputs[self.j]
        if g is None:
            return  # not needed by this backward: _Fetch's backward does not run either
        h, u, i = self.hooks, self.u, self.i
        if not u.early_grads:
            return  # a create_graph backward reached the weight by another path: _Fetch sends the sum
        self.fetch.sent.add(i)
        h.eng.push_grad(u.params[i], g, h.max_inflight, u.tag)
        h._delivered(u, i)

    def by_rows(
        self,
        dtype: torch.dtype,
        blocks: list[tuple[int, int]],
        fill: Callable[[int, int, torch.Tensor], None],
    ) -> torch.Tensor:
        """Called by the node itself (a :class:`~ramtorch._stream.rows._ByRows` backward, which
        then gets no hook): the weight's gradient, computed by ``fill`` block by block of rows, each
        block leaving for the host as soon as it is computed (before the node computes its input's
        gradient). Returns the whole gradient."""
        h, u, i = self.hooks, self.u, self.i
        self.fetch.sent.add(i)
        g = h.eng.push_grad_by_rows(u.params[i], dtype, blocks, fill, h.max_inflight, u.tag)
        h._delivered(u, i)
        return g


class GradientHooks:
    """The gradient half of :class:`~ramtorch._stream.streamer.Streamer`: early weight gradients
    (graph walk), their hand-off to the optimizers, and the saved-tensor hooks."""

    eng: _engine.DeviceEngine
    device: torch.device
    max_inflight: int
    lock: threading.RLock
    slot_owner: dict[int, tuple[int, _Unit]]

    def weights_buffer(self, slot: int) -> torch.Tensor:
        """See :meth:`~ramtorch._stream.itinerary.Prefetcher.weights_buffer`."""
        raise NotImplementedError

    # -- weight gradients as they are computed ------------------------------------------------------

    def _hook_weight_consumers(self, u: _Unit, fetch: Any, roots: list[Any]) -> None:
        """Walks the unit's graph from its outputs down to ``fetch`` (its :class:`_Fetch` node) and
        hooks the node that consumes each weight, where exactly one does: that weight's gradient
        leaves for the host as soon as the node has run, not at the end of the unit's backward
        (small weights excepted: their gradients cross in batches anyway).
        The walk stops at the unit's inputs (:class:`_PostBackward`), at other units' weights and at
        leaves, and gives up past ``_WALK_LIMIT`` nodes. Under ``torch.compile`` it runs eagerly
        like the rest of the hooks, over the compiled regions' nodes: a weight's gradient leaves
        once the backward of the compiled region that consumed it has run."""
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
            p = u.params[i]
            # A small weight's gradient (a norm's, a bias's) waits on the device for others to
            # cross with (``DeviceEngine._add_small``): ``_Fetch``'s backward hands it over at the
            # end of the unit's backward, which saves a hook and its call for each.
            if len(edges) == 1 and p.requires_grad and not _engine.small_grad(p.numel() * p.element_size()):
                node, j = edges[0]
                early = _EarlyGrad(self, u, fetch, i, j)
                if type(node) is rows.ByRowsBackward and j == rows.WEIGHT_INPUT:
                    node.send_weight_grad = early  # sends the blocks itself, as it computes them
                else:
                    node.register_hook(early)

    def _delivered(self, u: _Unit, i: int) -> None:
        """Parameter ``i`` of ``u`` got its gradient from one more forward of the step; once every
        forward has delivered it, it goes to the optimizers (batched: see ``_READY_BATCH``)."""
        u.delivered[i] += 1
        if u.delivered[i] != u.fetches:
            return
        p = u.params[i]
        u.ready.append(p)
        u.ready_numel += p.numel()
        u.done += p.requires_grad
        if u.done >= u.trainable or u.ready_numel >= _READY_BATCH:
            ready, u.ready, u.ready_numel = u.ready, [], 0
            self.eng.grads_complete(ready)

    # -- saved tensors ------------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        owners = self.slot_owner
        if owners and t.device == self.device:
            if (
                type(t) is not torch.Tensor
                and type(t) is not nn.Parameter
                and is_traceable_wrapper_subclass(t)
            ):
                return self._pack_subclass(t)
            # By address, not by ``t.untyped_storage()``: that call gives the storage a Python
            # object that lives as long as the storage does, one for every activation saved.
            p = t.data_ptr()
            for addr, (end, u) in owners.items():
                if addr <= p < end or (p == end and t.numel() == 0):
                    offset, rest = divmod(p - addr, t.element_size())
                    return t if rest else _SlotRef(u, t, offset)
        # Anything else is kept detached: a node that saves its own output (``tanh``, ``exp``,
        # ``sigmoid``) would otherwise hold that output and so its own ``grad_fn``, a cycle
        # through autograd's C++ objects that Python's collector cannot free, and the graph of a
        # forward whose backward never runs would leak. Autograd gives the unpacked tensor its
        # ``grad_fn`` back from what it saved (and ``detach`` shares the version counter).
        return t.detach() if t.requires_grad and not t.is_leaf else t

    def _pack_subclass(self, t: torch.Tensor) -> Any:
        """A saved tensor subclass (a quantized weight): its inner tensors that live in a slot
        are kept as references, as plain tensors are."""
        names, ctx = t.__tensor_flatten__()  # type: ignore[attr-defined]
        inner = {n: self._pack(getattr(t, n)) for n in names}
        if all(inner[n] is getattr(t, n) for n in names):
            return t
        return _SubRef(t, inner, ctx)

    def _unpack(self, obj: Any) -> torch.Tensor:
        if isinstance(obj, _SlotRef):
            if torch.is_grad_enabled():
                self._second_path(obj.unit)
            return self.weight_for_backward(obj)
        if type(obj) is _SubRef:
            if torch.is_grad_enabled():
                for ref in obj.inner.values():
                    if isinstance(ref, _SlotRef):
                        self._second_path(ref.unit)
            inner = {n: self._unpack(x) for n, x in obj.inner.items()}
            return obj.cls.__tensor_unflatten__(inner, obj.ctx, obj.size, obj.stride)  # type: ignore[attr-defined]
        return obj

    @staticmethod
    def _second_path(u: _Unit) -> None:
        """A backward with ``create_graph`` (a gradient penalty's) unpacks one of ``u``'s weights
        as saved: the graph it records reaches that weight's ``_Fetch`` output directly, not
        through the node that consumed it in the forward, so a later backward brings the weight's
        gradient by two paths. The hook on the consuming node would send only the one through
        it, and ``_Fetch``'s backward drop the other as sent: from now on the unit's gradients
        leave from ``_Fetch``, which receives their sum."""
        u.early_grads = False

    def weight_for_backward(self, ref: _SlotRef) -> torch.Tensor:
        u = ref.unit
        with self.lock:
            if u.bwd is None:
                self._begin_backward_locked(u)
            assert u.bwd is not None
            buf = self.weights_buffer(u.bwd)
        return buf.view(ref.dtype).as_strided(ref.size, ref.stride, ref.offset)


# Saved-tensor hooks run inside compiled models' eager stretches too: plain Python, never compiled
# (each saved tensor's shape would be a new variant, up to Dynamo's recompile limit).
run_eagerly(GradientHooks._pack, GradientHooks._pack_subclass, GradientHooks._unpack)
