"""Pretrained weights: :func:`load` (``ramtorch.load``) and :func:`save` (``ramtorch.save_pretrained``),
in place, without a second copy of the model. The layout is specified in :mod:`ramtorch.io.format`.

:func:`load` opens each file once with ramtorch's reader, which validates its header first (offsets
in range, no overlaps, sizes consistent with shapes) and never maps the file, and copies each tensor
straight into the memory of the model's parameter or buffer, converting F32/BF16/F16 on the fly.
Parameters in host RAM (including those :func:`ramtorch.offload` keeps in its arena) are written
through their address; parameters on a GPU get their bytes through one reusable pinned staging
buffer.

:func:`save` writes the Hugging Face layout: ``model.safetensors``, or
``model-00001-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``, each file
written atomically (temporary file, fsync, rename, directory fsync), the index last.
"""

from __future__ import annotations

import copy
import json
import os
import re
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .. import _arena, _engine
from .._units import parse_bytes
from ._dtypes import NATIVE, ST_TO_TORCH, TORCH_TO_ST
from ._files import fsync_dir, read_regular, write_atomic
from ._keys import ignored_missing, ignored_unexpected, map_keys
from ._progress import progress_bar
from ._reader import Batches, SafetensorsReader, plain_loading, settle_engines
from .format import check_storable, header, write_file

__all__ = ["INDEX_NAME", "SINGLE_NAME", "load", "plain_loading", "save"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict; a key given twice (which would silently keep the last) is an error."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears more than once")
        out[key] = value
    return out


def _resolve(path_or_dir: str | os.PathLike[str]) -> list[tuple[Path, list[str] | None]]:
    """The files to read, each with the keys the index assigns to it (``None``: all of them).
    Whether each is a regular file is checked when it is opened."""
    p = Path(path_or_dir)
    if not p.exists():
        raise FileNotFoundError(f"ramtorch.load: {str(p)!r} is neither a file nor a directory")
    if not p.is_dir():
        return [(p, None)]
    index = p / INDEX_NAME
    if index.exists():
        text = read_regular(index, "ramtorch.load")
        try:
            weight_map = json.loads(text, object_pairs_hook=_unique_keys)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise ValueError(f"ramtorch.load: {str(index)!r} is not a valid index: {e!r}") from None
        by_file: dict[str, list[str]] = {}
        for key, fname in weight_map.items():
            if not isinstance(fname, str) or Path(fname).name != fname or fname in ("", ".", ".."):
                raise ValueError(f"ramtorch.load: {str(index)!r}: bad file name {fname!r} for key {key!r}")
            by_file.setdefault(fname, []).append(key)
        return [(p / f, keys) for f, keys in sorted(by_file.items())]
    files = sorted(f for f in p.glob("*.safetensors") if f.is_file())
    if not files:
        raise FileNotFoundError(f"ramtorch.load: no {INDEX_NAME} and no *.safetensors file in {str(p)!r}")
    return [(f, None) for f in files]


def _targets(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """The model's state-dict tensors by name, and groups of names that share one tensor."""
    sd = model.state_dict(keep_vars=True)
    meta = [name for name, t in sd.items() if t.is_meta]
    if meta:
        raise RuntimeError(
            f"ramtorch.load: {len(meta)} tensors of the model are on the meta device (e.g. {meta[:3]}), "
            "with no memory to load into: ramtorch.offload(model) allocates them in host RAM "
            "(or model.to_empty(device=...) allocates them uninitialised)"
        )
    sub = [name for name, t in sd.items() if is_traceable_wrapper_subclass(t)]
    if sub:
        t = sd[sub[0]]
        raise RuntimeError(
            f"ramtorch.load: {len(sub)} tensors of the model are tensor subclasses (e.g. {sub[:3]}: "
            f"{type(t).__module__}.{type(t).__qualname__}, a quantized weight), which ramtorch.load "
            "cannot fill from safetensors files of plain tensors; nothing was written. Load the "
            "full-precision checkpoint before quantizing: ramtorch.load(model, path), then "
            "quantize_(model, config). A quantized state dict saved with torch.save loads with "
            "model.load_state_dict(torch.load(path))"
        )
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name, t in sd.items():
        key: tuple[Any, ...] = (id(t),)
        if t.numel() > 0:
            key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        groups.setdefault(key, []).append(name)
    return dict(sd), list(groups.values())


def _few(keys: list[str], shown: int = 8) -> str:
    """``keys`` for a message: all of them up to ``shown``, else the first ``shown`` and how many
    more (the returned dict of :func:`load` lists them all)."""
    if len(keys) <= shown:
        return repr(keys)
    return f"{keys[:shown]!r} and {len(keys) - shown} more"


@torch.no_grad()
def load(
    model: nn.Module,
    path_or_dir: str | os.PathLike[str],
    *,
    strict: bool = True,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Fills ``model``'s parameters and buffers in place from safetensors file(s).

    Args:
        model: any ``nn.Module``, offloaded by :func:`ramtorch.offload` or not. Its tensors keep
            their identity, device, dtype and (for host tensors) address.
        path_or_dir: one ``.safetensors`` file; a directory holding ``model.safetensors.index.json``
            (the Hugging Face sharded layout); or a directory of ``*.safetensors`` files.
        strict: raise (before anything is written) if the files miss keys of the model's
            ``state_dict`` or hold keys it does not have.
        progress: show a progress bar over bytes (default: when loading more than 1 GiB).

    Returns:
        ``{"missing": [...], "unexpected": [...], "bytes": n, "seconds": t}``: the model's keys
        the files do not hold and the files' keys the model does not have (also in a
        ``UserWarning`` with ``strict=False``).

    A transformers model's keys are matched as its ``from_pretrained`` matches them: the base
    model prefix (``bert.``, ``model.``) added or stripped, legacy names renamed
    (``LayerNorm.gamma``), and the keys the model ignores (its ``_keys_to_ignore_on_load_*``
    patterns, non-persistent buffers such as ``position_ids`` that older files hold) not reported.
    A tensor :func:`ramtorch.offload` allocated for a model built on the meta device that the
    files do not hold, and nothing has written since, is an error even with ``strict=False``.

    Raises:
        RuntimeError: key mismatch (with ``strict``), shape mismatch, a dtype that cannot be
            converted, a meta-device tensor left unloaded, a model still on the meta device
            (not offloaded), or one with tensor subclasses (quantized weights: load, then
            quantize); nothing has been written then.
        ValueError: a file that is not valid safetensors (truncated, inconsistent header, ...).
        OSError: a file that cannot be opened.

    On a model offloaded with a kept store (``ramtorch.offload(..., keep=True)``), a load of the
    files the store was last loaded from (same paths, sizes and modification times, nothing
    committed since) reads nothing and returns ``"bytes": 0`` and ``"from_store": True``; any
    other load is followed by a commit of the store (:func:`ramtorch.commit`, without optimizer).

    Tensors that several names share (tied weights) are filled once. Floating tensors are
    converted to each target's dtype (F32/BF16/F16 while copying; other pairs through torch).
    Modules with their own ``_load_from_state_dict`` or load hooks (and those below them) are
    given their tensors through ``model.load_state_dict``, as torch would: the rest is written
    in place directly.
    """
    t0 = time.perf_counter()
    # (offload(keep=True): the store's ramtorch._keep.Kept)
    kept = getattr(getattr(getattr(model, "_ramtorch_streamer", None), "disk_store", None), "kept", None)
    source = None
    if kept is not None:
        # A kept store holds the model: loading the files it was filled from reads nothing.
        source = {"files": _identity(path_or_dir), "strict": strict}
        had = kept.manifest.get("source")
        if kept.opened and had is not None and had.get("serial") == kept.manifest.get("serial"):
            if {k: had.get(k) for k in source} == source:
                return {
                    "missing": list(had.get("missing", [])),
                    "unexpected": list(had.get("unexpected", [])),
                    "bytes": 0,
                    "seconds": time.perf_counter() - t0,
                    "from_store": True,
                }
        kept.mark_dirty("ramtorch.load")  # (the journal does not see a load's writes)
    # Weights a failed optimizer update left half written are about to be replaced; they stay
    # flagged if the load fails.
    failed = _engine.discard_failed_updates(model.parameters())
    try:
        out = _load_into(model, path_or_dir, strict, progress, t0)
    except BaseException:
        _engine.restore_failed_updates(failed)
        raise
    if kept is not None and source is not None:
        kept.commit(
            model,
            None,
            None,
            source={**source, "missing": out["missing"], "unexpected": out["unexpected"]},
            by_user=False,
        )
    return out


def _identity(path_or_dir: str | os.PathLike[str]) -> list[list[Any]]:
    """Each file a load reads: its absolute path, size and modification time (nanoseconds)."""
    out: list[list[Any]] = []
    for path, _ in _resolve(path_or_dir):
        st = os.stat(path)
        out.append([os.path.abspath(path), st.st_size, st.st_mtime_ns])
    return out


def _load_into(
    model: nn.Module, path_or_dir: str | os.PathLike[str], strict: bool, progress: bool | None, t0: float
) -> dict[str, Any]:
    settle_engines()  # weights may be in flight to a device
    targets, groups = _targets(model)

    files = [(path, SafetensorsReader(path), keys) for path, keys in _resolve(path_or_dir)]
    source: dict[str, tuple[SafetensorsReader, str, tuple[int, ...], str]] = {}
    for path, f, keys in files:
        entries = {name: (dtype, shape) for name, (dtype, shape) in f.entries.items()}
        if keys is not None:
            absent = [k for k in keys if k not in entries]
            if absent:
                raise ValueError(
                    f"ramtorch.load: the index assigns {absent[:5]} to {str(path)!r}, "
                    "which does not hold them"
                )
            entries = {k: entries[k] for k in keys}
        for name, (dtype, shape) in entries.items():
            if name in source:
                first = source[name][0].path
                raise ValueError(f"ramtorch.load: key {name!r} is in both {first!r} and {str(path)!r}")
            source[name] = (f, dtype, shape, name)
    # Checkpoint keys under the model's names (transformers models: as from_pretrained maps them).
    renamed = map_keys(model, source, targets)
    source = {renamed[k]: v for k, v in source.items()}

    # Plan everything before writing anything.
    plan: list[tuple[str, str, torch.Tensor, SafetensorsReader, str]] = []
    missing: list[str] = []
    for names in groups:
        present = [n for n in names if n in source]
        if not present:
            missing.extend(names)
            continue
        name = present[0]
        t = targets[name]
        f, dtype, shape, key = source[name]
        if tuple(t.shape) != shape:
            raise RuntimeError(
                f"ramtorch.load: shape mismatch for {name!r}: the file ({f.path!r}) has {list(shape)}"
                + (f" under {key!r}" if key != name else "")
                + f", the model has {list(t.shape)}"
            )
        if dtype not in ST_TO_TORCH:
            raise RuntimeError(f"ramtorch.load: {key!r} has dtype {dtype}, which torch cannot hold")
        plan.append((name, key, t, f, dtype))
    # Tensors ramtorch.offload allocated for a meta-device model and nothing has written since.
    unwritten = getattr(model, "_ramtorch_unwritten", None) or {}
    never = [n for n in missing if n in unwritten and unwritten[n][0]._version == unwritten[n][1]]
    if never:
        raise RuntimeError(
            f"ramtorch.load: the checkpoint does not hold {never}, which the model was built without "
            "(on the meta device): they would stay zeros. Load a checkpoint that has them, or set "
            "them first (e.g. module.reset_parameters() after ramtorch.offload)"
        )
    skip_missing, skip_unexpected = ignored_missing(model), ignored_unexpected(model)
    missing = [n for n in missing if not skip_missing(n)]
    unexpected = sorted(source[n][3] for n in source if n not in targets and not skip_unexpected(n))
    if missing or unexpected:
        matched = sum(1 for n in targets if n in source)
        if matched == 0 and missing:
            what = (
                f"0 of {len(targets)} keys of the model matched the checkpoint (is it another "
                f"model's?); the file has keys like {_few(sorted(k for *_, k in source.values()), 4)}, "
                f"the model {_few(list(targets), 4)}"
            )
        else:
            what = (
                f"keys do not match the model ({matched} of {len(targets)} matched)"
                + (f"; missing from the checkpoint: {_few(missing)}" if missing else "")
                + (f"; unexpected in the checkpoint: {_few(unexpected)}" if unexpected else "")
            )
        if strict:
            raise RuntimeError(f"ramtorch.load: {what}")
        warnings.warn(f"ramtorch.load(strict=False): {what}", UserWarning, stacklevel=4)

    total = sum(f.nbytes(key) for _, key, _, f, _ in plan)
    bar = progress_bar(progress, total, "ramtorch.load")
    # Tensors that go straight into host memory are copied in batches per file, which all cores
    # share; the rest go through a staging buffer.
    order = {id(f): i for i, (_, f, _) in enumerate(files)}
    plan.sort(key=lambda e: order[id(e[3])])
    staging: torch.Tensor | None = None
    batches = Batches(bar)
    plain = plain_loading(model)
    routed: dict[str, torch.Tensor] = {}  # for modules with their own loading: load_state_dict
    try:
        for name, key, t, f, dtype in plan:
            nbytes = f.nbytes(key)
            if not plain(name.rpartition(".")[0]):
                tmp = torch.empty(t.shape, dtype=ST_TO_TORCH[dtype])
                f.copy_many([(key, tmp, nbytes, dtype)])
                routed[name] = tmp
                if bar is not None:
                    bar.update(nbytes)
                continue
            want = TORCH_TO_ST.get(t.dtype)
            native = want is not None and (want == dtype or (want in NATIVE and dtype in NATIVE))
            if t.numel() == 0:
                pass
            elif native and t.device.type == "cpu" and t.is_contiguous():
                batches.add(f, (key, t, t.numel() * t.element_size(), want), t)
                continue
            else:
                # Through the staging buffer: converted by Rust when it can, else by torch.
                sdtype = t.dtype if native else ST_TO_TORCH[dtype]
                n = t.numel() * (t.element_size() if native else torch.empty(0, dtype=sdtype).element_size())
                if staging is None or staging.numel() < n:
                    staging = _arena.host_bytes(max(n, 1 << 20))
                f.copy_many([(key, staging, n, want if native else dtype)])
                t.copy_(staging[:n].view(sdtype).view(t.shape))
            if bar is not None:
                bar.update(nbytes)
        batches.flush()
        if routed:
            model.load_state_dict(routed, strict=False)
    finally:
        if bar is not None:
            bar.close()
    settle_engines()  # forget what device slots held before
    streamer = getattr(model, "_ramtorch_streamer", None)
    if streamer is not None:
        streamer.settle_disk()  # what went into units on disk: written there, out of memory
    if unwritten:
        model._ramtorch_unwritten = {  # type: ignore[assignment]
            n: (t, v) for n, (t, v) in unwritten.items() if t._version == v
        }
    return {
        "missing": missing,
        "unexpected": unexpected,
        "bytes": total,
        "seconds": time.perf_counter() - t0,
    }


def _shard_bytes(value: int | str) -> int:
    n = parse_bytes(value, "max_shard_size")
    if not n:
        raise ValueError(f"max_shard_size must be positive, got {value!r}")
    return n


def save(
    model: nn.Module,
    save_dir: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    progress: bool | None = None,
) -> list[str]:
    """Writes ``model``'s state dict as Hugging Face style safetensors file(s) in ``save_dir``.

    One file (``model.safetensors``) when everything fits in ``max_shard_size``, else shards
    ``model-00001-of-0000N.safetensors`` plus ``model.safetensors.index.json``. Each file is written
    under a temporary name in ``save_dir``, flushed to disk and renamed; the index comes last, so a
    reader never sees an index naming incomplete shards. Tensors that several names share (tied
    weights) are written once, under their first name. Shards and an index from an earlier save
    that this one does not rewrite are removed. A transformers model also gets its
    ``config.json`` (and ``generation_config.json`` if it generates), so that ``from_pretrained`` of
    ``save_dir`` builds it. Returns the names of the files written.

    Tensors are written straight from their memory (device tensors through host memory in
    chunks), so saving holds no second copy of a shard. ``progress``: a progress bar over bytes
    (default: when saving more than 1 GiB).
    """
    limit = _shard_bytes(max_shard_size)
    out = Path(save_dir)
    out.mkdir(parents=True, exist_ok=True)

    sd = model.state_dict()
    seen: dict[tuple[Any, ...], str] = {}
    items: list[tuple[str, torch.Tensor]] = []
    for name, t in sd.items():
        key: tuple[Any, ...] = (id(t),)
        if t.numel() > 0:
            key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if key in seen:
            continue  # tied: recorded under its first name only
        seen[key] = name
        check_storable("save_pretrained", name, t)
        items.append((name, t))

    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in items:
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += n

    count = len(shards)
    names = (
        [SINGLE_NAME]
        if count == 1
        else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    )
    weight_map: dict[str, str] = {}
    total = sum(t.numel() * t.element_size() for _, t in items)
    bar = progress_bar(progress, total, "ramtorch.save_pretrained")
    tick: Callable[[int], None] = bar.update if bar is not None else (lambda n: None)
    try:
        for fname, shard in zip(names, shards):
            entries = [(name, t.detach()) for name, t in shard]
            head, _ = header(entries, {"format": "pt"})
            for name, _ in shard:
                weight_map[name] = fname

            def write(f: Any, head: bytes = head, entries: list = entries) -> None:
                write_file(f, head, entries, tick)

            write_atomic(out / fname, write, "ramtorch.save_pretrained")
    finally:
        if bar is not None:
            bar.close()

    stale = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
    if count > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        text = (json.dumps(index, indent=2) + "\n").encode()
        write_atomic(out / INDEX_NAME, lambda f: f.write(text), "ramtorch.save_pretrained")
        (out / SINGLE_NAME).unlink(missing_ok=True)
    else:
        (out / INDEX_NAME).unlink(missing_ok=True)
    for f in out.iterdir():
        if stale.fullmatch(f.name) and f.name not in names:
            f.unlink()
    names += _write_configs(model, out)
    fsync_dir(out)
    return names


def _write_configs(model: nn.Module, out: Path) -> list[str]:
    """A transformers model's ``config.json`` (with its class as the architecture and its weights'
    dtype, as its ``save_pretrained`` writes them) and, if it generates, ``generation_config.json``:
    then ``from_pretrained`` of the folder builds the same model. Nothing for other models."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "to_json_string", None)):
        return []
    config = copy.deepcopy(config)
    cls = type(model).__dict__.get("_ramtorch_base_class", type(model))
    config.architectures = [cls.__name__]
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if dtype is not None:
        config.dtype = str(dtype).split(".")[1]
    written = []
    files = [("config.json", config)]
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        files.append(("generation_config.json", generation))
    for fname, cfg in files:
        text = cfg.to_json_string(use_diff=True).encode()
        write_atomic(out / fname, lambda f, text=text: f.write(text), "ramtorch.save_pretrained")
        written.append(fname)
    return written
