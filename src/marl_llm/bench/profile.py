"""The top of a py-spy profile of marl-llm's training step (bench_profile.md).

py-spy samples the worker from outside (it launches it as its child, so no ptrace rights are
needed), which costs the worker almost nothing; torch.profiler records every op instead and grew
to gigabytes on one decoding rollout. Only samples inside `MarlLLM.step` count."""

from __future__ import annotations

import shutil
import sys
from collections import Counter
from pathlib import Path

from marl_llm.runs.atomic import atomic_write_text

STEP_FRAME = "MarlLLM.step (marl_llm/bench/systems.py"


def py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def record_command(raw: Path, rate: int = 100) -> list[str] | None:
    spy = py_spy()
    return None if spy is None else [spy, "record", "--format", "raw", "--rate", str(rate), "--nonblocking",
                                     "-o", str(raw), "--"]


def summarize(raw: Path, title: str, top: int = 25) -> str:
    """Markdown: the step's samples as inclusive and self shares of its functions."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not any(f.startswith(STEP_FRAME) for f in frames):
            continue
        n = int(count)
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    if not total:
        return f"# {title}\n\nNo samples inside the step were recorded.\n"

    def table(counts: Counter[str], skip_step_callers: bool) -> list[str]:
        rows = ["| share | function (file:line) |", "|---|---|"]
        shown = 0
        for frame, n in counts.most_common():
            if skip_step_callers and n >= total:  # the step itself and everything above it
                continue
            rows.append(f"| {100 * n / total:.1f}% | `{frame}` |")
            shown += 1
            if shown == top:
                break
        return rows

    return "\n".join([f"# {title}", "", f"{total} samples inside the step (py-spy, 100 Hz).", "",
                      "## Inclusive: where the step's time goes", "", *table(inclusive, True), "",
                      "## Self: the innermost frames", "", *table(own, False), ""])


def write(raw: Path, path: Path, title: str) -> None:
    atomic_write_text(path, summarize(raw, title))
