"""`marl-llm-bench tiny`: how long each `marl-llm debug=tiny ...` command takes, and where it goes.

    marl-llm-bench tiny --out results                        # the README's three commands: results/debug_tiny.{md,json}
    marl-llm-bench tiny --all --rounds 3 --out results       # + every algo on HumanEval, every task with MAGRPO: make bench-tiny
    marl-llm-bench tiny --pairs at_grpo:sokoban 'collm_cc:strbuild:algo.num_turns=2' --out /tmp/x
    marl-llm-bench tiny --model DIR --pairs magrpo:humaneval --out /tmp/x   # another model (the test)

Each command is the real console script, `marl-llm debug=tiny <overrides>` (the embedded model
unless `--model`), in a fresh run dir of its own under a temporary dir (`hydra.run.dir=`), with
`logger=none`; the commands alternate (A B C A B C ...) for `--rounds` rounds after `--warmup` runs
of the first (page cache, .pyc files, the sandbox's first start), so that all see the same load.
Per run: the exit code (a failing command's one-line error too), wall seconds, CPU seconds (user +
system of the process and its children), and where the wall time went, from what the run wrote:
its job log's times (cli.log: the first line, the run's start line after the data and model load,
each evaluation), metrics.jsonl's `step_time` per step, and the rest (checkpoint, export, exit).
Wall time depends on what else the machine runs, so the load average is recorded before and after
the benchmark and before each run, and CPU time is reported beside wall. Measures, never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from marl_llm.bench.cli_latency import console_script, run_timed
from marl_llm.bench.host import cpu_model, memory_gib
from marl_llm.config import last_error_line
from marl_llm.runs.atomic import atomic_write_text

# README.md's "The first five minutes" block, whose timing claim this benchmark checks.
README_COMMANDS = [[], ["algo=at_grpo", "task=sokoban"], ["algo=collm_cc", "task=strbuild", "algo.num_turns=2"]]
# conf/config.yaml's default algo and task: README's bare `debug=tiny` already runs this pair.
DEFAULT_PAIR = ("magrpo", "humaneval")
# Tasks that run only with the user's own code named on the command line (--all skips them).
NEEDS_OWN_CODE = {"env": "task.env=<module>:<Class>", "team": "task.prompts=<module>:<function> and task.reward="}
JOB_LOG = "cli.log"  # configure.JOB_LOGGING's file in the run dir
LOG_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[\w+\]\[[^\]]*\] (.*)$")
# The trainer's lines that end a phase right before an evaluation starts (training/trainer.py): the
# run's start line ("<algo> on <task>: agents ...; run dir ..."), a step's line (or a line logged
# within that step), the exported agents, the prompt-only baselines' note. Lines logged within an
# evaluation (the KV cache budget, a thread change) are not, and count towards it.
BEFORE_EVAL = re.compile(r"; run dir |^step \d+/\d+: |^agents of step \d+ |is a prompt-only baseline")
EVAL_LINE = re.compile(r"^eval @ step (\d+): ")
SPLIT_KEYS = ("first_log_s", "load_s", "steps_s", "eval_s", "rest_s")


def algo_and_task_names() -> tuple[list[str], list[str]]:
    """The options of conf/algo/ and conf/task/ as the package ships them."""
    from marl_llm.configure import config_dir

    def options(group: str) -> list[str]:
        return sorted(p.stem for p in (Path(config_dir()) / group).glob("*.yaml") if not p.stem.startswith("_"))

    return options("algo"), options("task")


def pair_overrides(entry: str) -> list[str]:
    """`algo:task[:extra overrides]` (the extras split as a shell would: spaces between them, and
    they may hold colons themselves) as overrides."""
    parts = entry.split(":", 2)
    if len(parts) < 2 or not parts[0] or not parts[1] or "=" in parts[0] + parts[1]:
        raise ValueError(f"--pairs {entry!r}: write algo:task or algo:task:extra overrides (e.g. magrpo:tldr); "
                         "overrides for every command go before --pairs, or after --")
    return [f"algo={parts[0]}", f"task={parts[1]}", *shlex.split(parts[2] if len(parts) == 3 else "")]


def command_list(pairs: list[str] | None, sweep_all: bool) -> tuple[list[list[str]], list[str]]:
    """The commands' overrides (after debug=tiny), each once, and notes on what --all left out."""
    commands = [pair_overrides(p) for p in pairs] if pairs else [list(c) for c in README_COMMANDS]
    notes = []
    if sweep_all:
        algos, tasks = algo_and_task_names()
        sweep = [(a, DEFAULT_PAIR[1]) for a in algos] + [(DEFAULT_PAIR[0], t) for t in tasks]
        for algo, task in sweep:
            if task in NEEDS_OWN_CODE:
                note = f"task={task} left out: it runs your own code, named with {NEEDS_OWN_CODE[task]}"
                if note not in notes:
                    notes.append(note)
                continue
            if (algo, task) == DEFAULT_PAIR and [] in commands:  # README's bare debug=tiny is this pair
                continue
            commands.append([f"algo={algo}", f"task={task}"])
    unique: list[list[str]] = []
    for c in commands:
        if c not in unique:
            unique.append(c)
    return unique, notes


def log_times(run_dir: Path) -> list[tuple[float, str]]:
    """(epoch seconds, message) of each line of the run's job log (lines without a time, such as a
    table's continuation, are left out). The log's times are local, to the millisecond."""
    path = run_dir / JOB_LOG
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        m = LOG_LINE.match(line)
        if m:
            out.append((datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), m.group(2)))
    return out


def wall_split(run_dir: Path, started_at: float, wall: float) -> dict[str, Any]:
    """Where a run's wall time went, from what it wrote (None where it did not get that far):
    first_log_s: from the start to the job log's first line (Python's and torch's imports, the
    config composed and checked); load_s: from there to the run's start line (the data, the
    model, the rollout engine); steps_s: the training steps (metrics.jsonl's step_time); eval_s:
    the evaluations (each from the line before it to its result line); rest_s: the remainder
    (the checkpoint, the exported agents, the summary, the interpreter's exit)."""
    lines = log_times(run_dir)
    split: dict[str, Any] = dict.fromkeys(SPLIT_KEYS)
    if lines:
        split["first_log_s"] = lines[0][0] - started_at
        start = next((t for t, msg in lines if "; run dir " in msg), None)
        if start is not None:
            split["load_s"] = start - lines[0][0]
        evals: dict[int, list[float]] = {}  # step -> [start, end]
        anchor = None
        for t, msg in lines:
            m = EVAL_LINE.match(msg)
            if m:
                step = int(m.group(1))
                if step in evals:
                    evals[step][1] = t  # a later line of the same evaluation: its result line ends it
                elif anchor is not None:
                    evals[step] = [anchor, t]
                anchor = t
            elif BEFORE_EVAL.search(msg):
                anchor = t
        if evals:
            split["eval_s"] = sum(end - begin for begin, end in evals.values())
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        step_times = [r["train/step_time"] for r in rows if "train/step_time" in r]
        split["steps"] = len(step_times)
        split["steps_s"] = sum(step_times) if step_times else (0.0 if split["eval_s"] is not None else None)
    summary = run_dir / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        split["loop_wall_s"] = s.get("wall_s")  # the trainer's own: from its start line to the summary
        split["peak_rss_gib"] = s.get("peak_rss_gib")
    if split["first_log_s"] is not None:
        split["rest_s"] = wall - sum(split[k] or 0.0 for k in SPLIT_KEYS if k != "rest_s")
    return split


def run_tiny(overrides: list[str], model: list[str], run_dir: Path, timeout: float) -> dict[str, Any]:
    """One `marl-llm debug=tiny ...` in its own run dir: exit code, times, the split."""
    load = os.getloadavg()[0]
    command = [console_script(), "debug=tiny", *overrides, *model, "logger=none", f"hydra.run.dir={run_dir}"]
    started_at = time.time()  # the job log's clock, for the split
    try:
        wall, cpu, proc = run_timed(command, run_dir.parent, timeout)
    except subprocess.TimeoutExpired:
        return {"exit_code": None, "error": f"killed after the bench's timeout of {timeout:.0f} s", "wall_s": timeout,
                "cpu_s": None, "load_1min_before": load}
    result: dict[str, Any] = {"exit_code": proc.returncode, "wall_s": wall, "cpu_s": cpu, "load_1min_before": load}
    if proc.returncode != 0:
        result["error"] = last_error_line(proc.stderr)
    result.update(wall_split(run_dir, started_at, wall))
    return result


def median_or_none(values: list[Any]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summarize(label: str, overrides: list[str], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A command's row: its exit codes, wall and CPU median and min, the split's medians (of the
    runs that finished)."""
    ok = [r for r in runs if r["exit_code"] == 0]
    walls, cpus = [r["wall_s"] for r in runs], [r["cpu_s"] for r in runs if r["cpu_s"] is not None]
    return {"command": label, "overrides": overrides, "exit_codes": sorted({r["exit_code"] for r in runs}, key=str),
            "errors": sorted({r["error"] for r in runs if r.get("error")}),
            "wall_s_median": statistics.median(walls), "wall_s_min": min(walls),
            "cpu_s_median": median_or_none(cpus), "cpu_s_min": min(cpus) if cpus else None,
            **{f"{k}_median": median_or_none([r.get(k) for r in ok]) for k in SPLIT_KEYS},
            "runs": runs}


def num(value: float | None, fmt: str = ".1f") -> str:
    return "–" if value is None else format(value, fmt)


def exit_text(code: int | None) -> str:
    return "killed (timeout)" if code is None else str(code)


def markdown(report: dict[str, Any]) -> str:
    m, before, after = report["machine"], report["load_average_before"], report["load_average_after"]
    lines = ["# `marl-llm debug=tiny`: wall and CPU time per command (`marl-llm-bench tiny`)", "",
             f"Command: `{report['command']}`; {m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB; load average "
             f"(1 min) {before[0]:.2f} before, {after[0]:.2f} after; model: {report['model']}; {report['rounds']} "
             f"run(s) per command after {report['warmup']} warm-up run(s), commands alternating; each with "
             f"`{' '.join(report['bench_overrides'])}` added. CPU: user + system time of the run and its children "
             "(what it costs on an idle machine); wall: what it took under this load. The split (medians of the "
             "runs that finished): to the job log's first line (imports, config), then to the run's start (data, "
             "model), the training steps, the evaluations before and after, the rest (checkpoint, export, exit).", "",
             "| command | exit | wall s (median, min) | CPU s (median, min) | to first log line s | data + model s "
             "| steps s | evaluations s | rest s |", "|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        lines.append(f"| `{row['command']}` | {', '.join(map(exit_text, row['exit_codes']))} | "
                     f"{num(row['wall_s_median'])}, {num(row['wall_s_min'])} | {num(row['cpu_s_median'])}, "
                     f"{num(row['cpu_s_min'])} | " + " | ".join(num(row[f'{k}_median']) for k in SPLIT_KEYS) + " |")
    failed = [row for row in report["rows"] if row["errors"]]
    if failed:
        lines += ["", "Failed:"] + [f"- `{row['command']}` (exit {', '.join(map(exit_text, row['exit_codes']))}): "
                                    + "; ".join(row["errors"]) for row in failed]
    if report["notes"]:
        lines += ["", "Not run: " + "; ".join(report["notes"]) + "."]
    lines += ["", f"The benchmark took {report['wall_s']:.0f} s ({report['date']})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="marl-llm-bench tiny", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results", help="where debug_tiny.md and debug_tiny.json go")
    ap.add_argument("--pairs", nargs="+", default=None, metavar="ALGO:TASK[:OVERRIDES]",
                    help="these commands instead of the README's three (e.g. magrpo:tldr "
                         "'collm_cc:strbuild:algo.num_turns=2 trainer.threads=1'); overrides for every "
                         "command go before --pairs, or after --")
    ap.add_argument("--all", action="store_true",
                    help="add every algo of conf/algo/ on HumanEval and every task of conf/task/ with MAGRPO "
                         f"(not {' and '.join(NEEDS_OWN_CODE)}: they need your own code)")
    ap.add_argument("--rounds", type=int, default=1, help="timed runs per command")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs of the first command first")
    ap.add_argument("--model", default="embedded",
                    help="embedded (SmolLM2-135M, debug=tiny's own) or a local HF checkpoint dir")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds after which a run is killed (and reported so)")
    ap.add_argument("overrides", nargs="*", help="more overrides for every command (e.g. trainer.threads=1)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        ap.error("--rounds must be at least 1 and --warmup at least 0")
    try:
        commands, notes = command_list(args.pairs, args.all)
    except ValueError as err:
        ap.error(str(err))
    commands = [[*c, *args.overrides] for c in commands]
    labels = [" ".join(["marl-llm debug=tiny", *c]) for c in commands]
    model = [] if args.model == "embedded" else ["model=local", f"model.path={Path(args.model).resolve()}"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    runs: list[list[dict[str, Any]]] = [[] for _ in commands]
    with tempfile.TemporaryDirectory(prefix="marl-bench-tiny-") as tmp:
        for i in range(args.warmup):
            r = run_tiny(commands[0], model, Path(tmp) / f"warmup-{i}", args.timeout)
            print(f"[bench] warm-up {labels[0]}: exit {exit_text(r['exit_code'])}, {r['wall_s']:.1f} s wall", flush=True)
        for round_ in range(args.rounds):
            for i, overrides in enumerate(commands):
                r = run_tiny(overrides, model, Path(tmp) / f"{i}-{round_}", args.timeout)
                runs[i].append({"round": round_, **r})
                print(f"[bench] {labels[i]}: exit {exit_text(r['exit_code'])}, {r['wall_s']:.1f} s wall, "
                      f"{num(r['cpu_s'])} s CPU" + (f": {r['error']}" if r.get("error") else ""), flush=True)
    load_after = os.getloadavg()
    words = argv if argv is not None else sys.argv[2:]
    report = {"command": "marl-llm-bench tiny " + " ".join(shlex.quote(a) for a in words),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "memory_gib": memory_gib()},
              "model": args.model, "bench_overrides": [*model, "logger=none", "hydra.run.dir=<a fresh dir>"],
              "rounds": args.rounds, "warmup": args.warmup, "load_average_before": load_before,
              "load_average_after": load_after, "notes": notes,
              "rows": [summarize(label, c, r) for label, c, r in zip(labels, commands, runs)]}
    report["wall_s"] = time.perf_counter() - t0
    atomic_write_text(out / "debug_tiny.json", json.dumps(report, indent=2))
    atomic_write_text(out / "debug_tiny.md", markdown(report))
    print((out / "debug_tiny.md").read_text())
    print(f"[bench] wrote {out / 'debug_tiny.md'} and {out / 'debug_tiny.json'} in {report['wall_s']:.0f} s", flush=True)
    failed = [row for row in report["rows"] if row["errors"]]
    for row in failed:
        print(f"[bench] error: {row['command']}: {'; '.join(row['errors'])}", file=sys.stderr)
    return 1 if failed else 0  # reported in full; the exit status says that a command did not run
