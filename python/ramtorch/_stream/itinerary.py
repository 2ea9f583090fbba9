"""Slots, the itinerary and prefetch along it.

The *itinerary* is the order in which units ran in the last forward (and the last backward); the
next pass prefetches along it, ``MAX_INFLIGHT`` copies ahead at most, and slots are evicted
farthest-next-use first (a released slot keeps its unit, so the units that end a forward pass start
the backward pass without a copy). A pass that strays from the itinerary is still correct: every
use checks the unit's key (its identity and its parameters' version counters) and copies when the
slot holds anything else; the itinerary is then relearned. By default a copy never serves a later
forward pass: user code between passes may edit weights in ways no version counter sees
(``param.data``), so a pass's start renews every unit's key (:meth:`_Unit.forget_copies`) and
copies its first units; passes of a decoding span after its first (:mod:`.decoding`) and passes
inside ``ramtorch.weights_unchanged`` keep the keys, and take the copies of the pass before.
"""

from __future__ import annotations

import threading
import time

import torch

from .. import _codec, _core, _disk, _engine
from .._units import format_bytes
from . import parts, rows
from .units import _packed_bytes, _Unit


def _raw_parts(u: _Unit) -> list[int]:
    """Where ``u``'s layout is cut, for a unit computed as its copy lands (.rows, .parts)."""
    return rows.copy_parts(u) or parts.copy_parts(u)


def _copy_parts(u: _Unit) -> list[int]:
    """Where ``u``'s copy is cut: :func:`_raw_parts`, or for a unit that streams encoded, where
    the encoded bytes that each of those parts decodes from end."""
    cuts = _raw_parts(u)
    enc = u.encoding() if cuts else None
    if enc is None:
        return cuts
    return sorted({e for e in (_codec.encoded_upto(enc, c) for c in cuts) if 0 < e < enc.nbytes})


class Prefetcher:
    """The slot and prefetch half of :class:`~ramtorch._stream.streamer.Streamer`: units claim
    slots (:meth:`_take`, :meth:`_give`), and the units that come next on the itinerary are copied
    ahead into free ones (:meth:`_prefetch_along`)."""

    units: list[_Unit]
    streamed: list[_Unit]
    by_uid: dict[int, _Unit]
    eng: _engine.DeviceEngine
    device: torch.device
    max_inflight: int
    slots: int
    slot_bytes: int
    ahead: dict[int, tuple[int, int]]
    held: int
    lock: threading.RLock
    counters: dict[str, int]
    #: Whether each forward pass ends with a hook that waits for the pass's copies (a model's
    #: ``Streamer``; not the per-layer ``LayerStreamer``, whose layers run outside any pass).
    pass_ends: bool = False
    # Per taken slot that holds an encoded unit (offload(compress=...)): the buffer its bytes were
    # decoded into, whose views are the unit's weights while the slot is held.
    decoded: dict[int, torch.Tensor]
    decode_stream: torch.cuda.Stream | None
    # Per taken slot whose unit is decoded by parts on the GPU: each part's raw end and the event
    # recorded after its decode (:meth:`claim_part`).
    part_events: dict[int, list[tuple[int, torch.cuda.Event]]]
    # offload(disk=...): reads of disk units' extents started ahead of their use, by uid, with the
    # unit's key when the read began; how many disk units to keep read ahead.
    staged: dict[int, tuple[int, _disk.Read]]
    disk_ahead: int
    disk_store: _disk.Store | None

    # -- slots ------------------------------------------------------------------------------------

    def _free_slots(self) -> int:
        return self.slots - self.held - len(self.ahead)

    def drop_prefetched(self) -> None:
        """Releases slots prefetched but not yet used (and, while none of its units runs, any
        slot an interrupt left taken for this streamer)."""
        with self.lock:
            self._drop_ahead()
            self.settle_interrupted()
            if self._idle():
                self.eng.reconcile(id(self), set())

    def _idle(self) -> bool:
        """Whether none of this streamer's units runs (then it records no slot but its prefetches)."""
        raise NotImplementedError

    def settle_interrupted(self) -> None:
        """See :meth:`~ramtorch._stream.streamer.Streamer.settle_interrupted`."""

    def _recorded(self) -> set[int]:
        """The slots this streamer's running units record (forwards and backwards)."""
        out = {u.bwd for u in self.streamed if u.bwd is not None}
        for u in self.streamed:
            for entry in u.fwd:
                if entry[1]:  # a slot of its own (a recomputation runs on the backward slot)
                    out.add(entry[0])
        return out

    def _reconcile(self) -> None:
        """Matches the engine's record of this streamer's slots with its own: a slot an interrupt
        left between the engine's answer and the record (or a give-back and its record) is given
        back, and ``held`` counts what the running units record."""
        legit = self._recorded()
        self.held = len(legit)
        self.eng.reconcile(id(self), legit | {slot for slot, _ in self.ahead.values()})

    def __del__(self) -> None:
        # Slots belong to the device's engine, shared with other models: give back what this
        # model's prefetches still hold.
        try:
            while self.ahead:
                self.eng.release(self.ahead.popitem()[1][0])  # forgotten first: never freed twice
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _drop_ahead(self, uid: int | None = None) -> None:
        items = list(self.ahead.items()) if uid is None else [(uid, self.ahead[uid])]
        for k, (slot, _) in items:
            del self.ahead[k]
            self.eng.release(slot)
            self.counters["prefetch_wasted"] += 1

    def _copies_ahead(self) -> int:
        """How many copies the host may have in flight before a prefetch blocks:
        ``max_inflight``, or :data:`~ramtorch._engine.COPIES_AHEAD` (if larger) where it is set
        and the pass's end waits for the pass's copies."""
        ahead = _engine.COPIES_AHEAD
        if ahead is None or not self.pass_ends:
            return self.max_inflight
        return max(ahead, self.max_inflight)

    def _prefetch(self, u: _Unit, key: int, keep: list[int]) -> int:
        assert u.layout is not None and u.flat is not None
        if self._free_slots() <= 0 and self.ahead:
            self._drop_ahead()
        if self._free_slots() <= 0:
            if torch._C._current_graph_task_id() != -1:
                # Inside backward: a checkpointed region's recomputation, whose units each keep
                # their slot until their own backward.
                raise RuntimeError(
                    f"ramtorch.offload: all {self.slots} device slots are held while unit {u.name!r} "
                    "needs one inside backward: an activation-checkpointed region "
                    "(torch.utils.checkpoint) is recomputed there, and each streamed unit it spans "
                    "keeps its slot until its own backward, so a region may span at most as many "
                    "units as there are slots; checkpoint each block apart (as transformers' "
                    "gradient_checkpointing_enable does), or raise gpu_budget or max_inflight"
                )
            raise RuntimeError(
                f"ramtorch.offload: all {self.slots} device slots are held while unit {u.name!r} "
                "needs one (units nested deeper than the slots allow); raise gpu_budget or "
                "max_inflight"
            )
        src, nbytes = self._source(u, True)  # type: ignore[misc]
        try:
            slot, _ = self.eng.prefetch(
                key, src, nbytes, self._copies_ahead(), keep, u.tag, id(self), _copy_parts(u)
            )
        except _core.SlotsExhausted:
            # The device's slots are shared with other models and layers: ask every holder of a
            # speculative prefetch to give it back, then try once more.
            self.eng.reclaim()
            slot, _ = self.eng.prefetch(
                key, src, nbytes, self._copies_ahead(), keep, u.tag, id(self), _copy_parts(u)
            )
        return slot

    def _take(self, u: _Unit, keep: list[int], claim: bool = True) -> int:
        """A claimed slot holding ``u``'s current weights (``claim=False``: not claimed, where the
        unit streams raw; the caller waits for its copy, :mod:`.rows`)."""
        # A pipelined optimizer step may still be writing these weights.
        _engine.wait_updates(u.params)
        if not u.is_home():
            # Its parameters were set anew in place (``param.data = ...``, a submodule's
            # ``.double()``): packed again, if they still fit the slots.
            self._check_fits(u)
            self._drop_ahead()
            u.pack()
        enc = u.encoding()  # (encoded again first if the weights changed: the key names it)
        key = u.key()
        hit = self.ahead.pop(u.uid, None)  # forgotten first: an interrupt leaks, never frees twice
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
        self.decoded.pop(slot, None)
        waits = self.part_events.pop(slot, None)
        if waits:
            # (A forward that stopped between parts: the decode still reads the slot.)
            torch.cuda.current_stream(self.device).wait_event(waits[-1][1])
        if enc is None:
            if claim:
                self.eng.claim(slot, u.tag)
            return slot
        buf = self.eng.slot(slot)
        # A unit computed as its copy lands (``claim=False``) decodes by parts where its codec
        # can: each part once its bytes have landed, and each layer (or block of rows) waits for
        # its part's decode (:meth:`claim_part`).
        cuts = [] if claim or not _codec.by_parts(enc.codec) else _raw_parts(u)
        if buf.is_cuda:
            # Decoded on a stream of its own, which waits for the copy: the decode of the next
            # unit runs beside the compute of this one. The buffer is allocated on that stream
            # and, used on the compute stream, is not reused before the compute is done with it.
            compute = torch.cuda.current_stream(buf.device)
            if self.decode_stream is None:
                self.decode_stream = torch.cuda.Stream(buf.device)
            with torch.cuda.stream(self.decode_stream):
                out = torch.empty(enc.raw, dtype=torch.uint8, device=buf.device)
                waits = self._decode(u, slot, enc, buf, out, cuts)
            if waits:
                self.part_events[slot] = waits
            else:
                compute.wait_stream(self.decode_stream)
            out.record_stream(compute)
        else:
            out = torch.empty(enc.raw, dtype=torch.uint8, device=buf.device)
            self._decode(u, slot, enc, buf, out, cuts)
        self.decoded[slot] = out
        self.counters["decoded_bytes"] += enc.raw
        return slot

    def _decode(
        self, u: _Unit, slot: int, enc: _codec.Encoded, buf: torch.Tensor, out: torch.Tensor, cuts: list[int]
    ) -> list[tuple[int, torch.cuda.Event]]:
        """Decodes ``slot``'s encoded bytes ``buf`` into ``out`` on the current stream, whole or
        (``cuts``: raw offsets) part by part, each after the copy of the bytes it reads; on a GPU,
        per part its raw end and an event recorded after its decode."""
        waits: list[tuple[int, torch.cuda.Event]] = []
        lo = 0
        for hi in [*cuts, enc.raw]:
            if hi <= lo:
                continue
            self.eng.claim_part(slot, _codec.encoded_upto(enc, hi), u.tag)
            _codec.decode((enc.codec, enc.meta), buf, out, lo, hi)
            if out.is_cuda:
                ev = torch.cuda.Event()
                ev.record()
                waits.append((hi, ev))
            lo = hi
        self.eng.claim(slot, u.tag)  # (the whole copy: counted, and what a release waits on)
        return waits if len(waits) > 1 else []

    def claim_part(self, slot: int, upto: int, tag: int) -> None:
        """Makes the current stream wait until the raw bytes of ``slot``'s unit below ``upto`` are
        there: copied, or (a unit decoded by parts) decoded."""
        waits = self.part_events.get(slot)
        if waits is None:
            self.eng.claim_part(slot, upto, tag)
            return
        ev = next((e for end, e in waits if end >= upto), waits[-1][1])
        torch.cuda.current_stream(self.device).wait_event(ev)

    def claim_whole(self, slot: int, tag: int) -> None:
        """:meth:`claim_part` for all of the unit's bytes."""
        waits = self.part_events.get(slot)
        if waits is None:
            self.eng.claim(slot, tag)
            return
        torch.cuda.current_stream(self.device).wait_event(waits[-1][1])

    def weights_buffer(self, slot: int) -> torch.Tensor:
        """The device bytes of the unit a taken ``slot`` holds, in its layout: the slot itself, or
        the buffer its encoded bytes were decoded into."""
        out = self.decoded.get(slot)
        return out if out is not None else self.eng.slot(slot)

    def _check_fits(self, u: _Unit) -> None:
        """Refuses, naming the unit and what changed, parameters of ``u`` that no longer fit the
        slots this streamer planned (converted to a wider dtype after ``offload``)."""
        nbytes = _packed_bytes(u.params)
        if not self.slot_bytes or nbytes <= self.slot_bytes:
            return
        lay = u.layout
        planned = [] if lay is None or u.tree is not None else [e[2] if e else None for e in lay.entries]
        changed = [
            f"{u._qualified_name(e)} is {u.params[e.index].dtype} (was {planned[e.index]})"
            for e in u.entries
            if e.index < len(planned) and u.params[e.index].dtype != planned[e.index]
        ]
        what = "; ".join(dict.fromkeys(changed)) or "its parameters were set anew with larger ones"
        raise RuntimeError(
            f"ramtorch.offload: unit {u.name!r} was changed after offload ({what}): it now takes "
            f"{format_bytes(nbytes)}, more than the {format_bytes(self.slot_bytes)} device slots that "
            "offload reserved for it. Convert the model before ramtorch.offload, or convert the unit "
            "back"
        )

    def _give(self, slot: int) -> None:
        self.held -= 1
        self.decoded.pop(slot, None)
        waits = self.part_events.pop(slot, None)
        if waits:
            # (A forward that stopped between parts: the decode still reads the slot.)
            torch.cuda.current_stream(self.device).wait_event(waits[-1][1])
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

    def _source(self, u: _Unit, wait: bool) -> tuple[torch.Tensor, int] | None:
        """The host bytes that cross the link for ``u`` (see :meth:`_Unit.source`); for a unit on
        disk, the staging buffer its extent was read into (read now, or waited for, if ``wait``;
        else ``None`` while the read is not done). A unit in host RAM whose optimizer states are
        on disk and updated during the backward starts their reads with its backward copy (as a
        disk unit's backward read does, :meth:`_Unit.disk_read`)."""
        if u.disk is None:
            store = self.disk_store
            if store is not None and store.optimizer_on_disk and self._read_cached(u):
                _disk.hint_states(u.params)
            return u.source()
        assert u.layout is not None
        enc = u.encoding()  # (encoded again first if the weights changed: the key names it)
        nbytes = enc.nbytes if enc is not None else u.layout.nbytes
        key = u.key()
        entry = self.staged.get(u.uid)
        if entry is not None and entry[0] != key:
            del self.staged[u.uid]  # read before the weights changed
            entry = None
        if entry is None:
            if not wait:
                return None
            entry = (key, u.disk_read(self._read_cached(u)))
            self.counters["disk_reads_on_demand"] += 1
        elif not wait and not entry[1].done():
            return None
        self.staged.pop(u.uid, None)
        read = entry[1]
        spans = _engine.host_spans
        t0 = time.perf_counter()
        try:
            buf = read.wait()
        except OSError as e:
            # Nothing was taken for the unit: its next use reads its extent again.
            raise OSError(
                e.errno, f"ramtorch: reading unit {u.name!r} from its disk store failed: {e.strerror or e}"
            ) from e
        if spans is not None:  # (ramtorch.trace)
            t1 = time.perf_counter()
            times = read.ticket.times()
            if times is not None:
                spans.add(spans.DISK, "disk read", times[0], times[1], u.params, self.device)
            if t1 - t0 > 1e-5:
                spans.add(spans.DISK_WAITS, "wait for the disk", t0, t1, u.params, self.device)
        return buf, nbytes

    def _read_cached(self, u: _Unit) -> bool:
        """Whether ``u``'s extent is read through the page cache (see :meth:`ramtorch._disk.
        Extent.read`): when its weights are about to be updated on the host."""
        return False

    def _read_ahead(self, itin: list[int], pos: int, skip: frozenset[int] = frozenset()) -> None:
        """Starts reading the next disk units along ``itin`` from ``pos`` (``disk_ahead`` of
        them at most, counting those read or being read; none of ``skip``), so the store reads
        continuously while the units before them run. A read begun for weights that have since
        changed is dropped when its unit is reached."""
        if self.disk_store is None:
            return
        want: list[_Unit] = []
        for uid in itin[pos:]:
            u = self.by_uid.get(uid)
            if u is None or u.disk is None or u.resident or u in want or uid in skip:
                continue
            want.append(u)
            if len(want) >= self.disk_ahead:
                break
        names = {u.uid for u in want}
        for uid in [k for k in self.staged if k not in names]:
            del self.staged[uid]  # off the itinerary now (the read, if in flight, ends on its own)
        for u in want:
            if u.uid in self.staged or u.uid in self.ahead or u.fwd or u.bwd is not None:
                continue
            if not u.is_home() or _engine.updating(u.params):
                continue  # (an update still writing its weights: read when it is reached)
            read = u.disk_read(self._read_cached(u))
            self.staged[u.uid] = (u.key(), read)
            self.counters["disk_reads_ahead"] += 1

    def _prefetch_along(
        self,
        itin: list[int],
        pos: int,
        current: _Unit | None,
        ahead: tuple[list[_Unit], list[int]] | None = None,
    ) -> None:
        """Queues the copies of the units next on ``itin`` from ``pos`` (not ``current``) into
        free slots. ``ahead``: those units (``_lookahead(itin, pos)``) and their keys, where the
        caller has just computed them under the lock with no user code run since."""
        self._read_ahead(itin, pos)
        if ahead is None:
            nxt = self._lookahead(itin, pos)
            keep = [u.key() for u in nxt]
        else:
            nxt, keep = ahead
        for u, key in zip(nxt, keep):
            if u is current or u.uid in self.ahead or u.fwd or u.bwd is not None:
                continue
            if self._free_slots() <= 0 or not u.is_home() or _engine.updating(u.params):
                break
            try:
                got = self._source(u, False)
                if got is None:
                    break  # its extent is still being read: copied when it is there
                src, nbytes = got
                slot, _ = self.eng.prefetch(
                    key, src, nbytes, self._copies_ahead(), keep, u.tag, id(self), _copy_parts(u)
                )
            except (_core.SlotsExhausted, ValueError):
                break  # speculative: never worth an error (nor a key an interrupt left held)
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
