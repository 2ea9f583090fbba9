"""Host parameters' AdamW updates computed on a GPU, with the bits of the Rust kernel.

:func:`optim_step` takes what ``_core.optim_step`` takes (host tensors: the weight or master,
compensation, gradient, states, scales, and ``old`` for an update out of place) and computes the
same bits with the Triton kernel of ``_gpu_kernel``: the operands cross to the device in pieces
of :data:`PIECE` elements on two side streams (a piece's upload overlaps the previous one's
download), each piece's results come back into the destination host tensors, and the returned
event marks the end. Page-locked host tensors make the copies asynchronous; others work, slower.

Where this is used (``_assist``): while the CPU's cores update some parameters, the GPU updates
others; the link carries a piece's operands up and its results down (14 bytes a parameter in
``precision="compact"``, 30 with fp32 masters), and the kernel itself takes microseconds.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from .. import _core

#: Elements per piece (a multiple of the quantization block). Each of the two streams keeps a
#: device buffer a piece long for every operand, in and out: 28 bytes an element with fp32
#: masters, 14 in compact precision (2 more when the gradient comes in two parts); 235 and
#: 117 MB a stream, outside ``gpu_budget``.
PIECE = 1 << 23

_BF16 = torch.bfloat16


def layout(
    rule: str,
    param: torch.Tensor,
    grad: torch.Tensor,
    states: list[torch.Tensor],
    master: torch.Tensor | None,
    comp: torch.Tensor | None,
    scales: list[torch.Tensor] | None,
) -> tuple[int, int, int] | None:
    """The kernel's modes (parameter, first state, second state) for these operands, or None if
    the GPU kernel does not implement them (a rule other than AdamW, fp16 weights, fp16
    gradients' other dtypes): such an update stays on the CPU."""
    from . import _gpu_kernel as k

    if rule != "adamw" or len(states) != 2:
        return None
    if grad.dtype not in (torch.float32, _BF16, torch.float16):
        return None
    if master is not None:
        if param.dtype != _BF16 or master.dtype != torch.float32 or comp is not None:
            return None
        pmode = k.P_MASTER_BF16
    elif comp is not None:
        if param.dtype != _BF16 or comp.dtype != _BF16:
            return None
        pmode = k.P_COMP
    elif param.dtype == torch.float32:
        pmode = k.P_F32
    elif param.dtype == _BF16:
        pmode = k.P_BF16_SR
    else:
        return None
    modes = []
    for s in states:
        if s.dtype == torch.float32:
            modes.append(k.S_F32)
        elif s.dtype == _BF16:
            modes.append(k.S_BF16)
        elif s.dtype == torch.uint8 and scales is not None:
            modes.append(k.S_Q8)
        else:
            return None
    if (modes[0] == k.S_Q8) != (modes[1] == k.S_Q8):
        return None
    return pmode, modes[0], modes[1]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """bf16 tensors as the kernel reads and writes them (int16 bits); others as they are."""
    return t.view(torch.int16) if t.dtype == _BF16 else t


class _Operands:
    """The flat operands of one update: sources (read) and destinations (written), by the
    kernel's argument names, and which of them are per block (scales)."""

    def __init__(
        self,
        pmode: int,
        param: torch.Tensor,
        grad: torch.Tensor,
        states: list[torch.Tensor],
        master: torch.Tensor | None,
        comp: torch.Tensor | None,
        scales: list[torch.Tensor] | None,
        old: dict[str, Any] | None,
    ) -> None:
        from . import _gpu_kernel as k

        flat = lambda t: t.detach().reshape(-1)  # noqa: E731 - contiguous: a view
        src: dict[str, torch.Tensor] = {}
        dst: dict[str, torch.Tensor] = {}
        o = old or {}
        if pmode == k.P_MASTER_BF16:
            assert master is not None
            src["p_in"] = flat(o.get("master", master))
            dst["p_out"], dst["w_out"] = flat(master), flat(param)
        else:
            src["p_in"] = flat(o.get("param", param))
            dst["p_out"] = flat(param)
            if pmode == k.P_COMP:
                assert comp is not None
                src["c_in"], dst["c_out"] = flat(o.get("comp", comp)), flat(comp)
        old_states = o.get("states", states)
        old_scales = o.get("scales", scales)
        for name, new, was in zip("ab", states, old_states):
            src[f"{name}_in"], dst[f"{name}_out"] = flat(was), flat(new)
        if scales is not None:
            for name, new, was in zip("ab", scales, old_scales):
                src[f"{name}s_in"], dst[f"{name}s_out"] = flat(was), flat(new)
        self.grad = [flat(grad)]
        self.src, self.dst = src, dst

    @staticmethod
    def piece(t: torch.Tensor, name: str, a: int, b: int) -> torch.Tensor:
        """Elements ``[a, b)``'s part of operand ``name`` (its blocks' scales, for a scale)."""
        from . import _gpu_kernel as k

        if _Operands.per_block(name):
            return t[a // k.BLOCK : -(-b // k.BLOCK)]
        return t[a:b]

    @staticmethod
    def per_block(name: str) -> bool:
        """Whether operand ``name`` holds one value a quantization block (a scale)."""
        return name in ("as_in", "as_out", "bs_in", "bs_out")


def _consts(rule: str, hyper: dict[str, Any], offset: int) -> dict[str, Any]:
    h = dict(hyper)
    h["index_offset"] = offset
    c = _core.optim_constants(rule, h)
    c["lo"] = offset & 0xFFFFFFFF
    return c


def _check(n: int, param: torch.Tensor, grad: torch.Tensor, offset: int) -> None:
    if grad.numel() != n:
        raise ValueError(f"optim_step on a GPU: grad has {grad.numel()} elements but param has {n}")
    if n and offset >> 32 != (offset + n - 1) >> 32:
        raise ValueError(
            f"index_offset {offset} with {n} elements crosses a multiple of 2^32 elements; cut "
            "pieces at such multiples"
        )
    if not param.is_contiguous():
        raise ValueError("optim_step on a GPU: the parameter must be contiguous")


def _prepare(
    rule: str,
    hyper: dict[str, Any],
    param: torch.Tensor,
    grad: torch.Tensor,
    states: list[torch.Tensor],
    master: torch.Tensor | None,
    comp: torch.Tensor | None,
    scales: list[torch.Tensor] | None,
    old: dict[str, Any] | None,
) -> tuple[tuple[int, int, int], int, int, _Operands]:
    """The kernel's modes, the element count, the first element's index and the operands of one
    update, checked; ``NotImplementedError`` for operands the kernel does not implement."""
    modes = layout(rule, param, grad, states, master, comp, scales)
    if modes is None:
        raise NotImplementedError(f"optim_step on a GPU: these operands of {rule} are not supported")
    n = param.numel()
    offset = int(hyper.get("index_offset", 0))
    _check(n, param, grad, offset)
    return modes, n, offset, _Operands(modes[0], param, grad, states, master, comp, scales, old)


def optim_step_here(
    rule: str,
    hyper: dict[str, Any],
    param: torch.Tensor,
    grad: torch.Tensor | list[torch.Tensor],
    states: list[torch.Tensor],
    master: torch.Tensor | None = None,
    comp: torch.Tensor | None = None,
    scales: list[torch.Tensor] | None = None,
    old: dict[str, Any] | None = None,
) -> None:
    """``_core.optim_step`` computed by the Triton kernel on the tensors where they are (all on
    one device: a GPU, or the CPU under ``TRITON_INTERPRET=1``). ``grad`` may be a list of parts,
    summed first as the host path sums them."""
    from . import _gpu_kernel as k

    parts = grad if isinstance(grad, list) else [grad]
    g = parts[0] if len(parts) == 1 else parts[0] + parts[1]
    modes, n, offset, ops = _prepare(rule, hyper, param, g, states, master, comp, scales, old)
    tensors = {name: _bits(t) for name, t in (*ops.src.items(), *ops.dst.items())}
    tensors["grad"] = ops.grad[0]
    k.launch(*modes, n, tensors, _consts(rule, hyper, offset))


class DeviceStepper:
    """Runs host updates on one CUDA device: :meth:`step` stages the operands up in pieces,
    computes, and copies the results down into the host tensors, on two side streams."""

    def __init__(self, device: torch.device) -> None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # as tensors name it
        self.device = device
        # On the CPU (Triton's interpreter, for tests) the same path runs without streams.
        self._streams = [torch.cuda.Stream(device) if device.type == "cuda" else None for _ in range(2)]
        # Device buffers of each stream, by operand and dtype, kept for the next piece (the
        # stream's order makes reuse safe; no allocation while a training step holds the memory).
        self._bufs: list[dict[tuple[str, torch.dtype], torch.Tensor]] = [{}, {}]
        # One step at a time issues its work (several threads may share a stager): the buffers
        # are then used in stream order.
        self._lock = threading.Lock()
        #: Bytes copied each way, for the statistics.
        self.up_bytes = 0
        self.down_bytes = 0
        self.updates = 0

    def step(
        self,
        rule: str,
        hyper: dict[str, Any],
        param: torch.Tensor,
        grad: torch.Tensor | list[torch.Tensor],
        states: list[torch.Tensor],
        master: torch.Tensor | None = None,
        comp: torch.Tensor | None = None,
        scales: list[torch.Tensor] | None = None,
        old: dict[str, Any] | None = None,
        here: tuple[torch.Tensor, ...] = (),
        mirror: torch.Tensor | None = None,
        after: torch.cuda.Event | None = None,
    ) -> list[torch.cuda.Event]:
        """As :func:`optim_step_here` for host tensors; returns the events after which the
        destinations hold the results (the caller waits on them before reading).

        ``here``: operands on this device (a resident weight, its gradient), which the kernel
        reads and writes where they are, nothing staged; ``after`` is then the event after which
        they may be read. ``mirror``: a host tensor that also receives the new weight (the host
        copy of a weight written on the device)."""
        with self._lock:
            return self._issue(
                rule, hyper, param, grad, states, master, comp, scales, old, here, mirror, after
            )

    def _issue(self, *args: Any) -> list[torch.cuda.Event]:
        """:meth:`step`'s work, issued while its lock is held (arguments as :meth:`step`'s)."""
        rule, hyper, param, grad, states, master, comp, scales, old, here, mirror, after = args
        from . import _gpu_kernel as k

        parts = [grad] if isinstance(grad, torch.Tensor) else list(grad)
        modes, n, offset, ops = _prepare(rule, hyper, param, parts[0], states, master, comp, scales, old)
        gparts = [p.detach().reshape(-1) for p in parts]
        resident = {(t.device, t.data_ptr()) for t in here}
        for t in here:
            if t.device != self.device:
                raise ValueError(f"optim_step on {self.device}: an operand to use in place is on {t.device}")
        in_place = lambda t: (t.device, t.data_ptr()) in resident  # noqa: E731 - a view's start is its own
        if mirror is not None:
            if mirror.numel() != n or not mirror.is_contiguous():
                raise ValueError("optim_step on a GPU: the mirror must be contiguous, the parameter's size")
            weight = ops.dst["w_out" if "w_out" in ops.dst else "p_out"]
            if not in_place(weight):
                raise ValueError("optim_step on a GPU: a mirror is for a weight written in place")
            mirror = (mirror.detach().reshape(-1), weight)
        if after is not None:
            for stream in self._streams:
                if stream is not None:
                    stream.wait_event(after)
        events = []
        for i, a in enumerate(range(0, n, PIECE)):
            b = min(n, a + PIECE)
            stream = self._streams[i % 2]
            bufs = self._bufs[i % 2]

            def buf(name: str, h: torch.Tensor, bufs: dict = bufs) -> torch.Tensor:
                d = bufs.get((name, h.dtype))
                if d is None or d.numel() < h.numel():
                    whole = PIECE // k.BLOCK if _Operands.per_block(name) else PIECE
                    d = bufs[(name, h.dtype)] = torch.empty(
                        max(h.numel(), whole), dtype=h.dtype, device=self.device
                    )
                return d[: h.numel()]

            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                tensors: dict[str, torch.Tensor] = {}
                for name, t in ops.src.items():
                    h = ops.piece(t, name, a, b)
                    if in_place(t):
                        tensors[name] = _bits(h)
                        continue
                    d = buf(name, h)
                    d.copy_(h, non_blocking=True)
                    tensors[name] = _bits(d)
                    self.up_bytes += h.numel() * h.element_size()
                gs = []
                for j, gp in enumerate(gparts):
                    h = gp[a:b]
                    if in_place(gp):
                        gs.append(h)
                        continue
                    d = buf(f"grad{j}", h)
                    d.copy_(h, non_blocking=True)
                    gs.append(d)
                    self.up_bytes += h.numel() * h.element_size()
                tensors["grad"] = gs[0] if len(gs) == 1 else gs[0] + gs[1]
                outs = []
                for name, t in ops.dst.items():
                    h = ops.piece(t, name, a, b)
                    if in_place(t):
                        tensors[name] = _bits(h)
                        continue
                    d = buf(name, h)
                    tensors[name] = _bits(d)
                    outs.append((h, d))
                k.launch(*modes, b - a, tensors, _consts(rule, hyper, offset + a))
                for h, d in outs:
                    h.copy_(d, non_blocking=True)
                    self.down_bytes += h.numel() * h.element_size()
                if mirror is not None:
                    mirror[0][a:b].copy_(mirror[1][a:b], non_blocking=True)
                    self.down_bytes += (b - a) * mirror[0].element_size()
                if stream is not None:
                    # Blocking: a waiting thread sleeps (the CPU's updates want every core).
                    ev = torch.cuda.Event(blocking=True)
                    ev.record(stream)
                    events.append(ev)
        self.updates += 1
        return events[-2:]
