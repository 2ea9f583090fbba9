"""The GPU as a second worker for speculative updates (``gpu_updates=True``).

During the last backward of a step the CPU's cores compute each unit's update into its shadow as
the unit's gradients land (``_speculation``); when the updates take longer than the backward (a
large model in ``precision="compact"``, whose codec keeps the cores busy), the rest waits for
``step()``. The GPU meanwhile has its memory bandwidth to spare and its kernels take
microseconds: the cost of an update there is the link, about 14 bytes a parameter in compact
precision (8 up, 6 down) and 30 with fp32 masters. So the GPU takes updates too: every
speculative update is a *claim* that the first of the two workers to take it runs, the CPU
worker taking the newest units' first (its jobs run newest first), the GPU thread the oldest
units' first, from the end of each unit's list, so that they meet. Both compute the same bits
(``_gpu_kernel``), so which one ran an update changes nothing.

The GPU thread waits for a unit's gradient copies like the CPU worker, runs each update it
claimed through a ``_gpu_step.DeviceStepper`` on the unit's device, and marks the speculation
done once its results are in the shadow (an event it waits for). ``step()`` drops the offers
(no update of theirs starts after that) and its drain waits for an update the GPU thread is
running. A failure there leaves the speculation undone (``step()`` updates the parameter on the
CPU) and turns the GPU's share off, with a warning. ``step()``'s own in-place updates are shared
the same way, by a thread of its own that it joins (``_HostOptimizer._gpu_share``,
``ResidentStates._resident_gpu_share`` for ``states="host"``)."""

from __future__ import annotations

import atexit
import os
import threading
import warnings
import weakref
from collections.abc import Callable

import torch

from .._log import logger
from . import _jobs

#: Tests set this: the CPU leaves every update the GPU can run to the GPU (which worker runs an
#: update is otherwise a race, and a test of the GPU's share would depend on timing).
GPU_ONLY = False


class Claim:
    """An update that either worker may run: the first :meth:`take` wins. ``gpu``: whether the
    GPU can run it (else only the CPU takes it)."""

    __slots__ = ("_lock", "by", "gpu")

    def __init__(self, gpu: bool = True) -> None:
        self._lock = threading.Lock()
        self.by: str | None = None
        self.gpu = gpu

    def take(self, who: str) -> bool:
        """Whether ``who`` (``"cpu"`` or ``"gpu"``) now owns the update (it was not taken)."""
        if who == "gpu" and not self.gpu:
            return False
        if who == "cpu" and GPU_ONLY and self.gpu:
            return False
        with self._lock:
            if self.by is not None:
                return False
            self.by = who
            return True


class GpuAssist:
    """The GPU thread of one optimizer: offered units of updates, runs the ones it claims."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        #: Offered units, oldest first: (generation, wait for the gradients, [(claim, run), ...]).
        self._offers: list[tuple[int, Callable[[], None], list[tuple[Claim, Callable[[], None]]]]] = []
        #: Moves on at each :meth:`drop_offers`: no update of an older offer starts after it.
        self._gen = 0
        self._running = 0
        self._thread: threading.Thread | None = None
        self._closing = False
        self.enabled = True

    def offer(self, wait: Callable[[], None], items: list[tuple[Claim, Callable[[], None]]]) -> None:
        """Offers a unit's updates: ``wait()`` returns once its gradients have landed (raises if
        they never will); each ``run()`` computes one update on the GPU and returns once its
        results are in host memory."""
        if not self.enabled or not items:
            return
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="ramtorch-optim-gpu", daemon=True)
                self._thread.start()
                _LIVE.add(self)
            self._offers.append((self._gen, wait, items))
            self._cv.notify_all()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._offers and not self._closing:
                    self._cv.wait()
                if not self._offers:
                    return
                offer = self._offers.pop(0)
            self._run_offer(*offer)
            offer = None  # it holds the optimizer: not while this thread waits for the next

    def _run_offer(
        self, gen: int, wait: Callable[[], None], items: list[tuple[Claim, Callable[[], None]]]
    ) -> None:
        """Runs the updates of one offered unit that the GPU claims, last first."""
        if not self.enabled or gen != self._gen or all(c.by is not None for c, _ in items):
            return
        try:
            wait()
        except BaseException:  # noqa: BLE001 - the copies failed: the CPU job meets the error
            return
        for claim, run in reversed(items):
            if not self.enabled:
                return
            with self._cv:
                if gen != self._gen:
                    return  # step() has begun: the rest is the CPU's, or step()'s
                if not claim.take("gpu"):
                    continue
                self._running += 1
            try:
                run()
            except Exception as e:  # noqa: BLE001 - the update stays undone: step() runs it
                self.enabled = False
                logger.warning(
                    "ramtorch.optim: an update on the GPU failed (%s); the CPU does them all now", e
                )
                warnings.warn(
                    f"ramtorch.optim: an update on the GPU failed ({e}); updates run on the CPU from now on",
                    RuntimeWarning,
                    stacklevel=1,
                )
            finally:
                with self._cv:
                    self._running -= 1
                    self._cv.notify_all()

    def busy(self) -> bool:
        """Whether an update is running on the GPU thread."""
        return self._running > 0

    def wait(self) -> None:
        """Until no update is running on the GPU thread. Updates it has not claimed are the CPU
        worker's (it claims what is left of a unit when it reaches it)."""
        with self._cv:
            while self._running:
                self._cv.wait()

    def drop_offers(self) -> None:
        """Forgets the offered units: no update of theirs starts after this returns (``step()``
        has begun: what is not running stays with the CPU worker or with ``step()``, which then
        waits for what is)."""
        with self._cv:
            self._offers.clear()
            self._gen += 1

    def close(self, timeout: float | None = None) -> None:
        """Ends the thread after the update it is running (waiting at most ``timeout`` seconds)."""
        with self._cv:
            self._closing = True
            self._offers.clear()
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


#: Threads started. At interpreter exit each is ended and joined (as the CPU worker's are,
#: ``_jobs``): a daemon thread stopped inside a CUDA call while the interpreter finalizes can
#: abort the process.
_LIVE: weakref.WeakSet[GpuAssist] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """In a forked child the GPU thread is not there (fork copies the calling thread only), its
    lock may have been held, and CUDA cannot be used: the child's updates are the CPU's."""
    for assist in list(_LIVE):
        assist._cv = threading.Condition()
        assist._offers = []
        assist._running = 0
        assist._thread = None
        assist.enabled = False
    _LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _close_all() -> None:
    for assist in list(_LIVE):
        assist.close(_jobs.EXIT_WAIT_SECONDS)


def supported(device: torch.device | None) -> bool:
    """Whether updates can run on ``device`` (a CUDA device, with Triton)."""
    if device is None or device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
