"""Comparison tables and reward plots from finished runs, read from their local files (no W&B needed).

Usage::

    marl-llm-report                                # searches ./outputs and ./multirun
    marl-llm-report multirun/2026-11-22 outputs/x  # run dirs or roots, searched recursively
    marl-llm-report --out results --task tldr --commands results/commands.txt

A run directory is one that holds ``config.yaml`` (the resolved config; ``.hydra/config.yaml`` is
accepted too) and ``metrics.jsonl``. Runs without ``summary.json`` are unfinished and skipped with a
warning, as are runs whose files cannot be read. Runs are grouped by (``task.name``, method), where the
method is ``logger.group`` if set, else ``algo.name``; the runs of a group are its seeds.

Per task it writes:

- ``<out>/<task>.md``: method x metric table of held-out metrics at each run's final eval step,
  ``mean ± std`` over seeds, plus the runs used, a legend and (``--commands FILE``) the exact commands;
- ``<out>/<task>_train_reward.png``: ``train/reward`` per step, mean over seeds with a ± std band;
- ``<out>/<task>_eval_reward.png``: ``eval/reward`` per eval step, mean ± std; methods evaluated only at
  step 0 (prompt-only baselines) are horizontal dashed lines.

The output carries no timestamps, so it can be committed and diffed. From Python::

    from marl_llm.report import find_runs, aggregate, write_report
    write_report(find_runs(["multirun"]), "results")
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from marl_llm.atomic import atomic_write, atomic_write_text

DEFAULT_ROOTS = ("outputs", "multirun")
# Prompt-only baselines lead the table so trained methods read as improvements over them.
BASELINE_ORDER = ("single", "parallel", "sequential", "discussion")
RUN_REQUIREMENTS = "config.yaml (or .hydra/config.yaml), metrics.jsonl and, once finished, summary.json"

_LEVEL_RE = re.compile(r"^eval/rewards/(.+)/mean$")
_PASS_RE = re.compile(r"^eval/pass@(\d+)$")
MISSING = "—"


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


@dataclass
class Run:
    """One finished run: its identity from config.yaml and its curves from metrics.jsonl."""

    path: Path
    task: str
    method: str
    algo: str
    model: str | None
    seed: int | None
    max_steps: int | None
    summary: dict[str, Any]
    train: dict[int, dict[str, float]] = field(default_factory=dict)
    eval: dict[int, dict[str, float]] = field(default_factory=dict)

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
               summary=summary, train=train, eval=evals)


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


# ----------------------------------------------------------------------------------------------- statistics


def method_order(methods: Iterable[str]) -> list[str]:
    ms = set(methods)
    return [m for m in BASELINE_ORDER if m in ms] + sorted(ms - set(BASELINE_ORDER))


def mean_std(values: Sequence[float]) -> tuple[float, float] | None:
    """Mean and population std (0 for one value): seeds are the whole population we report on."""
    if not values:
        return None
    m = sum(values) / len(values)
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def _stat(values: list[float]) -> dict[str, Any] | None:
    ms = mean_std(values)
    return None if ms is None else {"mean": ms[0], "std": ms[1], "count": len(values)}


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


def aggregate(runs: Sequence[Run]) -> dict[str, dict[str, Any]]:
    """Group runs by task and method and compute the table cells and plot curves.

    Returns ``{task: {"columns": [eval keys], "methods": {method: {...}}}}`` with tasks sorted and
    methods in table order. Per method: ``runs``, ``n``, ``steps`` (sorted distinct), ``final``
    (``{key: {"mean", "std", "count"}}``), ``delta`` and ``wall_s`` (same shape or None), ``eval_only``,
    ``train_curve`` and ``eval_curve`` (lists of ``{"step", "mean", "std", "count"}``).
    """
    by_task: dict[str, dict[str, list[Run]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        by_task[r.task][r.method].append(r)
    out: dict[str, dict[str, Any]] = {}
    for task in sorted(by_task):
        groups = by_task[task]
        methods: dict[str, Any] = {}
        for method in method_order(groups):
            rs = sorted(groups[method], key=lambda r: (r.seed is None, r.seed or 0, r.path.as_posix()))
            seeds = [r.seed for r in rs if r.seed is not None]
            dups = sorted({s for s in seeds if seeds.count(s) > 1})
            if dups:
                warn(f"{task}/{method}: several runs share seed(s) {dups}; they are counted as separate runs")
            models = sorted({r.model for r in rs if r.model})
            if len(models) > 1:
                warn(f"{task}/{method}: runs mix models {models}; set logger.group to tell them apart")
            keys = {k for r in rs for k in r.final_eval}
            deltas = [r.final_eval["eval/reward"] - r.eval[0]["eval/reward"] for r in rs
                      if 0 in r.eval and "eval/reward" in r.eval[0] and "eval/reward" in r.final_eval]
            walls = [float(r.summary["wall_s"]) for r in rs if isinstance(r.summary.get("wall_s"), (int, float))]
            # The training budget in joint actions (matched-budget comparisons); runs that log it.
            spent = [_budgets(r) for r in rs]
            budgets = [b[max(b)] for b in spent if b is not None]
            methods[method] = {
                "runs": rs,
                "n": len(rs),
                "steps": sorted({r.steps for r in rs if r.steps is not None}),
                "final": {k: _stat([r.final_eval[k] for r in rs if k in r.final_eval]) for k in sorted(keys)},
                "delta": _stat(deltas),
                "wall_s": _stat(walls),
                "joint_actions": _stat(budgets),
                "eval_only": all(r.eval_only for r in rs),
                "train_curve": _curve([r.train for r in rs], "train/reward", spent),
                "eval_curve": _curve([r.eval for r in rs], "eval/reward", spent),
            }
        out[task] = {"columns": _metric_columns([r for rs in groups.values() for r in rs]), "methods": methods}
    return out


# ----------------------------------------------------------------------------------------------- writing


def _num(x: float, fmt: str) -> str:
    s = format(x, fmt)
    # "-0.000" and "0.000" are the same number; one spelling keeps diffs quiet.
    return s[1:] if s.startswith("-") and float(s) == 0 else s


def _cell(stat: dict[str, Any] | None, n: int, fmt: str = ".3f") -> str:
    if stat is None:
        return MISSING
    text = f"{_num(stat['mean'], fmt)} ± {_num(stat['std'], fmt)}"
    return text if stat["count"] == n else f"{text} ({stat['count']}/{n})"


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


def render_markdown(task: str, agg: dict[str, Any], commands: str | None = None) -> str:
    cols, methods = agg["columns"], agg["methods"]
    n_runs = sum(m["n"] for m in methods.values())
    lines = [
        f"# {task}: method comparison",
        "",
        f"Held-out evaluation at each run's final eval step, mean ± std over seeds; {len(methods)} method(s), "
        f"{n_runs} run(s). Generated by `marl-llm-report` from the runs' local files.",
        "",
    ]
    budget = any(m["joint_actions"] for m in methods.values())
    header = ["method", "n", "steps", *(["joint actions"] if budget else []), *(_header(c) for c in cols),
              "Δ vs step 0", "train time (s)"]
    lines += ["| " + " | ".join(_esc(h) for h in header) + " |", "|" + "---|" * len(header)]
    for method, m in methods.items():
        steps = "/".join(str(s) for s in m["steps"]) or MISSING
        cells = [_esc(method), str(m["n"]), steps, *([_cell(m["joint_actions"], m["n"], ".0f")] if budget else []),
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
        "- **method**: `logger.group` if set, else `algo.name`. single / parallel / sequential / discussion are "
        "untrained prompt-only baselines (evaluated at step 0 only).",
        "- **n**: runs (seeds) in the group; **steps**: training steps (`summary.json` steps; 0 = evaluation only).",
        *(["- **joint actions**: joint actions scored in training (the sum of `train/joint_actions`), the budget "
           "of a matched-budget comparison."] if budget else []),
        "- Metric columns: held-out `eval/*` metrics from the eval row with the largest step of each run, "
        "as mean ± population std over runs. `eval/reward` is the joint team reward; level columns are "
        "`eval/rewards/<level>/mean`; `pass@k` is the functional pass rate.",
        "- **Δ vs step 0**: final `eval/reward` minus the same run's `eval/reward` at step 0 (before training); "
        "0 for evaluation-only runs.",
        "- **train time (s)**: wall-clock seconds of the whole run (`summary.json` wall_s).",
        f"- `(k/n)`: only k of the n runs logged that value; {MISSING}: no run did.",
        "",
    ]
    if commands is not None:
        lines += ["## Commands", "", _fence(commands), ""]
    return "\n".join(lines)


def _method_colors(methods: Sequence[str]) -> dict[str, Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    # Colour by table position so a method has the same colour in both plots.
    return {m: cmap(i % 10) for i, m in enumerate(methods)}


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
def _figure(path: Path, title: str, ylabel: str, xlabel: str = "step"):
    """A figure with the report's common frame; saved (atomically) to `path` when the body is done."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        yield ax
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        _save_fig(fig, path)
    finally:
        plt.close(fig)


def _x_axis(curves: list[list[dict[str, Any]]]) -> tuple[str, str]:
    """(curve key, label) of the x axis: joint actions trained on when every point has them (the
    budget of a matched-budget comparison: methods with different step sizes line up), else steps."""
    if all("budget" in p for c in curves for p in c):
        return "budget", "training joint actions"
    return "step", "step"


def plot_train_reward(task: str, agg: dict[str, Any], path: Path) -> bool:
    methods = {m: a for m, a in agg["methods"].items() if a["train_curve"]}
    if not methods:
        return False
    colors = _method_colors(list(agg["methods"]))
    x, xlabel = _x_axis([a["train_curve"] for a in methods.values()])
    with _figure(path, f"{task}: training reward (mean ± std over seeds)", "train/reward", xlabel) as ax:
        for method, a in methods.items():
            xs = [p[x] for p in a["train_curve"]]
            ys = [p["mean"] for p in a["train_curve"]]
            sd = [p["std"] for p in a["train_curve"]]
            ax.plot(xs, ys, color=colors[method], label=f"{method} (n={a['n']})")
            ax.fill_between(xs, [y - s for y, s in zip(ys, sd)], [y + s for y, s in zip(ys, sd)],
                            color=colors[method], alpha=0.2, linewidth=0)
    return True


def plot_eval_reward(task: str, agg: dict[str, Any], path: Path) -> bool:
    methods = {m: a for m, a in agg["methods"].items() if a["eval_curve"]}
    if not methods:
        return False
    colors = _method_colors(list(agg["methods"]))
    x, xlabel = _x_axis([a["eval_curve"] for a in methods.values() if not a["eval_only"]])
    with _figure(path, f"{task}: held-out eval reward (mean ± std over seeds)", "eval/reward", xlabel) as ax:
        max_step = max((p[x] for a in methods.values() for p in a["eval_curve"] if not a["eval_only"]), default=0)
        for method, a in methods.items():
            label = f"{method} (n={a['n']})"
            if a["eval_only"]:
                p = a["eval_curve"][0]
                ax.axhline(p["mean"], color=colors[method], linestyle="--", label=f"{label}, no training")
                if p["std"] > 0:
                    ax.axhspan(p["mean"] - p["std"], p["mean"] + p["std"], color=colors[method], alpha=0.1)
            else:
                ax.errorbar([p[x] for p in a["eval_curve"]], [p["mean"] for p in a["eval_curve"]],
                            yerr=[p["std"] for p in a["eval_curve"]], color=colors[method], marker="o",
                            capsize=3, label=label)
        ax.set_xlim(-0.02 * max(max_step, 1), max(max_step, 1) * 1.02)
    return True


def write_report(runs: Sequence[Run], out_dir: str | os.PathLike[str], commands: str | None = None) -> list[Path]:
    """Write `<task>.md` and the two reward plots per task into `out_dir`; returns the paths written.

    `commands` (text, e.g. the exact command lines used) is appended verbatim under "## Commands".
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for task, agg in aggregate(runs).items():
        name = _safe_name(task)
        md = out / f"{name}.md"
        atomic_write_text(md, render_markdown(task, agg, commands))
        written.append(md)
        for kind, plot, what in (("train_reward", plot_train_reward, "train/reward rows"),
                                 ("eval_reward", plot_eval_reward, "eval/reward rows")):
            png = out / f"{name}_{kind}.png"
            if plot(task, agg, png):
                written.append(png)
            else:
                print(f"[marl-llm-report] {task}: no method has {what}; skipping {png}", flush=True)
    return written


# ----------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="marl-llm-report",
        description="Comparison tables (mean ± std over seeds) and reward plots from finished marl-llm runs.",
        epilog=f"A run directory holds {RUN_REQUIREMENTS}. Output has no timestamps, so it can be committed.")
    p.add_argument("paths", nargs="*", metavar="RUN_DIRS_OR_ROOTS",
                   help=f"run directories or roots searched recursively (default: {' '.join(DEFAULT_ROOTS)})")
    p.add_argument("--out", default="results", help="output directory (default: results)")
    p.add_argument("--task", action="append", metavar="NAME", help="only this task (repeatable)")
    p.add_argument("--commands", metavar="FILE", help="file with the exact commands used, appended to each table")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    paths = args.paths or list(DEFAULT_ROOTS)
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
    try:
        written = write_report(runs, args.out, commands)
    except OSError as e:
        print(f"error: cannot write the report to {args.out}: {e}", file=sys.stderr)
        return 1
    for p in written:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
