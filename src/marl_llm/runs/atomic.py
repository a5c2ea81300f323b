"""Atomic file writes: a temp file in the target's directory, then a rename, so a reader (or a
crash mid-write) never sees half a file and the previous version survives a failed write."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


def atomic_write(path: Path, write: Callable[[str], object]) -> None:
    """Call `write(tmp_path)` and rename the result over `path` (same filesystem: a rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        # mkstemp makes the file private (0600); give it the permissions a plain open() would.
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def umask() -> int:
    """The process's umask (reading it means setting it: set straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
