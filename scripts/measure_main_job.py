#!/usr/bin/env python3
"""Measure the main job (`make run`: `marl-llm experiment=magrpo_humaneval_cpu`) over several seeds
and write results/magrpo_humaneval.md with its plot results/magrpo_humaneval.png.

    .venv/bin/python scripts/measure_main_job.py                      # seeds 0 1 2, one after another
    .venv/bin/python scripts/measure_main_job.py --seeds 0            # one seed
    .venv/bin/python scripts/measure_main_job.py --runs outputs/main_job/seed0 ...   # report finished runs only

Each seed runs the console script as a user would (sequentially: each run has the machine's cores to
itself, so its time is the one `make run` takes), in outputs/main_job/seed<s>/ (a run dir that
holds a run is never reused: remove it, or pass --out-dir). The report gives, per seed and as the
mean over seeds: the held-out evaluation before -> after training (greedy, the first
trainer.eval_max_problems problems of the eval split), the training reward per step, the share
of steps whose sampled groups had rewards that differ (train/frac_reward_zero_std < 1: a step
that can teach something), seconds per step and the whole run's wall time, and the machine's load
average while it ran (a busy machine inflates every time). It measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRESET = "experiment=magrpo_humaneval_cpu"
BUDGET_S = 15 * 60
NAN = float("nan")


def run_seed(seed: int, run_dir: Path, extra: list[str]) -> dict:
    """One seed through the console script; returns what the report needs about the machine."""
    cmd = [str(Path(sys.executable).parent / "marl-llm"), PRESET, f"seed={seed}", "logger=none",
           f"hydra.run.dir={run_dir}", *extra]
    print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO)
    return {"load_before": load_before, "load_after_1min": os.getloadavg()[0],
            "wall_outside_s": time.perf_counter() - t0, "command": " ".join(shlex.quote(c) for c in cmd[1:])}


def read_run(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if "train/reward" in r]
    evals = [r for r in rows if "eval/reward" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    machine = json.loads((run_dir / "measure.json").read_text()) if (run_dir / "measure.json").exists() else {}
    overrides = run_dir / ".hydra" / "overrides.yaml"  # a run started some other way: its command line
    if "command" not in machine and overrides.exists():
        import yaml

        machine["command"] = " ".join(shlex.quote(o) for o in yaml.safe_load(overrides.read_text()))
    return {"dir": run_dir, "train": train, "evals": evals, "summary": summary, "machine": machine}


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "n/a" if x is None or x != x else format(x, spec)


def stats(run: dict) -> dict:
    train, evals = run["train"], run["evals"]
    rewards = [r["train/reward"] for r in train]
    k = max(1, len(rewards) // 4)
    first, last = (evals[0], evals[-1]) if len(evals) >= 2 else ({}, {})
    return {
        "rewards": rewards,
        "first_quarter": mean(rewards[:k]), "last_quarter": mean(rewards[-k:]),
        "spread_share": mean([float(r["train/frac_reward_zero_std"] < 1) for r in train]),
        "groups_with_spread": mean([1 - r["train/frac_reward_zero_std"] for r in train]),
        "eval_before": first.get("eval/reward", NAN), "eval_after": last.get("eval/reward", NAN),
        "pass_before": first.get("eval/pass@1", NAN), "pass_after": last.get("eval/pass@1", NAN),
        "levels_before": {k.split("/")[2]: v for k, v in first.items() if k.startswith("eval/rewards/") and k.endswith("/mean")},
        "levels_after": {k.split("/")[2]: v for k, v in last.items() if k.startswith("eval/rewards/") and k.endswith("/mean")},
        "sec_per_step": run["summary"].get("sec_per_step") or NAN, "wall_s": run["summary"].get("wall_s") or NAN,
        "length": mean([r.get("train/completions/mean_length", float("nan")) for r in train]),
    }


def plot(runs: list[dict], seeds: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    per_step: dict[int, list[float]] = {}
    for run, seed in zip(runs, seeds):
        steps = [r["step"] for r in run["train"]]
        rewards = [r["train/reward"] for r in run["train"]]
        ax.plot(steps, rewards, marker=".", alpha=0.45, label=f"seed {seed}")
        for s, v in zip(steps, rewards):
            per_step.setdefault(s, []).append(v)
    xs = sorted(per_step)
    ax.plot(xs, [mean(per_step[s]) for s in xs], color="black", linewidth=2, label="mean over seeds")
    ax.set(xlabel="training step", ylabel="team reward (task scale, max 4)",
           title="train reward per step (sampled joint actions)")
    ax.legend(fontsize=8)
    s = [stats(r) for r in runs]
    for j, (st, seed) in enumerate(zip(s, seeds)):
        bx.plot([0, 1], [st["eval_before"], st["eval_after"]], marker="o", alpha=0.6, label=f"seed {seed}")
    bx.plot([0, 1], [mean([st["eval_before"] for st in s]), mean([st["eval_after"] for st in s])], color="black",
            linewidth=2, marker="o", label="mean")
    bx.set_xticks([0, 1], ["before", "after"])
    bx.set(ylabel="held-out reward (greedy)", title="held-out eval")
    bx.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(runs: list[dict], seeds: list[str], md: Path, png: Path, note: str = "") -> str:
    s = [stats(r) for r in runs]
    cfg_lines = []
    cfg_path = runs[0]["dir"] / "config.yaml"
    if cfg_path.exists():
        import yaml

        cfg = yaml.safe_load(cfg_path.read_text())
        a, t = cfg["algo"], cfg["trainer"]
        cfg_lines = [f"- settings: G={a['num_generations']}, {a['num_turns']} turn, {t['prompts_per_step']} prompts per "
                     f"step, {t['max_steps']} steps, learning rate {a['learning_rate']}, sampling temperature "
                     f"{a['sampling']['temperature']} / top_p {a['sampling']['top_p']}, max_new_tokens "
                     f"{a['sampling']['max_new_tokens']}, stop rule `{a['sampling'].get('stop')}`, reward "
                     f"`{cfg['task']['reward']['variant']}`, eval on {t['eval_max_problems']} held-out problems (greedy)"]
    n_steps = max(len(r["rewards"]) for r in s)
    header = "| step | " + " | ".join(f"seed {x}" for x in seeds) + " | mean |"
    step_rows = []
    for i in range(n_steps):
        vals = [st["rewards"][i] if i < len(st["rewards"]) else None for st in s]
        step_rows.append(f"| {i + 1} | " + " | ".join(fmt(v) for v in vals) + f" | {fmt(mean([v for v in vals if v is not None]))} |")
    machine = [r["machine"] for r in runs if "load_before" in r["machine"]]
    loads = [m["load_before"] for m in machine] + [m["load_after_1min"] for m in machine]
    over = [seed for st, seed in zip(s, seeds) if st["wall_s"] > BUDGET_S]
    lines = [
        "# The main job: MAGRPO on HumanEval with the embedded SmolLM2-135M (`make run`)",
        "",
        f"Written by `scripts/measure_main_job.py` from {len(runs)} run(s) of `marl-llm {PRESET}` "
        f"(seeds {', '.join(seeds)}); `conf/experiment/magrpo_humaneval_cpu.yaml` holds the settings.",
        "",
        *cfg_lines,
        f"- machine: {os.cpu_count()} CPUs seen; 1-minute load average while the runs ran: "
        + (f"{min(loads):.1f}-{max(loads):.1f}" if loads else "not recorded")
        + " (a load above the core count means the runs shared the cores, and every time below is inflated)",
        *([f"- note: {note}"] if note else []),
        "",
        "## Before -> after",
        "",
        "| seed | held-out reward before -> after | pass@1 before -> after | train reward, first quarter -> last quarter "
        "of the steps | steps with reward spread | sampled groups with spread | mean completion tokens | s/step | "
        "whole run (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for st, seed in zip(s, seeds):
        lines.append(f"| {seed} | {fmt(st['eval_before'])} -> {fmt(st['eval_after'])} | {fmt(st['pass_before'])} -> "
                     f"{fmt(st['pass_after'])} | {fmt(st['first_quarter'])} -> {fmt(st['last_quarter'])} | "
                     f"{fmt(st['spread_share'], '.0%')} | {fmt(st['groups_with_spread'], '.0%')} | {fmt(st['length'], '.0f')} | "
                     f"{fmt(st['sec_per_step'], '.1f')} | {fmt(st['wall_s'], '.0f')} |")
    keys = ("eval_before", "eval_after", "pass_before", "pass_after", "first_quarter", "last_quarter", "spread_share",
            "groups_with_spread", "length", "sec_per_step", "wall_s")
    m = {k: mean([st[k] for st in s if st[k] == st[k]]) for k in keys}
    lines.append(f"| **mean** | {fmt(m['eval_before'])} -> {fmt(m['eval_after'])} | {fmt(m['pass_before'])} -> "
                 f"{fmt(m['pass_after'])} | {fmt(m['first_quarter'])} -> {fmt(m['last_quarter'])} | "
                 f"{fmt(m['spread_share'], '.0%')} | {fmt(m['groups_with_spread'], '.0%')} | {fmt(m['length'], '.0f')} | "
                 f"{fmt(m['sec_per_step'], '.1f')} | {fmt(m['wall_s'], '.0f')} |")
    levels = sorted({k for st in s for k in st["levels_after"]})
    if levels:
        lines += ["", "Held-out reward by level (mean over seeds), before -> after: " + ", ".join(
            f"{k} {fmt(mean([st['levels_before'].get(k, 0.0) for st in s]))} -> "
            f"{fmt(mean([st['levels_after'].get(k, 0.0) for st in s]))}" for k in levels) + "."]
    lines += ["", f"Budget: `make run` must end within {BUDGET_S // 60} minutes on 2 CPU cores; "
              + (f"seed(s) {', '.join(over)} took longer here." if over else "every run here did."), "",
              "## Train reward per step", "", f"![train reward per step and held-out reward]({png.name})", "",
              header, "|" + "---|" * (len(seeds) + 2), *step_rows, "",
              "The training reward is the mean team reward of the step's sampled joint actions (G per problem, "
              "other training problems every step, so it is noisy); a step with reward spread has at least one "
              "group of G joint actions whose rewards differ, so MAGRPO's group advantage is not zero there.",
              "", "## Runs", ""]
    def shown(path: Path) -> str:
        return str(path.resolve().relative_to(REPO)) if path.resolve().is_relative_to(REPO) else str(path)

    lines += [f"- seed {seed}: `{shown(r['dir'])}`" + (f" (`marl-llm {r['machine']['command']}`)" if r["machine"] else "")
              for r, seed in zip(runs, seeds)]
    text = "\n".join(lines) + "\n"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(text)
    plot(runs, seeds, png)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out-dir", type=Path, default=REPO / "outputs" / "main_job", help="run dirs: <out-dir>/seed<s>")
    ap.add_argument("--runs", type=Path, nargs="+", help="report these finished run dirs; run nothing")
    ap.add_argument("--md", type=Path, default=REPO / "results" / "magrpo_humaneval.md")
    ap.add_argument("--note", default="", help="a line for the report (e.g. how the machine was shared)")
    ap.add_argument("overrides", nargs="*", help="more overrides for every run (e.g. trainer.threads=1)")
    args = ap.parse_args()
    if args.runs:
        import yaml

        dirs = args.runs
        seeds = [str(yaml.safe_load((d / "config.yaml").read_text())["seed"]) for d in dirs]
    else:
        dirs, seeds = [], []
        for seed in args.seeds:
            run_dir = args.out_dir / f"seed{seed}"
            machine = run_seed(seed, run_dir, args.overrides)
            (run_dir / "measure.json").write_text(json.dumps(machine, indent=2))
            dirs.append(run_dir)
            seeds.append(str(seed))
    runs = [read_run(d) for d in dirs]
    print(report(runs, seeds, args.md, args.md.with_suffix(".png"), args.note))
    return 0


if __name__ == "__main__":
    sys.exit(main())
