"""Configuration: constructor arguments first, environment variables as defaults."""

from __future__ import annotations

import os

from . import _core
from ._units import parse_bytes

#: Environment variables read for the number of copies in flight, strongest first.
MAX_INFLIGHT_VARS = ("RAMTORCH_MAX_INFLIGHT", "MAX_INFLIGHT")


def _check(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    if not 1 <= value <= _core.MAX_MAX_INFLIGHT:
        raise ValueError(f"{what} must be between 1 and {_core.MAX_MAX_INFLIGHT}, got {value}")
    return value


def max_inflight(value: int | None = None) -> int:
    """Copies allowed in flight per device: ``value`` if given, else ``RAMTORCH_MAX_INFLIGHT``,
    else ``MAX_INFLIGHT``, else 2. An invalid value raises an error naming where it came from."""
    if value is not None:
        return _check(value, "max_inflight")
    for name in MAX_INFLIGHT_VARS:
        raw = os.environ.get(name)
        if raw is None or raw.strip() == "":
            continue
        try:
            parsed = int(raw.strip())
        except ValueError:
            raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
        return _check(parsed, f"environment variable {name}")
    return _core.DEFAULT_MAX_INFLIGHT


#: Environment variable for the table size from which embeddings stream by rows.
GATHER_MIN_BYTES_VAR = "RAMTORCH_GATHER_MIN_BYTES"
#: Default of :func:`gather_min_bytes`: 16 MiB.
DEFAULT_GATHER_MIN_BYTES = 16 << 20


def gather_min_bytes() -> int:
    """Tables of at least this many bytes stream by rows (the rows a lookup reads cross the link,
    not the table; see ``ramtorch._stream.gather``): ``RAMTORCH_GATHER_MIN_BYTES`` (bytes, or a size
    such as ``"64MiB"``), else 16 MiB. An invalid value raises an error naming the variable."""
    raw = os.environ.get(GATHER_MIN_BYTES_VAR)
    if raw is None or raw.strip() == "":
        return DEFAULT_GATHER_MIN_BYTES
    value = parse_bytes(raw.strip(), f"environment variable {GATHER_MIN_BYTES_VAR}")
    assert value is not None
    return value


#: Environment variable for the unit size from which a unit of torch's layers is computed by parts
#: as its copy lands (``ramtorch._stream.parts``).
UNIT_PARTS_MIN_BYTES_VAR = "RAMTORCH_UNIT_PARTS_MIN_BYTES"
#: Default of :func:`unit_parts_min_bytes`: 64 MiB.
DEFAULT_UNIT_PARTS_MIN_BYTES = 64 << 20


def unit_parts_min_bytes() -> int | None:
    """Units of torch's layers of at least this many bytes may be copied and computed by parts
    (``ramtorch._stream.parts``): ``RAMTORCH_UNIT_PARTS_MIN_BYTES`` (bytes, or a size such as
    ``"64MiB"``; ``"off"``: never), else 64 MiB. An invalid value raises an error naming the
    variable."""
    return _size_var(UNIT_PARTS_MIN_BYTES_VAR, DEFAULT_UNIT_PARTS_MIN_BYTES)


def _size_var(name: str, default: int) -> int | None:
    """The size in environment variable ``name`` (bytes, or a size such as ``"64MiB"``; ``"off"``:
    ``None``), ``default`` when unset or empty; an invalid value raises an error naming it."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    if raw.strip().lower() == "off":
        return None
    return parse_bytes(raw.strip(), f"environment variable {name}")


#: Environment variable for the share of host-accumulated gradients summed on the GPU instead.
STREAMED_SUM_SHARE_VAR = "RAMTORCH_STREAMED_SUM_SHARE"


def streamed_sum_share() -> float | None:
    """Of the gradients that add onto a ``.grad`` in host memory (an accumulating loop whose
    running sums do not all fit on the GPU), the share, in bytes, whose ``.grad`` is copied to the
    GPU and summed there instead, the sum crossing back whole (two bytes of host memory traffic
    and one more link crossing per gradient byte, against four bytes of host memory traffic for
    an add on the host): ``RAMTORCH_STREAMED_SUM_SHARE`` (from 0 to 1), else None (chosen per
    run from timings: ``ramtorch._engine.ShareChoice``). An invalid value raises an error naming
    the variable."""
    raw = os.environ.get(STREAMED_SUM_SHARE_VAR)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError(f"environment variable {STREAMED_SUM_SHARE_VAR}={raw!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"environment variable {STREAMED_SUM_SHARE_VAR}={raw!r} must be between 0 and 1")
    return value


#: Environment variable for the size up to which a parameter stays on the device instead of
#: streaming with its unit (``ramtorch._stream.units.small_params``).
SMALL_PARAM_BYTES_VAR = "RAMTORCH_SMALL_PARAM_BYTES"
#: Default of :func:`small_param_bytes`: 64 KiB (a norm's weight or a bias of a model 32768 wide in
#: bf16).
DEFAULT_SMALL_PARAM_BYTES = 64 << 10


def small_param_bytes() -> int:
    """Parameters of at most this many bytes stay on the device (see
    ``ramtorch._stream.units.small_params``): ``RAMTORCH_SMALL_PARAM_BYTES`` (bytes, or a size
    such as ``"16KiB"``; ``0`` or ``"off"``: none), else 64 KiB. An invalid value raises an error
    naming the variable."""
    return _size_var(SMALL_PARAM_BYTES_VAR, DEFAULT_SMALL_PARAM_BYTES) or 0
