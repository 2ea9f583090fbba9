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
    minimum: int | None = None
    for count in range(want_slots, 1, -1):
        for k in range(len(free) + 1):
            res, rest = free[:k], free[k:]
            slot = _align(sizes[rest[0]]) if rest else 0
            need = base + sum(sizes[i] for i in res) + (count * slot if rest else 0)
            if count == 2:
                minimum = need if minimum is None else min(minimum, need)
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
        raise ValueError(
            f"gpu_budget of {_fmt(budget)} is too small for this model: it needs at least "
            f"{_fmt(minimum or base)} ({_fmt(base)} resident that cannot stream, plus two slots of "
            f"the largest streamed unit, {_fmt(_align(sizes[free[0]]) if free else 0)} each)"
        )
    return best[1]


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
