"""``ramtorch.offload``: any model streamed unit by unit through module hooks.

The streaming itself (units, itinerary, autograd functions, the streamer) is the streaming layer,
:mod:`ramtorch._stream`, whose docstring says how a unit runs. This module is the feature: the
entry point :func:`offload` (plan, pack, hook), model surgery (``.to()``, copy and pickle rules,
:func:`detach_streamer`) and the quirks of transformers models (KV cache, ``device``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import _arena, _codec, _config, _disk, _engine, _keep
from ._log import logger
from ._stream import added as _added
from ._stream import decoding as _decoding
from ._stream import gather as _gather
from ._stream import parts as _parts
from ._stream import pipeline as _pipeline
from ._stream import rows as _rows
from ._stream.functions import _READY_BATCH as _READY_BATCH
from ._stream.functions import _WALK_LIMIT as _WALK_LIMIT
from ._stream.functions import _Fetch as _Fetch
from ._stream.functions import _PostBackward as _PostBackward
from ._stream.functions import _SlotRef as _SlotRef
from ._stream.placement import Plan as Plan
from ._stream.placement import plan as plan
from ._stream.placement import spread_resident as spread_resident
from ._stream.streamer import _STREAMERS
from ._stream.streamer import MARK_BWD_BEGIN as MARK_BWD_BEGIN
from ._stream.streamer import MARK_BWD_END as MARK_BWD_END
from ._stream.streamer import MARK_FWD_BEGIN as MARK_FWD_BEGIN
from ._stream.streamer import MARK_FWD_END as MARK_FWD_END
from ._stream.streamer import Streamer as Streamer
from ._stream.streamer import streamers as streamers
from ._stream.units import _Entry as _Entry
from ._stream.units import _packed_bytes as _packed_bytes
from ._stream.units import _Unit as _Unit
from ._stream.units import check_streamable, materialize, move_param, stream_tensors, unit_hint
from ._stream.units import collect_units as collect_units
from ._stream.units import find_unit_roots as find_unit_roots
from ._units import _GIB
from ._units import format_bytes as _fmt
from ._units import parse_bytes as parse_bytes

# ---------------------------------------------------------------------------------------------
# Entry point


def _disk_units(
    model: nn.Module,
    units: list[_Unit],
    resident_ids: set[int],
    host_budget: int | str | None,
    disk: str | os.PathLike[str] | None,
    compress: str | None,
    keep: bool = False,
    optimizer_on_disk: bool = False,
) -> _disk.Store | None:
    """Puts the streamed units past ``host_budget`` on disk (see :func:`offload`): the units in
    the order ``model`` registers their modules fill the budget, the rest get an extent each in a
    store under ``disk`` (two with ``compress``: raw and encoded), before they are packed. With
    ``optimizer_on_disk`` (training), the budget holds the streamed units' gradients first, and
    the store is made even with no unit on disk (its directory holds the optimizer states).
    Returns the store, or ``None`` when nothing goes to disk."""
    if disk is None:
        if host_budget is not None:
            raise ValueError(
                "ramtorch.offload: host_budget= needs disk=, the directory for the units that do "
                "not fit in it"
            )
        return None
    if not isinstance(disk, (str, os.PathLike)):
        raise TypeError(f"ramtorch.offload: disk must be a directory path, got {type(disk).__name__}")
    if not os.path.isdir(disk):
        raise ValueError(f"ramtorch.offload: disk={os.fspath(disk)!r} is not a directory")
    streamed = [u for u in units if u.uid not in resident_ids and not u.container]
    found = _keep.manifest_units(os.fspath(disk)) if keep and host_budget is None else None
    if found is not None:  # a kept store's own units, whatever memory is free now
        by_name = {u.name: u for u in streamed if not u.gather}
        chosen = [by_name[n] for n in found if n in by_name]
        limit = sum(u.nbytes for u in streamed if u not in chosen)
    elif host_budget is None:
        limit = _disk.auto_host_budget(max((u.nbytes for u in streamed), default=0))
        logger.info(
            "ramtorch.offload: host_budget for disk=%s: %s (free memory less a reserve)", disk, _fmt(limit)
        )
    else:
        limit = parse_bytes(host_budget, "host_budget")
        assert limit is not None
    given = limit  # (the budget as given, which the plan splits again)
    limit -= sum(u.nbytes for u in streamed if u.gather)  # tables streamed by rows stay in RAM
    if optimizer_on_disk and found is None:
        # Training: every streamed unit's gradients live in host RAM until step(), on disk or not.
        grads = sum(_disk.grad_bytes(u.params) for u in streamed)
        if grads > limit:
            logger.warning(
                "ramtorch.offload: host_budget %s is less than the streamed units' gradients (%s), "
                "which stay in host RAM while training: every streamed unit goes to disk, and "
                "training holds the gradients beyond the budget",
                _fmt(max(limit, 0)),
                _fmt(grads),
            )
        limit -= grads
    cands = [u for u in streamed if not u.gather]
    if found is None:
        cands = [cands[i] for i in _disk.registration_order(model, [u.module for u in cands])]
        chosen = [cands[k] for k in _disk.choose([u.nbytes for u in cands], max(limit, 0))]
    if not chosen:
        if keep:
            raise ValueError(
                "ramtorch.offload: keep=True, but no unit goes to disk (host_budget holds them all): "
                "lower host_budget (0: every streamed unit on disk)"
            )
        if not optimizer_on_disk:
            return None
    # With a codec, each unit has a second extent for its encoded bytes (sized for the raw ones:
    # the encoding is known only once the unit is packed there).
    encoded = [u.nbytes for u in chosen] if compress is not None else []
    sizes = [u.nbytes for u in chosen] + encoded
    if keep:
        kept = _keep.Kept(os.fspath(disk), _keep.fingerprint(model, chosen, compress))
        store = kept.open_units(sizes)
    else:
        store = _disk.Store(disk, sizes)
    store.host_budget = given
    for k, u in enumerate(chosen):
        u.disk = store.extents[k]
        if compress is not None:
            u.enc_disk = store.extents[len(chosen) + k]
    logger.info(
        "ramtorch.offload: %d of %d streamed units (%s) on disk in %s (reads %s)",
        len(chosen),
        len(cands),
        _fmt(sum(u.nbytes for u in chosen)),
        store.directory,
        "direct" if store.core.direct else "through the page cache: no O_DIRECT on this file system",
    )
    return store


def offload(
    model: nn.Module,
    gpu_budget: int | str | None = None,
    unit: Any = None,
    device: torch.device | str | int | None = None,
    *,
    max_inflight: int | None = None,
    progress: bool | None = None,
    recompute: bool | Callable[[str], bool] = False,
    gather_rows: bool | None = None,
    compress: str | None = None,
    host_budget: int | str | None = None,
    disk: str | os.PathLike[str] | None = None,
    optimizer_on_disk: bool = False,
    keep: bool = False,
    links: str | int | Sequence[str | torch.device | int] | None = None,
    devices: Sequence[torch.device | str | int] | None = None,
    micro_batches: int = 1,
) -> nn.Module:
    """Keeps ``model``'s parameters in host RAM and streams them to ``device`` unit by unit.

    Args:
        model: any ``nn.Module``; changed in place and returned. Its training loop, optimizer,
            ``state_dict`` and autocast keep working; inputs go on ``device``.
        gpu_budget: bytes ramtorch may hold on the device (resident units plus streaming slots),
            as an int or a string such as ``"24GiB"``. Units that fit stay resident, the rest
            stream. ``None``: stream every unit, with ``max_inflight + 1`` slots of the largest.
            ``"auto"``: the device's free memory less a reserve for activations (a fifth, at
            least 2 GiB); the chosen plan and its predicted times are logged
            (INFO, logger ``ramtorch``). It is sized for inference: in training, the resident
            units' gradients and device optimizer states are outside any budget.
        unit: the block classes (types or class-name patterns) that form units; default: each
            child of the model's largest ``nn.ModuleList``, or ``nn.Sequential`` of blocks of one
            class (torchvision's ViT ``encoder.layers``), by parameter count. Modules outside the
            blocks that hold parameters are units of their own. When one unit holds most of the
            model and repeats a block class, the budget error and the plan logged (INFO) name the
            ``unit=`` that splits it.
        device: compute device; default the current CUDA device, or CPU without CUDA.
        max_inflight: copies in flight (default ``RAMTORCH_MAX_INFLIGHT``/``MAX_INFLIGHT``, else 2).
        progress: show a progress bar while moving weights into host RAM (default: for models
            over 1 GiB).
        recompute: backward mode of the streamed units: ``False`` keeps their activations for
            backward; ``True`` (or a predicate on the unit's name) recomputes the unit's forward in
            backward instead (activation checkpointing, non-reentrant, with the RNG state of the
            forward restored, so dropout draws the same mask, and the buffers the forward changed
            put back after the recomputation, so BatchNorm's running statistics are updated once
            a step). The recomputation runs on the weights fetched for the unit's backward: it
            costs compute, not PCIe bytes.
        gather_rows: input embeddings streamed by rows: an ``nn.Embedding`` that is a unit of its
            own (not tied to another module's weight, and not a subclass with a forward of its
            own) copies to the device only the distinct rows each forward reads, gathered on the
            host, and takes no slot; its backward adds their gradient into the rows of its dense
            ``.grad``. Reading the indices on the host costs one small device→host copy at the
            embedding's forward, which waits for the work queued before it (none when the
            indices are given on the CPU). ``None`` (default): tables of at least
            ``RAMTORCH_GATHER_MIN_BYTES`` (16 MiB unless set) that the budget does not keep
            resident; ``True``: every such embedding; ``False``: none. A forward whose rows take
            half the table or more copies the whole table through a slot instead, where the slots
            hold it. ``ramtorch.stats(model)`` counts the rows' bytes (``gathered_bytes``).
        compress: streams frozen units encoded, so fewer bytes cross the link; each copy is
            decoded on the device right after it lands. ``None`` (default): raw bytes.
            ``"lossless"``: the weights as 16-bit words, exponents coded in 3 bits a word
            (``bfloat16`` weights take about 0.7 of their bytes); outputs equal the uncompressed
            model's bit for bit. ``"fp8"`` (lossy): floating-point matrices as ``float8_e4m3fn``
            with a scale per row (about half of ``bfloat16``), other tensors raw; for inference
            and frozen bases (LoRA). Units are encoded here, on all cores; a unit whose encoding
            saves under a tenth of its bytes streams raw, and so does any unit while one of its
            parameters requires grad (encoded when it is frozen). An encoded unit is encoded
            again when its weights change in a way torch counts (``copy_``, ``load_state_dict``,
            a parameter set anew); writes through ``.data`` between passes are not seen (as
            inside :func:`weights_unchanged`). One decoded unit at a time takes device memory
            beside the slots (counted in the budget). ``ramtorch.stats(model)`` shows each
            unit's ratio (``compressed_units``) and the bytes a pass moves
            (``link_bytes_per_pass``).
        host_budget: bytes of host RAM the streamed units may take (an int or a string such as
            ``"32GiB"``); the units past it live on disk, in a store file under ``disk``. The
            model's first units (in the order it registers its modules) fill the budget, the rest go
            to disk. ``None`` (default): every streamed unit in host RAM, or, with ``disk`` given,
            the memory the machine has available less a reserve (the larger of 2 GiB and a tenth
            of its memory, and the staging buffers); ``0``: every streamed unit on disk. With
            ``optimizer_on_disk=True`` (training) the budget also holds the streamed units'
            gradients, which stay in host RAM until ``step()`` wherever their weights live: the
            weights fill what the gradients leave (a warning says so when the gradients alone
            exceed it), and with the optimizer states on disk, the process's memory is the budget
            plus the staging buffers and the runtime.
        disk: a directory for the store file of the units that do not fit in ``host_budget``.
            The file is made here, allocated whole (a full disk is an ``OSError`` here, naming
            the bytes needed and free), and its name removed at once: nothing is left behind when
            the process ends, crashes included. A disk unit's parameters stay CPU parameters over
            the file's mapping (``state_dict``, ``load_state_dict`` and optimizers work as for any
            unit, the operating system paging them); the copies to the device read the file
            ahead of use along the itinerary, ``RAMTORCH_DISK_AHEAD`` units ahead (default 4),
            with ``O_DIRECT`` where the file system takes it (not through the page cache), on
            ``RAMTORCH_DISK_THREADS`` threads (default 8), into page-locked staging buffers.
            ``ramtorch.stats(model)`` shows the disk units, the bytes read, the read bandwidth
            and the time the forward waited on the disk (``disk_wait_seconds``). With
            ``compress``, a disk unit's encoded bytes are kept on disk too, and are what is
            read (the store then takes twice the units' bytes: the encoded extent is sized for
            the raw one).
        optimizer_on_disk: the optimizer states of the streamed units' parameters live on
            disk, those of the units kept in host RAM included (with ``ramtorch.optim``'s
            optimizers: moments, fp32 masters, compensation), in a second store file in
            ``disk``, made whole at the optimizer's first step (or first ``load_state_dict``)
            and gone when the optimizer is. Such a parameter is updated in place in ``step()``
            (during the backward with ``pipeline=True`` or ``overlap="backward"``), in pieces of
            at most 256 MiB of states: each piece is read ahead into a staging buffer
            (``O_DIRECT``), updated there and written back (``O_DIRECT``), then the new weight of
            a disk unit, so host memory holds only the few pieces in flight (the bound is in
            ``ramtorch.stats``). ``False`` (default): their states are in host RAM.
        keep: the store in ``disk`` is kept: a checkpoint of the model that a later ``offload``
            of the same model with the same ``disk`` opens again, without copying: the model then
            takes the store's values (its units' and, from the last commit, every other tensor's),
            and :func:`ramtorch.load` of the files it was loaded from reads nothing. The store's
            files (``units.bin``, ``states.bin`` with ``optimizer_on_disk``, a journal, a
            manifest and the last commit's ``rest-<n>.safetensors``) stay in ``disk``.
            :func:`ramtorch.commit` makes the model, the optimizer and the RNG states the state
            to resume from, :func:`ramtorch.resume` restores the optimizer from it. Between
            commits, ``ramtorch.optim``'s updates of the disk units save what they overwrite to
            the journal first, so reopening after a crash (a SIGKILL, a power loss) gives the
            last commit exactly. Training a kept store needs ``optimizer_on_disk=True``. Writes
            the journal does not see (``.data`` writes, torch's optimizers) are not protected:
            commit after them. A directory holding the store of another model is a
            ``ValueError``. ``host_budget=None``: the store's own units go to disk again.
        links: more links into ``device`` than its own (several GPUs of one host): each copy of
            at least 4 MiB is split between ``device``'s own link and relays through peer GPUs
            (host → peer, then peer → ``device`` over NVLink), in pieces of up to 64 MiB through
            two staging buffers on each peer (128 MiB of its memory), each path's share its
            bandwidth measured when the device's engine is made (``link_shares``). ``"auto"``:
            every other GPU that reaches ``device`` directly; or a list of devices. Gradients
            leave by every link the same way (``device`` → peer → host), on lanes of their own.
            Outputs and gradients are bitwise those of one link. A peer without direct
            access is left out, and a peer that cannot be set up falls back to one link, with a
            warning. Set by the first model offloaded to a device (its engine is shared):
            another model on that device passes the same links or none. ``ramtorch.stats()``
            counts the bytes of each path (``link_own_bytes``, ``link_relay_bytes``, and
            ``link_own_down_bytes``, ``link_relay_down_bytes`` for gradients). On the
            host device (``device="cpu"``), an int ``n`` gives ``n`` links through host stand-ins,
            which runs the same split and relay logic without a GPU.
        devices: several devices for one model, in place of ``device`` (a pipeline): the units,
            in the order the model registers them, are cut into one contiguous stage a device,
            balanced by bytes (an embedding streamed by rows counts nothing); each stage streams
            its units over its own device's link and engine, with ``gpu_budget`` (and
            ``max_inflight``) per device. A unit's tensor inputs are moved to its stage's device
            (the gradient goes back through autograd), so outputs are on the last device; inputs
            go on the first (``model.device`` for transformers models). Tied parameters must be
            used by one stage only, and code outside the units that mixes two stages' tensors
            (a skip connection across stages) is not supported. On the host device ``"cpu"`` may
            repeat: stages on the host engine, as the tests run them. Not with ``links``,
            ``compress``, ``host_budget``, ``disk``, ``optimizer_on_disk``, ``keep`` or
            ``gpu_budget="auto"``.
        micro_batches: with ``devices``, each forward's batch is cut into this many
            micro-batches on dim 0 (every tensor argument whose dim 0 is the batch; a dim 0 of 1
            is broadcast), relayed through the stages (micro-batch ``t`` in stage ``s`` at tick
            ``s + t``: while the last device computes one micro-batch, the first computes the
            next), and the outputs joined: tensors concatenated on dim 0, 0-dim tensors (a mean
            loss) averaged, weighted by the micro-batches' sizes. ``loss.backward()`` then runs
            GPipe's schedule: the last device runs the micro-batches' backwards one after the
            other, each device's on a thread of torch's autograd engine, so the device before
            computes one while the last runs the next. Each micro-batch streams each stage's
            weights again. :func:`ramtorch.relay` relays several independent calls as one. A
            batch smaller than ``micro_batches``, a tensor argument with another dim 0, or an
            output that cannot be joined (a KV cache: ``use_cache=False``) is a ``ValueError``.
            Default 1: the batch goes through whole.

    Parameters shared by several units (tied weights), parameters of modules that contain other
    units, buffers, and a unit's trainable parameters when the rest of it is frozen and they hold
    at most a sixteenth of its bytes (LoRA adapters, trained biases or norms over a frozen base:
    their gradients then stay on the device and the optimizer updates them there) stay on the
    device and count against the budget. Not counted: in training, the gradients of what stays
    on the device and the optimizer states that ``ramtorch.optim`` keeps there for it (an fp32
    master and two fp32 moments a bf16 parameter with AdamW: with its gradient, 14 bytes a
    parameter); ``python -m ramtorch plan`` reports them.

    A model built without weights (on the meta device, or under accelerate's
    ``init_empty_weights``) is allocated here, zeroed, for :func:`ramtorch.load` to fill: a load
    that leaves one of those tensors unwritten raises, naming it. Its buffers on the meta device
    are computed again as a transformers model computes them (it is built once more from its
    config, with parameters on the meta device); other models' get zeros, and a warning names the
    non-persistent ones, which no checkpoint holds.

    Parameters that are tensor subclasses over plain tensors (torchao quantized weights: int8,
    float8) stream by their inner tensors (``__tensor_flatten__``), so the quantized bytes cross
    the link, and are rebuilt around them on the device (``__tensor_unflatten__``). They must be
    frozen (``requires_grad=False``, as in QLoRA); a subclass that requires grad, or whose bytes
    cannot be found that way, is refused with an error naming the parameter. Quantizing after
    ``offload`` works too: a parameter ``quantize_`` replaces is checked and packed into its unit
    at the next forward (the plan stays the one made for the full-precision sizes). Parameters
    added under new names after ``offload`` (peft's ``get_peft_model``, ``register_parameter``, a
    submodule set in place of another) are in no unit: the next forward refuses them, naming
    them; add adapters before ``offload``. A model built
    on the meta device is loaded (:func:`ramtorch.load`), then quantized: a quantized parameter on
    the meta device is refused here.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"ramtorch.offload: model must be an nn.Module, got {type(model).__name__}")
    if getattr(model, "_ramtorch_streamer", None) is not None:
        raise RuntimeError("ramtorch.offload: this model is already offloaded")
    inflight = _config.max_inflight(max_inflight)
    stage_devices = _stage_devices(
        devices,
        micro_batches,
        device=device,
        links=links,
        compress=compress,
        host_budget=host_budget,
        disk=disk,
        optimizer_on_disk=optimizer_on_disk,
        keep=keep,
        gpu_budget=gpu_budget,
    )
    if stage_devices is not None:
        device = stage_devices[0]
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = _engine.normalize_device(device)
    relays = _engine.configure_links(dev, links)
    if relays is not None:
        _engine.engine_for(dev, relays)  # checked before anything is moved
    auto = isinstance(gpu_budget, str) and gpu_budget.strip().lower() == "auto"
    budget = _auto_budget(dev) if auto else parse_bytes(gpu_budget, "gpu_budget")
    meta_names = [n for n, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    if meta_names and _transformers_model(model):
        model.tie_weights()  # as from_pretrained does (not done under accelerate's init_empty_weights)
    for name, p in model.named_parameters():
        if not p.is_meta:
            check_streamable(name, p)
        elif is_traceable_wrapper_subclass(p):
            raise TypeError(
                f"ramtorch.offload: parameter {name!r} ({type(p).__module__}.{type(p).__qualname__}) is "
                "a tensor subclass (a quantized weight) on the meta device, which offload cannot "
                "allocate, nor ramtorch.load fill from a checkpoint of plain tensors. Quantize after "
                "loading: ramtorch.offload(model), ramtorch.load(model, path), then quantize_(model, "
                "config); or load a quantized state dict into the quantized model first "
                "(model.load_state_dict(sd, assign=True)) and offload it then"
            )
    for name, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad:
            raise ValueError(
                f"ramtorch.offload: {name or 'the model'} is an {type(m).__name__} with sparse=True; "
                "streamed weights take dense gradients only: build it with sparse=False"
            )

    raw_units, shared = collect_units(model, unit, budget)
    if meta_names:
        placed = {id(p) for _, _, entries, _ in raw_units for _, _, p in entries}
        left = [n for n, p in model.named_parameters() if p.is_meta and id(p) not in placed]
        if left:
            raise ValueError(
                f"ramtorch.offload: parameters {left[:5]} are on the meta device in modules that "
                "stream themselves (ramtorch.nn layers), which offload does not allocate: build those "
                "with their weights"
            )
    units = [_Unit(k, name, m, entries) for k, (name, m, entries, _) in enumerate(raw_units)]
    shared_ids = {id(p) for p in shared}
    for u, raw in zip(units, raw_units):
        u.container = raw[3]
        # Tied parameters and light trainable ones (adapters over a frozen base) stay resident:
        # drop them from the streamed unit.
        own = [i for i, p in enumerate(u.params) if id(p) not in shared_ids]
        if len(own) != len(u.params):
            remap = {old: new for new, old in enumerate(own)}
            u.entries = [_Entry(e.owner, e.name, remap[e.index]) for e in u.entries if e.index in remap]
            u.params = [u.params[i] for i in own]
            u.nbytes = _packed_bytes(u.params)
    units = [u for u in units if u.params]
    for k, u in enumerate(units):
        u.uid = k
    if compress is not None and compress not in _codec.CODECS:
        raise ValueError(f"ramtorch.offload: compress={compress!r}; choose one of {_codec.CODECS} or None")
    if gather_rows is not None and not isinstance(gather_rows, bool):
        raise TypeError(f"ramtorch.offload: gather_rows must be a bool or None, got {gather_rows!r}")
    _gather.choose(units, gather_rows)
    if stage_devices is not None:
        return _offload_stages(
            model, units, shared, stage_devices, micro_batches, budget, gather_rows, inflight,
            progress, recompute, meta_names,
        )  # fmt: skip
    buffers = [b for b in model.buffers()]
    fixed = sum(_arena._nbytes(t.shape, t.dtype) for t in stream_tensors(shared)[0])
    fixed += sum(_arena._nbytes(b.shape, b.dtype) for b in buffers)
    if compress is not None:
        # One unit decoded beside the slots (its encoded copy stays in a slot until it is released).
        fixed += max((u.nbytes for u in units if not u.gather and not u.container), default=0)
    hint = (
        unit_hint([(u.name, u.module, u.nbytes) for u in units if not u.container]) if unit is None else None
    )
    # Tables streamed by rows take no slot: the other units are planned first, and a table stays
    # resident only in what the budget has left after them (gather.keep_resident).
    pl, resident_ids = _plan_units(
        units, budget, inflight, fixed, gather_rows, "ramtorch.offload: ", f"; {hint}" if hint else ""
    )

    if not isinstance(optimizer_on_disk, bool):
        raise TypeError(f"ramtorch.offload: optimizer_on_disk must be a bool, got {optimizer_on_disk!r}")
    if optimizer_on_disk and disk is None:
        raise ValueError("ramtorch.offload: optimizer_on_disk=True needs disk=, the directory for the states")
    if not isinstance(keep, bool):
        raise TypeError(f"ramtorch.offload: keep must be a bool, got {keep!r}")
    if keep and disk is None:
        raise ValueError("ramtorch.offload: keep=True needs disk=, the directory of the kept store")
    store = _disk_units(model, units, resident_ids, host_budget, disk, compress, keep, optimizer_on_disk)
    if store is not None:
        store.optimizer_on_disk = optimizer_on_disk

    _warn_strides(units, resident_ids)
    total = sum(u.nbytes for u in units)
    show = progress if progress is not None else total > _GIB
    bar = None
    if show:
        from tqdm.auto import tqdm

        desc = "ramtorch.offload" if compress is None else f"ramtorch.offload (compress={compress})"
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, leave=False)
    with torch.no_grad():
        for p in shared:
            _move(p, dev)
        _deltas_to_base_weights(model, {id(p) for p in shared})
        computed = _place_buffers(model, dev)
        for u in units:
            if u.uid in resident_ids:
                u.resident = True
                for p in u.params:
                    _move(p, dev)
            else:
                u.pack()
                if compress is not None and not u.gather and not u.container:
                    u.codec = compress
                    u.encoding()
            if bar is not None:
                bar.update(u.nbytes)
    if bar is not None:
        bar.close()
    if store is not None and optimizer_on_disk:
        # The streamed units kept in host RAM: their parameters' optimizer states on disk too.
        for u in units:
            if not u.resident and u.disk is None:
                for p in u.params:
                    store.host_params[id(p)] = weakref.ref(p)

    if meta_names:
        # What a load must still fill: each tensor with its version now (any write bumps it).
        sd = model.state_dict(keep_vars=True)
        model._ramtorch_unwritten = {  # type: ignore[assignment]
            n: (sd[n], sd[n]._version) for n in meta_names if n in sd and n not in computed
        }
    if auto:
        _report_auto_plan(model, units, pl, budget, dev, store)
    else:
        _report_plan(model, units, pl, budget, dev, hint, shared)
    if recompute:
        wants = recompute if callable(recompute) else (lambda name: True)
        for u in units:
            # (A gathered embedding's output is all it would keep: nothing to recompute.)
            if not u.resident and not u.gather and wants(u.name):
                _checkpoint_forward(u.module)
    streamer = Streamer(model, units, dev, inflight, pl.slots, pl.slot_bytes, budget, pl.resident_bytes)
    streamer.disk_store = store
    if store is not None:
        on_disk = [u for u in units if u.disk is not None]
        streamer.disk_order = [u.uid for u in sorted(on_disk, key=lambda u: u.disk.offset)]  # type: ignore[union-attr]
    handles = streamer.hook_handles
    handles.append(
        model.register_forward_pre_hook(
            lambda m, a, k: _check_kv_cache(k) or _check_loaded(m) or streamer.begin_pass(), with_kwargs=True
        )
    )
    handles.append(model.register_forward_hook(lambda m, a, o: streamer.end_pass(), always_call=True))
    sizes = [u.nbytes for u in units if not u.resident and not u.gather]
    for u in units:
        u.mean_unit_bytes = sum(sizes) / len(sizes) if sizes else 0.0
    for u in units:
        if u.resident:
            continue
        u.module._ramtorch_unit = u  # type: ignore[assignment]
        if u.nbytes >= _rows.MIN_BYTES:
            _rows.adopt(u.module)  # a large Linear: computed by blocks of rows as they land
        if _parts.wanted(u):
            streamer.hook_parts(u)  # a large unit of torch's layers: each waits for its own part
        # Partials, not lambdas: the hooks' frames are the streamer's methods, which
        # torch.compile runs as they are (ramtorch._stream.compiling).
        handles.append(
            u.module.register_forward_pre_hook(functools.partial(streamer.pre_forward, u), with_kwargs=True)
        )
        handles.append(
            u.module.register_forward_hook(
                functools.partial(streamer.post_forward, u), with_kwargs=True, always_call=True
            )
        )
    # A pipelined optimizer step may still be writing the weights that state_dict() hands out.
    params = [p for u in units for p in u.params]
    handles.append(
        model.register_state_dict_pre_hook(
            lambda *_: streamer.settle_interrupted() or _engine.wait_updates(params)
        )
    )
    model._ramtorch_streamer = streamer  # type: ignore[assignment]
    # What a deep copy of the model is offloaded with (see _copy_offloaded); None: no copy.
    copyable = compress is None and host_budget is None and disk is None and links is None
    model._ramtorch_copy_options = (  # type: ignore[assignment]
        {
            "gpu_budget": gpu_budget,
            "unit": unit,
            "device": dev,
            "max_inflight": max_inflight,
            "progress": progress,
            "recompute": recompute,
            "gather_rows": gather_rows,
        }
        if copyable
        else None
    )
    _guard(model, streamer, [(streamer, units)])
    kept = None if store is None else store.kept
    if kept is not None:
        if kept.opened:  # the store is the model: what lies outside it, from the last commit
            kept.restore_model(model)
            if getattr(model, "_ramtorch_unwritten", None):
                model._ramtorch_unwritten = {}  # type: ignore[assignment]
        else:
            kept.commit(model, None, None, by_user=False)
    _added.watch(model, streamer)  # parameters added after this are refused (by name) at the next forward
    _STREAMERS.add(streamer)
    streamer.eng.add_holder(streamer)
    return model


def _plan_units(
    units: list[_Unit],
    budget: int | None,
    inflight: int,
    fixed: int,
    gather_rows: bool | None,
    prefix: str,
    suffix: str = "",
) -> tuple[Any, set[int]]:
    """The plan of one device's ``units`` and the ids of those kept resident: the units planned
    for slots (tables streamed by rows take none: they stay resident only in what the budget has
    left after the others, ``gather.keep_resident``), the resident ones spread along the model. A
    budget that cannot hold them raises a ``ValueError`` between ``prefix`` and ``suffix``."""
    planned = [u for u in units if not u.gather]
    containers = {k for k, u in enumerate(planned) if u.container}
    try:
        pl = plan([u.nbytes for u in planned], sorted(containers), budget, inflight, fixed)
    except ValueError as e:
        raise ValueError(f"{prefix}{e}{suffix}") from None
    spread = spread_resident([u.nbytes for u in planned], set(pl.resident), containers)
    resident_ids = {planned[k].uid for k in spread}
    if budget is not None and gather_rows is None:
        for u in _gather.keep_resident(units, budget - pl.resident_bytes - pl.slots * pl.slot_bytes):
            resident_ids.add(u.uid)
            pl.resident_bytes += u.nbytes
    return pl, resident_ids


def _guard(model: nn.Module, streamer: Streamer, units: list[tuple[Streamer, list[_Unit]]]) -> None:
    """What every offloaded model gets once its streamers run (``units``: each streamer with its
    units): ``.to()``/``.cuda()`` guarded on the model (through ``streamer``) and on each
    streamed unit's module, copies and pickling refused, the compute device reported."""
    if type(model)._apply is nn.Module._apply:
        model._apply = _guarded_apply(model, streamer)  # type: ignore[method-assign]
    for st, members in units:
        for u in members:
            # Streamed units' modules (resident ones are plain modules on the device, which copy
            # and pickle as such; a streamed unit's module holds its unit).
            m = u.module
            if u.resident or m is model or type(m)._apply is not nn.Module._apply or "_apply" in m.__dict__:
                continue
            m._apply = _guarded_unit_apply(m, u.name, st)  # type: ignore[method-assign]
    # Copies would share (deepcopy: fail on) the engine, the hooks and the units of this model;
    # a class that says how to copy or pickle itself (ramtorch.nn's layers) keeps its way.
    cls = type(model)
    if not hasattr(cls, "__deepcopy__"):
        model.__deepcopy__ = _DeepCopy(model)  # type: ignore[method-assign]
    pickling = (cls.__reduce_ex__, cls.__reduce__, cls.__getstate__)
    if pickling == (object.__reduce_ex__, object.__reduce__, nn.Module.__getstate__):
        model.__reduce_ex__ = _refuse_copy  # type: ignore[method-assign]
    _report_compute_device(model)
    _span_generate()


def _stage_devices(
    devices: Sequence[torch.device | str | int] | None, micro_batches: int, **given: Any
) -> list[torch.device] | None:
    """``offload(devices=...)`` checked before anything is moved: the devices normalised, or
    ``None`` without ``devices``. Raises, naming what is wrong, for an empty list, an unknown or
    repeated device (``"cpu"`` may repeat: stages on the host engine), a mix of CPU and CUDA,
    ``micro_batches`` that is not a positive int (or above 1 without ``devices``), and the options
    a pipeline does not support."""
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"ramtorch.offload: micro_batches must be a positive int, got {micro_batches!r}")
    if devices is None:
        if micro_batches != 1:
            raise ValueError(
                f"ramtorch.offload: micro_batches={micro_batches} needs devices=[...], the devices the "
                "micro-batches are relayed through"
            )
        return None
    if isinstance(devices, (str, int, torch.device)) or not isinstance(devices, Sequence):
        raise TypeError(
            "ramtorch.offload: devices must be a list of devices (e.g. ['cuda:0', 'cuda:1']), "
            f"got {devices!r}"
        )
    if not devices:
        raise ValueError("ramtorch.offload: devices=[] names no device")
    if given.pop("device") is not None:
        raise ValueError("ramtorch.offload: give device= or devices=, not both")
    refused = {
        "links": given["links"] is not None,
        "compress": given["compress"] is not None,
        "host_budget": given["host_budget"] is not None,
        "disk": given["disk"] is not None,
        "optimizer_on_disk": bool(given["optimizer_on_disk"]),
        "keep": bool(given["keep"]),
        'gpu_budget="auto"': str(given["gpu_budget"]).strip().lower() == "auto",
    }
    named = [k for k, v in refused.items() if v]
    if named:
        raise ValueError(
            f"ramtorch.offload: devices= (a pipeline over several devices) does not support "
            f"{', '.join(named)} yet; offload to one device for those"
        )
    out = []
    for d in devices:
        try:
            out.append(_engine.normalize_device(d))
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"ramtorch.offload: devices entry {d!r} is not a device here: {e}") from None
    kinds = {d.type for d in out}
    if len(kinds) > 1:
        raise ValueError(f"ramtorch.offload: devices {[str(d) for d in out]} mix the CPU and CUDA devices")
    seen: set[torch.device] = set()
    for d in out:
        if d.type == "cuda" and d in seen:
            raise ValueError(f"ramtorch.offload: devices {[str(d) for d in out]} name {d} twice")
        seen.add(d)
    return out


def _offload_stages(
    model: nn.Module,
    units: list[_Unit],
    shared: list[nn.Parameter],
    devices: list[torch.device],
    micro_batches: int,
    budget: int | None,
    gather_rows: bool | None,
    inflight: int,
    progress: bool | None,
    recompute: bool | Callable[[str], bool],
    meta_names: list[str],
) -> nn.Module:
    """:func:`offload` with ``devices``: the units cut into stages, each planned, packed and
    streamed on its own device by a streamer of its own; a :class:`_pipeline.Pipeline` hands the
    activations over and relays the micro-batches (see :mod:`ramtorch._stream.pipeline`)."""
    # Containers (modules holding blocks, their own parameters resident) wrap the other units:
    # they stay on the first device, outside the split.
    order = _disk.registration_order(model, [u.module for u in units])
    cut = _pipeline.stage_units(model, units, len(devices))
    inner = [u for members in cut for u in members]
    stage_of = {u.uid: 0 for u in units}
    stage_of.update({u.uid: s for s, members in enumerate(cut) for u in members})
    stages = [[units[i] for i in order if stage_of[units[i].uid] == s] for s in range(len(devices))]
    # Parameters outside the streamed units (tied ones, adapters, a container's) go to the device
    # of the stage of each module that holds them: the unit's it is in, the first for a module
    # above units (a container), else the stage of the unit registered before it. A module that
    # holds only such parameters (a tied embedding or head) gets the stage's hand-off hook as a
    # unit does.
    names: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    home: dict[int, int] = {}
    extra: dict[int, tuple[nn.Module, str, int]] = {}  # modules outside the units, hooked too
    positions = {id(m): k for k, m in enumerate(model.modules())}
    inside = {id(m): stage_of[u.uid] for u in inner for m in u.module.modules()}
    unit_ids = {id(u.module) for u in inner}
    above = {id(m) for m in model.modules() if any(id(x) in unit_ids for x in m.modules() if x is not m)}
    starts = sorted((positions.get(id(u.module), 0), stage_of[u.uid]) for u in inner)
    shared_ids = {id(p) for p in shared}
    for mname, m in model.named_modules():
        held = [p for p in m._parameters.values() if p is not None and id(p) in shared_ids]
        if not held:
            continue
        if id(m) in inside:
            stage = inside[id(m)]
        elif id(m) in above:
            stage = 0  # a container: its parameters are read around its blocks, from the first stage
        else:  # outside every unit: the stage of the unit registered before it
            stage = max((s for k, s in starts if k < positions[id(m)]), default=0)
            extra[id(m)] = (m, mname, stage)
        for p in held:
            if home.setdefault(id(p), stage) != stage:
                found = sorted({home[id(p)], stage})
                raise ValueError(
                    f"ramtorch.offload(devices=...): parameter {names.get(id(p), '?')!r} is used by "
                    f"modules of stages {found} (tied weights across devices); a stage holds its "
                    "parameters on its own device: untie it, or use fewer devices so that its users "
                    "share a stage"
                )
    for p in shared:
        home.setdefault(id(p), 0)
    # Buffers: those of a stage's units on its device, the others on the first.
    buffer_stage: dict[int, int] = {}
    for u in inner:
        for b in u.module.buffers():
            buffer_stage[id(b)] = stage_of[u.uid]
    plans = []
    resident_ids: set[int] = set()
    for s, members in enumerate(stages):
        fixed = sum(
            _arena._nbytes(t.shape, t.dtype)
            for t in stream_tensors([p for p in shared if home[id(p)] == s])[0]
        )
        fixed += sum(
            _arena._nbytes(b.shape, b.dtype) for b in model.buffers() if buffer_stage.get(id(b), 0) == s
        )
        pl, ids = _plan_units(
            members, budget, inflight, fixed, gather_rows, f"ramtorch.offload: stage {s} on {devices[s]}: "
        )
        resident_ids.update(ids)
        plans.append(pl)
    _warn_strides(units, resident_ids)
    total = sum(u.nbytes for u in units)
    bar = None
    if progress if progress is not None else total > _GIB:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="ramtorch.offload", leave=False)
    with torch.no_grad():
        for p in shared:
            _move(p, devices[home[id(p)]])
        _deltas_to_base_weights(model, {id(p) for p in shared})
        computed = _place_buffers(model, devices[0])
        for u in inner:
            s = stage_of[u.uid]
            if s:
                for m in u.module.modules():
                    for bname, b in m._buffers.items():
                        if b is not None:
                            m._buffers[bname] = b.to(devices[s])
        for u in units:
            if u.uid in resident_ids:
                u.resident = True
                for p in u.params:
                    _move(p, devices[stage_of[u.uid]])
            else:
                u.pack()
            if bar is not None:
                bar.update(u.nbytes)
    if bar is not None:
        bar.close()
    if meta_names:
        sd = model.state_dict(keep_vars=True)
        model._ramtorch_unwritten = {  # type: ignore[assignment]
            n: (sd[n], sd[n]._version) for n in meta_names if n in sd and n not in computed
        }
    for s, (members, pl) in enumerate(zip(stages, plans)):
        _report_plan(model, members, pl, budget, devices[s], f"pipeline stage {s} of {len(devices)}")
    if recompute:
        wants = recompute if callable(recompute) else (lambda name: True)
        for u in units:
            if not u.resident and not u.gather and wants(u.name):
                _checkpoint_forward(u.module)
    streamers = []
    for s, (members, pl) in enumerate(zip(stages, plans)):
        st = Streamer(
            model, members, devices[s], inflight, pl.slots, pl.slot_bytes, budget, pl.resident_bytes
        )
        st.stage = s
        st.backward_per_forward = micro_batches > 1
        streamers.append(st)
    pipe = _pipeline.Pipeline(streamers, devices, micro_batches)
    first = streamers[0]
    handles = first.hook_handles
    handles.append(
        model.register_forward_pre_hook(
            lambda m, a, k: _check_kv_cache(k) or _check_loaded(m), with_kwargs=True
        )
    )
    for u in inner:
        # The hand-off first: the stage's pass begins, and the inputs reach its device, before
        # the unit's streamer takes its weights.
        st = streamers[stage_of[u.uid]]
        st.hook_handles.append(
            u.module.register_forward_pre_hook(
                functools.partial(pipe.unit_pre, stage_of[u.uid], u.name), with_kwargs=True
            )
        )
    for m, mname, stage in extra.values():
        streamers[stage].hook_handles.append(
            m.register_forward_pre_hook(functools.partial(pipe.unit_pre, stage, mname), with_kwargs=True)
        )
    for st in streamers:
        for u in st.units:
            if u.resident:
                continue
            u.module._ramtorch_unit = u  # type: ignore[assignment]
            st.hook_handles.append(
                u.module.register_forward_pre_hook(functools.partial(st.pre_forward, u), with_kwargs=True)
            )
            st.hook_handles.append(
                u.module.register_forward_hook(
                    functools.partial(st.post_forward, u), with_kwargs=True, always_call=True
                )
            )
    params = [p for u in units for p in u.params]

    def settle(*_: Any) -> None:
        # A pipelined optimizer step may still be writing the weights that state_dict() hands out.
        for st in streamers:
            st.settle_interrupted()
        _engine.wait_updates(params)

    handles.append(model.register_state_dict_pre_hook(settle))
    own_forward = model.forward

    @functools.wraps(own_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return pipe.forward(own_forward, args, kwargs)

    model.forward = forward  # type: ignore[method-assign]
    model._ramtorch_own_forward = own_forward  # type: ignore[assignment]
    model._ramtorch_streamer = first  # type: ignore[assignment]
    model._ramtorch_pipeline = pipe  # type: ignore[assignment]
    _guard(model, first, [(st, st.units) for st in streamers])
    _added.watch(model, first)
    for st in streamers:
        _STREAMERS.add(st)
        st.eng.add_holder(st)
    return model


def stage_streamers(model: nn.Module) -> list[Streamer]:
    """The streamers of an offloaded model: one a stage with ``devices``, else its one (``[]``
    for a model that is not offloaded)."""
    pipe = getattr(model, "_ramtorch_pipeline", None)
    if pipe is not None:
        return list(pipe.streamers)
    streamer = getattr(model, "_ramtorch_streamer", None)
    return [] if streamer is None else [streamer]


def relay(model: nn.Module, calls: Sequence[Any]) -> list[Any]:
    """Runs several calls of a model offloaded over several devices (``offload(model,
    devices=[...])``) as one relay: the micro-batches of each call (``micro_batches`` of them, or
    the call whole) follow those of the call before, so while the last device computes one call,
    the first already computes the next. For inference over independent batches (an evaluation
    set, requests): a relay of ``m`` calls of ``n`` micro-batches over ``k`` devices is at most
    ``k·m·n / (m·n + k − 1)`` times one device, where one call gets ``k·n / (n + k − 1)``.
    ::

        with torch.no_grad():
            outs = ramtorch.relay(model, [{"input_ids": ids} for ids in batches])

    ``calls``: one entry a call, a tuple of positional arguments, a dict of keyword arguments, a
    ``(tuple, dict)`` pair, or a single tensor. Returns the outputs, one a call, as ``model(...)``
    returns them (joined over micro-batches). The model's forward runs as in a call, without the
    hooks on the model itself (those of its modules run). The calls must not depend on each other.
    Raises ``ValueError`` for a model that is not offloaded over several devices."""
    pipe = getattr(model, "_ramtorch_pipeline", None)
    inner = model.__dict__.get("_ramtorch_own_forward")
    if pipe is None or inner is None:
        raise ValueError(
            "ramtorch.relay: the model is not offloaded over several devices "
            "(ramtorch.offload(model, devices=[...]))"
        )
    if isinstance(calls, (torch.Tensor, dict)) or not isinstance(calls, Sequence):
        raise TypeError(
            "ramtorch.relay: calls must be a list of calls (tuples, dicts or tensors), got "
            f"{type(calls).__name__}"
        )
    normal: list[tuple[tuple, dict]] = []
    for k, c in enumerate(calls):
        if isinstance(c, torch.Tensor):
            normal.append(((c,), {}))
        elif isinstance(c, dict):
            normal.append(((), dict(c)))
        elif isinstance(c, tuple) and len(c) == 2 and isinstance(c[0], tuple) and isinstance(c[1], dict):
            normal.append((c[0], dict(c[1])))
        elif isinstance(c, tuple):
            normal.append((c, {}))
        else:
            raise TypeError(
                f"ramtorch.relay: call {k} is a {type(c).__name__}; give a tuple of arguments, a dict "
                "of keyword arguments, an (args, kwargs) pair or a tensor"
            )
    _check_loaded(model)
    for _, kwargs in normal:
        _check_kv_cache(kwargs)
    return pipe.map(inner, normal)


@contextlib.contextmanager
def weights_unchanged(model: nn.Module) -> Iterator[nn.Module]:
    """A block in which ``model``'s weights are not edited between forward passes in a way torch
    does not record, by a promise of the caller: each pass then starts on the copies the previous
    one prefetched at its end, so in inference loops the first units of a pass come in while the
    last kernels of the one before run.

    transformers' ``generate()`` needs no such block: between the passes of one ``generate()``
    call only its decoding loop runs, and its second and later passes take the copies of the pass
    before by default (the first pass, the prefill, copies afresh). What the block still buys:

    - for inference loops other than ``generate()`` (a hand-written decoding loop, an evaluation
      loop, consecutive ``generate()`` calls): the overlap across passes, which by default they do
      not get, because user code between passes may rewrite weights in place through
      ``param.data`` (PEFT's ``merge_and_unload``, EMA helpers, init code), which no version
      counter sees and which every pass outside a ``generate()`` call therefore sees;
    - for ``generate()``: the overlap from the prefill to the first decode pass as well, and
      across calls.

    Inside the block, an in-place write through ``.data`` (or through memory no tensor of the
    parameter's counts: numpy views, raw pointers) between passes is not seen until the block
    ends. Everything torch records still is, inside and outside it: in-place edits of the
    parameters themselves (``p.copy_()``, ``p.mul_()`` under ``no_grad``, ``nn.init``,
    ``load_state_dict``, an optimizer's step: version counters), a parameter's ``.data`` set to
    another tensor (its storage address) and a parameter replaced on its module (torchao's
    ``quantize_``: its identity). Blocks nest.
    ::

        with torch.no_grad(), ramtorch.weights_unchanged(model):
            for batch in loader:
                scores.append(model(batch))
    """
    streamer = getattr(model, "_ramtorch_streamer", None)
    if streamer is None:
        raise ValueError(
            "ramtorch.weights_unchanged: the model is not offloaded (call ramtorch.offload first)"
        )
    every = stage_streamers(model)
    for st in every:
        with st.lock:
            st.unchanged += 1
    try:
        yield model
    finally:
        for st in every:
            with st.lock:
                st.unchanged -= 1


def _base_of(layer: nn.Module) -> tuple[nn.Module, Any]:
    """A peft tuner layer's base layer and that layer's ``weight`` (``None`` if it has none)."""
    base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer.base_layer
    return base, getattr(base, "weight", None)


class _DeltaOnBaseDevice:
    """A peft LoRA layer's ``get_delta_weight``, its result moved to the device of the layer's
    base weight. peft merges (``merge_and_unload``, ``merge``, ``unmerge``) by adding the delta,
    computed where the adapters are, into the base weight: with the adapters kept on the GPU
    (``_stream.units.light_trainable``) and the base weight streamed from host RAM, the two are on
    different devices. A class, not a closure, so that a model holding it still pickles."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer

    def __call__(self, adapter: str) -> torch.Tensor:
        layer = self.layer
        delta = type(layer).get_delta_weight(layer, adapter)  # type: ignore[attr-defined]
        _, weight = _base_of(layer)
        if (
            isinstance(weight, torch.Tensor)
            and isinstance(delta, torch.Tensor)
            and delta.device != weight.device
        ):
            delta = delta.to(weight.device)
        return delta


class _AdaptersOnBaseDevice:
    """A peft tuner layer's ``merge`` or ``unmerge``, run with the layer's own parameters (LoRA's
    adapters, DoRA's magnitudes, IA3's scales) moved for the call to the device of its base weight
    and back after. The merges combine them with the base weight (a DoRA merge divides the
    magnitudes by the weight's norm, IA3's multiplies the weight by the scales): with them kept on
    the GPU and the base weight in host RAM, the two would be on different devices. The merged
    weight is computed where the base weight lives and written there, as on a model that is not
    offloaded. The base layer's own small parameters kept on the GPU (its bias, which IA3 scales
    too) come along the same way."""

    def __init__(self, layer: nn.Module, name: str) -> None:
        self.layer = layer
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        layer = self.layer
        run = getattr(type(layer), self.name)
        _, weight = _base_of(layer)
        if not isinstance(weight, torch.Tensor):
            return run(layer, *args, **kwargs)
        away = [(p, p.device) for p in layer.parameters() if p is not weight and p.device != weight.device]
        for p, _ in away:
            move_param(p, weight.device)
        try:
            return run(layer, *args, **kwargs)
        finally:
            for p, dev in away:
                move_param(p, dev)


def _deltas_to_base_weights(model: nn.Module, moved: set[int]) -> None:
    """Gives every peft tuner layer (a module with a ``base_layer``: LoRA, DoRA, IA3, ...) some of
    whose parameters (its own, or its base layer's small ones) were moved to the device
    (``moved``: parameter ids) a ``merge`` and ``unmerge``
    that run with them on the base weight's device (:class:`_AdaptersOnBaseDevice`), and a LoRA
    layer's ``get_delta_weight`` a :class:`_DeltaOnBaseDevice`."""
    for m in model.modules():
        base = getattr(m, "base_layer", None)
        if not isinstance(base, nn.Module):
            continue
        if not any(id(p) in moved for p in m.parameters()):
            continue
        if callable(getattr(type(m), "get_delta_weight", None)):
            m.get_delta_weight = _DeltaOnBaseDevice(m)  # type: ignore[method-assign]
        for name in ("merge", "unmerge"):
            if callable(getattr(type(m), name, None)):
                setattr(m, name, _AdaptersOnBaseDevice(m, name))


def _move(p: nn.Parameter, dev: torch.device) -> None:
    """Moves ``p`` (and its gradient) to ``dev``; one on the meta device is allocated there, zeroed."""
    if p.is_meta:
        materialize(p, torch.zeros(p.shape, dtype=p.dtype, device=dev))
        return
    move_param(p, dev)  # a tensor subclass moves by its inner tensors


def _place_buffers(model: nn.Module, dev: torch.device) -> set[str]:
    """Moves the buffers to ``dev``. Buffers on the meta device are computed again where the model
    says how (a transformers model is built once more with its parameters on the meta device: its
    rotary ``inv_freq``, ``position_ids``, ... come from its own ``__init__``); the others are
    zeroed, and the non-persistent ones among them, which no checkpoint holds, are named in a
    warning. Returns the names of the buffers computed again."""
    meta = [(n, m, b) for n, m, b in _named_buffer_slots(model) if m._buffers[b].is_meta]  # type: ignore[union-attr]
    fresh = _fresh_buffers(model) if meta else {}
    unset, computed = [], set()
    for name, mod, bname in meta:
        b = mod._buffers[bname]
        value = fresh.get(name)
        if value is not None and tuple(value.shape) == tuple(b.shape):
            mod._buffers[bname] = value.to(device=dev, dtype=b.dtype)
            computed.add(name)
        else:
            mod._buffers[bname] = torch.zeros(b.shape, dtype=b.dtype, device=dev)
            if bname in mod._non_persistent_buffers_set:
                unset.append(name)
    for mod in model.modules():
        for bname, b in mod._buffers.items():
            if b is not None and not b.is_meta:
                mod._buffers[bname] = b.to(dev)
    if unset:
        warnings.warn(
            f"ramtorch.offload: the non-persistent buffers {unset} were on the meta device and no "
            "checkpoint holds them: they are zeros now. Set them (e.g. buffer.copy_(...)) before "
            "using the model, or build it with real buffers (accelerate's init_empty_weights() "
            "keeps buffers off the meta device)",
            UserWarning,
            stacklevel=3,
        )
    return computed


def _named_buffer_slots(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``(qualified name, owner, name)`` of each buffer, once per owner."""
    out = []
    for prefix, mod in model.named_modules():
        for bname, b in mod._buffers.items():
            if b is not None:
                out.append((f"{prefix}.{bname}" if prefix else bname, mod, bname))
    return out


def _transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (never imports transformers)."""
    base = getattr(sys.modules.get("transformers"), "PreTrainedModel", None)
    return base is not None and isinstance(model, base)


def _fresh_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a transformers model computes in its ``__init__``, from a second instance built
    from its config with its parameters on the meta device (``{}`` for other models)."""
    config = getattr(model, "config", None)
    if not _transformers_model(model) or config is None:
        return {}
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        p = self._parameters.get(name)
        if p is not None and not p.is_meta:
            self._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        fresh = type(model)(config)
    except Exception as e:  # a model whose class cannot be built from its config alone
        warnings.warn(
            f"ramtorch.offload: could not rebuild {type(model).__name__} from its config to compute its "
            f"buffers on the meta device ({e!r})",
            UserWarning,
            stacklevel=4,
        )
        return {}
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
    return {n: b for n, b in fresh.named_buffers(remove_duplicate=False) if not b.is_meta}


_DEVICE_VIEWS: dict[type, type] = {}


def _racy_offloaded_cache(cache: Any) -> bool:
    """Whether ``cache`` is a transformers KV cache that lives in host RAM (``offloading``, as
    ``cache_implementation="offloaded"`` makes) from a transformers release before 5.20. Those
    prefetch a layer's keys and values on a side stream without waiting for the copies of an
    earlier layer back to the host, whose device memory the prefetch may then reuse: when the
    GPU runs behind the host, as it does while weights stream in, the cache is silently
    corrupted (transformers 5.20 added the wait)."""
    if getattr(cache, "offloading", False) is not True or not hasattr(cache, "prefetch_stream"):
        return False
    module = sys.modules.get("transformers")
    version = getattr(module, "__version__", "")
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) < (5, 20)


def _check_kv_cache(kwargs: dict[str, Any]) -> None:
    """Refuses a KV cache that streaming would corrupt (see :func:`_racy_offloaded_cache`)."""
    for key in ("past_key_values", "cache"):
        if _racy_offloaded_cache(kwargs.get(key)):
            version = getattr(sys.modules.get("transformers"), "__version__", "?")
            raise RuntimeError(
                f"ramtorch: the KV cache in host RAM of transformers {version} "
                '(cache_implementation="offloaded") has a stream race that corrupts the cache '
                "when the GPU runs behind the host, as it does while weights stream: upgrade to "
                "transformers 5.20 or later, or keep the KV cache on the GPU"
            )


def _span_generate() -> None:
    """Makes each call of transformers' ``GenerationMixin.generate`` (once transformers is
    imported) a decoding span (:mod:`ramtorch._stream.decoding`): between its passes only the
    decoding loop's code runs, so its second and later passes take the copies prefetched at the
    end of the pass before instead of copying their first units afresh. Done once, on the class
    (every model's ``generate`` and the overrides that call it: Whisper's, PEFT's), so that a
    model whose offloaded part is a submodule (``ramtorch.offload(model.model)``) gets it too; a
    ``generate`` that does not reach ``GenerationMixin.generate`` runs as plain passes."""
    module = sys.modules.get("transformers")
    if module is None:
        return
    try:
        mixin = module.GenerationMixin
    except (AttributeError, ImportError):  # a transformers without it, or one that failed to import
        return
    inner = mixin.__dict__.get("generate")
    if not callable(inner) or getattr(inner, "_ramtorch_span", False):
        return

    @functools.wraps(inner)
    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _decoding.span():
            return inner(self, *args, **kwargs)

    generate._ramtorch_span = True  # type: ignore[attr-defined]
    mixin.generate = generate


def _check_loaded(model: nn.Module) -> None:
    """Refuses the forward of a model built on the meta device that still holds tensors no load
    and no write has filled (``offload`` allocated them as zeros, and recorded them with their
    version counters in ``_ramtorch_unwritten``): it would compute, and train, on zeros. A tensor
    counts as written once its version counter moved, its module holds another tensor under its
    name, or it is not all zeros (a write through ``.data``, which no version counter sees).
    Costs one attribute lookup a pass once every tensor is written."""
    unwritten = model.__dict__.get("_ramtorch_unwritten")
    if not unwritten or torch._C._current_graph_task_id() != -1:
        return
    now = dict(model.named_parameters(remove_duplicate=False))
    now.update(model.named_buffers(remove_duplicate=False))
    left = {}
    with torch.no_grad():
        for name, (t, version) in unwritten.items():
            if t._version == version and now.get(name) is t and not bool(t.count_nonzero()):
                left[name] = (t, version)
    model._ramtorch_unwritten = left  # type: ignore[assignment]
    if left:
        names = list(left)  # in the model's order
        shown = ", ".join(repr(n) for n in names[:8])
        if len(names) > 8:
            shown += f" and {len(names) - 8} more"
        raise RuntimeError(
            f"ramtorch.offload: the model was built on the meta device and {len(names)} of its tensors "
            f"were never loaded: [{shown}]. They are zeros, which the forward would compute and train "
            "on. Load the weights first (ramtorch.load(model, path), or model.load_state_dict(...)), "
            "or initialise them (e.g. module.reset_parameters()); zeros that are meant are set in "
            "place (with torch.no_grad(): tensor.zero_())"
        )


def _report_compute_device(model: nn.Module) -> None:
    """Models with a ``device`` property that reads their first parameter (transformers'
    ``PreTrainedModel``) would report "cpu" once the weights live in host RAM, and
    ``generate()`` would then move its inputs there. Such a model gets a subclass of its own class
    whose ``device`` is the compute device (``detach_streamer`` restores the class)."""
    cls = type(model)
    if not isinstance(inspect.getattr_static(cls, "device", None), property):
        return
    view = _DEVICE_VIEWS.get(cls)
    if view is None:
        base = inspect.getattr_static(cls, "device")

        def device(self: nn.Module) -> torch.device:
            streamer = self.__dict__.get("_ramtorch_streamer")
            return streamer.device if streamer is not None else base.fget(self)

        view = type(
            cls.__name__,
            (cls,),
            {"device": property(device), "__module__": cls.__module__, "__qualname__": cls.__qualname__},
        )
        view._ramtorch_base_class = cls  # type: ignore[attr-defined]
        _DEVICE_VIEWS[cls] = view
    model.__class__ = view


def _auto_budget(dev: torch.device) -> int:
    """``gpu_budget="auto"``: the device's free memory, less a reserve for activations and the
    caching allocator's slack (a fifth of it, at least 2 GiB)."""
    if dev.type != "cuda":
        raise ValueError("gpu_budget='auto' needs a CUDA device (on CPU there is nothing to budget)")
    free, _ = torch.cuda.mem_get_info(dev)
    return max(0, free - max(2 * _GIB, free // 5))


def _warn_strides(units: list[_Unit], resident: set[int]) -> None:
    """Warns, naming them, about the parameters whose strides packing changes: a streamed unit's
    tensors are laid out contiguously in its host region (and in device slots), so a
    ``channels_last`` convolution weight or a transposed weight keeps its values and shape but
    becomes contiguous."""
    names = []
    for u in units:
        if u.uid in resident or u.tree is not None or stream_tensors(u.params)[1] is not None:
            continue
        for e in u.entries:
            p = u.params[e.index]
            if not p.is_meta and not p.is_contiguous():
                names.append(f"{u._qualified_name(e)} (stride {tuple(p.stride())})")
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        warnings.warn(
            f"ramtorch.offload: {len(names)} streamed parameters are not contiguous ({shown}); "
            "streamed weights are stored contiguous in host RAM and on the device, so they keep "
            "their values and shapes but not their strides (channels_last convolution weights become "
            "contiguous: the convolutions still compute the same, maybe with other kernels). Keep "
            "such modules resident (a gpu_budget that holds them) to keep the strides",
            UserWarning,
            stacklevel=3,
        )


def _report_plan(
    model: nn.Module,
    units: list[_Unit],
    pl: Plan,
    budget: int | None,
    dev: torch.device,
    hint: str | None,
    kept: Sequence[nn.Parameter] = (),
) -> None:
    """Logs (INFO, logger ``ramtorch``) the plan :func:`offload` made: the units, which stay
    resident, the slots, the bytes streamed per pass, the parameters kept on the device outside
    the units (``kept``: tied, light trainable and small ones), and the ``unit=`` that would split
    a unit holding most of the model."""
    if not logger.isEnabledFor(logging.INFO):
        return
    if kept:
        nbytes = sum(p.numel() * p.element_size() for p in kept)
        hint = "; ".join(
            x
            for x in (
                f"{len(kept)} parameters ({_fmt(nbytes)}: tied, adapters over a frozen base, norms "
                "and biases) kept on the device outside the units",
                hint,
            )
            if x
        )
    resident = [u.name for u in units if u.resident]
    gathered = [f"{u.name} ({_fmt(u.nbytes)})" for u in units if u.gather]
    shown = ", ".join(resident[:6]) + (f" and {len(resident) - 6} more" if len(resident) > 6 else "")
    logger.info(
        "ramtorch.offload of %s on %s: %d units, %d resident (%s%s), %d streamed through %d slots of %s%s; "
        "%s held on the device (gpu_budget %s), %s streamed per pass%s",
        type(model).__name__,
        dev,
        len(units),
        len(resident),
        _fmt(pl.resident_bytes),
        f": {shown}" if shown else "",
        len(units) - len(resident) - len(gathered),
        pl.slots,
        _fmt(pl.slot_bytes),
        f", {len(gathered)} embedding tables streamed by the rows each pass reads ({', '.join(gathered)})"
        if gathered
        else "",
        _fmt(pl.resident_bytes + pl.slots * pl.slot_bytes),
        "none" if budget is None else _fmt(budget),
        _fmt(pl.streamed_bytes) + (" plus the gathered rows" if gathered else ""),
        f"; {hint}" if hint else "",
    )


def _report_auto_plan(
    model: nn.Module,
    units: list[_Unit],
    pl: Plan,
    budget: int,
    dev: torch.device,
    store: _disk.Store | None = None,
) -> None:
    """Logs (INFO, logger ``ramtorch``) the plan ``gpu_budget="auto"`` chose, with the predicted
    pass time (``ramtorch.plan``; with units on disk, their reads at the plan's default disk
    speed)."""
    from . import plan as _plan

    on_disk = store is not None and store.optimizer_on_disk
    pred = _plan.predict(
        model,
        budget,
        4096,
        host_budget=None if store is None else store.host_budget,
        optimizer_on_disk=on_disk,
    )
    resident = sum(1 for u in units if u.resident)
    logger.info(
        "ramtorch.offload(gpu_budget='auto') on %s: budget %s, %d of %d units resident (%s), %d slots "
        "of %s, %s streamed per pass; predicted at 4096 tokens: forward %.0f ms, forward+backward "
        "%.0f ms (python -m ramtorch plan for other shapes); training adds %s on the device outside "
        "the budget (gradients and optimizer states of the resident units)%s",
        dev,
        _fmt(budget),
        resident,
        len(units),
        _fmt(pl.resident_bytes),
        pl.slots,
        _fmt(pl.slot_bytes),
        _fmt(pl.streamed_bytes),
        pred.forward_seconds * 1e3,
        pred.forward_backward_seconds * 1e3,
        _fmt(pred.resident_training_bytes),
        ""
        if store is None
        else f"; {len(pred.disk_units)} units ({_fmt(pred.disk_bytes)}) on disk, read in "
        f"{pred.disk_read_seconds_per_pass * 1e3:.0f} ms a pass at {_plan.Ceilings().disk_gbps} GB/s"
        + (
            f", and their optimizer states ({_fmt(pred.disk_state_bytes)} with AdamW's fp32 masters), "
            f"read and written once a step: a step {pred.step_seconds:.1f} s"
            if on_disk
            else ""
        ),
    )


class _KeptBuffers:
    """The buffers of one checkpointed forward of a module that the forward changed (BatchNorm's
    running statistics and ``num_batches_tracked`` in training mode): its recomputation in
    backward changes them again, and they are put back as they were before it, as the RNG state
    is. A forward that changes no buffer (most) costs one version check per buffer.

    A change is seen per submodule: one buffer of it set anew or with its version counter bumped
    marks all its buffers (BatchNorm's kernels update the running statistics without bumping
    their version counters, but ``num_batches_tracked`` is bumped)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.changed: list[tuple[nn.Module, str]] = []
        self.replaying = False  # while the recomputation in backward runs

    def _slots(self) -> list[tuple[nn.Module, str, torch.Tensor]]:
        return [(m, n, b) for m in self.module.modules() for n, b in m._buffers.items() if b is not None]

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Around the forward: notes the buffers it changes (in place, or set anew)."""
        before = [(m, n, b, b._version) for m, n, b in self._slots()]
        yield
        touched = {id(m) for m, n, b, v in before if m._buffers.get(n) is not b or b._version != v}
        self.changed = [(m, n) for m, n, _, _ in before if id(m) in touched]

    @contextlib.contextmanager
    def recompute(self) -> Iterator[None]:
        """Around the recomputation in backward: the changed buffers are restored after it."""
        kept = []
        for m, n in self.changed:
            b = m._buffers.get(n)
            if b is not None:
                kept.append((m, n, b, b.clone()))
        self.replaying = True
        try:
            yield
        finally:
            self.replaying = False
            with torch.no_grad():
                for m, n, b, value in kept:
                    m._buffers[n] = b
                    b.copy_(value)

    def contexts(self) -> tuple[Any, Any]:
        """``context_fn`` of ``torch.utils.checkpoint.checkpoint``."""
        return self.forward(), self.recompute()


def _checkpoint_forward(module: nn.Module) -> None:
    """Runs ``module``'s forward under non-reentrant activation checkpointing (inside the unit's
    hooks, so the recomputation finds the weights the unit's backward fetched). Buffers the
    forward changes are restored after the recomputation (:class:`_KeptBuffers`): the step
    updates BatchNorm's running statistics once, as without recomputation."""
    from torch.utils.checkpoint import checkpoint

    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        kept = _KeptBuffers(module)
        if not any(_is_kv_cache(v) for v in (*args, *kwargs.values())):
            return checkpoint(inner, *args, use_reentrant=False, context_fn=kept.contexts, **kwargs)
        _check_kv_cache_empty(module, args, kwargs)

        def run(*a: Any, **kw: Any) -> Any:
            if kept.replaying:
                a, kw = _without_kv_cache(a, kw)
            return inner(*a, **kw)

        return checkpoint(run, *args, use_reentrant=False, context_fn=kept.contexts, **kwargs)

    module.forward = forward  # type: ignore[method-assign]


def _is_kv_cache(value: Any) -> bool:
    """Whether ``value`` is a transformers key/value cache (a ``Cache``: its layers write their
    keys and values into it in place)."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(value).__mro__)


def _without_kv_cache(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The arguments of a recomputed forward with no key/value cache: the forward already wrote
    this layer's keys and values into it, and a second write would append them again (a cache of
    twice the tokens, attention over keys its mask does not cover). With the layer's part of the
    cache empty before the forward (:func:`_check_kv_cache_empty`), attention over the new keys
    alone recomputes what the forward computed."""
    args = tuple(None if _is_kv_cache(v) else v for v in args)
    kwargs = {k: None if _is_kv_cache(v) else v for k, v in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return args, kwargs


def _check_kv_cache_empty(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Refuses a forward under ``recompute`` given a key/value cache that already holds tokens of
    the layer (a prefix, ``past_key_values`` from an earlier call): the recomputation in backward
    runs without the cache (:func:`_without_kv_cache`) and could not attend to them. The layer is
    the one its attention names (``layer_idx``); without one, nothing is checked here, and torch's
    checkpoint refuses a recomputation whose tensors differ in shape."""
    idx = next(
        (i for m in module.modules() if isinstance(i := getattr(m, "layer_idx", None), int)),
        None,
    )
    if idx is None:
        return
    for v in (*args, *kwargs.values()):
        if not _is_kv_cache(v):
            continue
        try:
            held = int(v.get_seq_length(idx))
        except Exception:  # noqa: BLE001 - a cache type without per-layer lengths: not checked
            continue
        if held:
            raise RuntimeError(
                f"ramtorch.offload(recompute=...): {type(module).__name__} (layer {idx}) was given a "
                f"key/value cache that already holds {held} tokens of the layer, and its recomputation "
                "in backward cannot attend to them (it runs without the cache, which the forward "
                "already wrote). Train with use_cache=False and no past_key_values, or offload without "
                "recompute for passes that continue from a cache"
            )


def _refuse_copy(*_: Any) -> Any:
    """``copy.copy`` and pickling (``torch.save(model)``) of an offloaded model, and
    ``copy.deepcopy`` of one that :func:`_copy_offloaded` does not copy."""
    raise TypeError(
        "ramtorch.offload: an offloaded model cannot be pickled or shallow-copied, nor deep-copied "
        "when offloaded with compress, host_budget, disk, links or devices, or before ramtorch.load "
        "has filled it (its hooks and host memory belong to this process's streaming engine). Copy "
        "its weights instead: build a fresh model, load this one's state_dict() into it (or use "
        "ramtorch.save_checkpoint / load_checkpoint), and offload the copy if it should stream too."
    )


class _DeepCopy:
    """An offloaded model's ``__deepcopy__`` (see :func:`_copy_offloaded`); holds the model weakly
    (a strong reference from its own attribute would keep it alive until a full collection)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = weakref.ref(model)

    def __call__(self, memo: dict[int, Any]) -> nn.Module:
        model = self.model()
        if model is None:
            _refuse_copy()
        return _copy_offloaded(model, memo)


#: Hook tables of a module (``nn.Module.__dict__``), whose ramtorch entries a copy leaves out.
_HOOK_TABLES = ("hooks", "hooks_with_kwargs", "hooks_always_called")


def _ours(value: Any) -> bool:
    """Whether ``value`` (a hook, a method set on a module) is ramtorch's own code."""
    f = getattr(value, "func", value)  # functools.partial
    f = getattr(f, "__func__", f)  # a bound method
    return str(getattr(f, "__module__", "") or "").startswith("ramtorch.")


@contextlib.contextmanager
def _without_streaming(model: nn.Module, hook_ids: set[int]) -> Iterator[None]:
    """``model`` as it was before :func:`offload` while the block runs, as far as copying sees
    it: the hooks whose ids are ``hook_ids`` out of its modules' hook tables (each table swapped
    for a filtered one, so the handles keep theirs), ramtorch's attributes and methods out of the
    modules' ``__dict__``, the classes ramtorch gave them (``RowsLinear``, a compute-device view)
    back to their own. All put back as they were on the way out."""
    undo: list[tuple[dict[str, Any], str, Any]] = []
    classes: list[tuple[nn.Module, type]] = []
    try:
        for m in model.modules():
            d = m.__dict__
            for name, v in list(d.items()):
                if name.endswith(_HOOK_TABLES) and isinstance(v, dict) and any(k in hook_ids for k in v):
                    d[name] = type(v)((k, x) for k, x in v.items() if k not in hook_ids)
                    undo.append((d, name, v))
                elif name.startswith("_ramtorch_") or (
                    name in ("_apply", "__deepcopy__", "__reduce_ex__", "forward") and _ours(v)
                ):
                    undo.append((d, name, d.pop(name)))
            cls = type(m)
            base = cls.__dict__.get("_ramtorch_base_class")
            if cls is _rows.RowsLinear:
                base = nn.Linear
            if base is not None:
                classes.append((m, cls))
                m.__class__ = base
        yield
    finally:
        for m, cls in reversed(classes):
            m.__class__ = cls
        for d, name, v in reversed(undo):
            d[name] = v


def _copy_offloaded(model: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """``copy.deepcopy(model)`` of an offloaded model: a model of its own, offloaded with the same
    options to the same device (an EMA model, ``torch.optim.swa_utils.AveragedModel``, a frozen
    reference model for DPO): the modules deep-copied without ramtorch's hooks and attributes,
    then :func:`offload` of the copy. Its weights are those the model has now (every pending
    optimizer update written first), copied from the model's host region into the copy's (units
    with a tensor subclass, a quantized weight, are deep-copied whole first). Refused, with the
    reason, inside a forward or backward of the model, for a pipeline (``devices``), for the
    options whose stores a copy cannot share (``compress``, ``host_budget``, ``disk``, ``links``)
    and for weights ``ramtorch.load`` has not filled yet."""
    streamer = model.__dict__.get("_ramtorch_streamer")
    opts = model.__dict__.get("_ramtorch_copy_options")
    if streamer is None or opts is None or model.__dict__.get("_ramtorch_unwritten"):
        _refuse_copy()
    if streamer.state:
        raise RuntimeError(
            "ramtorch.offload: copy.deepcopy of an offloaded model inside its forward or backward; "
            "copy it between passes"
        )
    _engine.wait_updates([p for u in streamer.units for p in u.params])  # pending optimizer writes
    # The streamed weights are not copied by deepcopy (a plain copy of each, then its packed copy,
    # would hold them twice in host memory): they go in as meta tensors, which offload allocates
    # in the copy's host region, and are copied there from the model's.
    sources: dict[int, nn.Parameter] = {}
    for u in streamer.units:
        plain_params = all(type(p) is nn.Parameter and not is_traceable_wrapper_subclass(p) for p in u.params)
        if u.resident or not plain_params:
            continue  # (a unit packs its tensors together: all of them meta, or none)
        for p in u.params:
            if id(p) not in memo:
                stand_in = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                memo[id(p)] = stand_in
                sources[id(stand_in)] = p
    with _without_streaming(model, {h.id for h in streamer.hook_handles}):
        plain = copy.deepcopy(model, memo)
    twin = offload(plain, **opts)
    pairs = [(p, sources[id(p)]) for p in twin.parameters() if id(p) in sources]
    total = sum(p.numel() * p.element_size() for p, _ in pairs)
    show = opts["progress"] if opts["progress"] is not None else total > _GIB
    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="ramtorch: copying weights", leave=False)
    with torch.no_grad():
        for p, src in pairs:
            p.copy_(src)
            if bar is not None:
                bar.update(p.numel() * p.element_size())
    if bar is not None:
        bar.close()
    unwritten = twin.__dict__.get("_ramtorch_unwritten")
    if unwritten:  # (the load check would count the writes too, by version, at the next forward)
        done = {id(p) for p, _ in pairs}
        twin._ramtorch_unwritten = {n: v for n, v in unwritten.items() if id(v[0]) not in done}  # type: ignore[assignment]
    return twin


def _guarded_apply(model: nn.Module, streamer: Streamer) -> Any:
    """``model.to()``/``.cuda()``/``.half()`` after offload: moving to the compute device is a
    no-op (streamed weights stay in RAM, the rest is there already); anything else is refused
    rather than silently pulling the host parameters onto a device."""
    ref = weakref.ref(model)

    def _apply(fn: Any, recurse: bool = True) -> nn.Module:
        m = ref()
        dtype = next((p.dtype for p in m.parameters()), torch.float32) if m is not None else torch.float32
        probe = _moved(fn, dtype, streamer)
        if probe is not None:
            raise RuntimeError(
                f"ramtorch.offload: this model streams to {streamer.device} with its weights in host "
                f"RAM; it cannot be moved or converted to {probe.device}/{probe.dtype} afterwards. "
                "Convert the model before calling ramtorch.offload (device= picks where it computes)."
            )
        return m  # type: ignore[return-value]

    return _apply


def _moved(fn: Any, dtype: torch.dtype, streamer: Streamer) -> torch.Tensor | None:
    """What ``Module._apply``'s ``fn`` makes of an empty ``dtype`` tensor, if that leaves
    ``dtype`` or the streamer's device (None: it changes nothing that streams)."""
    probe = fn(torch.empty(0, dtype=dtype))
    same = probe.dtype == dtype and probe.device.type == streamer.device.type
    if same and probe.device.type == "cuda":
        same = (probe.device.index or torch.cuda.current_device()) == streamer.device.index
    return None if same else probe


def _guarded_unit_apply(module: nn.Module, name: str, streamer: Streamer) -> Any:
    """``.to()``/``.double()``/``.cuda()`` of one unit's module after offload (``model.layers[1]
    .double()``), refused as the model's are (:func:`_guarded_apply`), before anything changed:
    its weights stream through device slots sized for the dtypes offload planned. Moving it to
    the compute device in its own dtypes is a no-op."""
    ref = weakref.ref(module)

    def _apply(fn: Any, recurse: bool = True) -> nn.Module:
        m = ref()
        dtypes = sorted({p.dtype for p in m.parameters()}, key=str) if m is not None else []
        for dtype in dtypes or [torch.float32]:
            probe = _moved(fn, dtype, streamer)
            if probe is not None:
                raise RuntimeError(
                    f"ramtorch.offload: unit {name!r} of an offloaded model streams to {streamer.device} "
                    f"with its weights ({', '.join(str(d) for d in dtypes)}) in host RAM, in device "
                    f"slots sized for them; it cannot be moved or converted to {probe.device}/"
                    f"{probe.dtype} afterwards (nothing was changed). Convert the model before calling "
                    "ramtorch.offload"
                )
        return m  # type: ignore[return-value]

    _apply._ramtorch_guard = True  # type: ignore[attr-defined]
    return _apply


def detach_streamer(model: nn.Module) -> None:
    """Removes ``model``'s streaming hooks (its parameters stay where they are)."""
    every = stage_streamers(model)
    if not every:
        return
    for name in ("_apply", "__deepcopy__", "__reduce_ex__", "forward"):
        if name != "forward" or getattr(model, "_ramtorch_pipeline", None) is not None:
            model.__dict__.pop(name, None)
    for streamer in every:
        streamer.eng.synchronize()
        for u in streamer.units:
            if getattr(u.module.__dict__.get("_apply"), "_ramtorch_guard", False):
                del u.module.__dict__["_apply"]
        for h in streamer.hook_handles:
            h.remove()
        for u in streamer.units:
            if getattr(u.module, "_ramtorch_unit", None) is u:
                del u.module._ramtorch_unit
            for m in u.module.modules():
                _rows.release(m)  # (a unit's last Linear computed by rows within its parts too)
        _STREAMERS.discard(streamer)
        _added.unwatch(streamer)
        streamer.eng.remove_holder(streamer)
    model._ramtorch_streamer = None
    for name in ("_ramtorch_pipeline", "_ramtorch_own_forward"):
        model.__dict__.pop(name, None)
    base = type(model).__dict__.get("_ramtorch_base_class")
    if base is not None:
        model.__class__ = base
