"""`marl-llm-bench cli`: how long the console script takes for what should be instant.

    marl-llm-bench cli --out results                       # results/cli.{md,json}
    marl-llm-bench cli --other /path/to/other/venv/bin/marl-llm --out /tmp/x   # side by side

Commands, each run `--rounds` times in a fresh process (the systems alternate A B A B ... after a
warm-up, so that both see the same load): `marl-llm --cfg job`, `--help`, a value error
(`trainer.max_steps=-1`: composed, then validated), a misspelled key (`trainer.max_stepz=1`:
refused before Hydra composes), an environment that cannot be imported (`task.env=`) and a
model.path that is no checkpoint (an empty dir): both refused before the trainer imports torch
(marl_llm/preflight.py). Wall time depends on what else the machine runs, so the children's
CPU time (user + system, from getrusage) is reported beside it, and the load average before and
after. Measures, never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from marl_llm.runs.atomic import atomic_write_text

COMMANDS = {
    "--cfg job": ["--cfg", "job"],
    "--help": ["--help"],
    "value error": ["trainer.max_steps=-1", "logger=none"],
    "unknown key": ["trainer.max_stepz=1"],
    "env error": ["task=env", "task.env=no_such_module:Env", "logger=none"],
    "model error": ["model=local", "model.path={tmp}/not-a-model", "logger=none"],
}
# The commands that get as far as a run (a run dir of their own, which they take back when refused).
RUNS = ("value error", "env error", "model error")


def console_script(name: str = "marl-llm") -> str:
    """The console script installed beside this interpreter (the venv's bin/), not one on PATH."""
    return str(Path(sys.executable).with_name(name))


def run_timed(command: list[str], cwd: Path, timeout: float) -> tuple[float, float, subprocess.CompletedProcess[str]]:
    """(wall seconds, CPU seconds of the process and its children, the finished process) of one
    run, its output captured. The CPU time is getrusage(RUSAGE_CHILDREN)'s difference: only
    correct while no other child of this process ends meanwhile (the benchmarks run one at a time).
    A run past `timeout` is killed and raises subprocess.TimeoutExpired."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "WANDB_MODE": "disabled"})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc


def run_once(script: str, args: list[str], cwd: Path) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of the process and its children, exit code) of one run."""
    wall, cpu, proc = run_timed([script, *args], cwd, timeout=600)
    return wall, cpu, proc.returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="marl-llm-bench cli", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results", help="where cli.md and cli.json go")
    ap.add_argument("--rounds", type=int, default=5, help="timed runs per command and system (after one warm-up)")
    ap.add_argument("--other", default=None, help="another marl-llm console script to time side by side")
    ap.add_argument("--other-label", default="other", help="what --other is, for the table (e.g. 'main before #34')")
    args = ap.parse_args(argv)
    ours = console_script()
    systems = {"this": ours, **({args.other_label: args.other} if args.other else {})}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    samples: dict[str, dict[str, list[tuple[float, float, int]]]] = {s: {c: [] for c in COMMANDS} for s in systems}
    with tempfile.TemporaryDirectory(prefix="marl-bench-cli-") as tmp:
        (Path(tmp) / "not-a-model").mkdir()
        for round_ in range(args.rounds + 1):  # round 0: the warm-up (page cache, .pyc files)
            for command, cli_args in COMMANDS.items():
                for system, script in systems.items():
                    run_dir = f"{tmp}/{system}-{command.replace(' ', '-')}-{round_}"
                    extra = [f"hydra.run.dir={run_dir}"] if command in RUNS else []
                    result = run_once(script, [*(a.format(tmp=tmp) for a in cli_args), *extra], Path(tmp))
                    if round_:
                        samples[system][command].append(result)
    load_after = os.getloadavg()
    rows: dict[str, Any] = {}
    for system, by_command in samples.items():
        for command, runs in by_command.items():
            walls, cpus = [r[0] for r in runs], [r[1] for r in runs]
            rows[f"{system} {command}"] = {
                "system": system, "script": systems[system], "command": command, "exit_codes": sorted({r[2] for r in runs}),
                "wall_s_median": statistics.median(walls), "wall_s_min": min(walls),
                "cpu_s_median": statistics.median(cpus), "cpu_s_min": min(cpus), "runs": len(runs)}
    report = {"command": "marl-llm-bench cli " + " ".join(argv if argv is not None else sys.argv[2:]),
              "cores": os.cpu_count(), "load_average_before": load_before, "load_average_after": load_after,
              "rounds": args.rounds, "rows": rows}
    atomic_write_text(out / "cli.json", json.dumps(report, indent=2))
    lines = [f"# Console script latency (`marl-llm-bench cli`)", "",
             f"Command: `{report['command']}`; {os.cpu_count()} cores; load average (1 min) "
             f"{load_before[0]:.2f} before, {load_after[0]:.2f} after; {args.rounds} runs each after a warm-up, "
             "systems alternating. CPU: the process's user + system time (what it costs on an idle machine); "
             "wall: what it took under this load.", "",
             "| system | command | exit code | CPU s (median, min) | wall s (median, min) |", "|---|---|---|---|---|"]
    for row in rows.values():
        shown = " ".join(COMMANDS[row["command"]]).replace("{tmp}", "<tmp>")
        lines.append(f"| {row['system']} (`{row['script']}`) | `marl-llm {shown}` | "
                     f"{', '.join(map(str, row['exit_codes']))} | {row['cpu_s_median']:.2f}, {row['cpu_s_min']:.2f} | "
                     f"{row['wall_s_median']:.2f}, {row['wall_s_min']:.2f} |")
    atomic_write_text(out / "cli.md", "\n".join(lines) + "\n")
    print((out / "cli.md").read_text())
    return 0
