"""Reading a torch.distributed.checkpoint (DCP) directory without running code from it.

DCP's own FileSystemReader unpickles `.metadata` with a plain `pickle.load`, and its
DefaultLoadPlanner unpickles every non-tensor value (an optimizer's lr, betas, ...) with
`torch.load(weights_only=False)`: a planted checkpoint ran its payload on resume. Here:
- `.metadata` is unpickled by `read_metadata`, whose unpickler finds only the classes a DCP
  checkpoint's metadata is made of (the standard library's "restricting globals" recipe: any
  other global, `os.system` or `builtins.eval` alike, is refused before it is looked up), and each
  file it points DCP to must be one of the checkpoint's verified files;
- `VerifiedReader` hands DCP that already checked metadata instead of reading the file again;
- `PlainDataLoadPlanner` loads the non-tensor values with `weights_only=True`.
Tensors are read by DCP itself with `torch.load(weights_only=True)`.

Imported only where a sharded checkpoint is read (DCP is a heavy import).
"""

from __future__ import annotations

import functools
import io
import pickle
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

METADATA = ".metadata"


@functools.cache
def _allowed() -> dict[tuple[str, str], Any]:
    """The globals a DCP `.metadata` holds (torch 2.x): its dataclasses, torch.Size, a dtype
    (looked up by name, below), a layout by name, and the path it was saved to."""
    from torch.distributed.checkpoint import filesystem, metadata

    found: dict[tuple[str, str], Any] = {
        (metadata.__name__, name): getattr(metadata, name)
        for name in ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                     "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
        if hasattr(metadata, name)}
    found[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    found[("torch", "Size")] = torch.Size
    found[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    import pathlib

    for module in ("pathlib", "pathlib._local"):  # StorageMeta.checkpoint_id (3.13 moved the classes)
        found[(module, "PosixPath")], found[(module, "PurePosixPath")] = pathlib.PosixPath, pathlib.PurePosixPath
    return found


class _NotAllowed(pickle.UnpicklingError):
    """A global outside _allowed(), by its dotted name."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = _allowed().get((module, name))
        if allowed is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = getattr(torch, name)
        if allowed is None:
            raise _NotAllowed(f"{module}.{name}")
        return allowed


def unpickle_metadata(f: BinaryIO) -> Any:
    return _MetadataUnpickler(f).load()


def read_metadata(path: Path, files: set[str]) -> Metadata:
    """The DCP metadata at `path`, unpickled as above. Raises ValueError (why, in a few words)
    when it holds anything else, or points DCP to a file outside `files` (the checkpoint's
    verified ones) or through a transform (marl-llm never writes one)."""
    name = Path(path).name
    try:
        with open(path, "rb") as f:
            found = unpickle_metadata(f)
    except _NotAllowed as err:
        raise ValueError(f"not plain data ({name} would run {err} when loaded; marl-llm loads only the classes of "
                         "DCP's metadata, tensors and plain data)") from None
    except Exception as err:  # noqa: BLE001  (truncated or garbage bytes)
        raise ValueError(f"unreadable ({name}: {type(err).__name__}: {str(err)[:120]})") from None
    if not isinstance(found, Metadata) or not isinstance(found.storage_data, dict):
        raise ValueError(f"unreadable ({name} is no DCP metadata: it holds a {type(found).__name__})")
    for info in found.storage_data.values():
        if getattr(info, "relative_path", None) not in files or getattr(info, "transform_descriptors", None):
            raise ValueError(f"not a checkpoint of its own files ({name} points to "
                             f"{getattr(info, 'relative_path', info)!r}, no verified file of it)")
    return found


class VerifiedReader(FileSystemReader):
    """DCP's file system reader, given the checkpoint's metadata already read by `read_metadata`:
    DCP never unpickles `.metadata` itself."""

    def __init__(self, path: str | Path, metadata: Metadata):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        return self._metadata


class PlainDataLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, except that a non-tensor value (an optimizer's hyperparameters) loads
    as plain data: DefaultLoadPlanner.load_bytes unpickles it with weights_only=False."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        plain = torch.load(value, weights_only=True)  # refuses anything but tensors and plain data
        # What the base class unpickles is now our own serialization of plain data: it can run
        # nothing, and the base class puts the value where it belongs in the state dict.
        again = io.BytesIO()
        torch.save(plain, again)
        again.seek(0)
        super().load_bytes(read_item, again)


def refused_global(err: BaseException) -> str | None:
    """The global that a value of a failed DCP load would have run (what torch.load(weights_only=True)
    refused, by name, or "code"), or None when the load failed otherwise. DCP gathers every
    rank's failure into a CheckpointException."""
    from marl_llm.runs.checkpoint import refused_global as refused

    failures = getattr(err, "failures", None) or {}
    for failure, _trace in failures.values():
        if isinstance(failure, pickle.UnpicklingError):
            return refused(failure)
    return None
