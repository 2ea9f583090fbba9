"""Host arena memory seen by torch as ordinary CPU tensors (zero-copy, through DLPack)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import torch

from . import _core

_ALIGN = 64


def _warn_if_unpinned() -> None:
    # A UserWarning, shown by default (a ResourceWarning is hidden unless warnings are enabled):
    # pageable memory makes every copy to the GPU slower.
    msg = _core.take_pin_warning()
    if msg is not None:
        warnings.warn(msg, UserWarning, stacklevel=3)


def host_bytes(nbytes: int, zeroed: bool = False, pin: bool = True) -> torch.Tensor:
    """A 1-D ``uint8`` CPU tensor of exactly ``nbytes`` bytes of arena memory (page-locked when a
    GPU is present, unless ``pin`` is false: memory only the CPU touches). The memory goes back to
    the arena when the last view of it dies."""
    flat = torch.from_dlpack(_core.arena_alloc(int(nbytes), zeroed, pin))
    _warn_if_unpinned()
    return flat


def device_view(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Contiguous host tensor ``t`` (arena or shared memory, page-locked) as the kernels of CUDA
    ``device`` read it in place: a CUDA tensor of ``t``'s shape and dtype over the same bytes,
    read over the link by whatever kernel uses it (mapped host memory), which keeps ``t``'s
    memory alive. Raises where the memory is not page-locked and mapped (pinning refused, a disk
    store's mapping) or not ramtorch's (``ValueError``/``RuntimeError`` from the bindings)."""
    if not t.is_contiguous():
        raise ValueError("device_view: the host tensor must be contiguous")
    index = device.index if device.index is not None else torch.cuda.current_device()
    nbytes = t.numel() * t.element_size()
    flat = torch.from_dlpack(_core.arena_device_view(t.data_ptr(), nbytes, index))
    if flat.device != torch.device("cuda", index) or flat.data_ptr() != t.data_ptr():
        raise RuntimeError(f"device_view: torch made {flat.device} memory at another address of it")
    return flat.view(t.dtype).view(tuple(t.shape))


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


#: DLPack's (type code, bits) of the dtypes the bindings export as typed tensors: one call makes
#: the tensor, where a byte tensor and two views cost several times as much (a backward makes a
#: host tensor for every gradient). Others go through a byte tensor.
_DLPACK: dict[torch.dtype, tuple[int, int]] = {
    torch.float32: (2, 32),
    torch.bfloat16: (4, 16),
    torch.float16: (2, 16),
    torch.float64: (2, 64),
    torch.int8: (0, 8),
    torch.int16: (0, 16),
    torch.int32: (0, 32),
    torch.int64: (0, 64),
    torch.uint8: (1, 8),
    torch.bool: (6, 8),
}
#: Builds a tensor from a capsule (torch's own, without ``torch.from_dlpack``'s Python checks).
_from_capsule: Callable[[object], torch.Tensor] = torch._C._from_dlpack


def host_empty(
    shape: Sequence[int], dtype: torch.dtype, zeroed: bool = False, pin: bool = True
) -> torch.Tensor:
    """An arena tensor of ``shape`` and ``dtype`` (see :func:`host_bytes`)."""
    dl = _DLPACK.get(dtype)
    if dl is None:
        return host_bytes(_nbytes(shape, dtype), zeroed, pin).view(dtype).view(tuple(shape))
    t = _from_capsule(_core.arena_alloc(_nbytes(shape, dtype), zeroed, pin, dl, list(shape)))
    _warn_if_unpinned()
    return t


def pack(shapes: Sequence[Sequence[int]], dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One arena region holding several tensors back to back (64-byte aligned), so that a unit's
    parameters cross the link in one copy. Returns the flat region and the tensor views."""
    return pack_mixed([(shape, dtype) for shape in shapes])


def pack_mixed(
    specs: Sequence[tuple[Sequence[int], torch.dtype]],
    region: Callable[[int], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """As :func:`pack`, each tensor with its own dtype. ``region(nbytes)`` gives the memory (a
    ``uint8`` tensor of ``nbytes`` inside ramtorch memory, e.g. a disk store's extent); default a
    new arena region."""
    offsets, total = _packed_offsets(specs)
    flat = host_bytes(total) if region is None else region(total)
    views = [
        own_storage(flat[off : off + _nbytes(shape, dtype)].view(dtype).view(tuple(shape)))
        for off, (shape, dtype) in zip(offsets, specs)
    ]
    return flat, views


def _packed_offsets(specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for shape, dtype in specs:
        total = -(-total // _ALIGN) * _ALIGN
        offsets.append(total)
        total += _nbytes(shape, dtype)
    return offsets, total


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous, inside a live arena or shared region) as a tensor with a storage of its
    own over the same bytes, which keeps the region alive. A region packing several tensors then
    shows torch one storage per tensor, not one storage seen as several dtypes, which torch.save
    and safetensors refuse (a unit packs a bf16 weight next to an fp32 norm)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return t
    return view_at(t.data_ptr(), t.shape, t.dtype)


def view_at(addr: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor of ``shape`` and ``dtype`` over the bytes at ``addr`` (inside a live
    arena or shared region, which it keeps alive), with a storage of its own: as
    :func:`own_storage`, without a tensor to start from."""
    nbytes = _nbytes(shape, dtype)
    if nbytes == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    dl = _DLPACK.get(dtype)
    if dl is None:
        return torch.from_dlpack(_core.arena_view(addr, nbytes)).view(dtype).view(tuple(shape))
    return _from_capsule(_core.arena_view(addr, nbytes, dl, list(shape)))


def in_region(t: torch.Tensor, flat: torch.Tensor | None) -> bool:
    """Whether ``t``'s data lies inside the arena region ``flat``."""
    if flat is None or t.device.type != "cpu":
        return False
    start, p = flat.data_ptr(), t.data_ptr()
    return start <= p and p + t.numel() * t.element_size() <= start + flat.numel()


def shared_bytes(nbytes: int) -> tuple[torch.Tensor, str]:
    """A 1-D ``uint8`` CPU tensor of exactly ``nbytes`` zero bytes that other processes of this node
    (same user) can map too, and its name for :func:`attach_shared`. The memory is an anonymous
    ``memfd`` (nothing is left in ``/dev/shm``), page-locked in this process when a GPU is present;
    the kernel frees it once every process has dropped its views (or exited, crashes included).
    The name is valid while this process keeps the tensor (or a view of it) alive."""
    capsule, name = _core.shared_alloc(int(nbytes))
    flat = torch.from_dlpack(capsule)
    _warn_if_unpinned()
    return flat, name


def attach_shared(name: str, nbytes: int) -> torch.Tensor:
    """Maps the shared region ``name`` (from :func:`shared_bytes` in a live process of this node)
    into this process, page-locked when a GPU is present; it must hold exactly ``nbytes`` bytes.
    Writes through the returned tensor are seen by every process mapping the region."""
    flat = torch.from_dlpack(_core.shared_attach(str(name), int(nbytes)))
    _warn_if_unpinned()
    return flat
