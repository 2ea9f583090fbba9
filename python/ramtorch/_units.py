"""Size parsing and byte formatting: ``"24GiB"`` and friends (used by every layer)."""

from __future__ import annotations

import math
import re

_GIB = 1 << 30
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9}
_UNITS.update({"t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})


def parse_bytes(value: int | float | str | None, what: str = "gpu_budget") -> int | None:
    """``None`` → ``None``; ints are bytes; strings such as ``"24GiB"``, ``"1.5 GB"``, ``"512MiB"``."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a byte count or a string such as '24GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0 or (isinstance(value, float) and not math.isfinite(value)):
            raise ValueError(f"{what} must be a non-negative byte count, got {value!r}")
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"{what}={value!r} is not a size; use bytes or a number with a unit "
                "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
            )
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise TypeError(f"{what} must be a byte count or a string such as '24GiB', got {type(value).__name__}")


def fmt_bytes(n: int) -> str:
    """``n`` bytes for people: GiB from a quarter GiB up, MiB below."""
    return f"{n / _GIB:.2f} GiB" if n >= (1 << 28) else f"{n / (1 << 20):.1f} MiB"


_fmt = fmt_bytes
