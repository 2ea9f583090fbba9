"""Slots, the itinerary and prefetch along it.

The *itinerary* is the order in which units ran in the last forward (and the last backward); the
next pass prefetches along it, ``MAX_INFLIGHT`` copies ahead at most, and slots are evicted
farthest-next-use first (a released slot keeps its unit, so the units that end a forward pass start
the backward pass without a copy). A pass that strays from the itinerary is still correct: every
use checks the unit's key (its identity and its parameters' version counters) and copies when the
slot holds anything else; the itinerary is then relearned.
"""

from __future__ import annotations

import threading

from .. import _core, _engine
from .units import _Unit


class Prefetcher:
    """The slot and prefetch half of :class:`~ramtorch._stream.streamer.Streamer`: units claim
    slots (:meth:`_take`, :meth:`_give`), and the units that come next on the itinerary are copied
    ahead into free ones (:meth:`_prefetch_along`)."""

    units: list[_Unit]
    by_uid: dict[int, _Unit]
    eng: _engine.DeviceEngine
    max_inflight: int
    slots: int
    ahead: dict[int, tuple[int, int]]
    held: int
    lock: threading.RLock
    counters: dict[str, int]

    # -- slots ------------------------------------------------------------------------------------

    def _free_slots(self) -> int:
        return self.slots - self.held - len(self.ahead)

    def drop_prefetched(self) -> None:
        """Releases slots prefetched but not yet used."""
        with self.lock:
            self._drop_ahead()

    def __del__(self) -> None:
        # Slots belong to the device's engine, shared with other models: give back what this
        # model's prefetches still hold.
        try:
            for slot, _ in self.ahead.values():
                self.eng.release(slot)
            self.ahead.clear()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _drop_ahead(self, uid: int | None = None) -> None:
        items = list(self.ahead.items()) if uid is None else [(uid, self.ahead[uid])]
        for k, (slot, _) in items:
            del self.ahead[k]
            self.eng.release(slot)
            self.counters["prefetch_wasted"] += 1

    def _prefetch(self, u: _Unit, key: int, keep: list[int]) -> int:
        assert u.layout is not None and u.flat is not None
        if self._free_slots() <= 0 and self.ahead:
            self._drop_ahead()
        if self._free_slots() <= 0:
            raise RuntimeError(
                f"ramtorch.offload: all {self.slots} device slots are held while unit {u.name!r} "
                "needs one (units nested deeper than the slots allow); raise gpu_budget or "
                "max_inflight"
            )
        try:
            slot, _ = self.eng.prefetch(key, u.flat, u.layout.nbytes, self.max_inflight, keep, u.tag)
        except _core.SlotsExhausted:
            # The device's slots are shared with other models and layers: ask every holder of a
            # speculative prefetch to give it back, then try once more.
            self.eng.reclaim()
            slot, _ = self.eng.prefetch(key, u.flat, u.layout.nbytes, self.max_inflight, keep, u.tag)
        return slot

    def _take(self, u: _Unit, keep: list[int]) -> int:
        """A claimed slot holding ``u``'s current weights."""
        # A pipelined optimizer step may still be writing these weights.
        _engine.wait_updates(u.params)
        if not u.is_home():
            self._drop_ahead()
            u.pack()
        key = u.key()
        hit = self.ahead.pop(u.uid, None)
        if hit is not None and hit[1] != key:
            self.eng.release(hit[0])
            self.counters["prefetch_wasted"] += 1
            hit = None
        if hit is not None:
            slot = hit[0]
            self.counters["prefetch_hits"] += 1
        else:
            slot = self._prefetch(u, key, keep)
        self.held += 1
        self.eng.claim(slot, u.tag)
        return slot

    def _give(self, slot: int) -> None:
        self.held -= 1
        self.eng.release(slot)

    def _lookahead(self, itin: list[int], pos: int) -> list[_Unit]:
        out: list[_Unit] = []
        depth = min(self.max_inflight, max(self.slots - 1, 0))
        for uid in itin[pos:]:
            if len(out) >= depth:
                break
            u = self.by_uid.get(uid)  # (a free-standing unit whose layer is gone: None)
            if u is not None and not u.resident and u not in out:
                out.append(u)
        return out

    def _prefetch_along(self, itin: list[int], pos: int, current: _Unit | None) -> None:
        nxt = self._lookahead(itin, pos)
        keep = [u.key() for u in nxt]
        for u in nxt:
            if u is current or u.uid in self.ahead or u.fwd or u.bwd is not None:
                continue
            if self._free_slots() <= 0 or not u.is_home() or _engine.updating(u.params):
                break
            key = u.key()
            try:
                slot, _ = self.eng.prefetch(key, u.flat, u.layout.nbytes, self.max_inflight, keep, u.tag)
            except _core.SlotsExhausted:
                break  # speculative: never worth an error
            self.ahead[u.uid] = (slot, key)
            self.counters["prefetches"] += 1

    @staticmethod
    def _advance(itin: list[int], pos: int, uid: int) -> int:
        """The itinerary position after ``uid`` ran: its next occurrence from ``pos`` on, else its
        first one (the order changed: what followed it last time comes next), else the end."""
        if pos < len(itin) and itin[pos] == uid:
            return pos + 1
        try:
            return itin.index(uid, pos) + 1
        except ValueError:
            pass
        try:
            return itin.index(uid) + 1
        except ValueError:
            return len(itin)
