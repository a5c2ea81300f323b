"""Evaluation: greedy held-out rollouts with the algorithm's own rollout, and sampled pass@k
(the metrics themselves: training/rollout_metrics.py, shared with the training logs)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from marl_llm.algos.base import Algorithm
    from marl_llm.training.episodes import JointNode, JointTree
    from marl_llm.tasks.base import Problem

from marl_llm.training.rollout_metrics import level_metrics, mean_pass_at_k

__all__ = ["evaluate"]

# The console's progress (rollout.PROGRESS, by name: this module stays free of torch).
PROGRESS = logging.getLogger("marl_llm.progress")


def evaluate(algo: "Algorithm", problems: "list[Problem]", trainer_cfg: Any) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Greedy rollout of `algo.eval_turns` turns with the algorithm's own rollout (feedback between
    turns, or the baselines' sequential / discussion prompts), and sampled pass@k when
    trainer.eval_num_samples > 0. Returns (metrics, sample rows); every algorithm reports the same
    metrics. pass@1 / reward / levels are of the final turn's joint action; turn_<t>/... per turn.
    """
    from dataclasses import replace

    task, num_turns, sampling = algo.task, algo.eval_turns, algo.agent_sampling()
    greedy = [replace(s, temperature=0.0) for s in sampling]
    PROGRESS.debug("phase", extra={"phase": "greedy rollout"})
    tree = algo.rollout_tree(problems, [1] * num_turns, greedy)
    final = _final_nodes(tree)
    metrics: dict[str, float] = {"reward": sum(n.reward.total for n in final) / len(final)}
    metrics.update(level_metrics(final))
    if num_turns > 1:
        for t, turn in enumerate(tree.turns):
            metrics[f"turn_{t + 1}/reward"] = sum(n.reward.total for n in turn) / len(turn)
    success = task.success_metric  # turn-based tasks: success_rate
    if all(n.reward.passed is not None for n in final):
        metrics[success] = sum(bool(n.reward.passed) for n in final) / len(final)
        for t, turn in enumerate(tree.turns):
            metrics[f"turn_{t + 1}/{success}"] = sum(bool(n.reward.passed) for n in turn) / len(turn)
    lengths = [len(c.completion_ids) for n in tree.nodes() for c in n.completions]
    metrics["completions/mean_length"] = sum(lengths) / len(lengths)
    metrics["completions/clipped_ratio"] = sum(c.truncated for n in tree.nodes() for c in n.completions) / len(lengths)
    rows = [{"problem": problems[n.problem].uid, "turn": n.turn + 1, "reward": n.reward.total,
             "passed": n.reward.passed, "levels": n.reward.levels,
             **{f"{a}/prompt": m for a, m in zip(task.agent_names, n.messages)},
             **{f"{a}/completion": c for a, c in zip(task.agent_names, n.texts)}} for n in final]

    n_samples = trainer_cfg.eval_num_samples
    if n_samples > 0 and success == "pass@1":
        PROGRESS.debug("phase", extra={"phase": f"sampled rollout (pass@k, {n_samples} per problem)"})
        sampled = algo.rollout_tree(problems, [n_samples] + [1] * (num_turns - 1), sampling)
        final_s = _final_nodes(sampled)
        if all(n.reward.passed is not None for n in final_s):
            per_problem = [(n_samples, sum(bool(n.reward.passed) for n in final_s if n.problem == b))
                           for b in range(len(problems))]
            for k in trainer_cfg.eval_k:
                metrics[f"pass@{k}_sampled" if k == 1 else f"pass@{k}"] = mean_pass_at_k(per_problem, k)
        metrics["reward_sampled"] = sum(n.reward.total for n in final_s) / len(final_s)
    return metrics, rows


def _final_nodes(tree: "JointTree") -> "list[JointNode]":
    """The last joint action of every chain (chains may end early when a task terminates them)."""
    return [n for n in tree.nodes() if n.terminated]
