"""The one reader of safetensors files, shared by :func:`ramtorch.load` and
:func:`ramtorch.load_checkpoint`: a file opened once by ramtorch's Rust reader (header validated,
never mapped), whose tensors are copied straight into host memory in batches that all cores share."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import _core, _engine
from ._dtypes import torch_dtype

__all__ = ["Batches", "SafetensorsReader", "plain_loading", "settle_engines"]

#: Bytes of the file copied per batch of tensors (a progress bar moves once a batch).
BATCH_BYTES = 256 << 20


def settle_engines() -> None:
    """Waits for every copy the engines have queued and the updates still running, and makes the
    device slots forget what they hold: weights about to be written (or just written) in place
    are then neither in flight nor cached."""
    for e in _engine.engines():
        e.synchronize()
    _engine.wait_updates()


def other_format(path: str) -> str | None:
    """What ``path`` is when it is plainly not safetensors, judged by its first bytes: a zip
    archive (what ``torch.save`` writes), a pickle (older ``torch.save`` files, ``pickle.dump``),
    a GGUF or NumPy file, or anything whose JSON header does not start after the 8-byte length.
    ``None`` when it starts as safetensors does (or cannot be read: the caller's error stands)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        head = os.pread(fd, 16, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if head.startswith(b"PK\x03\x04"):
        return "it is a zip archive, as torch.save writes"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "it is a Python pickle, as older torch.save files are"
    if head.startswith(b"GGUF"):
        return "it is a GGUF file"
    if head.startswith(b"\x93NUMPY"):
        return "it is a NumPy .npy file"
    if len(head) >= 9 and head[8:9] != b"{":
        return "a safetensors file starts with the 8-byte length of a JSON header, then '{'"
    return None


class SafetensorsReader:
    """One ``.safetensors`` file, opened once: its header and metadata are read at opening, its
    tensors with positioned reads of that same open file (a file renamed over the path afterwards
    is not seen). Errors while reading tensors are raised as ``error``.

    Raises (on opening): ``OSError`` (e.g. ``FileNotFoundError``) if the file cannot be opened;
    ``ValueError`` if it is not a regular file or not valid safetensors."""

    def __init__(self, path: str | os.PathLike[str], error: type[Exception] = ValueError) -> None:
        self.path = os.fspath(path)
        self.error = error
        try:
            self.core = _core.SafetensorsFile(self.path)
        except ValueError as e:
            other = other_format(self.path)
            if other is None:
                raise
            if other.startswith("it is"):  # what the file is says more than how its header failed
                raise ValueError(
                    f"{self.path}: not a safetensors file ({other}). ramtorch reads safetensors "
                    "files only; load a torch.save file with model.load_state_dict(torch.load(path, "
                    "map_location='cpu')), or convert it once with safetensors.torch.save_file("
                    "torch.load(path), 'model.safetensors')"
                ) from e
            raise ValueError(f"not a safetensors file ({other}): {e}") from e
        self.entries: dict[str, tuple[str, tuple[int, ...]]] = {
            name: (dtype, tuple(shape)) for name, dtype, shape in self.core.tensors()
        }

    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` entries (``{}`` if none)."""
        return self.core.metadata() or {}

    def keys(self) -> list[str]:
        return list(self.entries)

    def dtype(self, key: str) -> str:
        """Safetensors dtype name of tensor ``key`` (``"F32"``, ...)."""
        return self.entries[key][0]

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key][1]

    def nbytes(self, key: str) -> int:
        """Bytes of tensor ``key`` in the file."""
        return self.core.nbytes(key)

    def get_tensor(self, key: str) -> torch.Tensor:
        """A new CPU tensor holding tensor ``key`` of the file."""
        st, shape = self.entries[key]
        dtype = torch_dtype(st)
        if dtype is None:
            raise self.error(f"{self.path}: tensor {key!r} has dtype {st}, which torch cannot hold")
        t = torch.empty(shape, dtype=dtype)
        n = self.core.nbytes(key)
        if n:
            self.copy_many([(key, t, n, st)])
        return t

    def copy_many(self, jobs: list[tuple[str, torch.Tensor | int, int, str]]) -> None:
        """Copies tensors ``(key, destination, bytes, dtype)`` on all cores (see ``_core``): the
        destination is a contiguous CPU tensor, or the address of host memory ramtorch allocated."""
        try:
            self.core.copy_many(jobs)
        except ValueError as e:  # e.g. the file was cut short since it was opened
            if self.error is ValueError:
                raise
            raise self.error(f"{self.path}: reading failed: {e}") from e


class Batches:
    """Copies of file tensors into host memory, run in batches of about :data:`BATCH_BYTES` per
    file that all cores share (one tensor at a time leaves most of them idle). ``bar`` (or None)
    advances by the file bytes of each batch; the version counter of each destination tensor given
    is bumped once it is written (device slot caches key on versions)."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.file: SafetensorsReader | None = None
        self.jobs: list[tuple[str, torch.Tensor | int, int, str]] = []
        self.written: list[torch.Tensor] = []
        self.size = 0

    def add(
        self,
        f: SafetensorsReader,
        job: tuple[str, torch.Tensor | int, int, str],
        dest: torch.Tensor | None = None,
    ) -> None:
        """Queues ``job`` (as :meth:`SafetensorsReader.copy_many`) of file ``f``."""
        if f is not self.file:
            self.flush()
            self.file = f
        self.jobs.append(job)
        if dest is not None:
            self.written.append(dest)
        self.size += f.nbytes(job[0])
        if self.size >= BATCH_BYTES:
            self.flush()

    def flush(self) -> None:
        """Runs the queued copies."""
        if self.jobs and self.file is not None:
            self.file.copy_many(self.jobs)
            for t in self.written:
                torch.autograd.graph.increment_version(t)
            if self.bar is not None:
                self.bar.update(self.size)
        self.jobs, self.written, self.size = [], [], 0


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
