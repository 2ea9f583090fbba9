"""Optimizer states in host RAM for parameters that live on a GPU (``states="host"``): the
weights fit on the device, the optimizer state does not (the case of ZeRO-Offload and torchao's
``CPUOffloadOptimizer``).

Such a parameter (a model on the GPU that :func:`ramtorch.offload` does not stream, or the units
it keeps resident) keeps its states in host RAM in the format of a host parameter (an fp32 master
of a bf16/fp16 weight and the moments, or what ``precision`` asks for) and is updated by the same
Rust kernels, against a host copy of its weight. A step goes:

- **Gradients leave the device as backward produces them.** A post-accumulate-grad hook on each
  parameter copies its gradient into a page-locked host buffer on a side CUDA stream (once the
  compute stream has produced it), with an event, during the last backward of a step. The
  optimizer learns how many backwards a step has from its first step, as for streamed units.
- **The update is speculated** on the optimizer's worker thread as soon as that copy has landed,
  out of place into spare buffers (``_speculation``), while the GPU runs the rest of the
  backward. Nothing the user sees changes: the weight on the GPU, its ``.grad`` and the states
  stay as torch leaves them until ``step()``.
- **``step()`` commits** each speculation whose inputs are unchanged (the same gradient tensor at
  the same version, hyperparameters, states and weight, no clipping or loss scale: the checks of
  ``_schedule.OverlapSchedule._commit``); the other parameters are updated in ``step()``, from
  the host copy of the gradient when it still is the gradient, else from a fresh copy.
- **The new weights go back** to the device on another side stream, in the order the next forward
  uses them (the reverse of the order their gradients came in), each copy with an event. By
  default (``upload_wait="step"``) the compute stream waits for all of them at the end of
  ``step()``: whatever runs next on it sees the new weights, as after torch's step. With
  ``upload_wait="forward"`` each module's forward waits only for its own parameters' copies (a
  global forward pre-hook while copies are pending), so the first layers compute while the last
  ones are still crossing; code that reads a parameter outside the forward of a module holding it
  must call ``opt.synchronize()`` first.

With several backwards a step (gradient accumulation) only the last one's final gradient crosses.
On a machine without CUDA, a parameter that the streaming engine does not hold (a plain CPU
tensor) takes the same path without copies: the host copy of its weight is the parameter itself
and its gradient is read where it is. Under ``torch.distributed`` with more than one rank
gradients may still change after their hook (DDP reduces them later): they are copied and
updated in ``step()``.

Host memory per bf16 parameter with AdamW and fp32 masters: 12 bytes of states, 2 for the host
copy of the weight and 2 for the gradient (both page-locked), and, while speculating, 14 for the
spare buffers. The device keeps the weight and its gradient only.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _arena, _engine, _log
from . import _assist
from ._jobs import _Jobs
from ._schedule import Timings, UpdateMode
from ._speculation import Shadows, Speculation, freeze_group, same_group
from ._state import _DTYPES

#: Where the states of parameters that are not in host RAM may live.
STATES = ("device", "host")
#: What waits for the new weights of ``states="host"`` parameters (see the module documentation).
UPLOAD_WAITS = ("step", "forward")


def _key(p: torch.Tensor) -> tuple[Any, ...]:
    """What the host copy of ``p``'s weight is a copy of."""
    return (p.device, p.dtype, tuple(p.shape), p.data_ptr())


def _elsewhere(p: torch.Tensor) -> bool:
    """Whether ``p`` lives outside host memory: its update goes through a host copy of its weight
    and gradient, and its new weight is copied back."""
    return p.device.type != "cpu"


def _distributed() -> bool:
    """Whether gradients may change after their hook (DDP reduces them at the end of backward)."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class _Slot:
    """What a parameter with host states keeps besides its states: the host copies of its weight
    and gradient, and the events of their copies."""

    __slots__ = ("got", "got_event", "grad", "host_copy", "key", "upload", "version")

    def __init__(self, p: torch.Tensor) -> None:
        self.key = _key(p)
        #: The host copy of the weight (page-locked); None when the parameter is in host memory.
        self.host_copy: torch.Tensor | None = None
        if _elsewhere(p):
            self.host_copy = _arena.host_empty(tuple(p.shape), p.dtype, pin=True)
        #: ``p._version`` when ``host_copy`` last equalled the parameter (-1: never).
        self.version = -1
        #: The host buffer of the gradient (page-locked; device parameters).
        self.grad: torch.Tensor | None = None
        #: The gradient (tensor, version) that ``grad`` holds (or, in host memory, is).
        self.got: tuple[torch.Tensor, int] | None = None
        self.got_event: Any = None  # its copy (a CUDA event; None: done)
        self.upload: Any = None  # the last copy of ``host_copy`` to the device (a CUDA event)

    def host_grad(self) -> torch.Tensor:
        """The gradient in host memory (its copy landed)."""
        if self.got_event is not None:
            self.got_event.synchronize()
        if self.host_copy is None:
            assert self.got is not None
            return self.got[0]
        assert self.grad is not None
        return self.grad

    def holds(self, grad: torch.Tensor | None) -> bool:
        """Whether the host has (or is copying) ``grad`` as it is now."""
        return (
            grad is not None and self.got is not None and self.got[0] is grad and self.got[1] == grad._version
        )


#: ``step()``'s share of the GPU (``_resident_gpu_share``): the claims, the thread, the error it
#: left, the parameters it updated.
_GpuShare = tuple[dict[int, Any], threading.Thread, list[BaseException], list[torch.nn.Parameter]]


@dataclass(eq=False)
class _Spec(Speculation):
    """A speculative update of a parameter with host states, and whether its job has begun."""

    running: bool = False
    cancelled: bool = False
    finished: threading.Event = field(default_factory=threading.Event)


def _grad_hook(ref: weakref.ref[Any]) -> Callable[[torch.Tensor], None]:
    def hook(p: torch.Tensor) -> None:
        opt = ref()
        if opt is not None:
            opt._on_resident_grad(p)

    return hook


def _forward_hook(ref: weakref.ref[Any]) -> Callable[..., None]:
    def hook(module: torch.nn.Module, args: Any) -> None:
        opt = ref()
        if opt is not None:
            opt._wait_uploads_of(module)

    return hook


class ResidentStates(torch.optim.Optimizer):
    """Host states for parameters that live on a device (a base of ``_optimizer._HostOptimizer``,
    which supplies the scheduling attributes below, ``_update_host``, ``_update_host_into``,
    ``_owns`` and ``_param_ids``)."""

    states: str
    _mode: UpdateMode
    _auto: Any
    _jobs: _Jobs
    _shadows: Shadows
    _spec_closed: bool
    _assist: _assist.GpuAssist | None
    _accumulating: int
    _stepped: bool
    _backwards: int
    _micro: int
    _last_backward: int
    timings: Timings
    _done: dict[int, tuple[torch.Tensor | None, int]]
    _done_hyper: dict[int, dict[str, Any]]
    _late: set[int]
    _error: BaseException | None
    _host_keys: Callable[[], tuple[str, ...]]
    _owns: Callable[[torch.Tensor], bool]
    _param_ids: Callable[[], dict[int, tuple[torch.nn.Parameter, dict[str, Any]]]]
    _update_host: Callable[..., None]
    _update_host_into: Callable[..., None]

    def _init_resident(self, states: str) -> None:
        """Before ``torch.optim.Optimizer.__init__`` (which adds the param groups)."""
        if states not in STATES:
            raise ValueError(
                f"states must be 'device' (optimizer states of parameters on a GPU stay on it) or "
                f"'host' (they live in host RAM, updated by the Rust kernels), got {states!r}"
            )
        self.states = states
        self._slots: dict[int, _Slot] = {}
        self._rspec: dict[int, _Spec] = {}
        self._rhooks: dict[int, Any] = {}
        self._rlock = threading.Lock()
        self._rtask: int | None = None  # the backward whose end is being waited for
        self._arrival = 0
        self._order: dict[int, int] = {}  # id(param) -> when its gradient came (last backward)
        self._uploads: dict[int, Any] = {}  # id(param) -> its copy's event, not yet waited for
        self._upload_hook: Any = None
        self._upload_devices: set[torch.device] = set()  # new weights copied to them this step
        self._caller_waited: set[torch.device] = set()  # their copies waited for step()'s stream
        self._side: dict[tuple[int | None, str], Any] = {}
        self._rfrozen: dict[int, dict[str, Any]] = {}
        self._upload_wait = "step"
        # overlap="backward"/pipeline=True: id(param) -> [whether its update committed during
        # backward has been made] (step() makes those that were not).
        self._roverlap: dict[int, list[bool]] = {}

    # -- user API ----------------------------------------------------------------------------------

    @property
    def upload_wait(self) -> str:
        """With ``states="host"``: what waits for the new weights that ``step()`` copies to the
        GPU. ``"step"`` (default): the compute stream, at the end of ``step()`` (anything queued on
        it after the step sees the new weights). ``"forward"``: each module's forward waits for
        its own parameters only, so the first layers compute while the last weights are still
        copied; a parameter read outside the forward of a module holding it needs
        ``opt.synchronize()`` first."""
        return self._upload_wait

    @upload_wait.setter
    def upload_wait(self, value: str) -> None:
        if value not in UPLOAD_WAITS:
            raise ValueError(f"upload_wait must be one of {UPLOAD_WAITS}, got {value!r}")
        self._settle_uploads()
        self._upload_wait = value

    # -- which parameters ----------------------------------------------------------------------------

    def _hook_resident(self, params: Iterable[Any]) -> None:
        """Hooks the gradients of ``params`` (with ``states="host"``): each copy leaves as backward
        produces it."""
        if self.states != "host":
            return
        hook = _grad_hook(weakref.ref(self))
        for p in params:
            if not isinstance(p, torch.Tensor) or not p.requires_grad or not p.is_leaf:
                continue
            if id(p) not in self._rhooks:
                self._rhooks[id(p)] = p.register_post_accumulate_grad_hook(hook)

    def _unhook_resident(self) -> None:
        for handle in self._rhooks.values():
            handle.remove()
        self._rhooks.clear()
        if self._upload_hook is not None:
            self._upload_hook.remove()
            self._upload_hook = None

    def _is_resident(self, p: torch.Tensor) -> bool:
        """Whether ``p`` takes this path: ``states="host"``, a dtype the kernels take, and not a
        weight the streaming engine holds (those are host parameters already)."""
        return self.states == "host" and p.dtype in _DTYPES and not _engine.is_streamed(p)

    def _slot(self, p: torch.Tensor) -> _Slot:
        slot = self._slots.get(id(p))
        if slot is None or slot.key != _key(p):
            slot = self._slots[id(p)] = _Slot(p)
        return slot

    # -- during backward -----------------------------------------------------------------------------

    def _on_resident_grad(self, p: torch.Tensor) -> None:
        """``p``'s gradient for this backward is accumulated (its post-accumulate-grad hook)."""
        g = p.grad
        if g is None or not self._is_resident(p) or id(p) not in self._param_ids():
            return
        self._count_backward()
        self._arrival += 1
        self._order[id(p)] = self._arrival
        if (
            self._accumulating
            or not self._stepped
            or self._backwards < self._micro - 1
            or g.layout != torch.strided
            or _distributed()
            or not self._owns(p)
        ):
            # The first step learns how many backwards a step has (its copies and updates run in
            # step()); the earlier backwards of a step only accumulate.
            return
        slot = self._slot(p)
        self._fetch(p, slot)
        if self._mode in (UpdateMode.OVERLAP, UpdateMode.PIPELINE):
            self._overlap_resident(p, slot)
        elif self._mode is not UpdateMode.IN_STEP:
            self._speculate_resident(p, slot)

    def _count_backward(self) -> None:
        """Counts this backward at its end (an autograd callback, once per backward): the
        backwards of a step, as the streaming engine counts those that reach it."""
        task = torch._C._current_graph_task_id()
        if task == self._rtask:
            return
        self._rtask = task
        self._rfrozen.clear()  # this backward's hyperparameters are frozen anew
        ref = weakref.ref(self)

        def ended() -> None:
            opt = ref()
            if opt is not None and (task == -1 or task != opt._last_backward):
                opt._backwards += 1
                opt._last_backward = task

        torch.autograd.Variable._execution_engine.queue_callback(ended)

    def _stream(self, device: torch.device, kind: str) -> Any:
        key = (device.index, kind)
        stream = self._side.get(key)
        if stream is None:
            stream = self._side[key] = torch.cuda.Stream(device=device)
        return stream

    def _fetch(self, p: torch.Tensor, slot: _Slot) -> None:
        """Starts the copy of ``p``'s gradient to the host (none for a parameter in host memory).
        Its event is blocking: the worker thread that waits for it sleeps instead of spinning
        (the kernels want every core)."""
        g = p.grad
        assert g is not None
        slot.got, slot.got_event = (g, g._version), None
        if slot.host_copy is None:
            return
        if slot.grad is None or slot.grad.shape != g.shape or slot.grad.dtype != g.dtype:
            slot.grad = _arena.host_empty(tuple(g.shape), g.dtype, pin=True)
        if g.device.type == "cuda":
            stream = self._stream(g.device, "d2h")
            stream.wait_stream(torch.cuda.current_stream(g.device))  # the gradient is computed
            with torch.cuda.stream(stream):
                slot.grad.copy_(g.detach(), non_blocking=True)
                event = torch.cuda.Event(blocking=True)
                event.record(stream)
            g.record_stream(stream)  # freed (zero_grad) before the copy ran: not reused until it has
            slot.got_event = event
        else:
            slot.grad.copy_(g.detach())

    def _refresh(self, p: torch.Tensor, slot: _Slot) -> None:
        """Makes the host copy of the weight the weight again if something other than this
        optimizer wrote the parameter since (a load, an edit)."""
        if slot.host_copy is None or p._version == slot.version:
            return
        if slot.upload is not None:
            slot.upload.synchronize()
        slot.host_copy.copy_(p.detach())
        slot.version = p._version

    def _frozen(self, group: dict[str, Any]) -> dict[str, Any]:
        hyper = self._rfrozen.get(id(group))
        if hyper is None:
            hyper = self._rfrozen[id(group)] = freeze_group(group)
        return hyper

    def _speculate_resident(self, p: torch.Tensor, slot: _Slot) -> None:
        """Queues ``p``'s update into its shadow, for ``step()`` to commit."""
        entry = self._param_ids().get(id(p))
        state = self.state.get(p)
        if entry is None or not state or "step" not in state:
            return  # a first update makes the states: in step()
        shadow = self._shadows.get(p, state, self._host_keys(), pin_param=slot.host_copy is not None)
        if shadow is None:
            return  # the host cannot spare the memory: updated in step()
        self._refresh(p, slot)
        names = (*self._host_keys(), "master")
        step = state["step"]
        spec = _Spec(
            hyper=self._frozen(entry[1]),
            step=int(step.item() if isinstance(step, torch.Tensor) else step) + 1,
            read={n: (state[n], state[n]._version) for n in names if n in state},
            param_version=p._version,
            grad=slot.got,
        )
        with self._rlock:
            old = self._rspec.get(id(p))
            if old is not None and not old.running:
                old.cancelled = True
            self._rspec[id(p)] = spec
        grad = slot.grad if slot.host_copy is not None else p.grad
        event = slot.got_event
        assert grad is not None
        self._queue_update(
            p,
            grad,
            event,
            lambda: event.synchronize() if event is not None else None,
            lambda: self._resident_gpu_job(p, slot, spec, shadow, grad),
            lambda claim: self._resident_job(p, slot, spec, shadow, grad, event, claim),
        )

    def _queue_update(
        self,
        p: torch.Tensor,
        gpu_grad: torch.Tensor | None,
        event: Any,
        gpu_wait: Callable[[], None],
        gpu_job: Callable[[], None],
        cpu_job: Callable[[_assist.Claim | None], None],
    ) -> None:
        """Queues one update of ``p``: offered to the GPU thread (``gpu_updates``, where the GPU
        kernel takes ``p`` with ``gpu_grad``; None: not offered) and submitted to the CPU worker,
        which starts it once ``event`` (its gradient's copy) has completed. The first worker to
        take the claim makes it."""
        claim = None
        assist = self._assist
        if (
            gpu_grad is not None
            and assist is not None
            and assist.enabled
            and _assist.supported(p.device)
            and self._gpu_can_update(p, [gpu_grad])
        ):
            claim = _assist.Claim()
            assist.offer(gpu_wait, [(claim, gpu_job)])
        self._jobs.submit(lambda: cpu_job(claim), event.query if event is not None else None)

    def _overlap_resident(self, p: torch.Tensor, slot: _Slot) -> None:
        """``overlap="backward"`` (and ``pipeline=True``): ``p``'s update is committed now, in
        place, as its gradient has landed: no spare buffers. The CPU updates the host copy and
        copies the new weight back; with ``gpu_updates`` the GPU may update the weight where it
        is instead. Either waits for what backward has queued so far (the last readers of ``p``
        and its gradient). ``step()`` waits for both, checks that the gradient and the
        hyperparameters are still those used, and updates the rest."""
        entry = self._param_ids().get(id(p))
        state = self.state.get(p)
        if entry is None or not state or "step" not in state:
            return  # a first update makes the states: in step()
        group = entry[1]
        pid, g = id(p), p.grad
        assert g is not None
        if pid in self._done:
            self._late.add(pid)  # updated during an earlier backward of this step: step() raises
            return
        self._done[pid] = (g, g._version)
        if id(group) not in self._done_hyper:  # step() checks that they still hold then
            self._done_hyper[id(group)] = freeze_group(group)
        hyper = self._done_hyper[id(group)]
        self._refresh(p, slot)
        used = None
        if p.device.type == "cuda":
            used = torch.cuda.Event()
            used.record(torch.cuda.current_stream(p.device))
        step_value = state["step"]
        step = int(step_value.item() if isinstance(step_value, torch.Tensor) else step_value) + 1
        grad = slot.grad if slot.host_copy is not None else g
        event = slot.got_event
        assert grad is not None
        made = self._roverlap[pid] = [False]
        self._queue_update(
            p,
            g if self._in_place(p) else None,
            event,
            lambda: None,
            lambda: self._overlap_gpu_job(p, slot, hyper, step, g, used, made, (grad, event)),
            lambda claim: self._overlap_cpu_job(p, slot, hyper, grad, event, used, claim, made),
        )

    def _overlap_cpu_job(
        self,
        p: torch.Tensor,
        slot: _Slot,
        hyper: dict[str, Any],
        grad: torch.Tensor,
        event: Any,
        used: Any,
        claim: _assist.Claim | None,
        made: list[bool],
    ) -> None:
        """:meth:`_overlap_resident`'s update on a CPU worker: the host copy (or a parameter in
        host memory) in place, then the new weight's copy to the device."""
        if claim is not None and not claim.take("cpu"):
            return  # the GPU thread makes it (or, dropped by step(), step() does)
        try:
            if event is not None:
                event.synchronize()
            if slot.upload is not None:
                slot.upload.synchronize()  # the host copy was the source of an earlier copy
            t = time.perf_counter()
            self._update_host(p, grad, hyper, 1.0, weight=slot.host_copy)
            self.timings.add("in_backward_seconds", time.perf_counter() - t)
            self.timings.add("in_backward_updates", 1)
            self._upload_after(p, slot, used)
            made[0] = True
        except BaseException as e:  # noqa: BLE001 - step() raises it
            self._error = e

    def _overlap_gpu_job(
        self,
        p: torch.Tensor,
        slot: _Slot,
        hyper: dict[str, Any],
        step: int,
        grad: torch.Tensor,
        used: Any,
        made: list[bool],
        host: tuple[torch.Tensor, Any],
    ) -> None:
        """:meth:`_overlap_resident`'s update on the GPU thread: the weight where it is, from its
        gradient there (as ``step()``'s GPU share does), after ``used``. If the GPU fails, the
        CPU makes it here from ``host`` (the host copy of the gradient and its copy's event), and
        the GPU takes no more."""
        t = time.perf_counter()
        try:
            if slot.upload is not None:
                slot.upload.synchronize()  # the host copy, which the mirror writes, was a copy's source
            args, kw = self._kernel_args(p, [grad], hyper, step, 1.0)
            mirror = None if kw["master"] is not None else slot.host_copy
            kw.update(here=(p, grad), mirror=mirror, after=used)
            events = self._stepper(p.device).step(*args, **kw)
            for ev in events:
                ev.synchronize()
        except Exception as e:  # noqa: BLE001 - the CPU makes it instead
            assert self._assist is not None
            self._assist.enabled = False
            _log.logger.warning("ramtorch.optim: an update on the GPU failed (%s); the CPU does them", e)
            self._overlap_cpu_job(p, slot, hyper, host[0], host[1], used, None, made)
            return
        try:
            self.state[p]["step"] += 1
            self.timings.add("gpu_seconds", time.perf_counter() - t)
            self.timings.add("gpu_updates", 1)
            self.timings.add("in_backward_updates", 1)
            with self._rlock:
                self._written_in_place(p, slot, events[-1] if events else None, used)
            made[0] = True
        except BaseException as e:  # noqa: BLE001 - step() raises it
            self._error = e

    def _close_overlap(self, done: dict[int, Any]) -> None:
        """In ``step()``, once the updates of this backward have ended: a parameter whose update
        committed during backward was not made (an offer to the GPU that ``step()`` dropped) is
        left out of ``done``, for ``step()`` to update."""
        made, self._roverlap = self._roverlap, {}
        for pid, flag in made.items():
            if not flag[0]:
                done.pop(pid, None)

    def _upload_after(self, p: torch.Tensor, slot: _Slot, used: Any) -> None:
        """From a worker: the copy of ``p``'s new weight from its host copy to the device, after
        ``used`` (the backward's last readers of ``p``)."""
        with self._rlock, torch.no_grad():  # a worker thread records autograd by default
            self._upload(p, slot, used)

    def _resident_gpu_job(
        self, p: torch.Tensor, slot: _Slot, spec: _Spec, shadow: dict[str, torch.Tensor], grad: torch.Tensor
    ) -> None:
        """:meth:`_resident_job`'s update on the GPU thread (``gpu_updates``, ``_assist``): the
        same arguments and bits, staged through the device (its gradient copy has landed). An
        error reaches the GPU thread, which leaves the rest to the CPU."""

        def update() -> None:
            if slot.upload is not None:
                slot.upload.synchronize()  # the spare weight was the source of an earlier copy
            t = time.perf_counter()
            args, kw = self._kernel_args(p, [grad], spec.hyper, spec.step, 1.0, shadow, weight=slot.host_copy)
            for ev in self._stepper(p.device).step(*args, **kw):
                ev.synchronize()
            spec.done = True
            self.timings.add("gpu_seconds", time.perf_counter() - t)
            self.timings.add("gpu_updates", 1)
            self.timings.add("speculated_updates", 1)

        self._run_spec(spec, update)

    def _run_spec(self, spec: _Spec, update: Callable[[], None]) -> None:
        """Runs a speculative ``update`` under the speculations' protocol with ``step()``: not if
        ``step()`` has begun or cancelled it; marked running meanwhile (``step()`` waits for a
        running one) and finished after."""
        with self._rlock:
            if spec.cancelled or self._spec_closed:
                spec.finished.set()
                return
            spec.running = True
        try:
            update()
        finally:
            with self._rlock:
                spec.running = False
            spec.finished.set()

    def _resident_job(
        self,
        p: torch.Tensor,
        slot: _Slot,
        spec: _Spec,
        shadow: dict[str, torch.Tensor],
        grad: torch.Tensor,
        event: Any,
        claim: _assist.Claim | None = None,
    ) -> None:
        if claim is not None and not claim.take("cpu"):
            return  # the GPU thread runs it (and marks it finished)

        def update() -> None:
            try:
                if event is not None:
                    event.synchronize()
                if slot.upload is not None:
                    # The spare weight was the source of an earlier copy to the device.
                    slot.upload.synchronize()
                t = time.perf_counter()
                self._update_host_into(p, grad, spec.hyper, spec.step, shadow, weight=slot.host_copy)
                spec.done = True
                self.timings.add("in_backward_seconds", time.perf_counter() - t)
                self.timings.add("in_backward_updates", 1)
                self.timings.add("speculated_updates", 1)
            except Exception:  # noqa: BLE001, S110 - never committed: step() updates it and meets the error
                pass

        self._run_spec(spec, update)

    # -- in step() -----------------------------------------------------------------------------------

    def _close_resident(self) -> dict[int, _Spec]:
        """In ``step()``: speculations not begun are dropped (``step()`` updates those parameters
        in place), running ones are waited for; returns them all."""
        with self._rlock:
            specs, self._rspec = self._rspec, {}
            running = [s for s in specs.values() if s.running]
            for s in specs.values():
                if not s.running and not s.done:
                    s.cancelled = True
        for s in running:
            s.finished.wait()
        return specs

    def _forward_order(self, params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """``params`` in the order the next forward uses them: the last gradients first (those
        with none seen keep their order, after)."""
        order = self._order
        return sorted(params, key=lambda p: -order.get(id(p), 0))

    def _commit_resident(self, specs: dict[int, _Spec], scale: float) -> set[int]:
        """Commits each speculation whose inputs are as ``step()`` sees them, and starts its new
        weight's copy to the device; returns the ids of the parameters committed."""
        committed: set[int] = set()
        owned = self._param_ids()
        keys = self._host_keys()
        chosen = []
        for pid, s in specs.items():
            entry, slot = owned.get(pid), self._slots.get(pid)
            if entry is None or slot is None:
                continue
            p, group = entry
            state = self.state.get(p)
            valid = s.holds(p, state, scale) and slot.key == _key(p) and same_group(s.hyper, group)
            if not valid:
                if s.done:
                    self.timings.add("recomputed_updates", 1)
                continue
            assert state is not None
            new = self._shadows.swap(pid, state, keys)
            if slot.host_copy is None:
                p.copy_(new)
            else:
                slot.host_copy = self._shadows.swap_param(pid, slot.host_copy)
            state["step"] += 1
            committed.add(pid)
            chosen.append(p)
        for p in self._forward_order(chosen):
            self._upload(p, self._slots[id(p)])
        self.timings.add("committed_updates", len(committed))
        return committed

    def _update_resident(self, work: list[tuple[torch.nn.Parameter, dict[str, Any]]], scale: float) -> None:
        """Updates ``work`` (parameter, its group) in ``step()``, in the order the next forward
        uses them, each weight's copy to the device started as soon as it is computed."""
        for p, _ in work:
            if p.grad is not None and p.grad.layout != torch.strided:
                raise ValueError(
                    f"{type(self).__name__}: states='host' takes dense gradients only; a parameter of "
                    f"shape {tuple(p.shape)} has a {p.grad.layout} gradient"
                )
        groups = {id(p): group for p, group in work}
        params = self._forward_order([p for p, _ in work])
        for p in params:  # every copy of a gradient the host lacks starts before the first update
            slot = self._slot(p)
            if not slot.holds(p.grad):
                self._fetch(p, slot)
        gpu = self._resident_gpu_share(params, groups, scale)
        claims = gpu[0] if gpu is not None else {}
        for p in params:
            claim = claims.get(id(p))
            if claim is not None and not claim.take("cpu"):
                continue  # the GPU thread updates it (uploaded below)
            slot = self._slots[id(p)]
            grad = slot.host_grad()
            if slot.upload is not None:
                slot.upload.synchronize()
            self._refresh(p, slot)
            if slot.host_copy is None:
                self._update_host(p, grad, groups[id(p)], scale)
            else:
                self._update_host(p, grad, groups[id(p)], scale, weight=slot.host_copy)
            self.timings.add("in_step_updates", 1)
            self._upload(p, slot)
        if gpu is not None:
            _, thread, errors, done = gpu
            thread.join()
            if errors:
                raise errors[0]
            for p, event in reversed(done):  # the GPU took them from the end: in forward order now
                self.timings.add("in_step_updates", 1)
                if event is None:
                    self._upload(p, self._slots[id(p)])
                else:
                    self._written_in_place(p, self._slots[id(p)], event)

    def _resident_gpu_share(
        self, params: list[torch.nn.Parameter], groups: dict[int, dict[str, Any]], scale: float
    ) -> (
        tuple[
            dict[int, _assist.Claim],
            threading.Thread,
            list[BaseException],
            list[tuple[torch.nn.Parameter, Any]],
        ]
        | None
    ):
        """With ``gpu_updates=True``: a thread that makes ``step()``'s updates of ``params`` (in
        the next forward's order) on the GPU from the end, while the caller makes them from the
        start, each a claim that the first worker runs. It leaves the parameters it updated, for
        the caller to copy to their device once it has ended, with the event of each one it wrote
        in place instead (and the error of one it could not update).

        A weight on the GPU with its gradient there is updated in place (:meth:`_in_place`):
        only its states and master cross the link, each way, and (without a master, whose
        update makes the host copy anew) the host copy of the weight gets the new one. Others
        are staged from their host copies as the CPU's updates are."""
        assist = self._assist
        if assist is None or not assist.enabled:
            return None
        devices = {p.device for p in params if _assist.supported(p.device)}
        if len(devices) != 1:
            return None
        device = next(iter(devices))
        slots = {id(p): self._slots[id(p)] for p in params}
        claims = {}
        in_place = {}
        for p in params:
            slot = slots[id(p)]
            in_place[id(p)] = self._in_place(p)
            if in_place[id(p)]:
                grad = p.grad
            elif slot.host_copy is not None:
                grad = slot.grad
            else:
                grad = slot.got[0] if slot.got else None
            claims[id(p)] = _assist.Claim(grad is not None and self._gpu_can_update(p, [grad]))
        stepper = self._stepper(device)
        after = None
        if device.type == "cuda":  # the gradients and weights read in place are computed
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(device))
        errors: list[BaseException] = []
        done: list[tuple[torch.nn.Parameter, Any]] = []

        # Updates issued and not yet waited for: the next is issued before the last is waited
        # for, so that the link does not idle between two parameters.
        pending: collections.deque[tuple[torch.nn.Parameter, list[Any], bool]] = collections.deque()

        def finish() -> None:
            p, events, here = pending.popleft()
            for ev in events:
                ev.synchronize()
            self.state[p]["step"] += 1
            self.timings.add("gpu_updates", 1)
            done.append((p, events[-1] if here and events else None))

        def work() -> None:
            try:
                for p in reversed(params):
                    if not claims[id(p)].take("gpu"):
                        continue
                    slot = slots[id(p)]
                    here = in_place[id(p)]
                    if slot.upload is not None:
                        slot.upload.synchronize()  # the host copy is a copy's source, or is written
                    if here:
                        grad: torch.Tensor = p.grad  # type: ignore[assignment]
                        weight = None
                    else:
                        grad = slot.host_grad()
                        self._refresh(p, slot)
                        weight = slot.host_copy
                    state = self.state[p]
                    group = groups[id(p)]
                    args, kw = self._kernel_args(
                        p, [grad], group, int(state["step"].item()) + 1, scale, weight=weight
                    )
                    if here:
                        # With a master the host copy of the weight is only ever written (each
                        # update makes it from the master): it need not get this one.
                        mirror = None if kw["master"] is not None else slot.host_copy
                        kw.update(here=(p, grad), mirror=mirror, after=after)
                    try:
                        events = stepper.step(*args, **kw)
                    except Exception as e:  # noqa: BLE001 - the CPU does it (and the rest) instead
                        assist.enabled = False
                        _log.logger.warning(
                            "ramtorch.optim: an update on the GPU failed (%s); the CPU does them", e
                        )
                        while pending:
                            finish()
                        if here:  # the host copy of the gradient: step() started it
                            grad = slot.host_grad()
                            self._refresh(p, slot)
                        self._update_host(p, grad, group, scale, weight=slot.host_copy)
                        done.append((p, None))
                        continue
                    pending.append((p, events, here))
                    if len(pending) > 1:
                        finish()
                while pending:
                    finish()
            except BaseException as e:  # noqa: BLE001 - step() raises it once the thread has ended
                errors.append(e)

        thread = threading.Thread(target=work, name="ramtorch-optim-gpu-step", daemon=True)
        thread.start()
        return claims, thread, errors, done

    def _in_place(self, p: torch.Tensor) -> bool:
        """Whether ``step()``'s GPU share updates ``p`` where it is (a weight on a GPU, its dense
        gradient beside it in its dtype): its weight and gradient do not cross the link."""
        g = p.grad
        return (
            g is not None
            and g.device == p.device
            and g.dtype == p.dtype
            and g.layout == torch.strided
            and g.is_contiguous()
            and p.is_contiguous()
        )

    def _written_in_place(self, p: torch.Tensor, slot: _Slot, event: Any, used: Any = None) -> None:
        """``p`` was updated where it is by the GPU (its host copy too, if it has one): what
        follows waits for ``event`` as it waits for a copy of a new weight. ``used``: the event
        that the update waited for (from a worker; else the caller's stream is waited for)."""
        if p.device.type == "cuda" and event is not None:
            torch.autograd.graph.increment_version(p)  # as the copy of a new weight does
            stream = self._h2d_after(p.device, used)
            stream.wait_event(event)
            self._uploads[id(p)] = (p, event)
        slot.version = p._version

    def _h2d_after(self, device: torch.device, used: Any) -> Any:
        """The side stream that writes new weights into ``device``, made to wait for ``used`` (an
        event after the last readers of a weight, from a worker) or, without it, for everything
        queued on the caller's stream so far (once a step: the backward may still read them)."""
        stream = self._stream(device, "h2d")
        if used is not None:
            stream.wait_event(used)
        elif device not in self._caller_waited:
            stream.wait_stream(torch.cuda.current_stream(device))
            self._caller_waited.add(device)
        self._upload_devices.add(device)
        return stream

    def _upload(self, p: torch.Tensor, slot: _Slot, used: Any = None) -> None:
        """Starts the copy of ``p``'s new weight from its host copy to the device, after
        ``used`` (an event after the last readers of ``p``) or, without it, after everything
        queued on the caller's stream so far."""
        if slot.host_copy is None:
            return
        if p.device.type == "cuda":
            stream = self._h2d_after(p.device, used)
            with torch.cuda.stream(stream):
                p.copy_(slot.host_copy, non_blocking=True)
                event = torch.cuda.Event(blocking=True)
                event.record(stream)
            slot.upload = event
            self._uploads[id(p)] = (p, event)
        else:
            p.copy_(slot.host_copy)
        slot.version = p._version

    def _end_resident_step(self) -> None:
        """At the end of ``step()``: the gradients' host copies are used up (references to
        device gradients are dropped, so that ``zero_grad`` frees them); the compute stream waits
        for the new weights (``upload_wait="step"``), or each forward will (``"forward"``)."""
        for slot in self._slots.values():
            slot.got = None
            slot.got_event = None
        devices, self._upload_devices = self._upload_devices, set()
        self._caller_waited.clear()
        if self._upload_wait == "step":
            for device in devices:
                torch.cuda.current_stream(device).wait_stream(self._stream(device, "h2d"))
            self._uploads.clear()
        elif self._uploads and self._upload_hook is None:
            hook = _forward_hook(weakref.ref(self))
            self._upload_hook = torch.nn.modules.module.register_module_forward_pre_hook(hook)

    def _wait_uploads_of(self, module: torch.nn.Module) -> None:
        """A module's forward begins (``upload_wait="forward"``): the compute stream waits for
        the copies of its own parameters."""
        uploads = self._uploads
        for p in module._parameters.values():
            entry = uploads.pop(id(p), None) if p is not None else None
            if entry is not None:
                torch.cuda.current_stream(entry[0].device).wait_event(entry[1])
        if not uploads and self._upload_hook is not None:
            self._upload_hook.remove()
            self._upload_hook = None

    def _settle_uploads(self) -> None:
        """The compute streams wait for every copy of a new weight still pending."""
        uploads = getattr(self, "_uploads", None)
        if not uploads:
            return
        for p, event in list(uploads.values()):
            torch.cuda.current_stream(p.device).wait_event(event)
        uploads.clear()
        if self._upload_hook is not None:
            self._upload_hook.remove()
            self._upload_hook = None

    def _wait_host_copies(self) -> None:
        """Waits until no host copy of a weight is the source of a copy to a device still running
        (before spare buffers are freed)."""
        for slot in self._slots.values():
            if slot.upload is not None:
                slot.upload.synchronize()

    def _forget_resident_grads(self) -> None:
        """``zero_grad``: the host copies no longer stand for a gradient (references dropped)."""
        for slot in self._slots.values():
            slot.got = None
            slot.got_event = None
