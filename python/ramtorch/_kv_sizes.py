"""Sizes of a KV cache, shared by :class:`ramtorch.HostCache` and the planner: what a token's keys
and values take, and how many bytes of device copies of the cache's first pages fit in what a
GPU budget leaves."""

from __future__ import annotations

from typing import Any

import torch


def check_counts(what: str, **counts: Any) -> None:
    """Raises a ``ValueError`` (prefixed by ``what``) naming the first of ``counts`` that is not a
    positive int."""
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what}{name} must be a positive int, got {value!r}")


def bytes_per_token(config: Any, dtype: torch.dtype, batch: int = 1) -> int:
    """Bytes of one token's keys and values in every layer of a transformers decoder ``config``
    (``num_hidden_layers``, ``num_key_value_heads`` or ``num_attention_heads``, ``head_dim`` or
    ``hidden_size / num_attention_heads``), in ``dtype``, for ``batch`` sequences."""
    for name in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if not isinstance(getattr(config, name, None), int):
            raise ValueError(f"the model's config has no {name}: its KV cache cannot be sized")
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * dtype.itemsize * batch


def device_copy_bytes(
    room: int, per_token: int, layers: int, context: int, page_tokens: int, lookahead: int
) -> int:
    """What to give ``HostCache(device_bytes=...)`` out of ``room`` device bytes, for a cache of
    ``layers`` layers holding ``context`` tokens (``per_token`` bytes each, every layer): first
    its ring (``lookahead + 1`` layers' tokens) and the layer being assembled, then whole pages
    (a page of keys and one of values, ``page_tokens`` tokens, of one layer), at most all of the
    cache's."""
    if room <= 0 or layers <= 0 or per_token <= 0:
        return 0
    token = per_token // layers  # one token of one layer
    left = room - (lookahead + 2) * token * context
    page = token * page_tokens
    if left < page:
        return 0
    return min(left // page, layers * -(-context // page_tokens)) * page
