"""Optimizers that update parameters in host RAM with Rust kernels (all cores, SIMD), overlapped
with the backward pass.

``ramtorch.optim.AdamW``, ``SGD`` and ``Lion`` are real :class:`torch.optim.Optimizer` s: param
groups, LR schedulers, ``state_dict``/``load_state_dict`` and ``zero_grad`` work as usual, and
parameters that are not in host RAM (units kept resident on the GPU, norms) are updated too, with
torch's own kernels on their device.

**Overlap.** In a model streamed by :func:`ramtorch.offload`, a unit's weights are updated as soon
as the last of its gradients for the step has reached host RAM, on a CPU thread, while the GPU runs
the backward of the units before it. ``loss.backward()`` returns when the updates are done, and
``step()`` has only the GPU-resident parameters left. Updates run during the last backward before
``step()``: the optimizer learns from the first step (whose updates run in ``step()``) how many
backward passes a step has, k, and the first k - 1 of each step only accumulate gradients, as
inside ``with opt.accumulate():`` (which also works); a step with fewer backwards updates in
``step()``. If gradients are changed between ``backward()`` and ``step()`` (``clip_grad_norm_``, a
``GradScaler`` unscaling them, more backwards than any step before outside ``accumulate()``), an
update made during backward would have used the unchanged ones: ``step()`` detects it and raises.
Use ``max_grad_norm=`` for clipping (global-norm clipping needs every gradient, so the updates then
run in ``step()``: the overlap is lost). The first step's updates always run in ``step()``: a
``torch.amp.GradScaler`` shows itself there (its gradients are scaled until ``step()`` unscales
them), and the optimizer then updates in ``step()`` from then on, with the unscaling and the inf
check folded into the kernels. A scaler that appears only after overlapped steps is an error; pass
``overlap=False`` for that.

**Pipelined steps** (``pipeline=True``). The optimizer work of a step (reading and writing
every state in host RAM) usually takes longer than the backward it overlaps, and the first unit's
gradient arrives last. With ``pipeline=True``, ``backward()`` and ``step()`` return without waiting
for the updates still queued: they run on while the next forward starts, in the order that forward
needs them (the newest gradients that have landed first), and the forward waits for each unit's
update before streaming its weights. What reads the weights through ramtorch waits the same way:
``model.state_dict()``, ``opt.state_dict()``, ``ramtorch.save_checkpoint``,
``ramtorch.synchronize()`` and ``opt.synchronize()``. Code of yours that reads host parameters
directly between ``step()`` and the next forward (an EMA of the weights, logging their norms) must
call ``opt.synchronize()`` first, or it may see a mix of old and new weights. Not with ZeRO
(``shard()``), where ``step()`` publishes the new weights to the other ranks.

:func:`ramtorch.trace` shows where a step's optimizer time goes: each update, on the worker
thread (during backward, pipelined) or in ``step()``, and each wait of a forward or another reader
for a pipelined update, on the timeline of the device's copies and compute.

**Precision.** Parameters in fp32 are updated in place with fp32 states. bf16/fp16 parameters get
an fp32 master copy in host RAM (``precision="fp32-master"``, the default; 16 bytes a parameter with
the bf16 weight and gradient) and the weight is rewritten from it, rounded to nearest. With
``precision="bf16"``, bf16 parameters keep bf16 states and are written with stochastic rounding
(8 bytes a parameter), trading some accuracy for capacity.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from . import _arena, _core, _engine

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_PRECISIONS = ("fp32-master", "bf16")


def _is_host(p: torch.Tensor) -> bool:
    return p.device.type == "cpu" and p.dtype in _DTYPES


class _Jobs:
    """The optimizer's update jobs, run one at a time on a thread of their own (each kernel uses
    every core). Without ZeRO the newest job whose gradients have landed runs first: once updates
    fall behind the backward, the units whose gradients came last are the ones the next forward
    needs first, and a job whose gradients are still being copied does not hold up one whose
    gradients are there. When none has landed, the oldest runs (waiting for its copy): copies
    land in the order they were queued. With ZeRO jobs run in submission order, so that every
    rank issues its collectives in the same order."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._queue: list[tuple[Callable[[], None], Callable[[], bool] | None]] = []
        self._unfinished = 0
        self._closing = False
        self._thread: threading.Thread | None = None
        self.lifo = True

    def submit(self, job: Callable[[], None], ready: Callable[[], bool] | None = None) -> None:
        """Queues ``job``; ``ready()`` tells whether it can start without waiting (None: it can)."""
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="ramtorch-optim", daemon=True)
                self._thread.start()
            self._queue.append((job, ready))
            self._unfinished += 1
            self._cv.notify_all()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._queue.pop(self._pick())[0]
            try:
                job()  # jobs record their own errors
            finally:
                with self._cv:
                    self._unfinished -= 1
                    self._cv.notify_all()
            # A job holds its optimizer: dropped now, not when the next job comes (an optimizer
            # deleted with updates pending is freed, and closes this thread, right here).
            del job

    def _pick(self) -> int:
        """Index of the job to run next (the lock is held)."""
        if not self.lifo:
            return 0
        for i in range(len(self._queue) - 1, -1, -1):
            ready = self._queue[i][1]
            try:
                if ready is None or ready():
                    return i
            except Exception:  # noqa: BLE001 - the job itself meets the error and records it
                return i
        return 0

    def wait(self) -> None:
        """Until every job submitted so far has finished."""
        with self._cv:
            while self._unfinished:
                self._cv.wait()

    def busy(self) -> bool:
        return self._unfinished > 0

    def close(self) -> None:
        self.wait()
        with self._cv:
            self._closing = True
            self._cv.notify_all()


class _HostOptimizer(torch.optim.Optimizer):
    """Shared machinery: host parameters through Rust kernels, the rest through torch."""

    #: torch.amp.GradScaler passes its scale and inf flag to step() (as ``grad_scale`` and
    #: ``found_inf`` attributes) instead of unscaling every gradient in a pass of its own.
    _step_supports_amp_scaling = True

    _state_names: tuple[str, ...] = ()

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        precision: str = "fp32-master",
        overlap: bool = True,
        pipeline: bool = False,
        max_grad_norm: float | None = None,
    ) -> None:
        if precision not in _PRECISIONS:
            raise ValueError(f"precision must be one of {_PRECISIONS}, got {precision!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm!r}")
        super().__init__(params, defaults)
        self.precision = precision
        self.max_grad_norm = max_grad_norm
        self.overlap = overlap and max_grad_norm is None
        self.pipeline = pipeline and self.overlap
        self._accumulating = 0
        self._stepped = False
        # Backward passes since the last step(), and the most any step has had: with k micro-
        # batches a step, the first k - 1 backwards only accumulate, as inside accumulate().
        self._backwards = 0
        self._micro = 1
        self._last_backward = -1  # autograd's id of the last backward counted
        self._seed = 0x5EED
        self._jobs = _Jobs()
        # id(param) -> version of the gradient buffer the update used, for params updated during
        # the last backward (checked in step(): the gradient must not have changed since).
        self._done: dict[int, tuple[torch.Tensor, int]] = {}
        # Parameters updated during a backward that got gradients again from a later backward of
        # the same step (more backwards than any step before, outside accumulate()): step() raises.
        self._late: set[int] = set()
        self._error: BaseException | None = None
        self._group: Any = None
        self._owner: dict[int, int] | None = None  # id(param) -> rank updating it (ZeRO)
        self._reduced: set[int] = set()  # ZeRO-2: ids of others' parameters reduced in backward
        self._reduced_dev: set[int] = set()  # ZeRO-2: ids of parameters reduced on the device
        # ZeRO: the other ranks' states gathered here by consolidate_state_dict(), by parameter
        # index, until the next update.
        self._consolidated: dict[int, dict[str, Any]] | None = None
        if self.overlap:
            for e in _engine.engines():
                e.add_listener(self)
            _LISTENING.add(self)
        #: Seconds and tensor updates of the Rust kernels, during backward and in ``step()``.
        self.timings = {
            "in_backward_seconds": 0.0,
            "in_backward_updates": 0,
            "in_step_seconds": 0.0,
            "in_step_updates": 0,
        }

    # -- user API ----------------------------------------------------------------------------------

    def shard(self, group: Any = None, stage: int = 1) -> _HostOptimizer:
        """ZeRO over ``torch.distributed`` (``group``: a process group, default the world): each
        rank keeps optimizer state for, and updates, only its share of the parameters (balanced
        by size). Each gradient is averaged onto its owner (``reduce``), the owner updates the
        parameter, and the new value reaches the other ranks in ``step()``: for free when the
        parameters are in shared host memory (``ramtorch.distributed.share_parameters``), else by
        ``broadcast`` from the owner.

        ``stage=1`` reduces and updates in ``step()``. ``stage=2`` reduces each unit's gradients
        as soon as they have landed, during backward (the owner updates right away, as without
        ZeRO), and a rank keeps only the gradients it owns. Returns the optimizer."""
        if stage not in (1, 2):
            raise ValueError(f"{type(self).__name__}.shard(): stage must be 1 or 2, got {stage!r}")
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__}.shard(): torch.distributed is not initialised")
        world = dist.get_world_size(group)
        # Every rank must shard the same parameters with the same settings: compare before any
        # collective of a step could pair up wrong tensors.
        mine = (
            type(self).__name__,
            stage,
            self.precision,
            [
                (tuple(p.shape), str(p.dtype), {k: v for k, v in g.items() if k != "params"})
                for g in self.param_groups
                for p in g["params"]
            ],
        )
        theirs: list[Any] = [None] * world
        dist.all_gather_object(theirs, repr(mine), group=group)
        for r, other in enumerate(theirs):
            if other != theirs[0]:
                raise ValueError(
                    f"{type(self).__name__}.shard(): rank {r} has different parameters or settings "
                    f"than rank 0 (optimizer, stage, precision, shapes, dtypes, hyperparameters): "
                    f"{_first_diff(theirs[0], other)}"
                )
        loads = [0] * world
        owner: dict[int, int] = {}
        for g in self.param_groups:
            for p in g["params"]:
                r = min(range(world), key=lambda k: (loads[k], k))
                owner[id(p)] = r
                loads[r] += p.numel()
        self.drain()
        self._group, self._owner = group, owner
        self.zero_stage = stage
        self._jobs.lifo = False  # collectives in the same order on every rank
        self.pipeline = False  # step() publishes the new weights to the other ranks
        if stage == 1:
            self.overlap = False
        elif self.overlap:
            for e in _engine.engines():
                e.add_listener(self)
            _LISTENING.add(self)
        return self

    def reduce_grad(self, p: torch.Tensor, grad: torch.Tensor) -> bool | None:
        """Called by the engine with each gradient of a streamed parameter on the compute device,
        before it leaves for the host. ZeRO-2 reduces it there, onto its owner (over NVLink/PCIe
        with NCCL, not through host RAM); returns whether this rank keeps it (None: not ours)."""
        if self._owner is None or self.zero_stage != 2 or id(p) not in self._owner:
            return None
        self._reduce_one(p, grad)
        self._reduced_dev.add(id(p))
        return self._owns(p)

    def _reduce_one(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        import torch.distributed as dist

        assert self._owner is not None
        owner = self._owner[id(p)]
        dst = dist.get_global_rank(self._group, owner) if self._group is not None else owner
        dist.reduce(grad, dst=dst, op=dist.ReduceOp.SUM, group=self._group)
        if owner == dist.get_rank(self._group):
            grad.div_(dist.get_world_size(self._group))

    def _zero_reduce(self, skip: set[int]) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None and id(p) not in skip:
                    self._reduce_one(p, p.grad)

    def _zero_publish(self) -> None:
        import torch.distributed as dist

        assert self._owner is not None
        for g in self.param_groups:
            for p in g["params"]:
                if not p.requires_grad or getattr(p, "_ramtorch_shared", False):
                    continue
                src = self._owner[id(p)]
                src = dist.get_global_rank(self._group, src) if self._group is not None else src
                dist.broadcast(p.data, src=src, group=self._group)
        dist.barrier(group=self._group)

    def _owns(self, p: torch.Tensor) -> bool:
        if self._owner is None:
            return True
        import torch.distributed as dist

        return self._owner[id(p)] == dist.get_rank(self._group)

    @contextmanager
    def accumulate(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients (micro-batches); the update happens
        in the next backward outside (or in ``step()``)."""
        self._accumulating += 1
        try:
            yield
        finally:
            self._accumulating -= 1

    def _param_ids(self) -> dict[int, tuple[torch.nn.Parameter, dict[str, Any]]]:
        cache = self.__dict__.get("_ids_cache")
        if cache is None:
            cache = {id(p): (p, group) for group in self.param_groups for p in group["params"]}
            self.__dict__["_ids_cache"] = cache
        return cache

    # -- overlap -------------------------------------------------------------------------------------

    def on_grads(self, eng: _engine.DeviceEngine, params: list[torch.nn.Parameter]) -> None:
        """Called by the engine during backward once every gradient of ``params`` is queued."""
        if not self.overlap or self._accumulating or not self._stepped or self._backwards < self._micro - 1:
            # The first step's updates run in step(), which learns whether a GradScaler hands it
            # scaled gradients (overlap is then turned off before any update used them) and how
            # many backwards a step has (all but the last only accumulate).
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
            bufs = eng.pending_buffers(p)
            if len(bufs) != 1:
                continue  # several contributions: summed at the end of backward, updated in step()
            # The gradient accumulated before this backward, read now: by the time the job runs
            # (pipelined steps) the end of backward may have made ``.grad`` this very buffer.
            # The group's hyperparameters as they are for this step: with pipelined steps a
            # scheduler may change them (scheduler.step() after opt.step()) before the job runs.
            hyper = {k: v for k, v in entry[1].items() if k != "params"}
            work.append((p, hyper, bufs[0], p.grad))
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
        self._jobs.submit(
            lambda: self._run_job(eng, marker, work, updated, update), lambda: eng._core.marker_done(marker)
        )

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
        for p, group, buf, prior in work:
            grad = buf if prior is None else prior + buf
            if self._owner is not None and id(p) not in self._reduced_dev:
                # ZeRO-2: this unit's gradients go to their owners now, while backward runs on.
                self._reduce_one(p, grad)
                if not self._owns(p):
                    continue
            self._update_host(p, grad, group, 1.0)
        end = time.perf_counter()
        self.timings["in_backward_seconds"] += end - t
        self.timings["in_backward_updates"] += len(work)
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

    def before_finish(self) -> None:
        """Called by the engine at the end of backward, before it writes ``.grad``. Without
        ``pipeline`` the updates made during backward are waited for (``backward()`` returns with
        them done); with it they run on, unless a gradient they read is about to be added to."""
        task = torch._C._current_graph_task_id()  # once per backward (engines may call it again)
        if task == -1 or task != self._last_backward:
            self._backwards += 1
            self._last_backward = task
        if not self.pipeline or self._owner is not None:
            self.drain()
            return
        owned = self._param_ids()
        if any(owned[pid][0].grad is not None for pid in self._done if pid in owned):
            self.drain()

    def drain(self, interrupted: bool = False) -> None:
        """Waits for the updates queued during backward. After an interrupted backward the
        parameters already updated stay updated (the step is partly done; the error says so)."""
        self._jobs.wait()
        self._raise_failed()
        if interrupted:
            self._done.clear()
            self._late.clear()
            self._reduced.clear()
            self._reduced_dev.clear()

    def _forget_failed(self) -> None:
        """Waits for the queued updates and drops the error of a failed one (a load replaces
        what it left)."""
        self._jobs.wait()
        self._error = None

    def _raise_failed(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"{type(self).__name__}: an update during backward failed: {err}") from err

    def after_finish(self) -> None:
        """Called by the engine once backward has written ``.grad``: remembers each gradient the
        updates used, to detect later changes to it."""
        for pid in list(self._done):
            entry = self._param_ids().get(pid)
            if pid not in self._late and entry is not None and entry[0].grad is not None:
                g = entry[0].grad
                self._done[pid] = (g, g._version)
        for pid in self._reduced:
            entry = self._param_ids().get(pid)
            if entry is not None:
                entry[0].grad = None  # ZeRO-2: another rank owns it; its gradient was sent there

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, but states of host parameters keep their
        own dtype (fp32 master and moments of a bf16 parameter stay fp32) and live in host RAM, in
        tensors of their own (``state_dict``'s tensors are copied, not shared). A failed update of
        this optimizer is forgotten: the loaded state replaces what it left."""
        self._load_states(state_dict, adopt=False)

    def _load_state_dict_adopting(self, state_dict: dict[str, Any]) -> None:
        """As :meth:`load_state_dict`, but host states become ``state_dict``'s own tensors, with
        no copy: for a loader that has just read them into fresh host memory for this optimizer."""
        self._load_states(state_dict, adopt=True)

    def _kept_state_indices(self) -> set[int] | None:
        """Indices of the parameters whose state a load keeps: a sharded optimizer keeps its own
        share only (None: all)."""
        if self._owner is None:
            return None
        params = [p for g in self.param_groups for p in g["params"]]
        return {i for i, p in enumerate(params) if self._owns(p)}

    def _drop_host_states(self) -> None:
        """Frees the states of host parameters (before a load reads new ones: one copy at a time)."""
        self.synchronize()
        for p in [p for p in self.state if _is_host(p)]:
            del self.state[p]

    def _load_states(self, state_dict: dict[str, Any], adopt: bool) -> None:
        self._forget_failed()
        params = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in state_dict.get("param_groups", []) for i in g.get("params", [])]
        original = state_dict.get("state", {})
        host: dict[Any, torch.nn.Parameter] = {}
        if len(saved_ids) == len(params):  # else torch's load_state_dict raises on the sizes
            host = {i: p for i, p in zip(saved_ids, params) if _is_host(p)}
        # torch's own loading for the rest: it would cast host states to the parameter's dtype.
        rest = dict(state_dict)
        rest["state"] = {i: v for i, v in original.items() if i not in host}
        super().load_state_dict(rest)
        self.__dict__.pop("_ids_cache", None)
        with torch.no_grad():
            for i, p in host.items():
                saved = original.get(i)
                if saved is None:
                    continue
                st = self.state[p]
                for k, v in saved.items():
                    if isinstance(v, torch.Tensor) and not adopt:
                        if k != "step" and v.is_floating_point():
                            t = _arena.host_empty(tuple(v.shape), v.dtype, pin=False)
                            t.copy_(v)
                            v = t
                        else:
                            v = v.clone()
                    st[k] = v
        if self._owner is not None:  # ZeRO: a whole optimizer's state; this rank keeps its share
            for p in [p for p in self.state if not self._owns(p)]:
                del self.state[p]
        self._consolidated = None

    def _index_of(self, p: torch.nn.Parameter) -> int:
        """Position of ``p`` among the optimizer's parameters (seeds its stochastic rounding)."""
        index = self.__dict__.get("_index_cache")
        if index is None:
            index = {id(q): k for k, q in enumerate(q for g in self.param_groups for q in g["params"])}
            self.__dict__["_index_cache"] = index
        return index.get(id(p), 0)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self.__dict__.pop("_ids_cache", None)
        self.__dict__.pop("_index_cache", None)

    # -- step --------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Finishes the step: waits for the updates made during backward, checks their gradients
        were not changed since, and updates every other parameter that has a gradient."""
        self._consolidated = None  # the state changes
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # torch.amp.GradScaler hands us its scale and inf flag instead of unscaling the gradients
        # itself (see _step_supports_amp_scaling): unscaling is folded into the kernels.
        # (The scaler sets both attributes for this call and deletes them after it.)
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        self._stepped = True
        if (grad_scale is not None or found_inf is not None) and self.overlap:
            # Gradients are scaled until step() unscales them: updates cannot run in backward.
            self.overlap = self.pipeline = False
        if self.pipeline and grad_scale is None and found_inf is None:
            self._raise_failed()  # the updates of this step run on; the next forward waits for them
        else:
            self.drain()
        done, self._done = self._done, {}
        late, self._late = self._late, set()
        backwards, self._backwards = self._backwards, 0
        if late:
            raise RuntimeError(
                f"{type(self).__name__}: {len(late)} parameters were updated during a backward and "
                f"then got gradients from another backward before step(): this step had {backwards} "
                f"backward passes, more than any step before ({self._micro}), and the update used "
                "the gradients of the first ones only, so this step is wrong. Run every backward "
                "but the last inside `with opt.accumulate():` (or pass overlap=False)."
            )
        self._micro = max(self._micro, backwards)
        if (grad_scale is not None or found_inf is not None) and done:
            raise RuntimeError(
                f"{type(self).__name__}: a GradScaler is in use, but {len(done)} parameters were "
                "already updated during backward with the scaled gradients; this step's update is "
                "wrong (reload the weights from a checkpoint). Pass overlap=False with a GradScaler."
            )
        if found_inf is not None and float(found_inf) > 0:
            return loss  # GradScaler: inf/nan in the gradients, the step is skipped
        owned = self._param_ids()
        for pid, (grad, version) in done.items():
            p = owned[pid][0] if pid in owned else None
            if p is not None and (p.grad is not grad or grad._version != version):
                raise RuntimeError(
                    f"{type(self).__name__}: a gradient was changed or replaced after backward "
                    "(gradient clipping, GradScaler unscaling, a hook?) but its parameter was "
                    "already updated during backward with the gradient as it was. Use "
                    "max_grad_norm= for clipping, overlap=False with a GradScaler, and accumulate() "
                    "around the backward passes of micro-batches."
                )
        reduced, self._reduced = self._reduced, set()
        reduced_dev, self._reduced_dev = self._reduced_dev, set()
        if self._owner is not None:
            self._zero_reduce(reduced | reduced_dev | set(done))
        scale = 1.0 if grad_scale is None else 1.0 / float(grad_scale)
        if self.max_grad_norm is not None:
            scale *= self._clip_scale(scale)
        spans = _engine.host_spans  # ramtorch.trace is recording (None otherwise)
        t = time.perf_counter()
        for index, group in enumerate(self.param_groups):
            dev_params = []
            for p in group["params"]:
                if p.grad is None or id(p) in done or not self._owns(p):
                    continue
                if _is_host(p):
                    start = time.perf_counter() if spans is not None else 0.0
                    self._update_host(p, p.grad, group, scale)
                    self.timings["in_step_updates"] += 1
                    if spans is not None:  # one parameter; the trace joins those of a unit
                        end = time.perf_counter()
                        spans.add(spans.CALLER, "update", start, end, (p,), None, {"param_group": index})
                else:
                    dev_params.append(p)
            if dev_params:
                start = time.perf_counter() if spans is not None else 0.0
                if scale != 1.0:
                    torch._foreach_mul_([p.grad for p in dev_params], scale)
                self._update_torch(dev_params, group)
                if spans is not None:  # on a GPU: the time to launch the kernels
                    end = time.perf_counter()
                    where = dev_params[0].device
                    spans.add(
                        spans.CALLER, "torch update", start, end, dev_params, where, {"param_group": index}
                    )
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and _is_host(p):
                    # The kernels wrote through raw pointers: tell autograd and the streaming
                    # engine (which keys device copies on version counters) that p changed.
                    torch.autograd.graph.increment_version(p)
        self.timings["in_step_seconds"] += time.perf_counter() - t
        if self._owner is not None:
            self._zero_publish()
        return loss

    def _clip_scale(self, unscale: float = 1.0) -> float:
        total = 0.0
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None or not self._owns(p):
                    continue
                if g.device.type == "cpu" and g.dtype in _DTYPES and g.is_contiguous():
                    sq, _ = _core.grad_stats(g, _DTYPES[g.dtype], g.numel())
                    total += sq
                else:
                    total += float(g.detach().float().square().sum())
        if self._owner is not None:
            import torch.distributed as dist

            t = torch.tensor([total], dtype=torch.float64)
            dist.all_reduce(t, group=self._group)
            total = float(t.item())
        norm = total**0.5 * unscale
        self.last_grad_norm = norm
        return min(1.0, self.max_grad_norm / (norm + 1e-6)) if self.max_grad_norm is not None else 1.0

    # -- per-parameter state ---------------------------------------------------------------------------

    def _host_state(self, p: torch.nn.Parameter) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            low = p.dtype != torch.float32
            bf16_mode = self.precision == "bf16" and p.dtype == torch.bfloat16
            if low and not bf16_mode and p.dtype == torch.float16 and self.precision == "bf16":
                raise ValueError("precision='bf16' needs bfloat16 parameters, got float16")
            sdtype = torch.bfloat16 if bf16_mode else torch.float32
            state["step"] = torch.tensor(0.0)
            for name in self._state_names:
                state[name] = _arena.host_empty(tuple(p.shape), sdtype, zeroed=True, pin=False)
            if low and not bf16_mode:
                master = _arena.host_empty(tuple(p.shape), torch.float32, pin=False)
                master.copy_(p.detach())
                state["master"] = master
        return state

    def _update_host(
        self, p: torch.nn.Parameter, grad: torch.Tensor, group: dict[str, Any], scale: float
    ) -> None:
        if not p.is_contiguous():
            raise ValueError(f"{type(self).__name__}: host parameters must be contiguous")
        if grad.dtype not in _DTYPES or not grad.is_contiguous() or grad.device.type != "cpu":
            grad = grad.detach().to(device="cpu", dtype=p.dtype).contiguous()
        self._consolidated = None  # the state changes
        state = self._host_state(p)
        state["step"] += 1
        step = int(state["step"].item())
        master = state.get("master")
        names = self._state_names
        sdt = state[names[0]].dtype if names else torch.float32
        self._kernel(
            p,
            grad,
            [state[n] for n in names],
            _DTYPES[sdt],
            master,
            step,
            group,
            scale,
            hash((self._seed, step, self._index_of(p))) & ((1 << 63) - 1),
        )

    def _kernel(
        self,
        p: torch.Tensor,
        grad: torch.Tensor,
        states: list[torch.Tensor],
        state_dtype: str,
        master: torch.Tensor | None,
        step: int,
        group: dict[str, Any],
        scale: float,
        seed: int,
    ) -> None:
        raise NotImplementedError

    def _update_torch(self, params: list[torch.nn.Parameter], group: dict[str, Any]) -> None:
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``; zeroing gradients in place first waits for the
        updates still reading them (``pipeline``)."""
        if not set_to_none and self._jobs.busy():
            self._jobs.wait()
        super().zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """As ``torch.optim.Optimizer.state_dict``, once the pending updates are done.

        A sharded optimizer (``shard()`` over several ranks) holds the state of its share of the
        parameters only: its state dict is the whole optimizer's on the rank that
        :meth:`consolidate_state_dict` gathered it on, until the next update; elsewhere this
        raises (a shard saved as if it were the optimizer would lose the other ranks' state)."""
        self.drain()
        sd = super().state_dict()
        if self._owner is None or self._world() == 1:
            return sd
        if self._consolidated is None:
            import torch.distributed as dist

            raise RuntimeError(
                f"{type(self).__name__} is sharded over {self._world()} ranks (ZeRO): rank "
                f"{dist.get_rank(self._group)} holds the state of its share of the parameters only. "
                "Call opt.consolidate_state_dict(to=0) on every rank, then opt.state_dict() or "
                "ramtorch.save_checkpoint(...) on rank 0 (before the next step)"
            )
        sd["state"] = dict(sorted({**sd["state"], **self._consolidated}.items()))
        return sd

    def _world(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(self._group)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """ZeRO: gathers every rank's optimizer state on rank ``to`` of the group, where
        :meth:`state_dict` then returns the state of every parameter, as one unsharded optimizer
        would (save it there: ``ramtorch.save_checkpoint``). A collective: every rank of the group
        calls it. Rank ``to`` holds a copy of the other ranks' state until the next update.
        Loading that state dict into the sharded optimizer on every rank (``load_state_dict`` or
        ``ramtorch.load_checkpoint``) keeps each rank's share."""
        if self._owner is None:
            raise RuntimeError(
                f"{type(self).__name__}.consolidate_state_dict(): the optimizer is not sharded"
            )
        import torch.distributed as dist

        world, me = self._world(), dist.get_rank(self._group)
        if not 0 <= to < world:
            raise ValueError(f"consolidate_state_dict(to={to!r}): the group has ranks 0..{world - 1}")
        self.drain()
        local = super().state_dict()["state"]
        # What each rank holds, by parameter index: tensors by shape and dtype, other values as is.
        mine = {
            i: {
                k: ("tensor", tuple(v.shape), str(v.dtype)) if torch.is_tensor(v) else ("value", v)
                for k, v in st.items()
            }
            for i, st in local.items()
        }
        described: list[Any] = [None] * world
        dist.all_gather_object(described, mine, group=self._group)

        def global_rank(r: int) -> int:
            return dist.get_global_rank(self._group, r) if self._group is not None else r

        gathered: dict[int, dict[str, Any]] = {}
        for r in range(world):
            if r == to:
                continue
            for i in sorted(described[r]):
                if me == r:
                    for k in sorted(local[i]):
                        if torch.is_tensor(local[i][k]):
                            dist.send(local[i][k].contiguous(), dst=global_rank(to), group=self._group)
                elif me == to:
                    st: dict[str, Any] = {}
                    for k, d in sorted(described[r][i].items()):
                        if d[0] == "tensor":
                            t = torch.empty(d[1], dtype=getattr(torch, d[2].removeprefix("torch.")))
                            dist.recv(t, src=global_rank(r), group=self._group)
                            st[k] = t
                        else:
                            st[k] = d[1]
                    gathered[i] = st
        self._consolidated = gathered if me == to else None
        dist.barrier(group=self._group)

    def __del__(self) -> None:
        jobs = getattr(self, "_jobs", None)
        if jobs is not None:
            jobs.close()


_LISTENING: Any = __import__("weakref").WeakSet()


def _describe(params: list[torch.nn.Parameter]) -> str:
    """Names a unit's parameters in messages: their count and shapes."""
    shapes = ", ".join(str(tuple(p.shape)) for p in params[:4])
    more = f", ... ({len(params)} in all)" if len(params) > 4 else ""
    return f"parameters of shapes {shapes}{more}"


def _first_diff(a: str, b: str) -> str:
    """Where two settings descriptions part, with some context."""
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"rank 0 has ...{a[max(0, i - 40) : i + 40]}... where it has ...{b[max(0, i - 40) : i + 40]}..."


def listen_on(eng: _engine.DeviceEngine) -> None:
    """Engines created after an optimizer still report to it."""
    for opt in list(_LISTENING):
        eng.add_listener(opt)


_engine.on_engine_created(listen_on)


class AdamW(_HostOptimizer):
    """AdamW (decoupled weight decay, as :class:`torch.optim.AdamW`) with host parameters updated
    by Rust kernels, overlapped with backward (see the module documentation).

    Args:
        params: parameters or param groups.
        lr, betas, eps, weight_decay, maximize: as in ``torch.optim.AdamW``.
        precision: ``"fp32-master"`` (default) or ``"bf16"`` (bf16 states, stochastic rounding).
        overlap: update units during backward as their gradients land.
        pipeline: let ``step()`` return while the last updates run on; the next forward waits
            for each unit's update before streaming it (see the module documentation).
        max_grad_norm: clip the global gradient norm to this (disables the overlap).
    """

    _state_names = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        maximize: bool = False,
        precision: str = "fp32-master",
        overlap: bool = True,
        pipeline: bool = False,
        max_grad_norm: float | None = None,
    ) -> None:
        if not lr >= 0 or not eps >= 0 or not weight_decay >= 0:
            raise ValueError(f"AdamW: lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"AdamW: betas must be in [0, 1), got {betas}")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "maximize": maximize}
        super().__init__(
            params,
            defaults,
            precision=precision,
            overlap=overlap,
            pipeline=pipeline,
            max_grad_norm=max_grad_norm,
        )

    def _kernel(
        self,
        p: torch.Tensor,
        grad: torch.Tensor,
        states: list[torch.Tensor],
        state_dtype: str,
        master: torch.Tensor | None,
        step: int,
        group: dict[str, Any],
        scale: float,
        seed: int,
    ) -> None:
        b1, b2 = group["betas"]
        _core.adamw_step(
            param=p,
            param_dtype=_DTYPES[p.dtype],
            grad=grad,
            grad_dtype=_DTYPES[grad.dtype],
            exp_avg=states[0],
            exp_avg_sq=states[1],
            state_dtype=state_dtype,
            master=master,
            numel=p.numel(),
            step=step,
            lr=float(group["lr"]),
            beta1=float(b1),
            beta2=float(b2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            maximize=bool(group["maximize"]),
            grad_scale=scale,
            seed=seed,
        )

    def _update_torch(self, params: list[torch.nn.Parameter], group: dict[str, Any]) -> None:
        states = [self.state[p] for p in params]
        for p, st in zip(params, states):
            if not st:
                st["step"] = torch.tensor(0.0, device=p.device) if p.is_cuda else torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        b1, b2 = group["betas"]
        torch.optim.adamw.adamw(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            foreach=None,
            fused=all(p.is_cuda for p in params) or None,
            amsgrad=False,
            beta1=b1,
            beta2=b2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
        )


class SGD(_HostOptimizer):
    """SGD with momentum (as :class:`torch.optim.SGD`), host parameters updated by Rust kernels,
    overlapped with backward. Arguments as ``torch.optim.SGD`` plus ``precision``, ``overlap``,
    ``pipeline``, ``max_grad_norm`` (see :class:`AdamW`)."""

    _state_names = ("momentum_buffer",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        precision: str = "fp32-master",
        overlap: bool = True,
        pipeline: bool = False,
        max_grad_norm: float | None = None,
    ) -> None:
        if not lr >= 0 or not momentum >= 0 or not weight_decay >= 0:
            raise ValueError(
                f"SGD: lr, momentum and weight_decay must be >= 0, got {lr}, {momentum}, {weight_decay}"
            )
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("SGD: nesterov needs momentum > 0 and dampening = 0")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": maximize,
        }
        super().__init__(
            params,
            defaults,
            precision=precision,
            overlap=overlap,
            pipeline=pipeline,
            max_grad_norm=max_grad_norm,
        )

    def _kernel(
        self,
        p: torch.Tensor,
        grad: torch.Tensor,
        states: list[torch.Tensor],
        state_dtype: str,
        master: torch.Tensor | None,
        step: int,
        group: dict[str, Any],
        scale: float,
        seed: int,
    ) -> None:
        _core.sgd_step(
            param=p,
            param_dtype=_DTYPES[p.dtype],
            grad=grad,
            grad_dtype=_DTYPES[grad.dtype],
            momentum_buffer=states[0] if group["momentum"] != 0 else None,
            state_dtype=state_dtype,
            master=master,
            numel=p.numel(),
            lr=float(group["lr"]),
            momentum=float(group["momentum"]),
            dampening=float(group["dampening"]),
            weight_decay=float(group["weight_decay"]),
            nesterov=bool(group["nesterov"]),
            maximize=bool(group["maximize"]),
            first_step=step == 1,
            grad_scale=scale,
            seed=seed,
        )

    def _update_torch(self, params: list[torch.nn.Parameter], group: dict[str, Any]) -> None:
        bufs = [self.state[p].get("momentum_buffer") for p in params]
        torch.optim.sgd.sgd(
            params,
            [p.grad for p in params],
            bufs,
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            lr=group["lr"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            maximize=group["maximize"],
        )
        for p, b in zip(params, bufs):
            self.state[p]["momentum_buffer"] = b


class Lion(_HostOptimizer):
    """Lion (Chen et al., 2023): ``p -= lr * (sign(b1*m + (1-b1)*g) + wd*p)``, then
    ``m = b2*m + (1-b2)*g``. Host parameters through Rust kernels, overlapped with backward;
    ``precision``, ``overlap``, ``pipeline``, ``max_grad_norm`` as in :class:`AdamW`."""

    _state_names = ("exp_avg",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        precision: str = "fp32-master",
        overlap: bool = True,
        pipeline: bool = False,
        max_grad_norm: float | None = None,
    ) -> None:
        if not lr >= 0 or not weight_decay >= 0:
            raise ValueError(f"Lion: lr and weight_decay must be >= 0, got {lr}, {weight_decay}")
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"Lion: betas must be in [0, 1), got {betas}")
        defaults = {"lr": lr, "betas": betas, "weight_decay": weight_decay, "maximize": maximize}
        super().__init__(
            params,
            defaults,
            precision=precision,
            overlap=overlap,
            pipeline=pipeline,
            max_grad_norm=max_grad_norm,
        )

    def _kernel(
        self,
        p: torch.Tensor,
        grad: torch.Tensor,
        states: list[torch.Tensor],
        state_dtype: str,
        master: torch.Tensor | None,
        step: int,
        group: dict[str, Any],
        scale: float,
        seed: int,
    ) -> None:
        b1, b2 = group["betas"]
        _core.lion_step(
            param=p,
            param_dtype=_DTYPES[p.dtype],
            grad=grad,
            grad_dtype=_DTYPES[grad.dtype],
            exp_avg=states[0],
            state_dtype=state_dtype,
            master=master,
            numel=p.numel(),
            lr=float(group["lr"]),
            beta1=float(b1),
            beta2=float(b2),
            weight_decay=float(group["weight_decay"]),
            maximize=bool(group["maximize"]),
            grad_scale=scale,
            seed=seed,
        )

    def _update_torch(self, params: list[torch.nn.Parameter], group: dict[str, Any]) -> None:
        b1, b2 = group["betas"]
        for p in params:
            st = self.state[p]
            if "exp_avg" not in st:
                st["exp_avg"] = torch.zeros_like(p)
            g = -p.grad if group["maximize"] else p.grad
            m = st["exp_avg"]
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(torch.sign(m * b1 + g * (1 - b1)), alpha=-group["lr"])
            m.mul_(b2).add_(g, alpha=1 - b2)
