"""``ramtorch.HostCache``: a transformers KV cache whose pages live in host RAM.

Each layer's keys and values are kept in host arena memory (page-locked when a GPU is present) as
pages of ``page_tokens`` tokens, token-major (``[page_tokens, batch, heads, head_dim]``), so that
appending tokens writes a contiguous range of one or two pages and a layer's pages cross to the
device as a few contiguous copies. When a layer's attention calls :meth:`HostCache.update`, its
old tokens are already on the device (or are copied now), in one of a small ring of device buffers
sized by the largest layer; the next ``lookahead`` layers' pages are queued behind them on a side
CUDA stream, each copy ending with an event that the compute stream waits on before it reads the
buffer. The layer's keys and values are assembled on the device (old tokens, then the new ones)
into a fresh ``[batch, heads, tokens, head_dim]`` tensor, exactly as ``DynamicCache`` returns
them, and the new tokens are copied to the host pages. The whole cache is never on the device at
once: ``lookahead + 1`` layers' old tokens and the one layer whose attention runs.

Without CUDA (a CPU model, or one that ``ramtorch.offload(..., device="cpu")`` streams) the same
code runs with plain copies.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import _arena, _kv_sizes

__all__ = ["HostCache", "prefill"]

_ALIGN = 256  # bytes: where the values start in a ring buffer after the keys
#: Host pages are carved from extents of up to this many bytes (of keys, as many of values), each
#: twice the pages a layer holds so far: the pages of a long sequence lie back to back and cross
#: the link in copies of this size instead of one small copy per page.
_EXTENT_BYTES = 16 << 20


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _carve(
    pages: int, page_shape: tuple[int, ...], dtype: torch.dtype, host: bool, pin: bool, device: Any
) -> list[torch.Tensor]:
    """``pages`` pages of ``page_shape`` as views of one allocation, back to back (host arena
    memory, or memory on ``device``)."""
    shape = (pages * page_shape[0], *page_shape[1:])
    with torch.inference_mode(False):
        if host:
            block = _arena.host_empty(shape, dtype, pin=pin)
        else:
            block = torch.empty(shape, dtype=dtype, device=device)
    return list(block.split(page_shape[0]))


def _runs(pages: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``pages`` (contiguous, token-major tensors of one shape past the first dimension) with
    each run of pages that lie back to back in one allocation joined into one tensor: one copy
    for the run instead of one per page."""
    runs: list[list[Any]] = []  # [root, first page, address, bytes, rows]
    for page in pages:
        root = page._base if page._base is not None else page
        if runs and runs[-1][0] is root and runs[-1][2] + runs[-1][3] == page.data_ptr():
            runs[-1][3] += page.numel() * page.element_size()
            runs[-1][4] += page.shape[0]
        else:
            runs.append([root, page, page.data_ptr(), page.numel() * page.element_size(), page.shape[0]])
    out = []
    for root, first, address, nbytes, rows in runs:
        if rows == first.shape[0]:
            out.append(first)
            continue
        flat = root.view(torch.uint8).view(-1)  # the pages' allocation, contiguous (see _carve)
        start = address - root.data_ptr()
        out.append(flat[start : start + nbytes].view(first.dtype).view(rows, *first.shape[1:]))
    return out


class _HostLayer(CacheLayerMixin):
    """One layer's pages: keys and values in host memory, ``length`` tokens filled.

    ``keys``/``values`` (the attributes transformers' base class declares) stay ``None``: the
    tokens are in ``key_pages``/``value_pages``; :meth:`HostCache.host_tensors` assembles them."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self) -> None:
        super().__init__()
        self.key_pages: list[torch.Tensor] = []
        self.value_pages: list[torch.Tensor] = []
        self.length = 0
        self.version = 0
        self.shape: tuple[int, int, int, int] | None = None  # batch, heads, key dim, value dim
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None
        self.appended: Any = None  # a CUDA event after the last copy into the pages
        # Device copies of the layer's first pages (HostCache(device_bytes=...)): their tokens
        # need not cross the link again. ``mirrored`` says whether they hold what the host pages
        # hold (an edit of the pages, such as a crop or a new batch order, clears it; the next
        # copy of the layer refills them from the device buffer it fills).
        self.dev_key_pages: list[torch.Tensor] = []
        self.dev_value_pages: list[torch.Tensor] = []
        self.mirrored = True
        self.mirror_ready: Any = None  # a CUDA event after the side stream last refilled them
        # Host pages carved but not yet used: the rest of the last extent (see _EXTENT_BYTES).
        self.spare_key_pages: list[torch.Tensor] = []
        self.spare_value_pages: list[torch.Tensor] = []

    def __repr__(self) -> str:
        return f"_HostLayer(length={self.length}, pages={len(self.key_pages)}, shape={self.shape})"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, dk = key_states.shape
        self.shape = (b, h, dk, value_states.shape[-1])
        self.dtype = key_states.dtype
        self.device = key_states.device
        self.is_initialized = True

    def update(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError(
            "a HostCache layer is updated through HostCache.update (it pages its layers together)"
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:  # always in host memory
        pass

    def prefetch(self) -> None:  # HostCache prefetches along the layers' order itself
        pass

    def token_bytes(self) -> tuple[int, int]:
        """Bytes of one token's keys and of its values."""
        assert self.shape is not None and self.dtype is not None
        b, h, dk, dv = self.shape
        size = torch.empty(0, dtype=self.dtype).element_size()
        return b * h * dk * size, b * h * dv * size

    def host_bytes(self) -> int:
        """Host memory of the pages, those held and those carved for the next tokens."""
        pages = self.key_pages + self.value_pages + self.spare_key_pages + self.spare_value_pages
        return sum(p.numel() * p.element_size() for p in pages)

    def mirror_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.dev_key_pages + self.dev_value_pages)

    def mirror_rows(self) -> int:
        """Tokens whose keys and values the device copies hold (0 while they are stale)."""
        if not self.mirrored or not self.dev_key_pages:
            return 0
        return min(self.length, self.dev_key_pages[0].shape[0] * len(self.dev_key_pages))

    # The pages may be in flight: HostCache's own methods wait for the copies first.
    def reset(self) -> None:
        raise RuntimeError("reset a HostCache through HostCache.reset")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise RuntimeError("reorder a HostCache through HostCache.reorder_cache")


@dataclass
class _Slot:
    """A device buffer of the ring: holds one layer's old tokens (``layer``, at ``version``)."""

    buf: torch.Tensor | None = None
    layer: int | None = None
    version: int = -1
    length: int = 0
    ready: Any = None  # CUDA event: the copies into ``buf`` are done
    busy: bool = False  # taken by the layer being assembled
    free: Any = None  # CUDA event: the last reader of ``buf`` is done
    mirrored: int = 0  # the first tokens, not copied: the assembly reads the device pages


def _drain(inflight: list[tuple[Any, list[torch.Tensor]]]) -> None:
    """Waits for the copies in flight that read host pages, before the pages may be freed."""
    for event, _ in inflight:
        event.synchronize()
    inflight.clear()


class HostCache(Cache):
    """A transformers KV cache whose keys and values live in host RAM, paged, and reach the
    compute device one layer at a time, ahead of the layer that reads them.

    Use it wherever transformers takes a cache (``cache=`` from transformers 5.24, where
    ``past_key_values=`` still works with a deprecation warning)::

        cache = ramtorch.HostCache(page_tokens=256)
        out = model.generate(ids, cache=cache, max_new_tokens=64)

    Args:
        page_tokens: tokens per host page. Pages are allocated as the sequence grows (never
            the whole cache again), carved from extents that hold as many pages as the layer
            already has, up to 16 MiB of keys (as much of values): a layer holds at most that
            beyond its tokens, and its pages lie back to back, so that they cross the link in
            copies of up to 16 MiB whatever the page size.
        lookahead: how many of the next layers' pages are copied ahead on a side stream (CUDA)
            while a layer computes; the device holds ``lookahead + 1`` layers' old tokens.
        pin: page-lock the host pages when a GPU is present (needed for copies that overlap
            compute); ``False`` keeps them pageable.
        device_bytes: device memory for copies of the layers' first pages, which then do not
            cross the link again: each step moves only the tokens past them. Pages are taken as
            the layers grow, all layers alike, while the total stays within ``device_bytes``
            (0, the default: none; the whole cache crosses each step). A new batch order
            (beam search reorders every step) makes them anew from the next copy of each layer,
            so beam search gains little from them.
        context: the tokens the cache is expected to hold, if known: the ring's buffers are
            then allocated for that many at once (no larger, and not again as the sequence
            grows); past it they grow by a quarter at a time. ``None`` (the default): they grow
            with the sequence, a quarter ahead.

    The layers must be updated in the order a forward pass runs them (increasing layer index,
    each once per pass). Keys and values are detached from autograd: use it for inference.
    Sliding-window layers are kept whole (the model's attention mask applies the window).
    :meth:`stats` counts the bytes each pass moved (``kv_bytes_per_step``).
    """

    def __init__(
        self,
        page_tokens: int = 256,
        lookahead: int = 1,
        pin: bool = True,
        device_bytes: int = 0,
        context: int | None = None,
    ) -> None:
        for name, value, low in (
            ("page_tokens", page_tokens, 1),
            ("lookahead", lookahead, 0),
            ("device_bytes", device_bytes, 0),
            ("context", 1 if context is None else context, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"HostCache: {name} must be an int, got {type(value).__name__}")
            if value < low:
                raise ValueError(f"HostCache: {name} must be at least {low}, got {value}")
        super().__init__(layers=[])
        self.page_tokens = page_tokens
        self.lookahead = lookahead
        self.pin = bool(pin)
        self.device_bytes = device_bytes
        self.context = context
        self.device: torch.device | None = None
        self._slots = [_Slot() for _ in range(lookahead + 1)]
        self._side: Any = None  # the side CUDA stream
        self._inflight: list[tuple[Any, list[torch.Tensor]]] = []
        self._finalizer = weakref.finalize(self, _drain, self._inflight)
        self._finalizer.atexit = False  # at exit the memory goes with the process: no CUDA calls then
        self._first: int | None = None  # the first layer of a pass
        self._last: int | None = None  # the layer updated last in this pass
        self._order: list[int] = []  # the layers of the last complete pass, in order
        self._this_pass: list[int] = []
        self._pass_base = 0  # tokens held at the start of this pass
        self._counts = {
            "h2d_bytes": 0,
            "d2h_bytes": 0,
            "prefetch_hits": 0,
            "prefetch_misses": 0,
            "passes": 0,
        }
        self._pass_bytes = 0
        self._last_pass_bytes = 0
        self._pass_open = False
        self._mirror_bytes = 0  # device memory of the layers' first pages' copies

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        context: int,
        batch: int = 1,
        page_tokens: int = 256,
        lookahead: int = 1,
        pin: bool = True,
    ) -> HostCache:
        """A cache for ``model`` (offloaded with ``ramtorch.offload(..., gpu_budget=...)``) that
        will hold ``context`` tokens of ``batch`` sequences, with the ``device_bytes`` its budget
        leaves: after the weights' resident units and slots, the cache's ring and the layer being
        assembled, device copies of the cache's first pages (as ``python -m ramtorch plan
        --context`` predicts). A model offloaded without a budget, or not offloaded, gets none."""
        _kv_sizes.check_counts("HostCache.for_model: ", context=context, batch=batch)
        cache = cls(page_tokens, lookahead, pin, context=context)  # (checks them)
        streamer = getattr(model, "_ramtorch_streamer", None)
        if streamer is not None and streamer.budget is not None:
            config = getattr(model, "config", None)
            if config is None:
                raise ValueError(
                    "HostCache.for_model: the model has no transformers config to size its cache by"
                )
            dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
            per_token = _kv_sizes.bytes_per_token(config, dtype, batch)
            room = streamer.budget - streamer.resident_bytes - streamer.slots * streamer.slot_bytes
            cache.device_bytes = _kv_sizes.device_copy_bytes(
                room, per_token, config.num_hidden_layers, context, page_tokens, lookahead
            )
        return cache

    # ----------------------------------------------------------------------------------------
    # What transformers calls

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends ``key_states``/``value_states`` (``[batch, heads, new tokens, head_dim]``) to
        layer ``layer_idx`` and returns the layer's keys and values, old tokens then new, on the
        compute device (fresh tensors, as ``DynamicCache`` returns them)."""
        self._check_states(key_states, value_states, layer_idx)
        if layer_idx < len(self.layers) and self.layers[layer_idx].is_initialized:
            self._check_layer(self.layers[layer_idx], layer_idx, key_states, value_states)
        self._check_order(layer_idx)
        while len(self.layers) <= layer_idx:
            self.layers.append(_HostLayer())
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        if layer_idx != self._first and layer.length != self._pass_base:
            raise RuntimeError(
                f"HostCache: layer {layer_idx} holds {layer.length} tokens but layer {self._first} held "
                f"{self._pass_base} when this pass began: an earlier forward stopped midway, "
                "leaving the layers unequal; reset the cache (HostCache.reset) or start a new one"
            )
        old_keys, old_values, slot, m = self._take(layer_idx, layer)
        self._prefetch_after(layer_idx)
        n_old = layer.length
        keys = self._assemble(old_keys, key_states, layer.dev_key_pages, m, n_old)
        values = self._assemble(old_values, value_states, layer.dev_value_pages, m, n_old)
        if slot is not None:
            self._release(slot)
        self._append(layer, key_states, value_states)
        if self._order and layer_idx == self._order[-1]:
            self._end_pass()
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens held by layer ``layer_idx`` (0 for a layer not seen yet)."""
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].get_seq_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if layer_idx >= len(self.layers):
            return query_length, 0
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def reset(self) -> None:
        """Drops every token (the pages go back to the arena); the cache can be filled again."""
        self._quiesce()
        for i, layer in enumerate(self.layers):
            fresh = _HostLayer()
            fresh.version = layer.version + 1
            self.layers[i] = fresh
        self._mirror_bytes = 0
        self._first = self._last = None
        self._this_pass = []

    def crop(self, tokens_to_remove: int) -> None:
        """Removes the last ``-tokens_to_remove`` tokens of every layer (a non-positive count, as
        ``DynamicCache.crop``); pages left empty are kept for the tokens appended next."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"HostCache.crop: pass a negative number of tokens to remove, got {tokens_to_remove} "
                "(as DynamicCache.crop)"
            )
        if tokens_to_remove == 0:
            return
        self._quiesce()
        for layer in self._filled():
            layer.length = max(0, layer.length + tokens_to_remove)
            keep = -(-layer.length // self.page_tokens)
            layer.spare_key_pages[:0] = layer.key_pages[keep:]
            layer.spare_value_pages[:0] = layer.value_pages[keep:]
            del layer.key_pages[keep:], layer.value_pages[keep:]
            layer.version += 1
        self._pass_base = self.get_seq_length(self._first or 0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorders the batch (beam search): row ``i`` becomes row ``beam_idx[i]``."""
        self._rebatch(lambda page: page.index_select(1, beam_idx.to("cpu")), "reorder_cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeats each batch row ``repeats`` times, in place (as ``DynamicCache``)."""
        self._rebatch(lambda page: page.repeat_interleave(repeats, dim=1), "batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keeps only the batch rows ``indices``."""
        idx = indices.to("cpu") if isinstance(indices, torch.Tensor) else indices
        self._rebatch(lambda page: page[:, idx], "batch_select_indices")

    def __deepcopy__(self, memo: dict) -> HostCache:
        """A copy with pages of its own in fresh host memory (to reuse a prompt's cache for
        several continuations, as with ``DynamicCache``); nothing in flight or on the device is
        shared, and the copy's device buffers start empty."""
        self._quiesce()
        new = HostCache(self.page_tokens, self.lookahead, self.pin, self.device_bytes, self.context)
        memo[id(self)] = new
        new.device = self.device
        for layer in self.layers:
            twin = _HostLayer()
            if layer.is_initialized:
                twin.shape, twin.dtype, twin.device = layer.shape, layer.dtype, layer.device
                twin.length, twin.is_initialized = layer.length, True
                twin.key_pages = new._host_copies(layer.key_pages)
                twin.value_pages = new._host_copies(layer.value_pages)
                for mine, theirs in (
                    (layer.dev_key_pages, twin.dev_key_pages),
                    (layer.dev_value_pages, twin.dev_value_pages),
                ):
                    if mine:
                        theirs[:] = _carve(
                            len(mine), tuple(mine[0].shape), mine[0].dtype, False, False, mine[0].device
                        )
                twin.mirrored = False  # filled by its first copy
            new.layers.append(twin)
        new._first, new._last, new._pass_base = self._first, self._last, self._pass_base
        new._order, new._this_pass = list(self._order), list(self._this_pass)
        new._pass_open, new._counts = self._pass_open, dict(self._counts)
        new._pass_bytes, new._last_pass_bytes = self._pass_bytes, self._last_pass_bytes
        new._mirror_bytes = self._mirror_bytes
        return new

    # ----------------------------------------------------------------------------------------
    # Reading it

    def host_tensors(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s keys and values as CPU tensors ``[batch, heads, tokens, dim]``
        (a copy, assembled from the pages after the copies in flight are done)."""
        if not 0 <= layer_idx < len(self.layers) or not self.layers[layer_idx].is_initialized:
            raise IndexError(
                f"HostCache.host_tensors: layer {layer_idx} holds nothing (the cache has {len(self)} layers)"
            )
        self._quiesce()
        layer = self.layers[layer_idx]
        keys = torch.cat(layer.key_pages)[: layer.length] if layer.key_pages else None
        values = torch.cat(layer.value_pages)[: layer.length] if layer.value_pages else None
        b, h, dk, dv = layer.shape
        if keys is None:
            return torch.empty(b, h, 0, dk, dtype=layer.dtype), torch.empty(b, h, 0, dv, dtype=layer.dtype)
        return keys.permute(1, 2, 0, 3).contiguous(), values.permute(1, 2, 0, 3).contiguous()

    @property
    def kv_bytes_per_step(self) -> int:
        """Cache bytes that crossed between host and device in the last complete pass (one decode
        step): the old tokens copied to the device, the new ones copied back. The copies are
        counted in the pass that issues them, so a pass's last layers count the next pass's first
        ``lookahead`` layers (in a steady decode, the same bytes). 0 before a pass completes."""
        return self._last_pass_bytes

    def stats(self) -> dict[str, int]:
        """Counters: ``kv_bytes_per_step``; ``h2d_bytes``/``d2h_bytes`` (totals); ``host_bytes``
        (pages held); ``device_bytes`` (the ring's buffers and the copies of the first pages;
        the layer being assembled is a fresh tensor besides); ``mirror_bytes`` (those copies)
        and ``mirrored_tokens`` (the tokens they hold, in the layer that holds fewest);
        ``tokens``; ``pages`` (of keys, as many of values);
        ``prefetch_hits`` (a layer's tokens were already on the device or queued) and
        ``prefetch_misses``; ``passes``."""
        layers = self._filled()
        return {
            "kv_bytes_per_step": self._last_pass_bytes,
            **self._counts,
            "host_bytes": sum(layer.host_bytes() for layer in layers),
            "device_bytes": sum(s.buf.numel() for s in self._slots if s.buf is not None) + self._mirror_bytes,
            "mirror_bytes": self._mirror_bytes,
            "mirrored_tokens": min((layer.mirror_rows() for layer in layers), default=0),
            "tokens": self.get_seq_length(self._first or 0),
            "pages": sum(len(layer.key_pages) for layer in layers),
        }

    # ----------------------------------------------------------------------------------------
    # Checks

    def _check_states(self, keys: Any, values: Any, layer_idx: Any) -> None:
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
            raise TypeError(f"HostCache.update: layer_idx must be an int, got {type(layer_idx).__name__}")
        if layer_idx < 0:
            raise ValueError(f"HostCache.update: layer_idx must be non-negative, got {layer_idx}")
        where = f"HostCache.update (layer {layer_idx})"
        for name, t in (("key_states", keys), ("value_states", values)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{where}: {name} must be a tensor, got {type(t).__name__}")
            if t.dim() != 4:
                raise ValueError(
                    f"{where}: {name} must be [batch, heads, tokens, head_dim], got shape {tuple(t.shape)}"
                )
            if t.device.type not in ("cpu", "cuda"):
                raise ValueError(f"{where}: {name} is on {t.device}; HostCache serves CPU and CUDA")
        if keys.device != values.device:
            raise ValueError(f"{where}: key_states are on {keys.device} but value_states on {values.device}")
        if keys.dtype != values.dtype:
            raise ValueError(f"{where}: key_states are {keys.dtype} but value_states {values.dtype}")
        if keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                f"{where}: key_states {tuple(keys.shape)} and value_states "
                f"{tuple(values.shape)} differ in batch, heads or tokens"
            )
        if torch.is_grad_enabled() and (keys.requires_grad or values.requires_grad):
            raise RuntimeError(
                f"{where}: the keys require grad, but HostCache keeps them in host memory, detached "
                "from autograd: run under torch.no_grad() (generate() does), or use DynamicCache to "
                "backpropagate through the cache"
            )
        if self.device is None:
            self.device = keys.device
        elif keys.device != self.device:
            raise ValueError(
                f"{where}: key_states are on {keys.device} but this cache computes on "
                f"{self.device} (its earlier layers and steps): use one HostCache per device"
            )

    def _check_layer(self, layer: _HostLayer, idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        where = f"HostCache.update (layer {idx})"
        if keys.dtype != layer.dtype:
            raise ValueError(f"{where}: key_states are {keys.dtype} but the layer holds {layer.dtype}")
        b, h, dk, dv = layer.shape
        got = (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3])
        if got != (b, h, dk, dv):
            raise ValueError(
                f"{where}: states of batch {got[0]}, {got[1]} heads, key dim {got[2]}, value dim "
                f"{got[3]} do not match the layer's batch {b}, {h} heads, key dim {dk}, value dim {dv}"
            )

    def _check_order(self, idx: int) -> None:
        if self._first is None:
            self._first = idx
        if idx == self._first:  # a new pass
            if self._pass_open:
                self._end_pass()
            self._pass_open = True
            if self._this_pass:
                self._order = self._this_pass
            self._this_pass = []
            self._pass_base = self.get_seq_length(idx)
        elif self._last is None or idx <= self._last:
            before = "none" if self._last is None else f"layer {self._last}"
            raise ValueError(
                f"HostCache.update: layer {idx} after {before}: layers must be updated in order within a "
                f"pass, each once, the pass starting at layer {self._first}"
            )
        self._last = idx
        self._this_pass.append(idx)

    # ----------------------------------------------------------------------------------------
    # Paging

    def _filled(self) -> list[_HostLayer]:
        return [layer for layer in self.layers if isinstance(layer, _HostLayer) and layer.is_initialized]

    def _cuda(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def _end_pass(self) -> None:
        self._pass_open = False
        self._counts["passes"] += 1
        self._last_pass_bytes = self._pass_bytes
        self._pass_bytes = 0

    def _take(
        self, idx: int, layer: _HostLayer
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, _Slot | None, int]:
        """The layer's old tokens on the device: ``[tokens, batch, heads, dim]`` views of a ring
        buffer, its slot, and how many of the first tokens the device pages hold instead (the
        ring's rows for them are not filled), the compute stream made to wait for the copy. No
        buffer (``None``) when the layer holds no token, or when the device pages hold them all."""
        if layer.length == 0:
            return None, None, None, 0
        mirrored = layer.mirror_rows()
        if mirrored >= layer.length:  # nothing to copy: the assembly reads the device pages
            self._counts["prefetch_hits"] += 1
            if self._cuda() and layer.mirror_ready is not None:
                torch.cuda.current_stream(self.device).wait_event(layer.mirror_ready)
            return None, None, None, mirrored
        slot = next((s for s in self._slots if s.layer == idx and s.version == layer.version), None)
        if slot is None:
            self._counts["prefetch_misses"] += 1
            slot = self._copy_in(idx, layer, exclude=())
            assert slot is not None  # only one slot is ever busy, and the ring has two or more
        else:
            self._counts["prefetch_hits"] += 1
        slot.busy = True
        if self._cuda() and slot.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.ready)
        keys, values = self._views(slot, layer)
        return keys, values, slot, slot.mirrored

    def _views(self, slot: _Slot, layer: _HostLayer) -> tuple[torch.Tensor, torch.Tensor]:
        assert slot.buf is not None and layer.shape is not None
        b, h, dk, dv = layer.shape
        kb, vb = layer.token_bytes()
        n = slot.length
        voff = _round_up(n * kb, _ALIGN)
        keys = slot.buf[: n * kb].view(layer.dtype).view(n, b, h, dk)
        values = slot.buf[voff : voff + n * vb].view(layer.dtype).view(n, b, h, dv)
        return keys, values

    def _release(self, slot: _Slot) -> None:
        """The assembly has read ``slot``: it may take another layer after the compute stream's
        event."""
        if self._cuda():
            slot.free = torch.cuda.Event()
            slot.free.record(torch.cuda.current_stream(self.device))
        slot.layer, slot.version, slot.busy = None, -1, False

    def _prefetch_after(self, idx: int) -> None:
        """Queues the copies of the next ``lookahead`` layers after ``idx`` that need one, in the
        order of the last pass (wrapping to the next pass's first layers): layers whose old
        tokens the device pages hold all of are passed over, so that the link works ahead
        while they compute."""
        if not self.lookahead or idx not in self._order:
            return
        pos = self._order.index(idx)
        n = len(self._order)
        wanted: list[int] = []
        for k in range(1, n):
            if len(wanted) >= self.lookahead:
                break
            target = self._order[(pos + k) % n]
            layer = self.layers[target] if target < len(self.layers) else None
            if isinstance(layer, _HostLayer) and 0 < layer.length and layer.mirror_rows() < layer.length:
                wanted.append(target)
        for target in wanted:
            layer = self.layers[target]
            if any(s.layer == target and s.version == layer.version for s in self._slots):
                continue
            self._copy_in(target, layer, exclude=wanted)

    def _pick_slot(self, exclude: Sequence[int]) -> _Slot | None:
        """A ring buffer to copy into: a free one, else one whose layer is stale or not in
        ``exclude`` (the layers wanted soon); never the one being read. ``None`` if none is."""
        idle = [s for s in self._slots if not s.busy]
        for s in idle:
            if s.layer is None:
                return s
        for s in idle:
            layer = self.layers[s.layer] if s.layer is not None and s.layer < len(self.layers) else None
            if s.layer not in exclude or layer is None or layer.version != s.version:
                return s
        return None

    def _copy_in(self, idx: int, layer: _HostLayer, exclude: Sequence[int]) -> _Slot | None:
        """Copies layer ``idx``'s old tokens into a ring buffer (on the side stream with CUDA);
        ``None`` if every buffer holds a layer wanted sooner."""
        slot = self._pick_slot(exclude)
        if slot is None:
            return None
        kb, vb = layer.token_bytes()
        n = layer.length
        need = _round_up(n * kb, _ALIGN) + n * vb
        cuda = self._cuda()
        if slot.buf is None or slot.buf.numel() < need:
            self._grow(slot, need, layer)
        mirrored = layer.mirror_rows()
        slot.layer, slot.version, slot.length, slot.mirrored = idx, layer.version, n, mirrored
        keys, values = self._views(slot, layer)
        pages = self._pages_for(layer)
        moved = (n - mirrored) * (kb + vb)
        self._counts["h2d_bytes"] += moved
        self._pass_bytes += moved
        if not cuda:
            self._copy_pages(layer, keys, values, mirrored)
            self._refill_mirror(layer, keys, values)
            slot.ready = None
            return slot
        side = self._side_stream()
        if slot.free is not None:
            side.wait_event(slot.free)
        if layer.appended is not None:
            side.wait_event(layer.appended)
        with torch.cuda.stream(side):
            self._copy_pages(layer, keys, values, mirrored)
            refill = not layer.mirrored and bool(layer.dev_key_pages)
            self._refill_mirror(layer, keys, values)
            slot.ready = torch.cuda.Event()
            slot.ready.record(side)
        if refill:  # a read of the device pages without a slot waits for this
            layer.mirror_ready = slot.ready
        self._track(slot.ready, pages)
        return slot

    def _track(self, event: Any, pages: list[torch.Tensor]) -> None:
        """Keeps ``pages`` alive until ``event`` (after copies that read or write them): the
        oldest entries are dropped as their events complete."""
        while self._inflight and self._inflight[0][0].query():
            self._inflight.pop(0)
        self._inflight.append((event, pages))

    def _pages_for(self, layer: _HostLayer) -> list[torch.Tensor]:
        used = -(-layer.length // self.page_tokens)
        return layer.key_pages[:used] + layer.value_pages[:used]

    def _copy_pages(
        self, layer: _HostLayer, keys: torch.Tensor, values: torch.Tensor, mirrored: int = 0
    ) -> None:
        """Copies the layer's filled rows past the first ``mirrored`` (which the device copies
        of the first pages hold: the assembly reads them there) from the host pages into
        ``keys``/``values`` (``[tokens, batch, heads, dim]``), each run of pages that lie back to
        back in one copy."""
        cuda = self._cuda()
        n = layer.length
        m = min(mirrored, n)
        if n > m:
            self._read_rows(layer.key_pages, m, n, keys, cuda)
            self._read_rows(layer.value_pages, m, n, values, cuda)

    def _read_rows(self, pages: list[torch.Tensor], lo: int, hi: int, dst: torch.Tensor, cuda: bool) -> None:
        """Rows ``lo:hi`` of the sequence ``pages`` hold into ``dst[lo:hi]``."""
        p = self.page_tokens
        first, row = lo // p, (lo // p) * p
        dsts, srcs = [], []
        for run in _runs(pages[first : (hi - 1) // p + 1]):
            a, b = max(row, lo), min(row + run.shape[0], hi)
            if a < b:
                dsts.append(dst[a:b])
                srcs.append(run[a - row : b - row])
            row += run.shape[0]
        torch._foreach_copy_(dsts, srcs, non_blocking=cuda)

    def _write_rows(self, pages: list[torch.Tensor], start: int, rows: torch.Tensor, cuda: bool) -> None:
        """``rows`` (token-major) into the sequence ``pages`` hold, from row ``start``."""
        n = rows.shape[0]
        if n == 0:
            return
        p = self.page_tokens
        first, row = start // p, (start // p) * p
        for run in _runs(pages[first : (start + n - 1) // p + 1]):
            a, b = max(row, start), min(row + run.shape[0], start + n)
            if a < b:
                run[a - row : b - row].copy_(rows[a - start : b - start], non_blocking=cuda)
            row += run.shape[0]

    def _grow(self, slot: _Slot, need: int, layer: _HostLayer) -> None:
        """A larger ring buffer: room for the ``context`` tokens the cache expects, while the
        layer holds no more; else for the layer's tokens and a quarter more (at least a page),
        rounded to whole pages, so that a growing sequence reallocates it rarely."""
        kb, vb = layer.token_bytes()
        if self.context is not None and layer.length <= self.context:
            tokens = self.context  # what the plan (``_kv_sizes.device_copy_bytes``) counts
        else:
            tokens = _round_up(layer.length + max(layer.length // 4, self.page_tokens), self.page_tokens)
        largest = max([need, _round_up(tokens * kb, _ALIGN) + tokens * vb])
        if slot.buf is not None:
            largest = max(largest, slot.buf.numel())
        with torch.inference_mode(False):
            buf = torch.empty(largest, dtype=torch.uint8, device=self.device)
        if self._cuda():
            # the side stream writes it: wait for the compute stream's work on this memory's last
            # owner, and keep it from the allocator until the side stream's writes are done
            buf.record_stream(self._side_stream())
            slot.free = torch.cuda.Event()
            slot.free.record(torch.cuda.current_stream(self.device))
        slot.buf = buf

    def _refill_mirror(self, layer: _HostLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
        """After the host pages changed under the device copies (a crop's tokens appended
        again, a new batch order, a copied cache): the copies made anew from the device buffer
        just filled with all of the layer's tokens (``keys``/``values``), on the stream that
        filled it."""
        if layer.mirrored or not layer.dev_key_pages:
            layer.mirrored = True
            return
        rows = min(layer.length, len(layer.dev_key_pages) * self.page_tokens)
        self._write_rows(layer.dev_key_pages, 0, keys[:rows], False)
        self._write_rows(layer.dev_value_pages, 0, values[:rows], False)
        layer.mirrored = True

    def _mirror_append(
        self, layer: _HostLayer, k_rows: torch.Tensor, v_rows: torch.Tensor, start: int
    ) -> None:
        """The new rows ``k_rows``/``v_rows`` (token-major, on the device, from token ``start``)
        into the device copies of the layer's first pages: a page is added while the budget
        allows and the rows reach it."""
        p = self.page_tokens
        end = start + k_rows.shape[0]
        b, h, dk, dv = layer.shape  # type: ignore[misc]
        kb, vb = layer.token_bytes()
        held = len(layer.dev_key_pages)
        want = -(-end // p) - held
        room = (self.device_bytes - self._mirror_bytes) // (p * (kb + vb))
        new = min(want, room)
        if new > 0:  # the pages the rows reach, while the budget allows, in one allocation
            if held * p < start:
                layer.mirrored = False  # a page of tokens appended before it: filled at the next copy
            for dim, into in ((dk, layer.dev_key_pages), (dv, layer.dev_value_pages)):
                carved = _carve(new, (p, b, h, dim), layer.dtype, False, False, self.device)
                if self._cuda():  # the side stream reads and refills them: freed after its work
                    carved[0]._base.record_stream(self._side_stream())
                into.extend(carved)
            self._mirror_bytes += new * p * (kb + vb)
        if not layer.mirrored:
            return
        cap = len(layer.dev_key_pages) * p
        if cap > start:
            self._write_rows(layer.dev_key_pages, start, k_rows[: cap - start], False)
            self._write_rows(layer.dev_value_pages, start, v_rows[: cap - start], False)

    def _side_stream(self) -> Any:
        if self._side is None:
            self._side = torch.cuda.Stream(device=self.device)
        return self._side

    def _assemble(
        self,
        old: torch.Tensor | None,
        new: torch.Tensor,
        dev_pages: list[torch.Tensor],
        mirrored: int,
        n_old: int,
    ) -> torch.Tensor:
        """``[batch, heads, old + new tokens, dim]``, a fresh contiguous tensor as ``torch.cat``
        makes it in ``DynamicCache`` (so attention kernels see the same layout: the new states are
        often a transposed view): of the ``n_old`` old tokens, the first ``mirrored`` read from
        the device pages, the rest from ``old`` (``[n_old, batch, heads, dim]``, a ring buffer)."""
        if n_old == 0:
            return torch.empty_like(new, memory_format=torch.contiguous_format).copy_(new)
        b, h, n, d = new.shape
        out = torch.empty((b, h, n_old + n, d), dtype=new.dtype, device=new.device)
        row = 0
        if mirrored:
            for run in _runs(dev_pages[: -(-mirrored // self.page_tokens)]):
                end = min(row + run.shape[0], mirrored)
                out[:, :, row:end].copy_(run[: end - row].permute(1, 2, 0, 3))
                row = end
        if n_old > row:
            assert old is not None  # only a layer the device pages hold whole has no ring buffer
            out[:, :, row:n_old].copy_(old[row:n_old].permute(1, 2, 0, 3))
        out[:, :, n_old:].copy_(new)
        return out

    def _append(self, layer: _HostLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copies the new tokens into the layer's pages (allocating pages as needed)."""
        n = keys.shape[2]
        if n == 0:
            return
        cuda = self._cuda()
        # token-major on the device, so that each page's share is one contiguous copy
        k_rows = keys.detach().permute(2, 0, 1, 3).contiguous()
        v_rows = values.detach().permute(2, 0, 1, 3).contiguous()
        p = self.page_tokens
        start, end = layer.length, layer.length + n
        self._add_pages(layer, -(-end // p) - len(layer.key_pages))
        self._write_rows(layer.key_pages, start, k_rows, cuda)
        self._write_rows(layer.value_pages, start, v_rows, cuda)
        if self.device_bytes:
            self._mirror_append(layer, k_rows, v_rows, start)
        if cuda:
            layer.appended = torch.cuda.Event()
            layer.appended.record(torch.cuda.current_stream(self.device))
            # the pages stay alive until the copies into them are done, even if the cache dies
            self._track(layer.appended, layer.key_pages[start // p :] + layer.value_pages[start // p :])
        kb, vb = layer.token_bytes()
        self._counts["d2h_bytes"] += n * (kb + vb)
        self._pass_bytes += n * (kb + vb)
        layer.length = end
        layer.version += 1

    def _add_pages(self, layer: _HostLayer, count: int) -> None:
        """``count`` more host pages for the layer: spare ones first, then a new extent of at
        least as many pages as it holds (up to ``_EXTENT_BYTES``), the rest kept spare."""
        if count <= 0:
            return
        take = min(count, len(layer.spare_key_pages))
        layer.key_pages += layer.spare_key_pages[:take]
        layer.value_pages += layer.spare_value_pages[:take]
        del layer.spare_key_pages[:take], layer.spare_value_pages[:take]
        short = count - take
        if short <= 0:
            return
        b, h, dk, dv = layer.shape  # type: ignore[misc]
        kb, _ = layer.token_bytes()
        cap = max(1, _EXTENT_BYTES // (self.page_tokens * kb))
        n = max(short, min(cap, len(layer.key_pages)))
        for dim, held, spare in (
            (dk, layer.key_pages, layer.spare_key_pages),
            (dv, layer.value_pages, layer.spare_value_pages),
        ):
            carved = _carve(n, (self.page_tokens, b, h, dim), layer.dtype, True, self.pin, None)
            held += carved[:short]
            spare[:] = carved[short:]

    def _host_copies(self, pages: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of ``pages`` in fresh host pages of one extent."""
        if not pages:
            return []
        out = _carve(len(pages), tuple(pages[0].shape), pages[0].dtype, True, self.pin, None)
        for dst, src in zip(out, pages):
            dst.copy_(src)
        return out

    def _quiesce(self) -> None:
        """Waits for every copy that reads or writes host pages and forgets the ring's contents:
        the host is about to change the pages."""
        _drain(self._inflight)
        for layer in self._filled():
            if layer.appended is not None:
                layer.appended.synchronize()
                layer.appended = None
        for s in self._slots:
            s.layer, s.version, s.busy = None, -1, False

    def _rebatch(self, fn: Any, what: str) -> None:
        """Replaces every page by ``fn(page)`` (a new batch dimension), in fresh host pages."""
        self._quiesce()
        for layer in self._filled():
            new_keys = self._host_copies([fn(page) for page in layer.key_pages])
            new_values = self._host_copies([fn(page) for page in layer.value_pages])
            layer.spare_key_pages, layer.spare_value_pages = [], []  # of the old batch size
            # the new batch size, also for a layer with no pages left (cropped to nothing)
            b = fn(torch.empty(0, layer.shape[0], 1, 1)).shape[1]
            if any(t.shape[1] != b for t in new_keys + new_values):  # pragma: no cover
                raise RuntimeError(f"HostCache.{what}: the pages disagree on the batch size")
            layer.key_pages, layer.value_pages = new_keys, new_values
            layer.shape = (b, *layer.shape[1:])
            layer.version += 1
            # Another batch: the device copies are of the old one (made anew at that size).
            self._mirror_bytes -= layer.mirror_bytes()
            layer.dev_key_pages, layer.dev_value_pages, layer.mirrored = [], [], True


def prefill(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    cache: Cache,
    chunk_tokens: int,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> Any:
    """Runs ``input_ids`` (``[batch, tokens]``) through ``model`` into ``cache``, ``chunk_tokens``
    at a time, so that no forward's activations span the whole prompt (each chunk attends to the
    cached tokens before it). Returns the last chunk's output (its ``logits`` are the last
    chunk's). ``attention_mask`` covers the tokens already in the cache and the prompt; with it,
    and no ``position_ids``, positions are counted from the mask as ``generate()`` counts them
    (a left-padded batch starts at 0 after its padding). ``position_ids`` and ``token_type_ids``
    given as keyword arguments cover the same tokens and are cut per chunk; other keyword
    arguments go to every forward. To go on with ``model.generate(ids, cache=cache, ...)``,
    prefill all but the prompt's last token.

    The logits equal a one-shot prefill's up to rounding: the chunks' matrix products are
    different shapes, which floating point may round differently."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"ramtorch.prefill: chunk_tokens must be a positive int, got {chunk_tokens!r}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(
            "ramtorch.prefill: input_ids must be a [batch, tokens] tensor, got "
            f"{tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__}"
        )
    past = cache.get_seq_length()
    total = input_ids.shape[1]
    if attention_mask is not None and attention_mask.shape[-1] != past + total:
        raise ValueError(
            f"ramtorch.prefill: attention_mask covers {attention_mask.shape[-1]} tokens; the cache holds "
            f"{past} and input_ids has {total}, so it must cover {past + total}"
        )
    per_token = {k: kwargs.pop(k) for k in ("position_ids", "token_type_ids") if kwargs.get(k) is not None}
    if attention_mask is not None and "position_ids" not in per_token:
        positions = attention_mask.long().cumsum(-1) - 1
        per_token["position_ids"] = positions.masked_fill(attention_mask == 0, 0)
    for key, t in per_token.items():
        if not isinstance(t, torch.Tensor) or t.shape[-1] != past + total:
            raise ValueError(
                f"ramtorch.prefill: {key} must be a tensor covering the {past} cached tokens and the "
                f"{total} of input_ids ({past + total}), got "
                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
            )
    out = None
    name = _cache_kwarg(model)
    for start in range(0, total, chunk_tokens):
        end = min(total, start + chunk_tokens)
        call = dict(kwargs)
        if attention_mask is not None:
            call["attention_mask"] = attention_mask[:, : past + end]
        for key, t in per_token.items():
            call[key] = t[..., past + start : past + end]
        out = model(input_ids[:, start:end], **{name: cache}, use_cache=True, **call)
    return out


def _cache_kwarg(model: torch.nn.Module) -> str:
    """The name ``model``'s forward takes the cache under: ``cache`` (transformers 5.24 on) or
    ``past_key_values``."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"
