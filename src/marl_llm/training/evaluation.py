"""Evaluation, by trainer.eval_protocol (the metrics themselves: training/rollout_metrics.py, shared
with the training logs):

    own    greedy held-out rollouts with the algorithm's own rollout (pass@1, reward, levels, per
           turn) and sampled pass@k, every trainer.eval_every steps and before/after training
    paper  the reference trainers' (comlrl 1.4.3 MAGRPOTrainer.evaluate, the actor-critic
           trainers' evaluate): before every trainer.eval_interval-th batch of each epoch, one
           rollout sampled at the training settings on each of the first trainer.eval_max_problems
           eval items; the mean reward, expected return (undiscounted) and (code) test pass rate
           per turn. The reference never evaluates after its last batch: the paper presets set
           trainer.eval_after=false

A code task scored by the reference harness (task.reward.variant=paper) fails some canonical
solutions (21 of 164 HumanEval problems, 4 of test[:32]; docs/rewards_code.md): every pass@
metric then comes with `pass@1_ceiling`, the share of the evaluated problems whose canonical
solution passes, the most pass@1 can reach.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from marl_llm.algos.base import Algorithm
    from marl_llm.training.episodes import JointNode, JointTree
    from marl_llm.tasks.base import JointReward, Problem, Task

from marl_llm.training.rollout_metrics import level_metrics, mean_pass_at_k

__all__ = ["evaluate", "evaluate_paper", "paper_eval_due", "pass_at_1_ceiling"]

EVAL_PROTOCOLS = ("own", "paper")
# The console's progress (rollout.PROGRESS, by name: this module stays free of torch).
PROGRESS = logging.getLogger("marl_llm.progress")


def evaluate(algo: "Algorithm", problems: "list[Problem]", trainer_cfg: Any) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """`_evaluate`, with the task's own metrics of this evaluation's rollouts (task=env:
    observations/clipped_ratio)."""
    from marl_llm.tasks.base import take_task_metrics

    take_task_metrics(algo.task)  # what the training rollouts left is theirs
    metrics, rows = _evaluate(algo, problems, trainer_cfg)
    metrics.update(take_task_metrics(algo.task))
    return metrics, rows


def _evaluate(algo: "Algorithm", problems: "list[Problem]", trainer_cfg: Any) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Evaluate by trainer.eval_protocol; returns (metrics, sample rows). `own`: a greedy rollout of
    `algo.eval_turns` turns with the algorithm's own rollout (feedback between turns, or the
    baselines' sequential / discussion prompts), and sampled pass@k when trainer.eval_num_samples
    > 0; every algorithm reports the same metrics. pass@1 / reward / levels are of the final
    turn's joint action; turn_<t>/... per turn."""
    if trainer_cfg.get("eval_protocol", "own") == "paper":
        return evaluate_paper(algo, problems)
    from dataclasses import replace

    task, num_turns, sampling = algo.task, algo.eval_turns, algo.agent_sampling()
    greedy = [replace(s, temperature=0.0) for s in sampling]
    PROGRESS.debug("phase", extra={"phase": "greedy rollout"})
    tree = algo.rollout_tree(problems, [1] * num_turns, greedy)
    final = _final_nodes(tree)
    metrics: dict[str, float] = {"reward": _mean([n.reward.total for n in final])}
    metrics.update(level_metrics(final))
    if num_turns > 1:
        for t, turn in enumerate(tree.turns):
            metrics[f"turn_{t + 1}/reward"] = _mean([n.reward.total for n in turn])
    success = task.success_metric  # turn-based tasks: success_rate
    if all(n.reward.passed is not None for n in final):
        metrics[success] = _mean([float(bool(n.reward.passed)) for n in final])
        for t, turn in enumerate(tree.turns):
            metrics[f"turn_{t + 1}/{success}"] = _mean([float(bool(n.reward.passed)) for n in turn])
    lengths = [len(c.completion_ids) for n in tree.nodes() for c in n.completions]
    metrics["completions/mean_length"] = sum(lengths) / len(lengths)
    metrics["completions/clipped_ratio"] = sum(c.truncated for n in tree.nodes() for c in n.completions) / len(lengths)
    rows = _rows(task, problems, final)

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
        metrics["reward_sampled"] = _mean([n.reward.total for n in final_s])
    _add_ceiling(task, problems, metrics)
    return metrics, rows


def evaluate_paper(algo: "Algorithm", problems: "list[Problem]") -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The reference trainers' evaluation: one rollout per problem, sampled at the training
    sampling settings. comlrl's MAGRPO plays every turn; its actor-critic trainers evaluate with
    their training rollout, so an episode ends at the early termination
    (Algorithm.eval_as_training). Either logs a turn's return as the undiscounted sum of the
    shifted rewards from that turn on, whatever algo.discount the training uses (comlrl 1.4.3's
    MAAC and IAC trainers overwrite their rollouts' returns with it). Metrics per turn t (over the
    episodes that reached it): turn_<t>/reward (the task's reward, unshifted),
    turn_<t>/expected_return (comlrl's: shifted rewards from t on, summed) and, for code tasks,
    turn_<t>/test_pass_rate (tests passed / tests of the reward's own run, 0 when it stopped before
    the tests); overall `reward` and the success metric of the final joint actions (code:
    pass@1_sampled, with pass@1_ceiling under the reference harness)."""
    task, as_training = algo.task, algo.eval_as_training
    PROGRESS.debug("phase", extra={"phase": "sampled rollout (the reference protocol)"})
    tree = algo.rollout_tree(problems, [1] * algo.eval_turns, algo.agent_sampling(),
                             algo.early_stop() if as_training else None)
    from marl_llm.training.episodes import trajectories

    returns: dict[int, list[float]] = {}
    for chain in trajectories(tree):
        ret = 0.0
        for node in reversed(chain):
            ret += node.reward.total + task.reward_shift
            returns.setdefault(node.turn, []).append(ret)
    metrics: dict[str, float] = {}
    code = task.success_metric == "pass@1"
    for t, turn in enumerate(tree.turns):
        metrics[f"turn_{t + 1}/reward"] = _mean([n.reward.total for n in turn])
        metrics[f"turn_{t + 1}/expected_return"] = _mean(returns[t])
        if code:
            metrics[f"turn_{t + 1}/test_pass_rate"] = _mean([test_pass_rate(n.reward) for n in turn])
    final = _final_nodes(tree)
    metrics["reward"] = _mean([n.reward.total for n in final])
    metrics.update(level_metrics(final))
    if all(n.reward.passed is not None for n in final):
        name = "pass@1_sampled" if code else task.success_metric
        metrics[name] = _mean([float(bool(n.reward.passed)) for n in final])
    _add_ceiling(task, problems, metrics)
    return metrics, _rows(task, problems, final)


def paper_eval_due(step: int, prompts_per_step: int, num_problems: int, interval: int) -> bool:
    """trainer.eval_protocol=paper: does the reference evaluate before trainer step `step`? comlrl
    evaluates before batch b of every epoch when b % eval_interval == 0 (batch 0 included); a
    step's batch index in its epoch is where its first draw falls (exact with one prompt per
    step, the reference's batch size)."""
    if interval <= 0 or num_problems <= 0:
        return False
    return ((step * prompts_per_step) % num_problems) // prompts_per_step % interval == 0


def test_pass_rate(reward: "JointReward") -> float:
    """A code reward's share of passed tests (0 when it stopped before running them)."""
    total = reward.info.get("tests_total") or 0
    return reward.info.get("tests_passed", 0) / total if total else 0.0


_CEILINGS: dict[tuple[int, tuple[str, ...]], float | None] = {}


def pass_at_1_ceiling(task: "Task", problems: "list[Problem]") -> float | None:
    """The share of `problems` whose canonical solution the task's reward passes, when it is the
    reference harness (task.reward.variant=paper) and every problem has a canonical solution
    (HumanEval: prompt + canonical_solution as main; CoopHumanEval's sample: aux_solution and
    main_solution); None otherwise. Computed once per task and problem set (sandboxed runs)."""
    if getattr(task, "reward_variant", None) != "paper" or task.success_metric != "pass@1" or not problems:
        return None
    key = (id(task), tuple(p.uid for p in problems))
    if key not in _CEILINGS:
        actions = [_canonical(p.data) for p in problems]
        _CEILINGS[key] = (None if any(a is None for a in actions) else
                          _mean([float(bool(r.passed)) for r in task.joint_rewards(problems, actions)]))
    return _CEILINGS[key]


def _canonical(row: dict[str, Any]) -> list[str] | None:
    if row.get("canonical_solution") is not None:
        return ["def aux(x):\n    return x\n", row["prompt"] + row["canonical_solution"]]
    if row.get("main_solution") is not None:
        return [row.get("aux_solution") or "", row["main_solution"]]
    return None


def _add_ceiling(task: "Task", problems: "list[Problem]", metrics: dict[str, float]) -> None:
    if any(k.startswith("pass@") for k in metrics):
        ceiling = pass_at_1_ceiling(task, problems)
        if ceiling is not None:
            metrics["pass@1_ceiling"] = ceiling


def _rows(task: "Task", problems: "list[Problem]", final: "list[JointNode]") -> list[dict[str, Any]]:
    """The sample rows of the final joint actions (logged as the eval samples)."""
    return [{"problem": problems[n.problem].uid, "turn": n.turn + 1, "reward": n.reward.total,
             "passed": n.reward.passed, "levels": n.reward.levels,
             **{f"{a}/prompt": m for a, m in zip(task.agent_names, n.messages)},
             **{f"{a}/completion": c for a, c in zip(task.agent_names, n.texts)}} for n in final]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _final_nodes(tree: "JointTree") -> "list[JointNode]":
    """The last joint action of every chain (chains may end early when a task terminates them)."""
    return [n for n in tree.nodes() if n.terminated]
