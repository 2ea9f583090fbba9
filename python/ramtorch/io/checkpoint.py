"""Checkpoints of a model, its optimizer and the RNG states, as one safetensors file written atomically.

The layout of the file and its version are specified in :mod:`ramtorch.io.format`.

Saving never holds a second copy of the model: tensors are written one by one, straight from their
memory (device tensors pass through host memory in chunks). The file is written under a temporary
name in the target's directory, flushed, ``fsync``-ed and renamed over the target, so a crash at any
point leaves the previous checkpoint intact.

Loading opens the file once: its header, metadata and tensors are all read from that one open file
(with positioned reads, never through a mapping), so a checkpoint renamed over the path meanwhile
is not mixed in. It does not hold a second copy either. Host tensors of modules that load the standard way
(no ``_load_from_state_dict`` of their own, no load hooks) are read straight into place by ramtorch's
reader, on all cores. A ``ramtorch.optim`` optimizer frees its host states before the new ones are
read into fresh host memory, which it then keeps as they are. Everything else goes through
``load_state_dict``. If reading fails part way (after the file was validated), load again: the
model and optimizer may hold a mix of old and new values, and the optimizer's host states may be
gone.
"""

from __future__ import annotations

import copy
import errno
import itertools
import json
import math
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .. import _arena, _engine
from ._dtypes import torch_dtype
from ._files import write_atomic
from ._progress import progress_bar
from ._reader import Batches, SafetensorsReader, plain_loading, settle_engines
from .format import FORMAT_VERSION, VERSION_KEY, alias_key, check_storable, header, write_file

__all__ = ["FORMAT_VERSION", "CheckpointError", "load_checkpoint", "save_checkpoint"]

_VERSION_KEY = VERSION_KEY


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be read, or that does not match the model or optimizer."""


# ---------------------------------------------------------------------------------------------
# Non-tensor values <-> JSON. Tensors found on the way are stored as file tensors and referenced.

_MARKERS = ("__tensor__", "__tuple__", "__dict__", "__float__", "__dtype__", "__device__")
#: Deepest nesting of values saved (each level is at most three levels of JSON, well within what
#: loading accepts: _MAX_JSON_DEPTH).
_MAX_VALUE_DEPTH = 60


class _Encoder:
    """Turns nested Python values into JSON-able ones, collecting the tensors found in them."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def _tensor_key(self, path: tuple[str, ...]) -> str:
        key = ".".join(path)
        for n in itertools.count(1):
            if key not in self.tensors:
                return key
            key = f"{'.'.join(path)}~{n}"
        raise AssertionError("unreachable")

    def encode(self, obj: Any, path: tuple[str, ...]) -> Any:
        if len(path) > _MAX_VALUE_DEPTH:
            raise TypeError(
                f"save_checkpoint: {'.'.join(path[:4])}…: values nested more than {_MAX_VALUE_DEPTH} "
                "levels deep cannot be stored"
            )
        if isinstance(obj, torch.Tensor):
            key = self._tensor_key(path)
            self.tensors[key] = obj.detach()
            return {"__tensor__": key}
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            return float(obj) if math.isfinite(obj) else {"__float__": repr(float(obj))}
        if isinstance(obj, torch.dtype):
            return {"__dtype__": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"__device__": str(obj)}
        if isinstance(obj, tuple):
            return {"__tuple__": [self.encode(v, (*path, str(i))) for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [self.encode(v, (*path, str(i))) for i, v in enumerate(obj)]
        if isinstance(obj, Mapping):
            if all(isinstance(k, str) for k in obj) and not any(k in _MARKERS for k in obj):
                return {k: self.encode(v, (*path, k)) for k, v in obj.items()}
            return {
                "__dict__": [
                    [self.encode(k, (*path, "key")), self.encode(v, (*path, str(k)))] for k, v in obj.items()
                ]
            }
        if type(obj).__module__ == "numpy" and getattr(obj, "ndim", None) == 0:  # numpy scalars
            return self.encode(obj.item(), path)
        raise TypeError(
            f"save_checkpoint: cannot store {'.'.join(path)!r} of type {type(obj).__name__}: checkpoints "
            "hold tensors, None, bool, int, float, str, dtypes, devices and lists, tuples and dicts of those"
        )


def _decode(obj: Any, tensor: Callable[[str], torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensor) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        ((k, v),) = obj.items()
        if k == "__tensor__":
            return tensor(v)
        if k == "__tuple__":
            return tuple(_decode(x, tensor) for x in v)
        if k == "__dict__":
            return {_decode(a, tensor): _decode(b, tensor) for a, b in v}
        if k == "__float__":
            return float(v)
        if k == "__dtype__":
            dtype = getattr(torch, v, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown dtype {v!r}")
            return dtype
        if k == "__device__":
            return torch.device(v)
    return {k: _decode(v, tensor) for k, v in obj.items()}


# ---------------------------------------------------------------------------------------------
# Writing


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
    rng: bool = True,
    progress: bool | None = None,
) -> None:
    """Writes ``model``'s state dict, ``optimizer``'s state and ``extra`` to one safetensors file.

    The file is written to a temporary file next to ``path`` (``.<name>.<pid>.<random>.tmp``),
    flushed, ``fsync``-ed, renamed over ``path`` and the directory ``fsync``-ed: ``path`` holds either
    the previous checkpoint or the new one, whole, even if the process is killed while saving. On an
    exception the temporary file is removed; a temporary file left by a killed process is removed by
    the next save of the same ``path``.

    Args:
        path: the checkpoint file (conventionally ``*.safetensors``); its directory must exist.
        model: any ``nn.Module``; its ``state_dict()`` is saved (parameters and persistent buffers,
            wherever they live: host arena, CPU or GPU; device tensors are copied to the host in
            chunks). Tied tensors are written once.
        optimizer: optional optimizer whose ``state_dict()`` has the standard ``{"state",
            "param_groups"}`` form (any ``torch.optim`` optimizer); tensors of its state are stored
            as tensors, the rest (hyperparameters, ints, floats) as JSON.
        extra: optional dict of your own values (step, epoch, scheduler or data-loader state…):
            ``None``, bool, int, float, str, tensors, and lists/tuples/dicts of those. Returned by
            :func:`load_checkpoint`.
        rng: also save torch's CPU generator state and, when CUDA is available, every device's
            generator state, so that a resumed run draws the same random numbers (dropout…).
        progress: show a progress bar on stderr while writing (default: for checkpoints of more
            than 1 GiB of tensors).

    Raises:
        TypeError: ``extra`` (or the optimizer state) holds a value that cannot be stored, or a
            tensor has a dtype safetensors cannot represent. Nothing is written then.
    """
    path = os.fspath(path)
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"save_checkpoint: extra must be a dict or None, got {type(extra).__name__}")

    # 1. Everything to write, before touching the file system.
    tensors: dict[str, torch.Tensor] = {}
    objects: dict[str, Any] = {}
    enc = _Encoder(tensors)
    _engine.wait_updates()  # updates a pipelined optimizer step still runs
    sd = model.state_dict()
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            tensors[f"model.{k}"] = v.detach()
        else:  # e.g. a module's get_extra_state()
            objects[k] = enc.encode(v, ("model_objects", k))
    meta: dict[str, str] = {
        "format": "pt",
        _VERSION_KEY: str(FORMAT_VERSION),
        "ramtorch.torch": torch.__version__,
        "ramtorch.model": json.dumps({"keys": list(sd.keys()), "objects": objects}, allow_nan=False),
        "ramtorch.extra": json.dumps(enc.encode(dict(extra or {}), ("extra",)), allow_nan=False),
    }
    if optimizer is not None:
        osd = optimizer.state_dict()
        meta["ramtorch.optimizer"] = json.dumps(enc.encode(osd, ("optim",)), allow_nan=False)
    if rng:
        rng_keys: dict[str, Any] = {"cpu": "rng.cpu", "cuda": []}
        tensors["rng.cpu"] = torch.get_rng_state()
        if torch.cuda.is_available():
            for i, state in enumerate(torch.cuda.get_rng_state_all()):
                tensors[f"rng.cuda.{i}"] = state
                rng_keys["cuda"].append(f"rng.cuda.{i}")
        meta["ramtorch.rng"] = json.dumps(rng_keys)

    # 2. Tied tensors are written once; the other names become aliases.
    canonical: dict[tuple[Any, ...], str] = {}
    aliases: dict[str, str] = {}
    entries: list[tuple[str, torch.Tensor]] = []
    for key, t in tensors.items():
        check_storable("save_checkpoint", key, t)
        ak = alias_key(t)
        if ak in canonical:
            aliases[key] = canonical[ak]
        else:
            canonical[ak] = key
            entries.append((key, t))
    meta["ramtorch.aliases"] = json.dumps(aliases)

    # 3. Header.
    head, total = header(entries, meta)

    # 4. Temporary file, fsync, rename, fsync the directory.
    bar = progress_bar(progress, total, "ramtorch.save_checkpoint")
    tick: Callable[[int], None] = bar.update if bar is not None else (lambda n: None)
    try:
        write_atomic(path, lambda f: write_file(f, head, entries, tick), "save_checkpoint")
    finally:
        if bar is not None:
            bar.close()


# ---------------------------------------------------------------------------------------------
# Reading


def _fmt_keys(keys: list[str], limit: int = 20) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f", … ({len(keys) - limit} more)" if len(keys) > limit else "")


#: Deepest nesting of lists and objects accepted in a metadata entry (what save_checkpoint writes
#: stays far below: values nested at most _MAX_VALUE_DEPTH deep).
_MAX_JSON_DEPTH = 200


def _json_depth(obj: Any) -> int:
    """How deep lists and dicts nest in ``obj`` (without recursion)."""
    deepest = 0
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            o = list(o.values())
        if isinstance(o, list):
            deepest = max(deepest, d)
            if d <= _MAX_JSON_DEPTH:
                stack.extend((v, d + 1) for v in o)
    return deepest


def _json_meta(path: str, meta: Mapping[str, str], key: str, default: Any = None) -> Any:
    if key not in meta:
        return default
    try:
        value = json.loads(meta[key])
    except RecursionError:
        value = None
    except ValueError as e:
        raise CheckpointError(f"{path}: metadata entry {key!r} is not valid JSON ({e})") from e
    else:
        if _json_depth(value) <= _MAX_JSON_DEPTH:
            return value
    raise CheckpointError(
        f"{path}: metadata entry {key!r} is nested more than {_MAX_JSON_DEPTH} levels deep (corrupt?)"
    )


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    map_rng: bool = True,
    strict: bool = True,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Loads a checkpoint written by :func:`save_checkpoint` into ``model`` (and ``optimizer``).

    The file is checked first, before the model or optimizer is touched: it must be a complete
    safetensors file with a known format version; with ``strict`` its keys must be exactly the
    model's state-dict keys; every tensor must have the shape of the model's; the optimizer's
    parameter groups must have the saved sizes; every metadata entry must be well formed (JSON nested
    at most 200 levels deep, tensor references that name tensors of the file) and each saved RNG
    state one that torch's generators accept; the optimizer state must be one the optimizer's own
    ``load_state_dict`` accepts (tried on a throwaway twin of the optimizer, without its memory).
    Then the values are copied into the model's existing tensors with ``model.load_state_dict``
    (parameters keep their storage, e.g. ramtorch's host arena, and their identity, so an optimizer
    built on them stays valid), the optimizer state is loaded with ``optimizer.load_state_dict``
    and, with ``map_rng``, the RNG states are restored.

    Args:
        path: the checkpoint file.
        model: the model to load into, built like the saved one.
        optimizer: optional optimizer over ``model``'s parameters to restore; the checkpoint must
            contain optimizer state then (with ``strict=False`` a checkpoint without it only warns).
        map_rng: restore the saved torch RNG states (CPU, and each CUDA device present in both the
            checkpoint and this process).
        strict: require the checkpoint's model keys to match ``model.state_dict()`` exactly (as in
            ``load_state_dict``); with ``False`` missing and unexpected keys are skipped.
        progress: show a progress bar on stderr while reading (default: for checkpoints of more than
            1 GiB of tensors).

    Returns:
        The ``extra`` dict given to :func:`save_checkpoint` (``{}`` if none).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: the file is not a readable checkpoint (truncated, corrupt, unknown
            version) or does not match the model/optimizer (keys, shapes, parameter groups).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, "load_checkpoint: no such checkpoint file", path)
    # The one open of the file: the header, the metadata and every tensor are read through this
    # handle, so a file renamed over ``path`` meanwhile is not mixed in.
    try:
        handle = SafetensorsReader(path, CheckpointError)
    except (ValueError, RuntimeError) as e:
        why = "" if "not a regular file" in str(e) else " (truncated or corrupt?)"
        raise CheckpointError(f"{path} is not a readable safetensors checkpoint{why}: {e}") from e
    # Weights a failed optimizer update left half written are about to be replaced; they stay
    # flagged if the load fails.
    failed = _engine.discard_failed_updates(model.parameters())
    forget = getattr(optimizer, "_forget_failed", None)
    if forget is not None:
        forget()  # the optimizer state is replaced too
    try:
        return _load(path, handle, model, optimizer, map_rng=map_rng, strict=strict, progress=progress)
    except BaseException:
        _engine.restore_failed_updates(failed)
        raise


def _load(
    path: str,
    f: SafetensorsReader,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    map_rng: bool,
    strict: bool,
    progress: bool | None,
) -> dict[str, Any]:
    meta = f.metadata() or {}
    version = meta.get(_VERSION_KEY)
    if version is None:
        raise CheckpointError(
            f"{path} is a safetensors file but not a ramtorch checkpoint (no {_VERSION_KEY!r} metadata entry)"
        )
    if version != str(FORMAT_VERSION):
        raise CheckpointError(
            f"{path}: unknown checkpoint format version {version!r} "
            f"(this ramtorch reads version {FORMAT_VERSION})"
        )
    file_keys = set(f.keys())
    aliases: dict[str, str] = _json_meta(path, meta, "ramtorch.aliases", {})
    if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
        raise CheckpointError(f"{path}: metadata entry 'ramtorch.aliases' is malformed")
    model_meta = _json_meta(path, meta, "ramtorch.model")
    if (
        not isinstance(model_meta, dict)
        or not isinstance(model_meta.get("keys"), list)
        or not all(isinstance(k, str) for k in model_meta["keys"])
    ):
        raise CheckpointError(f"{path}: metadata entry 'ramtorch.model' is missing or malformed")
    objects: dict[str, Any] = model_meta.get("objects", {})
    if not isinstance(objects, dict):
        raise CheckpointError(f"{path}: metadata entry 'ramtorch.model' is malformed")

    def resolve(key: str) -> str:
        if not isinstance(key, str):
            raise CheckpointError(f"{path}: a tensor reference in the metadata is not a string: {key!r}")
        key = aliases.get(key, key)
        if key not in file_keys:
            raise CheckpointError(f"{path}: tensor {key!r} named in the metadata is not in the file")
        return key

    shapes = {key: f.shape(key) for key in file_keys}
    nbytes = {key: f.nbytes(key) for key in file_keys}

    # Model: keys and shapes.
    saved_keys: list[str] = model_meta["keys"]
    current = model.state_dict()
    current_keys = set(current)
    saved_set = set(saved_keys)
    missing = [k for k in current if k not in saved_set]
    unexpected = [k for k in saved_keys if k not in current]
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing keys (in the model, not in the checkpoint): {_fmt_keys(missing)}")
        if unexpected:
            parts.append(f"unexpected keys (in the checkpoint, not in the model): {_fmt_keys(unexpected)}")
        raise CheckpointError(f"{path} does not match the model: " + "; ".join(parts))
    mismatched = []
    for k in saved_keys:
        if k not in current:
            continue
        cur = current[k]
        if k in objects:
            if isinstance(cur, torch.Tensor):
                mismatched.append(f"{k!r}: checkpoint holds a non-tensor value, the model a tensor")
            continue
        fk = resolve(f"model.{k}")
        if not isinstance(cur, torch.Tensor):
            mismatched.append(f"{k!r}: checkpoint holds a tensor, the model a {type(cur).__name__}")
        elif tuple(cur.shape) != shapes[fk]:
            mismatched.append(
                f"{k!r}: shape {list(shapes[fk])} in the checkpoint, {list(cur.shape)} in the model"
            )
    if mismatched:
        raise CheckpointError(f"{path} does not match the model: " + "; ".join(mismatched))
    del current

    def check(entry: str, obj: Any) -> tuple[Any, list[str]]:
        """Decodes ``obj`` with tensors left as their keys: checks its form and its references."""
        refs: list[str] = []

        def ref(key: str) -> str:
            refs.append(resolve(key))
            return key

        try:
            return _decode(obj, ref), refs
        except (ValueError, TypeError, AttributeError, RecursionError) as e:
            raise CheckpointError(f"{path}: metadata entry {entry!r} is malformed ({e!r})") from e

    # Optimizer: state present, same parameter groups.
    optim_meta = None
    optim_refs: list[str] = []
    if optimizer is not None:
        optim_meta = _json_meta(path, meta, "ramtorch.optimizer")
        if optim_meta is None:
            if strict:
                raise CheckpointError(f"{path} holds no optimizer state (saved without an optimizer)")
            warnings.warn(
                f"load_checkpoint: {path} holds no optimizer state; optimizer left as is", stacklevel=3
            )
        else:
            skeleton, optim_refs = check("ramtorch.optimizer", optim_meta)
            groups = skeleton.get("param_groups") if isinstance(skeleton, dict) else None
            states = skeleton.get("state") if isinstance(skeleton, dict) else None
            if (
                not isinstance(groups, list)
                or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
                or not isinstance(states, dict)
                or not all(isinstance(v, dict) for v in states.values())
            ):
                raise CheckpointError(f"{path}: metadata entry 'ramtorch.optimizer' is malformed")
            saved_sizes = [len(g["params"]) for g in groups]
            sizes = [len(g["params"]) for g in optimizer.param_groups]
            if saved_sizes != sizes:
                raise CheckpointError(
                    f"{path} does not match the optimizer: parameter groups of sizes {saved_sizes} in the "
                    f"checkpoint, {sizes} in the optimizer"
                )
            ids = [i for g in groups for i in g["params"]]
            if (
                not all(type(i) is int for i in ids)
                or len(set(ids)) != len(ids)
                or not set(states) <= set(ids)
            ):
                raise CheckpointError(
                    f"{path}: metadata entry 'ramtorch.optimizer' is malformed (parameter ids of the groups "
                    "are not distinct integers covering the saved states)"
                )
            check_states = getattr(optimizer, "_check_state_dict", None)
            if check_states is not None:  # each state against its parameter, before any is read

                def described(key: str) -> torch.Tensor:  # shape and dtype, no data
                    key = resolve(key)
                    dtype = torch_dtype(f.dtype(key)) or torch.uint8
                    return torch.empty(shapes[key], dtype=dtype, device="meta")

                check_states(_decode(optim_meta, described))
            if getattr(optimizer, "_load_state_dict_adopting", None) is None:
                _try_optimizer_state(path, f, optimizer, optim_meta, resolve)
    extra_meta = _json_meta(path, meta, "ramtorch.extra", {})
    _, extra_refs = check("ramtorch.extra", extra_meta)
    _, object_refs = check("ramtorch.model", {k: v for k, v in objects.items() if k in current_keys})
    rng_meta = _json_meta(path, meta, "ramtorch.rng") if map_rng else None
    rng_states = (
        _read_rng(path, rng_meta, lambda k: f.get_tensor(resolve(k))) if rng_meta is not None else None
    )

    # Everything checked: read.
    load_keys = [k for k in saved_keys if k in current_keys]
    model_bytes = {k: nbytes[resolve(f"model.{k}")] for k in load_keys if k not in objects}
    total = sum(model_bytes.values()) + sum(nbytes[r] for r in optim_refs + extra_refs + object_refs)
    bar = progress_bar(progress, total, "ramtorch.load_checkpoint")
    try:

        def clone(key: str) -> torch.Tensor:
            key = resolve(key)
            t = f.get_tensor(key)
            if bar is not None:
                bar.update(nbytes[key])
            return t

        settle_engines()  # queued copies of the weights finish before we overwrite them
        reader = _DirectReader(f, bar)
        # Host tensors of modules that load the standard way are read straight into place, on all
        # cores; the rest go through load_state_dict.
        direct = reader.plan_model(model, {k: resolve(f"model.{k}") for k in load_keys if k not in objects})
        state: dict[str, Any] = {}
        for k in load_keys:
            if k in direct:
                continue
            if k in objects:
                state[k] = _decode(objects[k], clone)
            else:  # read here: load_state_dict copies them into the parameters
                state[k] = f.get_tensor(resolve(f"model.{k}"))
        # ramtorch's optimizers take their host states as read here, into fresh host memory, once
        # the old ones are gone: the process holds one copy of the optimizer state, not three.
        adopt = getattr(optimizer, "_load_state_dict_adopting", None)
        optim_state = None
        if optimizer is not None and optim_meta is not None and adopt is not None:
            optimizer._drop_host_states()  # type: ignore[union-attr]
            kept = optimizer._kept_state_indices()  # type: ignore[union-attr]

            def optim_tensor(key: str) -> torch.Tensor:
                # A sharded optimizer keeps its own share: the others' states are not read.
                parts = key.split(".")
                if kept is not None and parts[:2] == ["optim", "state"] and parts[2].isdigit():
                    if int(parts[2]) not in kept:
                        return torch.empty(0)
                return reader.fresh(resolve(key))

            optim_state = _decode(optim_meta, optim_tensor)
        reader.run()
        for t in direct.values():
            torch.autograd.graph.increment_version(t)  # slot caches key on versions
        with _ModelProgress(model, bar, {k: v for k, v in model_bytes.items() if k not in direct}):
            model.load_state_dict(state, strict=strict and not direct)
        del state

        if optim_state is not None:
            adopt(optim_state)
        elif optimizer is not None and optim_meta is not None:
            optimizer.load_state_dict(_decode(optim_meta, clone))
        extra = _decode(extra_meta, clone)
        if rng_states is not None:
            _restore_rng(path, *rng_states)
    finally:
        if bar is not None:
            bar.close()
    return extra if isinstance(extra, dict) else {}


def _try_optimizer_state(
    path: str, f: SafetensorsReader, optimizer: torch.optim.Optimizer, optim_meta: Any, resolve: Callable
) -> None:
    """Loads the saved optimizer state into a throwaway twin of ``optimizer`` (tensors stood in for
    by scalars of their dtype: no memory, on any device), so that a state the optimizer's own
    ``load_state_dict`` refuses is a :class:`CheckpointError` before anything is written."""
    try:
        twin = copy.copy(optimizer)  # its own state and groups; parameters shared, hooks not copied
    except Exception:  # noqa: BLE001 - an optimizer that cannot be copied is loaded untried
        return

    def stand_in(key: str) -> torch.Tensor:
        key = resolve(key)
        dtype = torch_dtype(f.dtype(key))
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {key!r} has dtype {f.dtype(key)}, which torch cannot hold")
        return torch.zeros((), dtype=dtype)  # torch's loading reads no shape; moved to the device: tiny

    try:
        twin.load_state_dict(_decode(optim_meta, stand_in))
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the optimizer raises, named
        raise CheckpointError(
            f"{path}: the saved optimizer state does not load into {type(optimizer).__name__} ({e!r})"
        ) from e


class _DirectReader:
    """Reads checkpoint tensors straight into host memory with ramtorch's reader: positioned reads
    on all cores, batched; no mapping of the file, no intermediate copy."""

    def __init__(self, f: SafetensorsReader, bar: Any) -> None:
        self.f, self.bar = f, bar
        self.jobs: list[tuple[str, torch.Tensor | int, int, str]] = []
        self.fresh_cache: dict[str, torch.Tensor] = {}

    def _dtype(self, key: str) -> tuple[str, torch.dtype | None]:
        st = self.f.dtype(key)
        return st, torch_dtype(st)

    def plan_model(self, model: nn.Module, keys: dict[str, str]) -> dict[str, torch.Tensor]:
        """Queues the tensors of ``keys`` (state-dict key → file key) that can be read straight into
        the model: contiguous host tensors of plain type and the file's dtype, of modules that load
        plainly, not overlapping another destination. Returns them by state-dict key."""
        plain = plain_loading(model)
        dests: dict[str, torch.Tensor] = {}
        for prefix, module in model.named_modules(remove_duplicate=False):
            if not plain(prefix):
                continue  # its own loading or load hooks: left to load_state_dict
            dot = prefix + "." if prefix else ""
            for name, t in itertools.chain(module._parameters.items(), module._buffers.items()):
                key = dot + name
                if t is None or key not in keys or type(t) not in (torch.Tensor, nn.Parameter):
                    continue
                if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
                    continue
                if self._dtype(keys[key])[1] != t.dtype:
                    continue
                dests[key] = t
        # One read per memory range (tied weights share one); ranges that partly overlap another
        # are left to load_state_dict.
        ranges: dict[tuple[int, int], list[str]] = {}
        for key, t in dests.items():
            ranges.setdefault((t.data_ptr(), t.numel() * t.element_size()), []).append(key)
        spans = sorted(ranges)
        clash: set[tuple[int, int]] = set()
        for a, b in zip(spans, spans[1:]):
            if a[0] + a[1] > b[0]:
                clash.update((a, b))
        out: dict[str, torch.Tensor] = {}
        for span, group in ranges.items():
            if span in clash:
                continue
            key = group[0]
            self.jobs.append((keys[key], dests[key], span[1], self._dtype(keys[key])[0]))
            for k in group:
                out[k] = dests[k]
        return out

    def fresh(self, key: str) -> torch.Tensor:
        """A new host tensor holding file tensor ``key`` once :meth:`run` has run (the same tensor
        for every reference to one key)."""
        t = self.fresh_cache.get(key)
        if t is not None:
            return t
        st, dtype = self._dtype(key)
        if dtype is None:
            t = self.f.get_tensor(key)
            if self.bar is not None:
                self.bar.update(t.numel() * t.element_size())
        else:
            shape = self.f.shape(key)
            n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            # Optimizer states: only the CPU touches them, so they need not be page-locked.
            big = n >= 1 << 20
            t = _arena.host_empty(shape, dtype, pin=False) if big else torch.empty(shape, dtype=dtype)
            if n:
                self.jobs.append((key, t, n, st))
        self.fresh_cache[key] = t
        return t

    def run(self) -> None:
        """Reads every queued tensor, in batches that all cores share."""
        batches = Batches(self.bar)
        for job in self.jobs:
            batches.add(self.f, job)
        batches.flush()
        self.jobs.clear()


class _ModelProgress:
    """Advances ``bar`` as ``load_state_dict`` reaches each module (by the bytes of its own keys)."""

    def __init__(self, model: nn.Module, bar: Any, nbytes: dict[str, int]) -> None:
        self.model, self.bar, self.nbytes = model, bar, nbytes
        self.handles: list[Any] = []
        self.pending = 0

    def _hook(self, module: nn.Module, state_dict: Any, prefix: str, *args: Any) -> None:
        self.bar.update(self.pending)
        own = itertools.chain(module._parameters, module._buffers)
        self.pending = sum(self.nbytes.get(prefix + n, 0) for n in own)

    def __enter__(self) -> _ModelProgress:
        if self.bar is not None:
            for m in self.model.modules():
                self.handles.append(m.register_load_state_dict_pre_hook(self._hook))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        if self.bar is not None and exc[0] is None:
            self.bar.update(self.pending)


def _read_rng(
    path: str, rng_meta: Any, tensor: Callable[[str], torch.Tensor]
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """The saved RNG states (CPU, then each CUDA device's), read and checked: each is one this
    process's generators accept. Raises :class:`CheckpointError` otherwise; changes nothing."""

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: metadata entry 'ramtorch.rng' is malformed ({why})")

    if not isinstance(rng_meta, dict):
        raise bad("not an object")
    cpu_key, cuda_keys = rng_meta.get("cpu"), rng_meta.get("cuda") or []
    if cpu_key is not None and not isinstance(cpu_key, str):
        raise bad("'cpu' is not a tensor name")
    if not isinstance(cuda_keys, list) or not all(isinstance(k, str) for k in cuda_keys):
        raise bad("'cuda' is not a list of tensor names")

    def checked(key: str, device: str) -> torch.Tensor:
        t = tensor(key)
        if t.dtype != torch.uint8 or t.dim() != 1:
            raise CheckpointError(
                f"{path}: RNG state {key!r} is a {t.dtype} tensor of shape {list(t.shape)}, "
                "not a 1-d uint8 tensor"
            )
        try:  # on a scratch generator: the global one is set only once everything is checked
            torch.Generator(device=device).set_state(t)
        except (RuntimeError, ValueError, TypeError) as e:
            raise CheckpointError(
                f"{path}: RNG state {key!r} is not a valid {device} generator state ({e})"
            ) from e
        return t

    cpu = checked(cpu_key, "cpu") if cpu_key else None
    cuda: list[torch.Tensor] = []
    if cuda_keys and torch.cuda.is_available():
        n = torch.cuda.device_count()
        if len(cuda_keys) != n:
            warnings.warn(
                f"load_checkpoint: {path} holds the RNG states of {len(cuda_keys)} CUDA devices, this "
                f"process sees {n}; restoring the first {min(n, len(cuda_keys))}",
                stacklevel=4,
            )
        cuda = [checked(k, f"cuda:{i}") for i, k in enumerate(cuda_keys[:n])]
    return cpu, cuda


def _restore_rng(path: str, cpu: torch.Tensor | None, cuda: list[torch.Tensor]) -> None:
    """Sets torch's generators to states checked by :func:`_read_rng`."""
    if cpu is not None:
        torch.set_rng_state(cpu)
    for i, state in enumerate(cuda):
        torch.cuda.set_rng_state(state, i)
