"""Checkpoint keys to model keys, as transformers' ``from_pretrained`` maps them: the base-model
prefix (``bert.``, ``model.``) added or stripped, legacy names renamed (``LayerNorm.gamma``, ...),
and the keys a model says to ignore left out of the report. Other models: keys as they are.

transformers is never imported here: a model is a transformers model only if transformers is
loaded already."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from typing import Any

from torch import nn

__all__ = ["ignored_missing", "ignored_unexpected", "map_keys"]

#: Legacy renames, used where transformers does not expose its own.
_LEGACY = [
    (re.compile(r"LayerNorm\.gamma$"), "LayerNorm.weight"),
    (re.compile(r"LayerNorm\.beta$"), "LayerNorm.bias"),
]


def _hf_model(model: nn.Module) -> bool:
    base = getattr(sys.modules.get("transformers"), "PreTrainedModel", None)
    return base is not None and isinstance(model, base)


def _hf_renamer(model: nn.Module, targets: dict[str, Any]) -> Any:
    """transformers' own key renaming for ``model`` (``None`` where this release has none)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:
        return None
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", "") or None

    def rename(key: str) -> str:
        new, converted = rename_source_key(key, renamings, converters, prefix, targets)
        if converted is not None:
            raise RuntimeError(
                f"ramtorch.load: checkpoint key {key!r} is converted by transformers when loading "
                f"({converted!r} to {new!r}: its values change, not only its name), which loading in "
                "place does not do: load the model with from_pretrained once and write it with "
                "ramtorch.save_pretrained"
            )
        return new

    return rename


def map_keys(model: nn.Module, keys: Iterable[str], targets: dict[str, Any]) -> dict[str, str]:
    """Checkpoint key -> model key, for a checkpoint holding ``keys`` loaded into ``model`` whose
    state-dict entries are ``targets``. Two checkpoint keys mapped to one model key are an error."""
    keys = list(keys)
    if not _hf_model(model):
        return {k: k for k in keys}
    rename = _hf_renamer(model, targets)
    if rename is None:
        prefix = getattr(model, "base_model_prefix", "")

        def rename(key: str) -> str:
            for pattern, new in _LEGACY:
                key = pattern.sub(new, key)
            if prefix and key.startswith(prefix + ".") and key[len(prefix) + 1 :] in targets:
                return key[len(prefix) + 1 :]
            if prefix and f"{prefix}.{key}" in targets:
                return f"{prefix}.{key}"
            return key

    out: dict[str, str] = {}
    seen: dict[str, str] = {}
    for k in keys:
        new = k if k in targets else rename(k)
        if new in seen:
            raise RuntimeError(
                f"ramtorch.load: checkpoint keys {seen[new]!r} and {k!r} both name the model's {new!r}"
            )
        seen[new] = k
        out[k] = new
    return out


def _patterns(model: nn.Module, attr: str) -> list[str]:
    found: set[str] = set()
    for m in model.modules():
        found.update(getattr(m, attr, None) or ())
    return sorted(found)


def ignored_unexpected(model: nn.Module) -> Any:
    """Predicate on a model key: a checkpoint may hold it although the model's state dict has no
    such entry (transformers' ``_keys_to_ignore_on_load_unexpected``; the model's non-persistent
    buffers, such as ``position_ids`` and rotary ``inv_freq``, which older checkpoints hold)."""
    if not _hf_model(model):
        return lambda key: False
    buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
    patterns = _patterns(model, "_keys_to_ignore_on_load_unexpected")
    if any(b.endswith("rotary_emb.inv_freq") for b in buffers):
        patterns.append(r"rotary_emb\.inv_freq")
    if any(b.endswith("position_ids") for b in buffers):
        patterns.append(r"(^|\.)position_ids$")
    regex = re.compile("|".join(f"({p})" for p in patterns)) if patterns else None
    return lambda key: key in buffers or (regex is not None and regex.search(key) is not None)


def ignored_missing(model: nn.Module) -> Any:
    """Predicate on a model key: the model does not expect checkpoints to hold it
    (transformers' ``_keys_to_ignore_on_load_missing``)."""
    patterns = _patterns(model, "_keys_to_ignore_on_load_missing") if _hf_model(model) else []
    regex = re.compile("|".join(f"({p})" for p in patterns)) if patterns else None
    return lambda key: regex is not None and regex.search(key) is not None
