"""Every figure of a report (matplotlib, headless): the training-reward curve, the held-out eval
reward per eval step, and the dot-and-interval chart of the headline metric. A group keeps its
dashes and marker (from its label) and its colour where it can (pinned for the algorithms, else
from its label; a colour another group of the report holds goes to the next free one, so no two
groups share one however many there are). Long labels are wrapped and cut to a few lines; the
figures keep their size, the legend beside the axes where it would cover the data; groups
evaluated at the same step are drawn side by side."""

from __future__ import annotations

import hashlib
import math
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Sequence

from marl_llm.report.aggregate import metric_header
from marl_llm.report.stats import CI_LEVEL
from marl_llm.report.tables import eval_problems_text
from marl_llm.runs.atomic import atomic_write

_LINESTYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
# The algorithms every comparison shows get fixed, distinct tab10 colours; other labels hash to one.
_PINNED_COLORS = {"magrpo": 0, "collm_cc": 1, "collm_dc": 2, "at_grpo": 3, "single": 4, "parallel": 5,
                  "sequential": 6, "discussion": 7}
# Colours in the order groups take them: tab10 (the labels' own), then tab20's light shades,
# tab20b and tab20c (60 distinct colours); more groups than that get evenly spaced hues.
_PALETTES = (("tab10", range(10)), ("tab20", range(1, 20, 2)), ("tab20b", range(20)), ("tab20c", range(20)))


def _digest(label: str) -> bytes:
    # sha256, not Python's per-process salted hash: the same label looks the same in every report.
    return hashlib.sha256(label.encode("utf-8")).digest()


def _palette(n: int) -> list[tuple[float, ...]]:
    import matplotlib

    colors = [tuple(matplotlib.colormaps[name](i)) for name, idx in _PALETTES for i in idx]
    extra = max(0, n - len(colors))
    return colors + [tuple(matplotlib.colormaps["hsv"](k / extra)) for k in range(extra)]


def group_styles(labels: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Colour, line style and marker of each group of one report. A group's dashes and marker come
    from its label alone; its colour is its pinned one (the algorithms), else the tab10 colour its
    label hashes to, unless a group ahead of it (pinned ones first, then by label) holds that one:
    then the next free colour, so every group of the report has its own however many there are."""
    labels = list(dict.fromkeys(labels))
    palette = _palette(len(labels))
    taken: set[int] = set()
    color: dict[str, int] = {}
    for label in sorted(labels, key=lambda x: (x not in _PINNED_COLORS, x)):
        first = _PINNED_COLORS.get(label, _digest(label)[0] % 10)
        order = [*range(first, 10), *range(first), *range(10, len(palette))]
        color[label] = next(i for i in order if i not in taken)
        taken.add(color[label])
    return {label: {"color": palette[color[label]], "linestyle": _LINESTYLES[_digest(label)[1] % len(_LINESTYLES)],
                    "marker": _MARKERS[_digest(label)[2] % len(_MARKERS)]} for label in labels}


# A label in a legend or on a row: wrapped to this many characters a line, at most this many lines.
_LABEL_WIDTH = 36
_LABEL_LINES = 3


def wrap_label(label: str, width: int = _LABEL_WIDTH, lines: int = _LABEL_LINES) -> str:
    """A group label over at most `lines` lines of about `width` characters, broken after its
    ", "-separated parts (a part longer than a line is cut); parts that do not fit are counted at
    the end ("+3 more"): the table names them all."""
    words = re.split(r"(?<=,) ", label)
    out: list[str] = []
    for k, word in enumerate(words):
        word = word if len(word) <= width else word[:width - 1] + "…"
        if out and len(out[-1]) + 1 + len(word) <= width:
            out[-1] += " " + word
        elif len(out) < lines:
            out.append(word)
        else:
            rest = f" +{len(words) - k} more"
            while out[-1] and len(out[-1]) + len(rest) > width:
                out[-1] = out[-1].rsplit(" ", 1)[0] if " " in out[-1] else out[-1][:-1]
            out[-1] = out[-1].rstrip(",") + "," + rest
            break
    return "\n".join(out)


def plot_labels(labels: Sequence[str]) -> dict[str, str]:
    """Each group's label as its plots show it (wrap_label); labels that the cut leaves alike get
    their place in the table added ("#3")."""
    shown = {label: wrap_label(label) for label in labels}
    counts = list(shown.values())
    return {label: text if counts.count(text) == 1 else f"{text} #{k + 1}"
            for k, (label, text) in enumerate(shown.items())}


def _pyplot():
    import matplotlib

    # Agg: no display needed (headless nodes, CI); it must be chosen before pyplot is first imported.
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# Legend entries that fit inside the axes (when their labels are short); more go beside them.
_LEGEND_INSIDE = 4
_LEGEND_SHORT = 28
_LEGEND_LINES = 16  # text lines per column of a legend beside the axes


def _save_fig(fig: Any, path: Path) -> None:
    # No "Software" metadata: the PNG bytes then do not change with the matplotlib version. "tight":
    # the saved image grows to hold a legend beside the axes and long tick labels, instead of cutting them.
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120, metadata={"Software": None},
                                               bbox_inches="tight", pad_inches=0.1))


def place_legend(ax: Any) -> bool:
    """Inside the axes for a few groups with short labels; beside them (right, in columns) for more
    or longer ones, where it would cover the data. True: beside."""
    labels = ax.get_legend_handles_labels()[1]
    if len(labels) <= _LEGEND_INSIDE and all(len(x) <= _LEGEND_SHORT for x in labels):
        ax.legend()
        return False
    per_column = max(1, _LEGEND_LINES // max((x.count("\n") + 1 for x in labels), default=1))
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize="small",
              ncol=math.ceil(len(labels) / per_column))
    return True


def _widen_for_legend(fig: Any, ax: Any) -> None:
    """Make the figure wider by the legend beside the axes, so that the layout fits both and the
    axes keep their width (the legend's labels are wrapped: its width is bounded)."""
    width = ax.get_legend().get_window_extent(fig.canvas.get_renderer()).width / fig.dpi
    w, h = fig.get_size_inches()
    fig.set_size_inches(w + width + 0.2, h)


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
        if legend and place_legend(ax):
            _widen_for_legend(fig, ax)
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
    styles, names = _looks(agg)
    for method, a in methods.items():
        style = styles[method]
        xs = [p[x] for p in a["train_curve"]]
        ys = [p["mean"] for p in a["train_curve"]]
        sd = [p["std"] or 0.0 for p in a["train_curve"]]
        ax.plot(xs, ys, color=style["color"], linestyle=style["linestyle"], marker=style["marker"], markersize=5,
                markevery=max(1, math.ceil(len(xs) / 12)), label=f"{names[method]} (n={a['n']})")
        if any(sd):
            if len(xs) > 1:
                ax.fill_between(xs, [y - s for y, s in zip(ys, sd)], [y + s for y, s in zip(ys, sd)],
                                color=style["color"], alpha=0.15, linewidth=0)
            else:
                ax.errorbar(xs, ys, yerr=sd, fmt="none", ecolor=style["color"], capsize=3)
    _integer_x(ax, xlabel)
    return True


def dodge(groups: int, xs: list[float]) -> list[float]:
    """x offsets of `groups` groups drawn at the same x values, side by side around each: together
    they span at most 40% of the smallest gap between the x values (1 when there is one) and 6% of
    the axis (a point of 96 joint actions drawn at 116 would read as 116)."""
    distinct = sorted(set(xs))
    gap = min((b - a for a, b in zip(distinct, distinct[1:])), default=max(distinct[-1] if distinct else 1.0, 1.0))
    axis = max(distinct[-1] - distinct[0], 1.0) if distinct else 1.0
    width = min(0.4 * gap, 0.06 * axis) / max(groups - 1, 1)
    return [(i - (groups - 1) / 2) * width for i in range(groups)]


def draw_eval_reward(ax: Any, agg: dict[str, Any]) -> bool:
    """eval/reward at each eval step: points with ± std bars, never joined (nothing was measured between
    two evaluations), the groups side by side around each step (dodged) so that none hides another;
    evaluation-only groups as a dashed level from their step-0 point."""
    methods = {m: a for m, a in agg["methods"].items() if a["eval_curve"]}
    if not methods:
        return False
    trained = [a["eval_curve"] for a in methods.values() if not a["eval_only"]]
    x, xlabel = _x_axis(trained)
    max_x = max((p[x] for c in trained for p in c), default=0)
    offsets = dodge(len(methods), [0.0, *(p[x] for c in trained for p in c)])
    styles, names = _looks(agg)
    for (method, a), offset in zip(methods.items(), offsets):
        style = styles[method]
        label = f"{names[method]} (n={a['n']})"
        if a["eval_only"]:
            p = a["eval_curve"][0]
            ax.axhline(p["mean"], color=style["color"], linestyle="--", linewidth=1.2, label=f"{label}, no training")
            ax.errorbar([offset], [p["mean"]], yerr=[p["std"] or 0.0], color=style["color"], marker=style["marker"],
                        linestyle="none", capsize=3)
        else:
            ax.errorbar([p[x] + offset for p in a["eval_curve"]], [p["mean"] for p in a["eval_curve"]],
                        yerr=[p["std"] or 0.0 for p in a["eval_curve"]], color=style["color"],
                        marker=style["marker"], linestyle="none", capsize=3, label=label)
    spread = max(abs(o) for o in offsets)
    ax.set_xlim(min(-0.05 * max(max_x, 1), -1.5 * spread), max(max_x, 1) * 1.05 + spread)
    _integer_x(ax, xlabel)
    return True


def draw_final(ax: Any, agg: dict[str, Any]) -> bool:
    """Dot-and-interval chart of the headline metric: one row per group with its IQM (filled marker),
    bootstrap CI (bar) and each run (hollow markers, spread a little up and down the row so that runs
    with the same value stay visible); matched-budget groups no longer stack at one x. A row's label
    says its runs and the problems each run evaluated on."""
    groups = [(m, a) for m, a in agg["methods"].items() if a["headline"]]
    if not groups:
        return False
    styles, names = _looks(agg)
    for i, (method, a) in enumerate(groups):
        y, head, style = len(groups) - 1 - i, a["headline"], styles[method]
        k = len(head["values"])
        spread = [y + (j - (k - 1) / 2) * (0.3 / max(k - 1, 1)) for j in range(k)]
        ax.plot(head["values"], spread, linestyle="none", marker=style["marker"],
                markerfacecolor="none", color=style["color"], alpha=0.7, markersize=6)
        if head["ci_low"] is not None:
            ax.hlines(y, head["ci_low"], head["ci_high"], colors=[style["color"]], linewidth=2.5)
        ax.plot([head["iqm"]], [y], linestyle="none", marker=style["marker"], color=style["color"], markersize=9)
    ax.set_yticks(range(len(groups)))
    ax.set_yticklabels([_row_label(names[m], a) for m, a in reversed(groups)])
    ax.set_ylim(-0.6, len(groups) - 0.4)
    ax.set_xlabel(f"{metric_header(agg['headline'])} at each run's final evaluation")
    return True


def _looks(agg: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Every group's style and plot label, over all groups of the report (each plot of a report
    shows a group alike, whichever groups it leaves out)."""
    return group_styles(list(agg["methods"])), plot_labels(list(agg["methods"]))


def _row_label(name: str, a: dict[str, Any]) -> str:
    """A final-chart row: the group's plot label, its runs and the problems each evaluated on (on
    a line of its own when the label is wrapped)."""
    runs = f"(n={a['n']}, {eval_problems_text(a['eval_problems'])} eval problems)"
    return f"{name}\n{runs}" if "\n" in name or len(name) + len(runs) > _LABEL_WIDTH + 12 else f"{name} {runs}"


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
    _, names = _looks(agg)
    # Each row as tall as its label's lines (about 0.17 in a line at the default size), at least 0.5 in.
    lines = max((_row_label(names[m], a).count("\n") + 1 for m, a in agg["methods"].items() if a["headline"]),
                default=1)
    title = f"{task}: IQM (filled), {CI_LEVEL:.0%} bootstrap CI (bar), runs (hollow)"
    with _figure(path, title, "", size=(7, 1.6 + max(0.5, 0.2 * lines) * n), legend=False) as ax:
        draw_final(ax, agg)
    return True
