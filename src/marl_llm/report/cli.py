"""Comparison tables and reward plots from finished runs, read from their local files (no W&B needed).

Usage::

    marl-llm-report                                # searches ./outputs and ./multirun, writes reports/<time>/
    marl-llm-report multirun/2026-11-22 outputs/x  # run dirs or roots, searched recursively
    marl-llm-report --out results --task tldr --commands results/commands.txt --format md,csv,json
    marl-llm-report multirun/x --group-by algo.name     # one row per algorithm, whatever else differs

A run directory is one that holds ``config.yaml`` (the resolved config; ``.hydra/config.yaml`` is
accepted too) and ``metrics.jsonl``. Runs without ``summary.json`` are unfinished and skipped with a
warning, as are runs whose files cannot be read.

Grouping: per task, the runs of a row are those whose configs are equal in every key except the seed
and bookkeeping keys (``IGNORED_KEYS``), so a sweep ``algo.baseline=mean,rloo`` gives two rows. A row's
label is ``logger.group`` (else ``algo.name``) plus the keys that tell it apart from rows of the same
algorithm, and any data/model/task/evaluation key that differs between rows (those also print a
warning). ``--group-by KEYS`` groups by those keys instead; a group that then mixes data, model, task or
evaluation settings is refused (``--allow-mixed``: warned and reported).

Per task it writes (``--format``, default ``md``):

- ``<out>/<task>.md``: group x metric table of held-out metrics at each run's final eval step,
  ``mean ± sample std`` over runs (``n/a`` for one run), the IQM of the headline metric with a
  stratified-bootstrap 95% CI, the runs used, a legend and (``--commands FILE``) the exact commands;
- ``<out>/<task>.csv`` and ``<out>/<task>.json``: the same numbers (the JSON also the curves);
- ``<out>/<task>_train_reward.png``: ``train/reward`` per step, mean over runs with a ± std band;
- ``<out>/<task>_eval_reward.png``: ``eval/reward`` per eval step as points with ± std bars (no line
  between evaluations); groups evaluated only at step 0 (prompt-only baselines) are horizontal dashed lines;
- ``<out>/<task>_final.png``: the headline metric per group, a dot-and-interval chart (IQM, CI, runs).

Without ``--out`` the report goes to a new directory ``reports/<date>_<time>/``, so it never replaces a
file (committed results included); an explicit ``--out`` replaces same-named files there. The files carry
no timestamps, so they can be committed and diffed. From Python::

    from marl_llm.report.cli import find_runs, aggregate, write_report
    write_report(find_runs(["multirun"]), "results")
"""

from __future__ import annotations

import argparse
import csv
import difflib
import hashlib
import io
import json
import math
import os
import re
import sys
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from marl_llm.runs.atomic import atomic_write, atomic_write_text
from marl_llm.config import UserError

DEFAULT_ROOTS = ("outputs", "multirun")
DEFAULT_REPORTS_DIR = "reports"
FORMATS = ("md", "csv", "json")
# Prompt-only baselines lead the table so trained methods read as improvements over them.
BASELINE_ORDER = ("single", "parallel", "sequential", "discussion")
RUN_REQUIREMENTS = "config.yaml (or .hydra/config.yaml), metrics.jsonl and, once finished, summary.json"

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

# Intervals of the headline metric, rliable's recipe (Agarwal et al. 2021): the interquartile mean over
# runs and a percentile bootstrap that resamples runs within each task (stratified). Fixed seed: the
# report is reproducible byte for byte.
CI_LEVEL = 0.95
CI_RESAMPLES = 2000
CI_SEED = 0
CI_DESCRIPTION = (f"IQM (interquartile mean: the mean of the middle 50% of runs, the plain mean below 4 runs) "
                  f"with a {CI_LEVEL:.0%} percentile bootstrap confidence interval: runs resampled with "
                  f"replacement within each task (stratified bootstrap, as rliable), {CI_RESAMPLES} resamples, "
                  f"seed {CI_SEED}")

_LEVEL_RE = re.compile(r"^eval/rewards/(.+)/mean$")
_PASS_RE = re.compile(r"^eval/pass@(\d+)$")
MISSING = "—"
NA = "n/a"


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


@dataclass
class Run:
    """One finished run: its identity from config.yaml and its curves from metrics.jsonl."""

    path: Path
    task: str
    method: str  # logger.group if set, else algo.name: the base of the run's group label
    algo: str
    model: str | None
    seed: int | None
    max_steps: int | None
    summary: dict[str, Any]
    train: dict[int, dict[str, float]] = field(default_factory=dict)
    eval: dict[int, dict[str, float]] = field(default_factory=dict)
    # Every leaf of config.yaml by dotted path ("algo.sampling.temperature"): what the groups are built from.
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def display_path(self) -> str:
        # Relative to the working directory when possible so the committed report is machine-independent.
        try:
            return self.path.resolve().relative_to(Path.cwd().resolve()).as_posix()
        except ValueError:
            return self.path.as_posix()

    @property
    def final_eval(self) -> dict[str, float]:
        return self.eval[max(self.eval)] if self.eval else {}

    @property
    def steps(self) -> int | None:
        s = self.summary.get("steps")
        return int(s) if isinstance(s, (int, float)) else self.max_steps

    @property
    def eval_only(self) -> bool:
        return not self.train and set(self.eval) <= {0}


# ----------------------------------------------------------------------------------------------- reading


def _config_path(d: Path) -> Path | None:
    for p in (d / "config.yaml", d / ".hydra" / "config.yaml"):
        if p.is_file():
            return p
    return None


def _is_run_dir(d: Path) -> bool:
    return (d / "metrics.jsonl").is_file() and _config_path(d) is not None


def _iter_run_dirs(root: Path) -> Iterable[Path]:
    if _is_run_dir(root):
        yield root
        return
    for dirpath, dirnames, _ in os.walk(root):
        d = Path(dirpath)
        if d != root and _is_run_dir(d):
            yield d
            # A run's own subfolders (wandb/, checkpoints) never hold other runs; not walking them is much faster.
            dirnames[:] = []
            continue
        dirnames[:] = sorted(n for n in dirnames if not n.startswith("."))


def _select(cfg: Any, key: str) -> Any:
    from omegaconf import OmegaConf

    # Unresolvable interpolations (e.g. in an unresolved .hydra/config.yaml) read as missing, not as errors.
    return OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of a nested dict by dotted path; lists are leaves, empty maps have none (a map that
    gained a key then differs from the empty one in that key only)."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def _config_leaves(cfg: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    try:
        tree = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # noqa: BLE001 - an unresolved .hydra/config.yaml: compare the interpolations' text
        tree = OmegaConf.to_container(cfg, resolve=False)
    return _flatten(tree) if isinstance(tree, dict) else {}


def _read_metrics(path: Path) -> tuple[dict[int, dict[str, float]], dict[int, dict[str, float]]]:
    train: dict[int, dict[str, float]] = {}
    evals: dict[int, dict[str, float]] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise TypeError("not a JSON object")
                step = int(row["step"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path.name} line {lineno}: {type(e).__name__}: {e}") from None
            for key, value in row.items():
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    continue
                # A resumed run re-logs steps after its last checkpoint; the later row is the one that counts.
                if key.startswith("train/"):
                    train.setdefault(step, {})[key] = float(value)
                elif key.startswith("eval/"):
                    evals.setdefault(step, {})[key] = float(value)
    return train, evals


def load_run(d: Path) -> Run:
    """Read one run directory; raises FileNotFoundError if unfinished, ValueError/OSError if unreadable."""
    from omegaconf import OmegaConf

    summary_path = d / "summary.json"
    if not summary_path.is_file():
        raise FileNotFoundError("unfinished (no summary.json)")
    cfg_path = _config_path(d)
    assert cfg_path is not None
    try:
        cfg = OmegaConf.load(cfg_path)
    except Exception as e:  # noqa: BLE001 - any YAML/OmegaConf failure means the same thing here: unreadable
        raise ValueError(f"{cfg_path.name}: {e}") from None
    summary = json.loads(summary_path.read_text(encoding="utf-8"))
    if not isinstance(summary, dict):
        raise ValueError("summary.json is not a JSON object")
    task, algo = _select(cfg, "task.name"), _select(cfg, "algo.name")
    if not task or not algo:
        raise ValueError(f"{cfg_path.name} lacks task.name or algo.name")
    group = _select(cfg, "logger.group")
    seed = _select(cfg, "seed")
    max_steps = _select(cfg, "trainer.max_steps")
    train, evals = _read_metrics(d / "metrics.jsonl")
    return Run(path=d, task=str(task), method=str(group) if group not in (None, "") else str(algo), algo=str(algo),
               model=None if _select(cfg, "model.name") is None else str(_select(cfg, "model.name")),
               seed=int(seed) if isinstance(seed, (int, float)) and not isinstance(seed, bool) else None,
               max_steps=int(max_steps) if isinstance(max_steps, int) else None,
               summary=summary, train=train, eval=evals, config=_config_leaves(cfg))


def find_runs(paths: Sequence[str | os.PathLike[str]]) -> list[Run]:
    """Every finished, readable run under `paths` (run dirs or roots searched recursively), sorted by path.

    Unfinished and unreadable runs are skipped with a warning on stderr; missing paths too.
    """
    runs: list[Run] = []
    seen: set[Path] = set()
    for p in paths:
        root = Path(p)
        if not root.exists():
            warn(f"{root}: no such file or directory")
            continue
        for d in _iter_run_dirs(root):
            key = d.resolve()
            if key in seen:  # overlapping roots (e.g. `outputs outputs/x`) must not count a run twice
                continue
            seen.add(key)
            try:
                runs.append(load_run(d))
            except FileNotFoundError as e:
                warn(f"skipping {d}: {e}")
            except (OSError, ValueError, UnicodeDecodeError) as e:
                warn(f"skipping {d}: unreadable ({e})")
    return sorted(runs, key=lambda r: r.path.as_posix())


# ----------------------------------------------------------------------------------------------- grouping

_ABSENT = object()  # a key that a run's config does not have (unlike a key set to null)


def is_ignored(key: str) -> bool:
    return any(fnmatchcase(key, pattern) for pattern in IGNORED_KEYS)


def comparability_kind(key: str) -> str | None:
    """"data", "task", "model" or "evaluation" for a key that runs must share to be comparable, else None."""
    return next((kind for pattern, kind in COMPARABILITY_KEYS if fnmatchcase(key, pattern)), None)


def _canon(value: Any) -> str:
    # A hashable spelling that tells 1 from "1" and an absent key from null, and compares lists by content.
    return "\0absent" if value is _ABSENT else json.dumps(value, sort_keys=True, default=str)


def _show(value: Any) -> str:
    if value is _ABSENT:
        return MISSING
    # Strings as typed; everything else as in an override (true, null, [1, 5], 0.0003).
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def _value(run: Run, key: str) -> Any:
    """`key` in the run's config: a leaf, a section (a dict of its leaves, for --group-by algo.sampling),
    or _ABSENT."""
    if key in run.config:
        return run.config[key]
    section = {k[len(key) + 1:]: v for k, v in run.config.items() if k.startswith(key + ".")}
    return section or _ABSENT


def differing_keys(runs: Sequence[Run]) -> list[str]:
    """Config leaves whose values differ between `runs` (set in some, absent in others counts), sorted,
    without IGNORED_KEYS."""
    keys = sorted({k for r in runs for k in r.config})
    return [k for k in keys if not is_ignored(k) and len({_canon(r.config.get(k, _ABSENT)) for r in runs}) > 1]


def _values_text(runs: Sequence[Run], keys: Sequence[str], limit: int = 3) -> str:
    shown = [f"{k} ({' vs '.join(sorted({_show(_value(r, k)) for r in runs}))})" for k in keys[:limit]]
    return "; ".join(shown) + (f"; and {len(keys) - limit} more" if len(keys) > limit else "")


def _short_names(keys: Iterable[str]) -> dict[str, str]:
    """Label spelling of each key: without its section ("baseline" for algo.baseline) unless that is ambiguous."""
    keys = sorted(set(keys))
    short = {k: k.split(".", 1)[-1] for k in keys}
    spellings = list(short.values())
    return {k: k if spellings.count(s) > 1 else s for k, s in short.items()}


def _label_part(key: str, value: Any, short: str) -> str:
    return _show(value) if key in NAME_KEYS else f"{short}={_show(value)}"


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
            buckets[(r.method, *(_canon(r.config.get(k, _ABSENT)) for k in differ))].append(r)
        # Label: the base name, plus the keys that differ between rows of the same base, plus every
        # data/model/task/evaluation key that differs between any rows (those must always be visible).
        critical = [k for k in differ if comparability_kind(k)]
        by_base: dict[str, list[list[Run]]] = defaultdict(list)
        for key, rs in buckets.items():
            by_base[key[0]].append(rs)
        label_keys = {key: [k for k in differ if k in critical or
                            len({_canon(s[0].config.get(k, _ABSENT)) for s in by_base[key[0]]}) > 1]
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
            buckets[tuple(_canon(_value(r, k)) for k in group_by)].append(r)
        short = _short_names(group_by)
        rows = []
        for rs in buckets.values():
            bases = {r.method for r in rs}
            label = ", ".join(_label_part(k, _value(rs[0], k), short[k]) for k in group_by)
            rows.append({"base": bases.pop() if len(bases) == 1 else label, "label": label, "runs": rs,
                         "config": {k: _value(rs[0], k) for k in group_by if _value(rs[0], k) is not _ABSENT}})
    # Two rows whose labels render alike (1 and "1") stay apart.
    seen: dict[str, int] = defaultdict(int)
    for row in sorted(rows, key=lambda row: row["runs"][0].path.as_posix()):
        seen[row["label"]] += 1
        if seen[row["label"]] > 1:
            row["label"] += f" #{seen[row['label']]}"
    rows.sort(key=lambda row: (*_rank(row["base"], row["runs"]), row["label"]))

    warnings: list[str] = []
    mixed: set[str] = set()
    for row in rows:
        inner = differing_keys(row["runs"])
        row["merged"] = {k: sorted({_show(_value(r, k)) for r in row["runs"]}) for k in inner}
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


# ----------------------------------------------------------------------------------------------- statistics


def mean_std(values: Sequence[float]) -> tuple[float, float | None] | None:
    """Mean and sample std (n - 1 denominator: the runs are a sample of seeds); std None for one value,
    which says nothing about the spread."""
    if not values:
        return None
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, None
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def _stat(values: list[float]) -> dict[str, Any] | None:
    ms = mean_std(values)
    return None if ms is None else {"mean": ms[0], "std": ms[1], "count": len(values)}


def iqm(scores: Any) -> Any:
    """Interquartile mean along the last axis: the mean of the middle 50% after cutting int(n/4) scores
    at each end (rliable's ``aggregate_iqm``, scipy's ``trim_mean(x, 0.25)``); the mean for n < 4."""
    x = np.sort(np.asarray(scores, dtype=float), axis=-1)
    cut = int(0.25 * x.shape[-1])
    return x[..., cut:x.shape[-1] - cut].mean(axis=-1)


def stratified_bootstrap_ci(strata: Sequence[Sequence[float]], statistic=iqm, level: float = CI_LEVEL,
                            resamples: int = CI_RESAMPLES, seed: int = CI_SEED) -> tuple[float, float] | None:
    """Percentile bootstrap CI of `statistic` over the pooled scores, each resample drawing every stratum's
    scores (one stratum per task: its runs) with replacement, as rliable's StratifiedBootstrap does.
    None below two scores: one run has no interval."""
    arrays = [np.asarray(s, dtype=float) for s in strata if len(s)]
    if sum(a.size for a in arrays) < 2:
        return None
    rng = np.random.default_rng(seed)
    pooled = np.concatenate([a[rng.integers(0, a.size, size=(resamples, a.size))] for a in arrays], axis=1)
    stats = statistic(pooled)
    low, high = np.percentile(stats, [50 * (1 - level), 50 * (1 + level)])
    return float(low), float(high)


def _headline(runs: Sequence[Run], metric: str | None) -> dict[str, Any] | None:
    values = [r.final_eval[metric] for r in runs if metric and metric in r.final_eval]
    if not values:
        return None
    ci = stratified_bootstrap_ci([values])  # one task per table: one stratum
    return {"metric": metric, "iqm": float(iqm(values)), "ci_low": None if ci is None else ci[0],
            "ci_high": None if ci is None else ci[1], "count": len(values), "values": values}


def _metric_columns(runs: Sequence[Run]) -> list[str]:
    keys: dict[str, None] = {}  # insertion-ordered set: levels keep the order the task logs them in
    for r in runs:
        keys.update(dict.fromkeys(r.final_eval))
    cols = [k for k in ("eval/success_rate", "eval/reward", "eval/reward_ungated") if k in keys]
    cols += [k for k in keys if _LEVEL_RE.match(k)]
    cols += sorted((k for k in keys if _PASS_RE.match(k)), key=lambda k: int(_PASS_RE.match(k).group(1)))
    return cols


def _budgets(run: Run) -> dict[int, float] | None:
    """Joint actions trained on through each step (the sum of train/joint_actions), or None when
    the run does not log them."""
    if not run.train or not all("train/joint_actions" in row for row in run.train.values()):
        return None
    total, out = 0.0, {0: 0.0}
    for step in sorted(run.train):
        total += run.train[step]["train/joint_actions"]
        out[step] = total
    return out


def _curve(rows_per_run: list[dict[int, dict[str, float]]], key: str,
           budgets: list[dict[int, float] | None] | None = None) -> list[dict[str, Any]]:
    by_step: dict[int, list[float]] = defaultdict(list)
    spent: dict[int, list[float]] = defaultdict(list)
    for r, rows in enumerate(rows_per_run):
        for step, row in rows.items():
            if key in row:
                by_step[step].append(row[key])
                if budgets and budgets[r] is not None and step in budgets[r]:
                    spent[step].append(budgets[r][step])
    # Mean of the seeds present at each step: seeds stopped at different steps still give a curve.
    # "budget": the mean joint actions trained on by then (when every seed there logs them).
    return [{"step": s, **_stat(v), **({"budget": sum(spent[s]) / len(spent[s])} if len(spent[s]) == len(v) else {})}
            for s, v in sorted(by_step.items())]


def aggregate(runs: Sequence[Run], group_by: Sequence[str] | None = None,
              allow_mixed: bool = False) -> dict[str, dict[str, Any]]:
    """Group runs per task (see `group_runs`) and compute the table cells and plot curves.

    Returns ``{task: {"columns": [eval keys], "headline": first column, "grouped_by": [keys],
    "warnings": [lines], "methods": {label: {...}}}}`` with tasks sorted and groups in table order.
    Per group: ``runs``, ``n``, ``config`` (its values of the grouping keys), ``merged`` (keys that
    differ inside it), ``steps`` (sorted distinct), ``final`` (``{key: {"mean", "std", "count"}}``, std
    None for one run), ``headline`` (``{"metric", "iqm", "ci_low", "ci_high", "count", "values"}``),
    ``delta``, ``wall_s`` and ``joint_actions`` (same shape as final's or None), ``eval_only``,
    ``train_curve`` and ``eval_curve`` (lists of ``{"step", "mean", "std", "count"[, "budget"]}``).
    Raises UserError for a ``group_by`` group that mixes data/model/task settings (unless allow_mixed).
    """
    by_task: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        by_task[r.task].append(r)
    out: dict[str, dict[str, Any]] = {}
    for task in sorted(by_task):
        rows, grouped_by, warnings = group_runs(task, by_task[task], group_by, allow_mixed)
        cols = _metric_columns(by_task[task])
        headline = cols[0] if cols else None
        methods: dict[str, Any] = {}
        for row in rows:
            label = row["label"]
            rs = sorted(row["runs"], key=lambda r: (r.seed is None, r.seed or 0, r.path.as_posix()))
            # Repeats of one config under one seed; a --group-by group that merges configs shares seeds by design.
            inner = row["merged"]
            seeds = [(r.seed, *(_canon(r.config.get(k, _ABSENT)) for k in inner)) for r in rs if r.seed is not None]
            dups = sorted({s[0] for s in seeds if seeds.count(s) > 1})
            if dups:
                warnings.append(f"{task}/{label}: several runs share seed(s) {dups}; they are counted as separate runs")
            keys = {k for r in rs for k in r.final_eval}
            deltas = [r.final_eval["eval/reward"] - r.eval[0]["eval/reward"] for r in rs
                      if 0 in r.eval and "eval/reward" in r.eval[0] and "eval/reward" in r.final_eval]
            walls = [float(r.summary["wall_s"]) for r in rs if isinstance(r.summary.get("wall_s"), (int, float))]
            # The training budget in joint actions (matched-budget comparisons); runs that log it.
            spent = [_budgets(r) for r in rs]
            budgets = [b[max(b)] for b in spent if b is not None]
            methods[label] = {
                "runs": rs,
                "n": len(rs),
                "config": row["config"],
                "merged": row["merged"],
                "steps": sorted({r.steps for r in rs if r.steps is not None}),
                "final": {k: _stat([r.final_eval[k] for r in rs if k in r.final_eval]) for k in sorted(keys)},
                "headline": _headline(rs, headline),
                "delta": _stat(deltas),
                "wall_s": _stat(walls),
                "joint_actions": _stat(budgets),
                "eval_only": all(r.eval_only for r in rs),
                "train_curve": _curve([r.train for r in rs], "train/reward", spent),
                "eval_curve": _curve([r.eval for r in rs], "eval/reward", spent),
            }
        for line in warnings:
            warn(line)
        out[task] = {"columns": cols, "headline": headline, "grouped_by": grouped_by,
                     "group_by_explicit": group_by is not None, "warnings": warnings, "methods": methods}
    return out


# ----------------------------------------------------------------------------------------------- writing


def _num(x: float, fmt: str) -> str:
    s = format(x, fmt)
    # "-0.000" and "0.000" are the same number; one spelling keeps diffs quiet.
    return s[1:] if s.startswith("-") and float(s) == 0 else s


def _cell(stat: dict[str, Any] | None, n: int, fmt: str = ".3f") -> str:
    if stat is None:
        return MISSING
    std = NA if stat["std"] is None else _num(stat["std"], fmt)
    text = f"{_num(stat['mean'], fmt)} ± {std}"
    return text if stat["count"] == n else f"{text} ({stat['count']}/{n})"


def _ci_cell(head: dict[str, Any] | None, n: int, fmt: str = ".3f") -> str:
    if head is None:
        return MISSING
    ci = NA if head["ci_low"] is None else f"{_num(head['ci_low'], fmt)}, {_num(head['ci_high'], fmt)}"
    text = f"{_num(head['iqm'], fmt)} [{ci}]"
    return text if head["count"] == n else f"{text} ({head['count']}/{n})"


def _header(key: str) -> str:
    m = _LEVEL_RE.match(key)
    if m:
        return m.group(1)
    return key[len("eval/"):] if _PASS_RE.match(key) or key == "eval/success_rate" else key


def _esc(text: str) -> str:
    return text.replace("|", "\\|")


def _fence(text: str) -> str:
    ticks = "```"
    while ticks in text:  # a longer fence than any backtick run inside keeps the commands verbatim
        ticks += "`"
    return f"{ticks}sh\n{text.rstrip(chr(10))}\n{ticks}"


def _safe_name(task: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", task) or "task"


def _key_list(keys: Sequence[str], limit: int = 12) -> str:
    shown = ", ".join(f"`{k}`" for k in keys[:limit])
    return (shown + (f" and {len(keys) - limit} more (all in `--format json`)" if len(keys) > limit else "")) or "none"


def render_markdown(task: str, agg: dict[str, Any], commands: str | None = None) -> str:
    cols, methods, head = agg["columns"], agg["methods"], agg["headline"]
    n_runs = sum(m["n"] for m in methods.values())
    if agg["group_by_explicit"]:
        grouping = f"Rows: `--group-by {','.join(agg['grouped_by'])}`."
    else:
        grouping = ("Rows: runs whose configs match in every key but the seed and bookkeeping keys; keys that differ "
                    f"between rows: {_key_list(agg['grouped_by'])}.")
    lines = [
        f"# {task}: method comparison",
        "",
        f"Held-out evaluation at each run's final eval step, mean ± sample std over the runs (seeds) of each "
        f"group ({NA}: one run); {len(methods)} group(s), {n_runs} run(s). Generated by `marl-llm-report` from "
        f"the runs' local files.",
        "",
        grouping,
        "",
    ]
    if head:
        lines += [f"Intervals ({_header(head)}): {CI_DESCRIPTION}.", ""]
    lines += [f"- **Warning:** {_esc(w)}" for w in agg["warnings"]]
    if agg["warnings"]:
        lines.append("")
    budget = any(m["joint_actions"] for m in methods.values())
    header = ["method", "n", "steps", *(["joint actions"] if budget else []),
              *([f"{_header(head)} IQM [{CI_LEVEL:.0%} CI]"] if head else []),
              *(_header(c) for c in cols), "Δ vs step 0", "train time (s)"]
    lines += ["| " + " | ".join(_esc(h) for h in header) + " |", "|" + "---|" * len(header)]
    for method, m in methods.items():
        steps = "/".join(str(s) for s in m["steps"]) or MISSING
        cells = [_esc(method), str(m["n"]), steps, *([_cell(m["joint_actions"], m["n"], ".0f")] if budget else []),
                 *([_ci_cell(m["headline"], m["n"])] if head else []),
                 *(_cell(m["final"].get(c), m["n"]) for c in cols),
                 _cell(m["delta"], m["n"]), _cell(m["wall_s"], m["n"], ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Runs", ""]
    for method, m in methods.items():
        for r in m["runs"]:
            extra = ", ".join(x for x in (f"model {r.model}" if r.model else "",
                                          f"{r.steps} steps" if r.steps is not None else "") if x)
            lines.append(f"- {_esc(method)}, seed {r.seed if r.seed is not None else '?'}: `{r.display_path}`"
                         + (f" ({extra})" if extra else ""))
    lines += [
        "",
        "## Legend",
        "",
        "- **method**: one group of runs. By default the runs that share every config key except the seed and "
        "bookkeeping (run dir, logger, resume, speed-only knobs), labelled `logger.group` if set, else "
        "`algo.name`, plus the keys that tell it apart from groups of the same algorithm and any data, model, "
        "task or evaluation key that differs between rows. single / parallel / sequential / discussion are "
        "untrained prompt-only baselines (evaluated at step 0 only).",
        "- **n**: runs (seeds) in the group; **steps**: training steps (`summary.json` steps; 0 = evaluation only).",
        *(["- **joint actions**: joint actions scored in training (the sum of `train/joint_actions`), the budget "
           "of a matched-budget comparison."] if budget else []),
        *([f"- **{_header(head)} IQM [{CI_LEVEL:.0%} CI]**: the interquartile mean over the group's runs and its "
           f"bootstrap confidence interval (above); {NA} for one run."] if head else []),
        "- Metric columns: held-out `eval/*` metrics from the eval row with the largest step of each run, "
        f"as mean ± sample std over runs ({NA} for one run). `eval/reward` is the joint team reward; level "
        "columns are `eval/rewards/<level>/mean`; `pass@k` is the functional pass rate.",
        "- **Δ vs step 0**: final `eval/reward` minus the same run's `eval/reward` at step 0 (before training); "
        "0 for evaluation-only runs.",
        "- **train time (s)**: wall-clock seconds of the whole run (`summary.json` wall_s).",
        f"- `(k/n)`: only k of the n runs logged that value; {MISSING}: no run did.",
        "",
    ]
    if commands is not None:
        lines += ["## Commands", "", _fence(commands), ""]
    return "\n".join(lines)


def _csv_num(x: float | None) -> str:
    return "" if x is None else format(x, ".12g")


def render_csv(task: str, agg: dict[str, Any]) -> str:
    """One row per group: its config values, the headline IQM and CI, and mean/std/count of each metric."""
    cols, head, methods = agg["columns"], agg["headline"], agg["methods"]
    config_keys = list(agg["grouped_by"])
    header = ["task", "method", "n", "seeds", "steps", *(f"config:{k}" for k in config_keys),
              "joint_actions_mean", "joint_actions_std"]
    if head:
        header += [f"{head}_iqm", f"{head}_ci_low", f"{head}_ci_high", "ci_level", "ci_resamples", "ci_method"]
    for c in [*cols, "delta", "wall_s"]:
        header += [f"{c}_mean", f"{c}_std", f"{c}_n"]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    for label, m in methods.items():
        row = [task, label, m["n"], " ".join(str(r.seed) for r in m["runs"] if r.seed is not None),
               "/".join(str(s) for s in m["steps"]),
               *(_show(m["config"][k]) if k in m["config"] else "" for k in config_keys),
               *((_csv_num(m["joint_actions"]["mean"]), _csv_num(m["joint_actions"]["std"]))
                 if m["joint_actions"] else ("", ""))]
        if head:
            h = m["headline"] or {}
            row += [_csv_num(h.get("iqm")), _csv_num(h.get("ci_low")), _csv_num(h.get("ci_high")), CI_LEVEL,
                    CI_RESAMPLES, f"IQM, stratified percentile bootstrap, seed {CI_SEED}"]
        for stat in [*(m["final"].get(c) for c in cols), m["delta"], m["wall_s"]]:
            row += [_csv_num(stat["mean"]), _csv_num(stat["std"]), stat["count"]] if stat else ["", "", 0]
        writer.writerow(row)
    return buf.getvalue()


def render_json(task: str, agg: dict[str, Any]) -> str:
    """Everything the table and plots show, curves included, for scripts (null: no value / one run)."""
    groups = []
    for label, m in agg["methods"].items():
        groups.append({
            "label": label, "n": m["n"], "seeds": [r.seed for r in m["runs"]],
            "runs": [r.display_path for r in m["runs"]], "config": m["config"], "merged": m["merged"],
            "steps": m["steps"], "eval_only": m["eval_only"], "headline": m["headline"], "final": m["final"],
            "delta": m["delta"], "wall_s": m["wall_s"], "joint_actions": m["joint_actions"],
            "train_curve": m["train_curve"], "eval_curve": m["eval_curve"],
        })
    doc = {
        "task": task, "grouped_by": agg["grouped_by"], "group_by_explicit": agg["group_by_explicit"],
        "headline": agg["headline"], "columns": agg["columns"], "std": "sample (n - 1), null for one run",
        "interval": {"statistic": "IQM", "method": "percentile bootstrap, runs resampled within each task "
                     "(stratified)", "level": CI_LEVEL, "resamples": CI_RESAMPLES, "seed": CI_SEED},
        "warnings": agg["warnings"], "groups": groups,
    }
    return json.dumps(doc, indent=2, default=str) + "\n"


RENDERERS = {"md": render_markdown, "csv": render_csv, "json": render_json}


def parse_formats(values: Sequence[str] | None) -> list[str]:
    """`--format` values (comma-separated, repeatable) as a list; default md."""
    formats = list(dict.fromkeys(f.strip().lower() for v in (values or ["md"]) for f in v.split(",") if f.strip()))
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise UserError(f"--format {','.join(unknown) or '(empty)'}: not a table format; choose from "
                        f"{', '.join(FORMATS)} (comma-separated, e.g. --format md,csv,json)")
    return formats


# ----------------------------------------------------------------------------------------------- plots

_LINESTYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
# The algorithms every comparison shows get fixed, distinct tab10 colours; other labels hash to one.
_PINNED_COLORS = {"magrpo": 0, "collm_cc": 1, "collm_dc": 2, "at_grpo": 3, "single": 4, "parallel": 5,
                  "sequential": 6, "discussion": 7}


def group_style(label: str) -> dict[str, Any]:
    """Colour, line style and marker of a group in every plot of every report: derived from its label
    alone (sha256, not Python's per-process salted hash), so a method keeps its look across reports,
    and two groups that share a colour still differ in dashes or markers."""
    import matplotlib

    digest = hashlib.sha256(label.encode("utf-8")).digest()
    color = matplotlib.colormaps["tab10"](_PINNED_COLORS.get(label, digest[0] % 10))
    return {"color": color, "linestyle": _LINESTYLES[digest[1] % len(_LINESTYLES)],
            "marker": _MARKERS[digest[2] % len(_MARKERS)]}


def _pyplot():
    import matplotlib

    # Agg: no display needed (headless nodes, CI); it must be chosen before pyplot is first imported.
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save_fig(fig: Any, path: Path) -> None:
    # No "Software" metadata: the PNG bytes then do not change with the matplotlib version.
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120, metadata={"Software": None}))


@contextmanager
def _figure(path: Path, title: str, ylabel: str, size: tuple[float, float] = (7, 4.5), legend: bool = True):
    """A figure with the report's common frame; saved (atomically) to `path` when the body is done."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=size)
    try:
        yield ax
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if legend:
            ax.legend()
        fig.tight_layout()
        _save_fig(fig, path)
    finally:
        plt.close(fig)


def _x_axis(curves: list[list[dict[str, Any]]]) -> tuple[str, str]:
    """(curve key, label) of the x axis: joint actions trained on when every point has them (the
    budget of a matched-budget comparison: methods with different step sizes line up), else steps."""
    if curves and all("budget" in p for c in curves for p in c):
        return "budget", "training joint actions"
    return "step", "step"


def _integer_x(ax: Any, xlabel: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel(xlabel)
    # Steps and joint actions are counts: no 2.5 ticks.
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def draw_train_reward(ax: Any, agg: dict[str, Any]) -> bool:
    """train/reward per step: a line with markers per group (a one-step run shows its point) and a ± std
    band (bars for a single step) where the group has several runs. False when no group has train rows."""
    methods = {m: a for m, a in agg["methods"].items() if a["train_curve"]}
    if not methods:
        return False
    x, xlabel = _x_axis([a["train_curve"] for a in methods.values()])
    for method, a in methods.items():
        style = group_style(method)
        xs = [p[x] for p in a["train_curve"]]
        ys = [p["mean"] for p in a["train_curve"]]
        sd = [p["std"] or 0.0 for p in a["train_curve"]]
        ax.plot(xs, ys, color=style["color"], linestyle=style["linestyle"], marker=style["marker"], markersize=5,
                markevery=max(1, math.ceil(len(xs) / 12)), label=f"{method} (n={a['n']})")
        if any(sd):
            if len(xs) > 1:
                ax.fill_between(xs, [y - s for y, s in zip(ys, sd)], [y + s for y, s in zip(ys, sd)],
                                color=style["color"], alpha=0.15, linewidth=0)
            else:
                ax.errorbar(xs, ys, yerr=sd, fmt="none", ecolor=style["color"], capsize=3)
    _integer_x(ax, xlabel)
    return True


def draw_eval_reward(ax: Any, agg: dict[str, Any]) -> bool:
    """eval/reward at each eval step: points with ± std bars, never joined (nothing was measured between
    two evaluations); evaluation-only groups as a dashed level from their step-0 point."""
    methods = {m: a for m, a in agg["methods"].items() if a["eval_curve"]}
    if not methods:
        return False
    trained = [a["eval_curve"] for a in methods.values() if not a["eval_only"]]
    x, xlabel = _x_axis(trained)
    max_x = max((p[x] for c in trained for p in c), default=0)
    for method, a in methods.items():
        style = group_style(method)
        label = f"{method} (n={a['n']})"
        if a["eval_only"]:
            p = a["eval_curve"][0]
            ax.axhline(p["mean"], color=style["color"], linestyle="--", linewidth=1.2, label=f"{label}, no training")
            ax.errorbar([0], [p["mean"]], yerr=[p["std"] or 0.0], color=style["color"], marker=style["marker"],
                        linestyle="none", capsize=3)
        else:
            ax.errorbar([p[x] for p in a["eval_curve"]], [p["mean"] for p in a["eval_curve"]],
                        yerr=[p["std"] or 0.0 for p in a["eval_curve"]], color=style["color"],
                        marker=style["marker"], linestyle="none", capsize=3, label=label)
    ax.set_xlim(-0.05 * max(max_x, 1), max(max_x, 1) * 1.05)
    _integer_x(ax, xlabel)
    return True


def draw_final(ax: Any, agg: dict[str, Any]) -> bool:
    """Dot-and-interval chart of the headline metric: one row per group with its IQM (filled marker),
    bootstrap CI (bar) and each run (hollow markers); matched-budget groups no longer stack at one x."""
    groups = [(m, a) for m, a in agg["methods"].items() if a["headline"]]
    if not groups:
        return False
    for i, (method, a) in enumerate(groups):
        y, head, style = len(groups) - 1 - i, a["headline"], group_style(method)
        ax.plot(head["values"], [y] * len(head["values"]), linestyle="none", marker=style["marker"],
                markerfacecolor="none", color=style["color"], alpha=0.7, markersize=6)
        if head["ci_low"] is not None:
            ax.hlines(y, head["ci_low"], head["ci_high"], colors=[style["color"]], linewidth=2.5)
        ax.plot([head["iqm"]], [y], linestyle="none", marker=style["marker"], color=style["color"], markersize=9)
    ax.set_yticks(range(len(groups)))
    ax.set_yticklabels([f"{m} (n={a['n']})" for m, a in reversed(groups)])
    ax.set_ylim(-0.6, len(groups) - 0.4)
    ax.set_xlabel(f"{_header(agg['headline'])} at each run's final evaluation")
    return True


def _plot_curves(curve: str, title: str, ylabel: str, draw: Any) -> Any:
    """A plot of one curve kind (train_curve / eval_curve) of every group; False when none has it."""

    def plot(task: str, agg: dict[str, Any], path: Path) -> bool:
        if not any(a[curve] for a in agg["methods"].values()):
            return False
        with _figure(path, f"{task}: {title} (mean ± sample std over runs)", ylabel) as ax:
            draw(ax, agg)
        return True

    return plot


plot_train_reward = _plot_curves("train_curve", "training reward", "train/reward", draw_train_reward)
plot_eval_reward = _plot_curves("eval_curve", "held-out eval reward", "eval/reward", draw_eval_reward)


def plot_final(task: str, agg: dict[str, Any], path: Path) -> bool:
    n = sum(1 for a in agg["methods"].values() if a["headline"])
    if not n:
        return False
    title = f"{task}: IQM (filled), {CI_LEVEL:.0%} bootstrap CI (bar), runs (hollow)"
    with _figure(path, title, "", size=(7, 1.6 + 0.5 * n), legend=False) as ax:
        draw_final(ax, agg)
    return True


def write_report(runs: Sequence[Run], out_dir: str | os.PathLike[str], commands: str | None = None,
                 formats: Sequence[str] = ("md",), group_by: Sequence[str] | None = None,
                 allow_mixed: bool = False, exclusive: bool = False) -> list[Path]:
    """Write per task the tables (`<task>.<fmt>` for each of `formats`) and the plots into `out_dir`;
    returns the paths written. `exclusive`: `out_dir` must not exist yet (so nothing is replaced).

    `commands` (text, e.g. the exact command lines used) is appended verbatim under "## Commands".
    Raises UserError for a bad format or a refused grouping, before anything is written.
    """
    formats = parse_formats(formats)
    aggs = aggregate(runs, group_by, allow_mixed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=not exclusive)
    written: list[Path] = []
    for task, agg in aggs.items():
        name = _safe_name(task)
        for fmt in formats:
            path = out / f"{name}.{fmt}"
            text = render_markdown(task, agg, commands) if fmt == "md" else RENDERERS[fmt](task, agg)
            atomic_write_text(path, text)
            written.append(path)
        for kind, plot, what in (("train_reward", plot_train_reward, "train/reward rows"),
                                 ("eval_reward", plot_eval_reward, "eval/reward rows"),
                                 ("final", plot_final, "final eval metrics")):
            png = out / f"{name}_{kind}.png"
            if plot(task, agg, png):
                written.append(png)
            else:
                print(f"[marl-llm-report] {task}: no method has {what}; skipping {png}", flush=True)
    return written


def fresh_report_dir(root: str | os.PathLike[str] = DEFAULT_REPORTS_DIR, now: datetime | None = None) -> Path:
    """A directory name under `root` that does not exist yet: <date>_<time>, with -2, -3, ... on a clash."""
    stamp = (now or datetime.now()).strftime("%Y-%m-%d_%H-%M-%S")
    path, i = Path(root) / stamp, 2
    while path.exists():
        path, i = Path(root) / f"{stamp}-{i}", i + 1
    return path


# ----------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="marl-llm-report",
        description="Comparison tables (mean ± sample std over seeds, IQM with bootstrap CIs) and reward plots "
                    "from finished marl-llm runs.",
        epilog=f"A run directory holds {RUN_REQUIREMENTS}. Output has no timestamps, so it can be committed.")
    p.add_argument("paths", nargs="*", metavar="RUN_DIRS_OR_ROOTS",
                   help=f"run directories or roots searched recursively (default: {' '.join(DEFAULT_ROOTS)})")
    p.add_argument("--out", help=f"output directory; same-named files there are replaced (default: a new "
                                 f"{DEFAULT_REPORTS_DIR}/<date>_<time>/, so no existing file is ever replaced)")
    p.add_argument("--task", action="append", metavar="NAME", help="only this task (repeatable)")
    p.add_argument("--commands", metavar="FILE", help="file with the exact commands used, appended to each table")
    p.add_argument("--group-by", action="append", metavar="KEY[,KEY...]",
                   help="config keys (or sections) whose values define the rows, e.g. algo.name or "
                        "algo.name,algo.baseline (default: every key that differs between the runs, except the "
                        "seed and bookkeeping keys)")
    p.add_argument("--allow-mixed", action="store_true",
                   help="report a --group-by group whose runs differ in data, model, task or evaluation settings "
                        "(with a warning) instead of refusing")
    p.add_argument("--format", action="append", metavar="FMT[,FMT...]",
                   help=f"table formats: {', '.join(FORMATS)} (default: md; plots are always written)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    paths = args.paths or list(DEFAULT_ROOTS)
    try:
        formats = parse_formats(args.format)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    commands = None
    if args.commands:
        try:
            commands = Path(args.commands).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            print(f"error: cannot read --commands file {args.commands}: {e}", file=sys.stderr)
            return 2
    # Explicit paths that do not exist deserve a warning; absent default roots are just "nothing there".
    runs = find_runs(paths if args.paths else [p for p in paths if Path(p).exists()])
    if args.task:
        runs = [r for r in runs if r.task in set(args.task)]
    if not runs:
        only = f" for task(s) {', '.join(args.task)}" if args.task else ""
        print(f"error: no finished runs{only} found under {', '.join(paths)}; a run directory must contain "
              f"{RUN_REQUIREMENTS}", file=sys.stderr)
        return 2
    # Only a directory the user names may have files replaced: committed results/ tables stay as they are.
    out = Path(args.out) if args.out else fresh_report_dir()
    try:
        written = write_report(runs, out, commands, formats, parse_group_by(args.group_by, runs),
                               args.allow_mixed, exclusive=not args.out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write the report to {out}: {e}", file=sys.stderr)
        return 1
    for p in written:
        print(p)
    if not args.out:
        print(f"[marl-llm-report] no --out given: wrote the new directory {out} (--out DIR writes there instead, "
              f"replacing files of the same name)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
