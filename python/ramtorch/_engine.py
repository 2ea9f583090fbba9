"""The torch side of the engine: one :class:`DeviceEngine` per compute device.

It owns the device slots (allocated through torch's caching allocator, so ``torch.cuda.memory_*``
counts them), turns a slot into weight views, sends gradients to the host arena and, once per
backward, waits for them and writes ``.grad``. Streams and events live in the Rust engine; this
module only passes torch's current stream to it.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import statistics
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from . import _arena, _config, _core, _profile

if TYPE_CHECKING:
    from ._trace import HostSpans

#: The host spans of the trace being recorded (``ramtorch.trace``), ``None`` while none is: the
#: optimizer and :func:`wait_updates` check it, and record nothing when it is ``None``.
host_spans: HostSpans | None = None


def normalize_device(device: torch.device | str | int | None) -> torch.device:
    """``None`` → cpu; ``"cuda"`` → ``cuda:<current>``. Raises if the CUDA device does not exist."""
    if device is None:
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"ramtorch computes on 'cpu' or 'cuda' devices, not {dev.type!r}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"device {dev} was asked for but CUDA is not available on this machine")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise RuntimeError(f"device cuda:{index} does not exist ({count} CUDA device(s) visible)")
    return torch.device("cuda", index)


class Update:
    """A pending optimizer update of some host parameters (pipelined steps: ``step()`` returns
    while the updates of the last units run on; whatever reads those weights waits here first)."""

    __slots__ = ("done", "error", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.done = threading.Event()
        self.error: BaseException | None = None


# id(param) -> (the parameter, weakly, and its pending or failed update). The weak reference
# tells a parameter from a later tensor that got the same id after it was freed.
_UPDATES: dict[int, tuple[weakref.ref[torch.Tensor], Update]] = {}
_UPDATES_LOCK = threading.Lock()


def _lookup(p: torch.Tensor) -> Update | None:
    entry = _UPDATES.get(id(p))
    if entry is None:
        return None
    if entry[0]() is not p:  # a freed parameter's entry
        _UPDATES.pop(id(p), None)
        return None
    return entry[1]


def updates_begin(params: Sequence[torch.Tensor], update: Update) -> None:
    """``params`` are being rewritten by ``update`` until :func:`updates_end`."""
    with _UPDATES_LOCK:
        for p in params:
            _UPDATES[id(p)] = (weakref.ref(p), update)


def updates_end(params: Sequence[torch.Tensor], update: Update, error: BaseException | None = None) -> None:
    """``update`` is over. A failed one stays registered: its weights are half written, and every
    later reader gets the error rather than those weights."""
    with _UPDATES_LOCK:
        update.error = error
        if error is None:
            for p in params:
                if _lookup(p) is update:
                    del _UPDATES[id(p)]
    update.done.set()


def discard_failed_updates(params: Iterator[torch.Tensor] | Sequence[torch.Tensor]) -> dict[int, Any]:
    """Forgets failed updates of ``params``, whose weights are about to be overwritten (a load);
    returns them for :func:`restore_failed_updates` should the load fail."""
    out = {}
    with _UPDATES_LOCK:
        for p in params:
            u = _lookup(p)
            if u is not None and u.done.is_set() and u.error is not None:
                out[id(p)] = _UPDATES.pop(id(p))
    return out


def restore_failed_updates(failed: dict[int, Any]) -> None:
    """Flags again weights a failed load did not replace (see :func:`discard_failed_updates`)."""
    with _UPDATES_LOCK:
        for pid, entry in failed.items():
            _UPDATES.setdefault(pid, entry)


def updating(params: Iterator[torch.Tensor] | Sequence[torch.Tensor]) -> bool:
    """Whether an update of any of ``params`` is still running (cheap when none is)."""
    if not _UPDATES:
        return False
    with _UPDATES_LOCK:
        return any(_lookup(p) is not None for p in params)


def wait_updates(params: Iterator[torch.Tensor] | Sequence[torch.Tensor] | None = None) -> None:
    """Waits for the pending updates of ``params`` (of every parameter with ``None``); raises if
    one failed, naming it."""
    if not _UPDATES:
        return
    spans = host_spans
    if spans is not None and params is not None:
        params = list(params)  # read twice: here, and to name the reader in the trace
    with _UPDATES_LOCK:
        if params is None:
            pending = {u for ref, u in _UPDATES.values() if ref() is not None}
        else:
            pending = {u for u in (_lookup(p) for p in params) if u is not None}
    if spans is None:
        for u in pending:
            _wait_update(u)
        return
    start, blocked = 0.0, []
    try:
        for u in pending:
            if not u.done.is_set():
                if not blocked:
                    start = time.perf_counter()  # this reader blocks: a span for the trace
                blocked.append(u.name)
            _wait_update(u)
    finally:
        if blocked:
            end = time.perf_counter()
            spans.add(spans.WAITS, "wait for update", start, end, params or (), None, {"updates": blocked})


def pending_updates() -> list[Update]:
    """The updates registered now (running, queued, or failed and not yet discarded)."""
    with _UPDATES_LOCK:
        return [u for _, u in _UPDATES.values()]


def _wait_update(u: Update) -> None:
    if _profile.active() and not u.done.is_set():
        with _profile.span(f"ramtorch.wait_update {u.name}"):
            u.done.wait()
    else:
        u.done.wait()
    if u.error is not None:
        raise RuntimeError(
            f"ramtorch: the optimizer update of {u.name} failed, so its weights are not valid "
            f"(load them again: ramtorch.load_checkpoint or ramtorch.load): {u.error}"
        ) from u.error


# -- streamed parameters ------------------------------------------------------------------------

#: id(param) -> the parameter, weakly (a later tensor with the same id is told apart), for every
#: parameter whose forward uses device copies that an engine streams: its gradient reaches the
#: host through the engine. The streaming front-end (``_stream.guard``) registers them; the
#: optimizers tell them from the parameters that stay where they are.
STREAMED: dict[int, weakref.ref[torch.Tensor]] = {}
_STREAMED_LOCK = threading.Lock()


def register_streamed(params: Sequence[torch.Tensor] | Iterator[torch.Tensor]) -> None:
    """``params`` are streamed from now on."""
    with _STREAMED_LOCK:
        for p in params:
            STREAMED[id(p)] = weakref.ref(p, _forget_streamed(id(p)))


def _forget_streamed(key: int) -> Callable[[object], None]:
    """The callback that drops ``key``'s entry once its parameter is freed."""

    def forget(_: object) -> None:
        entry = STREAMED.get(key)
        if entry is not None and entry() is None:
            STREAMED.pop(key, None)

    return forget


def is_streamed(t: Any) -> bool:
    """Whether ``t`` is a registered streamed parameter."""
    entry = STREAMED.get(id(t))
    return entry is not None and entry() is t


_GENERATIONS = itertools.count(1)


def next_generation() -> int:
    """A number never handed out before in this process: a host region's generation, part of the
    slot keys of its bytes (one source for every layer and unit, so keys never collide)."""
    return next(_GENERATIONS)


#: Layouts holding views of device slots (:meth:`Layout.slot_views`): emptied when a device's
#: slots are replaced, so that no view keeps an old slot's memory alive.
_SLOT_VIEWS: weakref.WeakSet[Layout] = weakref.WeakSet()


def forget_slot_views() -> None:
    """Drops every layout's views of device slots (the slots are being replaced)."""
    for layout in list(_SLOT_VIEWS):
        layout._made.clear()
    _SLOT_VIEWS.clear()


class Layout:
    """Where a unit's tensors sit in its host region: ``(offset, shape, dtype)`` per tensor."""

    __slots__ = ("entries", "dtypes", "nbytes", "_spans", "_made", "__weakref__")

    def __init__(self, flat: torch.Tensor, views: Sequence[torch.Tensor | None]) -> None:
        base = flat.data_ptr()
        self.entries = [None if v is None else (v.data_ptr() - base, tuple(v.shape), v.dtype) for v in views]
        self.dtypes = [None if e is None else e[2] for e in self.entries]
        self.nbytes = flat.numel()
        # Per tensor, (first byte, end byte, dtype, shape): the views of every use without
        # recomputing sizes.
        self._spans = [
            None if e is None else (e[0], e[0] + _arena._nbytes(e[1], e[2]), e[2], e[1]) for e in self.entries
        ]

        # id of a device slot -> (the slot, its views): see slot_views.
        self._made: dict[int, tuple[torch.Tensor, list[torch.Tensor | None]]] = {}

    def views(self, slot: torch.Tensor) -> list[torch.Tensor | None]:
        """The tensors of this layout inside ``slot`` (a ``uint8`` buffer holding the region)."""
        return [None if s is None else slot[s[0] : s[1]].view(s[2]).view(s[3]) for s in self._spans]

    def slot_views(self, slot: torch.Tensor) -> list[torch.Tensor | None]:
        """:meth:`views` of one of an engine's device slots, made once per slot: a unit of a few
        hundred tensors (a ResNet stage) took longer to view anew each forward than its kernels
        took to launch. The views are the same tensors at each use, sharing the slot's version
        counter as any view does; a view whose metadata was changed in place (``resize_``,
        ``as_strided_``, ``t_``) is made anew. Forgotten when the engine replaces its slots
        (:func:`forget_slot_views`)."""
        got = self._made.get(id(slot))
        if got is not None and got[0] is slot:
            views = got[1]
            base = slot.data_ptr()
            for v, s in zip(views, self._spans):
                if v is None:
                    continue
                if v.data_ptr() != base + s[0] or v.shape != s[3] or not v.is_contiguous():
                    break
            else:
                return views
        views = self.views(slot)
        self._made[id(slot)] = (slot, views)
        _SLOT_VIEWS.add(self)
        return views


#: Threads that run a forward on behalf of another (``_stream.pipeline``: the micro-batches of one
#: call, each on a thread of its own, taking turns): thread -> the thread they act for.
_ACTING_FOR: weakref.WeakKeyDictionary[threading.Thread, threading.Thread] = weakref.WeakKeyDictionary()


def acting_thread() -> threading.Thread:
    """The thread whose forward or training step the calling thread runs: itself, or the thread
    it acts for (:func:`acting_for`). The forwards lock and the engine's training-step owner
    (:class:`ForwardLock`, :meth:`DeviceEngine._check_thread`) count threads this way."""
    me = threading.current_thread()
    return _ACTING_FOR.get(me, me)


@contextlib.contextmanager
def acting_for(principal: threading.Thread) -> Iterator[None]:
    """The calling thread acts for ``principal`` while the block runs: the two count as one for the
    forwards lock and the training step. The caller makes sure that they never run the streaming
    layer at the same time (``_stream.pipeline`` hands one turn at a time)."""
    me = threading.current_thread()
    _ACTING_FOR[me] = acting_thread() if principal is me else _ACTING_FOR.get(principal, principal)
    try:
        yield
    finally:
        _ACTING_FOR.pop(me, None)


class ForwardLock:
    """Serialises the forwards that stream weights on one device, across threads.

    Several threads may run inference on one model (or on several models of one device) at
    once: each forward pass then runs whole, one after the other, and gives exactly the outputs
    it gives alone. A thread holds the lock while it holds any token: an offloaded model's pass
    (from its root forward pre-hook to its forward hook), a unit run on its own, a free-standing
    layer's forward. Tokens of the owning thread nest (a model called inside another's forward).
    Backward passes do not take it (the engine's gradient path serves one training step at a
    time, see :meth:`DeviceEngine._check_thread`).

    A pass cut short by a ``BaseException`` (Ctrl-C), which skips torch's forward hooks, keeps
    its token until the same thread runs that model again; a thread that died holding the lock
    hands it over."""

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._owner: threading.Thread | None = None
        self._tokens: set[Hashable] = set()

    def acquire(self, token: Hashable) -> None:
        """Adds ``token`` for the calling thread, waiting while another live thread holds the
        lock."""
        me = acting_thread()
        with self._cv:
            while self._owner is not None and self._owner is not me:
                if not self._owner.is_alive():
                    self._tokens.clear()  # its passes will never end
                    break
                # Woken by the release; the timeout only re-checks that the owner is alive.
                self._cv.wait(1.0)
            self._owner = me
            self._tokens.add(token)

    def release(self, token: Hashable) -> None:
        """Drops ``token`` of the calling thread (nothing if it does not hold it); the lock is free
        once the thread holds no token."""
        with self._cv:
            if self._owner is not acting_thread():
                return
            self._tokens.discard(token)
            if not self._tokens:
                self._owner = None
                self._cv.notify_all()

    def mine(self) -> bool:
        """Whether the calling thread holds the lock."""
        return self._owner is acting_thread()


#: The raw handle of a CUDA device's current stream, without a Python stream object (what
#: ``torch.cuda.current_stream(device).cuda_stream`` reads; None where torch lacks it).
_RAW_STREAM: Callable[[int], int] | None = getattr(torch._C, "_cuda_getCurrentRawStream", None)


#: Contiguous tensors of one dtype, flattened and packed back to back in one new tensor (torch's
#: C++ helper: one call instead of a view per tensor and a cat).
_flatten: Callable[[Sequence[torch.Tensor]], torch.Tensor] = torch._C._nn.flatten_dense_tensors

#: The engine's bound on copies in flight per lane.
_MAX_GRADIENT_COPIES = 64

#: How many copies into slots the host may have in flight before a prefetch along the itinerary
#: blocks on the oldest, for callers that wait for their pass's copies at its end
#: (``Streamer._end_pass``); ``None``: ``max_inflight``. The slots (``max_inflight + 1``) order
#: the copies on the device by themselves: each waits there for its slot's last reader. Blocking
#: the host on ``max_inflight`` copies stopped it before it had queued the kernels of the unit it
#: was starting (a trace of an int8 LoRA step of the 8B shape had it blocked 4-10 ms at a unit's
#: start while the device ran short of queued kernels). ``bench/copies_ahead.py`` alternates the
#: two settings inside one process on one H200: that step 302 against 314 ms (every pair of
#: rounds), the bf16-base LoRA step 525 against 534 ms, a full forward+backward and a decode
#: under an 8 GiB budget unchanged.
COPIES_AHEAD: int | None = 64

#: A gradient of at most this many bytes (a norm's, a bias's) waits on the device and crosses
#: together with others of its dtype: one copy and one set of events for many tensors, where each
#: copy costs the host tens of microseconds (a ResNet's backward has 310 such gradients of 465).
_SMALL_GRAD_BYTES = 64 << 10
#: The host tensor of a running sum that crosses in a batch, until the batch has left.
_LATER = torch.empty(0)
#: A batch of small gradients leaves once it holds this many bytes or tensors (and at the end of
#: backward, and before the optimizers are told a unit's gradients are on their way).
_SMALL_BATCH_BYTES = 4 << 20
_SMALL_BATCH_COUNT = 128


class _GradSources:
    """The device sources of the gradient copies in flight, oldest first, each with its bytes, and
    their bytes in all (what the throttle of gradient copies reads on every copy: kept, not summed
    again each time)."""

    __slots__ = ("items", "nbytes")

    def __init__(self) -> None:
        self.items: deque[tuple[torch.Tensor, int]] = deque()
        self.nbytes = 0

    def append(self, t: torch.Tensor, nbytes: int) -> None:
        self.items.append((t, nbytes))
        self.nbytes += nbytes

    def pop(self) -> None:
        self.nbytes -= self.items.pop()[1]

    def popleft(self) -> None:
        self.nbytes -= self.items.popleft()[1]

    def clear(self) -> None:
        self.items.clear()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.items)


def small_grad(nbytes: int) -> bool:
    """Whether a gradient of ``nbytes`` waits on the device to cross in a batch with others
    (:meth:`DeviceEngine._add_small`) rather than by a copy of its own."""
    return 0 < nbytes <= _SMALL_GRAD_BYTES


#: Host tensors of these dtypes are added by the engine's kernel (``_core.add_``): torch's bits
#: (in float32, 16-bit results rounded to nearest even) on the rayon pool. torch's own CPU add of
#: bfloat16 ran at 90 GB/s where float32 ran at 132 on a 16-core host: the gradients added on the
#: host during a backward compete with the link's copies for the host's memory. float16 stays
#: torch's (its conversions, vectorised by torch, are slower in the kernel).
_ADD_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
#: Below this many bytes torch adds (one call of the kernel costs more than such an add).
_KERNEL_ADD_MIN_BYTES = 1 << 20


def host_add_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst += src`` for host tensors, as torch's ``add_`` (its version counter too); by the
    engine's kernel where both are plain contiguous tensors of one shape and dtype that it
    handles and do not overlap, else by torch."""
    name = _ADD_DTYPES.get(dst.dtype)
    dst, src = plain(dst), plain(src)
    if (
        name is None
        or dst.numel() * dst.element_size() < _KERNEL_ADD_MIN_BYTES
        or type(dst) is not torch.Tensor
        or type(src) is not torch.Tensor
        or src.dtype is not dst.dtype
        or dst.shape != src.shape
        or dst.device.type != "cpu"
        or src.device.type != "cpu"
        or not dst.is_contiguous()
        or not src.is_contiguous()
        or dst.requires_grad
        or _overlap(dst, src)
    ):
        dst.add_(src)
        return
    _core.add_(dst, src, name, dst.numel())
    torch.autograd.graph.increment_version(dst)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    pa, pb = a.data_ptr(), b.data_ptr()
    return pa < pb + b.numel() * b.element_size() and pb < pa + a.numel() * a.element_size()


_TENSOR_DATA = torch._C.TensorBase.data
_TENSOR_VERSION = torch._C.TensorBase._version


class HostGrad(torch.Tensor):
    """The ``.grad`` tensors the engine makes in host memory: plain tensors to torch (its functions
    see no subclass and return plain tensors), whose ``_version`` also counts each access to their
    memory that their version counter cannot see: ``.data`` (read or set) and ``.numpy()``. A
    gradient written through those (``p.grad.data.zero_()``, ``p.grad.data.clamp_(-1, 1)``, a numpy
    view) then reads as changed to what keeps state beside ``.grad``: the running sums on the
    device (:class:`_Sum`) and the optimizers' updates computed during backward, which are made
    anew from the written gradient, as torch uses it. Even a read through ``.data`` counts (it
    cannot be told from a write)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def _touch(self) -> None:
        self.__dict__["_ramtorch_touches"] = self.__dict__.get("_ramtorch_touches", 0) + 1

    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        self._touch()
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        self._touch()
        _TENSOR_DATA.__set__(self, value)

    @property  # type: ignore[override]
    def _version(self) -> int:
        return _TENSOR_VERSION.__get__(self) + self.__dict__.get("_ramtorch_touches", 0)

    def numpy(self, *, force: bool = False) -> Any:
        self._touch()
        return super().numpy(force=force)

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        self._touch()
        return super().__dlpack__(*args, **kwargs)

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        return torch.Tensor.__repr__(self.as_subclass(torch.Tensor), *args, **kwargs)

    # Saved and copied as the plain tensors they are to torch (``torch.load`` with
    # ``weights_only=True`` takes plain tensors only).
    def __reduce_ex__(self, proto: Any) -> Any:
        return self.as_subclass(torch.Tensor).__reduce_ex__(proto)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return self.as_subclass(torch.Tensor).__deepcopy__(memo)


def _foreach_takes_host_grads() -> None:
    """torch picks its multi-tensor (``foreach``) kernels only for tensors of the types it lists
    (``clip_grad_norm_`` reads the gradients' types): a :class:`HostGrad` is listed beside the
    plain tensor it is to torch, so that gradients take the path and the bits they take as plain
    tensors."""
    try:
        from torch.utils import _foreach_utils
    except ImportError:  # pragma: no cover - a torch without the list: nothing to extend
        return
    types = getattr(_foreach_utils, "_foreach_supported_types", None)
    if isinstance(types, list) and HostGrad not in types:
        types.append(HostGrad)


_foreach_takes_host_grads()


def host_grad(t: torch.Tensor) -> torch.Tensor:
    """``t`` (host memory the engine made) as the :class:`HostGrad` that becomes a ``.grad``."""
    return t.as_subclass(HostGrad) if type(t) is torch.Tensor else t


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor where it is a :class:`HostGrad` (the same memory; the core's
    functions take plain tensors only), else ``t``."""
    return t.as_subclass(torch.Tensor) if type(t) is HostGrad else t


def _plain_host_grad(grad: torch.Tensor, param: torch.nn.Parameter) -> bool:
    """Whether ``.grad`` tensor ``grad`` is a plain dense host tensor of ``param``'s dtype and shape
    (one the engine may sum on the device or add into on the host)."""
    return (
        type(grad) in (torch.Tensor, HostGrad)
        and grad.device.type == "cpu"
        and grad.dtype == param.dtype
        and grad.shape == param.shape
        and grad.layout == torch.strided
    )


class _SmallGrads:
    """Small gradients of one dtype and unit, produced on one stream, waiting on the device to cross the
    link together (see :data:`_SMALL_GRAD_BYTES`), each with its parameter's record."""

    __slots__ = ("entries", "grads", "into_target", "max_inflight", "nbytes", "stream", "tag")

    def __init__(self, stream: Any, max_inflight: int, tag: int) -> None:
        self.stream = stream  # the torch stream they were produced on (None on the host device)
        self.entries: list[_Pending] = []
        self.grads: list[torch.Tensor] = []
        self.into_target: list[bool] = []  # a running sum whose host tensor becomes entry.target
        self.nbytes = 0
        self.max_inflight = max_inflight
        self.tag = tag


class _Pending:
    """One parameter's gradient in the running backward: either the host tensor that the
    device's running sum crosses into (``target``), or host buffers, one per gradient, added up
    at the end of backward (``bufs``)."""

    __slots__ = ("bufs", "param", "pre", "replaces", "streamed", "target")

    def __init__(self, param: torch.nn.Parameter) -> None:
        self.param = param
        self.target: torch.Tensor | None = None
        self.replaces: torch.Tensor | None = None  # the ``.grad`` whose value the sum includes
        # A sum started from a copy of ``.grad`` on the device for this backward only
        # (:meth:`DeviceEngine._stream_sum`): the version of ``replaces`` when it was read.
        self.streamed: int | None = None
        self.bufs: list[torch.Tensor] = []
        # Once the host adds ``.grad`` during backward (:meth:`DeviceEngine._add_as_landed`): the
        # ``.grad`` read, its version then, and how many of ``bufs`` there were: the first of
        # them becomes their sum plus ``.grad`` (any later one is added at the end of backward).
        self.pre: tuple[torch.Tensor, int, int] | None = None


class _HostAdds:
    """A thread of its own that adds gradients into host buffers as their copies land, while the
    backward goes on (see :meth:`DeviceEngine._add_as_landed`): jobs run in order; the first
    error is kept for :meth:`wait`."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._queue: deque[Callable[[], None]] = deque()
        self._running = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="ramtorch-grad-adds", daemon=True)
                self._thread.start()
            self._queue.append(job)
            self._cv.notify_all()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                job = self._queue.popleft()
                self._running += 1
            try:
                job()
            except BaseException as e:  # kept for the backward's end, which raises it
                with self._cv:
                    if self._error is None:
                        self._error = e
            finally:
                with self._cv:
                    self._running -= 1
                    self._cv.notify_all()
            del job

    def wait(self) -> BaseException | None:
        """Blocks until every job submitted so far has run; returns (and forgets) the first error."""
        with self._cv:
            while self._queue or self._running:
                self._cv.wait()
            err, self._error = self._error, None
        return err


class _Sum:
    """A parameter's gradient accumulated on the device: the sum of its gradients since ``.grad``
    was last empty (``dev``), and the host tensor it was last copied into whole (``host``, at
    ``version``). Valid while ``.grad`` is that tensor at that version."""

    __slots__ = ("dev", "host", "nbytes", "ref", "transient", "version")

    def __init__(self, param: torch.nn.Parameter) -> None:
        self.ref = weakref.ref(param)
        self.nbytes = param.numel() * param.element_size()
        self.dev: torch.Tensor | None = None
        self.host: torch.Tensor | None = None
        self.version = -1
        self.transient = False  # for the running backward only (:meth:`DeviceEngine._stream_sum`)

    def holds(self, param: torch.nn.Parameter, grad: torch.Tensor | None) -> bool:
        return (
            self.ref() is param
            and grad is not None
            and grad is self.host
            and grad._version == self.version
            and self.dev is not None
        )


class _Load:
    """A ``.grad`` in host memory being copied to the device ahead of its parameter's gradient
    (:meth:`DeviceEngine._stream_sum`): the device tensor, the event after the copy (None on the
    host device), the host tensor read and its version then."""

    __slots__ = ("dev", "event", "nbytes", "prior", "version")

    def __init__(self, dev: torch.Tensor, event: Any, prior: torch.Tensor, nbytes: int) -> None:
        self.dev = dev
        self.event = event
        self.prior = prior
        self.version = prior._version
        self.nbytes = nbytes


class ShareChoice:
    """The choice, per run, of the share of host-accumulated gradients summed on the device for
    one backward (:meth:`DeviceEngine._stream_sum`), by the time of accumulating backwards under
    each share (from the backward's first gradient to the end of its ``.grad`` writes). Summing
    on the device moves half the host memory traffic of an add on the host and one more crossing
    of the link: which one bounds the backward depends on the host (its memory against the link),
    and the best share lies where the two balance. The shares of :attr:`SHARES` are measured in
    turn, then the faster one's neighbours at :attr:`STEP` (within 0 and 1), each after one
    backward left out (the change of path costs it: sums kept from then on copy ``.grad`` to the
    device once, the side stream's memory is first allocated); the share with the least median
    time is kept for the run."""

    SHARES = (0.5, 0.0)
    #: The second round: the first round's faster share plus and minus this.
    STEP = 0.25
    #: Backwards measured under each share.
    SAMPLES = 2

    def __init__(self) -> None:
        #: The shares to measure, in order (the second round's are appended to the first's).
        self.order: list[float] = list(self.SHARES)
        self.times: dict[float, list[float]] = {s: [] for s in self.order}
        self._skipped: set[float] = set()
        self._refined = False
        #: None while measuring, then the share kept.
        self.choice: float | None = None

    def share(self) -> float:
        """The share the next backward runs with."""
        if self.choice is not None:
            return self.choice
        for s in self.order:
            if len(self.times[s]) < self.SAMPLES:
                return s
        return self.order[0]  # (unreachable: observe() chooses once every share is measured)

    def observe(self, share: float, seconds: float) -> None:
        """An accumulating backward under ``share`` took ``seconds``."""
        if self.choice is not None or share not in self.times:
            return
        if share not in self._skipped:
            self._skipped.add(share)
            return
        if len(self.times[share]) < self.SAMPLES:
            self.times[share].append(seconds)
        if any(len(t) < self.SAMPLES for t in self.times.values()):
            return
        best = min(self.order, key=lambda s: statistics.median(self.times[s]))
        if not self._refined:
            self._refined = True
            near = (best - self.STEP, best + self.STEP)
            more = [s for s in near if 0.0 <= s <= 1.0 and s not in self.times]
            if more:
                self.order += more
                self.times.update({s: [] for s in more})
                return
        self.choice = best


#: How many ``.grad`` copies to the device run ahead of the gradients that add to them.
_LOADS_AHEAD = 2


#: Serialises the listeners' ``on_grads`` calls of every engine (see ``grads_complete``).
_LISTENER_CALLS = threading.RLock()


class DeviceEngine:
    """Slots, weight acquisition and gradient write-back for one compute device."""

    def __init__(self, device: torch.device, relays: tuple[int, ...] = ()) -> None:
        self.device = device
        self._index = device.index if device.index is not None else 0
        #: The peers asked to feed this device besides its own link (CUDA ordinals; on the host
        #: device, host stand-ins), see :func:`configure_links`; ``relays`` those that do.
        self.asked_relays = relays
        self.relays = relays
        kind, index = ("cuda", device.index) if device.type == "cuda" else ("cpu", 0)
        #: How each copy is split between the paths, own link first (bytes per second measured
        #: on CUDA, see :func:`measure_link_shares`; equal on the host device).
        self.link_shares: list[float] | None = link_shares(device, relays) if relays else None
        try:
            self._core = _core.Engine(
                kind, index, relays=list(relays) if relays else None, shares=self.link_shares
            )
        except (RuntimeError, ValueError) as e:
            if not relays:
                raise
            warnings.warn(
                f"links: {device} could not be fed through {_links_text(relays)} ({e}); it streams "
                "over its own link only",
                UserWarning,
                stacklevel=4,
            )
            self.relays = ()
            self.link_shares = None
            self._core = _core.Engine(kind, index)
        self._slots: list[torch.Tensor] = []
        self._slot_bytes = 0
        self._want_bytes = 0
        self._want_count = 0
        self._lock = threading.RLock()
        # Prefetch counters of the free-standing layers streaming on this device (their streamer
        # counts here; reported as ``layer_*`` by :meth:`stats`).
        self.layer_counters = {"prefetches": 0, "prefetch_hits": 0, "prefetch_wasted": 0}
        # Embedding tables streamed by rows (``_stream/gather.py``): lookups, distinct rows
        # gathered, and their bytes each way (copied by torch, outside the engine's copies).
        self.row_counters = {
            "row_lookups": 0,
            "rows_gathered": 0,
            "row_h2d_bytes": 0,
            "row_d2h_bytes": 0,
            "mapped_lookups": 0,
            "mapped_row_bytes": 0,
        }
        self._listeners: weakref.WeakSet[Any] = weakref.WeakSet()
        # Holders of speculative prefetches on this device (offloaded models' streamers): asked
        # to give their slots back (``holder.drop_prefetched()``) when the slots are needed.
        self._holders: weakref.WeakSet[Any] = weakref.WeakSet()
        self.tracing = False  # set by ramtorch.trace
        # Gradient copies in flight: their device sources, oldest first, freed as they complete.
        self._grad_sources = _GradSources()
        # Each parameter's gradient in the running backward: id(param) -> its record.
        self._pending: dict[int, _Pending] = {}
        # Small gradients not yet copied, by (dtype, stream handle, unit tag): one unit's at a time,
        # see :meth:`_add_small`.
        self._small: dict[tuple[torch.dtype, int, int], _SmallGrads] = {}
        # Gradient accumulation on the device (see :class:`_Sum`): id(param) -> the running sum
        # of its gradient since ``.grad`` was last empty, kept across backwards while the device
        # has room (``_sum_cap``) and the training loop accumulates (``_keep_sums``).
        self._sums: dict[int, _Sum] = {}
        self._sum_bytes = 0
        self._keep_sums = False
        self._fresh_backwards = 0  # backwards in a row that added to no earlier gradient
        self._accumulated = False  # this backward added to a gradient left by an earlier one
        #: Bytes of gradient sums the device may hold (None: what its memory leaves free, and no
        #: more than the models with a ``gpu_budget`` leave of it: :meth:`limit_sums`).
        self.sum_cap: int | None = None
        self._auto_sum_cap = 0
        # torch's peak of allocated memory when the cap was last computed, and what that peak held
        # besides the gradient sums (``_update_sum_cap``).
        self._cap_peak = -1
        self._cap_base = 0
        self._sum_limits: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        # Sums streamed for one backward (:meth:`_stream_sum`): whether the loop's gradients are
        # summed so (it accumulates and the sums kept did not all fit); the parameters whose
        # ``.grad`` is copied to the device in the next backward, in the order their gradients
        # came in the last one (``_plan``, with their positions), how far this backward got
        # along it, ``.grad`` copies issued ahead, the sums streamed now, the largest bytes they
        # held at once (room they took from a peak of memory), the gradients this backward added
        # onto a ``.grad`` in host memory either way, in order, and the side stream for the copies.
        self._streaming = False
        self._stream_reserve = 0  # room new kept sums leave for streamed ones
        #: Share, in bytes, of the host-accumulated gradients summed on the device instead
        #: (:func:`ramtorch._config.streamed_sum_share`; None: chosen per run by
        #: :class:`ShareChoice`); on the host device only where ``stream_sums_on_host`` is set.
        self.streamed_sum_share: float | None = _config.streamed_sum_share()
        self.stream_sums_on_host = False
        self.share_choice = ShareChoice()
        self._plan_share: float | None = None  # the share the running backward was planned with
        self._backward_t0 = 0.0  # when the running backward's first gradient came
        self._plan: list[weakref.ref[torch.nn.Parameter]] = []
        self._plan_pos: dict[int, int] = {}
        self._plan_at = -1
        self._loads: dict[int, _Load] = {}
        self._transients: set[int] = set()
        self._transient_bytes = 0
        self._transient_peak = 0
        self._host_summed: list[tuple[weakref.ref[torch.nn.Parameter], int]] = []
        self._load_stream: Any = None
        self.sums_streamed = 0  # gradients summed so, since the engine was made
        # Gradients added into a copy of ``.grad`` as they land (see :meth:`_add_as_landed`), and
        # the ``.grad`` tensors this engine wrote, at the version it left them: such a ``.grad``
        # takes the new sum's memory at the end of backward instead of a copy of it.
        self._adds = _HostAdds()
        self._adds_queued = 0
        self.adds_as_landed = 0  # gradients added so, since the engine was made
        self.adds_wait_seconds = 0.0  # time the ends of backward waited for those adds
        # param -> (its .grad, weakly held, and that .grad's version), for live parameters.
        self._written = _ByParam()
        # Who each held slot was taken for: slot -> id of its holder (a streamer). An interrupt
        # (Ctrl-C) can land between the engine's answer and the holder's record of it:
        # :meth:`reconcile` compares the two and gives back what no holder records. ``_unsettled``
        # is set while a slot is taken or given back and not yet recorded here: then a slot may be
        # held that not even ``_owned`` knows about.
        self._owned: dict[int, int] = {}
        self._unsettled = False
        # The thread whose training step (from a forward with gradients to the end of its
        # backward) is in progress on this engine: the gradient state above is one per engine,
        # so a second thread's step is refused (see :meth:`_check_thread`). A lock of its own:
        # never held while waiting for another.
        self._user: threading.Thread | None = None
        self._user_lock = threading.Lock()
        # Forwards of this device run one at a time, whichever thread calls them.
        self.forwards = ForwardLock()

    # -- slots --------------------------------------------------------------------------------

    def reserve(self, nbytes: int, count: int) -> None:
        """Records that units of up to ``nbytes`` will stream through ``count`` slots on this
        device; slots are (re)allocated lazily at the next acquire."""
        self._want_bytes = max(self._want_bytes, -(-nbytes // 64) * 64)
        self._want_count = max(self._want_count, count)

    def _ensure_slots(self) -> None:
        if self._slot_bytes >= self._want_bytes and len(self._slots) >= self._want_count:
            return
        # Speculative prefetches (of offloaded models that may not run again) hold slots: the
        # slots are replaced, so every holder gives them back.
        self.reclaim()
        if self._slots:
            # Kernels may still read the old slots: let them finish before torch reuses the memory.
            self.synchronize_compute()
        nbytes = max(self._want_bytes, self._slot_bytes)
        count = max(self._want_count, len(self._slots))
        self._core.set_slots([], 0)
        self._slots = []
        forget_slot_views()
        self._owned.clear()  # none is held (set_slots checks): nothing of the old slots is owned
        # Normal tensors also when first needed under torch.inference_mode: the streamers read
        # their version counters, which inference tensors do not have.
        with torch.inference_mode(False):
            if self.device.type == "cpu":
                # The host device's slots are host memory the engine writes: arena memory, which
                # the engine holds while they are its slots (it takes no other host memory as slots).
                slots = [_arena.host_bytes(nbytes, pin=False) for _ in range(count)]
            else:
                slots = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(count)]
        self._core.set_slots(slots, nbytes)  # the engine keeps the tensors alive
        self._slots, self._slot_bytes = slots, nbytes

    def _stream(self) -> int:
        """The raw handle of the current stream of this engine's device (0 on the host device)."""
        if self.device.type == "cuda":
            if _RAW_STREAM is not None:  # (no Python stream object made for each gradient)
                return _RAW_STREAM(self._index)
            return torch.cuda.current_stream(self.device).cuda_stream
        return 0

    def reclaim(self) -> None:
        """Asks every holder of a speculative prefetch on this device (offloaded models, the
        per-layer streamer) to release it: slots are shared between them. Slots an interrupt left
        taken for a holder no longer alive are given back too."""
        holders = list(self._holders)
        for holder in holders:
            holder.drop_prefetched()
        with self._lock:
            live = {id(h) for h in holders}
            for slot, who in list(self._owned.items()):
                if who not in live:
                    self.release(slot)

    def reconcile(self, owner: int, legit: set[int]) -> int:
        """Gives back the slots taken for ``owner`` (the id of a holder) that are not in ``legit``,
        the slots its holder records, and (after an interrupted take or release) the slots held
        that nobody recorded. Returns how many were given back.

        Called by a holder at a point where its records are complete (an offloaded model at the
        start of a pass, the shared streamer when no slot is free): an interrupt between taking a
        slot and recording it then costs the slot until that point, not for good."""
        n = 0
        with self._lock:
            for slot, who in list(self._owned.items()):
                if who == owner and slot not in legit:
                    self.release(slot)
                    n += 1
            if self._unsettled:
                stream = self._stream()
                for slot in range(len(self._slots)):
                    if slot not in self._owned:
                        try:
                            self._core.release(slot, stream)  # held by nobody: leaked
                            n += 1
                        except (ValueError, RuntimeError):
                            pass  # not held
                self._unsettled = False
        return n

    # -- split acquisition (prefetch ahead, claim at the point of use) ---------------------------

    def prefetch(
        self,
        key: int,
        flat: torch.Tensor,
        nbytes: int,
        max_inflight: int,
        keep: list[int],
        tag: int,
        owner: int = 0,
        parts: Sequence[int] = (),
    ) -> tuple[int, bool]:
        """Issues the copy of ``flat`` into a slot held from now on, for ``owner`` (the id of its
        holder, see :meth:`reconcile`); returns ``(slot, copied)``. A slot still holding ``key``
        is reused without a copy. ``parts``: byte offsets where the copy is cut, an event after
        each part (see :meth:`claim_part`). ``max_inflight``: the host blocks while that many
        copies are in flight."""
        with self._lock:
            self._ensure_slots()
            settled = not self._unsettled
            self._unsettled = True  # until recorded in _owned
            # The copy is queued on the transfer stream, after its slot's last reader; the host
            # blocks here while max_inflight copies are in flight.
            rng = _profile.begin("ramtorch.copy_to_device") if _profile.active() else None
            try:
                index, _, copied = self._core.prefetch(
                    key, flat.data_ptr(), nbytes, max_inflight, keep, tag, list(parts)
                )
            except (_core.SlotsExhausted, ValueError):
                self._unsettled = not settled  # refused: nothing was taken
                raise
            finally:
                if rng is not None:
                    _profile.end(rng)
            self._owned[index] = owner
            self._unsettled = not settled
        return index, copied

    def copies_marker(self) -> int:
        """An engine marker of every copy queued so far, both ways (for :meth:`wait_copies`)."""
        return int(self._core.marker())

    def wait_copies(self, marker: int) -> None:
        """Blocks, without the GIL, until the copies of ``marker`` (:meth:`copies_marker`) have
        completed: from then on none of them reads host memory."""
        self._core.wait_marker(marker)

    def claim(self, index: int, tag: int = 0) -> torch.Tensor:
        """Makes the current stream wait for the copy into slot ``index``; returns the slot."""
        if _profile.active():
            with _profile.span("ramtorch.wait_copy"):  # a wait of the stream, not of the host
                self._core.claim(index, self._stream(), tag)
        else:
            self._core.claim(index, self._stream(), tag)
        return self._slots[index]

    def claim_part(self, index: int, upto: int, tag: int = 0) -> None:
        """Makes the current stream wait for the first ``upto`` bytes of the copy into slot
        ``index`` only (the part that covers them, when the copy was cut; else all of it)."""
        self._core.claim_part(index, self._stream(), upto, tag)

    def slot(self, index: int) -> torch.Tensor:
        return self._slots[index]

    def release(self, index: int) -> None:
        """Gives slot ``index`` back after the work queued so far on the current stream."""
        check_fork()  # (a streamer freed in a forked child gives its slots back here)
        with self._lock:
            settled = not self._unsettled
            self._unsettled = True  # until the engine has it back
            self._owned.pop(index, None)
            self._core.release(index, self._stream())
            self._unsettled = not settled

    def mark(self, tag: int, code: int) -> None:
        """A trace instant on the current stream; nothing (not even a call into the engine)
        while no trace is on."""
        if self.tracing:
            self._core.mark(self._stream(), tag, code)

    # -- gradients ----------------------------------------------------------------------------

    def push_grad(
        self, param: torch.nn.Parameter, grad: torch.Tensor, max_inflight: int, tag: int = 0
    ) -> None:
        """Runs ``param``'s gradient hooks on the device gradient, then queues its copy into host
        memory; :meth:`finish` makes it ``param.grad`` (or adds it to ``param.grad``).

        Accumulation (a backward adding to the gradient an earlier one left, no ``zero_grad``
        between) happens on the device while it has room: the running sum of the parameter's
        gradients since ``.grad`` was last empty stays in device memory, the new gradient is added
        to it there, and the sum crosses the link straight into ``.grad``, overwriting it: the
        same bytes cross as for a fresh gradient and the host adds nothing. The sums are kept
        only once the training loop has been seen to accumulate, and only while ``.grad`` is the
        tensor this engine wrote, unchanged since (its version counter). Otherwise the gradient
        lands in a buffer of its own, added into ``.grad`` at the end of backward."""
        if grad.requires_grad and torch.is_grad_enabled():
            # torch would keep the graph in ``.grad`` (for gradients of gradients); host memory
            # cannot: refused rather than a ``.grad`` that silently has none.
            raise RuntimeError(
                f"ramtorch: backward(create_graph=True) computed the gradient of a streamed weight "
                f"(shape {tuple(param.shape)}) with a graph, which its .grad in host RAM cannot keep. "
                "For gradients of gradients, take the first gradient with respect to inputs "
                "(torch.autograd.grad(loss, inputs, create_graph=True)) and backward through it, or "
                "keep the module resident"
            )
        hooks = getattr(param, "_backward_hooks", None)
        if hooks:
            for hook in list(hooks.values()):
                out = hook(grad)
                if out is not None:
                    grad = out
        if grad.layout != torch.strided:
            raise RuntimeError(
                f"ramtorch: a streamed parameter of shape {tuple(param.shape)} got a {grad.layout} "
                "gradient; streamed weights take dense gradients only"
            )
        grad = grad.to(dtype=param.dtype).contiguous()
        if self._listeners:  # (iterating a WeakSet allocates: once per gradient, skipped when empty)
            for listener in list(self._listeners):
                if listener.reduce_grad(param, grad) is False:
                    return  # ZeRO-2: reduced onto the rank that owns it, which keeps it
        nbytes = grad.numel() * grad.element_size()
        small = small_grad(nbytes)  # crosses in a batch (see _add_small)
        pid = id(param)
        entry = self._pending_entry(param, nbytes, small)
        s = self._sums.get(pid) if entry.target is not None else None
        if s is not None:
            # The running sum, out of place: the sum being copied stays intact until its copy
            # retires, and a gradient autograd handed over is never written.
            src = grad if s.dev is None else s.dev + grad
            s.dev = src
            if small:
                self._add_small(entry, src, nbytes, max_inflight, tag, into_target=True)
                return
            dst = entry.target
        else:
            if small:
                self._add_small(entry, grad, nbytes, max_inflight, tag)
                return
            src = grad
            dst = _arena.host_empty(param.shape, param.dtype)
            entry.bufs.append(dst)
        assert dst is not None
        # Source and destination are recorded before the copy is queued: an interrupt (Ctrl-C)
        # landing right after the engine queued it must not free either while the copy runs
        # (an interrupted backward's records are dropped only after a synchronize).
        try:
            self._queue_copy(dst, src, nbytes, max_inflight, tag)
        except Exception:
            self._undo_push(pid, entry, dst)
            raise

    def push_grad_by_rows(
        self,
        param: torch.nn.Parameter,
        dtype: torch.dtype,
        rows: Sequence[tuple[int, int]],
        fill: Callable[[int, int, torch.Tensor], None],
        max_inflight: int,
        tag: int = 0,
    ) -> torch.Tensor:
        """:meth:`push_grad` for a gradient computed by blocks of rows: ``fill(r0, r1, out)``
        writes rows ``r0:r1`` of it (of ``dtype``) into ``out``, and each block's copy is queued as
        soon as its rows are computed, so the link starts on the first block while the device
        computes the others. Returns the whole gradient.

        Where the gradient cannot cross as it is computed (gradient hooks or a ZeRO-2 listener read
        it whole first, it is of another dtype than the parameter, or small), it is computed whole
        and handed to :meth:`push_grad`."""
        shape = tuple(param.shape)
        grad = torch.empty(shape, dtype=dtype, device=self.device)
        nbytes = grad.numel() * grad.element_size()
        if (
            getattr(param, "_backward_hooks", None)
            or (self._listeners and self._reduced(param))
            or dtype != param.dtype
            or len(shape) < 1
            or small_grad(nbytes)
        ):
            for r0, r1 in rows:
                fill(r0, r1, grad[r0:r1])
            self.push_grad(param, grad, max_inflight, tag)
            return grad
        pid = id(param)
        row_bytes = nbytes // shape[0] if shape[0] else 0
        entry = self._pending_entry(param, nbytes, False)
        s = self._sums.get(pid) if entry.target is not None else None
        if s is not None:
            src = grad if s.dev is None else torch.empty_like(grad)  # the running sum, out of place
            dst = entry.target
        else:
            src = grad
            dst = _arena.host_empty(param.shape, param.dtype)
            entry.bufs.append(dst)
        assert dst is not None
        queued = False
        try:
            for r0, r1 in rows:
                fill(r0, r1, grad[r0:r1])
                if src is not grad:
                    assert s is not None and s.dev is not None
                    torch.add(s.dev[r0:r1], grad[r0:r1], out=src[r0:r1])
                self._queue_copy(dst[r0:r1], src[r0:r1], (r1 - r0) * row_bytes, max_inflight, tag)
                queued = True
            if s is not None:
                s.dev = src
        except BaseException:
            if queued:
                self._core.synchronize()  # blocks already queued write into ``dst``
            self._undo_push(pid, entry, dst)
            raise
        return grad

    def _undo_push(self, pid: int, entry: _Pending, dst: torch.Tensor) -> None:
        """A gradient of parameter ``pid`` whose copy into ``dst`` could not be queued (nothing
        of it in flight any more): its records are undone."""
        self._drop_sum(pid)  # its device sum may be ahead of ``.grad`` now
        if entry.bufs and entry.bufs[-1] is dst:
            entry.bufs.pop()
        if not entry.bufs and entry.target is None:
            del self._pending[pid]

    def _reduced(self, param: torch.nn.Parameter) -> bool:
        """Whether a listener reads ``param``'s gradients whole before they leave (ZeRO-2 reduces
        them onto their owner: ``reduce_grad``): one that cannot say is taken to."""
        for listener in list(self._listeners):
            reduces = getattr(listener, "reduces_grad", None)
            if reduces is None or reduces(param):
                return True
        return False

    def _pending_entry(self, param: torch.nn.Parameter, nbytes: int, small: bool) -> _Pending:
        """``param``'s record in the running backward, made at its first gradient: where the
        gradients of this backward go (a device sum crossing into ``target``, or buffers of
        their own), decided from ``.grad`` and the sums kept."""
        pid = id(param)
        entry = self._pending.get(pid)
        if entry is None:
            if not self._pending:  # the backward's first gradient
                self._backward_t0 = time.perf_counter()
                if self._streaming and self._plan:
                    self._look_ahead()  # its first ``.grad`` copies
            entry = _Pending(param)
            prior = param.grad
            s = self._sums.get(pid)
            if s is not None and not s.holds(param, prior):
                self._drop_sum(pid)  # ``.grad`` was emptied, replaced or written since
                s = None
            if prior is not None:
                self._accumulated = True
                if s is None:
                    if not self._keep_sums:  # the loop accumulates: keep sums from now on
                        self._keep_sums = True
                        self._update_sum_cap()
                    if self._streaming:
                        s = None if small else self._stream_sum(param, prior, nbytes)
                    else:
                        s = self._start_sum(param, prior, nbytes)
                    if (s is None or s.transient) and not small and _plain_host_grad(prior, param):
                        self._host_summed.append((weakref.ref(param), nbytes))
            if s is not None:
                # The sum crosses whole into a buffer that becomes ``.grad``'s memory at the end
                # of backward (not into ``.grad`` itself: a backward that raises leaves it as it was).
                entry.target = _LATER if small else _arena.host_empty(param.shape, param.dtype)
                entry.replaces = prior
                if s.transient:
                    entry.streamed = s.version
            elif prior is None and self._keep_sums and self._sum_room(nbytes + self._stream_reserve):
                s = self._sums[pid] = _Sum(param)
                self._sum_bytes += nbytes
                entry.target = _LATER if small else _arena.host_empty(param.shape, param.dtype)
            self._pending[pid] = entry  # one step: an interrupt leaves it recorded or not
        return entry

    def _queue_copy(
        self, dst: torch.Tensor, src: torch.Tensor, nbytes: int, max_inflight: int, tag: int
    ) -> None:
        """Queues the copy of gradient bytes ``src`` (on the device) into ``dst`` (host arena
        memory), throttled; ``src`` stays referenced until its copy has completed. Raises with
        nothing queued (and every earlier copy waited for)."""
        self._grad_sources.append(src, nbytes)
        limit = self._gradient_copies_allowed(max_inflight, nbytes)
        rng = _profile.begin("ramtorch.copy_to_host") if _profile.active() else None
        try:
            retired = self._core.copy_to_host(dst, src, nbytes, limit, self._stream(), tag)
        except Exception:
            self._core.synchronize()  # (refused: nothing queued; waited for in any case)
            self._grad_sources.pop()
            raise
        finally:
            if rng is not None:
                _profile.end(rng)
        for _ in range(min(retired, len(self._grad_sources) - 1)):  # earlier copies only
            self._grad_sources.popleft()

    def _add_small(
        self,
        entry: _Pending,
        grad: torch.Tensor,
        nbytes: int,
        max_inflight: int,
        tag: int,
        into_target: bool = False,
    ) -> None:
        """Keeps small gradient ``grad`` (contiguous, of ``entry``'s parameter) on the device until
        its batch crosses the link (:meth:`_flush_small`); until then it is in no ``entry.bufs``.
        With ``into_target`` it is the parameter's running sum: its host tensor becomes
        ``entry.target`` (:data:`_LATER` until then)."""
        key = (grad.dtype, self._stream(), tag)
        b = self._small.get(key)
        if b is None:
            if self._small:
                self._flush_small(keep=tag)  # other units' (a batch is one unit's: the trace names it)
            stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
            b = self._small[key] = _SmallGrads(stream, max_inflight, tag)
        b.entries.append(entry)
        b.grads.append(grad)
        b.into_target.append(into_target)
        b.nbytes += nbytes
        b.max_inflight = max_inflight
        if b.nbytes >= _SMALL_BATCH_BYTES or len(b.grads) >= _SMALL_BATCH_COUNT:
            del self._small[key]
            self._copy_small(b)

    def _flush_small(self, keep: int | None = None) -> None:
        """Queues the copies of every small gradient still waiting on the device (but unit
        ``keep``'s): before anything reads the records of the running backward (the optimizers
        told that gradients are on their way, the end of backward)."""
        for key in [k for k in self._small if k[2] != keep]:
            b = self._small.pop(key)
            if b.stream is not None and key[1] != self._stream():
                with torch.cuda.stream(b.stream):
                    self._copy_small(b)
            else:
                self._copy_small(b)

    def _copy_small(self, b: _SmallGrads) -> None:
        """One copy of batch ``b``'s gradients, packed back to back on the device, into one host
        buffer; each gradient's host tensor is its stretch of the buffer (a storage of its own)."""
        grads = b.grads
        src = _flatten(grads) if len(grads) > 1 else grads[0].view(-1)
        dst = _arena.host_empty((src.numel(),), src.dtype)
        try:
            self._queue_copy(dst, src, b.nbytes, b.max_inflight, b.tag)
        except Exception:
            for entry, into in zip(b.entries, b.into_target):
                pid = id(entry.param)
                if into:
                    self._drop_sum(pid)  # its device sum may be ahead of ``.grad`` now
                    self._pending.pop(pid, None)
                elif not entry.bufs and entry.target is None:
                    self._pending.pop(pid, None)
            raise
        addr, dtype, size = dst.data_ptr(), dst.dtype, dst.element_size()
        view_at = _arena.view_at
        for entry, g, into in zip(b.entries, grads, b.into_target):
            host = view_at(addr, g.shape, dtype)
            if into:
                entry.target = host  # (a later sum of the same backward replaces it: it is newer)
            else:
                entry.bufs.append(host)
            addr += g.numel() * size

    def _gradient_copies_allowed(self, max_inflight: int, nbytes: int) -> int:
        """How many gradient copies may be in flight once this one (of ``nbytes``) is queued: the
        throttle bounds the device memory that gradients waiting for the link hold to about
        ``max_inflight`` units' worth (``max_inflight`` slots), not ``max_inflight`` tensors. A
        unit has many gradients, most of them small (norms, biases): counting tensors would block
        the backward's thread on each unit's last copies, leaving the GPU without queued work."""
        budget = max_inflight * max(self._slot_bytes, nbytes)
        sources = self._grad_sources
        if sources.nbytes <= budget:  # every copy in flight fits, this one's included
            return min(_MAX_GRADIENT_COPIES, max(max_inflight, len(sources)))
        total, n = nbytes, 0
        items = sources.items
        for i in range(len(items) - 2, -1, -1):  # newest first, this copy's excluded
            total += items[i][1]
            if total > budget:
                break
            n += 1
        return min(_MAX_GRADIENT_COPIES, max(max_inflight, n + 1))

    def limit_sums(self, owner: Any, nbytes: int) -> None:
        """``owner`` (a model's streamer with a ``gpu_budget``) leaves ``nbytes`` of its budget for
        gradient sums: while any such owner lives, the sums stay within what they leave together."""
        self._sum_limits[owner] = max(0, int(nbytes))

    def _start_sum(self, param: torch.nn.Parameter, prior: torch.Tensor, nbytes: int) -> _Sum | None:
        """A sum for ``param`` whose ``.grad`` (``prior``) this engine did not write: ``.grad`` is
        copied to the device once (a loop that never empties ``.grad`` pays that once, not a
        host add per backward), if there is room and it is a host tensor like the weight that
        this engine made (a :class:`HostGrad`: a write through ``.data`` is seen; in a tensor of
        the user's it would not be, and the gradients are added into it on the host)."""
        if not (self._sum_room(nbytes) and type(prior) is HostGrad and _plain_host_grad(prior, param)):
            return None
        s = self._sums[id(param)] = _Sum(param)
        self._sum_bytes += nbytes
        s.dev = prior.to(self.device, non_blocking=True, copy=True)
        s.host, s.version = prior, prior._version
        return s

    def _stream_sum(self, param: torch.nn.Parameter, prior: torch.Tensor, nbytes: int) -> _Sum | None:
        """A sum for this backward only, for a parameter whose gradient would otherwise be added
        onto its ``.grad`` in host memory (``prior``): ``.grad`` is copied to the device (ahead of
        the gradient where the last backward's order says it comes: :meth:`_look_ahead`), the
        gradients of this backward are added to it there, and the sum crosses whole, as a kept
        sum does. The host's memory moves two bytes for each gradient byte (the copy's read, the
        sum's write) instead of four (the gradient's write, two reads and a write for the add),
        and the link one more. Taken for the parameters of the plan (:meth:`_plan_next`) while
        the device has room; the sum is dropped once the parameter's gradients are all queued
        (:meth:`grads_complete`), which gives its room to the next."""
        pid = id(param)
        if pid not in self._plan_pos or not _plain_host_grad(prior, param):
            return None
        load = self._loads.pop(pid, None)
        if load is not None and (load.prior is not prior or load.version != prior._version):
            self._release_load(load)
            load = None
        if load is None:
            if not self._sum_room(nbytes):
                return None
            load = self._issue_load(prior, nbytes)
        self._plan_at = max(self._plan_at, self._plan_pos[pid])
        if load.event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(load.event)
            load.dev.record_stream(stream)  # (made on the side stream, read and freed on this one)
        s = self._sums[pid] = _Sum(param)  # its bytes are the load's, counted when it was issued
        s.transient = True
        s.dev, s.host, s.version = load.dev, prior, load.version
        self._transients.add(pid)
        self.sums_streamed += 1
        self._look_ahead()
        return s

    def _issue_load(self, prior: torch.Tensor, nbytes: int) -> _Load:
        """Starts the copy of host tensor ``prior`` to the device, on a side stream."""
        if self.device.type == "cuda":
            if self._load_stream is None:
                self._load_stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(self._load_stream):
                dev = torch.empty(prior.shape, dtype=prior.dtype, device=self.device)
                dev.copy_(prior, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._load_stream)
        else:
            dev, event = prior.clone(), None
        self._sum_bytes += nbytes
        self._transient_bytes += nbytes
        self._transient_peak = max(self._transient_peak, self._transient_bytes)
        return _Load(dev, event, prior, nbytes)

    def _release_load(self, load: _Load) -> None:
        """Gives back the room of a copy of a ``.grad`` that no sum took (its host tensor stays
        referenced until the copy is done)."""
        if load.event is not None:
            load.event.synchronize()
        self._sum_bytes -= load.nbytes
        self._transient_bytes -= load.nbytes

    def _look_ahead(self) -> None:
        """Copies the ``.grad`` of the next parameters of the plan to the device ahead of their
        gradients, up to ``_LOADS_AHEAD`` at a time, within the room for sums."""
        i = self._plan_at + 1
        plan = self._plan
        while len(self._loads) < _LOADS_AHEAD and i < len(plan):
            p = plan[i]()
            i += 1
            if p is None:
                continue
            pid = id(p)
            if pid in self._loads or pid in self._pending or pid in self._sums:
                continue
            prior = p.grad
            nbytes = p.numel() * p.element_size()
            if prior is None or small_grad(nbytes) or not _plain_host_grad(prior, p):
                continue
            if not self._sum_room(nbytes):
                break
            self._loads[pid] = self._issue_load(prior, nbytes)

    def _plan_next(self) -> None:
        """At the end of an accumulating backward: where gradients were added onto a ``.grad`` in
        host memory, the next backward streams the share :attr:`streamed_sum_share` of them (in
        bytes, spread along their order) through the device (:meth:`_stream_sum`). Of the sums kept
        across backwards, those that would leave no room for the streamed ones are dropped then.
        The plan is for the next backward only (the backward after an edit or a new model makes
        its own)."""
        summed, self._host_summed = self._host_summed, []
        if not summed or not (self.device.type == "cuda" or self.stream_sums_on_host):
            return
        share = self.streamed_sum_share
        if share is None:
            share = self.share_choice.share()
        self._plan_share = share
        if share <= 0:  # every such gradient adds on the host, and sums are kept where they fit
            self._streaming = False
            self._stream_reserve = 0
            self._plan, self._plan_pos = [], {}
            return
        if not self._streaming:
            self._streaming = True
            # The sums kept so far stay where they leave room for a sum streamed now and the
            # copies ahead of it; the others are dropped (``.grad`` holds their whole sum).
            self._stream_reserve = reserve = max(n for _, n in summed) * (_LOADS_AHEAD + 1)
            cap = self._sum_cap_now()
            for pid in list(self._sums):
                if self._sum_bytes + reserve <= cap:
                    break
                self._drop_sum(pid)
        plan: list[weakref.ref[torch.nn.Parameter]] = []
        seen = taken = 0
        for ref, nbytes in summed:
            seen += nbytes
            if taken + nbytes <= share * seen + nbytes / 2:
                plan.append(ref)
                taken += nbytes
        self._plan = plan
        self._plan_pos = {}
        for i, ref in enumerate(plan):
            p = ref()
            if p is not None:
                self._plan_pos[id(p)] = i

    def _end_transients(self) -> None:
        """Drops this backward's streamed sums and unused ``.grad`` copies."""
        for pid in list(self._transients):
            self._drop_sum(pid)
        for load in self._loads.values():
            self._release_load(load)
        self._loads.clear()
        self._plan_at = -1

    def _sum_cap_now(self) -> int:
        """How many bytes of gradient sums the device may hold."""
        if self.sum_cap is not None:
            return self.sum_cap
        cap = self._auto_sum_cap
        limits = list(self._sum_limits.values())
        if limits:
            cap = min(cap, sum(limits))
        return cap

    def _sum_room(self, nbytes: int) -> bool:
        """Whether the device may hold ``nbytes`` more of gradient sums."""
        return self._sum_bytes + nbytes <= self._sum_cap_now()

    def _drop_sum(self, pid: int) -> None:
        s = self._sums.pop(pid, None)
        if s is not None:
            self._sum_bytes -= s.nbytes
            if s.transient:
                self._transients.discard(pid)
                self._transient_bytes -= s.nbytes

    def drop_sums(self) -> None:
        """Forgets every gradient sum kept on the device (their memory goes back to torch), and
        the copies of ``.grad`` made ahead for sums streamed in the running backward."""
        if self._loads and self._load_stream is not None:
            self._load_stream.synchronize()  # (their host tensors are dropped now)
        self._loads.clear()
        self._transients.clear()
        self._transient_bytes = 0
        self._sums.clear()
        self._sum_bytes = 0

    def _update_sum_cap(self) -> None:
        """After a backward: how many bytes of gradient sums the device may hold from now on.
        On a GPU, what the highest memory use seen so far leaves below the process's limit
        (the device's memory times torch's per-process fraction), less a reserve of a tenth
        (at least 2 GiB); the sums held when that peak was first seen count as room, since it
        includes them. On the host device the sums live in host memory: no limit."""
        if self.device.type != "cuda":
            self._auto_sum_cap = 1 << 62
            return
        total = torch.cuda.get_device_properties(self.device).total_memory
        limit = int(total * torch.cuda.get_per_process_memory_fraction(self.device))
        self._auto_sum_cap = self._cap_below(limit, torch.cuda.max_memory_allocated(self.device))

    def _cap_below(self, limit: int, peak: int) -> int:
        """The room for gradient sums under ``limit`` bytes, less a reserve of a tenth (at least
        2 GiB), given torch's ``peak`` of allocated memory."""
        reserve = max(2 << 30, limit // 10)
        if peak != self._cap_peak:
            # A new highest use (or torch's peak was reset): what it held besides the sums held
            # now. The peak is a maximum over the process's life, so it keeps sums held when it
            # was reached: measured against the sums held later (fewer, after a zero_grad), it
            # would shrink the room after every backward until no sum was left.
            self._cap_peak = peak
            # Sums streamed for one backward held up to ``_transient_peak`` bytes then.
            self._cap_base = max(0, peak - self._sum_bytes - self._transient_peak)
        return max(0, limit - reserve - self._cap_base)

    def finish(self) -> None:
        """Waits for every gradient copy (one synchronisation per backward) and writes ``.grad``:
        a gradient whose sum crossed from the device is there already (or becomes ``.grad``),
        the others' host buffers are added into it. Then runs post-accumulate-grad hooks."""
        # The optimizer step comes next: weights may change in ways no version counter sees.
        self._core.invalidate()
        self._flush_small()
        if self._adds_queued:  # before any listener writes a .grad (a table's rows)
            t = time.perf_counter()
            err = self._adds.wait()
            self.adds_wait_seconds += time.perf_counter() - t
            self._adds_queued = 0
            if err is not None:
                self._drop_backward()  # as for an interrupted backward
                self._user = None
                raise RuntimeError(
                    "ramtorch: adding a gradient into .grad on the host failed (the backward wrote no .grad)"
                ) from err
        for listener in list(self._listeners):
            listener.before_finish(self)
        if not self._pending and not self._grad_sources:
            self._user = None  # the training step's backward is over
            return
        if _profile.active():
            with _profile.span("ramtorch.wait_gradient_copies"):
                self._core.synchronize()
        else:
            self._core.synchronize()
        self._grad_sources.clear()
        pending, self._pending = self._pending, {}
        with torch.no_grad():
            for pid, entry in pending.items():
                param, target = entry.param, entry.target
                if entry.pre is not None:
                    self._finish_pre_added(param, entry)
                elif target is not None:
                    for b in entry.bufs:  # gradients that came after a streamed sum was dropped
                        host_add_(target, b)
                    s = self._sums.get(pid)
                    grad = param.grad
                    if entry.streamed is not None:
                        held = grad is entry.replaces and grad is not None and grad._version == entry.streamed
                    else:
                        held = grad is entry.replaces and s is not None and s.holds(param, grad)
                    if grad is None:
                        param.grad = grad = host_grad(target)
                        self._note_written(param, grad)
                    elif held:
                        # The sum of every gradient since ``.grad`` was empty: it becomes the
                        # memory of the same tensor, as torch's in-place accumulation keeps it
                        # (the version counter moves, as it does there), where this engine made
                        # that tensor; a tensor of the user's keeps its memory (and its views).
                        if self._wrote(param, grad):
                            grad.set_(target)
                            self._note_written(param, grad)
                        else:
                            grad.copy_(target)
                    else:  # ``.grad`` changed during backward (a hook): added into it
                        grad.add_(target)
                        s = None
                        self._drop_sum(pid)
                    if s is not None and not s.transient:
                        s.host, s.version = grad, grad._version
                else:
                    total = entry.bufs[0]
                    for b in entry.bufs[1:]:
                        host_add_(total, b)
                    if param.grad is None:
                        param.grad = total = host_grad(total)
                        self._note_written(param, total)
                    else:
                        host_add_(param.grad, total)
                post = getattr(param, "_post_accumulate_grad_hooks", None)
                if post:
                    for hook in list(post.values()):
                        hook(param)
        self._end_backward_sums()
        for listener in list(self._listeners):
            listener.after_finish()
        self._user = None  # the training step's backward is over: another thread may start one

    def _finish_pre_added(self, param: torch.nn.Parameter, entry: _Pending) -> None:
        """Writes ``.grad`` of a parameter whose gradient was added to it as it landed: the sum
        becomes the memory of ``.grad`` where this engine wrote that tensor (as the device sums
        do), else is copied into it."""
        assert entry.pre is not None
        prior, version, summed = entry.pre
        total = entry.bufs[0]
        for b in entry.bufs[summed:]:  # (none, unless a gradient came after the parameter's last)
            host_add_(total, b)
        grad = param.grad
        if grad is prior and prior._version != version:
            warnings.warn(
                f"ramtorch: the .grad of a parameter of shape {tuple(param.shape)} was written during "
                "backward after its gradient was complete; it holds the gradient added to its value "
                "before that write",
                RuntimeWarning,
                stacklevel=2,
            )
        if self._wrote(param, prior):
            prior.set_(total)
            if param.grad is prior:
                self._note_written(param, prior)
        else:  # a tensor of the user's (or changed since): its memory, and any view of it, stay
            prior.copy_(total)

    def _end_backward_sums(self) -> None:
        """Learns, at the end of a backward, whether to keep gradient sums: a loop that stops
        accumulating (two backwards in a row that added to nothing) gets its memory back."""
        self._end_transients()
        if self._accumulated:
            self._fresh_backwards = 0
            if self._plan_share is not None and self.streamed_sum_share is None:
                self.share_choice.observe(self._plan_share, time.perf_counter() - self._backward_t0)
            self._plan_next()
        else:
            self._host_summed.clear()
            self._fresh_backwards += 1
            if self._fresh_backwards >= 2 and self._keep_sums:
                self._keep_sums = False
                self._streaming = False
                self._stream_reserve = 0
                self._plan, self._plan_pos = [], {}
                self._plan_share = None
                self.drop_sums()
        self._accumulated = False
        if self._keep_sums:
            self._update_sum_cap()

    def _check_thread(self, claim: bool) -> None:
        """Raises if another (live) thread has a training step in progress on this engine; with
        ``claim``, the calling thread's training step begins."""
        me = acting_thread()
        with self._user_lock:
            user = self._user
            if user is not None and user is not me and user.is_alive():
                raise RuntimeError(
                    f"ramtorch: two threads use the streaming engine of {self.device} at once: thread "
                    f"{me.name!r} starts a forward pass while thread {user.name!r} has a training step "
                    "in progress on it (a forward with gradients whose backward has not finished). "
                    "Models computing on one device share its engine, whose gradient path serves one "
                    "training step at a time: train them from one thread, or one after the other."
                )
            if claim:
                self._user = me

    def drop_interrupted(self, claim: bool = False) -> bool:
        """Called outside backward: gradients still pending belong to a backward pass that raised
        (Ctrl-C, an error in a hook) before its end. They are dropped, so an interrupted backward
        writes no ``.grad`` at all, and the engine is ready for the next step. Returns whether
        there was anything to drop.

        The optimizers may have updated some parameters during that backward (their update
        rewrites host memory without bumping version counters): slots holding those units must
        not be reused, so, as at the end of every backward, no slot is trusted anymore.

        Called at the start of every forward (``claim``: one with gradients, which begins a
        training step): raises if another thread's training step is in progress."""
        if torch._C._current_graph_task_id() != -1:
            return False  # a recomputation inside backward
        user, me = self._user, acting_thread()
        if claim and user is not me:
            self._check_thread(claim)
        elif user is not None and user is not me and (self._pending or self._grad_sources):
            # Without gradients of its own (inference, a load, synchronize), another thread only
            # conflicts with a backward whose gradients are on their way; a forward with gradients
            # that no backward followed (an evaluation outside no_grad) holds nothing.
            self._check_thread(claim)
        if self._pending or self._grad_sources:
            for holder in list(self._holders):
                holder.drop_prefetched()
            self._core.invalidate()
            self._drop_backward()
            return True
        return False

    def _drop_backward(self) -> None:
        """Forgets the gradients of a backward that did not end (or failed at its end): nothing of
        it reaches ``.grad``."""
        for listener in list(self._listeners):
            listener.drain(interrupted=True)
        self._core.synchronize()
        if self._adds_queued:
            self._adds.wait()  # (they wrote only buffers that are dropped now)
            self._adds_queued = 0
        self._grad_sources.clear()
        self._small.clear()  # never queued
        self._pending.clear()
        self.drop_sums()  # they may hold gradients that never reached ``.grad``
        self._host_summed.clear()
        self._plan_at = -1
        self._accumulated = False

    # -- gradient listeners (optimizers that update as gradients land) --------------------------

    def add_holder(self, holder: Any) -> None:
        """``holder.drop_prefetched()`` is called whenever this engine needs its slots back."""
        self._holders.add(holder)

    def remove_holder(self, holder: Any) -> None:
        self._holders.discard(holder)

    def add_listener(self, listener: Any) -> None:
        """``listener.on_grads(engine, params)`` is called during backward when every gradient of
        ``params`` for this backward is on its way to the host; ``listener.before_finish(engine)`` before
        the gradients are written to ``.grad``; ``listener.reduce_grad(param, grad)`` with each
        gradient before it leaves, whole, unless ``listener.reduces_grad(param)`` says it has
        nothing to do with ``param``'s (then a gradient may leave by parts as it is computed)."""
        self._listeners.add(listener)

    def grads_complete(self, params: list[torch.nn.Parameter]) -> None:
        # One listener call at a time across engines: the backwards of several devices run on
        # autograd's threads, one a device (a model over several devices, offload(devices=...)),
        # and an optimizer listening to both hands its jobs out from one state.
        if self._transients:  # their gradients are queued: the room goes to the next ones
            for p in params:
                if id(p) in self._transients:
                    self._drop_sum(id(p))
            self._look_ahead()
        readers = bool(self._listeners) and self._gradient_readers()
        if self._small and readers:
            self._flush_small()  # they read the records (``pending_gradient``)
        if self._accumulated and not readers:  # (readers read ``.grad`` and the buffers as they are)
            self._add_as_landed(params)
        with _LISTENER_CALLS:
            for listener in list(self._listeners):
                listener.on_grads(self, params)

    def _gradient_readers(self) -> bool:
        """Whether a listener reads the running backward's gradients as they land (an optimizer
        updating during backward: :meth:`pending_gradient`); listeners with a class attribute
        ``reads_gradients = False`` (the gathered tables' row gradients) do not."""
        return any(getattr(x, "reads_gradients", True) for x in self._listeners)

    def _add_as_landed(self, params: list[torch.nn.Parameter]) -> None:
        """``params`` have all their gradients of this backward queued. Where one is added into a
        ``.grad`` left by an earlier backward on the host (no running sum on the device for it),
        a thread adds ``.grad`` into the landed buffer as soon as its copy is done, while the
        backward goes on, rather than in a pass over every such gradient at its end. ``.grad``
        itself is written only at the end of backward (:meth:`finish`): an interrupted backward
        leaves it as it was. Small gradients are left to the end (their batches cross later)."""
        todo = []
        for p in params:
            entry = self._pending.get(id(p))
            if entry is None or entry.target is not None or entry.pre is not None or not entry.bufs:
                continue
            prior = p.grad
            if prior is None or small_grad(p.numel() * p.element_size()) or not _plain_host_grad(prior, p):
                continue
            entry.pre = (prior, prior._version, len(entry.bufs))
            todo.append((list(entry.bufs), prior))
        if not todo:
            return
        marker = self._core.marker()  # every copy queued so far
        self._adds_queued += len(todo)
        self.adds_as_landed += len(todo)
        self._adds.submit(lambda: self._run_adds(marker, todo))

    def _run_adds(self, marker: int, todo: list[tuple[list[torch.Tensor], torch.Tensor]]) -> None:
        """Each ``(bufs, prior)``: ``bufs[0]`` becomes ``bufs[0] + ... + bufs[-1] + prior`` once the
        copies have landed (only that buffer's memory is written)."""
        self._core.wait_marker(marker)
        with torch.no_grad():
            for bufs, prior in todo:
                total = bufs[0]
                for b in bufs[1:]:
                    host_add_(total, b)
                # ``total + prior``: the bits of torch's ``prior += total`` (addition commutes).
                host_add_(total, prior)

    def _wrote(self, param: torch.nn.Parameter, grad: torch.Tensor) -> bool:
        """Whether ``grad`` is the ``.grad`` this engine last wrote for ``param``, unchanged since."""
        w = self._written.get(param)
        return w is not None and w[0]() is grad and grad._version == w[1]

    def _note_written(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        self._written.set(param, (weakref.ref(grad), grad._version))

    def pending_gradient(self, param: torch.nn.Parameter) -> list[torch.Tensor]:
        """Host tensors whose sum is ``param``'s gradient at the end of the running backward, as
        far as its gradients were queued: read them once the copies queued so far have landed
        (an engine marker). Empty if none was queued."""
        entry = self._pending.get(id(param))
        if entry is None:
            return []
        if entry.target is not None:
            return [entry.target]
        prior = param.grad
        return ([] if prior is None else [prior]) + list(entry.bufs)

    def adds_into_grad(self, param: torch.nn.Parameter) -> bool:
        """Whether the end of the running backward adds host buffers (into ``param.grad``, or into
        the first of them), rather than the gradient crossing whole."""
        entry = self._pending.get(id(param))
        return entry is not None and entry.target is None and (param.grad is not None or len(entry.bufs) > 1)

    # -- synchronisation ------------------------------------------------------------------------

    def synchronize_compute(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def synchronize(self) -> None:
        """Waits for all copies of this device; pending gradients are written to ``.grad`` (within
        backward; outside it they belong to an interrupted backward and are dropped).
        Prefetched copies are dropped and no slot is trusted to hold current weights anymore."""
        check_fork()
        for holder in list(self._holders):
            holder.drop_prefetched()
        self._core.invalidate()
        # Outside backward, pending gradients are those of a backward that raised before its
        # end: dropped (written, they would be a partial step's gradients in ``.grad``).
        if not self.drop_interrupted() and (self._pending or self._grad_sources):
            self.finish()
        else:
            self._core.synchronize()

    def stats(self) -> dict[str, float | int]:
        s = dict(self._core.stats())
        s["slots"] = len(self._slots)
        s["slot_bytes"] = self._slot_bytes
        s["slot_device_bytes"] = len(self._slots) * self._slot_bytes
        s["grad_sum_bytes"] = self._sum_bytes
        s["grad_adds_as_landed"] = self.adds_as_landed
        s["grad_sums_streamed"] = self.sums_streamed
        share = self.streamed_sum_share if self.streamed_sum_share is not None else self.share_choice.choice
        s["grad_streamed_share"] = -1.0 if share is None else share  # (-1: still measuring)
        s["grad_adds_wait_seconds"] = self.adds_wait_seconds
        s.update({f"layer_{k}": v for k, v in self.layer_counters.items()})
        s.update(self.row_counters)
        s["h2d_gbps"] = s["h2d_timed_bytes"] / s["h2d_seconds"] / 1e9 if s["h2d_seconds"] > 0 else 0.0
        s["d2h_gbps"] = s["d2h_timed_bytes"] / s["d2h_seconds"] / 1e9 if s["d2h_seconds"] > 0 else 0.0
        links = self._core.link_stats()
        if links is not None:
            s["links"] = 1 + len(self.relays)
            s["link_relays"] = list(self.relays)
            s["link_own_bytes"] = links["own_bytes"]
            s["link_relay_bytes"] = list(links["relay_bytes"])
            s["link_own_down_bytes"] = links["own_down_bytes"]
            s["link_relay_down_bytes"] = list(links["relay_down_bytes"])
            s["link_direct"] = list(links["direct"])
            if self.link_shares is not None:
                s["link_shares"] = list(self.link_shares)
        return s


class _ByParam:
    """A value per live parameter: a dict by ``id`` whose entries hold their parameter weakly,
    dropped when it dies (torch's ``WeakIdKeyDictionary`` took about 4 µs a look-up, twice per
    gradient of every backward; this about 0.5)."""

    __slots__ = ("_d",)

    def __init__(self) -> None:
        self._d: dict[int, tuple[weakref.ref, Any]] = {}

    def get(self, param: torch.Tensor) -> Any:
        e = self._d.get(id(param))
        return e[1] if e is not None and e[0]() is param else None

    def set(self, param: torch.Tensor, value: Any) -> None:
        k, d = id(param), self._d
        e = d.get(k)
        if e is not None and e[0]() is param:
            d[k] = (e[0], value)
            return

        def gone(ref: weakref.ref, k: int = k, d: dict = d) -> None:
            e = d.get(k)
            if e is not None and e[0] is ref:  # (not a later parameter that took the same id)
                d.pop(k, None)

        d[k] = (weakref.ref(param, gone), value)

    def __len__(self) -> int:
        return len(self._d)


_ENGINES: dict[torch.device, DeviceEngine] = {}
_ENGINES_LOCK = threading.Lock()


def engine_for(device: torch.device, relays: tuple[int, ...] | None = None) -> DeviceEngine:
    """The engine of ``device`` (normalised), created on first use; with ``relays``, one fed
    through those peers as well (see :func:`configure_links`)."""
    eng = _ENGINES.get(device)
    if eng is None:
        with _ENGINES_LOCK:
            eng = _ENGINES.get(device)
            if eng is None:
                eng = DeviceEngine(device, relays or ())
                _ENGINES[device] = eng
                for callback in list(_ENGINE_CREATED):
                    callback(eng)
    if relays is not None and eng.asked_relays != relays:
        raise ValueError(
            f"{device} already streams over {_links_text(eng.asked_relays)}; links are set by the first "
            f"model offloaded to a device and shared by every model on it, so {_links_text(relays)} "
            "cannot be used now (pass the same links, or none)"
        )
    return eng


def _links_text(relays: tuple[int, ...]) -> str:
    if not relays:
        return "its own link only"
    return f"its own link and {len(relays)} peer(s) ({', '.join(map(str, relays))})"


#: Bytes each path's probe copies (see :func:`measure_link_shares`).
_PROBE_BYTES = 64 << 20


def measure_link_shares(device: torch.device, relays: tuple[int, ...]) -> list[float]:
    """The bandwidth of each path into CUDA ``device`` in bytes per second, its own link first:
    page-locked host memory copied to ``device``, then for each relay the slower of its two legs
    (host to the relay, relay to ``device`` over the peer link). Each is the best of three
    copies of 64 MiB timed by CUDA events; the page-locked probe is given back to the OS after."""

    def best(copy: Callable[[], None], on: torch.device) -> float:
        copy()  # the first copy pays for setup
        rates = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream = torch.cuda.current_stream(on)
            start.record(stream)
            copy()
            end.record(stream)
            end.synchronize()
            rates.append(_PROBE_BYTES / (start.elapsed_time(end) / 1e3))
        return max(rates)

    host = torch.empty(_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    own = torch.empty(_PROBE_BYTES, dtype=torch.uint8, device=device)
    shares = [best(lambda: own.copy_(host, non_blocking=True), device)]
    for r in relays:
        peer_dev = torch.device("cuda", r)
        peer = torch.empty(_PROBE_BYTES, dtype=torch.uint8, device=peer_dev)
        with torch.cuda.device(peer_dev):
            up = best(lambda peer=peer: peer.copy_(host, non_blocking=True), peer_dev)
        with torch.cuda.device(device):
            across = best(lambda peer=peer: own.copy_(peer, non_blocking=True), device)
        shares.append(min(up, across))
        del peer
    return shares


def link_shares(device: torch.device, relays: tuple[int, ...]) -> list[float] | None:
    """How copies into ``device`` are split between its own link and ``relays``: measured on
    CUDA (:func:`measure_link_shares`), equal (None) on the host device or where the measurement
    fails (with a warning)."""
    if device.type != "cuda":
        return None
    try:
        shares = measure_link_shares(device, relays)
        getattr(torch._C, "_host_emptyCache", lambda: None)()  # torch's allocator would keep the probe
    except (RuntimeError, ValueError, ZeroDivisionError) as e:
        warnings.warn(
            f"links: the paths into {device} could not be measured ({e}); copies are split equally",
            UserWarning,
            stacklevel=4,
        )
        return None
    if not all(math.isfinite(x) and x > 0 for x in shares):
        return None
    return shares


def configure_links(device: torch.device, links: object) -> tuple[int, ...] | None:
    """The relays ``offload(..., links=links)`` asks of ``device``'s engine: ``None`` (own link
    only, or whatever the engine already has), ``"auto"`` (on CUDA, every other GPU that can
    reach ``device`` directly, as ``torch.cuda.can_device_access_peer`` says; on the host device,
    none), a list of devices (CUDA: the peers; ``device`` itself may be listed) or, on the host
    device only, an int ``n``: ``n`` links, the own one and ``n - 1`` host stand-ins (the split
    and relay logic without a GPU). A peer that cannot be used is left out with a warning."""
    if links is None:
        return None
    if device.type != "cuda":
        if links == "auto":
            return ()
        if isinstance(links, bool) or not isinstance(links, int) or links < 1:
            raise ValueError(
                f"links={links!r} on the host device: give an int n >= 1 (the own link and n - 1 host "
                "stand-ins), 'auto' or None"
            )
        return tuple(range(1, links))
    if links == "auto":
        peers = [
            i
            for i in range(torch.cuda.device_count())
            if i != device.index and torch.cuda.can_device_access_peer(device.index, i)
        ]
        return tuple(peers)
    if isinstance(links, (str, torch.device, int)) or not hasattr(links, "__iter__"):
        raise ValueError(f"links={links!r}: give 'auto', a list of CUDA devices, or None")
    relays: list[int] = []
    for entry in links:  # type: ignore[union-attr]
        try:
            d = torch.device(entry)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"links: {entry!r} is not a device ({e})") from None
        if d.type != "cuda":
            raise ValueError(f"links: {entry!r} is not a CUDA device; peers of {device} must be GPUs")
        index = d.index if d.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"links: cuda:{index} does not exist ({torch.cuda.device_count()} GPU(s))")
        if index == device.index or index in relays:
            continue
        if not torch.cuda.can_device_access_peer(device.index, index):
            warnings.warn(
                f"links: cuda:{index} cannot reach {device} directly (no peer access); it is left out",
                UserWarning,
                stacklevel=3,
            )
            continue
        relays.append(index)
    return tuple(relays)


#: Called with every engine created from now on (layers above register here: the optimizers
#: listen to the gradients of every engine).
_ENGINE_CREATED: list[Callable[[DeviceEngine], None]] = []


def on_engine_created(callback: Callable[[DeviceEngine], None]) -> None:
    """Calls ``callback(engine)`` for every engine created after this call."""
    _ENGINE_CREATED.append(callback)


def engines() -> list[DeviceEngine]:
    """Engines created so far."""
    return list(_ENGINES.values())


# -- processes forked after an engine exists ---------------------------------------------------------

#: Whether this process was forked after its parent created an engine (see :func:`check_fork`).
_forked_child = False

#: What a forked child gets (the compiled layer raises the same at every call).
FORKED_MESSAGE = (
    "ramtorch cannot be used in a process forked after ramtorch started in its parent: fork() "
    "copies only the calling thread, so the engine's threads and locks are not in the child; "
    "start worker processes with the 'spawn' or 'forkserver' start method "
    "(multiprocessing.get_context('spawn'), or DataLoader(multiprocessing_context='spawn') when "
    "workers use ramtorch)"
)


def _after_fork_in_child() -> None:
    global _forked_child
    if _ENGINES:
        _forked_child = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def check_fork() -> None:
    """Raises in a process forked after its parent created an engine. Called where a forward or
    a synchronisation enters the streaming layer, before it takes a lock: the child has none of
    the parent's other threads, so a lock one of them held would never be released, and the
    engine's copies, run by threads of the parent, would never complete. (Every call into the
    compiled layer refuses in such a child too.) A child that does not use ramtorch, such as a
    ``DataLoader`` worker, is unaffected."""
    if _forked_child:
        raise RuntimeError(FORKED_MESSAGE)
