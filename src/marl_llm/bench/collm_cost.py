"""`marl-llm-bench collm-cost`: where CoLLM's cost per joint action goes, against MAGRPO's.

    marl-llm-bench collm-cost --out results        # results/collm_cost.{md,json}; make bench-collm-cost
    marl-llm-bench collm-cost --model DIR --rounds 1 --warmup 0 --new-tokens 2 --out /tmp/x   # the test

The systems are marl-llm's own trainers at marl-llm's default update granularity (one actor step
per policy, one critic step per critic per trainer step), on the CPU benchmark's TLDR workload,
2 agents, fixed-length completions:
- magrpo: `algo=magrpo`, G=4 joint actions per post, one trainer step per post;
- collm_cc / collm_dc: `algo=collm_cc` / `collm_dc`, the same 4 posts in one trainer step, one
  trajectory (one joint action) each. So both spend the same posts on the same number of joint
  actions (16 for MAGRPO, 4 for CoLLM per round: costs are divided per joint action);
- collm_cc_ref / collm_dc_ref: the same CoLLM with the critic's collection-time values from a
  no-grad pass of their own (what marl-llm did before `Critic.fit_fresh` read them off the
  update's own forward/backward pass): the difference is the avoidable part that was removed.

Every system lives in this one process and they run round-robin, round after round (the first
rounds warm up). Costs are CPU seconds (getrusage) on `--threads` torch threads (default 1: CPU
time is then the work done, whatever else the machine runs), split by phase: the rollout's
`generate`, the critic's no-grad values, the critic update, the actor update; everything else
(rewards, advantages, bookkeeping) is "other". Token counts are what the base model's forward
was fed in each phase (padded rows x columns, and the real tokens among them). Measures, never
asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import shlex
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator

from marl_llm.runs.atomic import atomic_write_text

PHASES = ("generate", "critic values (no grad)", "critic update", "actor update", "other")
POSTS_PER_ROUND = 4  # CoLLM's environments per step = MAGRPO's G: the same joint actions per post


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class PhaseMeter:
    """CPU seconds and base-model tokens per phase, while `patched()` wraps the phase functions."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.tokens: Counter[str] = Counter()
        self._stack: list[str] = []

    def reset(self) -> None:
        self.seconds.clear()
        self.tokens.clear()

    def _wrap(self, owner: Any, name: str, phase: str, undo: list[Callable[[], None]]) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            self._stack.append(phase)
            start = cpu_seconds()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[phase] += cpu_seconds() - start
                self._stack.pop()
                if self._stack:  # a nested phase's time is not its caller's as well
                    self.seconds[self._stack[-1]] -= cpu_seconds() - start

        setattr(owner, name, timed)
        undo.append(lambda: setattr(owner, name, original))

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        import marl_llm.algos.collm as collm
        import marl_llm.algos.critic as critic
        import marl_llm.algos.magrpo as magrpo
        import marl_llm.rollout.decode as rollout

        undo: list[Callable[[], None]] = []
        for owner, name, phase in ((rollout.HFRollout, "generate", "generate"),
                                   (critic.Critic, "values", "critic values (no grad)"),
                                   (critic.Critic, "update", "critic update"),
                                   (critic.Critic, "fit_fresh", "critic update"),
                                   (critic.Critic, "step_fitted", "critic update"),
                                   (collm, "policy_update", "actor update"),
                                   (magrpo, "policy_update", "actor update")):
            self._wrap(owner, name, phase, undo)
        try:
            yield
        finally:
            for restore in reversed(undo):
                restore()

    def count_tokens(self, module, args, kwargs) -> None:
        """Forward pre-hook on a base model: the tokens it is fed, by phase."""
        ids = kwargs.get("input_ids")
        ids = kwargs.get("inputs_embeds") if ids is None else ids
        if ids is None and args:
            ids = args[0]
        if ids is None:
            return
        rows, cols = ids.shape[0], ids.shape[1]
        mask = kwargs.get("attention_mask")
        real = int(mask[:, -cols:].sum()) if mask is not None and mask.dim() == 2 else rows * cols
        phase = self._stack[-1] if self._stack else "other"
        self.tokens[f"{phase} padded"] += rows * cols
        self.tokens[f"{phase} real"] += real


def build_systems(model: str, new_tokens: int, threads: int) -> dict[str, Any]:
    """name -> a marl-llm bench system (bench/systems.py) at marl-llm's default granularity."""
    from marl_llm.bench.systems import MarlCoLLMCC, MarlLLM
    from marl_llm.bench.workload import Workload

    class DefaultGranularity(MarlCoLLMCC):  # no comlrl buffer: marl-llm's own update granularity
        @staticmethod
        def algo_overrides(w: Workload) -> list[str]:
            return []

    base = dict(model=model, agents=2, new_tokens=new_tokens, threads=threads)
    magrpo = Workload(num_generations=POSTS_PER_ROUND, **base)
    collm = Workload(num_generations=1, prompts_per_step=POSTS_PER_ROUND, **base)
    systems: dict[str, Any] = {"magrpo": MarlLLM(magrpo)}
    for algo in ("collm_cc", "collm_dc"):
        for suffix in ("", "_ref"):
            system = type(f"Marl_{algo}", (DefaultGranularity,), {"name": f"marl_{algo}"})(collm)
            if suffix:  # the collection-time values from a no-grad pass of their own
                system.run.algo._fits_at_collection = lambda critic, spans: False
            systems[algo + suffix] = system
    return systems


def run_round(name: str, system: Any, posts: list[int], meter: PhaseMeter) -> dict[str, Any]:
    """One round of `system` on `posts`: CPU seconds and tokens per joint action, by phase."""
    from marl_llm.training.trainer import train_step

    meter.reset()
    start, wall = cpu_seconds(), time.perf_counter()
    if name == "magrpo":  # one step per post, G joint actions each
        for j in posts:
            train_step(system.run, system.cfg, system.k, problems=[system.problems[j]])
            system.k += 1
        joint_actions = len(posts) * system.workload.num_generations
    else:  # every post in one step, one joint action each
        train_step(system.run, system.cfg, system.k, problems=[system.problems[j] for j in posts])
        system.k += 1
        joint_actions = len(posts)
    total = cpu_seconds() - start
    phases = {p: meter.seconds.get(p, 0.0) / joint_actions for p in PHASES if p != "other"}
    phases["other"] = total / joint_actions - sum(phases.values())
    return {"seconds": total / joint_actions, "wall_seconds": (time.perf_counter() - wall) / joint_actions,
            "phases": phases, "tokens": {k: v / joint_actions for k, v in meter.tokens.items()}}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the measured rounds."""
    med = statistics.median
    return {"seconds": med(r["seconds"] for r in rows), "wall_seconds": med(r["wall_seconds"] for r in rows),
            "phases": {p: med(r["phases"][p] for r in rows) for p in PHASES},
            "tokens": {k: med(r["tokens"].get(k, 0) for r in rows) for k in sorted({k for r in rows for k in r["tokens"]})},
            "rounds": rows}


def write_report(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "collm_cost.json", json.dumps(report, indent=2))
    s = report["systems"]
    magrpo = s["magrpo"]["seconds"]
    lines = ["# CoLLM's cost per joint action, against MAGRPO", "",
             f"Command: `{report['command']}` ({report['date']}, {report['minutes']:.1f} min)", "",
             f"Machine: {report['machine']}. Torch threads: {report['threads']}. Completions of exactly "
             f"{report['new_tokens']} tokens, 2 agents, the TLDR sample, {report['rounds']} measured rounds after "
             f"{report['warmup']} warm-up round(s), medians. CPU seconds per joint action (getrusage), by phase.", "",
             "| system | s / joint action | / MAGRPO | generate | critic values (no grad) | critic update | actor update | other |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in s.items():
        ph = r["phases"]
        lines.append(f"| {name} | {r['seconds']:.2f} | {r['seconds'] / magrpo:.2f} | "
                     + " | ".join(f"{ph[p]:.2f}" for p in PHASES) + " |")
    lines += ["", "Tokens fed to the base model per joint action (real / padded):", "",
              "| system | " + " | ".join(PHASES[:-1]) + " |", "|---|" + "---|" * (len(PHASES) - 1)]
    for name, r in s.items():
        t = r["tokens"]
        lines.append(f"| {name} | " + " | ".join(
            f"{t.get(p + ' real', 0):.0f} / {t.get(p + ' padded', 0):.0f}" for p in PHASES[:-1]) + " |")
    lines += ["", "## Avoidable (removed): the critic's own no-grad pass", "",
              "| algorithm | before (ref) | now | saved |", "|---|---|---|---|"]
    for algo in ("collm_cc", "collm_dc"):
        ref, now = s[algo + "_ref"]["seconds"], s[algo]["seconds"]
        lines.append(f"| {algo} | {ref:.2f} s ({ref / magrpo:.2f}x MAGRPO) | {now:.2f} s ({now / magrpo:.2f}x MAGRPO) "
                     f"| {1 - now / ref:.0%} |")
    lines.append("")
    atomic_write_text(out / "collm_cost.md", "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="marl-llm-bench collm-cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded", help="embedded (SmolLM2-135M) or a local HF checkpoint dir")
    ap.add_argument("--out", default="results", help="where collm_cost.md and collm_cost.json go")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (each system once per round)")
    ap.add_argument("--warmup", type=int, default=1, help="rounds before the measured ones")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU seconds are the work done)")
    args = ap.parse_args(argv)
    import torch

    from marl_llm.training.setup import quiet_libraries

    quiet_libraries()
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        report = measure(args, argv)
    finally:  # a caller's own thread count (the tests run this in-process)
        torch.set_num_threads(threads)
    write_report(report, Path(args.out))
    print(f"[collm-cost] wrote {Path(args.out) / 'collm_cost.md'}", file=sys.stderr)
    return 0


def measure(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    """Every system's rounds, summarized: the report that write_report writes."""
    import platform

    import torch

    began = time.time()
    systems = build_systems(args.model, args.new_tokens, args.threads)
    meter = PhaseMeter()
    bases = {id(m.get_base_model().model): m.get_base_model().model
             for system in systems.values() for m in system.run.policies.models}
    for base in bases.values():  # agents sharing a base: hooked once
        base.register_forward_pre_hook(meter.count_tokens, with_kwargs=True)
    n = len(systems["magrpo"].problems)
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    with meter.patched():
        for r in range(args.warmup + args.rounds):
            posts = [(POSTS_PER_ROUND * r + j) % n for j in range(POSTS_PER_ROUND)]
            for name, system in systems.items():
                row = run_round(name, system, posts, meter)
                print(f"[collm-cost] round {r}{' (warm-up)' if r < args.warmup else ''} {name}: "
                      f"{row['seconds']:.2f} CPU s per joint action", file=sys.stderr, flush=True)
                if r >= args.warmup:
                    rows[name].append(row)
    return {"command": "marl-llm-bench collm-cost " + " ".join(shlex.quote(a) for a in (argv or sys.argv[2:])),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "minutes": (time.time() - began) / 60,
            "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
            "threads": args.threads, "new_tokens": args.new_tokens, "rounds": args.rounds, "warmup": args.warmup,
            "systems": {name: summarize(r) for name, r in rows.items()}}
