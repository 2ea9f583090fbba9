"""The file formats ramtorch writes and reads, specified here once, and the one writer of them.

Both are standard safetensors files (any safetensors reader opens them):

- 8 bytes: ``N``, the header's length, little-endian unsigned;
- ``N`` bytes: the header, a UTF-8 JSON object (padded with spaces to a multiple of 8 bytes): for
  each tensor ``"<name>": {"dtype": "F32", "shape": [..], "data_offsets": [start, end]}`` (offsets
  counted from the end of the header), and ``"__metadata__"``, a string → string object;
- the tensors' bytes, little-endian, C order, one after the other with no gap and no overlap,
  largest element size first (so that each tensor is aligned to its element size), ending at the
  end of the file.

Readers accept a header of at most 100 MiB with no key given twice, at most 64 dimensions per
tensor, shapes whose byte counts neither overflow nor disagree with the offsets, offsets inside the
file that tile the data section exactly, and only regular files (never a FIFO or a device). The file
is opened once and read with positioned reads, never memory-mapped. An index of shards with a key
given twice is refused too.

**Pretrained weights** (:func:`ramtorch.save_pretrained` / :func:`ramtorch.load`) use the Hugging
Face layout: ``model.safetensors``, or shards ``model-00001-of-0000N.safetensors`` plus
``model.safetensors.index.json`` (``{"metadata": {"total_size": n}, "weight_map": {key: shard}}``,
shard names being plain file names in the same directory). Metadata: ``{"format": "pt"}``. Tensors
that several names share (tied weights) are written once, under their first name.

**Checkpoints** (:func:`ramtorch.save_checkpoint` / :func:`ramtorch.load_checkpoint`), format
version :data:`FORMAT_VERSION` (``1``), one file:

- ``model.<key>``: each tensor of ``model.state_dict()``. A tensor that is the same memory as
  another one (tied weights) is written once; the other keys are listed in the ``ramtorch.aliases``
  metadata entry and restored on load.
- ``optim.<path>``: the tensors of ``optimizer.state_dict()``, e.g. ``optim.state.0.exp_avg``
  (per-parameter state) or ``optim.param_groups.0.lr`` (a tensor learning rate).
- ``extra.<path>``: tensors found in ``extra``.
- ``rng.cpu``, ``rng.cuda.<i>``: torch's generator states (1-d ``uint8`` tensors).
- metadata (strings): ``format`` (``"pt"``), ``ramtorch.checkpoint`` (the format version, ``"1"``),
  ``ramtorch.torch`` (torch's version when saved), and JSON entries:

  - ``ramtorch.model``: ``{"keys": [state-dict keys in order], "objects": {key: value}}`` (values
    of the state dict that are not tensors, e.g. a module's extra state);
  - ``ramtorch.optimizer``: the optimizer's state dict (absent when saved without an optimizer);
  - ``ramtorch.extra``: the ``extra`` dict;
  - ``ramtorch.rng``: ``{"cpu": "rng.cpu", "cuda": ["rng.cuda.0", ...]}`` (absent with ``rng=False``);
  - ``ramtorch.aliases``: ``{alias key: key of the tensor written}``.

  In those JSON values a tensor is ``{"__tensor__": key}``, a tuple ``{"__tuple__": [...]}``, a dict
  with keys other than strings ``{"__dict__": [[key, value], ...]}``, a non-finite float
  ``{"__float__": "inf"}``, a dtype ``{"__dtype__": "float32"}``, a device ``{"__device__": "cpu"}``.
  Values nest at most 60 levels deep (writers refuse more; readers refuse JSON nested more than
  200 levels).

A reader refuses a checkpoint whose version it does not know. A change of the layout that an older
reader would misread takes a new version number.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Callable
from typing import IO, Any

import torch

from ._dtypes import TORCH_TO_ST

__all__ = ["FORMAT_VERSION", "VERSION_KEY", "check_storable", "header", "write_file"]

#: Version of the checkpoint layout above; written as the ``ramtorch.checkpoint`` metadata entry.
FORMAT_VERSION = 1
#: The metadata entry that holds :data:`FORMAT_VERSION`.
VERSION_KEY = "ramtorch.checkpoint"
#: Bytes copied per write (and per device-to-host copy) while saving.
_CHUNK = 64 << 20


def nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements."""
    return t.numel() * t.element_size()


def alias_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Two tensors with the same key hold the same values (same memory, same view)."""
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


def _write_chunk(f: IO[bytes], chunk: torch.Tensor) -> None:
    """Writes the bytes of a contiguous CPU tensor, without copying them."""
    n = nbytes(chunk)
    if n:
        f.write(memoryview((ctypes.c_char * n).from_address(chunk.data_ptr())))


def _write_tensor(f: IO[bytes], t: torch.Tensor, tick: Callable[[int], None]) -> None:
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1)
    step = max(1, _CHUNK // max(1, t.element_size()))
    for start in range(0, flat.numel(), step):
        chunk = flat[start : start + step]
        if chunk.device.type != "cpu":
            chunk = chunk.to("cpu")
        _write_chunk(f, chunk)
        tick(nbytes(chunk))


def header(entries: list[tuple[str, torch.Tensor]], meta: dict[str, str]) -> tuple[bytes, int]:
    """The safetensors header of ``entries`` (sorted in place: largest elements first, so that
    every tensor is aligned to its element size), padded to 8 bytes, and the data's length."""
    entries.sort(key=lambda e: (-e[1].element_size(), e[0]))
    head: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for key, t in entries:
        n = nbytes(t)
        head[key] = {
            "dtype": TORCH_TO_ST[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    text = json.dumps(head, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8), offset


def write_file(
    f: IO[bytes], head: bytes, entries: list[tuple[str, torch.Tensor]], tick: Callable[[int], None]
) -> None:
    """Writes a safetensors file: ``head`` (from :func:`header`), then each tensor straight from
    its memory (device tensors through host memory in chunks): no copy of the whole."""
    f.write(len(head).to_bytes(8, "little"))
    f.write(head)
    with torch.no_grad():
        for _, t in entries:
            _write_tensor(f, t, tick)


def check_storable(what: str, key: str, t: torch.Tensor) -> None:
    """Raises ``TypeError`` naming ``key`` unless safetensors can store ``t``."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        raise TypeError(
            f"{what}: {key!r} is a {type(t).__module__}.{type(t).__qualname__} (a tensor subclass, "
            "such as a quantized weight), which a safetensors file of plain tensors cannot hold: "
            "save the model with torch.save(model.state_dict(), path), or save only what you "
            "trained (LoRA adapters: peft's save_pretrained)"
        )
    if t.layout != torch.strided:
        raise TypeError(f"{what}: {key!r} is a {t.layout} tensor; only dense tensors can be saved")
    if t.dtype not in TORCH_TO_ST:
        raise TypeError(f"{what}: {key!r} has dtype {t.dtype}, which safetensors cannot store")
    if t.device.type == "meta":
        raise TypeError(f"{what}: {key!r} is on the meta device (no data to save)")
