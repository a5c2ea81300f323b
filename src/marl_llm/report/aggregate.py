"""Per task and group, the numbers the tables and plots show: final held-out metrics, the headline
metric's IQM and interval, the change since step 0, wall time, joint actions trained on, and the reward
curves; also which eval metrics are columns and what their headers read."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Sequence

from marl_llm.config import UserError
from marl_llm.report.grouping import ABSENT, canon, group_runs
from marl_llm.report.runs import Run, warn
from marl_llm.report.stats import iqm, mean_std, stratified_bootstrap_ci

# The per-level rewards and pass@k: metric columns after the headline ones.
_LEVEL_RE = re.compile(r"^eval/rewards/(.+)/mean$")
_PASS_RE = re.compile(r"^eval/pass@(\d+)$")
# Under task.reward.variant=paper: the share of the evaluated problems whose canonical solution
# passes the reference harness, i.e. what pass@1 can reach there (training/evaluation.py).
CEILING = "eval/pass@1_ceiling"


def _metric_columns(runs: Sequence[Run]) -> list[str]:
    keys: dict[str, None] = {}  # insertion-ordered set: levels keep the order the task logs them in
    for r in runs:
        keys.update(dict.fromkeys(r.final_eval))
    cols = [k for k in ("eval/success_rate", "eval/reward", "eval/reward_ungated") if k in keys]
    cols += [k for k in keys if _LEVEL_RE.match(k)]
    cols += sorted((k for k in keys if _PASS_RE.match(k)), key=lambda k: int(_PASS_RE.match(k).group(1)))
    cols += [CEILING] if CEILING in keys else []
    return cols


def metric_header(key: str) -> str:
    """A metric's column header (and axis label): the level for eval/rewards/<level>/mean, pass@k and
    success_rate without their eval/ prefix, any other key as it is."""
    m = _LEVEL_RE.match(key)
    if m:
        return m.group(1)
    if key == CEILING:
        return "pass@1 ceiling"
    return key[len("eval/"):] if _PASS_RE.match(key) or key == "eval/success_rate" else key


def _stat(values: list[float]) -> dict[str, Any] | None:
    ms = mean_std(values)
    return None if ms is None else {"mean": ms[0], "std": ms[1], "count": len(values)}


def _headline(runs: Sequence[Run], metric: str | None) -> dict[str, Any] | None:
    values = [r.final_eval[metric] for r in runs if metric and metric in r.final_eval]
    if not values:
        return None
    ci = stratified_bootstrap_ci([values])  # one task per table: one stratum
    return {"metric": metric, "iqm": float(iqm(values)), "ci_low": None if ci is None else ci[0],
            "ci_high": None if ci is None else ci[1], "count": len(values), "values": values}


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


def headline_key(metric: str, runs: Sequence[Run]) -> str:
    """`--metric` as the eval key it names ("pass@1" or "eval/pass@1"; a level's name reads
    eval/rewards/<level>/mean): UserError naming the metrics there are when no run's final
    evaluation has it."""
    keys = {k for r in runs for k in r.final_eval}
    name = metric.strip()
    for key in (name, f"eval/{name}", f"eval/rewards/{name}/mean"):
        if key in keys:
            return key
    shown = sorted(k[len("eval/"):] for k in keys if not k.startswith("eval/turn_"))
    raise UserError(f"--metric {metric}: no run's final evaluation has it; choose one of "
                    f"{', '.join(shown[:12]) or 'none (no run was evaluated)'}{' ...' if len(shown) > 12 else ''} "
                    "(a turn's as turn_<t>/<name>)")


def aggregate(runs: Sequence[Run], group_by: Sequence[str] | None = None,
              allow_mixed: bool = False, metric: str | None = None) -> dict[str, dict[str, Any]]:
    """Group runs per task (see `group_runs`) and compute the table cells and plot curves.

    Returns ``{task: {"columns": [eval keys], "headline": first column, "grouped_by": [keys],
    "warnings": [lines], "methods": {label: {...}}}}`` with tasks sorted and groups in table order.
    Per group: ``runs``, ``n``, ``config`` (its values of the grouping keys), ``merged`` (keys that
    differ inside it), ``steps`` (sorted distinct), ``final`` (``{key: {"mean", "std", "count"}}``, std
    None for one run), ``headline`` (``{"metric", "iqm", "ci_low", "ci_high", "count", "values"}``),
    ``delta``, ``wall_s`` and ``joint_actions`` (same shape as final's or None), ``eval_problems``
    (the distinct numbers of problems the runs evaluated on, from summary.json), ``eval_only``,
    ``train_curve`` and ``eval_curve`` (lists of ``{"step", "mean", "std", "count"[, "budget"]}``).
    ``metric`` (``--metric``): the headline, a key of the runs' final evaluations (``headline_key``;
    a task whose runs lack it keeps its default, with a warning); default: the first column.
    Raises UserError for a ``group_by`` group that mixes data/model/task settings (unless allow_mixed)
    and for a ``metric`` no run has.
    """
    by_task: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        by_task[r.task].append(r)
    chosen = None if metric is None else headline_key(metric, runs)
    out: dict[str, dict[str, Any]] = {}
    for task in sorted(by_task):
        rows, grouped_by, warnings = group_runs(task, by_task[task], group_by, allow_mixed)
        cols = _metric_columns(by_task[task])
        if chosen is not None and any(chosen in r.final_eval for r in by_task[task]):
            cols = [chosen, *(c for c in cols if c != chosen)]  # the headline leads the table
        elif chosen is not None:
            warnings.append(f"{task}: no run has {chosen} (--metric); its headline stays "
                            f"{cols[0] if cols else 'none'}")
        headline = cols[0] if cols else None
        methods: dict[str, Any] = {}
        for row in rows:
            label = row["label"]
            rs = sorted(row["runs"], key=lambda r: (r.seed is None, r.seed or 0, r.path.as_posix()))
            # Repeats of one config under one seed; a --group-by group that merges configs shares seeds by design.
            inner = row["merged"]
            seeds = [(r.seed, *(canon(r.config.get(k, ABSENT)) for k in inner)) for r in rs if r.seed is not None]
            dups = sorted({s[0] for s in seeds if seeds.count(s) > 1})
            if dups:
                warnings.append(f"{task}/{label}: several runs share seed(s) {dups}; they are counted as separate runs")
            keys = {k for r in rs for k in r.final_eval}
            deltas = [r.final_eval["eval/reward"] - r.eval[0]["eval/reward"] for r in rs
                      if 0 in r.eval and "eval/reward" in r.eval[0] and "eval/reward" in r.final_eval]
            # One axis, one meaning: an old AT-GRPO run's train/reward is its mixed scores, not the team reward.
            mixed = [r for r in rs if r.mixed_train_reward]
            if mixed:
                warnings.append(f"{task}/{label}: {len(mixed)} run(s) logged train/reward as AT-GRPO's alpha x team + "
                                "own scores (before 2026-11-30), not the team reward: left out of the training-reward "
                                f"plot ({', '.join(r.display_path for r in mixed[:3])}{' ...' if len(mixed) > 3 else ''})")
            walls = [float(r.summary["wall_s"]) for r in rs if isinstance(r.summary.get("wall_s"), (int, float))]
            # The training budget in joint actions (matched-budget comparisons); runs that log it.
            spent = [_budgets(r) for r in rs]
            budgets = [b[max(b)] for b in spent if b is not None]
            # Problems each run evaluated on (summary.json; older runs do not say): the headline's
            # interval is over runs, and says nothing of how few problems each value comes from.
            problems = sorted({int(r.summary["eval_problems"]) for r in rs
                               if isinstance(r.summary.get("eval_problems"), int)})
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
                "eval_problems": problems,
                "eval_only": all(r.eval_only for r in rs),
                "train_curve": _curve([{} if r.mixed_train_reward else r.train for r in rs], "train/reward", spent),
                "eval_curve": _curve([r.eval for r in rs], "eval/reward", spent),
            }
        for line in warnings:
            warn(line)
        out[task] = {"columns": cols, "headline": headline, "grouped_by": grouped_by,
                     "group_by_explicit": group_by is not None, "warnings": warnings, "methods": methods}
    return out
