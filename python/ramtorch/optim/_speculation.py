"""Speculative updates: the default schedule, which keeps torch's semantics and still overlaps the
optimizer with backward.

As a unit's gradients land during backward, its update is computed on the worker thread, out of
place, into spare buffers (the parameter's *shadow*: a new weight, new states, a new master),
reading the live weight and states and changing neither. ``step()`` then checks, for each such
update, that everything it read is as ``step()`` sees it: the same gradient tensor at the same
version, the same hyperparameters, no clipping or loss scaling to apply, states and weight not
replaced or written since, the same step count. A valid update is *committed*: the shadow's states
and master are swapped with the live ones (no bytes move) and the new weight is copied into the
parameter. Any other parameter with a gradient is updated in ``step()`` as with ``overlap=False``.
The kernels compute the same bits in or out of place, so every step equals ``overlap=False``
bitwise. A speculation that ``step()`` never commits (a skipped step, a probe backward, changed
gradients) is simply dropped.

The cost is host memory: a shadow holds one more copy of a parameter's states and weight (14
bytes a parameter with fp32 masters and AdamW, 6 with ``precision="bf16"``, 6.03 with
``precision="compact"``: weight, compensation, codes and scales). Shadows are made on
a parameter's first speculation only while the host has that memory to spare (``MemAvailable``
above a reserve); parameters without one are updated in ``step()``."""

from __future__ import annotations

import gc
import threading
from dataclasses import dataclass
from typing import Any

import torch

from .. import _arena, _core

#: Host memory left free when shadows are made: the larger of this many bytes and
#: ``_RESERVE_FRACTION`` of the machine's memory.
_RESERVE_BYTES = 2 << 30
_RESERVE_FRACTION = 0.10


def _meminfo() -> tuple[int, int] | None:
    """(MemAvailable, MemTotal) in bytes, or None where ``/proc/meminfo`` does not tell."""
    try:
        with open("/proc/meminfo") as f:
            fields = {line.split(":")[0]: line.split()[1] for line in f}
        return int(fields["MemAvailable"]) * 1024, int(fields["MemTotal"]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None


def host_can_spare(nbytes: int) -> bool:
    """Whether ``nbytes`` more of host memory leave the reserve free."""
    info = _meminfo()
    if info is None:
        return True  # no way to tell (not Linux): shadows are made, as any state would be
    available, total = info
    return nbytes + max(_RESERVE_BYTES, int(total * _RESERVE_FRACTION)) <= available


def _freeze(value: Any) -> Any:
    """A hyperparameter's value as it is now (a tensor is copied: it may be changed in place)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def same_value(a: Any, b: Any) -> bool:
    """Whether a frozen hyperparameter ``a`` still equals ``b`` (tensors by value, exactly)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.cpu(), b.detach().cpu()))
    try:
        return bool(a == b) and type(a) is type(b)
    except (TypeError, ValueError, RuntimeError):
        return a is b


def freeze_group(group: dict[str, Any]) -> dict[str, Any]:
    """The hyperparameters of ``group`` as they are now."""
    return {k: _freeze(v) for k, v in group.items() if k != "params"}


def same_group(frozen: dict[str, Any], group: dict[str, Any]) -> bool:
    """Whether ``group``'s hyperparameters are still those frozen."""
    keys = {k for k in group if k != "params"}
    return keys == set(frozen) and all(same_value(frozen[k], group[k]) for k in keys)


@dataclass
class Speculation:
    """One parameter's update computed ahead into its shadow, and what it read."""

    #: The hyperparameters it used.
    hyper: dict[str, Any]
    #: The step number it computed (the state's ``step`` + 1).
    step: int
    #: The live state tensors it read (name -> tensor, with their versions), and the weight's
    #: version: a commit needs them unchanged.
    read: dict[str, tuple[torch.Tensor, int]]
    param_version: int
    #: The gradient tensor it used and its version, known once backward has written ``.grad``
    #: (``None`` until then).
    grad: tuple[torch.Tensor, int] | None = None
    #: Set by the worker once the shadow holds the update (a failed one never commits).
    done: bool = False

    def holds(self, p: torch.Tensor, state: dict[str, Any] | None, scale: float) -> bool:
        """Whether the update computed ahead is the one ``step()`` would compute now for ``p``
        (``state``: its live state): done, from ``p``'s current gradient, weight and states, for
        the next step, with no gradient scale (the caller compares the hyperparameters)."""
        g = p.grad
        if not state or scale != 1.0 or not self.done or self.grad is None:
            return False
        return (
            g is self.grad[0]
            and g._version == self.grad[1]
            and p._version == self.param_version
            and int(state["step"]) + 1 == self.step
            and all(state.get(n) is t and t._version == v for n, (t, v) in self.read.items())
        )


class Shadows:
    """The spare buffers of the parameters that speculate, made on first use while the host can
    spare them; counts what they hold."""

    def __init__(self) -> None:
        #: Page-lock every buffer (the GPU writes them: ``gpu_updates``), not only the weight's.
        self.pin_all = False
        self._bufs: dict[int, dict[str, torch.Tensor]] = {}
        self._refused: set[int] = set()
        self._lock = threading.Lock()
        self.nbytes = 0

    def get(
        self, p: torch.Tensor, state: dict[str, Any], names: tuple[str, ...], pin_param: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """``p``'s shadow (the weight as ``"param"``, each state of ``names``, ``"master"`` when
        ``state`` has one), made now if the host can spare it; None if it cannot. ``pin_param``:
        the weight's buffer is page-locked (it is copied to a GPU once committed)."""
        pid = id(p)
        want: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"param": (tuple(p.shape), p.dtype)}
        for name in (*names, "master"):
            t = state.get(name)
            if isinstance(t, torch.Tensor):
                want[name] = (tuple(t.shape), t.dtype)
        bufs = self._bufs.get(pid)
        if bufs is not None:
            if {k: (tuple(t.shape), t.dtype) for k, t in bufs.items()} == want:
                return bufs
            self.forget(pid)  # states loaded in another dtype or shape since
        if pid in self._refused:
            return None
        nbytes = sum(
            torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
            for shape, dt in want.values()
        )
        with self._lock:
            if not host_can_spare(nbytes):
                self._refused.add(pid)
                return None
            bufs = {
                name: _arena.host_empty(shape, dt, pin=self.pin_all or (pin_param and name == "param"))
                for name, (shape, dt) in want.items()
            }
            self._bufs[pid] = bufs
            self.nbytes += nbytes
        return bufs

    def swap(self, pid: int, state: dict[str, Any], names: tuple[str, ...]) -> torch.Tensor:
        """Commits ``pid``'s shadow: its states and master become the live ones (the live ones
        become its spares); returns the new weight, for the caller to copy into the parameter."""
        bufs = self._bufs[pid]
        for name in (*names, "master"):
            if name in bufs:
                state[name], bufs[name] = bufs[name], state[name]
        return bufs["param"]

    def swap_param(self, pid: int, weight: torch.Tensor) -> torch.Tensor:
        """After :meth:`swap`: the shadow's new weight becomes the live host copy of a parameter
        that lives elsewhere (returned), and ``weight``, the old host copy, the spare."""
        bufs = self._bufs[pid]
        new, bufs["param"] = bufs["param"], weight
        return new

    def forget(self, pid: int) -> None:
        """Frees ``pid``'s shadow (its parameter left the optimizer, or its states were replaced
        by ones of another shape)."""
        with self._lock:
            bufs = self._bufs.pop(pid, None)
            if bufs is not None:
                self.nbytes -= sum(t.numel() * t.element_size() for t in bufs.values())
            self._refused.discard(pid)

    def clear(self) -> None:
        """Frees every shadow and returns the memory to the OS (the arena would otherwise keep it
        pooled: the process would still hold the spare buffers' bytes)."""
        with self._lock:
            had = bool(self._bufs)
            self._bufs.clear()
            self._refused.clear()
            self.nbytes = 0
        if had:
            gc.collect()
            _core.arena_empty_cache()


class AutoChoice:
    """The default schedule's choice, per run, between speculating and updating in ``step()``
    (both give ``overlap=False``'s bits), by the time of a whole training iteration in each
    (from the end of one ``step()`` to the end of the next: speculation shortens ``step()`` but
    competes with the backward for the host's cores and memory). When the host's memory
    bandwidth bounds the step, computing the update out of place during backward costs more than it hides,
    and ``step()`` wins; when backward is long against the update (long sequences,
    compute-bound models), speculation hides it.

    Speculation is measured first (its first step is left out: the spare buffers' pages are
    touched for the first time), then updates in ``step()``; the cheaper one is kept for the run,
    and a choice of ``step()`` frees the spare buffers."""

    #: Speculative steps measured, then steps in ``step()`` measured.
    SPECULATIVE_STEPS = 2
    IN_STEP_STEPS = 2

    def __init__(self) -> None:
        self.speculative: list[float] = []
        self.in_step: list[float] = []
        self._skipped_first = False
        #: None while measuring, then ``"speculate"`` or ``"in step"``.
        self.choice: str | None = None

    def observe_speculative(self, seconds: float) -> None:
        """An iteration that speculated took ``seconds``."""
        if not self._skipped_first:
            self._skipped_first = True
            return
        self.speculative.append(seconds)

    def observe_in_step(self, seconds: float) -> None:
        """An iteration that updated everything in ``step()`` took ``seconds``."""
        self.in_step.append(seconds)

    def wants_speculation(self) -> bool:
        """Whether the next step should speculate."""
        if self.choice is not None:
            return self.choice == "speculate"
        if len(self.speculative) < self.SPECULATIVE_STEPS:
            return True
        if len(self.in_step) < self.IN_STEP_STEPS:
            return False
        self.choice = "speculate" if min(self.speculative) <= min(self.in_step) else "in step"
        return self.choice == "speculate"
