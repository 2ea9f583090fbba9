"""Many small updates at once.

A kernel splits its tensor into pieces of at most 2^15 elements on the rayon pool, so one tensor
keeps all of a large host's cores busy only from a few hundred thousand elements up. Models with
many small trainable tensors (LoRA adapters: a unit of a 7B model has fourteen of 16k-230k
elements; biases, norms) then update one after the other on a few cores. The kernels release the
GIL, so several threads calling them keep the rayon pool full: ``run`` spreads a list of such
calls over a small thread pool. Each call is independent and computes the bits it would alone.

``RAMTORCH_UPDATE_THREADS`` sets the number of threads (0 or 1: every call on the caller's
thread); the default is a quarter of the cores this process may run on, at most 8, none below 8
cores (two threads on a small host only contend)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from typing import TypeVar

import torch

T = TypeVar("T")

#: Environment variable for the number of threads that run small updates side by side.
THREADS_VAR = "RAMTORCH_UPDATE_THREADS"

#: A tensor of at least this many elements keeps every core busy on its own (pieces of 2^15 on
#: 32 cores): it runs on the caller's thread, after the small ones are queued.
ALONE_NUMEL = 1 << 20

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads() -> int:
    """Threads that run small updates side by side (0: none, every call on the caller's thread):
    ``RAMTORCH_UPDATE_THREADS``, else a quarter of the cores, at most 8, and 0 below 8 cores. An
    invalid value raises an error naming the variable."""
    raw = os.environ.get(THREADS_VAR)
    if raw is not None and raw.strip():
        try:
            n = int(raw.strip())
        except ValueError:
            raise ValueError(f"environment variable {THREADS_VAR}={raw!r} is not an integer") from None
        if not 0 <= n <= 256:
            raise ValueError(f"environment variable {THREADS_VAR} must be between 0 and 256, got {n}")
        return 0 if n == 1 else n
    cores = _cores()
    return 0 if cores < 8 else min(8, cores // 4)


def _executor(n: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size != n:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="ramtorch-update")
            _pool_size = n
        return _pool


def run(fn: Callable[[T], None], items: Sequence[T], numel: Callable[[T], int]) -> None:
    """Calls ``fn(item)`` for every item. With threads (:func:`threads`) and more than one item,
    the first runs alone on this thread (an error every call would raise, such as a bad
    hyperparameter, surfaces before any other runs), the small ones (fewer than
    ``ALONE_NUMEL`` elements) then run on the pool while this thread runs the large ones; returns
    when all are done, raising the first error (a small item's before a large one's). An
    interrupt cancels the calls not begun and waits for those running. The pool's threads run
    in the caller's grad mode."""
    n = threads() if len(items) > 1 else 0
    if n == 0:
        for item in items:
            fn(item)
        return
    fn(items[0])
    small = [it for it in items[1:] if numel(it) < ALONE_NUMEL]
    large = [it for it in items[1:] if numel(it) >= ALONE_NUMEL]
    pool = _executor(n)
    grad_mode = torch.is_grad_enabled()  # thread-local: the pool's threads take the caller's

    def call(it: T) -> None:
        with torch.set_grad_enabled(grad_mode):
            fn(it)

    futures: list[Future[None]] = []
    errors: list[BaseException] = []
    try:
        futures = [pool.submit(call, it) for it in small]
        for it in large:
            try:
                fn(it)
            except Exception as e:  # noqa: BLE001 - raised below, once the small ones are done
                errors.append(e)
        wait_all(futures)
    except BaseException:
        for f in futures:
            f.cancel()
        wait_all(futures)
        raise
    errors = [e for f in futures if (e := f.exception()) is not None] + errors
    if errors:
        raise errors[0]
