"""One model over several devices (``ramtorch.offload(model, devices=[...])``): its units split
into contiguous stages, one :class:`~ramtorch._stream.streamer.Streamer` per stage streaming on its
own device's engine, activations moved to a stage's device as they enter it, and, with
``micro_batches``, the batch split on dim 0 and relayed through the stages.

- **The split** (:func:`split_stages`): the units in the order the model registers them (the usual
  order of a forward), cut into as many contiguous stages as there are devices, the largest stage
  (by cost: a unit's bytes, which is also what its matrices compute with; an embedding streamed by
  rows costs nothing) as small as it can be.
- **The hand-off**: a forward pre-hook on every unit of a stage (registered before its streamer's)
  moves the tensors among its arguments to the stage's device (``Tensor.to``: autograd carries the
  gradient back). The stage's pass (``Streamer.begin_pass``/``end_pass``) begins when a forward first
  reaches one of its units and ends when it reaches the next stage (or the forward returns).
- **The relay** (:func:`relay`): micro-batch ``t`` runs in stage ``s`` at tick ``s + t``. Each
  micro-batch's forward runs the model's own forward code on a thread of its own, but one thread
  at a time: the calling thread conducts (:meth:`Pipeline._relay`), handing the turn to the tasks
  of a tick one unit each, round robin, so that the host issues one unit's work to one device,
  then one unit's to the next device, and so on. CUDA calls return once queued, so every device
  has work queued while the host waits on another's copies. The threads act for the caller
  (:func:`ramtorch._engine.acting_for`): the forwards lock and the training step see one thread.
- **Training**: the micro-batches' outputs are joined (:func:`combine`), so ``loss.backward()``
  runs one backward over all of them (GPipe's schedule: every forward, then the backward); torch's
  autograd engine runs the backward of each device on a thread of its own, each starting as soon
  as the gradient of its stage's output arrives. An ordering edge (:class:`_After`) makes the last
  stage run the micro-batches' backwards one after the other, newest first, so the device before
  gets the first gradient early.
- **Several calls** (:meth:`Pipeline.map`, ``ramtorch.relay``): the micro-batches of independent
  calls relayed as one sequence, so the stages overlap across calls too.
- **Errors**: a micro-batch's error is raised in the caller, after the other micro-batches'
  forwards unwound (:class:`PipelineAborted` at their next turn); one that skips the units' forward
  hooks (Ctrl-C) undoes the cut unit's forward on its own thread and leaves its stage's pass open,
  for the next pass to clean up as after an interrupt.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten

from .. import _disk, _engine
from .compiling import is_compiling, opaque, run_eagerly
from .units import _Unit

# -- the split and the schedule, as pure functions ----------------------------------------------


def split_stages(costs: Sequence[int], stages: int) -> list[int]:
    """The stage of each unit: ``costs`` (one a unit, in the order the units run) cut into
    ``stages`` contiguous, non-empty stages whose largest total cost is the smallest possible
    (ties give the later stages more units). Raises ``ValueError`` with fewer units than stages."""
    n = len(costs)
    if stages < 1:
        raise ValueError(f"pipeline: {stages} stages; at least one is needed")
    if n < stages:
        raise ValueError(f"pipeline: {n} units cannot fill {stages} stages (one unit at least a stage)")
    if any(c < 0 for c in costs):
        raise ValueError("pipeline: unit costs must not be negative")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[s][i]: the smallest largest stage of the first i units cut into s stages; cut[s][i]:
    # where its last stage begins.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                v = max(best[s - 1][j], prefix[i] - prefix[j])
                if v < best[s][i]:
                    best[s][i], cut[s][i] = v, j
    out = [0] * n
    i = n
    for s in range(stages, 0, -1):
        j = cut[s][i]
        for k in range(j, i):
            out[k] = s - 1
        i = j
    return out


def stage_units(model: torch.nn.Module, units: Sequence[_Unit], stages: int) -> list[list[_Unit]]:
    """The units of each stage, as ``offload(devices=...)`` cuts them: the units that hold
    parameters, containers left out (they stay on the first device), in the order ``model``
    registers their modules, cut by :func:`split_stages` on their bytes (an embedding streamed by
    rows, ``gather``, costs nothing: it crosses no slot)."""
    order = _disk.registration_order(model, [u.module for u in units])
    inner = [units[i] for i in order if not units[i].container and units[i].params]
    cuts = split_stages([0 if u.gather else u.nbytes for u in inner], stages)
    return [[u for u, c in zip(inner, cuts) if c == s] for s in range(stages)]


def relay(stages: int, micro_batches: int) -> list[list[tuple[int, int]]]:
    """The relay's ticks: at tick ``k``, stage ``s`` runs micro-batch ``k - s``. Each tick lists its
    tasks ``(stage, micro_batch)``, the deepest stage (the oldest micro-batch) first; there are
    ``stages + micro_batches - 1`` ticks, and each stage runs the micro-batches in order."""
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"pipeline: relay of {stages} stages and {micro_batches} micro-batches")
    return [
        [(s, k - s) for s in reversed(range(stages)) if 0 <= k - s < micro_batches]
        for k in range(stages + micro_batches - 1)
    ]


# -- batches: split on dim 0, outputs joined -----------------------------------------------------


def split_batch(args: tuple, kwargs: dict, n: int) -> tuple[list[tuple[tuple, dict]], list[int]]:
    """``(args, kwargs)`` cut into ``n`` micro-batches on dim 0, and the micro-batches' sizes.

    The batch size is the largest dim 0 of the tensor arguments; each tensor with a dim 0 of that
    size is cut (``torch.tensor_split``: sizes differ by one at most), one whose dim 0 is 1 is
    broadcast and given whole to every micro-batch, as are 0-dim tensors and other values. Raises
    ``ValueError``, naming the argument, for a tensor of another dim 0, and for a batch smaller
    than ``n``."""
    flat, treespec = tree_flatten_with_path((args, kwargs))
    sizes = [t.shape[0] for _, t in flat if isinstance(t, torch.Tensor) and t.dim() > 0]
    batch = max(sizes, default=0)
    if batch < n:
        raise ValueError(
            f"ramtorch.offload(micro_batches={n}): the batch ({batch} on dim 0 of the tensor arguments"
            f"{'' if sizes else ': none has a dim 0'}) cannot be split into {n} micro-batches; give a "
            f"batch of at least {n}, or offload with fewer micro_batches"
        )
    pieces: list[list[Any]] = []
    for path, t in flat:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] != 1:
            if t.shape[0] != batch:
                raise ValueError(
                    f"ramtorch.offload(micro_batches={n}) splits dim 0 of every tensor argument, but "
                    f"argument {_where(path)} has shape {tuple(t.shape)} while the batch is {batch} "
                    "(a dim 0 of 1 is broadcast); give it the batch on dim 0, or offload with "
                    "micro_batches=1"
                )
            pieces.append(list(torch.tensor_split(t, n, dim=0)))
        else:
            pieces.append([t] * n)
    parts = [tree_unflatten([p[k] for p in pieces], treespec) for k in range(n)]
    lengths = [batch // n + (1 if k < batch % n else 0) for k in range(n)]
    return [(a, kw) for a, kw in parts], lengths


def _where(path: Any) -> str:
    """An argument's place in ``(args, kwargs)``, as the caller wrote it (``args[0]``, ``x``...)."""
    text = keystr(path)
    if text.startswith("[0]"):
        return "args" + text[3:]
    if text.startswith("[1]"):
        return text[3:].strip("[]'\"") or "kwargs"
    return text


def combine(outs: Sequence[Any], sizes: Sequence[int]) -> Any:
    """The micro-batches' outputs joined into the batch's: tensors with a dim 0 concatenated on it
    (each must have its micro-batch's size there), 0-dim tensors (a mean loss) averaged, weighted
    by the micro-batches' sizes, other values kept when every micro-batch returned the same.
    Raises ``ValueError``, naming the output, for what cannot be joined (a KV cache object)."""
    flats = [tree_flatten_with_path(o) for o in outs]
    spec = tree_flatten(outs[0])[1]
    for o in outs[1:]:
        if tree_flatten(o)[1] != spec:
            raise ValueError(
                "ramtorch.offload(micro_batches=...): the micro-batches' outputs differ in structure, "
                "so they cannot be joined into the batch's"
            )
    total = sum(sizes)
    joined = []
    for k, (path, first) in enumerate(flats[0][0]):
        leaves = [f[0][k][1] for f in flats]
        if all(isinstance(t, torch.Tensor) for t in leaves):
            if first.dim() == 0:
                if not first.is_floating_point():
                    raise ValueError(
                        f"ramtorch.offload(micro_batches=...): output {_out(path)} is a 0-dim "
                        f"{first.dtype} tensor, which cannot be averaged over micro-batches"
                    )
                joined.append(sum(t * (n / total) for t, n in zip(leaves, sizes)))
                continue
            for t, n in zip(leaves, sizes):
                if t.shape[0] != n:
                    raise ValueError(
                        f"ramtorch.offload(micro_batches=...): output {_out(path)} has shape "
                        f"{tuple(t.shape)} for a micro-batch of {n}: outputs must keep the batch on "
                        "dim 0 to be joined (or offload with micro_batches=1)"
                    )
            joined.append(torch.cat(leaves, dim=0))
        elif all(t is first or _same(t, first) for t in leaves):
            joined.append(first)
        else:
            raise ValueError(
                f"ramtorch.offload(micro_batches=...): output {_out(path)} is a "
                f"{type(first).__name__} that differs between micro-batches and cannot be joined "
                "(a KV cache: pass use_cache=False, or offload with micro_batches=1 to generate)"
            )
    return tree_unflatten(joined, spec)


def _out(path: Any) -> str:
    return keystr(path) or "(the output)"


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


def to_device(tree: Any, device: torch.device, moved: dict[int, Any] | None = None) -> Any:
    """``tree`` with every tensor elsewhere than ``device`` moved there (differentiably: the
    gradient goes back to where the tensor came from). ``moved`` keeps the copies made (by the
    source tensor's id, with the tensor and its version): a tensor handed to every unit of a stage
    (a rotary table, a mask) crosses once, as long as it is not written."""

    def move(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.device == device:
            return t
        if moved is not None:
            hit = moved.get(id(t))
            if hit is not None and hit[0] is t and hit[1] == t._version:
                return hit[2]
        y = t.to(device, non_blocking=t.device.type == "cuda" and device.type == "cuda")
        if moved is not None:
            moved[id(t)] = (t, t._version, y)
        return y

    return tree_map(move, tree)


# -- the relay at run time -----------------------------------------------------------------------


#: Held by the calling thread for the whole of a relay (see :meth:`Pipeline._relay`).
_RELAYS = threading.Lock()
#: ``active`` on the threads that run a micro-batch's forward.
_IN_FLIGHT = threading.local()


class _After(torch.autograd.Function):
    """``x`` as it is, whose backward must run before that of ``earlier`` (an ordering edge in the
    graph, no gradient through it: autograd waits for every edge into a node, ``None`` or not)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *earlier: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.n = len(earlier)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        return (grad,) + (None,) * ctx.n


def _after_previous(f: _Flight, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The backward in GPipe's order: micro-batch ``t`` entering the last stage makes the backward
    of micro-batch ``t - 1``'s outputs wait for its own through the last stage (:class:`_After`
    on its first input that requires grad). Without it, the join hands every output its gradient
    at once, and each device's autograd thread would run a unit's backward for every
    micro-batch before the next unit's (their threads number autograd's nodes alike): the first
    gradient would reach the device before only at the end. With it, the last device runs the
    micro-batches' backwards one after the other, newest first, each handing its gradient to
    the device before as it ends, which computes it while the last device runs the next."""
    prev = f.previous
    if prev is None or not prev.done or prev.error is not None or not torch.is_grad_enabled():
        return args, kwargs
    earlier = [t for t in tree_flatten(prev.result)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not earlier:
        return args, kwargs
    flat, spec = tree_flatten((args, kwargs))
    for i, t in enumerate(flat):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            flat[i] = _After.apply(t, *earlier)
            return tree_unflatten(flat, spec)
    return args, kwargs


class PipelineAborted(RuntimeError):
    """Raised in a micro-batch's forward when another micro-batch's forward raised: it unwinds
    (the stages' passes end as on any error) and the first error reaches the caller."""


class _ThreadContext:
    """The calling thread's torch state that a micro-batch's thread must compute under: grad mode,
    inference mode, autocast, the current CUDA device and streams."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.autocast = [
            (dt, torch.get_autocast_dtype(dt)) for dt in ("cuda", "cpu") if torch.is_autocast_enabled(dt)
        ]
        self.cuda_device: int | None = None
        self.streams: list[torch.cuda.Stream] = []
        if any(d.type == "cuda" for d in devices):
            self.cuda_device = torch.cuda.current_device()
            for d in devices:
                s = torch.cuda.current_stream(d)
                if d.type == "cuda" and s != torch.cuda.default_stream(d):
                    self.streams.append(s)

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.inference:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for dt, dtype in self.autocast:
                stack.enter_context(torch.autocast(dt, dtype=dtype))
            if self.cuda_device is not None:
                stack.enter_context(torch.cuda.device(self.cuda_device))
            for s in self.streams:
                stack.enter_context(torch.cuda.stream(s))
            yield


class _Flight:
    """One micro-batch's forward: where it is (``stage``, ``None`` between stages), the stage it
    waits to enter (``want``), and its turn (``go``)."""

    def __init__(self, index: int, args: tuple, kwargs: dict, conductor: _Conductor | None) -> None:
        self.index = index
        self.args, self.kwargs = args, kwargs
        self.conductor = conductor
        self.stage: int | None = None
        self.want = 0
        # No unit of the current task has run yet: its first unit runs in the turn that began
        # the task (its entry into the stage, or the start of the forward).
        self.fresh = True
        self.done = False
        #: Tensors moved to the current stage's device (see :func:`to_device`).
        self.moved: dict[int, Any] = {}
        self.go = threading.Semaphore(0)
        #: The flight of the micro-batch before (``None`` for the first, and on the calling thread).
        self.previous: _Flight | None = None
        self.result: Any = None
        self.error: BaseException | None = None

    def turn(self, want: int) -> None:
        """A gate (a unit about to run, in stage ``want``): the turn goes back to the conductor,
        and this flight waits for its next one."""
        c = self.conductor
        if c is None:
            return
        if c.aborted:
            raise PipelineAborted("ramtorch: another micro-batch's forward raised")
        self.want = want
        c.back.release()
        self.go.acquire()
        if c.aborted:
            raise PipelineAborted("ramtorch: another micro-batch's forward raised")


class _Conductor:
    """The calling thread's side of a relay: it resumes one flight at a time."""

    def __init__(self) -> None:
        self.back = threading.Semaphore(0)
        self.aborted = False
        self.running: _Flight | None = None

    def resume(self, f: _Flight) -> None:
        """Gives ``f`` the turn and waits until it reaches its next gate (or its end)."""
        self.running = f
        f.go.release()
        self.back.acquire()
        self.running = None


class Pipeline:
    """The stages of one model over several devices: their streamers, the hand-off of activations,
    and the relay of micro-batches (see the module's docstring)."""

    def __init__(self, streamers: Sequence[Any], devices: Sequence[torch.device], micro_batches: int) -> None:
        self.streamers = list(streamers)
        self.devices = list(devices)
        self.micro_batches = micro_batches
        self._local = threading.local()
        #: ``(stage, micro_batch, unit)`` of every unit forward, in the order the host issued them,
        #: while this is a list (``None``: not recorded). For tests and traces.
        self.issued: list[tuple[int, int, str]] | None = None

    # -- hooks ------------------------------------------------------------------------------------

    def unit_pre(self, stage: int, name: str, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Forward pre-hook of a unit of ``stage``: the stage's pass begins if the forward enters the
        stage now (the last stage's ends), after the relay's turn; its inputs go to its device."""
        if is_compiling():
            return opaque(Pipeline.unit_pre, self, stage, name, module, args, kwargs)
        f: _Flight | None = getattr(self._local, "flight", None)
        if f is not None and f.stage is not None:
            if stage != f.stage:
                if stage < f.stage and f.conductor is not None:
                    raise RuntimeError(
                        f"ramtorch.offload(devices=..., micro_batches=...): unit {name!r} of stage {stage} "
                        f"ran after stage {f.stage}: the relay needs the units to run in the order the "
                        "model registers them (the order the stages were cut in); offload with "
                        "micro_batches=1"
                    )
                old, f.stage = f.stage, None
                f.moved = {}
                self.streamers[old].end_pass()
                f.turn(stage)
                f.stage = stage
                self.streamers[stage].begin_pass()
            elif f.fresh:
                f.fresh = False
            else:
                f.turn(stage)
            if self.issued is not None:
                self.issued.append((stage, f.index, name))
        dev = self.devices[stage]
        moved = None if f is None else f.moved
        args, kwargs = to_device(args, dev, moved), to_device(kwargs, dev, moved)
        if f is not None and f.conductor is not None and stage == len(self.streamers) - 1 and stage > 0:
            args, kwargs = _after_previous(f, args, kwargs)
        return args, kwargs

    # -- the model's forward --------------------------------------------------------------------------

    def forward(self, inner: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """The model's forward: on the calling thread with one micro-batch, else relayed."""
        if is_compiling():  # the stages' passes, threads and turns run eagerly, as the streamers do
            return opaque(Pipeline.forward, self, inner, args, kwargs)
        nested = getattr(self._local, "flight", None) is not None or getattr(_IN_FLIGHT, "active", False)
        if self.micro_batches == 1 or nested:  # (a pipelined model called inside a micro-batch: whole)
            f = _Flight(0, args, kwargs, None)
            return self._fly_inline(f, inner)
        return self.map(inner, [(args, kwargs)])[0]

    def map(self, inner: Callable[..., Any], calls: Sequence[tuple[tuple, dict]]) -> list[Any]:
        """Several calls of the model's forward as one relay (``ramtorch.relay``): each call cut
        into micro-batches (with ``micro_batches`` above 1), and the micro-batches of all calls
        relayed one after the other, so that the stages overlap across calls as within one.
        Returns each call's output, joined."""
        if getattr(self._local, "flight", None) is not None or getattr(_IN_FLIGHT, "active", False):
            return [self.forward(inner, a, k) for a, k in calls]
        parts: list[tuple[tuple, dict]] = []
        spans: list[tuple[int, list[int] | None]] = []  # each call's first part and its sizes
        for args, kwargs in calls:
            if self.micro_batches == 1:
                spans.append((len(parts), None))
                parts.append((args, kwargs))
            else:
                pieces, sizes = split_batch(args, kwargs, self.micro_batches)
                spans.append((len(parts), sizes))
                parts += pieces
        firsts = {start for start, _ in spans}
        outs = self._relay(inner, parts, firsts)
        return [
            outs[start] if sizes is None else combine(outs[start : start + len(sizes)], sizes)
            for start, sizes in spans
        ]

    def _run(self, f: _Flight, inner: Callable[..., Any]) -> Any:
        f.stage = 0
        try:
            self.streamers[0].begin_pass()
            return inner(*f.args, **f.kwargs)
        except Exception:
            raise
        except BaseException:
            # Ctrl-C skipped the units' forward hooks: the stage's pass stays open, as a model's on
            # one device does, and its next pass cleans up as after an interrupt. What this
            # thread pushed (saved-tensor hooks) is undone now, on this thread: the next forward
            # begins with another stage (or on another thread).
            if f.stage is not None:
                self.streamers[f.stage].end_interrupted_forwards()
                f.stage = None
            raise
        finally:
            stage, f.stage = f.stage, None
            if stage is not None:
                self.streamers[stage].end_pass()

    def _fly_inline(self, f: _Flight, inner: Callable[..., Any]) -> Any:
        outer = getattr(self._local, "flight", None)
        if outer is not None:  # the model called inside its own forward: a forward of its own
            return inner(*f.args, **f.kwargs)
        self._local.flight = f
        try:
            return self._run(f, inner)
        finally:
            self._local.flight = None

    def _fly(
        self, f: _Flight, inner: Callable[..., Any], ctx: _ThreadContext, principal: threading.Thread
    ) -> None:
        """A micro-batch's thread: waits for its first turn, runs the forward, hands the turn back."""
        c = f.conductor
        assert c is not None
        f.go.acquire()
        try:
            if c.aborted:
                return
            with _engine.acting_for(principal), ctx.entered():
                _IN_FLIGHT.active = True
                self._local.flight = f
                try:
                    f.result = self._run(f, inner)
                finally:
                    self._local.flight = None
        except BaseException as e:  # handed to the caller's thread
            f.error = e
        finally:
            f.done = True
            c.back.release()

    def _relay(
        self,
        inner: Callable[..., Any],
        parts: list[tuple[tuple, dict]],
        firsts: set[int] | frozenset = frozenset(),
    ) -> list[Any]:
        """Runs the micro-batches' forwards along :func:`relay`'s ticks; within a tick, the tasks
        take turns one unit each. Returns their outputs, in order."""
        # One relay at a time in the process: a relay's micro-batches hold several devices' forward
        # locks at once (one a stage), so two relays from two threads could each wait for the other.
        with _RELAYS:
            return self._relay_locked(inner, parts, firsts)

    def _relay_locked(
        self, inner: Callable[..., Any], parts: list[tuple[tuple, dict]], firsts: set[int] | frozenset
    ) -> list[Any]:
        c = _Conductor()
        flights = [_Flight(t, a, k, c) for t, (a, k) in enumerate(parts)]
        for f, g in zip(flights[1:], flights):
            if f.index not in firsts:  # (the backward's order is kept within a call: see _After)
                f.previous = g
        ctx = _ThreadContext(self.devices)
        principal = _engine.acting_thread()
        threads = [
            threading.Thread(
                target=self._fly,
                args=(f, inner, ctx, principal),
                name=f"ramtorch-micro-batch-{f.index}",
                daemon=True,
            )
            for f in flights
        ]
        for th in threads:
            th.start()
        try:
            for tick in relay(len(self.streamers), len(flights)):
                active = [(s, flights[t]) for s, t in tick if not flights[t].done and flights[t].want == s]
                while active:
                    for task in list(active):
                        s, f = task
                        c.resume(f)
                        if f.error is not None:
                            raise f.error
                        if f.done or f.want != s:
                            active.remove(task)
            left = [f.index for f in flights if not f.done]
            if left:
                raise RuntimeError(f"ramtorch: micro-batches {left} did not finish along the relay")
            return [f.result for f in flights]
        finally:
            if c.running is not None:  # interrupted while a flight had the turn: it comes back first
                c.back.acquire()
                c.running = None
            if not all(f.done for f in flights):
                c.aborted = True
                for f in flights:
                    if not f.done:
                        c.resume(f)
            for th in threads:
                th.join()


run_eagerly(Pipeline.unit_pre, Pipeline.forward)
