"""The planner: which units stay resident within a device budget, and how the rest stream."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .._units import format_bytes as _fmt


@dataclass
class Plan:
    """Which units stay resident and how the rest stream."""

    resident: list[int]
    slots: int
    slot_bytes: int
    resident_bytes: int
    streamed_bytes: int


def _align(n: int) -> int:
    return -(-n // 64) * 64


def plan(
    sizes: Sequence[int], forced: Iterable[int], budget: int | None, max_inflight: int, forced_bytes: int = 0
) -> Plan:
    """Picks resident units for ``budget`` bytes: most bytes resident (fewest streamed per pass),
    then most slots. ``forced`` units must be resident; ``forced_bytes`` (buffers, tied weights) are
    held on the device too. Raises ``ValueError`` with the smallest budget that works."""
    forced = set(forced)
    want_slots = max_inflight + 1
    base = forced_bytes + sum(sizes[i] for i in forced)
    free = sorted((i for i in range(len(sizes)) if i not in forced), key=lambda i: -sizes[i])
    if budget is None:
        slot = _align(max((sizes[i] for i in free), default=0))
        return Plan(sorted(forced), want_slots if free else 0, slot, base, sum(sizes[i] for i in free))
    best: tuple[tuple[int, int], Plan] | None = None
    # The smallest budget that works: (bytes, units kept resident, their bytes, slot bytes).
    minimum: tuple[int, int, int, int] | None = None
    for count in range(want_slots, 1, -1):
        for k in range(len(free) + 1):
            res, rest = free[:k], free[k:]
            slot = _align(sizes[rest[0]]) if rest else 0
            kept = sum(sizes[i] for i in res)
            need = base + kept + (count * slot if rest else 0)
            if count == 2 and (minimum is None or need < minimum[0]):
                minimum = (need, k, kept, slot if rest else 0)
            if need > budget:
                continue
            left = budget - need
            extra = []
            for i in rest[1:]:
                if sizes[i] <= left:
                    extra.append(i)
                    left -= sizes[i]
            resident = res + extra
            streamed = sum(sizes[i] for i in rest) - sum(sizes[i] for i in extra)
            p = Plan(
                sorted(forced | set(resident)),
                count if streamed or len(rest) > len(extra) else 0,
                slot if len(rest) > len(extra) else 0,
                base + sum(sizes[i] for i in resident),
                streamed,
            )
            score = (streamed, -count)
            if best is None or score < best[0]:
                best = (score, p)
    if best is None:
        raise ValueError(too_small(budget, minimum or (base, 0, 0, 0), base, [sizes[i] for i in free]))
    return best[1]


def too_small(budget: int, minimum: tuple[int, int, int, int], base: int, free: Sequence[int]) -> str:
    """The message for a budget below ``minimum`` (bytes, units kept resident, their bytes, slot
    bytes; see :func:`plan`), written as the sum that gives it: ``base`` bytes that must stay on
    the device, the units kept resident, two slots for the rest. ``free``: the sizes of the units
    that may stream."""
    need, kept_units, kept, slot = minimum
    terms: list[tuple[str, str]] = []  # (bytes, what they are for)
    if base:
        terms.append(
            (
                _fmt(base),
                "that cannot stream (tied weights, small parameters, buffers, parameters of modules "
                "holding blocks)",
            )
        )
    if kept_units:
        which = "its only unit" if len(free) == 1 else f"{kept_units} of its {len(free)} units"
        terms.append((_fmt(kept), f"to keep {which} resident"))
    if slot:
        terms.append((f"2 slots x {_fmt(slot)}", "for the units that stream"))
    msg = f"gpu_budget of {_fmt(budget)} is too small for this model: it needs at least {_fmt(need)}"
    notes = []
    if len(terms) == 1 and terms[0][0] == _fmt(need):
        notes.append(terms[0][1])
    elif terms:
        msg += " = " + " + ".join(f"{n} {what}" for n, what in terms)
    if free and kept_units == len(free):
        largest = _align(max(free))
        notes.append(
            f"streaming its largest unit instead would take 2 slots x {_fmt(largest)} = {_fmt(2 * largest)}"
        )
    return msg + (f" ({'; '.join(notes)})" if notes else "")


def spread_resident(sizes: Sequence[int], resident: set[int], forced: set[int]) -> set[int]:
    """Among units of equal size (the blocks), which ones stay resident does not change the
    bytes: spread them evenly along the model's order, so each run of resident blocks is short
    and its compute overlaps the copy of the next streamed block instead of idling the link."""
    out = set(resident)
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(sizes):
        if i not in forced:
            groups.setdefault(n, []).append(i)
    for members in groups.values():
        chosen = [i for i in members if i in resident]
        if not chosen or len(chosen) == len(members):
            continue
        n, r = len(members), len(chosen)
        out -= set(chosen)
        out |= {members[min(n - 1, int((j + 0.5) * n / r))] for j in range(r)}
    return out
