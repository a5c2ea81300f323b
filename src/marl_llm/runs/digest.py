"""A checksum beside a file (`<file>.sha256`), so that a file whose bytes changed after it was
written (a bad copy, a flipped bit on disk, an edit) is caught before it is used.

Each function works on one file, so a checkpoint of several files (a shard each) checks each
one. The sidecar is written before the file takes its final name and moves before it, so a kill
between two steps never leaves a good file beside a wrong checksum: at worst a file without one,
which `verify` accepts as unverified (checkpoints written before checksums existed have none).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from marl_llm.runs.atomic import atomic_write_text

SUFFIX = ".sha256"
_CHUNK = 1 << 20


def sidecar(path: Path) -> Path:
    """Where `path`'s checksum is kept."""
    path = Path(path)
    return path.with_name(path.name + SUFFIX)


def file_digest(path: Path) -> str:
    """The file's SHA-256, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_digest(path: Path, digest: str) -> None:
    """Record `digest` as the checksum of `path` (`sha256sum`'s format, so `sha256sum -c` reads it)."""
    atomic_write_text(sidecar(path), f"{digest}  {Path(path).name}\n")


def recorded(path: Path) -> str | None:
    """The checksum recorded for `path` (None: none recorded). Raises ValueError when the record
    cannot be read."""
    try:
        return sidecar(path).read_text(encoding="utf-8").split()[0]
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, IndexError) as err:
        raise ValueError(f"its checksum file {sidecar(path).name} is unreadable") from err


def verify(path: Path) -> str | None:
    """None when `path` matches its recorded checksum or has none; else why not."""
    record = sidecar(path)
    try:
        expected = recorded(path)
    except ValueError as err:
        return f"unverifiable ({err})"
    if expected is None:
        return None  # unverified: written before checksums, or killed between two renames
    actual = file_digest(path)
    if actual != expected:
        return f"corrupt (its SHA-256 is {actual[:12]}…, {record.name} recorded {expected[:12]}…)"
    return None


def move(src: Path, dst: Path) -> None:
    """Rename `src` to `dst` with its checksum: the record first (rewritten under the new name,
    or `dst`'s old one removed), then the file. A kill in between leaves `src` intact and
    unverified, and at worst `dst`'s older file beside a checksum that refuses it."""
    try:
        digest = recorded(src)
    except ValueError:
        digest = None
    if digest is not None:
        write_digest(dst, digest)
        sidecar(src).unlink()
    else:
        sidecar(dst).unlink(missing_ok=True)
    os.replace(src, dst)
