"""SHA-256 digests of checkpoint files, recorded when they are written and checked before any byte
of them is loaded, in `sha256sum`'s own format (so `sha256sum -c` reads them, and
`sha256sum <files> > <record>` writes one).

    checkpoint.pt.sha256         one file: `<hex>  checkpoint.pt`, beside it
    checkpoint/SHA256SUMS        a sharded checkpoint: one line per file of the directory

A file is used only when its record exists, parses, names that file and matches its bytes: a
missing, malformed or wrong record refuses it (`verify`, `verify_sums`). What that guarantees:
bytes that changed after the save (a bad copy, a flipped bit, a truncated or half-written file, a
record deleted, emptied or mixed up with another file's) are caught. What it does not: the record
lives beside the file, so whoever can write the run dir can rewrite both; that is no corruption
but an attacker, and what keeps code out of such a file is the loading (tensors and plain data
only), not the digest. docs/logging.md#what-a-checkpoint-digest-guarantees says the same for users.

A record is written before its file takes its final name, and moves after the file does (`move`),
so a kill between two steps never leaves the only good file without its record.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from marl_llm.runs.atomic import atomic_write_text

SUFFIX = ".sha256"
SUMS = "SHA256SUMS"
_CHUNK = 1 << 20
# sha256sum's line: 64 hex digits, two spaces (or " *": binary mode), the file's name. Names are
# a checkpoint's own plain file names: no directory, no "..".
_LINE = re.compile(r"([0-9a-fA-F]{64}) [ *]([\w.-]+)")
_MAX_RECORD = 1 << 20  # a record of a few thousand shards is ~100 KB; a bigger one is no record of ours


class Unverified(ValueError):
    """A file's digest record is missing (`missing`), unreadable or malformed: the message says which."""

    def __init__(self, why: str, missing: bool = False):
        super().__init__(why)
        self.missing = missing


def sidecar(path: Path) -> Path:
    """Where `path`'s digest is kept."""
    path = Path(path)
    return path.with_name(path.name + SUFFIX)


def file_digest(path: Path) -> str:
    """The file's SHA-256, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _lines(digests: dict[str, str]) -> str:
    return "".join(f"{digests[name]}  {name}\n" for name in sorted(digests))


def write_digest(path: Path, digest: str) -> None:
    """Record `digest` as the SHA-256 of `path`."""
    atomic_write_text(sidecar(path), _lines({Path(path).name: digest}))


def write_sums(path: Path, digests: dict[str, str]) -> None:
    """Record {file name: SHA-256} of a directory's files in `path` (its SHA256SUMS)."""
    atomic_write_text(path, _lines(digests))


def read_sums(path: Path) -> dict[str, str]:
    """{file name: SHA-256} of a record. Raises Unverified when it is missing, unreadable or not
    sha256sum's format (a line that is not, a name given twice, an empty record)."""
    name = Path(path).name
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_RECORD + 1)
    except FileNotFoundError:
        raise Unverified(f"no {name}", missing=True) from None
    except OSError as err:
        raise Unverified(f"{name} is unreadable ({err.strerror})") from None
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise Unverified(f"{name} is not a digest record (not text)") from None
    if len(data) > _MAX_RECORD:
        raise Unverified(f"{name} is not a digest record (over {_MAX_RECORD} bytes)")
    digests: dict[str, str] = {}
    for line in text.splitlines():
        found = _LINE.fullmatch(line)
        if found is None or found.group(2) in (".", "..") or found.group(2) in digests:
            raise Unverified(f"{name} is not a digest record (line {line[:80]!r})")
        digests[found.group(2)] = found.group(1).lower()
    if not digests:
        raise Unverified(f"{name} is empty")
    return digests


def recorded(path: Path) -> str | None:
    """The digest recorded for `path` (None: no record). Raises Unverified when the record is
    there but cannot be used (unreadable, malformed, or naming another file)."""
    try:
        digests = read_sums(sidecar(path))
    except Unverified as err:
        if err.missing:
            return None
        raise
    if list(digests) != [Path(path).name]:
        raise Unverified(f"{sidecar(path).name} records {', '.join(digests)}, not {Path(path).name}")
    return digests[Path(path).name]


def _mismatch(path: Path, expected: str, record: str, whose: str) -> str | None:
    try:
        actual = file_digest(path)
    except FileNotFoundError:
        return f"corrupt ({Path(path).name}, which {record} lists, is missing)"
    except OSError as err:
        return f"unreadable ({Path(path).name}: {err.strerror})"
    if actual != expected:
        return f"corrupt ({whose} SHA-256 is {actual[:12]}…, {record} recorded {expected[:12]}…)"
    return None


def verify(path: Path) -> str | None:
    """None when `path` matches its recorded digest; else why it may not be used."""
    try:
        expected = recorded(path)
    except Unverified as err:
        return f"unverifiable ({err})"
    if expected is None:
        return f"unverified (no {sidecar(path).name}: a checkpoint is loaded only with its digest)"
    return _mismatch(path, expected, sidecar(path).name, "its")


def verify_sums(directory: Path, digests: dict[str, str], names: list[str]) -> str | None:
    """None when each of `names` in `directory` matches `digests` (its SHA256SUMS); else why not."""
    for name in names:
        why = _mismatch(Path(directory) / name, digests[name], SUMS, f"{name}'s")
        if why:
            return why
    return None


def move(src: Path, dst: Path) -> None:
    """Rename `src` to `dst` with its digest: the record under the new name first, then the file,
    then the old record goes. A kill in between leaves `src` with its own record (and `dst`'s
    older file beside a record that refuses it), or `dst` with its record: never the only good
    file without one."""
    try:
        digest = recorded(src)
    except Unverified:
        digest = None
    if digest is not None:
        write_digest(dst, digest)
    else:
        sidecar(dst).unlink(missing_ok=True)
    os.replace(src, dst)
    sidecar(src).unlink(missing_ok=True)
