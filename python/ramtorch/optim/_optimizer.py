"""The torch-facing optimizer: a :class:`torch.optim.Optimizer` whose host parameters are
updated by Rust kernels (``_state``), scheduled during backward (``_schedule``), optionally
sharded (``_zero``); ``step()`` finishes what backward left, updates the rest (GPU-resident
parameters with torch's kernels, or with ``states="host"`` through the host kernels:
``_resident``) and clips; ``state_dict`` and ZeRO consolidation. The update rules (``_rules``)
subclass it."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .. import _core, _engine, _log
from .._units import format_bytes
from . import _assist, _parallel, _speculation
from ._jobs import _Jobs
from ._resident import ResidentStates
from ._schedule import OverlapSchedule, Timings, UpdateMode, listen
from ._speculation import AutoChoice, Shadows, same_group, same_value
from ._state import _DTYPES, _PRECISIONS, HostStates, _is_host
from ._zero import Zero


def _step_of(state: dict[str, Any]) -> float:
    step = state.get("step", 0)
    return float(step.item()) if isinstance(step, torch.Tensor) else float(step)


def _round_stochastic(src: torch.Tensor, out: torch.Tensor, seed: int) -> None:
    """Writes fp32 ``src`` into bf16 ``out`` with stochastic rounding (as the host kernels do):
    a random 16-bit value is added below the bits bf16 keeps, then cut off. Inf and nan are
    written as they are."""
    gen = torch.Generator(device=src.device)
    gen.manual_seed(seed & ((1 << 63) - 1))
    bits = src.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, src.shape, dtype=torch.int32, device=src.device, generator=gen)
    cut = ((bits + noise) & ~0xFFFF).view(torch.float32)
    out.copy_(torch.where(torch.isfinite(src), cut, src))


#: Host memory left to the runtime when the first update's states are checked against the
#: memory available (``_check_host_memory``).
_STATE_MARGIN = 1 << 30


class _HostOptimizer(OverlapSchedule, ResidentStates, HostStates):
    """Shared machinery: host parameters through Rust kernels, the rest through torch (or, with
    ``states="host"``, through the Rust kernels too)."""

    #: torch.amp.GradScaler passes its scale and inf flag to step() (as ``grad_scale`` and
    #: ``found_inf`` attributes) instead of unscaling every gradient in a pass of its own.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        precision: str = "fp32-master",
        overlap: bool | str = True,
        pipeline: bool = False,
        max_grad_norm: float | None = None,
        states: str = "device",
        gpu_updates: bool = False,
    ) -> None:
        if precision not in _PRECISIONS:
            raise ValueError(f"precision must be one of {_PRECISIONS}, got {precision!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm!r}")
        if overlap not in (True, False, "backward"):
            raise ValueError(f"overlap must be True, False or 'backward', got {overlap!r}")
        _core.optim_isa()  # a RAMTORCH_CPU_KERNELS that names no instruction set: ValueError
        self._check_group(defaults)
        self._init_resident(states)  # before the groups are added: their gradients are hooked
        super().__init__(params, defaults)  # each group is checked in add_param_group
        self.precision = precision
        self.max_grad_norm = max_grad_norm
        if not overlap:
            self._mode = UpdateMode.IN_STEP
        elif pipeline or overlap == "backward":
            # Committed during backward: clipping needs every gradient first, so it turns them off.
            in_backward = UpdateMode.PIPELINE if pipeline else UpdateMode.OVERLAP
            self._mode = UpdateMode.IN_STEP if max_grad_norm is not None else in_backward
        else:
            # Speculative: a clip (or anything else step() sees changed) recomputes in step().
            self._mode = UpdateMode.SPECULATE
        self._accumulating = 0
        self._stepped = False
        # Backward passes since the last step(), and the most any step has had: with k micro-
        # batches a step, the first k - 1 backwards only accumulate, as inside accumulate().
        self._backwards = 0
        self._micro = 1
        self._saw_grads = False  # this backward delivered gradients of our parameters
        self._last_step_end: float | None = None  # when the last step() returned (perf_counter)
        self._last_backward = -1  # autograd's id of the last backward counted
        self._seed = 0x5EED
        self._jobs = _Jobs()
        # id(param) -> version of the gradient buffer the update used, for params updated during
        # the last backward (checked in step(): the gradient must not have changed since).
        self._done: dict[int, tuple[torch.Tensor, int]] = {}
        # id(param group) -> its hyperparameters when updates committed during backward used them
        # (checked in step()).
        self._done_hyper: dict[int, dict[str, Any]] = {}
        # Parameters updated during a backward that got gradients again from a later backward of
        # the same step (more backwards than any step before, outside accumulate()): step() raises.
        self._late: set[int] = set()
        self._error: BaseException | None = None
        # Speculative updates (UpdateMode.SPECULATE): id(param) -> what each read, and the spare
        # buffers they are computed into.
        self._spec = {}
        self._spec_closed = False  # step() has begun: speculations not begun are dropped
        self._shadows = Shadows()
        # gpu_updates=True: the GPU computes speculative updates beside the CPU (_assist); what it
        # copies is page-locked.
        if not isinstance(gpu_updates, bool):
            raise ValueError(f"gpu_updates must be True or False, got {gpu_updates!r}")
        self._assist = _assist.GpuAssist() if gpu_updates else None
        self._steppers = {}
        self._pin_states = gpu_updates
        self._shadows.pin_all = gpu_updates
        # overlap=True: the choice between speculating and updating in step(), measured per run.
        self._auto: AutoChoice | None = AutoChoice() if self._mode is UpdateMode.SPECULATE else None
        # clip_grad_norm_() before step(): (norm of the gradients, max_norm), applied by step().
        self._clip_request: tuple[float, float] | None = None
        self._zero: Zero | None = None  # shard(): the ZeRO strategy
        self._reduced: set[int] = set()  # ZeRO-2: ids of others' parameters reduced in backward
        self._reduced_dev: set[int] = set()  # ZeRO-2: ids of parameters reduced on the device
        if self._mode is not UpdateMode.IN_STEP:
            listen(self)
        #: Seconds and tensor updates of the Rust kernels, during backward and in ``step()``.
        self.timings = Timings(
            {
                "in_backward_seconds": 0.0,
                "in_backward_updates": 0,
                "in_step_seconds": 0.0,
                "in_step_updates": 0,
                # Speculative updates computed during backward, committed by step(), and computed but
                # then updated again in step() (their inputs had changed, or the step clipped).
                "speculated_updates": 0,
                "committed_updates": 0,
                "recomputed_updates": 0,
                # Speculative updates computed on the GPU (gpu_updates=True), and their seconds.
                "gpu_updates": 0,
                "gpu_seconds": 0.0,
            }
        )

    # -- user API ----------------------------------------------------------------------------------

    def shard(self, group: Any = None, stage: int = 1) -> _HostOptimizer:
        """ZeRO over ``torch.distributed`` (``group``: a process group, default the world): each
        rank keeps optimizer state for, and updates, only its share of the parameters (balanced
        by size). Each gradient is averaged onto its owner (``reduce``), the owner updates the
        parameter, and the new value reaches the other ranks in ``step()``: for free when the
        parameters are in shared host memory (``ramtorch.distributed.share_parameters``), else by
        ``broadcast`` from the owner.

        ``stage=1`` reduces and updates in ``step()``. ``stage=2`` reduces each unit's gradients
        as soon as they have landed, during backward, and a rank keeps only the gradients it owns;
        the owner computes its updates then (committed by ``step()`` by default, as without ZeRO;
        during backward with ``overlap="backward"``). Returns the optimizer. Not with
        ``states="host"``."""
        if self.states == "host":
            raise ValueError(
                f"{type(self).__name__}.shard(): ZeRO is not supported with states='host'; build the "
                "optimizer with states='device' (the default) to shard it"
            )
        zero = Zero.plan(self, group, stage)
        self.drain()
        self._zero = zero
        self.zero_stage = stage
        self._auto = None
        self._jobs.lifo = False  # collectives in the same order on every rank
        if stage == 1:
            self._mode = UpdateMode.IN_STEP
        elif self._mode is UpdateMode.SPECULATE:
            # The default: each owner computes its updates during backward, as the unit's
            # gradients are reduced to it, into spare buffers; step() commits them (or updates in
            # place what changed since) and publishes the new weights to the other ranks. Nothing
            # changes before step(), on any rank. Every rank speculates (no per-rank choice).
            listen(self)
        elif self._mode is not UpdateMode.IN_STEP:
            # overlap="backward"/pipeline=True: committed during backward, as each unit's
            # gradients are reduced to its owner; step() publishes the new weights.
            self._mode = UpdateMode.OVERLAP
            listen(self)
        return self

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, parameters: Iterable[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Clips the global norm of the gradients for the coming ``step()``, as
        ``torch.nn.utils.clip_grad_norm_(parameters, max_norm)`` would, and returns the norm
        before clipping (a 0-d float32 tensor). The gradients are not rewritten: ``step()``
        folds the clip into its kernels. ``parameters``: whose gradients make the norm (default:
        the optimizer's); those the optimizer does not update are scaled in place, as torch does.

        Use this instead of ``torch.nn.utils.clip_grad_norm_``, which rewrites gradients that an
        update during backward has already read. Clipping needs every gradient before any
        update: build the optimizer with ``max_grad_norm=`` (or ``overlap=False``). With overlap,
        a call that would change nothing (``max_norm`` inf, or at least the norm) still only
        measures; one that would clip raises. ``transformers.Trainer`` calls this through
        ``ramtorch.integrations.transformers.RamtorchTrainer``."""
        max_norm = float(max_norm)
        if not max_norm > 0:  # nan too
            raise ValueError(
                f"{type(self).__name__}.clip_grad_norm_: max_norm must be positive, got {max_norm!r}"
            )
        if float(norm_type) != 2.0:
            raise ValueError(
                f"{type(self).__name__}.clip_grad_norm_: only norm_type=2 (the global L2 norm) is "
                f"supported, got {norm_type!r}"
            )
        self.drain()
        owned = self._param_ids()
        others: list[torch.Tensor] = []
        if parameters is None:
            norm = self._grad_norm()
        else:
            if isinstance(parameters, torch.Tensor):
                parameters = [parameters]
            mine: list[torch.Tensor] = []
            for p in parameters:
                if p.grad is None:
                    continue
                (mine if id(p) in owned else others).append(p)
            norm = (self._grad_norm(mine) ** 2 + self._grad_norm(others) ** 2) ** 0.5
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0 and self._done:
            raise RuntimeError(
                f"{type(self).__name__}.clip_grad_norm_: {len(self._done)} parameters were already "
                "updated during backward with the unclipped gradients, so they cannot be clipped "
                "now. Build the optimizer with max_grad_norm= (updates then wait for every "
                "gradient, in step()) or overlap=False."
            )
        if others and coef < 1.0:
            torch._foreach_mul_([p.grad for p in others], coef)
        if self._clip_request is not None:
            max_norm = min(max_norm, self._clip_request[1])
        self._clip_request = (norm, max_norm)
        return torch.tensor(norm, dtype=torch.float32)

    def reduces_grad(self, p: torch.Tensor) -> bool:
        """Whether :meth:`reduce_grad` reads ``p``'s gradients (ZeRO-2's, of the parameters it
        shards)."""
        zero = self._zero
        return zero is not None and zero.stage == 2 and id(p) in zero.owner

    def reduce_grad(self, p: torch.Tensor, grad: torch.Tensor) -> bool | None:
        """Called by the engine with each gradient of a streamed parameter on the compute device,
        before it leaves for the host. ZeRO-2 reduces it there, onto its owner (over NVLink/PCIe
        with NCCL, not through host RAM); returns whether this rank keeps it (None: not ours)."""
        zero = self._zero
        if not self.reduces_grad(p):
            return None
        assert zero is not None
        zero.reduce_one(p, grad)
        self._reduced_dev.add(id(p))
        return zero.owns(p)

    def _owns(self, p: torch.Tensor) -> bool:
        """Whether this rank updates ``p`` (always, unless sharded)."""
        return self._zero is None or self._zero.owns(p)

    def _param_ids(self) -> dict[int, tuple[torch.nn.Parameter, dict[str, Any]]]:
        cache = self.__dict__.get("_ids_cache")
        if cache is None:
            cache = {id(p): (p, group) for group in self.param_groups for p in group["params"]}
            self.__dict__["_ids_cache"] = cache
        return cache

    def _check_group(self, group: dict[str, Any]) -> None:
        """Raises a ValueError naming the first hyperparameter of ``group`` out of its range: each
        rule checks its own (``_rules``)."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.add_param_group``; a hyperparameter of the group out of its
        range (``lr`` inf or nan, ``betas`` not a pair in [0, 1), ...) is a ValueError that names
        it, and the group is not added."""
        if isinstance(param_group, dict):
            self._check_group({**self.defaults, **param_group})
        super().add_param_group(param_group)
        self.__dict__.pop("_ids_cache", None)
        self.__dict__.pop("_index_cache", None)
        self._hook_resident(self.param_groups[-1]["params"])

    # -- step --------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Finishes the step: waits for the updates made during backward, checks their gradients
        were not changed since, and updates every other parameter that has a gradient."""
        if self._zero is not None:
            self._zero.consolidated = None  # the state changes
        self._settle_uploads()  # the last step's new weights, where no forward waited for them
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # torch.amp.GradScaler hands us its scale and inf flag instead of unscaling the gradients
        # itself (see _step_supports_amp_scaling): unscaling is folded into the kernels.
        # (The scaler sets both attributes for this call and deletes them after it.)
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        self._stepped = True
        self._check_host_memory()
        if (grad_scale is not None or found_inf is not None) and self._mode is not UpdateMode.IN_STEP:
            # Gradients are scaled until step() unscales them: updates cannot run in backward.
            self._mode = UpdateMode.IN_STEP
            self._auto = None
        if self._mode is UpdateMode.PIPELINE and grad_scale is None and found_inf is None:
            self._raise_failed()  # the updates of this step run on; the next forward waits for them
        else:
            # Speculations not begun by now are not begun: step() updates those parameters in place
            # (cheaper than out of place, and the wait is over sooner).
            self._spec_closed = True
            try:
                if self._assist is not None:
                    self._assist.drop_offers()  # then the drain waits for what the GPU runs
                self.drain()
            finally:
                self._spec_closed = False
        if self._roverlap and self._mode is UpdateMode.PIPELINE:
            # Weights on a GPU updated during backward: their copies must be queued before the
            # compute stream waits for them (step()'s end), so step() waits for their updates.
            self._wait_updates()
            self._raise_failed()
        rspec = self._close_resident()  # speculations of parameters with host states (_resident)
        done, self._done = self._done, {}
        self._close_overlap(done)  # and those updated during backward (overlap="backward")
        done_hyper, self._done_hyper = self._done_hyper, {}
        spec, self._spec = self._spec, {}
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
                    "max_grad_norm= or opt.clip_grad_norm_() for clipping (with transformers' "
                    "Trainer: ramtorch.integrations.transformers.RamtorchTrainer), overlap=False "
                    "with a GradScaler, and accumulate() around the backward passes of micro-batches."
                )
        groups = {id(g): g for g in self.param_groups}
        for gid, hyper in done_hyper.items():
            group = groups.get(gid)
            if group is not None and not same_group(hyper, group):
                changed = sorted(k for k in hyper if k in group and not same_value(hyper[k], group[k]))
                raise RuntimeError(
                    f"{type(self).__name__}: hyperparameters ({', '.join(changed) or 'the group'}) "
                    "were changed between backward and step(), but this step's updates were "
                    "committed during backward (overlap='backward' or pipeline=True) with the "
                    "values of then, so this step is not the one asked for. Set them before "
                    "backward, or use the default overlap=True (updates use the values step() sees)."
                )
        reduced, self._reduced = self._reduced, set()
        reduced_dev, self._reduced_dev = self._reduced_dev, set()
        if self._zero is not None:
            self._zero.reduce(self.param_groups, reduced | reduced_dev | set(done))
        scale = 1.0 if grad_scale is None else 1.0 / float(grad_scale)
        request, self._clip_request = self._clip_request, None
        if request is not None:  # clip_grad_norm_(): the norm is known, the gradients unchanged
            norm, max_norm = request
            norm *= scale  # a GradScaler's gradients: the norm of the unscaled ones
            if self.max_grad_norm is not None:
                max_norm = min(max_norm, self.max_grad_norm)
            self.last_grad_norm = norm
            scale *= min(1.0, max_norm / (norm + 1e-6))
        elif self.max_grad_norm is not None:
            scale *= self._clip_scale(scale)
        spans = _engine.host_spans  # ramtorch.trace is recording (None otherwise)
        t = time.perf_counter()
        committed = self._commit(spec, scale)
        committed |= self._commit_resident(rspec, scale)
        if self._disk_states is not None:  # states on disk: read ahead in the order of the loop
            self._disk_states.in_backward = self._updates_in_backward()
            self._disk_states.plan(
                p
                for g in self.param_groups
                for p in g["params"]
                if p.grad is not None and id(p) not in done and id(p) not in committed
            )
        host_updates = self.timings["in_step_updates"]
        resident: list[tuple[torch.nn.Parameter, dict[str, Any]]] = []
        host: list[tuple[torch.nn.Parameter, dict[str, Any], int]] = []
        for index, group in enumerate(self.param_groups):
            dev_params = []
            for p in group["params"]:
                if p.grad is None or id(p) in done or id(p) in committed or not self._owns(p):
                    continue
                if self._is_resident(p):
                    resident.append((p, group))  # states="host": after the loop, in forward order
                elif _is_host(p):
                    host.append((p, group, index))
                else:
                    dev_params.append(p)
            if dev_params:
                start = time.perf_counter() if spans is not None else 0.0
                self._update_device(dev_params, group, scale)
                if spans is not None:  # on a GPU: the time to launch the kernels
                    end = time.perf_counter()
                    where = dev_params[0].device
                    spans.add(
                        spans.CALLER, "torch update", start, end, dev_params, where, {"param_group": index}
                    )
        self._update_hosts(host, scale)
        if resident:
            start = time.perf_counter()
            self._update_resident(resident, scale)
            if spans is not None:
                spans.add(spans.CALLER, "update", start, time.perf_counter(), [p for p, _ in resident], None)
        self._end_resident_step()
        if self._disk_states is not None and self._mode is not UpdateMode.PIPELINE:
            self._disk_states.flush()  # the write-backs of this step's updates (pipelined: later)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and _is_host(p):
                    # The kernels wrote through raw pointers: tell autograd and the streaming
                    # engine (which keys device copies on version counters) that p changed.
                    torch.autograd.graph.increment_version(p)
        end = time.perf_counter()
        self.timings.add("in_step_seconds", end - t)
        self._choose(bool(spec) or bool(rspec), self.timings["in_step_updates"] - host_updates, end)
        if self._zero is not None:
            self._zero.publish(self.param_groups)
        return loss

    def _update_hosts(
        self, items: list[tuple[torch.nn.Parameter, dict[str, Any], int]], scale: float
    ) -> None:
        """The in-place updates of ``step()`` of host parameters ``items`` ((parameter, its group,
        the group's index)), small ones side by side (``_parallel``) once every one has its states
        (a first update makes them: all in turn); states on disk in turn, in the order the disk
        reads ahead."""
        spans = _engine.host_spans  # ramtorch.trace is recording (None otherwise)
        ds = self._disk_states

        def one(item: tuple[torch.nn.Parameter, dict[str, Any], int]) -> None:
            p, group, index = item
            start = time.perf_counter() if spans is not None else 0.0
            self._update_host(p, p.grad, group, scale)
            if spans is not None:  # one parameter; the trace joins those of a unit
                end = time.perf_counter()
                spans.add(spans.CALLER, "update", start, end, (p,), None, {"param_group": index})

        def numel(item: tuple[torch.nn.Parameter, dict[str, Any], int]) -> int:
            p = item[0]
            return _parallel.ALONE_NUMEL if ds is not None and p in ds else p.numel()

        if all(self.state.get(p) for p, _, _ in items):
            gpu = self._gpu_share(items, scale)
            if gpu is None:
                _parallel.run(one, items, numel)
            else:
                claims, thread, errors = gpu
                _parallel.run(
                    lambda item: one(item) if claims[id(item[0])].take("cpu") else None, items, numel
                )
                thread.join()
                if errors:
                    raise errors[0]
        else:
            for item in items:
                one(item)
        self.timings.add("in_step_updates", len(items))

    def _gpu_share(
        self, items: list[tuple[torch.nn.Parameter, dict[str, Any], int]], scale: float
    ) -> tuple[dict[int, _assist.Claim], threading.Thread, list[BaseException]] | None:
        """With ``gpu_updates=True``, starts a thread that runs ``step()``'s in-place updates on
        the GPU beside the CPU's, from the end of ``items`` (the CPU takes them from the start):
        each update is a claim that the first worker to take it runs, with the same bits. Returns
        the claims, the thread and the list where it leaves the error of an update it could not
        make (raised by ``step()`` once the thread has ended); None when the GPU takes no part
        (no CUDA engine, ZeRO, states on disk)."""
        if self._assist is None or not self._assist.enabled or self._zero is not None:
            return None
        if self._disk_states is not None:
            return None
        device = next((e.device for e in _engine.engines() if _assist.supported(e.device)), None)
        if device is None:
            return None
        claims = {
            id(p): _assist.Claim(p.grad is not None and self._gpu_can_update(p, [p.grad]))
            for p, _, _ in items
        }
        stepper = self._stepper(device)

        errors: list[BaseException] = []

        def work() -> None:
            try:
                run()
            except BaseException as e:  # noqa: BLE001 - step() raises it once the thread has ended
                errors.append(e)

        def run() -> None:
            done, start = 0, time.perf_counter()
            for p, group, _ in reversed(items):
                grad = p.grad
                if grad is None or not claims[id(p)].take("gpu"):
                    continue  # the CPU has it, or only the CPU can run it
                state = self.state[p]
                try:
                    args, kw = self._kernel_args(p, [grad], group, int(state["step"].item()) + 1, scale)
                    for ev in stepper.step(*args, **kw):
                        ev.synchronize()
                except Exception as e:  # noqa: BLE001 - the CPU does it (and the rest) instead
                    self._assist.enabled = False
                    _log.logger.warning(
                        "ramtorch.optim: an update on the GPU failed (%s); the CPU does them", e
                    )
                    self._update_host(p, grad, group, scale)
                    continue
                state["step"] += 1
                done += 1
            self.timings.add("gpu_updates", done)
            self.timings.add("gpu_seconds", time.perf_counter() - start)

        thread = threading.Thread(target=work, name="ramtorch-optim-gpu-step", daemon=True)
        thread.start()
        return claims, thread, errors

    def _check_host_memory(self) -> None:
        """Before an update makes states in host RAM: a ``MemoryError`` that names the bytes when
        they cannot fit in the memory the host has available now, instead of the kernel ending
        the process once the kernels first write their pages (states are allocated lazily)."""
        need, count = 0, 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or self.state.get(p) or not self._owns(p):
                    continue
                if not (_is_host(p) or self._is_resident(p)):
                    continue
                if _is_host(p) and self._disk_states_for(p) is not None:
                    continue  # states on disk (the store is allocated whole now, or fails here)
                for shape, dtype in self._host_specs(p).values():
                    need += math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                count += p.numel()
        info = _speculation._meminfo() if need else None
        if info is None:
            return
        available = info[0] - _STATE_MARGIN
        if need > available:
            # The arena keeps freed memory pooled (an earlier optimizer's states, dropped buffers),
            # which the OS counts as taken: given back, it may be enough.
            _core.arena_empty_cache()
            info = _speculation._meminfo() or info
            available = info[0] - _STATE_MARGIN
        if need > available:
            raise MemoryError(
                f"{type(self).__name__}: the optimizer states of {count:.3g} parameters "
                f"(precision={self.precision!r}) need {format_bytes(need)} of host memory, but "
                f"{format_bytes(max(0, info[0]))} is available: the process would be killed once "
                "the states are first written. Use precision='compact' (about 4 bytes of state a bf16 "
                "parameter) or 'bf16', shard the optimizer over several ranks (shard()), or free host "
                "memory; `python -m ramtorch plan --host-memory auto` predicts what training needs "
                "before anything is allocated"
            )

    def _choose(self, speculated: bool, in_step: int, now: float) -> None:
        """The default schedule (``overlap=True``): feeds the time of this training iteration
        (from the end of the last ``step()`` to the end of this one: speculation also competes
        with the backward for the host, so ``step()`` alone does not tell) to the choice between
        speculating and updating in ``step()`` (``_speculation.AutoChoice``), and applies it."""
        auto = self._auto
        last, self._last_step_end = self._last_step_end, now
        if auto is None or auto.choice is not None:
            return
        if self._mode is not UpdateMode.SPECULATE and self._mode is not UpdateMode.IN_STEP:
            self._auto = None  # the user chose a mode since
            return
        if last is None:
            pass  # the first step makes the states: not a measure of either
        elif self._mode is UpdateMode.SPECULATE and speculated:
            auto.observe_speculative(now - last)
        elif self._mode is UpdateMode.IN_STEP and not speculated and in_step:
            auto.observe_in_step(now - last)
        speculate = auto.wants_speculation()
        self._mode = UpdateMode.SPECULATE if speculate else UpdateMode.IN_STEP
        if auto.choice == "in step":
            self._wait_host_copies()  # a spare weight may still be the source of a copy to a GPU
            self._shadows.clear()  # the spare buffers' memory goes back

    def _grad_norm(self, params: list[torch.Tensor] | None = None) -> float:
        """The L2 norm of the gradients of ``params`` (default: the optimizer's parameters this
        rank updates, summed over the ZeRO group)."""
        total = 0.0
        if params is None:
            params = [p for group in self.param_groups for p in group["params"] if self._owns(p)]
            reduce = self._zero is not None
        else:
            reduce = False
        for p in params:
            g = p.grad
            if g is None:
                continue
            if g.device.type == "cpu" and g.dtype in _DTYPES and g.is_contiguous():
                sq, _ = _core.grad_stats(_engine.plain(g), _DTYPES[g.dtype], g.numel())
                total += sq
            else:
                total += float(g.detach().float().square().sum())
        if reduce:
            total = self._zero.all_reduce_sum(total)  # type: ignore[union-attr]
        return total**0.5

    def _clip_scale(self, unscale: float = 1.0) -> float:
        norm = self._grad_norm() * unscale
        self.last_grad_norm = norm
        return min(1.0, self.max_grad_norm / (norm + 1e-6)) if self.max_grad_norm is not None else 1.0

    def _update_device(self, params: list[torch.nn.Parameter], group: dict[str, Any], scale: float) -> None:
        """Updates parameters that are not in host RAM (units kept resident on the GPU) with
        torch's kernels on their device, with the numerics of a host parameter: a bf16/fp16
        parameter gets an fp32 master copy and fp32 states on its device (``precision=
        "fp32-master"``), the rule runs on the master with the gradient in fp32 (times
        ``scale``), and the parameter is rewritten from the master, rounded to nearest. With
        ``precision="bf16"``, bf16 states are computed on in fp32 and written back, as the
        weight, with stochastic rounding. An fp32 parameter is updated in place (its gradient
        scaled in place by ``scale``, as torch's clipping would). These states are device
        memory outside ``gpu_budget`` (``ramtorch.plan`` reports them)."""
        targets: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        states: list[dict[str, Any]] = []
        rounded: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        stochastic: list[tuple[int, torch.nn.Parameter, dict[str, Any]]] = []
        for p in params:
            st = self.state[p]
            grad = p.grad
            assert grad is not None
            sdtype, needs_master = self._state_layout(p) if p.dtype in _DTYPES else (p.dtype, False)
            if needs_master:
                if "master" not in st:
                    st["master"] = p.detach().float()
                    for name, v in list(st.items()):  # states of another precision: widened
                        if name != "step" and isinstance(v, torch.Tensor) and v.dtype != torch.float32:
                            st[name] = v.float()
                target = st["master"]
                rounded.append((p, target))
                grad = grad.float()
            elif sdtype == torch.bfloat16 and p.dtype == torch.bfloat16:
                # precision="bf16": the rule runs on fp32 copies of the weight and the states
                stochastic.append((len(targets), p, st))
                target = p.detach().float()
                st = {
                    k: (v.float() if k != "step" and isinstance(v, torch.Tensor) else v)
                    for k, v in st.items()
                }
                grad = grad.float()
            else:
                target = p
            targets.append(target)
            grads.append(grad)
            states.append(st)
        if scale != 1.0:
            torch._foreach_mul_(grads, scale)
        self._update_torch(targets, grads, states, group)
        for k, p, st in stochastic:
            wide = states[k]
            seed = hash((self._seed, int(_step_of(wide)), self._index_of(p))) & ((1 << 62) - 1)
            _round_stochastic(targets[k], p, seed)
            for j, (name, v) in enumerate(sorted(wide.items())):
                if name == "step" or not isinstance(v, torch.Tensor) or not v.is_floating_point():
                    st[name] = v
                    continue
                if name not in st or st[name].dtype != torch.bfloat16:
                    st[name] = torch.empty_like(p)
                _round_stochastic(v, st[name], seed + 1 + j)
        if rounded:  # rounded to nearest
            torch._foreach_copy_([p for p, _ in rounded], [m for _, m in rounded])

    def _update_torch(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: list[dict[str, Any]],
        group: dict[str, Any],
    ) -> None:
        """The rule's update of ``params`` (device parameters, or their fp32 masters) with
        ``grads`` and the per-parameter ``states`` (dicts, created on first use), with torch's
        kernels."""
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``; zeroing gradients in place first waits for the
        updates still reading them (``pipeline``)."""
        if not set_to_none and (self._jobs.busy() or (self._assist is not None and self._assist.busy())):
            self._wait_updates()
        self._clip_request = None  # measured on gradients that are gone
        self._forget_resident_grads()
        super().zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """As ``torch.optim.Optimizer.state_dict``, once the pending updates are done.

        A sharded optimizer (``shard()`` over several ranks) holds the state of its share of the
        parameters only: its state dict is the whole optimizer's on the rank that
        :meth:`consolidate_state_dict` gathered it on, until the next update; elsewhere this
        raises (a shard saved as if it were the optimizer would lose the other ranks' state)."""
        self.drain()
        sd = super().state_dict()
        zero = self._zero
        if zero is None or zero.world() == 1:
            return sd
        if zero.consolidated is None:
            raise zero.sharded_state_error(type(self).__name__)
        sd["state"] = dict(sorted({**sd["state"], **zero.consolidated}.items()))
        return sd

    def consolidate_state_dict(self, to: int = 0) -> None:
        """ZeRO: gathers every rank's optimizer state on rank ``to`` of the group, where
        :meth:`state_dict` then returns the state of every parameter, as one unsharded optimizer
        would (save it there: ``ramtorch.save_checkpoint``). A collective: every rank of the group
        calls it. Rank ``to`` holds a copy of the other ranks' state until the next update.
        Loading that state dict into the sharded optimizer on every rank (``load_state_dict`` or
        ``ramtorch.load_checkpoint``) keeps each rank's share."""
        if self._zero is None:
            raise RuntimeError(
                f"{type(self).__name__}.consolidate_state_dict(): the optimizer is not sharded"
            )
        world = self._zero.world()
        if not 0 <= to < world:
            raise ValueError(f"consolidate_state_dict(to={to!r}): the group has ranks 0..{world - 1}")
        self.drain()
        self._zero.gather(super().state_dict()["state"], to)

    def synchronize(self) -> None:
        """Waits for every update queued so far (see ``pipeline``), and makes the compute stream
        wait for the new weights still being copied to the GPU (``states="host"`` with
        ``upload_wait="forward"``); raises if an update failed."""
        self.drain()
        self._settle_uploads()
        if self._disk_states is not None:
            self._disk_states.flush()

    def __del__(self) -> None:
        jobs = getattr(self, "_jobs", None)
        if jobs is not None:
            jobs.close()
        assist = getattr(self, "_assist", None)
        if assist is not None:
            assist.close(0)  # the thread ends after what it runs (it holds no reference to us)
        if getattr(self, "_rhooks", None):
            self._unhook_resident()
