"""Loading and saving ``.safetensors`` checkpoints in place, without a second copy of the model.

:func:`load` opens each file once with ramtorch's reader, which validates its header first (offsets
in range, no overlaps, sizes consistent with shapes) and never maps the file, and copies each tensor
straight into the memory of the model's parameter or buffer, converting F32/BF16/F16 on the fly.
Parameters in host RAM (including those :func:`ramtorch.offload` keeps in its arena) are written
through their address; parameters on a GPU get their bytes through one reusable pinned staging
buffer.

:func:`save` writes the Hugging Face layout: ``model.safetensors``, or
``model-00001-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``, each file
written under a temporary name, flushed to disk and renamed, the index last.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import _arena, _core, _engine

__all__ = ["load", "save"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_GIB = 1 << 30
#: Bytes of the file copied per batch of tensors (the progress bar moves once a batch).
_BATCH_BYTES = 256 << 20

_TORCH_TO_ST: dict[torch.dtype, str] = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name, _st in [
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
    ("float8_e8m0fnu", "F8_E8M0"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
]:
    if hasattr(torch, _name):
        _TORCH_TO_ST[getattr(torch, _name)] = _st
_ST_TO_TORCH = {v: k for k, v in _TORCH_TO_ST.items()}
#: Conversions the Rust reader does while copying.
_NATIVE = {"F32", "F16", "BF16"}


def _read_regular(path: Path, what: str) -> bytes:
    """The bytes of ``path``, a regular file: anything else (a FIFO, which would block the open
    for ever, a device, a directory) is a ``ValueError`` naming it, checked on the open file."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{what}: {str(path)!r} is not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read()
    finally:
        os.close(fd)


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
        text = _read_regular(index, "ramtorch.load")
        try:
            weight_map = json.loads(text)["weight_map"]
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
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name, t in sd.items():
        key: tuple[Any, ...] = (id(t),)
        if t.numel() > 0:
            key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        groups.setdefault(key, []).append(name)
    return dict(sd), list(groups.values())


def plain_loading(model: nn.Module) -> Callable[[str], bool]:
    """Whether ``model.load_state_dict`` would only copy values into the parameters and buffers
    of the module at a given prefix ("" for the root), so that a loader may write them directly.
    Not where that module or one above it has its own ``_load_from_state_dict`` or load hooks,
    which may change any key below them, nor anywhere when the model overrides
    ``load_state_dict``."""
    if type(model).load_state_dict is not nn.Module.load_state_dict:
        return lambda prefix: False
    own = [
        prefix
        for prefix, m in model.named_modules(remove_duplicate=False)
        if type(m)._load_from_state_dict is not nn.Module._load_from_state_dict
        or m._load_state_dict_pre_hooks
        or m._load_state_dict_post_hooks
    ]

    def plain(prefix: str) -> bool:
        return not any(f == "" or prefix == f or prefix.startswith(f + ".") for f in own)

    return plain


def _progress_bar(total: int, progress: bool | None, desc: str = "ramtorch.load") -> Any:
    if progress is False or (progress is None and total <= _GIB):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)


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
        ``{"missing": [...], "unexpected": [...], "bytes": n, "seconds": t}``.

    Raises:
        RuntimeError: key mismatch (with ``strict``), shape mismatch, or a dtype that cannot be
            converted; nothing has been written then.
        ValueError: a file that is not valid safetensors (truncated, inconsistent header, ...).
        OSError: a file that cannot be opened.

    Tensors that several names share (tied weights) are filled once. Floating tensors are
    converted to each target's dtype (F32/BF16/F16 while copying; other pairs through torch).
    Modules with their own ``_load_from_state_dict`` or load hooks (and those below them) are
    given their tensors through ``model.load_state_dict``, as torch would: the rest is written
    in place directly.
    """
    t0 = time.perf_counter()
    # Weights a failed optimizer update left half written are about to be replaced; they stay
    # flagged if the load fails.
    failed = _engine.discard_failed_updates(model.parameters())
    try:
        return _load_into(model, path_or_dir, strict, progress, t0)
    except BaseException:
        _engine.restore_failed_updates(failed)
        raise


def _load_into(
    model: nn.Module, path_or_dir: str | os.PathLike[str], strict: bool, progress: bool | None, t0: float
) -> dict[str, Any]:
    from . import synchronize  # here, not at the top: ramtorch/__init__ imports this module

    synchronize()  # weights may be in flight to a device
    targets, groups = _targets(model)

    files = [(path, _core.SafetensorsFile(str(path)), keys) for path, keys in _resolve(path_or_dir)]
    source: dict[str, tuple[Any, str, tuple[int, ...]]] = {}
    for path, f, keys in files:
        entries = {name: (dtype, tuple(shape)) for name, dtype, shape in f.tensors()}
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
            source[name] = (f, dtype, shape)

    # Plan everything before writing anything.
    plan: list[tuple[str, torch.Tensor, Any, str]] = []
    missing: list[str] = []
    for names in groups:
        present = [n for n in names if n in source]
        if not present:
            missing.extend(names)
            continue
        name = present[0]
        t = targets[name]
        f, dtype, shape = source[name]
        if tuple(t.shape) != shape:
            raise RuntimeError(
                f"ramtorch.load: shape mismatch for {name!r}: the file ({f.path!r}) has {list(shape)}, "
                f"the model has {list(t.shape)}"
            )
        if dtype not in _ST_TO_TORCH:
            raise RuntimeError(f"ramtorch.load: {name!r} has dtype {dtype}, which torch cannot hold")
        plan.append((name, t, f, dtype))
    unexpected = sorted(set(source) - set(targets))
    if strict and (missing or unexpected):
        raise RuntimeError(
            "ramtorch.load: keys do not match the model"
            + (f"; missing from the checkpoint: {missing}" if missing else "")
            + (f"; unexpected in the checkpoint: {unexpected}" if unexpected else "")
        )

    total = sum(f.nbytes(name) for name, _, f, _ in plan)
    bar = _progress_bar(total, progress)
    # Tensors that go straight into host memory are copied in batches per file, which all cores
    # share (one tensor at a time leaves most of them idle); the rest go through a staging buffer.
    order = {id(f): i for i, (_, f, _) in enumerate(files)}
    plan.sort(key=lambda e: order[id(e[2])])
    staging: torch.Tensor | None = None
    batch: list[tuple[str, int, int, str]] = []
    batched: list[torch.Tensor] = []
    batch_file: Any = None
    batch_bytes = 0

    def flush() -> None:
        nonlocal batch_bytes
        if batch:
            batch_file.copy_many(batch)
            for t in batched:
                torch.autograd.graph.increment_version(t)  # slot caches key on versions
            if bar is not None:
                bar.update(batch_bytes)
        batch.clear()
        batched.clear()
        batch_bytes = 0

    plain = plain_loading(model)
    routed: dict[str, torch.Tensor] = {}  # for modules with their own loading: load_state_dict
    try:
        for name, t, f, dtype in plan:
            nbytes = f.nbytes(name)
            if not plain(name.rpartition(".")[0]):
                tmp = torch.empty(t.shape, dtype=_ST_TO_TORCH[dtype])
                f.copy_into(name, tmp.data_ptr(), nbytes, dtype)
                routed[name] = tmp
                if bar is not None:
                    bar.update(nbytes)
                continue
            want = _TORCH_TO_ST.get(t.dtype)
            native = want is not None and (want == dtype or (want in _NATIVE and dtype in _NATIVE))
            if t.numel() == 0:
                pass
            elif native and t.device.type == "cpu" and t.is_contiguous():
                if f is not batch_file:
                    flush()
                    batch_file = f
                batch.append((name, t.data_ptr(), t.numel() * t.element_size(), want))
                batched.append(t)
                batch_bytes += nbytes
                if batch_bytes >= _BATCH_BYTES:
                    flush()
                continue
            else:
                # Through the staging buffer: converted by Rust when it can, else by torch.
                sdtype = t.dtype if native else _ST_TO_TORCH[dtype]
                n = t.numel() * (t.element_size() if native else torch.empty(0, dtype=sdtype).element_size())
                if staging is None or staging.numel() < n:
                    staging = _arena.host_bytes(max(n, 1 << 20))
                f.copy_into(name, staging.data_ptr(), n, want if native else dtype)
                t.copy_(staging[:n].view(sdtype).view(t.shape))
            if bar is not None:
                bar.update(nbytes)
        flush()
        if routed:
            model.load_state_dict(routed, strict=False)
    finally:
        if bar is not None:
            bar.close()
    synchronize()  # forget what device slots held before
    return {
        "missing": missing,
        "unexpected": unexpected,
        "bytes": total,
        "seconds": time.perf_counter() - t0,
    }


def _shard_bytes(value: int | str) -> int:
    from ._offload import parse_bytes

    n = parse_bytes(value, "max_shard_size")
    if not n:
        raise ValueError(f"max_shard_size must be positive, got {value!r}")
    return n


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
    that this one does not rewrite are removed. Returns the names of the files written.

    Tensors are written straight from their memory (device tensors through host memory in
    chunks), so saving holds no second copy of a shard. ``progress``: a progress bar over bytes
    (default: when saving more than 1 GiB).
    """
    from .checkpoint import _check_storable, _header, _write_file

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
        _check_storable("save_pretrained", name, t)
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
    bar = _progress_bar(total, progress, "ramtorch.save_pretrained")
    tick: Callable[[int], None] = bar.update if bar is not None else (lambda n: None)
    try:
        for fname, shard in zip(names, shards):
            entries = [(name, t.detach()) for name, t in shard]
            head, _ = _header(entries, {"format": "pt"})
            for name, _ in shard:
                weight_map[name] = fname

            def write(p: Path, head: bytes = head, entries: list = entries) -> None:
                with open(p, "wb") as f:
                    _write_file(f, head, entries, tick)

            _write_atomic(out / fname, write)
    finally:
        if bar is not None:
            bar.close()

    stale = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
    if count > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_atomic(out / INDEX_NAME, lambda p: p.write_text(json.dumps(index, indent=2) + "\n"))
        (out / SINGLE_NAME).unlink(missing_ok=True)
    else:
        (out / INDEX_NAME).unlink(missing_ok=True)
    for f in out.iterdir():
        if stale.fullmatch(f.name) and f.name not in names:
            f.unlink()
    _fsync_dir(out)
    return names
