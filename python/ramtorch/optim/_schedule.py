"""The overlap and pipeline scheduler: which updates run during backward (``on_grads``, as each
unit's gradients land), on the worker thread (``_jobs``), and what waits for them: the end of
backward (``before_finish``/``after_finish``), ``step()``, ``drain``/``synchronize``. Optimizers
hear of the gradients of every engine, present and future (``listen``)."""

from __future__ import annotations

import enum
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .. import _engine, _profile
from . import _assist, _gpu_step, _parallel
from ._jobs import _Jobs
from ._speculation import Shadows, Speculation, freeze_group, same_group
from ._state import _is_host, grad_arg, sum_parts


class Timings(dict):
    """``timings``: counters and seconds of the optimizer's updates, a dict to read. The CPU's
    job threads, the GPU's thread and ``step()`` add to them at once: :meth:`add` holds a lock,
    so that no count is lost."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()

    def add(self, key: str, value: float) -> None:
        """Adds ``value`` to counter ``key``."""
        with self._lock:
            self[key] += value


class UpdateMode(enum.Enum):
    """Where an optimizer's updates of host parameters run."""

    #: In ``step()`` only (``overlap=False``, a GradScaler, ZeRO stage 1).
    IN_STEP = "in step"
    #: The default: computed during backward, out of place, and committed by ``step()`` when
    #: everything they read is unchanged (``_speculation``); nothing changes before ``step()``.
    SPECULATE = "speculate"
    #: Committed during the last backward of a step, as gradients land (``overlap="backward"``);
    #: ``backward()`` returns with them done.
    OVERLAP = "overlap"
    #: As OVERLAP, but they run on past ``backward()`` and ``step()`` into the next forward.
    PIPELINE = "pipeline"


#: Guards the making of an optimizer's GPU stagers (``OverlapSchedule._stepper``).
_STEPPERS_LOCK = threading.Lock()

#: Optimizers that update during backward: every engine reports its gradients to them.
_LISTENING: Any = weakref.WeakSet()


def listen(opt: Any) -> None:
    """``opt`` hears of the gradients of every engine, present and future."""
    for e in _engine.engines():
        e.add_listener(opt)
    _LISTENING.add(opt)


def listen_on(eng: _engine.DeviceEngine) -> None:
    """Engines created after an optimizer still report to it."""
    for opt in list(_LISTENING):
        eng.add_listener(opt)


_engine.on_engine_created(listen_on)


def _describe(params: list[torch.nn.Parameter]) -> str:
    """Names a unit's parameters in messages: their count and shapes."""
    shapes = ", ".join(str(tuple(p.shape)) for p in params[:4])
    more = f", ... ({len(params)} in all)" if len(params) > 4 else ""
    return f"parameters of shapes {shapes}{more}"


class OverlapSchedule(torch.optim.Optimizer):
    """The scheduling of an optimizer's updates (a base of ``_optimizer._HostOptimizer``, which
    sets the attributes below in its constructor and supplies ``_update_host``, ``_owns`` and
    ``_param_ids``)."""

    _mode: UpdateMode
    _jobs: _Jobs
    _zero: Any
    _accumulating: int
    _stepped: bool
    _backwards: int
    _saw_grads: bool
    _micro: int
    _last_backward: int
    _done: dict[int, tuple[torch.Tensor, int]]
    _done_hyper: dict[int, dict[str, Any]]  # id(param group) -> its hyperparameters then
    _disk_states: Any  # states on disk (``_state.HostStates``), or None
    _late: set[int]
    _reduced: set[int]
    _reduced_dev: set[int]
    _error: BaseException | None
    _spec: dict[int, Speculation]
    _spec_closed: bool
    _assist: _assist.GpuAssist | None
    _steppers: dict[torch.device, _gpu_step.DeviceStepper]
    _shadows: Shadows
    _auto: Any
    _state_names: tuple[str, ...]
    _host_keys: Callable[[], tuple[str, ...]]  # HostStates: every state tensor of a parameter
    timings: Timings

    @property
    def overlap(self) -> bool:
        """Whether updates are computed during backward (``UpdateMode.SPECULATE``, ``OVERLAP`` or
        ``PIPELINE``), or may be (the default, while it runs in ``step()`` because it measured
        that cheaper). Setting it True turns on speculation (if updates ran in ``step()``);
        ``"backward"`` commits them during backward (``UpdateMode.OVERLAP``)."""
        return self._mode is not UpdateMode.IN_STEP or self._auto is not None

    @overlap.setter
    def overlap(self, on: bool | str) -> None:
        self._auto = None  # the user's choice, kept
        if on == "backward":
            self._mode = UpdateMode.OVERLAP
        elif not on:
            self._mode = UpdateMode.IN_STEP
        elif self._mode is UpdateMode.IN_STEP:
            self._mode = UpdateMode.SPECULATE
        if self._mode is not UpdateMode.IN_STEP:
            listen(self)

    @property
    def speculation_bytes(self) -> int:
        """Host memory held by the spare buffers that speculative updates are computed into."""
        return self._shadows.nbytes

    @property
    def pipeline(self) -> bool:
        """Whether updates run on past ``step()`` (``UpdateMode.PIPELINE``)."""
        return self._mode is UpdateMode.PIPELINE

    @pipeline.setter
    def pipeline(self, on: bool) -> None:
        if on and self._mode is not UpdateMode.IN_STEP:
            self._mode = UpdateMode.PIPELINE
        elif not on and self._mode is UpdateMode.PIPELINE:
            self._mode = UpdateMode.OVERLAP

    @contextmanager
    def accumulate(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients (micro-batches); the update happens
        in the next backward outside (or in ``step()``)."""
        self._accumulating += 1
        try:
            yield
        finally:
            self._accumulating -= 1

    def _updates_in_backward(self) -> bool:
        """Whether host parameters are updated in place during the backward."""
        return self._mode in (UpdateMode.OVERLAP, UpdateMode.PIPELINE)

    def on_grads(self, eng: _engine.DeviceEngine, params: list[torch.nn.Parameter]) -> None:
        """Called by the engine during backward once every gradient of ``params`` is queued."""
        if not self._saw_grads:
            # Only backwards that reach this optimizer's parameters count as its micro-batches
            # (another model's backward on the same engine does not).
            owned = self._param_ids()
            self._saw_grads = any(id(p) in owned for p in params)
        if (
            self._mode is UpdateMode.IN_STEP
            or self._accumulating
            or not self._stepped
            or self._backwards < self._micro - 1
        ):
            # The first step's updates run in step(), which learns whether a GradScaler hands it
            # scaled gradients (overlap is then turned off before any update used them) and how
            # many backwards a step has (all but the last only accumulate).
            return
        if self._mode is UpdateMode.SPECULATE:
            self._speculate(eng, params)
            return
        owned = self._param_ids()
        work = []
        for p in params:
            entry = owned.get(id(p))
            if id(p) in self._done:
                self._late.add(id(p))  # updated during an earlier backward of this step
                continue
            if entry is None or not _is_host(p) or id(p) in self._reduced:
                continue
            # The host tensors whose sum is the gradient (the one accumulated before this backward
            # among them), taken now: by the time the job runs (pipelined steps) the end of
            # backward may have made ``.grad`` one of them.
            parts = eng.pending_gradient(p)
            if not 1 <= len(parts) <= 2:
                continue  # several contributions: summed at the end of backward, updated in step()
            # The group's hyperparameters as they are for this step: with pipelined steps a
            # scheduler may change them (scheduler.step() after opt.step()) before the job runs.
            hyper = {k: v for k, v in entry[1].items() if k != "params"}
            work.append((p, hyper, parts))
            if id(entry[1]) not in self._done_hyper:  # step() checks they still hold then
                self._done_hyper[id(entry[1])] = freeze_group(entry[1])
        if not work:
            return
        marker = eng._core.marker()
        updated = []
        for p, *_ in work:
            if self._owns(p):
                self._done[id(p)] = (None, -1)  # the gradient it becomes is known after backward
                updated.append(p)
            else:
                self._reduced.add(id(p))  # ZeRO-2: reduced to its owner during backward
        update = _engine.Update(_describe(updated))
        _engine.updates_begin(updated, update)
        try:
            self._jobs.submit(
                lambda: self._run_job(eng, marker, work, updated, update),
                lambda: eng._core.marker_done(marker),
            )
        except BaseException:
            # Interrupted (Ctrl-C) around the submission: readers must not wait for an update that
            # may never run (if it did get queued, the drain of the interrupted backward waits).
            _engine.updates_end(updated, update)
            raise

    def _speculate(self, eng: _engine.DeviceEngine, params: list[torch.nn.Parameter]) -> None:
        """Queues the updates of ``params`` into their shadows (``_speculation``): nothing the
        user sees changes until ``step()`` commits them."""
        owned = self._param_ids()
        names = (*self._host_keys(), "master")
        frozen: dict[int, dict[str, Any]] = {}  # each group's hyperparameters, frozen once
        work = []
        for p in params:
            entry = owned.get(id(p))
            if entry is None or not _is_host(p) or not self._owns(p):
                continue
            parts = eng.pending_gradient(p)
            if not 1 <= len(parts) <= 2:
                continue  # several contributions: summed at the end of backward, updated in step()
            state = self.state.get(p)
            if not state or "step" not in state:
                continue  # a first update makes the states: in step()
            if self._disk_states is not None and p in self._disk_states:
                continue  # states on disk: updated in place in step() (no spare copy in RAM)
            shadow = self._shadows.get(p, state, self._host_keys())
            if shadow is None:
                continue  # the host cannot spare the memory: updated in step()
            step = state["step"]
            hyper = frozen.get(id(entry[1]))
            if hyper is None:
                hyper = frozen[id(entry[1])] = freeze_group(entry[1])
            spec = Speculation(
                hyper=hyper,
                step=int(step.item() if isinstance(step, torch.Tensor) else step) + 1,
                read={n: (state[n], state[n]._version) for n in names if n in state},
                param_version=p._version,
            )
            # A later backward of the same step replaces it (the gradient read is then the sum).
            self._spec[id(p)] = spec
            work.append((p, spec, shadow, parts, None))
        if not work:
            return
        marker = eng._core.marker()
        if self._assist is not None and self._assist.enabled and _assist.supported(eng.device):
            offered = []
            for k, (p, spec, shadow, parts, _) in enumerate(work):
                if self._gpu_can_update(p, parts):
                    claim = _assist.Claim()
                    work[k] = (p, spec, shadow, parts, claim)
                    offered.append((claim, self._gpu_update(eng.device, p, spec, shadow, parts)))
            self._assist.offer(lambda: eng._core.wait_marker(marker), offered)
        self._jobs.submit(
            lambda: self._speculate_job(eng, marker, work),
            lambda: eng._core.marker_done(marker),
        )

    def _speculate_job(self, eng: _engine.DeviceEngine, marker: int, work: list[Any]) -> None:
        spans = _engine.host_spans
        begin = time.perf_counter() if spans is not None else 0.0
        if self._spec_closed:
            return
        try:
            eng._core.wait_marker(marker)
        except BaseException:  # noqa: BLE001 - the copies failed: nothing commits; step() recomputes
            return
        t = time.perf_counter()
        done: list[torch.nn.Parameter] = []

        def one(item: tuple[Any, ...]) -> None:
            p, spec, shadow, parts, claim = item
            if self._spec_closed or self._spec.get(id(p)) is not spec:
                return  # step() has begun (it updates the rest), or replaced, or dropped
            if claim is not None and not claim.take("cpu"):
                return  # the GPU runs it (_assist)
            try:
                self._update_host_into(p, grad_arg(parts, p), spec.hyper, spec.step, shadow)
            except Exception:  # noqa: BLE001 - never committed; step() updates it and meets the error
                return
            spec.done = True
            done.append(p)  # list.append is atomic: small ones run side by side (_parallel)

        _parallel.run(one, work, lambda item: item[0].numel())
        end = time.perf_counter()
        self.timings.add("in_backward_seconds", end - t)
        self.timings.add("in_backward_updates", len(done))
        self.timings.add("speculated_updates", len(done))
        if spans is not None and done:
            spans.add(spans.WORKER, "wait for gradients of", begin, t, done, eng.device)
            spans.add(spans.WORKER, "speculative update", t, end, done, eng.device)

    def _gpu_can_update(self, p: torch.nn.Parameter, parts: list[torch.Tensor]) -> bool:
        """Whether the GPU kernel computes ``p``'s update from these gradient parts (tensors of
        one float dtype, contiguous, in host memory or beside ``p`` on its GPU; states in a format
        the kernel has)."""
        where = parts[0].device
        if where.type != "cpu" and where != p.device:
            return False
        if any(g.device != where or not g.is_contiguous() or g.dtype != parts[0].dtype for g in parts):
            return False
        try:
            args, kw = self._kernel_args(p, list(parts), self._group_of(p), 1, 1.0)
        except (KeyError, ValueError):
            return False
        rule, _, dst, grad, states = args
        return (
            _gpu_step.layout(rule, dst, grad[0], states, kw["master"], kw["comp"], kw["scales"]) is not None
        )

    def _stepper(self, device: torch.device) -> _gpu_step.DeviceStepper:
        """The GPU updates' stager of ``device`` (made on first use, by whichever thread)."""
        with _STEPPERS_LOCK:
            stepper = self._steppers.get(device)
            if stepper is None:
                stepper = self._steppers[device] = _gpu_step.DeviceStepper(device)
            return stepper

    def _group_of(self, p: torch.nn.Parameter) -> dict[str, Any]:
        entry = self._param_ids().get(id(p))
        if entry is None:
            raise KeyError("not this optimizer's parameter")
        return entry[1]

    def _gpu_update(
        self,
        device: torch.device,
        p: torch.nn.Parameter,
        spec: Speculation,
        shadow: dict[str, torch.Tensor],
        parts: list[torch.Tensor],
    ) -> Callable[[], None]:
        """The speculative update of ``p`` as the GPU thread runs it (``_assist``): the same
        arguments as the CPU's (``_kernel_args``), computed by ``_gpu_step`` on ``device``,
        done once the results are in the shadow."""

        def run() -> None:
            if self._spec_closed or self._spec.get(id(p)) is not spec:
                return
            stepper = self._stepper(device)
            t = time.perf_counter()
            args, kw = self._kernel_args(p, list(parts), spec.hyper, spec.step, 1.0, shadow)
            for ev in stepper.step(*args, **kw):
                ev.synchronize()
            spec.done = True
            self.timings.add("gpu_seconds", time.perf_counter() - t)
            self.timings.add("gpu_updates", 1)
            self.timings.add("speculated_updates", 1)

        return run

    def _commit(self, spec: dict[int, Speculation], scale: float) -> set[int]:
        """In ``step()``: commits each speculation whose inputs are as ``step()`` sees them (the
        same gradient at the same version, hyperparameters, states and weight, and no scaling);
        returns the ids of the parameters committed. The others are updated by ``step()``."""
        committed: set[int] = set()
        if not spec:
            return committed
        owned = self._param_ids()
        same: dict[tuple[int, int], bool] = {}  # (frozen hyperparameters, group) compared once
        copies: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        for pid, s in spec.items():
            entry = owned.get(pid)
            if entry is None:
                continue
            p, group = entry
            key = (id(s.hyper), id(group))
            if key not in same:
                same[key] = same_group(s.hyper, group)
            state = self.state.get(p)
            valid = s.holds(p, state, scale) and same[key]
            if not valid:
                if s.done:
                    self.timings.add("recomputed_updates", 1)
                continue
            assert state is not None
            copies.append((p, self._shadows.swap(pid, state, self._host_keys())))
            state["step"] += 1
            committed.add(pid)
        # The new weights into the parameters, small ones side by side (torch's copy of a tensor
        # of fewer than 32k elements runs on one core).
        _parallel.run(lambda pn: pn[0].copy_(pn[1]), copies, lambda pn: pn[0].numel())
        self.timings.add("committed_updates", len(committed))
        return committed

    def _run_job(
        self,
        eng: _engine.DeviceEngine,
        marker: int,
        work: list[Any],
        updated: list[torch.nn.Parameter],
        update: _engine.Update,
    ) -> None:
        error: BaseException | None = None
        try:
            if _profile.active():
                with _profile.span("ramtorch.optimizer_update"):
                    self._update_job(eng, marker, work)
            else:
                self._update_job(eng, marker, work)
        except BaseException as e:  # noqa: BLE001 - surfaced by drain()/step() and by readers
            error = self._error = e
        finally:
            _engine.updates_end(updated, update, error)

    def _update_job(self, eng: _engine.DeviceEngine, marker: int, work: list[Any]) -> None:
        spans = _engine.host_spans  # ramtorch.trace is recording (None otherwise)
        begin = time.perf_counter() if spans is not None else 0.0
        eng._core.wait_marker(marker)
        t = time.perf_counter()
        for p, group, parts in work:
            grad = grad_arg(parts, p)
            if self._zero is not None and id(p) not in self._reduced_dev:
                # ZeRO-2: this unit's gradients go to their owners now, while backward runs on.
                if isinstance(grad, list):
                    grad = sum_parts(grad)
                self._zero.reduce_one(p, grad)
                if not self._owns(p):
                    continue
            self._update_host(p, grad, group, 1.0)
        end = time.perf_counter()
        self.timings.add("in_backward_seconds", end - t)
        self.timings.add("in_backward_updates", len(work))
        if spans is not None:
            params = [w[0] for w in work]
            spans.add(spans.WORKER, "wait for gradients of", begin, t, params, eng.device)
            owned = [p for p in params if self._owns(p)]
            # ZeRO-2: a job of parameters that other ranks own only reduces their gradients.
            label = "update" if owned else "reduce gradients of"
            spans.add(spans.WORKER, label, t, end, owned or params, eng.device)

    def synchronize(self) -> None:
        """Waits for every update queued so far (see ``pipeline``); raises if one failed."""
        self.drain()

    def before_finish(self, eng: _engine.DeviceEngine) -> None:
        """Called by ``eng`` at the end of backward, before it writes ``.grad``. Without
        ``pipeline`` the updates made during backward are waited for (``backward()`` returns with
        them done); with it they run on, unless a gradient they read is about to be added to."""
        task = torch._C._current_graph_task_id()  # once per backward (engines may call it again)
        if self._saw_grads and (task == -1 or task != self._last_backward):
            self._backwards += 1
            self._last_backward = task
        self._saw_grads = False
        owned = self._param_ids()
        if self._mode is UpdateMode.SPECULATE:
            # Speculative updates run on past backward (step() waits for them), unless one reads a
            # gradient that the end of backward is about to add to.
            if any(
                not s.done and eng.adds_into_grad(owned[pid][0])
                for pid, s in self._spec.items()
                if pid in owned
            ):
                self.drain()
            return
        if self._mode is not UpdateMode.PIPELINE or self._zero is not None:
            self.drain()
            return
        if any(eng.adds_into_grad(owned[pid][0]) for pid in self._done if pid in owned):
            self.drain()

    def _wait_updates(self) -> None:
        """Until every queued update has finished, on the CPU worker and on the GPU thread."""
        self._jobs.wait()
        if self._assist is not None:
            self._assist.wait()

    def drain(self, interrupted: bool = False) -> None:
        """Waits for the updates queued during backward. After an interrupted backward the
        parameters already updated stay updated (the step is partly done; the error says so)."""
        self._wait_updates()
        self._raise_failed()
        if interrupted:
            self._spec.clear()
            self._done.clear()
            self._done_hyper.clear()
            self._late.clear()
            self._reduced.clear()
            self._reduced_dev.clear()

    def _forget_failed(self) -> None:
        """Waits for the queued updates and drops the error of a failed one (a load replaces
        what it left)."""
        self._wait_updates()
        self._error = None

    def _raise_failed(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"{type(self).__name__}: an update during backward failed: {err}") from err

    def after_finish(self) -> None:
        """Called by the engine once backward has written ``.grad``: remembers each gradient the
        updates used, to detect later changes to it."""
        owned = self._param_ids()
        for pid, s in self._spec.items():
            entry = owned.get(pid)
            if s.grad is None and entry is not None and entry[0].grad is not None:
                g = entry[0].grad
                s.grad = (g, g._version)
        for pid in list(self._done):
            entry = self._param_ids().get(pid)
            if pid not in self._late and entry is not None and entry[0].grad is not None:
                g = entry[0].grad
                self._done[pid] = (g, g._version)
        for pid in self._reduced:
            entry = self._param_ids().get(pid)
            if entry is not None:
                entry[0].grad = None  # ZeRO-2: another rank owns it; its gradient was sent there
