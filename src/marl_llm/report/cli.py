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
and bookkeeping keys (``IGNORED_KEYS`` in ``grouping.py``), so a sweep ``algo.baseline=mean,rloo`` gives
two rows. A row's label is ``logger.group`` (else ``algo.name``) plus the keys that tell it apart from
rows of the same algorithm, and any data/model/task/evaluation key that differs between rows (those also
print a warning). ``--group-by KEYS`` groups by those keys instead; a group that then mixes data, model,
task or evaluation settings is refused (``--allow-mixed``: warned and reported).

Per task it writes (``--format``, default ``md``):

- ``<out>/<task>.md``: group x metric table of held-out metrics at each run's final eval step,
  ``mean ± sample std`` over runs (``n/a`` for one run), the IQM of the headline metric with a
  stratified-bootstrap 95% CI, the runs used, a legend and (``--commands FILE``) the exact commands;
- ``<out>/<task>.csv`` and ``<out>/<task>.json``: the same numbers (the JSON also the curves);
- ``<out>/<task>_train_reward.png``: ``train/reward`` per step, mean over runs with a ± std band;
- ``<out>/<task>_eval_reward.png``: ``eval/reward`` per eval step as points with ± std bars (no line
  between evaluations); groups evaluated only at step 0 (prompt-only baselines) are horizontal dashed lines;
- ``<out>/<task>_final.png``: the headline metric per group, a dot-and-interval chart (IQM, CI, runs);
  ``--metric NAME`` chooses it (default: the first metric column).

Without ``--out`` the report goes to a new directory ``reports/<date>_<time>/``, so it never replaces a
file (committed results included); an explicit ``--out`` replaces same-named files there. The files carry
no timestamps, so they can be committed and diffed. From Python::

    from marl_llm.report.cli import write_report
    from marl_llm.report.runs import find_runs
    write_report(find_runs(["multirun"]), "results")

This module holds `write_report` (the tables and plots of every task) and the command line; the
pieces live beside it: runs (loading), grouping (rows, IGNORED_KEYS, the mixed-settings checks), stats
(std, IQM, bootstrap), aggregate (the numbers per group), tables (md/csv/json) and plots.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from datetime import datetime
from pathlib import Path
from typing import Sequence

from marl_llm.config import UserError
from marl_llm.extras import install_line, missing
from marl_llm.report.aggregate import aggregate
from marl_llm.report.grouping import parse_group_by
from marl_llm.report.plots import plot_eval_reward, plot_final, plot_train_reward
from marl_llm.report.runs import RUN_REQUIREMENTS, Run, find_runs, warn
from marl_llm.report.tables import FORMATS, RENDERERS, parse_formats, render_markdown
from marl_llm.runs.atomic import atomic_write_text

DEFAULT_ROOTS = ("outputs", "multirun")
DEFAULT_REPORTS_DIR = "reports"


def _safe_name(task: str) -> str:
    # A task name as a file name: whatever a path or shell would trip on becomes "_".
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", task) or "task"


def write_report(runs: Sequence[Run], out_dir: str | os.PathLike[str], commands: str | None = None,
                 formats: Sequence[str] = ("md",), group_by: Sequence[str] | None = None,
                 allow_mixed: bool = False, exclusive: bool = False, metric: str | None = None) -> list[Path]:
    """Write per task the tables (`<task>.<fmt>` for each of `formats`) and the plots into `out_dir`;
    returns the paths written. `exclusive`: `out_dir` must not exist yet (so nothing is replaced).

    `commands` (text, e.g. the exact command lines used) is appended verbatim under "## Commands".
    `metric`: the headline metric (the IQM column and the final chart; default: the first column).
    Raises UserError for a bad format, a refused grouping or an unknown metric, before anything is written.
    """
    formats = parse_formats(formats)
    aggs = aggregate(runs, group_by, allow_mixed, metric)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=not exclusive)
    written: list[Path] = []
    no_plots = missing("report")
    if no_plots:  # the tables need no matplotlib; say once why there are no figures
        warn(f"no plots: marl-llm-report draws them with {', '.join(no_plots)}, which is not installed: "
             f"{install_line('report')}")
    for task, agg in aggs.items():
        name = _safe_name(task)
        for fmt in formats:
            path = out / f"{name}.{fmt}"
            text = render_markdown(task, agg, commands) if fmt == "md" else RENDERERS[fmt](task, agg)
            atomic_write_text(path, text)
            written.append(path)
        for kind, plot, what in () if no_plots else (("train_reward", plot_train_reward, "train/reward rows"),
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
    p.add_argument("--metric", metavar="NAME",
                   help="the headline metric, of the IQM column and the final chart: a key of the final evaluation "
                        "with or without eval/, e.g. pass@1, reward, turn_2/reward, rewards/tests/mean or a level's "
                        "name (default: success_rate, else reward, else the first metric)")
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
    unreadable: list[Path] = []
    runs = find_runs(paths if args.paths else [p for p in paths if Path(p).exists()], unreadable)
    if args.task:
        runs = [r for r in runs if r.task in set(args.task)]
    if not runs and unreadable and not args.task:
        print(f"error: no readable finished runs under {', '.join(paths)}: {len(unreadable)} skipped as unreadable, "
              "each named above with its file; restore those files or leave the runs out", file=sys.stderr)
        return 2
    if not runs:
        only = f" for task(s) {', '.join(args.task)}" if args.task else ""
        print(f"error: no finished runs{only} found under {', '.join(paths)}; a run directory must contain "
              f"{RUN_REQUIREMENTS}", file=sys.stderr)
        return 2
    # Only a directory the user names may have files replaced: committed results/ tables stay as they are.
    out = Path(args.out) if args.out else fresh_report_dir()
    try:
        written = write_report(runs, out, commands, formats, parse_group_by(args.group_by, runs),
                               args.allow_mixed, exclusive=not args.out, metric=args.metric)
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
