"""Kept stores: the disk tier's store as a checkpoint of the model (``offload(..., keep=True)``).

A kept store is a directory (the ``disk=`` of :func:`ramtorch.offload`) holding:

- ``units.bin``: the disk units' extents (``ramtorch._disk.Store``, its name kept);
- ``states.bin``: with ``optimizer_on_disk=True``, the optimizer states of those units'
  parameters (``ramtorch._disk.DiskStates``);
- ``rest-<serial>.safetensors``: at each commit, everything else the model, the optimizer and the
  caller need to resume (tensors outside the store, the optimizer's other states and step counts,
  the ``extra`` dict, the RNG states), written by :func:`ramtorch.save_checkpoint`;
- ``journal.bin``: the undo journal of the store's bytes since the last commit;
- ``ramtorch-store.json``: the manifest, replaced atomically at each commit: the model's
  fingerprint, the serial of the last commit and its rest file.

Commits (:meth:`Kept.commit`: ``ramtorch.commit``, the end of ``offload`` and of
``ramtorch.load``) make the store's files durable (``msync``, ``fdatasync``), write the rest file,
then replace the manifest: the manifest's rename is the commit point. Between commits, an
optimizer update of a kept parameter first saves the bytes it is about to overwrite (the
parameter's weight and its states extent) to the journal, durably (data, ``fdatasync``, then the
record's header, ``fdatasync``); only then are they written. Reopening a store whose journal holds
records of the manifest's serial writes them back, newest first: every byte is as the last commit
left it, whatever the process was doing when it ended (a SIGKILL, a power loss). Writes the
journal does not see (``ramtorch.load``, writes through ``.data``, torch's optimizers) mark the
store *dirty* first; a dirty store found on reopening is not trusted and is made anew from the
model.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import hashlib
import json
import logging
import os
import threading
import warnings
import weakref
import zlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from . import _disk

logger = logging.getLogger("ramtorch")

MANIFEST = "ramtorch-store.json"
UNITS = "units.bin"
STATES = "states.bin"
JOURNAL = "journal.bin"
FORMAT = 1
_BLOCK = 4096
_MAGIC = "ramtorch-journal"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fingerprint(model: nn.Module, units: Sequence[Any], compress: str | None) -> dict[str, Any]:
    """What a store must match to be this model's: the disk units (names, their parameters'
    shapes and dtypes, their bytes), whether encoded extents follow, and a digest of the model's
    state-dict keys, shapes and dtypes."""
    keys = [
        [k, list(v.shape), _dtype_name(v.dtype)]
        for k, v in model.state_dict(keep_vars=True).items()
        if isinstance(v, torch.Tensor)
    ]
    digest = hashlib.sha256(json.dumps(keys).encode()).hexdigest()
    return {
        "units": [
            [u.name, [[list(p.shape), _dtype_name(p.dtype)] for p in u.params], int(u.nbytes)] for u in units
        ],
        "compress": compress is not None,
        "state_dict": digest,
    }


def _difference(have: dict[str, Any], want: dict[str, Any]) -> str:
    hu, wu = have.get("units", []), want["units"]
    if len(hu) != len(wu):
        return f"it holds {len(hu)} units on disk, this model puts {len(wu)} there"
    for a, b in zip(hu, wu):
        if a != b:
            return f"its unit {a[0]!r} ({a[2]} bytes) is not this model's {b[0]!r} ({b[2]} bytes)"
    if have.get("compress") != want["compress"]:
        return "it was made with another compress= setting"
    return "the model's state-dict keys, shapes or dtypes differ"


def _write_json(path: str, obj: dict[str, Any]) -> None:
    """Writes ``obj`` to ``path`` atomically and durably (temporary file, fsync, rename, fsync of
    the directory)."""
    from .io._files import write_atomic

    data = json.dumps(obj, indent=1).encode()
    write_atomic(path, lambda f: f.write(data), "ramtorch.offload(keep=True)")


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A memoryview of contiguous CPU tensor ``t``'s bytes (no copy)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _copy_range(src: int, dst: int, n: int, src_off: int, dst_off: int) -> None:
    done = 0
    while done < n:
        k = os.copy_file_range(src, dst, n - done, src_off + done, dst_off + done)
        if k <= 0:
            raise OSError(f"copy_file_range copied nothing at byte {src_off + done}")
        done += k


class Kept:
    """One kept store (see the module docs): its directory, manifest, journal and files."""

    def __init__(self, directory: str, fp: dict[str, Any]) -> None:
        self.directory = directory
        self.fingerprint = fp
        self.manifest_path = os.path.join(directory, MANIFEST)
        self.units: _disk.Store | None = None
        self.states: _disk.Store | None = None
        self._protected: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        #: Journals the states a read ahead brought in while the updates before them run.
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ramtorch-journal")
        self.commits = 0
        self.journal_bytes = 0  # journaled since the last commit
        self.manifest: dict[str, Any] = {}
        self.opened = False
        self.states_opened = False
        self._states_sizes: list[int] | None = None
        found = self._read_manifest()
        if found is not None:
            if found.get("format") != FORMAT:
                raise ValueError(
                    f"ramtorch.offload: {self.manifest_path} is of store format {found.get('format')!r}; "
                    f"this ramtorch reads format {FORMAT}"
                )
            if found.get("fingerprint") != fp:
                raise ValueError(
                    f"ramtorch.offload: disk={directory!r} holds the kept store of another model "
                    f"({_difference(found.get('fingerprint') or {}, fp)}). Give this model another "
                    "directory, or remove that store's files to replace it."
                )
            if found.get("dirty"):
                warnings.warn(
                    f"ramtorch.offload: the kept store in {directory!r} was being written outside "
                    f"its journal ({found.get('dirty')}) when its process ended; it is made anew "
                    "from this model",
                    stacklevel=3,
                )
            else:
                self.manifest = found
                self.opened = True
        self._fds: dict[str, int] = {}
        jpath = os.path.join(directory, JOURNAL)
        if self.opened:
            self._rollback(jpath)
        else:
            self._remove_files()
            self.manifest = {"format": FORMAT, "fingerprint": fp, "serial": 0, "rest": None, "dirty": "made"}
            _write_json(self.manifest_path, self.manifest)
        self._journal = os.open(jpath, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._fds["journal"] = self._journal
        # The descriptors close and the journal thread ends when the store is collected.
        self._finalizer = weakref.finalize(self, _release, self._fds, self.pool)
        self._reset_journal()

    # -- files ---------------------------------------------------------------------------------

    def _read_manifest(self) -> dict[str, Any] | None:
        try:
            with open(self.manifest_path, "rb") as f:
                obj = json.loads(f.read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise ValueError(f"ramtorch.offload: {self.manifest_path} cannot be read ({e})") from e
        if not isinstance(obj, dict):
            raise ValueError(f"ramtorch.offload: {self.manifest_path} is not a store manifest")
        return obj

    def _remove_files(self) -> None:
        for name in os.listdir(self.directory):
            if name in (UNITS, STATES, JOURNAL) or (
                name.startswith("rest-") and name.endswith(".safetensors")
            ):
                os.unlink(os.path.join(self.directory, name))

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def open_units(self, sizes: Sequence[int]) -> _disk.Store:
        """The units' store file: opened as it is when the store was found, else made."""
        store = _disk.Store(self.directory, sizes, self.path(UNITS), create=not self.opened)
        store.kept = self
        self.units = store
        self._fds["units"] = os.open(self.path(UNITS), os.O_RDWR | os.O_CLOEXEC)
        if self.opened:
            for ext in store.extents:
                ext.opened = True
        return store

    def open_states(self, sizes: Sequence[int]) -> tuple[_disk.Store, bool]:
        """The optimizer states' store file (``DiskStates``): opened when the last commit made it
        with these sizes, else made anew (zeros). Returns it and whether it was opened."""
        sizes = [int(n) for n in sizes]
        path = self.path(STATES)
        same_layout = self.manifest.get("states_layout") == _disk.STATES_LAYOUT
        reuse = self.manifest.get("states") == sizes and same_layout and os.path.exists(path)
        if not reuse:
            if self.manifest.get("states") is not None and not same_layout:
                logger.warning(
                    "ramtorch: the optimizer states in the kept store in %r are in an older layout; "
                    "they are made anew (zeros)",
                    self.directory,
                )
            if self.manifest.get("states") is not None:  # the last commit's states are gone now
                self.manifest["states"] = None
                _write_json(self.manifest_path, self.manifest)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        store = _disk.Store(self.directory, sizes, path, create=not reuse)
        store.kept = self
        self.states = store
        self.states_opened = reuse
        old = self._fds.pop("states", None)
        if old is not None:
            os.close(old)
        self._fds["states"] = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        self._states_sizes = sizes  # (in the manifest from the next commit on)
        return store, reuse

    def mark_dirty(self, why: str) -> None:
        """Before writes the journal does not see: a crash before the next commit leaves the store
        untrusted (made anew when reopened)."""
        if not self.manifest.get("dirty"):
            self.manifest["dirty"] = why
            _write_json(self.manifest_path, self.manifest)

    # -- the journal ---------------------------------------------------------------------------

    def _reset_journal(self) -> None:
        with self._lock:
            head = json.dumps({"magic": _MAGIC, "serial": self.manifest["serial"]}).encode()
            os.ftruncate(self._journal, 0)
            _pwrite_all(self._journal, memoryview(head.ljust(_BLOCK, b"\0")), 0)
            os.fdatasync(self._journal)
            self._end = _BLOCK
            self._protected.clear()
            self.journal_bytes = 0

    def protect(self, which: str, offset: int, nbytes: int, data: torch.Tensor | None = None) -> int:
        """Saves the ``nbytes`` at ``offset`` of the ``which`` file (``"units"``, ``"states"``)
        to the journal, durably, unless saved since the last commit: call before writing them.
        ``data``: those bytes, already in memory (else they are copied from the file)."""
        return self.protect_many([(which, offset, nbytes, data)])

    def protect_many(self, ranges: Sequence[tuple[str, int, int, torch.Tensor | None]]) -> int:
        """:meth:`protect` of several ranges, with one ``fdatasync`` for their data and one for
        their records' headers; returns the bytes journaled (0: all saved before). Safe to call
        from several threads. A failed write raises ``OSError`` naming the journal (the ranges
        are not written then: nothing is lost)."""
        try:
            return self._protect_many(ranges)
        except OSError as e:
            n = sum(r[2] for r in ranges)
            raise OSError(
                e.errno,
                f"ramtorch: saving {n} bytes to the journal of the kept store in {self.directory!r} "
                f"failed ({e.strerror or e}); the update that would overwrite them did not run, and "
                "reopening the store gives its last commit",
                self.path(JOURNAL),
            ) from e

    def _protect_many(self, ranges: Sequence[tuple[str, int, int, torch.Tensor | None]]) -> int:
        with self._lock:
            todo = [r for r in ranges if (r[0], r[1], r[2]) not in self._protected and r[2] > 0]
            if not todo:
                return 0
            start, pos, heads = self._end, self._end, []
            for which, offset, nbytes, data in todo:
                if data is not None:
                    _pwrite_all(self._journal, _bytes_of(data)[:nbytes], pos + _BLOCK)
                else:
                    _copy_range(self._fds[which], self._journal, nbytes, offset, pos + _BLOCK)
                rec = {"file": which, "offset": offset, "nbytes": nbytes, "serial": self.manifest["serial"]}
                rec["check"] = zlib.crc32(json.dumps(rec, sort_keys=True).encode())
                heads.append((pos, json.dumps(rec).encode().ljust(_BLOCK, b"\0")))
                pos += _BLOCK + -(-nbytes // _BLOCK) * _BLOCK
            os.fdatasync(self._journal)  # the data, then the headers that make it records
            for at, head in heads:
                _pwrite_all(self._journal, memoryview(head), at)
            os.fdatasync(self._journal)
            # (Written once and read only after a crash: out of the page cache.)
            os.posix_fadvise(self._journal, start, pos - start, os.POSIX_FADV_DONTNEED)
            self._end = pos
            for which, offset, nbytes, _ in todo:
                self._protected.add((which, offset, nbytes))
                self.journal_bytes += nbytes
            return sum(r[2] for r in todo)

    def _records(self, fd: int, serial: int) -> list[dict[str, Any]]:
        """The journal's whole records of ``serial``, in order (a torn last one is left out)."""
        size = os.fstat(fd).st_size
        head = os.pread(fd, _BLOCK, 0).split(b"\0", 1)[0]
        try:
            h = json.loads(head)
        except ValueError:
            return []
        if not isinstance(h, dict) or h.get("magic") != _MAGIC or h.get("serial") != serial:
            return []  # a journal of a step that committed since: nothing to undo
        out, pos = [], _BLOCK
        while pos + _BLOCK <= size:
            raw = os.pread(fd, _BLOCK, pos).split(b"\0", 1)[0]
            try:
                rec = json.loads(raw)
                check = rec.pop("check")
            except (ValueError, KeyError, AttributeError):
                break
            if check != zlib.crc32(json.dumps(rec, sort_keys=True).encode()) or rec.get("serial") != serial:
                break
            n = int(rec["nbytes"])
            if pos + _BLOCK + n > size:
                break
            rec["at"] = pos + _BLOCK
            out.append(rec)
            pos += _BLOCK + -(-n // _BLOCK) * _BLOCK
        return out

    def _rollback(self, jpath: str) -> None:
        """Writes the journal's records back, newest first, and makes that durable."""
        if not os.path.exists(jpath):
            return
        fd = os.open(jpath, os.O_RDONLY | os.O_CLOEXEC)
        try:
            recs = self._records(fd, self.manifest["serial"])
            if not recs:
                return
            files = {"units": self.path(UNITS), "states": self.path(STATES)}
            fds = {k: os.open(v, os.O_RDWR | os.O_CLOEXEC) for k, v in files.items() if os.path.exists(v)}
            try:
                for rec in reversed(recs):
                    if rec["file"] not in fds:
                        raise ValueError(
                            f"ramtorch.offload: the journal of the kept store in {self.directory!r} "
                            f"undoes {rec['file']!r}, which is missing"
                        )
                    _copy_range(fd, fds[rec["file"]], int(rec["nbytes"]), rec["at"], int(rec["offset"]))
                for f in fds.values():
                    os.fdatasync(f)
            finally:
                for f in fds.values():
                    os.close(f)
            logger.warning(
                "ramtorch.offload: the kept store in %s was written after its last commit (serial %d): "
                "%d ranges (%d bytes) restored from its journal",
                self.directory,
                self.manifest["serial"],
                len(recs),
                sum(int(r["nbytes"]) for r in recs),
            )
        finally:
            os.close(fd)

    # -- commits -------------------------------------------------------------------------------

    def holds(self, t: torch.Tensor) -> bool:
        return any(s is not None and s.holds(t) for s in (self.units, self.states))

    def commit(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        extra: dict[str, Any] | None,
        source: dict[str, Any] | None = None,
        by_user: bool = True,
    ) -> None:
        """Makes the store and everything outside it the state to resume from (see the module
        docs). ``source``: the files a load just filled the store from."""
        from .io.checkpoint import save_checkpoint

        if optimizer is not None:
            sync = getattr(optimizer, "synchronize", None)
            if sync is not None:
                sync()
        for s in (self.units, self.states):
            if s is not None:
                s.core.sync()
        serial = int(self.manifest["serial"]) + 1
        rest_name = f"rest-{serial}.safetensors"
        rest: dict[str, Any] = {
            "model": {
                k: v.detach()
                for k, v in model.state_dict().items()
                if isinstance(v, torch.Tensor) and not self.holds(v)
            },
            "optimizer": None if optimizer is None else self._optimizer_rest(optimizer),
            "extra": dict(extra) if extra is not None else None,
            "by_user": by_user,
        }
        save_checkpoint(self.path(rest_name), nn.Module(), None, extra=rest, rng=True, progress=False)
        old = self.manifest.get("rest")
        manifest = dict(self.manifest, serial=serial, rest=rest_name, dirty=False)
        if self._states_sizes is not None:
            manifest["states"] = self._states_sizes
            manifest["states_layout"] = _disk.STATES_LAYOUT
        if source is not None:
            manifest["source"] = dict(source, serial=serial)
        _write_json(self.manifest_path, manifest)  # the commit point
        self.manifest = manifest
        self._reset_journal()
        self.commits += 1
        if old and old != rest_name:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(old))

    def _optimizer_rest(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer.state_dict()`` with the states that live in this store left out (marked)."""
        sd = optimizer.state_dict()
        state = {}
        for i, st in sd["state"].items():
            if isinstance(st, dict) and any(
                isinstance(v, torch.Tensor) and self.holds(v) for v in st.values()
            ):
                kept = [k for k, v in st.items() if isinstance(v, torch.Tensor) and self.holds(v)]
                st = {k: v for k, v in st.items() if k not in kept}
                st["__in_store__"] = kept
            state[i] = st
        return {"state": state, "param_groups": sd["param_groups"]}

    def read_rest(self, map_rng: bool) -> dict[str, Any] | None:
        """The last commit's rest (see :meth:`commit`), or None before any commit."""
        from .io.checkpoint import load_checkpoint

        name = self.manifest.get("rest")
        if not name:
            return None
        return load_checkpoint(self.path(name), nn.Module(), map_rng=map_rng, progress=False)

    def restore_model(self, model: nn.Module) -> None:
        """Fills the model's tensors outside the store from the last commit."""
        rest = self.read_rest(map_rng=False)
        if rest is None:
            return
        tensors = rest.get("model") or {}
        result = model.load_state_dict(tensors, strict=False)
        if result.unexpected_keys:
            raise ValueError(
                f"ramtorch.offload: the kept store in {self.directory!r} holds values of keys this model "
                f"has not: {result.unexpected_keys[:8]}"
            )
        sd = model.state_dict()
        unfilled = [k for k in result.missing_keys if not self.holds(sd[k])]
        if unfilled:
            raise ValueError(
                f"ramtorch.offload: the kept store in {self.directory!r} has no values for {unfilled[:8]}"
            )


def _release(fds: dict[str, int], pool: concurrent.futures.ThreadPoolExecutor) -> None:
    pool.shutdown(wait=True)
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


def manifest_units(directory: str) -> list[str] | None:
    """The names of the disk units of the kept store in ``directory``, if one is there (and
    trusted)."""
    try:
        with open(os.path.join(directory, MANIFEST), "rb") as f:
            obj = json.loads(f.read())
        units = obj["fingerprint"]["units"]
        return None if obj.get("dirty") else [str(u[0]) for u in units]
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def kept_of(model: nn.Module) -> Kept | None:
    """The kept store of an offloaded model, if it has one."""
    streamer = getattr(model, "_ramtorch_streamer", None)
    store = None if streamer is None else getattr(streamer, "disk_store", None)
    return None if store is None else store.kept


def _kept_or_raise(model: nn.Module, what: str) -> Kept:
    kept = kept_of(model)
    if kept is None:
        raise ValueError(
            f"ramtorch.{what}: the model has no kept store (ramtorch.offload(model, disk=..., keep=True))"
        )
    return kept


def commit(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Makes the current state of ``model`` (offloaded with ``keep=True``), ``optimizer`` and
    torch's RNG the one its kept store resumes from (:func:`ramtorch.resume`), durably: the
    store's bytes are flushed to the disk, everything outside the store (the model's other
    tensors, the optimizer's other states, step counts and groups, ``extra``) is written to the
    store's directory, and the store's manifest is replaced atomically, the commit point. A crash
    at any point leaves this commit or the previous one, whole.

    Args:
        model: a model offloaded with ``keep=True``.
        optimizer: the optimizer training it (a ``ramtorch.optim`` optimizer for parameters in the
            store), or None.
        extra: your own values to resume with (step, epoch, scheduler or data state): what
            :func:`ramtorch.save_checkpoint` takes as ``extra``.

    Raises:
        ValueError: the model has no kept store.
        OSError: a write failed (the previous commit stays the one to resume from).
    """
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"ramtorch.commit: extra must be a dict or None, got {type(extra).__name__}")
    _kept_or_raise(model, "commit").commit(model, optimizer, extra)


def resume(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, map_rng: bool = True
) -> dict[str, Any] | None:
    """Restores ``optimizer`` and torch's RNG states from the last :func:`ramtorch.commit` of
    ``model``'s kept store, and returns that commit's ``extra`` (``{}`` if it had none); None when
    the store was never committed by :func:`ramtorch.commit` (it was made or loaded only).

    The model itself needs nothing: ``ramtorch.offload(..., keep=True)`` gave it the store's
    values (undoing, from the journal, what a crashed step had written since the commit). The
    optimizer must be built as the committed one was (same parameters, groups and precision);
    its states that live in the store are taken as they are there, without a copy.

    Raises:
        ValueError: the model has no kept store; the optimizer does not fit the committed state,
            or the committed states on disk are gone (the optimizer was made with another layout
            since).
    """
    kept = _kept_or_raise(model, "resume")
    rest = kept.read_rest(map_rng=map_rng)
    if rest is None or not rest.get("by_user"):
        return None
    saved = rest.get("optimizer")
    if optimizer is not None and saved is not None:
        groups = saved.get("param_groups", [])
        if len(groups) != len(optimizer.param_groups):
            raise ValueError(
                f"ramtorch.resume: the committed optimizer has {len(groups)} parameter groups, "
                f"this one {len(optimizer.param_groups)}"
            )
        state = dict(saved.get("state", {}))
        for g_saved, g in zip(groups, optimizer.param_groups):
            if len(g_saved["params"]) != len(g["params"]):
                raise ValueError(
                    "ramtorch.resume: the committed optimizer's parameter groups hold "
                    f"{len(g_saved['params'])} parameters where this one's hold {len(g['params'])}"
                )
            for i, p in zip(g_saved["params"], g["params"]):
                st = state.get(i)
                if not isinstance(st, dict) or "__in_store__" not in st:
                    continue
                ds_for = getattr(optimizer, "_disk_states_for", None)
                ds = None if ds_for is None else ds_for(p)
                if ds is None or ds.kept is not kept or not kept.states_opened:
                    raise ValueError(
                        "ramtorch.resume: the committed optimizer states on disk are not there for "
                        "this optimizer (not a ramtorch.optim optimizer with optimizer_on_disk=True, "
                        "or its states were made anew with another layout since the commit)"
                    )
                views = ds.make(p, zero=False)
                names = list(st.pop("__in_store__"))
                # A state saved under a key of an earlier format is where the optimizer keeps it
                # now, under its old key: the load recodes it in place.
                home = getattr(optimizer, "_current_state_key", lambda k: k)
                where = {k: k if k in views else home(k) for k in names}
                missing = [k for k in names if where[k] not in views]
                if missing:
                    raise ValueError(
                        f"ramtorch.resume: the committed states {missing} are not this optimizer's"
                    )
                state[i] = {**{k: v for k, v in st.items()}, **{k: views[where[k]] for k in names}}
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    out = rest.get("extra")
    return dict(out) if isinstance(out, dict) else {}
