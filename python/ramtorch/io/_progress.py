"""The progress bar of loading and saving: over bytes, on stderr, shown by default above 1 GiB."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["progress_bar"]

_GIB = 1 << 30


def progress_bar(show: bool | None, total: int, desc: str) -> Any:
    """A tqdm bar over ``total`` bytes, or ``None``: ``show`` True/False forces it on/off, ``None``
    shows it for more than 1 GiB. Without tqdm installed, ``show=True`` raises ``ImportError``."""
    if not (show if show is not None else total > _GIB):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        if show:
            raise
        return None
    return tqdm(
        total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False, file=sys.stderr
    )
