"""Placement and a cost model: which units stay resident, and the predicted time of a pass.

``predict(model, budget, tokens, ceilings)`` groups ``model`` into units exactly as
:func:`ramtorch.offload` would (it works on a model built on the ``meta`` device: nothing is
allocated), runs the same planner, then simulates the streaming pipeline unit by unit:

- a streamed unit's copy takes ``bytes / h2d``, copies run back to back on one link, and a copy
  needs a free slot (the unit ``slots`` places earlier must have finished computing);
- a unit's compute takes ``2 * params * tokens / (flop_rate * efficiency)`` (matrix products
  dominate) and starts when its copy is done and the previous unit has finished;
- training adds the backward pass (twice the forward's compute; streamed units copied again, in
  reverse order) and the optimizer (``optimizer_bytes_per_param * params / host`` per unit, started
  when the unit's backward is done, one unit at a time).

``python -m ramtorch plan --model config.json --budget 24GiB --tokens 4096`` prints the plan.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from . import _config, _disk, _kv_sizes
from ._stream import gather as _gather
from ._stream import pipeline as _pipeline
from ._stream import placement
from ._stream import units as _stream_units
from ._units import format_bytes, parse_bytes
from .optim import _state as _optim_state

#: ``precision`` values of ``ramtorch.optim`` that the plan prices.
PRECISIONS = _optim_state._PRECISIONS
#: ``states`` values of ``ramtorch.optim``: where the states of parameters kept on the device live.
STATES = ("device", "host")
#: AdamW's states (``ramtorch.optim.AdamW._state_names``): the optimizer the plan prices.
_ADAMW_STATES = ("exp_avg", "exp_avg_sq")


@dataclass
class Ceilings:
    """Measured limits of the machine. The defaults are those BENCHMARKS.md measured on one H200
    on PCIe gen5 with 16 host cores: 55 GB/s pinned copies each way, and 154 GB/s of optimizer
    host traffic (the fp32-master AdamW kernel's speed); the GPU's dense bf16 peak at 0.85."""

    h2d_gbps: float = 55.0
    d2h_gbps: float = 55.0
    tflops: float = 790.0
    efficiency: float = 0.85
    host_gbps: float = 154.0
    #: The disk tier (``offload(host_budget=..., disk=...)``): sequential ``O_DIRECT`` reads and
    #: writes of the store's disk (measured on the H200 machine's local disk: reads 1.46-1.91 GB/s,
    #: writes 1.9-2.5 GB/s).
    disk_gbps: float = 1.5
    disk_write_gbps: float = 1.9
    #: Links into the compute GPU (``offload(links=...)``: its own and its peers'), each at
    #: ``h2d_gbps``/``d2h_gbps``; copies are split equally among them.
    links: int = 1

    def __post_init__(self) -> None:
        # Every time is a size divided by one of these: zero, negative or nan ceilings would
        # give a ZeroDivisionError or a meaningless prediction.
        names = ("h2d_gbps", "d2h_gbps", "tflops", "efficiency", "host_gbps", "disk_gbps", "disk_write_gbps")
        for name in names:
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
            if not ok or (name == "efficiency" and v > 1):
                want = "a fraction in (0, 1]" if name == "efficiency" else "a positive finite number"
                raise ValueError(f"{name} must be {want}, got {v!r}")
        if isinstance(self.links, bool) or not isinstance(self.links, int) or self.links < 1:
            raise ValueError(f"links must be an int of at least 1, got {self.links!r}")

    @property
    def link_h2d(self) -> float:
        """Bytes a second into the GPU over all its links."""
        return self.h2d_gbps * 1e9 * self.links

    @property
    def link_d2h(self) -> float:
        """Bytes a second out of the GPU over all its links."""
        return self.d2h_gbps * 1e9 * self.links


@dataclass
class UnitPlan:
    name: str
    bytes: int
    params: int
    resident: bool
    #: How the unit's bytes reach the GPU: ``"resident"`` (they stay there), ``"copy"`` (copied
    #: into a slot each pass), ``"rows"`` (an embedding whose lookups gather the rows they read
    #: when they train the table, and read them in place from mapped host memory otherwise) or
    #: ``"mapped"`` (a frozen such table: every lookup reads in place, on a GPU).
    transfer: str = "copy"


@dataclass
class KVPlan:
    """Greedy decoding with a :class:`ramtorch.HostCache` holding ``context`` tokens of ``batch``
    sequences, under the plan's budget: the cache lives in host RAM; what the budget leaves after
    the weights' resident units and slots holds device copies of the layers' first pages
    (``HostCache(device_bytes=kv_device_bytes)``), whose tokens do not cross again. A decode step
    moves the streamed weights and the rest of the cache to the GPU, and the new token's keys
    and values back."""

    context: int
    batch: int
    page_tokens: int
    #: The whole cache, and a token's keys and values in every layer.
    kv_bytes: int
    kv_bytes_per_token: int
    #: What to give ``HostCache(device_bytes=...)``: whole pages, as it takes them.
    kv_device_bytes: int
    #: Cache bytes over the link in a decode step (``bench`` names: ``"kv_bytes_per_step"``).
    kv_bytes_per_step: int
    #: ``"gpu"`` when the budget holds the whole cache, else ``"host"``.
    kv_place: str
    #: Predicted decode step: the streamed weights and the cache's share to the GPU at the H2D
    #: ceiling (the new token's bytes back are fewer, in the other direction).
    decode_seconds: float


#: Bytes of one token's keys and values in every layer (``ramtorch._kv_sizes.bytes_per_token``).
kv_cache_bytes_per_token = _kv_sizes.bytes_per_token


def plan_kv_cache(
    pred: Prediction,
    model: nn.Module,
    context: int,
    batch: int = 1,
    page_tokens: int = 256,
    ceilings: Ceilings | None = None,
    lookahead: int = 1,
) -> KVPlan:
    """The KV cache of greedy decoding at ``context`` tokens under ``pred``'s plan (see
    :class:`KVPlan`): what the budget leaves after the weights (their resident units and slots)
    holds the cache's ring (``lookahead + 1`` layers' tokens) and the layer being assembled, then
    device copies of the cache's first pages (``HostCache.for_model`` gives a live offloaded
    model's cache the same); no budget keeps none there."""
    _kv_sizes.check_counts("", context=context, batch=batch, page_tokens=page_tokens)
    c = ceilings or Ceilings()
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError("the model has no transformers config: its KV cache cannot be sized")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    per_token = _kv_sizes.bytes_per_token(config, dtype, batch)
    layers = config.num_hidden_layers
    total = per_token * context
    room = 0
    if pred.budget is not None:
        room = pred.budget - pred.resident_bytes - pred.slots * pred.slot_bytes
    device = _kv_sizes.device_copy_bytes(room, per_token, layers, context, page_tokens, lookahead)
    mirrored = min(total, device)
    step = total - mirrored + per_token
    return KVPlan(
        context=context,
        batch=batch,
        page_tokens=page_tokens,
        kv_bytes=total,
        kv_bytes_per_token=per_token,
        kv_device_bytes=device,
        kv_bytes_per_step=step,
        kv_place="gpu" if mirrored >= total else "host",
        decode_seconds=(pred.streamed_bytes_per_pass + total - mirrored) / c.link_h2d,
    )


def kv_summary(kv: KVPlan) -> str:
    """Lines for the plan's printout: the cache, where it lives, a decode step."""
    if kv.kv_place == "gpu":
        where = "all of it on the GPU"
    elif kv.kv_device_bytes:
        held = format_bytes(kv.kv_device_bytes)
        where = f"{held} of it on the GPU (HostCache(device_bytes={kv.kv_device_bytes}))"
    else:
        where = "all of it in host RAM (give a GPU budget to keep some on the GPU)"
    return "\n".join(
        [
            f"KV cache at {kv.context} tokens x {kv.batch}: {format_bytes(kv.kv_bytes)} "
            f"({format_bytes(kv.kv_bytes_per_token)} a token), {where}",
            f"decode step: {format_bytes(kv.kv_bytes_per_step)} of cache over the link, predicted "
            f"{format_seconds(kv.decode_seconds)} with the streamed weights",
        ]
    )


def _transfer(u: Any, resident: bool, gathered: bool) -> str:
    """How unit ``u``'s bytes reach the GPU (:attr:`UnitPlan.transfer`)."""
    if resident:
        return "resident"
    if not gathered:
        return "copy"
    return "rows" if any(p.requires_grad for p in u.params) else "mapped"


@dataclass
class Prediction:
    """The plan and its predicted times."""

    budget: int | None
    slots: int
    slot_bytes: int
    resident_bytes: int
    streamed_bytes_per_pass: int
    forward_seconds: float
    forward_backward_seconds: float
    step_seconds: float
    units: list[UnitPlan] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: Device memory that training adds and the budget does not count: the gradients and
    #: optimizer states of what stays on the device (resident units, tied weights), as
    #: ``ramtorch.optim.AdamW`` keeps them (``precision="fp32-master"``): per parameter its
    #: gradient, two fp32 moments and, below fp32, an fp32 master (14 bytes a bf16 parameter).
    resident_training_bytes: int = 0
    #: The optimizer priced: ``ramtorch.optim.AdamW(precision=..., states=...)``.
    precision: str = "fp32-master"
    states: str = "device"
    #: Host RAM of the weights that stream (the streamed units, tables gathered by rows).
    host_weight_bytes: int = 0
    #: Host RAM that training adds: the gradients of the streamed parameters and the optimizer
    #: states kept in host RAM (``states="host"``: those of the parameters on the device too, with
    #: page-locked copies of their gradients and weights). The spare buffers of the default schedule's
    #: speculation are not counted: they are made only while memory allows.
    host_training_bytes: int = 0
    #: Parameters of the model (tied ones once).
    params: int = 0
    #: Host memory the plan was checked against (``None``: not checked), and whether training fits
    #: in it with a reserve for the runtime (the larger of 2 GiB and a tenth of it).
    host_memory: int | None = None
    fits_host: bool | None = None
    #: The disk tier: the host budget of the streamed units (``None``: no disk), the units past
    #: it (on disk), their bytes (read from disk once a pass), and the seconds a pass's reads take.
    host_budget: int | None = None
    disk_units: list[str] = field(default_factory=list)
    disk_bytes: int = 0
    disk_read_seconds_per_pass: float = 0.0
    #: ``offload(optimizer_on_disk=True)``: the optimizer states of the streamed units'
    #: parameters are on disk (their bytes), read and written once a step, not in host RAM; the
    #: host budget holds those units' gradients first.
    optimizer_on_disk: bool = False
    disk_state_bytes: int = 0
    #: Host memory beyond the budget that the updates of those states take at most: staging
    #: buffers for the pieces read ahead, being updated and being written back
    #: (``ramtorch._disk.STATES_IN_FLIGHT`` times the largest piece, about ``PIECE_BYTES`` or
    #: less).
    disk_state_staging_bytes: int = 0
    #: ``offload(devices=[...])`` over this many devices: the units of each stage (names, in the
    #: model's order) and their bytes, as offload cuts them (empty for one device). The rest of
    #: the prediction is for the whole model on one device.
    stages: list[list[str]] = field(default_factory=list)
    stage_bytes: list[int] = field(default_factory=list)

    @property
    def host_bytes_per_param(self) -> float:
        """Host bytes a parameter holds in training (weights, gradients, optimizer states)."""
        return (self.host_weight_bytes + self.host_training_bytes) / max(1, self.params)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "host_bytes_per_param": self.host_bytes_per_param}

    def summary(self) -> str:
        resident = [u.name for u in self.units if u.resident]
        n, held = len(self.units), self.resident_bytes + self.slots * self.slot_bytes
        lines = [
            f"units: {n} ({len(resident)} resident, {n - len(resident)} streamed)",
            f"device memory held by ramtorch: {format_bytes(held)} ({format_bytes(self.resident_bytes)} "
            f"resident + {self.slots} slots x {format_bytes(self.slot_bytes)})",
            "not counted in it, when training: gradients and optimizer states of the resident units "
            f"on the device ({self._optimizer()}): {format_bytes(self.resident_training_bytes)}",
            f"host memory: {format_bytes(self.host_weight_bytes)} of streamed weights; training adds "
            f"{format_bytes(self.host_training_bytes)} (gradients, optimizer states): "
            f"{self.host_bytes_per_param:.2f} bytes a parameter{self._fit()}",
            f"streamed per pass: {format_bytes(self.streamed_bytes_per_pass)}",
            f"predicted forward: {format_seconds(self.forward_seconds)}, forward+backward: "
            f"{format_seconds(self.forward_backward_seconds)}, training step ({self._optimizer()}): "
            f"{format_seconds(self.step_seconds)}",
        ]
        if self.host_budget is not None:
            lines.insert(
                4,
                f"on disk (host budget {format_bytes(self.host_budget)}): {len(self.disk_units)} units, "
                f"{format_bytes(self.disk_bytes)}, read once a pass: "
                f"{format_seconds(self.disk_read_seconds_per_pass)}"
                + (
                    f"; the streamed units' optimizer states on disk: {format_bytes(self.disk_state_bytes)}, "
                    "read and written once a step, through staging buffers of up to "
                    f"{format_bytes(self.disk_state_staging_bytes)}"
                    if self.optimizer_on_disk
                    else ""
                ),
            )
        if resident:
            shown = ", ".join(resident[:12]) + (" ..." if len(resident) > 12 else "")
            lines.append(f"resident: {shown}")
        if self.stages:
            lines.append(
                f"pipeline over {len(self.stages)} devices (offload(devices=...), cut by bytes; the "
                "figures above are for the whole model on one device):"
            )
            for k, (names, nbytes) in enumerate(zip(self.stages, self.stage_bytes)):
                span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
                lines.append(f"  stage {k}: {len(names)} units, {format_bytes(nbytes)}: {span}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _optimizer(self) -> str:
        return f"AdamW, {self.precision}" + (", states in host RAM" if self.states == "host" else "")

    def _fit(self) -> str:
        if self.host_memory is None:
            return ""
        need = self.host_weight_bytes + self.host_training_bytes
        verdict = "fits" if self.fits_host else "does NOT fit"
        return f"; {verdict} in {format_bytes(self.host_memory)} of host memory (needs {format_bytes(need)})"


def host_reserve(host_memory: int) -> int:
    """Host memory kept for the runtime (torch, CUDA, Python, activations' pinned copies) when a
    plan is checked against ``host_memory``: the larger of 2 GiB and a tenth of it."""
    return max(2 << 30, host_memory // 10)


def machine_memory() -> int:
    """This machine's physical memory in bytes."""
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


def optimizer_bytes(p: torch.Tensor, precision: str, *, device: bool = False) -> tuple[int, float]:
    """``(held, moved)``: bytes of ``ramtorch.optim.AdamW``'s states for parameter ``p`` (the
    master included), and bytes a step moves for it (its gradient read, every state read and
    written, the weight written, and read too where no master holds it). ``device``: the states
    of a parameter updated on its device by torch's kernels (``precision="compact"`` keeps fp32
    masters there)."""
    if device and precision == "compact":
        precision = "fp32-master"
    specs = _optim_state.state_specs(tuple(p.shape), p.dtype, precision, _ADAMW_STATES)
    held = sum(math.prod(shape) * torch.empty((), dtype=dt).element_size() for shape, dt in specs.values())
    size = p.numel() * p.element_size()
    return held, size + 2 * held + (size if "master" in specs else 2 * size)


def format_seconds(t: float) -> str:
    """A duration for a message, with three significant digits where it has them: ``"2.50 s"``,
    ``"12.3 ms"``, ``"456 µs"``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if t >= scale:
            x = t / scale
            return f"{x:.{2 if x < 10 else 1 if x < 100 else 0}f} {unit}"
    x = t * 1e6
    if x == 0:
        return "0 µs"
    return f"{x:.{max(0, 2 - math.floor(math.log10(x)))}f} µs"


def _simulate(
    copies: Sequence[float],
    computes: Sequence[float],
    slots: int,
    start: float = 0.0,
    reads: Sequence[float] | None = None,
) -> tuple[float, list[float]]:
    """One pass: returns (end time, per-unit compute end times). ``copies[i]`` is 0 for a
    resident unit. ``reads[i]``: seconds to read unit ``i`` from disk first (0: in host RAM); the
    disk reads its units back to back from the pass's start, and a unit's copy waits for its read."""
    link = start
    disk = start
    ends: list[float] = []
    streamed_ends: list[float] = []
    prev = start
    for k, (copy, comp) in enumerate(zip(copies, computes)):
        ready = prev
        if copy > 0:
            free = streamed_ends[-slots] if slots and len(streamed_ends) >= slots else start
            read = reads[k] if reads is not None else 0.0
            if read > 0:
                disk += read
                free = max(free, disk)
            link = max(link, free) + copy
            ready = max(prev, link)
        prev = ready + comp
        ends.append(prev)
        if copy > 0:
            streamed_ends.append(prev)
    return prev, ends


def predict(
    model: nn.Module,
    budget: int | str | None,
    tokens: int,
    ceilings: Ceilings | None = None,
    *,
    unit: Any = None,
    max_inflight: int | None = None,
    optimizer_bytes_per_param: float | None = None,
    precision: str = "fp32-master",
    states: str = "device",
    host_memory: int | str | None = None,
    host_budget: int | str | None = None,
    optimizer_on_disk: bool = False,
    devices: int = 1,
) -> Prediction:
    """The plan :func:`ramtorch.offload` would make for ``model``, its predicted times and its
    host memory in training with ``ramtorch.optim.AdamW(precision=precision, states=states)``.
    ``optimizer_bytes_per_param``: host bytes a step moves per parameter (default: what that
    optimizer moves for the model's parameters, 28 for a bf16 parameter with fp32 masters).
    ``host_memory``: bytes (or ``"24GiB"``, or ``"auto"``: this machine's) to check that training
    fits in, less :func:`host_reserve`; ``None``: not checked. ``host_budget``: the streamed units
    past it live on disk (as ``offload(host_budget=..., disk=...)`` places them), read once a pass
    (twice a training step, and written back once) at the ceilings' disk speeds.
    ``optimizer_on_disk``: the optimizer states of the streamed units live on disk (not in host
    RAM), read and written once a step, in ``step()`` after the backward, and the host budget
    holds the streamed units' gradients before their weights. ``devices``: the stage split that
    ``offload(devices=[...])`` makes over that many devices (``Prediction.stages``)."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive int, got {devices!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if states not in STATES:
        raise ValueError(f"states must be one of {STATES}, got {states!r}")
    memory = machine_memory() if host_memory == "auto" else parse_bytes(host_memory, "host_memory")
    c = ceilings or Ceilings()
    inflight = _config.max_inflight(max_inflight)
    raw, shared = _stream_units.collect_units(model, unit, parse_bytes(budget, "gpu_budget"))
    units = [_stream_units._Unit(k, name, m, entries) for k, (name, m, entries, _) in enumerate(raw)]
    shared_ids = {id(p) for p in shared}
    for u in units:
        u.params = [p for p in u.params if id(p) not in shared_ids]
        u.nbytes = _stream_units._packed_bytes(u.params)
    fixed = sum(p.numel() * p.element_size() for p in shared)
    fixed += sum(b.numel() * b.element_size() for b in model.buffers())
    forced = [k for k, r in enumerate(raw) if r[3]]
    for u, r in zip(units, raw):
        u.container = r[3]
    # Embedding tables streamed by rows take no slot (as in offload): the other units are
    # planned, then the tables kept resident in what the budget leaves, else copied by the rows
    # a pass reads.
    _gather.choose(units, None)
    cut = _pipeline.stage_units(model, units, devices) if devices > 1 else []
    sizes = [u.nbytes for u in units]
    planned = [k for k, u in enumerate(units) if not u.gather]
    hint = None
    if unit is None:
        hint = _stream_units.unit_hint(
            [(u.name, u.module, u.nbytes) for k, u in enumerate(units) if k not in forced]
        )
    try:
        pl = placement.plan(
            [sizes[k] for k in planned],
            [j for j, k in enumerate(planned) if k in forced],
            parse_bytes(budget, "gpu_budget"),
            inflight,
            fixed,
        )
    except ValueError as e:
        raise ValueError(f"{e}; {hint}" if hint else str(e)) from None
    spread = placement.spread_resident(
        [sizes[k] for k in planned], set(pl.resident), {j for j, k in enumerate(planned) if k in forced}
    )
    resident = {planned[j] for j in spread}
    gathered = {k for k, u in enumerate(units) if u.gather}
    limit = parse_bytes(budget, "gpu_budget")
    if limit is not None:
        for u in _gather.keep_resident(units, limit - pl.resident_bytes - pl.slots * pl.slot_bytes):
            gathered.discard(u.uid)
            resident.add(u.uid)
            pl.resident_bytes += u.nbytes
    for k in gathered:  # the rows a pass reads: at most one a token
        w = units[k].params[0]
        sizes[k] = min(tokens, w.shape[0]) * w.shape[1] * w.element_size()
    rate = c.tflops * 1e12 * c.efficiency
    counts = [sum(p.numel() for p in u.params) for u in units]
    # Host memory in training, and the bytes a step moves per parameter.
    trained = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]
    on_host = {id(p) for k, u in enumerate(units) if k not in resident for p in u.params}
    host_weights = sum(units[k].nbytes for k in range(len(units)) if k not in resident)
    # The disk tier: the streamed units past the host budget, in the order offload puts them.
    on_disk: list[int] = []
    hb = parse_bytes(host_budget, "host_budget")
    if optimizer_on_disk and hb is None:
        raise ValueError("optimizer_on_disk=True needs host_budget (the units on disk)")
    if hb is not None:
        cands = [k for k in range(len(units)) if k not in resident and not units[k].container]
        hb -= sum(units[k].nbytes for k in cands if k in gathered)
        if optimizer_on_disk:  # (as offload: the streamed units' gradients first)
            hb -= sum(_disk.grad_bytes(units[k].params) for k in cands)
        cands = [k for k in cands if k not in gathered]
        cands = [cands[i] for i in _disk.registration_order(model, [units[k].module for k in cands])]
        on_disk = [cands[i] for i in _disk.choose([units[k].nbytes for k in cands], max(hb, 0))]
        host_weights -= sum(units[k].nbytes for k in on_disk)
    # optimizer_on_disk: the states of every streamed unit's parameters (on disk or not).
    states_on_disk = on_host if optimizer_on_disk else set()
    host_training, moved, disk_states, largest_states = 0, 0.0, 0, 0
    for p in trained:
        here = id(p) in on_host or states == "host"
        held, step_bytes = optimizer_bytes(p, precision, device=not here)
        if precision == "compact":
            # Its block codec is bound by arithmetic, not memory: on the measured host (16 cores)
            # a compact update took about what an fp32-master one does per parameter (0.22 ns),
            # though it moves half the bytes. Priced as the fp32-master update. (Measured with
            # the first format's dynamic map; the current codec is 1.7x faster on a core, not
            # yet measured on that host.)
            step_bytes = max(step_bytes, optimizer_bytes(p, "fp32-master", device=not here)[1])
        if id(p) in states_on_disk:  # its gradient in host RAM, its states on disk
            disk_states += held
            specs = _optim_state.state_specs(tuple(p.shape), p.dtype, precision, _ADAMW_STATES)
            largest_states = max(largest_states, _disk.largest_piece(p.numel(), specs))
            host_training += p.numel() * p.element_size()
            continue
        moved += step_bytes
        if here:  # states (and a host gradient: .grad, or the page-locked copy of a device one)
            host_training += held + p.numel() * p.element_size()
            if id(p) not in on_host:  # states="host" on the device: the host copy of its weight
                host_training += p.numel() * p.element_size()
    nparams = sum(p.numel() for p in model.parameters())
    if optimizer_bytes_per_param is None:
        optimizer_bytes_per_param = moved / max(1, sum(p.numel() for p in trained))
    copies = [0.0 if k in resident else sizes[k] / c.link_h2d for k in range(len(units))]
    reads = [0.0] * len(units)
    for k in on_disk:
        reads[k] = units[k].nbytes / (c.disk_gbps * 1e9)
    disk_bytes = sum(units[k].nbytes for k in on_disk)
    fwd_comp = [2 * n * tokens / rate for n in counts]
    fwd, _ = _simulate(copies, fwd_comp, pl.slots, reads=reads)
    # Backward: reverse order, twice the compute, streamed units copied again (the last ones of
    # the forward pass are still in their slots), gradients leave on the other direction.
    bwd_copies = list(reversed(copies))
    for i in range(min(pl.slots - 1, len(bwd_copies))):
        bwd_copies[i] = 0.0
    bwd_comp = [2 * x for x in reversed(fwd_comp)]
    bwd_reads = list(reversed(reads))
    for i in range(min(pl.slots - 1, len(bwd_reads))):
        bwd_reads[i] = 0.0  # (still in its slot: no copy, no read)
    fb, bwd_ends = _simulate(bwd_copies, bwd_comp, pl.slots, start=fwd, reads=bwd_reads)
    grad_bytes = [sizes[k] for k in reversed(range(len(units)))]
    link_back = fwd
    opt_end = fwd
    disk_ids = {k for k in range(len(units)) if k not in resident} if optimizer_on_disk else set()
    for end, nbytes, n, k in zip(bwd_ends, grad_bytes, reversed(counts), reversed(range(len(units)))):
        link_back = max(link_back, end) + nbytes / c.link_d2h
        if k not in disk_ids:  # (states on disk: updated in step(), priced by the disk below)
            opt_end = max(opt_end, link_back) + optimizer_bytes_per_param * n / (c.host_gbps * 1e9)
    fb_end = max(fb, link_back)
    # On one disk, a step's reads (forward, backward; with the states on disk, the states) and
    # its writes (the updated weights; the states) follow each other; the updates of the
    # parameters with states on disk run in step(), after the backward.
    disk_reads = sum(reads) + sum(bwd_reads)
    disk_writes = disk_bytes / (c.disk_write_gbps * 1e9)
    state_io = disk_states / (c.disk_gbps * 1e9) + disk_states / (c.disk_write_gbps * 1e9)
    step_seconds = max(fb_end, opt_end, disk_reads + disk_writes + state_io)
    if optimizer_on_disk and disk_states:
        step_seconds = max(step_seconds, fb_end + state_io + disk_writes)
    on_device = [p for k in resident for p in units[k].params] + [p for p in shared if p.requires_grad]
    return Prediction(
        stages=[[u.name for u in members] for members in cut],
        stage_bytes=[sum(u.nbytes for u in members) for members in cut],
        budget=parse_bytes(budget, "gpu_budget"),
        slots=pl.slots,
        slot_bytes=pl.slot_bytes,
        resident_bytes=pl.resident_bytes,
        streamed_bytes_per_pass=pl.streamed_bytes + sum(sizes[k] for k in gathered),
        forward_seconds=fwd,
        forward_backward_seconds=fb_end,
        step_seconds=step_seconds,
        units=[
            UnitPlan(u.name, u.nbytes, n, k in resident, _transfer(u, k in resident, k in gathered))
            for k, (u, n) in enumerate(zip(units, counts))
        ],
        notes=((_block_notes(model) + ([hint] if hint else [])) if unit is None else [])
        + [
            f"embedding {units[k].name!r} ({format_bytes(units[k].nbytes)}) streams by the rows a pass "
            f"reads (at most {format_bytes(sizes[k])} at {tokens} tokens), in no slot"
            + (
                ": on a GPU every lookup reads them in place (mapped host memory; the table is frozen)"
                if _transfer(units[k], False, True) == "mapped"
                else "; lookups that do not train it read them in place on a GPU (mapped host memory)"
            )
            for k in sorted(gathered)
        ]
        + (
            [
                f"{c.links} links into the GPU ({c.h2d_gbps:g} GB/s each): every copy split among them, "
                "as offload(links=...) splits it"
            ]
            if c.links > 1
            else []
        ),
        resident_training_bytes=sum(
            _training_bytes(p, precision, states) for p in on_device if p.is_floating_point()
        ),
        precision=precision,
        states=states,
        host_weight_bytes=host_weights,
        host_training_bytes=host_training,
        params=nparams,
        host_memory=memory,
        fits_host=None if memory is None else host_weights + host_training <= memory - host_reserve(memory),
        host_budget=parse_bytes(host_budget, "host_budget"),
        disk_units=[units[k].name for k in on_disk],
        disk_bytes=disk_bytes,
        disk_read_seconds_per_pass=sum(reads),
        optimizer_on_disk=optimizer_on_disk,
        disk_state_bytes=disk_states,
        disk_state_staging_bytes=_disk.STATES_IN_FLIGHT * largest_states,
    )


def _block_notes(model: nn.Module) -> list[str]:
    """Blocks of the default units' class that are not units themselves (blocks that no list
    holds: registered one by one as attributes), with the ``unit=`` that makes them units."""
    roots = _stream_units.find_unit_roots(model, None)
    classes = {type(m) for _, m in roots}
    names = [n for n, _ in roots]
    outside = [
        name
        for name, m in model.named_modules()
        if type(m) in classes and not any(name == r or name.startswith(r + ".") for r in names)
    ]
    if not outside:
        return []
    cls = type(roots[0][1]).__name__
    return [
        f"{len(outside)} more {cls} modules ({outside[0]}, ...) are outside the default blocks "
        f"and stream layer by layer; --unit {cls} (offload(..., unit={cls!r})) makes each one unit"
    ]


def _training_bytes(p: torch.Tensor, precision: str = "fp32-master", states: str = "device") -> int:
    """Device bytes a parameter kept on the device adds in training with ramtorch's AdamW: its
    gradient, and with ``states="device"`` its states there (two fp32 moments, and an fp32 master
    below fp32, with ``precision="fp32-master"``)."""
    grad = p.numel() * p.element_size()
    return grad if states == "host" else grad + optimizer_bytes(p, precision, device=True)[0]


def build_meta_model(spec: str) -> nn.Module:
    """A model on the ``meta`` device from a transformers ``config.json`` path or a
    ``package.module:factory`` callable.

    A ``config.json`` gives the class its ``architectures`` names (what ``from_pretrained`` builds:
    ``BertModel`` for a sentence-embedding checkpoint, ``ViTForImageClassification``...), else
    ``AutoModelForSeq2SeqLM`` for an encoder-decoder, ``AutoModelForCausalLM`` for a model type
    that has a causal-LM class, and ``AutoModel`` for the rest (encoders, vision models)."""
    if spec.endswith(".json"):
        with torch.device("meta"):
            return _build_from_config(spec)
    module, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"--model {spec!r}: give a config.json path or package.module:factory")
    import importlib

    factory = getattr(importlib.import_module(module), attr)
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"--model {spec!r} returned {type(model).__name__}, not an nn.Module")
    return model


def _build_from_config(path: str) -> nn.Module:
    try:
        import transformers
        from transformers import AutoConfig
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("--model config.json needs the transformers package") from e

    def failed(what: str, e: Exception) -> ValueError:
        # transformers' messages can list every model type it knows (kilobytes): the first line.
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if len(first) > 300:
            first = first[:300] + "..."
        return ValueError(f"--model {path}: {what}: {first}")

    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as e:
        raise failed("transformers cannot read this config", e) from None
    dtype = torch.bfloat16
    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module) and hasattr(cls, "_from_config"):
            try:
                return cls._from_config(config, dtype=dtype)
            except (ValueError, TypeError, AttributeError, KeyError) as e:
                raise failed(f"building {arch}", e) from None
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    if getattr(config, "is_encoder_decoder", False):
        auto: Any = AutoModelForSeq2SeqLM
    elif type(config) in AutoModelForCausalLM._model_mapping:
        auto = AutoModelForCausalLM
    else:
        auto = AutoModel
    try:
        return auto.from_config(config, dtype=dtype)
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        raise failed(f"building a model with {auto.__name__}", e) from None
