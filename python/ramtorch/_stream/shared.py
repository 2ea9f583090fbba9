"""Free-standing units: layers that stream themselves (``ramtorch.nn.Linear``, ``Embedding``,
``Conv2d``), one unit each, on one shared streamer per compute device.

They run through the same hooks, slots, itinerary, prefetch, autograd functions and gradient
hand-off as an offloaded model's units (:class:`~ramtorch._stream.streamer.Streamer`); what differs
is that no root module delimits a pass. The forward itinerary is the order in which the device's
free-standing units ran since the last pass began; a pass begins when a unit runs again that
already ran in it, or at the first forward after a backward ended. The backward itinerary is
recorded between the first unit a backward reaches and the end of that backward, as for an
offloaded model.

A layer's forward hooks (:meth:`LayerStreamer.attach`) put device views of its weights in place of
its parameters for its own forward (through ``_Fetch`` when autograd records), so torch's kernels
compute its weight gradients, which leave for the host as soon as each is computed (the early
gradient hooks of :class:`~ramtorch._stream.functions.GradientHooks`).
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import torch
from torch import nn

from .. import _core, _engine
from . import gather
from .compiling import is_compiling, opaque, run_eagerly
from .streamer import PassState, Streamer, inside_ddp_forward, refuse_ddp
from .units import _packed_bytes, _Unit, check_streamable, is_override


class LayerStreamer(Streamer):
    """The streamer of a device's free-standing units (one per compute device: :func:`for_device`)."""

    pass_ends = False

    def __init__(self, device: torch.device) -> None:
        self.model_ref = None
        self.device = device
        self.max_inflight = 1
        self.slots = 0
        self.slot_bytes = 0
        self.budget = None
        self.resident_bytes = 0
        self.eng = _engine.engine_for(device)
        # Units live as long as their layers: held weakly here.
        self.by_uid: weakref.WeakValueDictionary[int, _Unit] = weakref.WeakValueDictionary()
        self.fwd_itin: list[int] = []
        self.end_pair: tuple[int, int | None] | None = None
        self.bwd_itin: list[int] = []
        self.cur_fwd: list[int] = []
        self.cur_bwd: list[int] = []
        self.fwd_pos = 0
        self.bwd_pos = 0
        self.ran: set[int] = set()  # units of the current forward pass
        self.new_pass = True  # a backward ended: the next forward begins a pass
        self.ahead: dict[int, tuple[int, int]] = {}
        self.held = 0
        self.slot_owner: dict[int, tuple[int, _Unit]] = {}
        self.decoded: dict[int, torch.Tensor] = {}  # (ramtorch.nn layers stream raw: stays empty)
        self.part_events: dict[int, list[tuple[int, torch.cuda.Event]]] = {}  # (so does this)
        self.mapped_reads: list[torch.cuda.Event] = []  # (each waited for at once: stays empty)
        self.decode_stream: torch.cuda.Stream | None = None
        self.staged: dict[int, Any] = {}  # (nor from disk: stays empty)
        self.disk_ahead = 1
        self.disk_store = None
        # Free-standing units are always in a forward pass (no root module begins or ends one).
        self.state = PassState.FORWARD
        self.lock = threading.RLock()
        self.touched: set[nn.Module] = set()  # no model whose additions to watch (see .added)
        # Hooked units with a forward running: one that a Ctrl-C cut short (torch skips forward
        # hooks on BaseExceptions) still holds its slot; the next forward releases it.
        self.in_forward: dict[int, _Unit] = {}
        # Reported by the engine's stats as ``layer_*``.
        self.counters = self.eng.layer_counters
        self._pass_token = ("layers", id(self))  # a layer's forward holds (token, unit id)
        self.hook_handles: list[Any] = []
        self.next_uid = 0
        self.eng.add_holder(self)

    @property
    def units(self) -> list[_Unit]:  # type: ignore[override]
        return list(self.by_uid.values())

    @property
    def streamed(self) -> list[_Unit]:  # type: ignore[override]
        return list(self.by_uid.values())

    # -- units ------------------------------------------------------------------------------------

    def forget(self, u: _Unit) -> None:
        """``u`` no longer streams here (its layer moved to another region or device)."""
        with self.lock:
            if u.uid in self.ahead:
                self._drop_ahead(u.uid)
            self.by_uid.pop(u.uid, None)

    def _free_slots(self) -> int:
        free = self.slots - self.held - len(self.ahead)
        if free <= 0:
            # Prefetches of units whose layers are gone will never be claimed: give them back.
            for uid in [k for k in self.ahead if k not in self.by_uid]:
                self._drop_ahead(uid)
            free = self.slots - self.held - len(self.ahead)
        return free

    def _idle(self) -> bool:
        return PassState.BACKWARD not in self.state and not (self.held or self.in_forward)

    def _prefetch(self, u: _Unit, key: int, keep: list[int]) -> int:
        if self._free_slots() <= 0 and not self.ahead:
            self._reconcile()  # every slot counted as held: perhaps one an interrupt left counted
        try:
            return super()._prefetch(u, key, keep)
        except (_core.SlotsExhausted, ValueError):
            # No slot free, or this unit's key still held: an interrupted take or give-back may
            # have left a slot behind. Given back by the reconciliation, then once more.
            self._reconcile()
            return super()._prefetch(u, key, keep)

    def _settle_held(self) -> None:
        """At the start of a hooked forward (outside backward): a slot count that differs from
        what the running units record is an interrupt's leftover."""
        if self.held != len(self.in_forward) and PassState.BACKWARD not in self.state:
            self._reconcile()

    def _check_fits(self, u: _Unit) -> None:
        """``u``'s parameters were set anew in place (``param.data = ...``): the device's slots grow
        to hold them if they must (a layer's slots are the engine's, sized by what streams)."""
        self.eng.reserve(_packed_bytes(u.params), self.slots)

    def _retake(self, u: _Unit, module: nn.Module) -> None:
        """Takes ``module``'s parameters again if one was replaced or removed since the unit was
        packed (``layer.weight = nn.Parameter(...)``, ``load_state_dict(..., assign=True)``,
        ``layer.bias = None``): the unit is packed again, with what the module holds now."""
        # A tensor torch.func.functional_call put in for one call is not a replacement: the unit
        # keeps its own parameter (units.is_override).
        own = {e.name: u.params[e.index] for e in u.entries}
        now = [
            (n, own.get(n, p) if is_override(p, own.get(n)) else p)
            for n, p in module._parameters.items()
            if p is not None
        ]
        if len(now) == len(u.entries) and all(
            e.name == n and u.params[e.index] is p for e, (n, p) in zip(u.entries, now)
        ):
            return
        label = self.gather_label(u)
        for n, p in now:
            if not any(p is q for q in u.params):
                check_streamable(n, p, who=label)
        if u.uid in self.ahead:
            self._drop_ahead(u.uid)
        u.take([(module, n, p) for n, p in now])
        u.pack()
        assert u.layout is not None
        if not u.gather:
            self.eng.reserve(u.layout.nbytes, self.slots)

    def attach(
        self, module: nn.Module, name: str, max_inflight: int, rows: bool = False
    ) -> tuple[_Unit, list[Any]]:
        """Streams ``module``'s own parameters as one unit of this device through its forward hooks,
        as an offloaded model's units run (``ramtorch.nn.Linear``, ``Embedding``, ``Conv2d``): they
        move into one host-arena region. ``rows``: an embedding streamed by rows (:mod:`.gather`), which
        needs no slot. Returns the unit and the hook handles (remove them to detach)."""
        with self.lock:
            u = _Unit(
                self.next_uid,
                name,
                module,
                [(module, n, p) for n, p in module.named_parameters(recurse=False)],
            )
            self.next_uid += 1
            u.pack()
            assert u.layout is not None
            u.gather = rows
            self.by_uid[u.uid] = u
            if not rows:
                self.max_inflight = max(self.max_inflight, max_inflight)
                self.slots = max(self.slots, max_inflight + 1)
                self.eng.reserve(u.layout.nbytes, max_inflight + 1)
        handles = [
            # Partials: the hooks' frames are these methods (see .compiling).
            module.register_forward_pre_hook(functools.partial(self.layer_pre_forward, u), with_kwargs=True),
            module.register_forward_hook(
                functools.partial(self.layer_post_forward, u), with_kwargs=True, always_call=True
            ),
            # A pipelined optimizer step may still be writing the weights that state_dict() hands out.
            module.register_state_dict_pre_hook(
                lambda *_, u=u: self.settle_interrupted() or _engine.wait_updates(u.params)
            ),
        ]
        return u, handles

    def layer_pre_forward(self, u: _Unit, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Forward pre-hook of a hooked unit (see :meth:`attach`)."""
        if is_compiling():
            return opaque(LayerStreamer.layer_pre_forward, self, u, module, args, kwargs)
        _engine.check_fork()
        token = (self._pass_token, u.uid)
        if torch._C._current_graph_task_id() == -1:
            # Another thread's forward on this device runs to its end first (released by the
            # forward hook, which torch calls also when the forward raises).
            self.eng.forwards.acquire(token)
        try:
            if torch._C._current_graph_task_id() == -1:
                trains = torch.is_grad_enabled() and any(
                    p is not None and p.requires_grad for p in module._parameters.values()
                )
                if trains and inside_ddp_forward():
                    refuse_ddp(f"a layer streamed by ramtorch ({type(module).__name__}, trainable)")
                with self.lock:
                    self._check_interrupted(trains)
                    for x in list(self.in_forward.values()):
                        self._unwind(x)
                        if x.uid != u.uid:  # its forward was cut short: its hold ends too
                            self.eng.forwards.release((self._pass_token, x.uid))
                    self.in_forward.clear()
                    self._settle_held()
                    if not u.fwd and u.bwd is None:
                        self._retake(u, module)
            with self.lock:
                self.in_forward[u.uid] = u
            return self.pre_forward(u, module, args, kwargs)
        except BaseException:
            # Cut short (Ctrl-C, a refused input or layer): nothing of this forward stays behind.
            self._abandon(u)
            raise

    def layer_post_forward(self, u: _Unit, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """Forward hook of a hooked unit (always called, also when its forward raised)."""
        if is_compiling():
            return opaque(LayerStreamer.layer_post_forward, self, u, module, args, kwargs, output)
        done = False
        try:
            out = self._post_forward(u, output)
            if not u.fwd:
                with self.lock:
                    self.in_forward.pop(u.uid, None)
            done = True
            return out
        finally:
            if done:
                self.eng.forwards.release((self._pass_token, u.uid))
            else:
                # Cut short between two of its steps: the parameters back, the slot given back.
                self._abandon(u)

    def _unwind(self, u: _Unit) -> None:
        """Undoes what running forwards of ``u`` hold (under the lock): the device views in place
        of its parameters, its slot, its saved-tensor hook. What an interrupt cut short between
        two of these steps (an entry popped, its undoing not done) is undone too: the real
        parameters are put back, and a slot no entry records is given back by the reconciliation
        (:meth:`_settle_held`)."""
        while u.fwd:
            self._end_forward(u, *u.fwd.pop()[:5])
        self._undo_gathers(u)
        for e in u.entries:
            # A device view left in place (a parameter the user set meanwhile is kept).
            if not isinstance(e.owner._parameters.get(e.name), nn.Parameter):
                e.owner._parameters[e.name] = u.params[e.index]
        self._pop_saved_tensor_hooks()

    def _abandon(self, u: _Unit) -> None:
        """A forward of ``u`` that its hooks could not complete: undone, its slot given back, its
        hold on the device's forwards released."""
        try:
            with self.lock:
                self._unwind(u)
                self.in_forward.pop(u.uid, None)
                self._settle_held()
        finally:
            self.eng.forwards.release((self._pass_token, u.uid))

    # -- passes -----------------------------------------------------------------------------------

    def _check_interrupted(self, claim: bool = False) -> None:
        """Outside backward: a backward that raised before its end (Ctrl-C, an error in a hook)
        left its state behind; drop it (see :meth:`Streamer.begin_pass`). ``claim``: a forward
        with gradients, which begins a training step on the engine."""
        interrupted = self.eng.drop_interrupted(claim)
        gather.drop_interrupted(self.eng)
        if PassState.BACKWARD in self.state:
            self.state &= ~PassState.BACKWARD
            self.cur_bwd = []
            interrupted = True
        if interrupted:
            for u in self.streamed:
                u.reset_backward_counts()
            self._release_backward()
            self._pop_saved_tensor_hooks()

    def gather_label(self, u: _Unit) -> str:
        label = getattr(u.module, "_label", None)
        return label() if callable(label) else f"ramtorch.nn.{u.name}"

    def forward_failed(self, u: _Unit) -> None:
        """The running forward of ``u`` raised in its module's own code (a refused input): it
        delivers no gradient, so the count its pre-hook added for the optimizers' hand-off (see
        :meth:`~ramtorch._stream.functions.GradientHooks._delivered`) is taken back."""
        with self.lock:
            if u.fwd and u.fwd[-1][5] is not None:
                entry = u.fwd[-1]
                u.fwd[-1] = (*entry[:5], None, *entry[6:])
                u.uncount_fetch()

    def _record_forward(self, u: _Unit) -> None:
        if self.new_pass or u.uid in self.ran:
            # A new pass: the one that ended is the itinerary now.
            if self.cur_fwd:
                self.fwd_itin = self.cur_fwd
            self.cur_fwd, self.ran, self.fwd_pos, self.new_pass = [], set(), 0, False
            # User code ran since the last pass and may have rewritten weights in a way no
            # version counter sees (``param.data``): no copy made before is trusted.
            self._drop_ahead()
            for x in self.by_uid.values():
                x.forget_copies()
        self.cur_fwd.append(u.uid)
        self.ran.add(u.uid)
        self.fwd_pos = self._advance(self.fwd_itin, self.fwd_pos, u.uid)

    def end_of_backward(self) -> None:
        self.new_pass = True
        super().end_of_backward()


run_eagerly(LayerStreamer.layer_pre_forward, LayerStreamer.layer_post_forward)

_SHARED: dict[torch.device, LayerStreamer] = {}
_SHARED_LOCK = threading.Lock()


def streamers() -> list[LayerStreamer]:
    """The devices' shared streamers made so far."""
    return list(_SHARED.values())


def for_device(device: torch.device) -> LayerStreamer:
    """The streamer of free-standing units computing on ``device`` (normalised), made on first use."""
    s = _SHARED.get(device)
    if s is None:
        with _SHARED_LOCK:
            s = _SHARED.get(device)
            if s is None:
                s = _SHARED[device] = LayerStreamer(device)
    return s
