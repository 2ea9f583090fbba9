"""Converting existing models."""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Iterable

import torch
from torch import nn

from .nn import Linear


def replace_linear(
    model: nn.Module,
    skip: Iterable[str] = (),
    min_params: int = 0,
    device: torch.device | str | None = None,
    max_inflight: int | None = None,
) -> nn.Module:
    """Swaps every ``nn.Linear`` of ``model`` for a :class:`ramtorch.nn.Linear` holding the same
    (trained) weights in host RAM. Returns the model (changed in place; a bare ``nn.Linear`` given
    as ``model`` is returned converted).

    Args:
        model: the model to convert.
        skip: ``fnmatch`` patterns on qualified module names to leave alone
            (e.g. ``("lm_head", "*.gate")``).
        min_params: leave layers with fewer weight elements than this on their device.
        device: compute device of the new layers (default: where each layer's weight is).
        max_inflight: copies in flight (default from the environment, else 2).

    Projections inside ``nn.MultiheadAttention`` are left alone (it reads their weights directly
    instead of calling them). A Linear whose weight is shared with another module (tied
    embeddings) is left alone, with a warning: moving it would untie the weights.
    """
    patterns = tuple(skip)
    if isinstance(model, nn.Linear) and not isinstance(model, Linear):
        return Linear.from_linear(model, device=device, max_inflight=max_inflight)
    owners: dict[int, int] = {}
    for _, mod in model.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            qual = f"{name}.{child_name}" if name else child_name
            if not isinstance(child, nn.Linear) or isinstance(child, Linear):
                continue
            if isinstance(module, nn.MultiheadAttention):
                continue  # reads out_proj.weight directly instead of calling the layer
            if any(fnmatch.fnmatchcase(qual, pat) for pat in patterns):
                continue
            if child.weight.numel() < min_params:
                continue
            if owners.get(id(child.weight), 0) > 1:
                warnings.warn(
                    f"replace_linear: {qual!r} shares its weight with another module (tied "
                    "weights); it is left as it is",
                    stacklevel=2,
                )
                continue
            new = Linear.from_linear(child, device=device, max_inflight=max_inflight)
            setattr(module, child_name, new)
    return model
