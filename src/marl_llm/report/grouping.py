"""Grouping one task's runs into table rows: by the config keys that differ between them (or by
`--group-by` keys), with labels, table order, and the checks that refuse or warn about groups and rows
that mix data, model, task or evaluation settings."""

from __future__ import annotations

import difflib
import json
import re
from collections import defaultdict
from fnmatch import fnmatchcase
from typing import Any, Iterable, Sequence

from marl_llm.config import UserError
from marl_llm.report.runs import Run

# Prompt-only baselines lead the table so trained methods read as improvements over them.
BASELINE_ORDER = ("single", "parallel", "sequential", "discussion")
# Config keys (fnmatch patterns over dotted leaf paths) that never tell two experiments apart: the seed
# (runs that differ only in it are one group's repeats), where and how a run was stored, logged,
# resumed or scheduled, and knobs that change speed or memory but not what is trained or measured
# (chunk sizes, decode loop, checkpointing, sharding, device placement, sandbox worker count).
# This is the one list: grouping, labels and the mixed-settings checks all read it.
IGNORED_KEYS = (
    "seed", "run_dir", "hydra.*", "logger.*", "cluster.*",
    "trainer.resume*", "trainer.save_every", "trainer.summary_file", "trainer.export*",
    "trainer.eval_every", "trainer.eval_before", "trainer.eval_after", "trainer.eval_k",
    "trainer.threads", "trainer.progress*", "trainer.sequences_per_generate", "trainer.completions_per_micro_batch",
    "trainer.decode", "trainer.compile_decode", "trainer.gradient_checkpointing", "trainer.deterministic",
    "trainer.distributed_timeout_min", "trainer.peak_tflops", "trainer.vllm_gpu_memory_utilization",
    "trainer.vllm_sleep", "trainer.fsdp*", "model.device", "task.sandbox.workers",
)
# Keys whose values must match for runs to be comparable at all, and what they are called in messages
# (first matching pattern wins): a group that mixes them is refused, rows that differ in them are warned.
COMPARABILITY_KEYS = (
    ("task.data.*", "data"), ("task.*", "task"), ("model.*", "model"),
    ("trainer.eval_max_problems", "evaluation"), ("trainer.eval_num_samples", "evaluation"),
)
# Keys whose value alone names a group (no "key=" prefix in the label).
NAME_KEYS = ("algo.name", "logger.group")

ABSENT = object()  # a key that a run's config does not have (unlike a key set to null)
MISSING = "—"  # how ABSENT reads in labels and tables (also a table cell no run has a value for)


def is_ignored(key: str) -> bool:
    return any(fnmatchcase(key, pattern) for pattern in IGNORED_KEYS)


def comparability_kind(key: str) -> str | None:
    """"data", "task", "model" or "evaluation" for a key that runs must share to be comparable, else None."""
    return next((kind for pattern, kind in COMPARABILITY_KEYS if fnmatchcase(key, pattern)), None)


def canon(value: Any) -> str:
    # A hashable spelling that tells 1 from "1" and an absent key from null, and compares lists by content.
    return "\0absent" if value is ABSENT else json.dumps(value, sort_keys=True, default=str)


def show_value(value: Any) -> str:
    if value is ABSENT:
        return MISSING
    # Strings as typed; everything else as in an override (true, null, [1, 5], 0.0003).
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def _value(run: Run, key: str) -> Any:
    """`key` in the run's config: a leaf, a section (a dict of its leaves, for --group-by algo.sampling),
    or ABSENT."""
    if key in run.config:
        return run.config[key]
    section = {k[len(key) + 1:]: v for k, v in run.config.items() if k.startswith(key + ".")}
    return section or ABSENT


def differing_keys(runs: Sequence[Run]) -> list[str]:
    """Config leaves whose values differ between `runs` (set in some, absent in others counts), sorted,
    without IGNORED_KEYS."""
    keys = sorted({k for r in runs for k in r.config})
    return [k for k in keys if not is_ignored(k) and len({canon(r.config.get(k, ABSENT)) for r in runs}) > 1]


def _values_text(runs: Sequence[Run], keys: Sequence[str], limit: int = 3) -> str:
    shown = [f"{k} ({' vs '.join(sorted({show_value(_value(r, k)) for r in runs}))})" for k in keys[:limit]]
    return "; ".join(shown) + (f"; and {len(keys) - limit} more" if len(keys) > limit else "")


def _short_names(keys: Iterable[str]) -> dict[str, str]:
    """Label spelling of each key: without its section ("baseline" for algo.baseline) unless that is ambiguous."""
    keys = sorted(set(keys))
    short = {k: k.split(".", 1)[-1] for k in keys}
    spellings = list(short.values())
    return {k: k if spellings.count(s) > 1 else s for k, s in short.items()}


def _label_part(key: str, value: Any, short: str) -> str:
    return show_value(value) if key in NAME_KEYS else f"{short}={show_value(value)}"


_NUMBER = re.compile(r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)")


def natural_key(label: str) -> tuple[tuple[int, Any], ...]:
    """A label's sort key with its numbers compared as numbers: lr=1e-05 before lr=0.0001 before
    lr=0.001, G=4 before G=16 (as text, 0.0001 came before 1e-05)."""
    parts = _NUMBER.split(label)
    return tuple((0, float(p)) if k % 2 else (1, p) for k, p in enumerate(parts) if p)


def parse_group_by(values: Sequence[str] | None, runs: Sequence[Run]) -> list[str] | None:
    """`--group-by` values (comma-separated, repeatable) as a key list; every key must be in some run's config."""
    if not values:
        return None
    keys = list(dict.fromkeys(k.strip() for v in values for k in v.split(",") if k.strip()))
    if not keys:
        raise UserError("--group-by needs config keys, e.g. --group-by algo.name,algo.baseline")
    known = {k for r in runs for k in r.config}
    sections = {".".join(k.split(".")[:i]) for k in known for i in range(1, k.count(".") + 1)}
    for key in keys:
        if key not in known and key not in sections:
            close = difflib.get_close_matches(key, sorted(known | sections), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            differ = differing_keys(runs)
            raise UserError(f"--group-by {key}: no run's config.yaml has this key; {hint}keys that differ between "
                            f"these runs: {', '.join(differ[:8]) or 'none'}{' ...' if len(differ) > 8 else ''}")
    return keys


def _rank(base: str, runs: Sequence[Run]) -> tuple[int, int]:
    # Evaluation-only groups (prompt-only baselines, untrained teams) first, then the papers' baseline order.
    return (0 if all(r.eval_only for r in runs) else 1,
            BASELINE_ORDER.index(base) if base in BASELINE_ORDER else len(BASELINE_ORDER))


def group_runs(task: str, runs: Sequence[Run], group_by: Sequence[str] | None = None,
               allow_mixed: bool = False) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """Split one task's runs into table rows: ``([{"label", "runs", "config", "merged"}], grouped_by, warnings)``.

    Default: runs equal in every key but IGNORED_KEYS share a row (they are seeds of one config), and
    ``logger.group`` keeps its runs apart. ``group_by``: rows by those keys' values; a row mixing
    COMPARABILITY_KEYS raises UserError unless ``allow_mixed`` (then a warning)."""
    differ = differing_keys(runs)
    buckets: dict[tuple, list[Run]] = defaultdict(list)
    if group_by is None:
        grouped_by = differ
        for r in runs:
            buckets[(r.method, *(canon(r.config.get(k, ABSENT)) for k in differ))].append(r)
        # Label: the base name, plus the keys that differ between rows of the same base, plus every
        # data/model/task/evaluation key that differs between any rows (those must always be visible).
        critical = [k for k in differ if comparability_kind(k)]
        by_base: dict[str, list[list[Run]]] = defaultdict(list)
        for key, rs in buckets.items():
            by_base[key[0]].append(rs)
        label_keys = {key: [k for k in differ if k in critical or
                            len({canon(s[0].config.get(k, ABSENT)) for s in by_base[key[0]]}) > 1]
                      for key in buckets}
        short = _short_names(k for ks in label_keys.values() for k in ks)
        rows = []
        for key, rs in buckets.items():
            parts = [_label_part(k, rs[0].config[k], short[k]) for k in label_keys[key] if k in rs[0].config]
            rows.append({"base": key[0], "label": " ".join([key[0], ", ".join(parts)]) if parts else key[0],
                         "runs": rs, "config": {k: rs[0].config[k] for k in differ if k in rs[0].config}})
    else:
        grouped_by = list(group_by)
        for r in runs:
            buckets[tuple(canon(_value(r, k)) for k in group_by)].append(r)
        short = _short_names(group_by)
        rows = []
        for rs in buckets.values():
            bases = {r.method for r in rs}
            label = ", ".join(_label_part(k, _value(rs[0], k), short[k]) for k in group_by)
            rows.append({"base": bases.pop() if len(bases) == 1 else label, "label": label, "runs": rs,
                         "config": {k: _value(rs[0], k) for k in group_by if _value(rs[0], k) is not ABSENT}})
    # Two rows whose labels render alike (1 and "1") stay apart.
    seen: dict[str, int] = defaultdict(int)
    for row in sorted(rows, key=lambda row: row["runs"][0].path.as_posix()):
        seen[row["label"]] += 1
        if seen[row["label"]] > 1:
            row["label"] += f" #{seen[row['label']]}"
    rows.sort(key=lambda row: (*_rank(row["base"], row["runs"]), natural_key(row["label"])))

    warnings: list[str] = []
    mixed: set[str] = set()
    for row in rows:
        inner = differing_keys(row["runs"])
        row["merged"] = {k: sorted({show_value(_value(r, k)) for r in row["runs"]}) for k in inner}
        critical = [k for k in inner if comparability_kind(k)]
        mixed.update(critical)
        if critical:
            kinds = " and ".join(sorted({comparability_kind(k) for k in critical}))
            msg = f"{task}: group '{row['label']}' mixes {kinds} settings: {_values_text(row['runs'], critical)}"
            if not allow_mixed:
                example = ",".join([*grouped_by, *critical[:2]])
                raise UserError(f"{msg}; add the key(s) to --group-by (e.g. --group-by {example}) or pass "
                                f"--allow-mixed to report these runs as one group")
            warnings.append(f"{msg} (reported as one group: --allow-mixed)")
        others = [k for k in inner if not comparability_kind(k)]
        if others:
            warnings.append(f"{task}: group '{row['label']}' merges runs that differ in {_values_text(row['runs'], others)}: "
                            f"its spread mixes those settings with seed noise")
    across = [k for k in differ if comparability_kind(k) and k not in mixed]
    if across:
        kinds = " and ".join(sorted({comparability_kind(k) for k in across}))
        named = "the labels name them" if group_by is None else "add them to --group-by to see them in the labels"
        warnings.append(f"{task}: the rows differ in {kinds} settings: {_values_text(runs, across)} ({named}); "
                        f"compare rows only where that difference is what you mean to compare")
    return rows, grouped_by, warnings
