"""`marl-llm-bench threads`: `marl-llm debug=tiny` with 1 thread, every core, and `auto`.

    marl-llm-bench threads --out results                  # results/threads.{md,json}
    marl-llm-bench threads --busy 2 --out results         # with two busy processes of its own

Each round runs the three settings one after another (alternating, so that each sees the same
load), after a warm-up run; `--busy N` starts N processes that spin on a core for the whole
benchmark (a loaded machine on demand). Reports each run's wall time, the count `auto` chose and
why (the run's first line), how auto changed it as the load changed, and the load average before
and after. Measures, never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from marl_llm.runs.atomic import atomic_write_text

SPIN = "while True: pass"


def run_tiny(threads: str, run_dir: Path, extra: list[str]) -> dict[str, Any]:
    script = str(Path(sys.executable).with_name("marl-llm"))
    t0 = time.perf_counter()
    proc = subprocess.run([script, "debug=tiny", f"trainer.threads={threads}", f"hydra.run.dir={run_dir}", *extra],
                          capture_output=True, text=True, timeout=3600, cwd=run_dir.parent,
                          env={**os.environ, "WANDB_MODE": "disabled"})
    wall = time.perf_counter() - t0
    chosen = re.search(r"torch threads: (\d+)(?: \[([^\]]*)\])?", proc.stdout)
    changed = re.findall(r"torch threads: (\d+) -> (\d+)", proc.stdout)  # auto, as the load changed
    return {"threads": threads, "wall_s": wall, "exit_code": proc.returncode,
            "chosen": int(chosen.group(1)) if chosen else None, "why": chosen.group(2) if chosen else None,
            "changes": [f"{a} -> {b}" for a, b in changed], "load_1min": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="marl-llm-bench threads", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results", help="where threads.md and threads.json go")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds (after one warm-up run)")
    ap.add_argument("--busy", type=int, default=0, help="processes of its own that keep a core busy meanwhile")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="the 'every core' setting")
    ap.add_argument("overrides", nargs="*", help="more overrides for every run (e.g. algo=at_grpo task=sokoban)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = ["1", str(args.cores), "auto"]
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.busy)]
    load_before = os.getloadavg()
    runs: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="marl-bench-threads-") as tmp:
            run_tiny("1", Path(tmp) / "warmup", args.overrides)  # page cache, .pyc files, the sandbox's zygote
            for round_ in range(args.rounds):
                for setting in settings:
                    runs.append({"round": round_, **run_tiny(setting, Path(tmp) / f"{setting}-{round_}",
                                                             args.overrides)})
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    load_after = os.getloadavg()
    summary = {s: statistics.median(r["wall_s"] for r in runs if r["threads"] == s) for s in settings}
    best = min(summary.values())
    report = {"command": "marl-llm-bench threads " + " ".join(argv if argv is not None else sys.argv[2:]),
              "cores": os.cpu_count(), "busy_processes": args.busy, "load_average_before": load_before,
              "load_average_after": load_after, "runs": runs, "median_wall_s": summary,
              "vs_best": {s: v / best for s, v in summary.items()}}
    atomic_write_text(out / "threads.json", json.dumps(report, indent=2))
    lines = ["# Torch threads on this machine (`marl-llm-bench threads`)", "",
             f"Command: `{report['command']}`; {os.cpu_count()} CPUs; {args.busy} busy processes of the benchmark's own; "
             f"load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after. Each run: "
             f"`marl-llm debug=tiny trainer.threads=<setting>` ({' '.join(args.overrides) or 'no other overrides'}), "
             "settings alternating, after a warm-up run.", "",
             "| setting | median wall s | vs the best setting | runs (wall s, threads used) |", "|---|---|---|---|"]
    for s in settings:
        mine = [r for r in runs if r["threads"] == s]
        lines.append(f"| `trainer.threads={s}` | {summary[s]:.1f} | {summary[s] / best:.2f}x | "
                     + "; ".join(f"{r['wall_s']:.1f} s, {r['chosen']}" + (f" ({r['why']})" if r["why"] else "")
                                 + (f", then {', '.join(r['changes'])}" if r["changes"] else "")
                                 + ("" if r["exit_code"] == 0 else f", exit {r['exit_code']}") for r in mine) + " |")
    atomic_write_text(out / "threads.md", "\n".join(lines) + "\n")
    print((out / "threads.md").read_text())
    return 0
