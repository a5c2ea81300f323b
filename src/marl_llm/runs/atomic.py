"""Atomic file writes: a temp file in the target's directory, then a rename, so a reader (or a
crash mid-write) never sees half a file and the previous version survives a failed write.

The temp file is fsynced before the rename and the directory after it, so a power loss or a
kernel crash after the write returned cannot leave an empty or half file under the final name.
Ctrl-C is held back during the renames (and raised right after them), so an interrupt never
stops a write between "the old version moved away" and "the new one in place".
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator


def atomic_write(path: Path, write: Callable[[str], object],
                 before_replace: Callable[[str], object] | None = None) -> None:
    """Call `write(tmp_path)` and rename the result over `path` (same filesystem: a rename).
    `before_replace(tmp_path)` runs right before that rename, with it and Ctrl-C held back (a
    checkpoint moves the previous one aside there)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        # mkstemp makes the file private (0600); give it the permissions a plain open() would.
        os.chmod(tmp, 0o666 & ~umask())
        fsync_file(tmp)
        with interrupts_deferred():
            if before_replace is not None:
                before_replace(tmp)
            os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def fsync_file(path: str | Path) -> None:
    """Flush a written file's data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """Flush a directory's entries (a rename in it) to the disk. File systems that cannot sync a
    directory (some network and FUSE mounts) are skipped."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES):
            raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) back for the block and deliver it to the handler in force right after,
    so a few renames that belong together happen all or none. Outside the main thread, or when
    SIGINT is ignored or has no Python handler, the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):
        yield
        return
    caught: list[tuple[int, Any]] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            previous(*caught[0])


def umask() -> int:
    """The process's umask (reading it means setting it: set straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
