"""Group-relative advantages for MAGRPO (arXiv 2508.04652) and its variants.

Layout (verl style): a small registry of *baselines*, plus the functions that turn the team
returns of joint actions into one advantage per agent sample.

Baselines (``BASELINES``, extend with ``@register_baseline(name)``), over one sibling group of
returns R_1..R_G (the G samples that share the same parent history):

    mean  (MAGRPO)     A_g = R_g - mean(R)
    rloo               A_g = R_g - mean_{j != g} R_j      = G/(G-1) * (R_g - mean(R))
    max   (ReMax)      A_g = R_g - max(R)
    raw   (REINFORCE)  A_g = R_g

Optional normalization, per group: A <- (A - mean(A)) / max(std(A), eps). The std is the
*population* std (divide by G) unless ``unbiased_std=True`` (divide by G-1).

With normalization on, all four baselines give identical advantages: every baseline is
A = c * (R - b) with a group constant b and a positive group constant c (c = 1, or G/(G-1) for
rloo), so A - mean(A) = c * (R - mean(R)) and std(A) = c * std(R); the c cancels. (Exact whenever
std(A) >= eps; a constant group gives 0 for every baseline. Only a group whose spread lies below
eps would keep the factor c.) The baselines differ only with normalization off.

Joint actions (``JOINT_MODES``) for N agents with G samples each per node:

    align  joint action g = (sample g of every agent): joint returns [G]; every agent's sample g
           gets the advantage of joint action g.
    cross  Cartesian product: G^N joint actions, returns [G, ..., G] (N dims, dim i = agent i's
           sample index). Agent i's sample k gets the mean return of every joint action that
           contains it (the mean over all other agents' dims), then the baseline over its G
           samples. (The reference sums; the sum is G^(N-1) times the mean, equal after
           normalization.)

Multi-turn (align): the rollout is a tree; see ``tree_returns`` / ``tree_advantages``.

Rewards with several levels (``REWARD_LEVELS``, ``algo.reward_levels``): ``sum`` (the papers') takes
the advantage of the total; ``normalize_then_sum`` is GDPO's (arXiv 2601.05242; TRL's
``multi_objective_aggregation="normalize_then_sum"``): every level k gets its own group advantage,
normalized within the group, the levels' advantages are summed, and the sum is normalized over the
step's batch:

    A_k = normalize_group(baseline(R_k))     S = sum_k A_k     A = (S - mean(S)) / max(std(S), eps)

so a rare level is not drowned by a frequent one, and distinct level combinations keep distinct
advantages (a group's totals may tie where its levels do not). See ``normalize_then_sum`` and
``tree_level_advantages``.

All computation happens in float64 (groups are small), so a constant group normalizes to exact
zeros instead of round-off / eps; results are cast back to the input dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from marl_llm.algos.schemas import REWARD_LEVELS
from marl_llm.registry import (BASELINE_MIN_GROUP_SIZE, BASELINES, GROUP_BASELINES, JOINT_MODES, register_baseline,
                               register_joint_mode)

__all__ = [
    "BASELINES",
    "GROUP_BASELINES",
    "JOINT_MODES",
    "GroupIndex",
    "register_baseline",
    "register_joint_mode",
    "group_advantages",
    "grouped_advantages",
    "normalize_grouped",
    "per_agent_returns",
    "per_agent_advantages",
    "tree_returns",
    "tree_advantages",
    "REWARD_LEVELS",
    "level_matrix",
    "normalize_then_sum",
    "tree_level_advantages",
]


# --------------------------------------------------------------------------------------------
# Groups: a flat tensor of n values split into sibling groups.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupIndex:
    """Segment structure of n flat values split into ``num_groups`` sibling groups.

    ids:    LongTensor[n]          group of every value, in [0, num_groups)
    counts: LongTensor[num_groups] group sizes (0 for an id that never occurs)
    """

    ids: Tensor
    num_groups: int
    counts: Tensor

    @classmethod
    def from_ids(cls, ids: Tensor, num_groups: int | None = None) -> "GroupIndex":
        """ids: LongTensor[n] of non-negative group ids (need not be contiguous or sorted)."""
        if ids.dim() != 1:
            raise ValueError(f"group ids must be 1-D, got shape {tuple(ids.shape)}")
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise TypeError(f"group ids must be an integer tensor, got {ids.dtype}")
        ids = ids.long()
        if ids.numel() and int(ids.min()) < 0:
            raise ValueError("group ids must be non-negative")
        needed = int(ids.max()) + 1 if ids.numel() else 0
        if num_groups is None:
            num_groups = needed
        elif num_groups < needed:
            raise ValueError(f"num_groups={num_groups} but the largest id is {needed - 1}")
        counts = torch.bincount(ids, minlength=num_groups)
        return cls(ids=ids, num_groups=num_groups, counts=counts)

    @classmethod
    def dense(cls, num_groups: int, group_size: int, device: torch.device | str | None = None):
        """Groups of a row-major [num_groups, group_size] tensor flattened to [num_groups*G]."""
        ids = torch.arange(num_groups, device=device).repeat_interleave(group_size)
        counts = torch.full((num_groups,), group_size, dtype=torch.long, device=device)
        return cls(ids=ids, num_groups=num_groups, counts=counts)

    def size_of(self) -> Tensor:
        """LongTensor[n]: the size of the group of every value."""
        return self.counts[self.ids]

    def sum(self, x: Tensor) -> Tensor:
        """x: [n] -> [num_groups] per-group sums."""
        return x.new_zeros(self.num_groups).index_add_(0, self.ids, x)

    def mean(self, x: Tensor) -> Tensor:
        """x: [n] -> [num_groups] per-group means (0 for an empty group)."""
        return self.sum(x) / self.counts.clamp_min(1).to(x.dtype)

    def amax(self, x: Tensor) -> Tensor:
        """x: [n] -> [num_groups] per-group maxima (-inf for an empty group)."""
        out = x.new_full((self.num_groups,), float("-inf"))
        return out.scatter_reduce(0, self.ids, x, reduce="amax", include_self=True)


# --------------------------------------------------------------------------------------------
# Baseline registry. A baseline maps flat values [n] + their groups to advantages [n]
# (before normalization).
# --------------------------------------------------------------------------------------------

BaselineFn = Callable[[Tensor, GroupIndex], Tensor]

# BASELINES, BASELINE_MIN_GROUP_SIZE, GROUP_BASELINES and register_baseline: marl_llm.registry (the
# built-ins are declared by name in algos/schemas.py, which config checks read without importing
# this module; a plugin registers with the decorator there, importing no torch).


def _get_baseline(name: str) -> BaselineFn:
    try:
        return BASELINES[name]
    except KeyError:
        raise ValueError(f"unknown baseline {name!r}; known: {sorted(BASELINES)}") from None


@register_baseline("mean")
def mean_baseline(values: Tensor, groups: GroupIndex) -> Tensor:
    """MAGRPO / GRPO: A_g = R_g - mean(R)."""
    return values - groups.mean(values)[groups.ids]


@register_baseline("rloo", min_group_size=2)
def rloo_baseline(values: Tensor, groups: GroupIndex) -> Tensor:
    """Leave-one-out: A_g = R_g - mean_{j != g} R_j. A group of size 1 has no other sample: A = 0."""
    size = groups.size_of()
    others = (groups.sum(values)[groups.ids] - values) / (size - 1).clamp_min(1).to(values.dtype)
    return torch.where(size > 1, values - others, torch.zeros_like(values))


@register_baseline("max")
def max_baseline(values: Tensor, groups: GroupIndex) -> Tensor:
    """ReMax-style: A_g = R_g - max(R) (every advantage <= 0)."""
    return values - groups.amax(values)[groups.ids]


@register_baseline("raw", uses_group=False)
def raw_baseline(values: Tensor, groups: GroupIndex) -> Tensor:
    """Plain REINFORCE: A_g = R_g."""
    return values.clone()


def normalize_grouped(
    adv: Tensor, groups: GroupIndex, eps: float = 1e-6, unbiased_std: bool = False
) -> Tensor:
    """Per group: A <- (A - mean(A)) / max(std(A), eps). adv: [n] -> [n].

    std: population (divide by the group size) unless ``unbiased_std`` (size - 1, clamped to >= 1,
    so a group of size 1 gets 0 rather than NaN). A group of size 1 always normalizes to 0.
    """
    dev = adv - groups.mean(adv)[groups.ids]
    denom = groups.counts - 1 if unbiased_std else groups.counts
    var = groups.sum(dev * dev) / denom.clamp_min(1).to(adv.dtype)
    std = var.sqrt().clamp_min(eps)
    return dev / std[groups.ids]


def _advantages_flat(
    values: Tensor, groups: GroupIndex, baseline: str, normalize: bool, eps: float, unbiased: bool
) -> Tensor:
    fn = _get_baseline(baseline)
    x = values.to(torch.float64)
    adv = fn(x, groups)
    if normalize:
        adv = normalize_grouped(adv, groups, eps=eps, unbiased_std=unbiased)
    out_dtype = values.dtype if values.is_floating_point() else torch.get_default_dtype()
    return adv.to(out_dtype)


def group_advantages(
    returns: Tensor,
    baseline: str = "mean",
    normalize: bool = False,
    eps: float = 1e-6,
    *,
    unbiased_std: bool = False,
) -> Tensor:
    """Advantages over sibling groups laid out densely.

    returns: Tensor[..., G] (last dim = the G samples of one group; leading dims are independent
        groups). Returns Tensor[..., G] (same shape, input float dtype).
    baseline: a key of ``BASELINES`` ("mean" | "rloo" | "max" | "raw").
    normalize: then A <- (A - mean A) / max(std A, eps) per group (population std unless
        ``unbiased_std``). With it on, all four baselines give identical advantages (module doc).
    Raises ValueError for an unknown baseline or G below its minimum (rloo needs G >= 2).
    """
    if returns.dim() == 0:
        raise ValueError("returns must have a group dimension [..., G]")
    _get_baseline(baseline)
    min_g = max(1, BASELINE_MIN_GROUP_SIZE.get(baseline, 1))
    g = returns.shape[-1]
    if g < min_g:
        raise ValueError(f"baseline {baseline!r} needs groups of size >= {min_g}, got G={g}")
    flat = returns.reshape(-1)
    groups = GroupIndex.dense(flat.numel() // g, g, device=returns.device)
    adv = _advantages_flat(flat, groups, baseline, normalize, eps, unbiased_std)
    return adv.reshape(returns.shape)


def grouped_advantages(
    values: Tensor,
    group_ids: Tensor,
    baseline: str = "mean",
    normalize: bool = False,
    eps: float = 1e-6,
    *,
    num_groups: int | None = None,
    unbiased_std: bool = False,
) -> Tensor:
    """Advantages over variable-size groups given by ids.

    values: Tensor[n] returns; group_ids: LongTensor[n] (non-negative, any order, need not be
    contiguous: values with equal ids are siblings). Returns Tensor[n].
    Groups of size 1: mean/max/rloo give 0 (rloo has no other sample to compare with), raw gives
    R; with normalization every size-1 group gives 0.
    """
    if values.dim() != 1 or values.shape != group_ids.shape:
        raise ValueError(
            f"values and group_ids must be 1-D of equal shape, got {tuple(values.shape)} "
            f"and {tuple(group_ids.shape)}"
        )
    groups = GroupIndex.from_ids(group_ids.to(values.device), num_groups)
    return _advantages_flat(values, groups, baseline, normalize, eps, unbiased_std)


# --------------------------------------------------------------------------------------------
# Joint modes: team returns of joint actions -> per-agent returns [..., N, G].
# --------------------------------------------------------------------------------------------

JointModeFn = Callable[[Tensor, int], Tensor]

# JOINT_MODES and register_joint_mode: marl_llm.registry (the built-ins are declared in algos/schemas.py).


@register_joint_mode("align")
def align_returns(joint_returns: Tensor, num_agents: int) -> Tensor:
    """[G] -> [N, G] or [B, G] -> [B, N, G]: agent i's sample g gets joint return g."""
    if joint_returns.dim() not in (1, 2):
        raise ValueError(f"align expects returns [G] or [B, G], got {tuple(joint_returns.shape)}")
    shape = (*joint_returns.shape[:-1], num_agents, joint_returns.shape[-1])
    return joint_returns.unsqueeze(-2).expand(shape).clone()


@register_joint_mode("cross")
def cross_returns(joint_returns: Tensor, num_agents: int) -> Tensor:
    """[G]*N -> [N, G] or [B] + [G]*N -> [B, N, G]: marginal mean over the other agents' dims."""
    nd = joint_returns.dim()
    if nd == num_agents:
        batched = False
    elif nd == num_agents + 1:
        batched = True
    else:
        raise ValueError(
            f"cross with {num_agents} agents expects returns [G]*{num_agents} or "
            f"[B]+[G]*{num_agents}, got {tuple(joint_returns.shape)}"
        )
    off = 1 if batched else 0
    sizes = joint_returns.shape[off:]
    if len(set(sizes)) != 1:
        raise ValueError(f"cross expects the same G for every agent, got {tuple(sizes)}")
    agent_dims = list(range(off, off + num_agents))
    per_agent = []
    for i in range(num_agents):
        others = [d for d in agent_dims if d != off + i]
        per_agent.append(joint_returns.mean(dim=others) if others else joint_returns)
    return torch.stack(per_agent, dim=-2)


def per_agent_returns(joint_returns: Tensor, num_agents: int, mode: str = "align") -> Tensor:
    """Per-agent returns before the baseline, Tensor[N, G] (or [B, N, G]); shapes as below."""
    if num_agents < 1:
        raise ValueError(f"num_agents must be >= 1, got {num_agents}")
    try:
        fn = JOINT_MODES[mode]
    except KeyError:
        raise ValueError(f"unknown joint mode {mode!r}; known: {sorted(JOINT_MODES)}") from None
    return fn(joint_returns, num_agents)


def per_agent_advantages(
    joint_returns: Tensor,
    num_agents: int,
    mode: str = "align",
    baseline: str = "mean",
    normalize: bool = False,
    eps: float = 1e-6,
    *,
    unbiased_std: bool = False,
) -> Tensor:
    """Advantage of every agent's every sample at one node (or a batch of nodes).

    align: joint_returns [G]  -> [N, G];   [B, G]           -> [B, N, G]
    cross: joint_returns [G]*N -> [N, G];  [B] + [G]*N      -> [B, N, G]
           (dim i (after the batch dim) indexes agent i's sample)
    Output [..., i, k]: advantage of agent i's sample k, baseline (and normalization) taken over
    the G samples of that agent at that node. In align mode every agent row is identical.
    """
    returns = per_agent_returns(joint_returns, num_agents, mode)
    return group_advantages(returns, baseline, normalize, eps, unbiased_std=unbiased_std)


# --------------------------------------------------------------------------------------------
# Multi-turn rollout trees (align mode).
# --------------------------------------------------------------------------------------------


def _check_tree(rewards_per_turn: Sequence[Tensor], parent_per_turn: Sequence[Tensor]) -> None:
    if len(rewards_per_turn) != len(parent_per_turn):
        raise ValueError(
            f"{len(rewards_per_turn)} reward tensors but {len(parent_per_turn)} parent tensors"
        )
    if not rewards_per_turn:
        raise ValueError("the tree needs at least one turn")
    for t, (r, p) in enumerate(zip(rewards_per_turn, parent_per_turn)):
        if r.dim() != 1 or p.shape != r.shape:
            raise ValueError(
                f"turn {t}: rewards and parents must be 1-D of equal shape, got "
                f"{tuple(r.shape)} and {tuple(p.shape)}"
            )
        if p.is_floating_point() or p.dtype == torch.bool:
            raise TypeError(f"turn {t}: parent indices must be integers, got {p.dtype}")
        if p.numel() and int(p.min()) < 0:
            raise ValueError(f"turn {t}: negative parent index")
        if t > 0 and p.numel() and int(p.max()) >= rewards_per_turn[t - 1].numel():
            raise ValueError(
                f"turn {t}: parent index {int(p.max())} out of range for "
                f"{rewards_per_turn[t - 1].numel()} nodes at turn {t - 1}"
            )


def tree_returns(
    rewards_per_turn: Sequence[Tensor], parent_per_turn: Sequence[Tensor], gamma: float = 1.0
) -> list[Tensor]:
    """Returns of every node of a rollout tree (one node = one joint action at one turn).

    rewards_per_turn[t]: Tensor[n_t], the team reward r of every node at turn t.
    parent_per_turn[t]:  LongTensor[n_t]; for t >= 1 the index of the node's parent among the
        n_{t-1} nodes of turn t-1; for t = 0 the prompt (environment instance) index, unused here.
        Siblings (one group of G samples) are the nodes of a turn that share a parent.
    gamma: discount (the reference is undiscounted: gamma = 1).

    R = r + gamma * mean(R of the node's children); a node without children (last turn, or not
    expanded: early termination) has R = r. Returns list[Tensor[n_t]] (float64 if the rewards are
    not floating point, else their dtype). Vectorized per turn with index_add.
    """
    _check_tree(rewards_per_turn, parent_per_turn)
    dtype = rewards_per_turn[0].dtype
    if not dtype.is_floating_point:
        dtype = torch.float64
    out: list[Tensor] = [r.to(dtype) for r in rewards_per_turn]
    for t in range(len(out) - 2, -1, -1):
        n = out[t].numel()
        child_r, parents = out[t + 1], parent_per_turn[t + 1].long().to(out[t].device)
        child_sum = child_r.new_zeros(n).index_add_(0, parents, child_r)
        child_cnt = torch.bincount(parents, minlength=n).to(dtype)
        child_mean = torch.where(child_cnt > 0, child_sum / child_cnt.clamp_min(1), 0.0)
        out[t] = out[t] + gamma * child_mean
    return out


def tree_advantages(
    rewards_per_turn: Sequence[Tensor],
    parent_per_turn: Sequence[Tensor],
    gamma: float = 1.0,
    baseline: str = "mean",
    normalize: bool = False,
    eps: float = 1e-6,
    *,
    unbiased_std: bool = False,
) -> list[Tensor]:
    """Align-mode multi-turn advantages: ``tree_returns`` then ``grouped_advantages`` per turn.

    Same layout as ``tree_returns``; sibling groups at turn t are the nodes with equal
    ``parent_per_turn[t]``. Returns list[Tensor[n_t]]; node j of turn t holds the advantage that
    every agent's sample in joint action j receives.
    """
    returns = tree_returns(rewards_per_turn, parent_per_turn, gamma)
    return [
        grouped_advantages(r, p.long(), baseline, normalize, eps, unbiased_std=unbiased_std)
        for r, p in zip(returns, parent_per_turn)
    ]


# --------------------------------------------------------------------------------------------
# Rewards with several levels (GDPO): normalize each level in its group, then sum.
# --------------------------------------------------------------------------------------------

# REWARD_LEVELS (the choices of algo.reward_levels) lives with the schemas that check it (algos/schemas.py).

# A level's share of the total that the levels do not account for (a task whose levels do not add
# up to its total): kept as one more level, so the advantage still sees the whole reward.
REST_LEVEL = "_rest"


def level_matrix(rewards: Sequence[object]) -> Tensor:
    """The reward levels of n rewards (objects with ``total`` and a ``levels`` dict, e.g. JointReward)
    as Tensor[K, n] float64: one row per level name (in order of first appearance; a reward without
    the level has 0), plus a row for what the levels leave of the total where that is not 0
    anywhere (|rest| > 1e-9). A reward without levels is its total alone."""
    names: dict[str, None] = {}
    for r in rewards:
        names.update(dict.fromkeys(r.levels))  # type: ignore[attr-defined]
    rows = [[float(r.levels.get(k, 0.0)) for r in rewards] for k in names]  # type: ignore[attr-defined]
    rest = [float(r.total) - sum(r.levels.values()) for r in rewards]  # type: ignore[attr-defined]
    if any(abs(x) > 1e-9 for x in rest):
        rows.append(rest)
    return torch.tensor(rows, dtype=torch.float64).reshape(len(rows), len(rewards))


def normalize_then_sum(
    levels: Tensor, groups: GroupIndex, baseline: str = "mean", eps: float = 1e-6, *, unbiased_std: bool = False
) -> Tensor:
    """GDPO's advantages (module doc). levels: Tensor[K, n], the K levels of n samples; groups: their
    sibling groups. Returns Tensor[n] (float64): per level the baseline then per-group
    normalization (every group-constant baseline gives the same), summed over levels, then
    normalized over all n samples (population std unless ``unbiased_std``, at least eps)."""
    if levels.dim() != 2 or levels.shape[1] != groups.ids.numel():
        raise ValueError(f"levels must be [K, n] with n = {groups.ids.numel()} samples, got {tuple(levels.shape)}")
    total = levels.new_zeros(levels.shape[1], dtype=torch.float64)
    for level in levels:
        total += _advantages_flat(level.to(torch.float64), groups, baseline, True, eps, unbiased_std)
    one = GroupIndex.dense(1, total.numel(), device=total.device)
    return normalize_grouped(total, one, eps=eps, unbiased_std=unbiased_std) if total.numel() else total


def tree_level_advantages(
    levels_per_turn: Sequence[Tensor],
    parent_per_turn: Sequence[Tensor],
    gamma: float = 1.0,
    baseline: str = "mean",
    eps: float = 1e-6,
    *,
    unbiased_std: bool = False,
) -> list[Tensor]:
    """``tree_advantages`` with GDPO's level normalization: levels_per_turn[t] is Tensor[K, n_t] (the
    same K levels at every turn); each level's returns come from ``tree_returns``, its advantages
    are normalized in the sibling groups of every turn, and the summed advantages are normalized
    over every node of the tree. Returns list[Tensor[n_t]] (float64)."""
    k = {lv.shape[0] for lv in levels_per_turn}
    if len(k) != 1 or any(lv.dim() != 2 for lv in levels_per_turn):
        raise ValueError(f"every turn needs the same levels [K, n_t], got {[tuple(lv.shape) for lv in levels_per_turn]}")
    returns = [tree_returns([lv[j] for lv in levels_per_turn], parent_per_turn, gamma) for j in range(k.pop())]
    # Sibling groups over the whole tree: (turn, parent) pairs numbered turn by turn.
    ids, offset = [], 0
    for p in parent_per_turn:
        ids.append(p.long() + offset)
        offset += int(p.max()) + 1 if p.numel() else 0
    groups = GroupIndex.from_ids(torch.cat(ids)) if ids else GroupIndex.dense(0, 1)
    flat = torch.stack([torch.cat(r) for r in returns])  # [K, total nodes]
    adv = normalize_then_sum(flat, groups, baseline, eps, unbiased_std=unbiased_std)
    return list(adv.split([lv.shape[1] for lv in levels_per_turn]))
