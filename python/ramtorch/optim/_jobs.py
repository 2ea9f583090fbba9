"""The optimizer's worker: a queue of update jobs run one at a time on a thread of its own."""

from __future__ import annotations

import atexit
import os
import sys
import threading
import weakref
from collections.abc import Callable


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
                _LIVE.add(self)
            self._queue.append((job, ready))  # one step: an interrupt leaves it queued or not
            self._cv.notify_all()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._queue.pop(self._pick())[0]
                self._unfinished += 1  # running (counted here, where no interrupt can land)
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
            while self._unfinished or self._queue:
                self._cv.wait()

    def busy(self) -> bool:
        return self._unfinished > 0 or bool(self._queue)

    def _after_fork_in_child(self) -> None:
        """In a child forked while this queue had jobs or a worker: the worker is not in the child
        (fork copies the calling thread only) and its lock may have been held. The child starts
        with a fresh lock and no jobs (the parent runs them), so ``wait()`` returns instead of
        waiting forever for a worker that is not there."""
        self._cv = threading.Condition()
        self._queue = []
        self._unfinished = 0
        self._thread = None

    def close(self) -> None:
        self.wait()
        with self._cv:
            self._closing = True
            self._cv.notify_all()

    def shutdown(self, timeout: float | None = None) -> bool:
        """Runs the queued jobs to their end and ends the thread, waiting for it (at most
        ``timeout`` seconds when given); returns whether the thread has ended."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            return not thread.is_alive()
        return True


#: Queues whose thread was started. At interpreter exit each thread is ended and joined before
#: the interpreter finalizes: a daemon thread still inside torch or the engine then would be
#: stopped mid-call (pthread_exit), and a C++ frame on its way out aborts the process.
_LIVE: weakref.WeakSet[_Jobs] = weakref.WeakSet()


#: How long interpreter exit waits for queued optimizer jobs. A job that never ends (one blocked
#: on something the exiting program will not do) must not hang the exit: past this, the thread is
#: left to the interpreter's teardown, with a message.
EXIT_WAIT_SECONDS = 120.0


def _after_fork_in_child() -> None:
    for jobs in list(_LIVE):
        jobs._after_fork_in_child()
    _LIVE.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _shutdown_all() -> None:
    for jobs in list(_LIVE):
        if not jobs.shutdown(EXIT_WAIT_SECONDS):
            sys.stderr.write(
                f"ramtorch.optim: queued optimizer updates did not finish within {EXIT_WAIT_SECONDS:.0f} s "
                "of interpreter exit; exiting without them\n"
            )
