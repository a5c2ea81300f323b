"""Value targets and advantages of actor-critic methods (CoLLM-CC / CoLLM-DC, arXiv 2601.21972).

All functions work on one trajectory of T turns, as tensors:

    rewards: Tensor[T]   r_t, the team reward of turn t
    values:  Tensor[T]   V(h_t), the critic's values recorded at collection time
    done:    bool        True when the episode ended at turn T-1 (success threshold or horizon):
                         no bootstrap after the last turn; False: the trajectory was cut, bootstrap
                         from `last_value` = V(h_T)

TD(0) (the paper's): delta_t = r_t + gamma * V(h_{t+1}) - V(h_t), target y_t = r_t + gamma * V(h_{t+1}).
GAE(lambda) (option): A_t = sum_k (gamma * lambda)^k delta_{t+k}, target y_t = A_t + V(h_t);
lambda = 0 is TD(0), lambda = 1 the Monte Carlo return minus V(h_t).
"""

from __future__ import annotations

import torch
from torch import Tensor

from marl_llm.distributed.data_parallel import gather_objects


def _next_values(values: Tensor, done: bool, last_value: float) -> Tensor:
    nxt = torch.empty_like(values)
    nxt[:-1] = values[1:]
    nxt[-1] = 0.0 if done else last_value
    return nxt


def td0(rewards: Tensor, values: Tensor, gamma: float, done: bool = True,
        last_value: float = 0.0) -> tuple[Tensor, Tensor]:
    """(advantages delta_t: Tensor[T], targets y_t: Tensor[T]) of TD(0)."""
    _check(rewards, values)
    targets = rewards + gamma * _next_values(values, done, last_value)
    return targets - values, targets


def gae(rewards: Tensor, values: Tensor, gamma: float, lam: float, done: bool = True,
        last_value: float = 0.0) -> tuple[Tensor, Tensor]:
    """(advantages A_t: Tensor[T], targets A_t + V(h_t): Tensor[T]) of GAE(lambda)."""
    _check(rewards, values)
    deltas = rewards + gamma * _next_values(values, done, last_value) - values
    adv = torch.empty_like(deltas)
    running = torch.zeros((), dtype=deltas.dtype)
    for t in range(len(deltas) - 1, -1, -1):
        running = deltas[t] + gamma * lam * running
        adv[t] = running
    return adv, adv + values


def normalize_per_group(advantages: Tensor, groups: list[tuple[int, int]], eps: float = 1e-8) -> Tensor:
    """(A - mean) / std within each group (e.g. (agent, turn) over the batch); a group of one
    sample is left as is (no statistics from a single sample). Data-parallel ranks pool each
    group's statistics over all ranks, so the batch is the global one."""
    out = advantages.clone()
    by_group: dict[tuple[int, int], list[int]] = {}
    for j, g in enumerate(groups):
        by_group.setdefault(g, []).append(j)
    local = {g: (len(idx), float(advantages[idx].double().sum()), float((advantages[idx].double() ** 2).sum()))
             for g, idx in by_group.items()}
    pooled: dict[tuple[int, int], list[float]] = {}
    for stats in gather_objects(local):  # [local] on one process
        for g, (n, s1, s2) in stats.items():
            acc = pooled.setdefault(g, [0, 0.0, 0.0])
            acc[0], acc[1], acc[2] = acc[0] + n, acc[1] + s1, acc[2] + s2
    for g, idx in by_group.items():
        n, s1, s2 = pooled[g]
        if n > 1:
            mean = s1 / n
            std = max(s2 / n - mean * mean, 0.0) ** 0.5
            out[idx] = ((advantages[idx].double() - mean) / (std + eps)).to(advantages.dtype)
    return out


def _check(rewards: Tensor, values: Tensor) -> None:
    if rewards.shape != values.shape or rewards.dim() != 1 or len(rewards) == 0:
        raise ValueError(f"rewards {tuple(rewards.shape)} and values {tuple(values.shape)} must be equal, 1-D, non-empty")
