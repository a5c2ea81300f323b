"""What a finished run reports: summary.json's held-out line on the console and the markdown
summary (trainer.summary_file; `make run` writes results/)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from marl_llm.config import task_label
from marl_llm.runs.atomic import atomic_write_text


def held_out_line(summary: dict[str, Any]) -> str:
    """The held-out evaluations before and after training, as the console's last line shows them."""
    before, after = summary["before"] or {}, summary["after"] or {}
    # pass@1_ceiling: what the reference harness lets pass@1 reach (task.reward.variant=paper).
    keys = ("pass@1", "pass@1_sampled", "pass@1_ceiling", "success_rate", "reward")
    if after and before:
        return "held-out before -> after training: " + "  ".join(
            f"{k} {before[k]:.3f} -> {after[k]:.3f}" for k in keys if k in before and k in after)
    if after:
        return "held-out after training: " + "  ".join(f"{k} {after[k]:.3f}" for k in keys if k in after)
    if before and summary.get("steps"):  # trained, not evaluated after (the paper presets, as the reference)
        return ("held-out before training (none after it: trainer.eval_after=false): "
                + "  ".join(f"{k} {before[k]:.3f}" for k in keys if k in before))
    if before:
        return "held-out, no training: " + "  ".join(f"{k} {before[k]:.3f}" for k in keys if k in before)
    return "no held-out evaluation (trainer.eval_before and trainer.eval_after are off)"


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def first_train_reward(run_dir: Path) -> float | None:
    return next((row["train/reward"] for row in _rows(run_dir) if "train/reward" in row), None)


def logged_eval(run_dir: Path, step: int) -> dict[str, float] | None:
    """The evaluation metrics.jsonl holds for `step`, as the evaluation returned them: a resumed
    run's summary keeps its first attempt's evaluation before training."""
    row = next((r for r in _rows(run_dir) if r.get("step") == step and any(k.startswith("eval/") for k in r)), None)
    return None if row is None else {k[len("eval/"):]: v for k, v in row.items() if k.startswith("eval/")}


def code_line() -> str:
    from marl_llm.runs.loggers import code_version

    code = code_version()
    commit = code.get("git_commit")
    where = f", commit {commit[:12]}" + (" (uncommitted changes)" if code.get("git_dirty") else "") if commit else ""
    return f"marl-llm {code.get('marl_llm')}{where}"


def write_summary(path: Path, cfg: DictConfig, s: dict[str, Any]) -> None:
    """A short markdown summary (make run writes results/), with the command that produced it."""
    def get(which: str, key: str) -> str:
        v = (s.get(which) or {}).get(key)
        return "n/a" if v is None else f"{v:.4f}"

    def num(v: Any, fmt: str) -> str:
        return "n/a" if v is None else format(v, fmt)

    cmd = "marl-llm " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    lines = [
        f"# {cfg.algo.name} on {task_label(cfg)} with {cfg.model.name}",
        "",
        f"Command: `{cmd}`",
        "",
        "| metric | before training | after training |",
        "|---|---|---|",
        f"| eval pass@1 (greedy, {cfg.algo.get('num_turns', 1)} turns, {s['eval_problems']} held-out problems) | {get('before', 'pass@1')} | {get('after', 'pass@1')} |",
        f"| eval reward (task scale) | {get('before', 'reward')} | {get('after', 'reward')} |",
        *([f"| pass@1 ceiling (canonical solutions passing the reference harness) | {get('before', 'pass@1_ceiling')} "
           f"| {get('after', 'pass@1_ceiling')} |"] if any("pass@1_ceiling" in (s.get(k) or {}) for k in ("before", "after"))
          else []),
        f"| train reward (first step / last step) | {num(s.get('train_reward_first'), '.4f')} | {num(s.get('train_reward_last'), '.4f')} |",
        "",
        f"- steps: {s.get('steps')} (prompts per step: {cfg.trainer.prompts_per_step}, "
        f"G={cfg.algo.get('num_generations')}); seconds per step: {num(s.get('sec_per_step'), '.1f')}; "
        f"whole run: {num(s.get('wall_s'), '.0f')} s; peak RSS: {num(s.get('peak_rss_gib'), '.2f')} GiB",
        f"- device: {'cuda' if torch.cuda.is_available() else 'cpu'}; torch {torch.__version__}",
        f"- code: {code_line()}",
        "",
    ]
    atomic_write_text(path, "\n".join(lines))
