"""The streamer of one offloaded model: the per-unit state machine, driven by module hooks."""

from __future__ import annotations

import enum
import functools
import sys
import threading
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import _disk, _engine, _profile
from .._units import format_bytes
from . import added, decoding, gather, parts, rows
from .compiling import is_compiling, opaque, run_eagerly
from .functions import GradientHooks, _Fetch, _leaves, _PostBackward
from .itinerary import Prefetcher
from .units import BackwardPhase, UnitState, _Unit, stream_tensors

#: Trace mark codes (see :mod:`ramtorch._trace`).
MARK_FWD_BEGIN, MARK_FWD_END, MARK_BWD_BEGIN, MARK_BWD_END = 1, 2, 3, 4


class PassState(enum.Flag):
    """Where a streamer is in the training loop (``Streamer.state``).

    =============================  ==================================================================
    transition                     where
    =============================  ==================================================================
    any -> FORWARD                 :meth:`Streamer.begin_pass` (root forward pre-hook, outside
                                   backward). A BACKWARD still set belongs to a backward that raised
                                   before its end: it is cleared, its counts and slots dropped.
    FORWARD -> (clear FORWARD)     :meth:`Streamer.end_pass` (root forward hook, always called)
    (set BACKWARD)                 :meth:`Streamer._begin_backward_locked`, when a backward first
                                   reaches a unit: the end-of-backward callback is queued
    BACKWARD -> (clear BACKWARD)   :meth:`Streamer.end_of_backward` (that callback)
    =============================  ==================================================================

    ``FORWARD | BACKWARD`` happens only when a model's forward runs a backward inside it.
    """

    IDLE = 0
    FORWARD = enum.auto()
    BACKWARD = enum.auto()


def inside_ddp_forward() -> bool:
    """Whether a ``torch.nn.parallel.DistributedDataParallel`` forward is running (torch marks it on
    the class for TorchDynamo; its module is loaded with ``torch.nn``)."""
    ddp = sys.modules.get("torch.nn.parallel.distributed")
    cls = getattr(ddp, "DistributedDataParallel", None)
    return getattr(cls, "_active_ddp_module", None) is not None


def refuse_ddp(what: str) -> None:
    """``what`` trains streamed weights inside a ``DistributedDataParallel`` forward. DDP averages
    gradients in hooks on autograd's accumulation into each parameter, which streamed weights'
    gradients never pass (they are copied to host memory): each rank would step with its own
    gradients and the ranks drift apart, silently. A clear error instead."""
    raise RuntimeError(
        f"ramtorch: {what} runs inside torch's DistributedDataParallel, which cannot average the "
        "gradients of streamed weights: they reach host memory without passing through autograd's "
        "accumulation, where DDP's hooks are, so the ranks would train apart silently. Use "
        "ramtorch.distributed instead of DDP: ramtorch.distributed.init(), ramtorch.offload(model), "
        "ramtorch.optim.AdamW(model.parameters()).shard(stage=2) (README: Several GPUs); or freeze "
        "the offloaded part (requires_grad_(False))"
    )


def _device_views(u: _Unit, buf: torch.Tensor, cached: bool) -> list[Any]:
    """``u``'s weights in ``buf``, per parameter (tensor subclasses rebuilt around their inner
    tensors); ``cached``: ``buf`` is a device slot, whose views are made once
    (:meth:`~ramtorch._engine.Layout.slot_views`). Made as normal tensors also under
    ``torch.inference_mode`` (where torch's own parameters are normal tensors too): a write into
    them then bumps the slot's version counter, which inference tensors do not have."""
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            return _device_views(u, buf, cached)
    views = u.layout.slot_views(buf) if cached else u.layout.views(buf)  # type: ignore[union-attr]
    return u.device_params(views) if u.tree is not None else views


class Streamer(Prefetcher, GradientHooks):
    """Runs the units of one offloaded model on one compute device.

    State: the pass (``state``, a :class:`PassState`, with its transitions listed there) and, per
    unit, its forwards (``_Unit.fwd``), its backward phase (``_Unit.phase``, a
    :class:`~ramtorch._stream.units.BackwardPhase`) and its prefetch (``ahead``);
    :meth:`unit_state` sums them up. Every transition happens under ``lock``.
    """

    #: Whether the model's forward ends with ``end_pass`` (a free-standing layer's streamer has
    #: no pass around its units: ``shared.LayerStreamer``).
    pass_ends = True
    #: This streamer's stage in a pipeline over several devices (``offload(devices=...)``: one
    #: streamer a stage, see :mod:`.pipeline`), ``None`` for a model on one device.
    stage: int | None = None
    #: Whether the forwards of a unit in one step have backwards that run apart, each reaching the
    #: unit anew (a pipeline stage's micro-batches, ``offload(micro_batches=...)``).
    backward_per_forward = False

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
        self.serial = _engine.next_generation()  # orders the models in ramtorch.stats()
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
        if budget is not None:
            # Gradient accumulation keeps sums on the device within what the budget leaves.
            self.eng.limit_sums(self, budget - resident_bytes - slots * slot_bytes)
        self.by_uid = {u.uid: u for u in units}
        self.streamed = [u for u in units if not u.resident]
        self.fwd_itin: list[int] = []
        # (uid of the unit that ended the last forward pass, uid of the large one before it)
        self.end_pair: tuple[int, int | None] | None = None
        self.bwd_itin: list[int] = []
        self.cur_fwd: list[int] = []
        self.cur_bwd: list[int] = []
        self.fwd_pos = 0
        self.bwd_pos = 0
        self.ahead: dict[int, tuple[int, int]] = {}  # uid -> (slot, key): prefetched, not claimed
        self.held = 0  # slots held by running units (forward or backward)
        # A slot's storage address -> (its end, the unit using it in forward).
        self.slot_owner: dict[int, tuple[int, _Unit]] = {}
        self.state = PassState.IDLE
        self.lock = threading.RLock()
        self.counters = {
            "prefetches": 0,
            "prefetch_hits": 0,
            "prefetch_wasted": 0,
            "passes": 0,
            # Forwards of units streamed by rows (.gather), and the bytes of the rows they moved
            # (read in place: the rows' bytes the lookup's indices name, repeats counted).
            "row_lookups": 0,
            "gathered_bytes": 0,
            # Bytes decoded on the device from units streamed encoded (offload(compress=...)).
            "decoded_bytes": 0,
            # Forwards of a large Linear computed by blocks of rows as its copy landed (.rows).
            "forwards_by_rows": 0,
            # Forwards of a large unit of torch's layers computed by parts as they landed.
            "forwards_by_parts": 0,
            # Disk units' extents read ahead along the itinerary, and read when needed (not read
            # ahead: the first pass, a pass off the itinerary, weights changed since the read).
            "disk_reads_ahead": 0,
            "disk_reads_on_demand": 0,
        }
        self.decoded: dict[int, torch.Tensor] = {}
        self.part_events: dict[int, list[tuple[int, torch.cuda.Event]]] = {}
        # Events after this pass's lookups that read their tables in place (.gather): waited for
        # at the pass's end, before user code may write the tables.
        self.mapped_reads: list[torch.cuda.Event] = []
        self.decode_stream: torch.cuda.Stream | None = None
        # offload(disk=...): the store of the units that live on disk, and their reads ahead.
        self.disk_store: _disk.Store | None = None
        self.disk_order: list[int] = []  # their uids, in the order the model registers them
        self.staged: dict[int, tuple[int, _disk.Read]] = {}
        self.disk_ahead = _disk.ahead()
        # What this streamer's passes hold of the device's forward lock (see ForwardLock).
        self._pass_token = ("pass", id(self))
        self.hook_handles: list[Any] = []
        # Open ``ramtorch.weights_unchanged`` blocks: while one is, the caller promises that no
        # weight is edited between passes, so copies made for one pass may serve the next.
        self.unchanged = 0
        # The decoding span (``generate()``) of this model's last pass, and whether the running
        # pass takes copies made before it (inside ``weights_unchanged``, or a pass of a span
        # after its first): see :meth:`begin_pass` and :mod:`ramtorch._stream.decoding`.
        self.span: decoding.Span | None = None
        self.trusted = False
        # Modules of the model on which a parameter or a submodule was registered since the last
        # check (torch's registration hooks, :mod:`ramtorch._stream.added`).
        self.touched: set[nn.Module] = set()

    # -- passes -------------------------------------------------------------------------------------

    def begin_pass(self) -> None:
        """Root forward pre-hook: a new forward pass begins."""
        if is_compiling():
            return opaque(Streamer.begin_pass, self)
        _engine.check_fork()
        if torch._C._current_graph_task_id() != -1:
            return  # a recomputation inside backward
        # Another thread's forward on this device runs to its end first (released by end_pass,
        # which torch calls also when the forward raises).
        self.eng.forwards.acquire(self._pass_token)
        if inside_ddp_forward() and torch.is_grad_enabled():
            self._refuse_ddp()
        with self.lock:
            # Parameters added to the model since offload are refused here, before anything
            # changes (their modules were marked touched as they were registered).
            if self.touched:
                added.check(self)
            # A pass still open: the last forward was interrupted (Ctrl-C skips the end hooks).
            interrupted = PassState.FORWARD in self.state
            # A forward with gradients begins a training step on the engine (refused while
            # another thread's is in progress).
            trains = torch.is_grad_enabled() and any(p.requires_grad for u in self.streamed for p in u.params)
            interrupted = self.eng.drop_interrupted(claim=trains) or interrupted
            gather.drop_interrupted(self.eng)
            if PassState.BACKWARD in self.state:
                # A backward raised before its end, so its end-of-backward callback never ran:
                # without this the next backward would not queue one, and no gradient would
                # ever reach ``.grad`` again.
                self.state &= ~PassState.BACKWARD
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
                self._undo_gathers(u)
            self._release_backward()
            # No unit of this model runs now: the slots it holds are its prefetches. Any other
            # slot taken for it was lost by an interrupt between the take and its record (or
            # the give-back and its record): given back here, whichever point it hit.
            self._reconcile()
            if interrupted:
                self.slot_owner.clear()
                for u in self.streamed:
                    self._restore(u)  # parameters an interrupted forward left as device views
                self._pop_saved_tensor_hooks()
            # User code ran since the last pass, and may have rewritten any weight in a way no
            # version counter sees (``param.data``, as PEFT's merge, EMA helpers and init code
            # do): no device copy made before this point is taken for the current weights. The
            # first units are copied now, while the model's own code before them runs. Unless
            # only a decoding loop's code ran since this model's last pass (a pass of a
            # ``generate()`` after its first: :mod:`.decoding`), or the caller promised that no
            # weight is edited (``weights_unchanged``): then the copies made for the last pass,
            # and the next one's first units prefetched at its end, serve this one, each still
            # checked against its unit's key (parameters' version counters) in :meth:`_take`.
            # A parameter replaced on its module (``module.weight = nn.Parameter(...)``, torchao's
            # ``quantize_``) is taken into its unit, which is packed again; a parameter whose
            # ``.data`` was set anew (another storage) is packed again in :meth:`_take`: both are
            # seen exactly (by identity and address), at no cost, in every pass.
            span = decoding.current() if not torch.is_grad_enabled() else None
            self.trusted = bool(self.unchanged) or (span is not None and span is self.span)
            if span is not None and self.span is not span:
                span.members.add(self)
            self.span = span
            if not self.trusted:
                self._drop_ahead()
            for u in self.streamed:
                if u.rebind():
                    if u.uid in self.ahead:
                        self._drop_ahead(u.uid)
                    u.pack()
                if u.nbytes > self.slot_bytes and not u.gather:
                    raise RuntimeError(
                        f"ramtorch.offload: unit {u.name!r} now takes {format_bytes(u.nbytes)}, more "
                        f"than the {format_bytes(self.slot_bytes)} device slots that offload reserved: "
                        "its parameters were replaced after offload by larger ones (a wider dtype, "
                        "e.g. load_state_dict(..., assign=True) of fp32 weights into a bf16 model). "
                        "Replace them with parameters of the planned sizes, or offload a model built "
                        "with the new ones"
                    )
                if not self.trusted:
                    u.forget_copies()
            self.state |= PassState.FORWARD
            self.cur_fwd = []
            self.fwd_pos = 0
            if self.fwd_itin:
                self._prefetch_along(self.fwd_itin, 0, None)

    def end_interrupted_forwards(self) -> None:
        """Undoes the forwards of this streamer's units left open by an exception that skipped
        their forward hooks (Ctrl-C), on the thread that ran them, whose saved-tensor hooks they
        pushed: a pipeline's micro-batch runs on a thread of its own, and the next pass (which
        sees the pass interrupted and does the rest) begins on another."""
        with self.lock:
            for u in reversed(self.streamed):
                while u.fwd:
                    self._end_forward(u, *u.fwd.pop()[:5])
                self._undo_gathers(u)
            self._pop_saved_tensor_hooks()

    def _refuse_ddp(self) -> None:
        """This model's forward runs inside a DDP forward with grad (see :func:`refuse_ddp`):
        refused when a streamed weight trains."""
        names = [u.name for u in self.streamed if any(p.requires_grad for p in u.params)]
        if names:  # (frozen, as a text encoder inside a DDP-trained model: no gradient to average)
            refuse_ddp(f"an offloaded model with trainable streamed weights (units {names[:4]}"
                       f"{' ...' if len(names) > 4 else ''})")  # fmt: skip

    def _pop_saved_tensor_hooks(self) -> None:
        """Removes a saved-tensor hook of this streamer left on torch's stack (an interrupt inside
        the end of a unit's forward): later units would take it for an outer one."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        while top is not None and top[0] == self._pack:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)

    def _idle(self) -> bool:
        return self.state is PassState.IDLE and not self.held

    def settle_interrupted(self) -> None:
        """Outside backward: a backward of this model that raised before its end (Ctrl-C, an
        error in a hook) left its units' slots held and device views in place of their
        parameters, so ``state_dict()`` would read the slots' (possibly pre-update) copies. The
        slots are given back and the parameters restored; the next pass still sees the backward
        as interrupted (``PassState.BACKWARD`` stays set)."""
        if PassState.BACKWARD not in self.state or torch._C._current_graph_task_id() != -1:
            return
        user = self.eng._user
        if user is not None and user is not _engine.acting_thread():
            return  # another thread's training step: its backward may be running (its thread settles)
        with self.lock:
            self._release_backward()
            for u in self.streamed:
                self._restore(u)  # also those whose restore the interrupt cut short

    def _record_forward(self, u: _Unit) -> None:
        """``u`` runs next in the forward pass: recorded, and the itinerary position advanced."""
        self.cur_fwd.append(u.uid)
        self.fwd_pos = self._advance(self.fwd_itin, self.fwd_pos, u.uid)

    def end_pass(self) -> None:
        if is_compiling():
            return opaque(Streamer.end_pass, self)
        try:
            self._end_pass()
        finally:
            self.eng.forwards.release(self._pass_token)

    def _end_pass(self) -> None:
        if PassState.FORWARD not in self.state:
            return
        self._settle_mapped_reads()
        # Copies of this pass's last units may still be reading host weights (the host runs
        # ahead of the device by up to max_inflight copies, ``_copies_ahead``), and user code may
        # edit them once the forward returns (``param.data``, an optimizer): they are waited for
        # below. By then their units' kernels are queued, so the device is not held back; the
        # next pass's first copies, queued here inside a decoding span, are not waited for.
        copies = self.eng.copies_marker()
        try:
            self._close_pass()
        finally:
            self.eng.wait_copies(copies)

    def _close_pass(self) -> None:
        """:meth:`_end_pass` under the lock: the itinerary, the flags near the pass's end, and the
        next pass's first copies where it will take them."""
        with self.lock:
            self.state &= ~PassState.FORWARD
            self.fwd_itin = self.cur_fwd
            self.cur_fwd = []
            if self.fwd_itin:
                # The unit that ended this pass and the large one computed before it are cut by
                # parts where they can be (.parts.wanted); flagged anew when they change.
                last = self.by_uid[self.fwd_itin[-1]]
                before = parts.before_end(self.fwd_itin, self.by_uid)
                pair = (last.uid, None if before is None else before.uid)
                if pair != self.end_pair:
                    self.end_pair = pair
                    for x in self.units:
                        x.ends_forward = x.before_end = False
                    last.ends_forward = True
                    self.hook_parts(last)
                    if before is not None:
                        before.before_end = True
                        self.hook_parts(before)
            self.counters["passes"] += 1
            # Nothing of the next pass is copied now: its weights may be edited before it begins
            # (see :meth:`begin_pass`, which copies its first units). Unless the next pass will
            # take this one's copies: inside a decoding span (``generate()``) from its second
            # pass on (after the first, the prefill, nothing is prefetched: a generate() of one
            # token has no next pass, and a copy the link made for nothing would delay what
            # follows), or inside ``ramtorch.weights_unchanged``. The next pass's first units
            # then come in while this pass's last kernels run.
            trusted, self.trusted = self.trusted, False
            if trusted and not torch.is_grad_enabled() and self.fwd_itin:
                self._prefetch_along(self.fwd_itin, 0, None)

    def leave_span(self, span: decoding.Span) -> None:
        """The decoding span ``span`` ended (``generate()`` returned): copies prefetched for a next
        pass in it are given back (the next pass follows user code, and copies afresh)."""
        with self.lock:
            if self.span is not span:
                return
            self.span = None
            if PassState.FORWARD not in self.state:
                self._drop_ahead()

    # -- forward --------------------------------------------------------------------------------

    def pre_forward(
        self, u: _Unit, module: nn.Module, args: tuple, kwargs: dict, traced: bool = False
    ) -> tuple[tuple, dict]:
        if is_compiling():
            # Under torch.compile the hooks run as in eager mode (see .compiling); so do the
            # other entry points of this layer. (``traced``: the forward may be a graph.)
            return opaque(Streamer.pre_forward, self, u, module, args, kwargs, True)
        _engine.check_fork()
        # Inside backward this is a recomputation (activation checkpointing): the unit's backward
        # slot serves it, and stays held until the unit's backward is done.
        recompute = torch._C._current_graph_task_id() != -1
        if not recompute and not self.eng.forwards.mine():
            # A unit run on its own (outside a pass of this thread): it waits for other threads'
            # forwards, and holds the device's forwards until its own forward hook.
            self.eng.forwards.acquire((self._pass_token, u.uid))
        if self.touched and not recompute and PassState.FORWARD not in self.state:
            with self.lock:
                added.check(self)  # a unit run on its own
        # Tensors that ``torch.func.functional_call`` put in for this call stand for those
        # parameters (units.is_override): the module computes on them, and only the unit's
        # other parameters stream. Given them all, nothing streams (nor goes through autograd
        # functions of ours, so torch.func's transforms work over the call).
        over = frozenset() if recompute or u.fwd or u.bwd is not None else u.overridden()
        if over:
            if len(over) == len(u.entries):
                return args, kwargs
            if u.gather:
                raise RuntimeError(
                    f"ramtorch.offload: unit {u.name!r} streams its table by rows, and a call "
                    "(torch.func.functional_call) gave some of its parameters but not all; give "
                    "all of them or none"
                )
        if u.gather:
            gathered = self._gather_forward(u, module, args, kwargs, recompute)
            if gathered is not None:
                return gathered
            if args and isinstance(args[0], torch.Tensor) and args[0].device != self.device:
                args = (args[0].to(self.device), *args[1:])  # indices on the CPU, whole table
        rng = _profile.begin(f"ramtorch.forward {u.name}") if _profile.active() else None
        # A large Linear computed by blocks of rows as they land (.rows): its copy is waited for
        # part by part in its forward, not here.
        blocks = None if recompute or traced or over else rows.by_rows(u, module, args, kwargs, self.device)
        # A large unit of torch's layers computed by parts as they land (.parts): each layer's
        # forward waits for its own part (its first forward in a mode waits for all, watched).
        cut = None if recompute or traced or over or blocks is not None else parts.by_parts(u, module)
        with self.lock:
            if recompute:
                if u.bwd is None:
                    self._begin_backward_locked(u)
                assert u.bwd is not None
                slot, own = u.bwd, False
            else:
                if PassState.FORWARD in self.state:
                    self._record_forward(u)
                    itin, pos = self.fwd_itin, self.fwd_pos
                else:
                    # Called outside the model's forward (a submodule run on its own): a pass of
                    # its own, whose weights may have been edited since the last copy.
                    if not u.fwd and u.bwd is None and u.rebind():
                        self._drop_ahead()
                        u.pack()
                    u.forget_copies()
                    itin, pos = [], 0
                whole = blocks is None and (cut is None or cut[1])
                nxt = self._lookahead(itin, pos)
                keep = [x.key() for x in nxt]
                slot = self._take(u, keep, claim=whole)
                own = True
                u.ahead_after = None
                if itin and not whole:
                    # Computed as its copy lands: the copies ahead are queued once its kernels
                    # are, since queueing one may wait on the host for this unit's copy (the
                    # engine keeps max_inflight copies in flight), which would hold back the
                    # kernels that compute on its first parts.
                    u.ahead_after = (itin, pos)
                elif itin:
                    self._prefetch_along(itin, pos, u, (nxt, keep))
                elif self.disk_store is not None and PassState.FORWARD in self.state:
                    # No itinerary yet (the first pass): the disk units that have not run are
                    # read ahead in the order the model registers them.
                    self._read_ahead(self.disk_order, 0, frozenset(self.cur_fwd))
            assert u.layout is not None
            buf = self.weights_buffer(slot)
            views = _device_views(u, buf, slot not in self.decoded)
            if blocks is not None and rows.blocks_of(u) is not blocks:
                self.claim_whole(slot, u.tag)  # packed anew by _take: cut anew at its next copy
                blocks = None
            if cut is not None and parts.plan_of(u) is not cut[0]:
                if not cut[1]:
                    self.claim_whole(slot, u.tag)  # (as above)
                cut = None
            if u.ahead_after is not None and blocks is None and (cut is None or cut[1]):
                self._prefetch_along(*u.ahead_after, u)  # (goes whole after all)
                u.ahead_after = None
            lazy = cut is not None and not cut[1]
            if lazy:
                u.parts_armed = [slot, cut[0], 0]  # (the bytes waited for so far; the weights)
                self.counters["forwards_by_parts"] += 1
            if blocks is not None and own:
                rows.arm(
                    module,
                    (
                        lambda upto: self.claim_part(slot, upto, u.tag),
                        lambda: self.claim_whole(slot, u.tag),
                        blocks,
                    ),
                )
                self.counters["forwards_by_rows"] += 1
        self.eng.mark(u.tag, MARK_FWD_BEGIN)
        grad = torch.is_grad_enabled()
        # Reentrant activation checkpointing (``use_reentrant=True``) runs the unit's forward
        # without grad and this recomputation, inside backward, with grad for a nested backward:
        # no forward of the step fetched the weights, so this one does (its gradients leave
        # through ``_Fetch`` as a forward's do). A non-reentrant recomputation only refills
        # tensors saved by a forward that fetched already.
        first = not recompute or u.fetches == 0
        wants = grad and first and any(p.requires_grad for p in u.params)
        fetch = None
        if wants:
            u.count_fetch()
            if u.tree is None:
                dev = _Fetch.apply(u.anchor, u, self, *views)
                fetch = dev[0].grad_fn
            else:
                # Subclassed weights are frozen (offload checks): a placeholder passes for them.
                dev = _Fetch.apply(
                    u.anchor, u, self, *[v if type(v) is torch.Tensor else u.anchor for v in views]
                )
                fetch = dev[0].grad_fn
                dev = [d if type(v) is torch.Tensor else v for d, v in zip(dev, views)]
            # (A subclassed weight did not pass through _Fetch: it is no part of a graph already,
            # and detaching it would rebuild it through its __torch_dispatch__.)
            dev = [
                d if p.requires_grad or type(d) is not torch.Tensor else d.detach()
                for d, p in zip(dev, u.params)
            ]
        elif recompute and grad:
            dev = _leaves(views, u.params)
        else:
            dev = views
        before = [e.owner._parameters[e.name] for e in u.entries]
        if lazy and u.parts_armed is not None:
            # Each layer's weights become the slot's in its own pre-hook, once their part is
            # waited for; until then they are the host's, so a read outside the layers (which
            # the watched forward did not see) gets the host's bytes or fails on their device,
            # never bytes that have not landed.
            u.parts_armed.append(dev)
        else:
            for k, e in enumerate(u.entries):
                if k not in over:  # (a tensor given for the call stays: the module computes on it)
                    e.owner._parameters[e.name] = dev[e.index]  # type: ignore[assignment]
        if cut is not None and cut[1]:
            weights: dict[int, set[int]] = {}
            for e in u.entries:
                weights.setdefault(id(dev[e.index]), set()).add(id(e.owner))
            u.parts_probe = parts.Guard(weights)
            u.parts_probe.__enter__()
        storage = buf.untyped_storage()
        addr = storage.data_ptr()
        ctx = None
        if grad and not recompute:
            outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if outer is None:
                # Tensors saved for backward that live in the slot are kept as references.
                self.slot_owner[addr] = (addr + storage.nbytes(), u)
                ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                ctx.__enter__()
            # Under another saved-tensor hook (a checkpointed region) that hook decides; the
            # recomputation in backward runs on the unit's backward slot.
        # The slot's version counter, which every view of it shares: a forward that writes its
        # weights in place (an EMA codebook, a clamp, ``nn.Embedding(max_norm=...)``) bumps it.
        u.fwd.append((slot, own, ctx, addr, before, fetch, rng, buf, buf._version, own and self._probe(u)))
        if grad and not recompute:
            # (Only the top-level tensors are wrapped: no need to flatten nested inputs first.)
            args, kwargs = self._wrap_inputs(u, args, kwargs)
        return args, kwargs

    def _gather_forward(
        self, u: _Unit, module: nn.Module, args: tuple, kwargs: dict, recompute: bool
    ) -> tuple[tuple, dict] | None:
        """The forward pre-hook of a unit streamed by rows (see :mod:`.gather`): the distinct
        rows its indices read are gathered and copied to the device, and stand for the table
        while its forward runs on the indices remapped into them. Returns the remapped arguments,
        or ``None`` when the whole table is cheaper (the rows take most of its bytes and the
        slots hold it): the forward then streams the table as any unit."""
        param = u.params[0]
        keyword = not args
        ids = kwargs.get("input") if keyword else args[0]
        label = self.gather_label(u)
        gather.check_indices(ids, param.shape[0], self.device, label)
        if not recompute:
            gather.drop_interrupted(self.eng)
        grad_wanted = torch.is_grad_enabled() and param.requires_grad
        if gather.reads_in_place(self.device, grad_wanted, module.max_norm, u.disk is not None):  # type: ignore[arg-type]
            table = self._mapped_table(u)
            if table is not None:
                return self._read_in_place(u, module, table, ids, args, kwargs, label)
        host = gather.host_indices(ids, param.shape[0], label)
        index, inverse = gather.distinct(host)
        row_bytes = param.shape[1] * param.element_size()
        moved = index.numel() * row_bytes
        if self.slots and u.nbytes <= self.slot_bytes and moved >= gather.WHOLE_TABLE_FRACTION * u.nbytes:
            u.gathers.append(None)
            return None
        # A pipelined optimizer step may still be writing the table.
        _engine.wait_updates(u.params)
        found = gather.lookup(param, index, inverse, self.device, module.padding_idx)  # type: ignore[arg-type]
        first = not recompute or u.fetches == 0
        fetch = torch.is_grad_enabled() and first and param.requires_grad
        rows = gather.gathered_rows(u, self, found, param, fetch, recompute)
        if fetch:
            u.count_fetch()
            # The backward writes a zero .grad where there is none: made now, in the background.
            gather.prepare_grad(self.eng, param)
        e = u.entries[0]
        u.gathers.append((e.owner._parameters[e.name], module.padding_idx, found, found.rows._version))
        e.owner._parameters[e.name] = rows  # type: ignore[assignment]
        module.padding_idx = found.padding_idx  # type: ignore[assignment]
        with self.lock:
            c = self.eng.row_counters
            c["row_lookups"] += 1
            c["rows_gathered"] += index.numel()
            c["row_h2d_bytes"] += moved
            if "gathered_bytes" in self.counters:
                self.counters["row_lookups"] += 1
                self.counters["gathered_bytes"] += moved
        if keyword:
            return args, {**kwargs, "input": found.remapped}
        return (found.remapped, *args[1:]), kwargs

    def _mapped_table(self, u: _Unit) -> torch.Tensor | None:
        """``u``'s table as the device reads it in place, made once per table memory (a repack
        makes it anew), or None where its memory is not mapped."""
        param = u.params[0]
        key = (param.data_ptr(), param.numel(), param.dtype)
        if u.mapped is None or u.mapped[0] != key:
            u.mapped = (key, gather.mapped_table(param, self.device))
        return u.mapped[1]

    def _read_in_place(
        self,
        u: _Unit,
        module: nn.Module,
        table: torch.Tensor,
        ids: Any,
        args: tuple,
        kwargs: dict,
        label: str,
    ) -> tuple[tuple, dict]:
        """A lookup that reads the rows its indices name straight from the host table (mapped
        host memory, :func:`.gather.reads_in_place`): the table's device view stands for it
        while its forward runs, on the indices as given (moved to the device). Indices on the
        CPU are checked there (an ``IndexError``, as ``_gather_forward`` raises); on the device
        they are checked as torch checks them for a table on the device."""
        param = u.params[0]
        if ids.device.type == "cpu":
            gather.host_indices(ids, param.shape[0], label)
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        # A pipelined optimizer step may still be writing the table.
        _engine.wait_updates(u.params)
        e = u.entries[0]
        u.gathers.append((e.owner._parameters[e.name], module.padding_idx, None, 0))
        e.owner._parameters[e.name] = table  # type: ignore[assignment]
        read = ids.numel() * param.shape[1] * param.element_size()
        with self.lock:
            c = self.eng.row_counters
            c["row_lookups"] += 1
            c["mapped_lookups"] += 1
            c["mapped_row_bytes"] += read
            if "gathered_bytes" in self.counters:
                self.counters["row_lookups"] += 1
                self.counters["gathered_bytes"] += read
        if not args:
            return args, {**kwargs, "input": ids}
        return (ids, *args[1:]), kwargs

    def _mapped_read_queued(self) -> None:
        """A lookup that reads its table in place was queued: the host table must not change
        until the GPU has read it, and user code may write it (an optimizer's step, ``.data``)
        once the model's forward returns. So the forward's end waits for it (``_end_pass``: by
        then the GPU, kept within a few units of the host by the copies' throttle, is long past
        the lookup); outside a model's pass (a layer run on its own) it is waited for now."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        if self.pass_ends and PassState.FORWARD in self.state:
            self.mapped_reads.append(event)
        else:
            event.synchronize()

    def _settle_mapped_reads(self) -> None:
        """Waits for the in-place reads of this pass's lookups (:meth:`_mapped_read_queued`)."""
        reads, self.mapped_reads = self.mapped_reads, []
        for event in reads:
            event.synchronize()

    def gather_label(self, u: _Unit) -> str:
        """Names ``u`` in the errors of its lookups."""
        return f"ramtorch.offload: embedding {u.name!r}"

    def _end_gather(self, u: _Unit, entry: tuple[Any, ...], output: Any) -> Any:
        """The forward hook of a gathered forward: the table and ``padding_idx`` back; rows that
        the forward renormalised in place (``max_norm``) written into the host table, as
        ``nn.Embedding`` writes its own."""
        before, padding_idx, found, version = entry
        e = u.entries[0]
        e.owner._parameters[e.name] = before
        e.owner.padding_idx = padding_idx  # type: ignore[assignment]
        if found is None:
            self._mapped_read_queued()
        elif found.rows._version != version:
            with torch.no_grad():
                u.params[0].index_copy_(0, found.index, found.rows.detach().to("cpu"))
        return output

    def _undo_gathers(self, u: _Unit) -> None:
        """Puts back what gathered forwards of ``u`` cut short (Ctrl-C skips forward hooks)
        replaced: the table and ``padding_idx``."""
        while u.gathers:
            entry = u.gathers.pop()
            if entry is not None:
                e = u.entries[0]
                e.owner._parameters[e.name] = entry[0]
                e.owner.padding_idx = entry[1]  # type: ignore[assignment]

    def rows_backward(self, u: _Unit, index: torch.Tensor, grad: torch.Tensor | None) -> None:
        """The backward of a gathered forward of ``u``: the gradient of the rows ``index`` goes to
        the rows of the table's ``.grad`` (see :class:`.gather.RowGrads`), or, where the engine must
        see the whole gradient (:func:`.gather.needs_dense`), as a dense gradient through it."""
        param = u.params[0]
        with self.lock:
            self._queue_backward_end()
            if grad is not None and param.requires_grad:
                if gather.needs_dense(param):
                    self.eng.push_grad(param, gather.dense_grad(param, index, grad), self.max_inflight, u.tag)
                else:
                    gather.row_grads(self.eng).push(param, index, grad)
            self._delivered(u, 0)

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
        if is_compiling():
            return opaque(Streamer.post_forward, self, u, module, args, kwargs, output)
        try:
            return self._post_forward(u, output)
        finally:
            self.eng.forwards.release((self._pass_token, u.uid))  # (a unit run on its own)

    def hook_parts(self, u: _Unit) -> None:
        """Hooks on the layers of ``u``, where it can be computed by parts (.parts), so that each
        waits for its own part of the copy (once: the layers of a unit stay its own)."""
        plan = parts.plan_of(u)
        if plan is None or u.parts_handles or parts.compiled_anything():
            return
        for owner in plan.owners:
            if id(owner) in plan.rows:
                rows.adopt(owner)  # its forward goes by blocks of rows where it can
            pre = functools.partial(self.part_pre_forward, u)
            post = functools.partial(self.part_post_forward, u)
            u.parts_handles.append(owner.register_forward_pre_hook(pre))
            u.parts_handles.append(owner.register_forward_hook(post, always_call=True))
        self.hook_handles.extend(u.parts_handles)

    def _unhook_parts(self, u: _Unit) -> None:
        """Takes the hooks of ``hook_parts`` off ``u``'s layers once the process has compiled
        anything: no unit is cut from then on (.parts.by_parts), so they have nothing to do (and
        a hook that Dynamo traces breaks the graph: ``opaque``)."""
        for h in u.parts_handles:
            h.remove()
        u.parts_handles = []
        plan = parts.plan_of(u)
        for owner in plan.owners if plan is not None else ():
            rows.release(owner)

    def part_pre_forward(self, u: _Unit, module: nn.Module, args: tuple) -> None:
        """A layer of a unit computed by parts (.parts): waits for the part that holds its
        weights (on a traced forward too, as a graph break), and enters its guard's stack."""
        if is_compiling():
            return opaque(Streamer.part_pre_forward, self, u, module, args)
        probe = u.parts_probe
        if probe is not None:
            probe.stack.append(id(module))
        armed = u.parts_armed
        if armed is None and probe is None and parts.compiled_anything():
            self._unhook_parts(u)
            return None
        if armed is not None:
            key = id(module)
            plan, slot = armed[1], armed[0]
            upto = plan.upto[key]
            blocks = plan.rows.get(key)
            if blocks is not None and rows.takes(module, args, {}, self.device):
                # The unit's last layer, a large Linear: its forward waits for each block of
                # rows in turn (.rows), and for all of the layer before it returns.
                if upto > armed[2]:
                    rows.arm(
                        module,
                        (
                            lambda at: self.claim_part(slot, at, u.tag),
                            lambda: self.claim_part(slot, upto, u.tag),
                            blocks,
                        ),
                    )
                    armed[2] = upto
                    self.counters["forwards_by_rows"] += 1
            elif upto > armed[2]:
                self.claim_part(slot, upto, u.tag)
                armed[2] = upto
            dev = armed[3]
            for name, index in plan.binds[key]:
                module._parameters[name] = dev[index]
        return None

    def part_post_forward(self, u: _Unit, module: nn.Module, args: tuple, output: Any) -> None:
        if is_compiling():
            return opaque(Streamer.part_post_forward, self, u, module, args, output)
        if type(module) is rows.RowsLinear:
            rows.settle(module)  # armed by part_pre_forward, not taken by a forward: all now
        probe = u.parts_probe
        if probe is not None and probe.stack:
            probe.stack.pop()
        return None

    def _post_forward(self, u: _Unit, output: Any) -> Any:
        if type(u.module) is rows.RowsLinear:
            rows.settle(u.module)  # a forward that did not take the copy by parts: all of it now
        guard, u.parts_probe = u.parts_probe, None
        if guard is not None:
            guard.__exit__(None, None, None)
            plan = parts.plan_of(u)
            if plan is not None:
                mode = bool(getattr(u.module, "training", False))
                (plan.watched if guard.clean else plan.refused).add(mode)
        # (Only a unit's outermost forward is cut: a forward of it nested inside leaves it armed.)
        armed = u.parts_armed if len(u.fwd) <= 1 else None
        if armed is not None:
            u.parts_armed = None
            self.claim_whole(armed[0], u.tag)  # what follows may read any of the unit's bytes
        ahead, u.ahead_after = u.ahead_after, None
        if ahead is not None:
            with self.lock:
                self._prefetch_along(*ahead, u)
        if u.gathers:
            entry = u.gathers.pop()
            if entry is not None:
                return self._end_gather(u, entry, output)
        if not u.fwd:
            return output  # the pre-hook failed before taking a slot
        slot, own, ctx, addr, before, fetch, rng, buf, version, probe = u.fwd.pop()
        try:
            # (A recomputation inside backward runs on the backward slot, while the optimizers may
            # be updating the host weights: what it writes again was kept by the forward.)
            written = own and (u.writes or buf._version != version)
            if own and not written and probe and self._slot_differs(u, buf):
                # A write no version counter saw (through ``.data``): kept, now and from now on.
                u.writes = written = True
            if written:
                self._write_back(u, buf)
            output = self._own_memory(output, addr)
            if own and (probe or u.stashes):
                self._own_stashes(u, addr)
        finally:
            self._end_forward(u, slot, own, ctx, addr, before)
        self.eng.mark(u.tag, MARK_FWD_END)
        if rng is not None:
            _profile.end(rng)
        if own:
            if torch.is_grad_enabled():
                flat = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                for t in flat:
                    t.register_hook(self._pre_backward_hook(u))
                if fetch is not None:
                    self._hook_weight_consumers(u, fetch, [t.grad_fn for t in flat if t.grad_fn is not None])
        return output

    def _probe(self, u: _Unit) -> bool:
        """Whether ``u``'s forward now is its first in its mode (training or evaluation): after
        it, the slot is compared with the host region, to tell whether the forward wrote its
        weights in a way no version counter sees (``self.codebook.data.mul_(...)``: ``.data``
        has a counter of its own). Once per unit and mode; not in a pass that takes copies made
        before it (``weights_unchanged``, a decoding span after its first pass), where a slot may
        hold a copy older than an edit of the host weights."""
        mode = bool(getattr(u.module, "training", False))
        if u.writes or mode in u.probed or getattr(self, "trusted", False):
            return False
        if u.enc is not None and u.enc.codec != "lossless":
            return False  # a lossy copy differs from the host bytes (compressed units are frozen)
        u.probed.add(mode)
        return True

    @staticmethod
    def _slot_differs(u: _Unit, buf: torch.Tensor) -> bool:
        """Whether the slot ``buf`` no longer holds ``u``'s host bytes (its forward wrote them). A
        slot on a GPU is brought to the host in chunks of 64 MiB and compared there: no device
        memory beyond the budget, and no copy of the unit held on either side."""
        assert u.layout is not None and u.flat is not None
        n = u.layout.nbytes
        try:
            if buf.device.type == "cpu":
                return not torch.equal(buf[:n], u.flat[:n])
            step = 64 << 20
            for i in range(0, n, step):
                j = min(n, i + step)
                if not torch.equal(buf[i:j].to("cpu"), u.flat[i:j]):
                    return True
            return False
        finally:
            if u.disk is not None:
                u.disk.settle()  # the pages this read brought in, out of memory again

    def _write_back(self, u: _Unit, buf: torch.Tensor) -> None:
        """``u``'s forward wrote into its device weights in place (an EMA codebook, ``clamp_`` under
        ``no_grad``, ``nn.Embedding(max_norm=...)``): as in torch, the write persists. The slot's
        bytes are copied to the unit's host region before the slot is given back (the other
        weights there are the host's own bytes), and the parameters' version counters are bumped:
        no copy made before the write is taken for the new weights."""
        assert u.layout is not None and u.flat is not None
        if not u.is_home():
            raise RuntimeError(
                f"ramtorch: the forward of unit {u.name!r} wrote its weights in place while their host "
                "copy was replaced (a parameter set or converted during the forward), so the write "
                "cannot be kept: write the weights outside the forward, or not through the "
                "module's parameters during it"
            )
        n = u.layout.nbytes
        with torch.no_grad():
            u.flat[:n].copy_(buf[:n])
        if u.disk is not None:
            u.disk.settle()
        for t in stream_tensors(u.params)[0]:
            torch.autograd.graph.increment_version(t)

    def _own_memory(self, output: Any, addr: int) -> Any:
        """``output`` with every tensor that lives in the slot at ``addr`` (a weight returned as
        is, or a view of it: a position table, a soft prompt) replaced by a copy of its own,
        through autograd: the slot is given back after this forward, and later units overwrite it."""
        if isinstance(output, torch.Tensor):
            return output.clone() if self._in_slot(output, addr) else output
        leaves, spec = tree_flatten(output)
        if not any(isinstance(t, torch.Tensor) and self._in_slot(t, addr) for t in leaves):
            return output
        leaves = [t.clone() if isinstance(t, torch.Tensor) and self._in_slot(t, addr) else t for t in leaves]
        return tree_unflatten(leaves, spec)

    def _own_stashes(self, u: _Unit, addr: int) -> None:
        """Tensors that ``u``'s forward stored on its modules and that live in its slot (``self.
        cache = self.weight[:4]``, a transposed weight kept for the next call) are replaced by
        copies of their own: the slot is given back after this forward and later units overwrite
        it. Unlike torch's view, such a copy does not follow later edits of the weights; a warning
        says so, once per unit. Checked after the unit's first forward in each mode and, once a
        stash is found, after every forward."""
        found: list[str] = []
        for mname, m in u.module.named_modules():
            d = m.__dict__
            for name, v in list(d.items()):
                if name in _MODULE_INTERNALS:
                    continue
                if isinstance(v, torch.Tensor):
                    if not isinstance(v, nn.Parameter) and self._in_slot(v, addr):
                        d[name] = v.clone()
                        found.append(f"{mname}.{name}" if mname else name)
                elif isinstance(v, (list, tuple, dict)) and v:
                    leaves, spec = tree_flatten(v)
                    hit = [isinstance(t, torch.Tensor) and self._in_slot(t, addr) for t in leaves]
                    if any(hit):
                        d[name] = tree_unflatten([t.clone() if h else t for t, h in zip(leaves, hit)], spec)
                        found.append(f"{mname}.{name}" if mname else name)
        if found and not u.stashes:
            u.stashes = True
            warnings.warn(
                f"ramtorch: the forward of unit {u.name!r} stored views of its streamed weights "
                f"({', '.join(found)}); they are replaced by copies, since the weights' device "
                "memory is reused once the forward returns. Unlike views, the copies do not follow "
                "later changes of the weights (an optimizer step): read the parameters again "
                "instead of keeping views of them, or keep the module resident",
                stacklevel=2,
            )

    def _in_slot(self, t: torch.Tensor, addr: int) -> bool:
        """Whether ``t`` lives in the slot whose storage begins at ``addr``."""
        if t.device != self.device:
            return False
        try:
            return t.untyped_storage().data_ptr() == addr
        except (RuntimeError, NotImplementedError):
            return False  # a tensor subclass without storage of its own (its inner tensors are copies)

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

    # -- backward -----------------------------------------------------------------------------

    def _pre_backward_hook(self, u: _Unit) -> Any:
        def hook(grad: torch.Tensor) -> None:
            with self.lock:
                if u.phase is BackwardPhase.IDLE or (self.backward_per_forward and u.bwd is None):
                    self._begin_backward_locked(u)

        return hook

    def _queue_backward_end(self) -> None:
        """The running backward reaches this streamer: its end-of-backward callback is queued
        (once per backward)."""
        if PassState.BACKWARD not in self.state:
            self.state |= PassState.BACKWARD
            self.cur_bwd = []
            self.bwd_pos = 0
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)

    def _begin_backward_locked(self, u: _Unit) -> None:
        self._queue_backward_end()
        # A unit whose backward for one forward ended is reached anew by another forward's, where
        # each runs apart (a pipeline's micro-batches): the itinerary learns one entry each, and
        # prefetches each.
        first = u.phase is BackwardPhase.IDLE or (self.backward_per_forward and u.bwd is None)
        if first:
            u.phase = BackwardPhase.REACHED
        if first:
            self.cur_bwd.append(u.uid)
            self.bwd_pos = self._advance(self.bwd_itin, self.bwd_pos, u.uid)
        nxt = self._lookahead(self.bwd_itin, self.bwd_pos)
        keep = [x.key() for x in nxt]
        if u.bwd is None:
            u.bwd = self._take(u, keep)
            u.phase = BackwardPhase.HELD
            self.eng.mark(u.tag, MARK_BWD_BEGIN)
            if _profile.active():
                u.bwd_range = _profile.begin(f"ramtorch.backward {u.name}")
            # Code that runs the unit's submodules during its backward (a checkpointed region
            # inside the unit recomputing) must find the weights on the device.
            assert u.layout is not None
            views = _device_views(u, self.weights_buffer(u.bwd), u.bwd not in self.decoded)
            views = _leaves(views, u.params)
            for e in u.entries:
                e.owner._parameters[e.name] = views[e.index]  # type: ignore[assignment]
        self._prefetch_along(self.bwd_itin, self.bwd_pos, u, (nxt, keep))

    def weights_backward(self, u: _Unit, grads: Sequence[torch.Tensor | None], sent: set[int]) -> None:
        """:class:`_Fetch`'s backward: gradients of the unit's weights not ``sent`` already leave for
        the host."""
        leaf = self._take_leaf_grads(u)
        for i, (p, g) in enumerate(zip(u.params, grads)):
            if i in sent:
                sent.discard(i)  # (a graph kept for another backward hooks them again)
                continue
            if not p.requires_grad:
                continue
            if i in leaf:
                g = leaf[i] if g is None else g + leaf[i]
            if g is not None:
                self.eng.push_grad(p, g, self.max_inflight, u.tag)
            self._delivered(u, i)
        self.end_backward(u)

    def _take_leaf_grads(self, u: _Unit) -> dict[int, torch.Tensor]:
        """Gradients that a region under reentrant activation checkpointing (``use_reentrant=True``,
        e.g. transformers' ``gradient_checkpointing_enable`` with it) left in ``u``'s backward-time
        weights (:func:`_leaves`): its forward ran without grad on the fetched weights, and its
        recomputation inside backward runs on these leaves, into which a nested backward
        accumulates. They are taken (the leaves' ``.grad`` cleared), by parameter index."""
        out: dict[int, torch.Tensor] = {}
        if u.bwd is None:
            return out
        for e in u.entries:
            t = e.owner._parameters.get(e.name)
            if t is None or t is u.params[e.index] or e.index in out or not t.is_leaf:
                continue
            g = t.grad
            if g is not None:
                out[e.index] = g
                t.grad = None
        return out

    def _push_leaf_grads(self, u: _Unit) -> None:
        """Sends what :meth:`_take_leaf_grads` finds to the host, as the weights' gradients."""
        for i, g in self._take_leaf_grads(u).items():
            if u.params[i].requires_grad:
                self.eng.push_grad(u.params[i], g, self.max_inflight, u.tag)
                self._delivered(u, i)

    def end_backward(self, u: _Unit) -> None:
        with self.lock:
            if u.bwd is not None:
                self._push_leaf_grads(u)
                self.eng.mark(u.tag, MARK_BWD_END)
                slot, u.bwd = u.bwd, None  # forgotten first: an interrupt leaks, never frees twice
                u.phase = BackwardPhase.REACHED
                self._restore(u)
                self._give(slot)
                if u.bwd_range is not None:
                    rng, u.bwd_range = u.bwd_range, None
                    _profile.end(rng)

    @staticmethod
    def _restore(u: _Unit) -> None:
        if not u.fwd:
            for e in u.entries:
                e.owner._parameters[e.name] = u.params[e.index]

    def _release_backward(self) -> None:
        for u in self.streamed:
            if u.bwd is not None:
                self._push_leaf_grads(u)
                slot, u.bwd = u.bwd, None  # forgotten first: an interrupt leaks, never frees twice
                self._restore(u)
                self._give(slot)
            if u.bwd_range is not None:
                rng, u.bwd_range = u.bwd_range, None
                _profile.end(rng)
            u.phase = BackwardPhase.IDLE

    def end_of_backward(self) -> None:
        with self.lock:
            self._release_backward()
            self._drop_ahead()
            self.state &= ~PassState.BACKWARD
            if self.cur_bwd:
                self.bwd_itin = self.cur_bwd
            self.cur_bwd = []
            for u in self.streamed:
                u.reset_backward_counts()
        self.eng.finish()

    # -- reporting --------------------------------------------------------------------------------

    def unit_state(self, u: _Unit) -> UnitState:
        """What ``u`` holds now (see :class:`~ramtorch._stream.units.UnitState`)."""
        state = UnitState.HOME
        if u.uid in self.ahead:
            state |= UnitState.PREFETCHED
        if u.fwd:
            state |= UnitState.FORWARD
        if u.phase is BackwardPhase.HELD:
            state |= UnitState.BACKWARD
        return state

    def stats(self) -> dict[str, Any]:
        gathered = [u for u in self.units if u.gather]
        streamed = [u for u in self.units if not u.resident and not u.gather]
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
            "gathered_units": [u.name for u in gathered],
            "host_bytes": sum(u.nbytes for u in streamed + gathered if u.disk is None),
            "itinerary": [self.by_uid[k].name for k in self.fwd_itin],
            **({} if self.stage is None else {"pipeline_stage": self.stage}),
            **self._compression(streamed),
            **self._disk_stats(streamed),
            **self.counters,
        }

    def _read_cached(self, u: _Unit) -> bool:
        """A disk unit's read for its backward, when it trains: the optimizer writes its weights
        next, and finds their pages in memory (see :meth:`ramtorch._disk.Extent.read`)."""
        return PassState.BACKWARD in self.state and any(p.requires_grad for p in u.params)

    def settle_disk(self) -> None:
        """Writes the units on disk that host code wrote through their parameters (a load) back to
        the store and drops their pages from memory (see :meth:`ramtorch._disk.Extent.settle`)."""
        for u in self.streamed:
            if u.disk is not None:
                u.disk.settle()

    def _disk_stats(self, streamed: list[_Unit]) -> dict[str, Any]:
        """What ``offload(host_budget=..., disk=...)`` did: the units on disk, their bytes, and
        the store's reads (bytes, bandwidth while reading, the time the compute thread waited)."""
        if self.disk_store is None:
            return {}
        return {
            "disk_units": [u.name for u in streamed if u.disk is not None],
            **self.disk_store.stats(),
        }

    @staticmethod
    def _compression(streamed: list[_Unit]) -> dict[str, Any]:
        """What ``offload(compress=...)`` did: the codec, the units streamed encoded with their
        ratio (encoded bytes over raw bytes), and the bytes a pass moves with and without it."""
        codecs = {u.codec for u in streamed if u.codec is not None}
        if not codecs:
            return {}
        enc = {u.name: u.enc for u in streamed if u.enc is not None}
        return {
            "compress": codecs.pop() if len(codecs) == 1 else sorted(codecs),
            "compressed_units": {name: round(e.ratio, 4) for name, e in enc.items()},
            "link_bytes_per_pass": sum(u.enc.nbytes if u.enc is not None else u.nbytes for u in streamed),
        }


run_eagerly(
    Streamer.begin_pass,
    Streamer.end_pass,
    Streamer.pre_forward,
    Streamer.post_forward,
    Streamer.part_pre_forward,
    Streamer.part_post_forward,
)

_STREAMERS: weakref.WeakSet[Streamer] = weakref.WeakSet()


#: Attributes every ``nn.Module`` has (parameters, buffers, submodules, hooks): not the tensors
#: a forward may store on a module.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)


def streamers() -> list[Streamer]:
    """Live offloaded models' streamers."""
    return list(_STREAMERS)
