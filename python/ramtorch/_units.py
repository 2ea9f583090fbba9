"""Sizes for humans: byte counts parsed from strings such as ``"24GiB"`` and formatted back."""

from __future__ import annotations

import math
import re

__all__ = ["format_bytes", "parse_bytes"]

_GIB = 1 << 30
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9}
_UNITS.update({"t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})
#: Largest size accepted (1 EiB): far above any memory, far below what overflows a C integer.
_MAX = 1 << 60


def parse_bytes(value: int | float | str | None, what: str = "size") -> int | None:
    """``None`` → ``None``; ints (and floats holding a whole number, ``8e9``) are bytes; strings
    such as ``"24GiB"``, ``"1.5 GB"``, ``"512MiB"`` (a size with a unit of at least a kilobyte is
    rounded down to whole bytes).

    Raises ``TypeError`` for other types and ``ValueError`` (naming ``what``) for negative, non-finite,
    absurdly large or unparsable sizes, and for a fraction of a byte (``1.5``, ``"0.5B"``: most
    likely a unit left out), which would otherwise be rounded down without a word."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a byte count or a string such as '24GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0 or (isinstance(value, float) and not math.isfinite(value)):
            raise ValueError(f"{what} must be a non-negative byte count, got {value!r}")
        if isinstance(value, float) and not value.is_integer():
            raise _fraction(what, value)
        n = int(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"{what}={value!r} is not a size; use bytes or a number with a unit "
                "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
            )
        scale = _UNITS[m.group(2).lower()]
        x = float(m.group(1)) * scale
        if math.isfinite(x) and not x.is_integer() and (scale == 1 or x < 1):
            raise _fraction(what, value)
        n = int(x) if math.isfinite(x) and x <= _MAX else _MAX + 1
    else:
        raise TypeError(
            f"{what} must be a byte count or a string such as '24GiB', got {type(value).__name__}"
        )
    if n > _MAX:
        raise ValueError(f"{what}={value!r} is larger than any memory (at most {_MAX} bytes)")
    return n


def _fraction(what: str, value: float | str) -> ValueError:
    """The error for a size that is a fraction of a byte."""
    return ValueError(
        f"{what}={value!r} is a fraction of a byte; give an int of bytes (8589934592) or a string "
        "with a unit, such as '8GiB' or '1.5GB'"
    )


def format_bytes(n: int) -> str:
    """``n`` bytes for a message: plain bytes under 1 KiB, then KiB and MiB with one decimal, GiB
    and TiB with two (``"512 B"``, ``"1.5 KiB"``, ``"5.0 MiB"``, ``"3.00 GiB"``)."""
    n = int(n)
    for unit, scale, digits in _FORMATS:
        if abs(n) >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n} B"


_FORMATS = (("TiB", 1 << 40, 2), ("GiB", 1 << 30, 2), ("MiB", 1 << 20, 1), ("KiB", 1 << 10, 1))
