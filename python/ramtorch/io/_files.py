"""File-system steps shared by every writer and reader of the package: the one atomic write
(temporary file, fsync, rename, directory fsync), the one fsync of a directory, and the one read of a
small file that refuses anything but a regular file."""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
from collections.abc import Callable
from typing import IO

__all__ = ["fsync_dir", "read_regular", "write_atomic"]


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Flushes ``directory``'s entries (a rename in it) to disk, where the platform can."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems cannot sync a directory
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def _temp_re(name: str) -> re.Pattern[str]:
    return re.compile(rf"\.{re.escape(name)}\.(\d+)\.[0-9a-f]{{8}}\.tmp")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _remove_stale_temps(directory: str, name: str) -> None:
    """Removes temporary files of ``name`` left by writes whose process died (e.g. killed)."""
    pattern = _temp_re(name)
    try:
        entries = os.listdir(directory)
    except OSError:
        return
    for entry in entries:
        m = pattern.fullmatch(entry)
        if m is not None and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            try:
                os.unlink(os.path.join(directory, entry))
            except OSError:
                pass


def write_atomic(path: str | os.PathLike[str], write: Callable[[IO[bytes]], None], what: str) -> None:
    """Writes ``path`` so that it holds either its previous content or the new one, whole, even if
    the process is killed meanwhile: ``write(f)`` fills a temporary file next to it
    (``.<name>.<pid>.<random>.tmp``), which is flushed, ``fsync``-ed and renamed over ``path``; then
    the directory is ``fsync``-ed. On an exception the temporary file is removed; one left by a
    killed process is removed by the next write of the same ``path``. ``what`` names the caller in
    errors."""
    path = os.fspath(path)
    directory, name = os.path.split(os.path.abspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(f"{what}: {path} is a directory")
    _remove_stale_temps(directory, name)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    replaced = False
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        replaced = True
        fsync_dir(directory)
    except BaseException:
        if not replaced:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        raise


def read_regular(path: str | os.PathLike[str], what: str) -> bytes:
    """The bytes of ``path``, a regular file: anything else (a FIFO, whose open would block for
    ever, a device, a directory) is a ``ValueError`` naming it, checked on the open file."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{what}: {os.fspath(path)!r} is not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read()
    finally:
        os.close(fd)
