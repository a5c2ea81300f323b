"""Metrics of rollouts, shared by training logs and evaluation: the team reward and its levels per
turn and sibling group, and pass@k (the unbiased estimator of Chen et al. 2021, "Evaluating Large
Language Models Trained on Code"). Plain Python: no torch."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from marl_llm.training.episodes import JointNode, JointTree

__all__ = ["pass_at_k", "mean_pass_at_k", "reward_metrics", "level_metrics"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Computed in the numerically stable product form 1 - prod_{i=n-c+1}^{n} (1 - k / i) (no large
    binomials). Raises ValueError unless 0 <= c <= n and 1 <= k <= n.
    """
    n, c, k = int(n), int(c), int(k)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"c must be in [0, n={n}], got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(per_problem: Iterable[tuple[int, int]], k: int) -> float:
    """Mean of pass_at_k(n, c, k) over problems given as (n, c) pairs. Raises on an empty list."""
    values = [pass_at_k(n, c, k) for n, c in per_problem]
    if not values:
        raise ValueError("mean_pass_at_k needs at least one problem")
    return sum(values) / len(values)


def _std(xs: list[float]) -> float:
    return statistics.pstdev(xs) if len(xs) > 1 else 0.0


def level_metrics(nodes: "list[JointNode]") -> dict[str, float]:
    """rewards/<level>/mean, /std and /rate (fraction of joint actions earning credit at that level);
    for tasks that report ungated levels also rewards/<level>_ungated/... and reward_ungated."""
    out: dict[str, float] = {}
    for suffix, attr in (("", "levels"), ("_ungated", "ungated")):
        names = list(dict.fromkeys(k for n in nodes for k in getattr(n.reward, attr)))
        for name in names:
            vals = [float(getattr(n.reward, attr).get(name, 0.0)) for n in nodes]
            out[f"rewards/{name}{suffix}/mean"] = sum(vals) / len(vals)
            out[f"rewards/{name}{suffix}/std"] = _std(vals)
            out[f"rewards/{name}{suffix}/rate"] = sum(v > 0 for v in vals) / len(vals)
    if nodes and all(n.reward.ungated for n in nodes):
        out["reward_ungated"] = sum(sum(n.reward.ungated.values()) for n in nodes) / len(nodes)
    return out


def reward_metrics(tree: "JointTree", shift: float = 0.0) -> dict[str, float]:
    """Team-reward metrics of a training rollout (task scale, unshifted; training adds `shift`).

    reward / reward_std over all joint actions, joint_actions (how many the step scored),
    frac_reward_zero_std over sibling groups,
    turn_<t>/reward and turn_<t>/reward_std, rewards/<level>/{mean,std,rate}.
    """
    nodes = list(tree.nodes())
    rewards = [n.reward.total for n in nodes]
    out = {"reward": sum(rewards) / len(rewards), "reward_std": _std(rewards),
           "reward_shifted": sum(rewards) / len(rewards) + shift,
           # the step's budget in the CoLLM paper's accounting (matched-budget comparisons)
           "joint_actions": float(len(nodes))}
    groups: dict[tuple[int, int], list[float]] = {}
    for t, turn in enumerate(tree.turns):
        vals = [n.reward.total for n in turn]
        out[f"turn_{t + 1}/reward"] = sum(vals) / len(vals)
        out[f"turn_{t + 1}/reward_std"] = _std(vals)
        for n in turn:
            groups.setdefault((t, n.parent), []).append(n.reward.total)
    out["frac_reward_zero_std"] = sum(_std(g) == 0 for g in groups.values()) / len(groups)
    out.update(level_metrics(nodes))
    return out
