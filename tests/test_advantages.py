"""Advantage math: baselines, normalization, align/cross joint modes, rollout trees."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from conftest import FLOAT64_REL, assert_close_to_scale
from marl_llm.algos.advantages import (
    BASELINES,
    GroupIndex,
    group_advantages,
    grouped_advantages,
    level_matrix,
    normalize_then_sum,
    per_agent_advantages,
    per_agent_returns,
    register_baseline,
    tree_advantages,
    tree_level_advantages,
    tree_returns,
)

ALL = ["mean", "rloo", "max", "raw"]


def t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


def close(a, b, tol=1e-9):
    b = b if isinstance(b, torch.Tensor) else t(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    torch.testing.assert_close(a.to(torch.float64), b.to(torch.float64), atol=tol, rtol=0)


# ---------------------------------------------------------------- baselines on one group

R = [1.0, 2.0, 3.0, 6.0]  # mean 3, max 6


@pytest.mark.parametrize(
    "baseline, expected",
    [
        ("mean", [-2.0, -1.0, 0.0, 3.0]),
        # leave-one-out means: 11/3, 10/3, 3, 2
        ("rloo", [1 - 11 / 3, 2 - 10 / 3, 0.0, 4.0]),
        ("max", [-5.0, -4.0, -3.0, 0.0]),
        ("raw", [1.0, 2.0, 3.0, 6.0]),
    ],
)
def test_baselines_hand_computed(baseline, expected):
    close(group_advantages(t(R), baseline, normalize=False), expected)


def test_registry_has_the_four_baselines():
    assert set(ALL) <= set(BASELINES)
    with pytest.raises(ValueError):
        register_baseline("mean")(lambda v, g: v)


@pytest.mark.parametrize("baseline", ALL)
def test_normalized_hand_computed(baseline):
    # centered [-2, -1, 0, 3]: population var = 14/4, unbiased var = 14/3
    centered = [-2.0, -1.0, 0.0, 3.0]
    pop = [x / math.sqrt(3.5) for x in centered]
    unb = [x / math.sqrt(14 / 3) for x in centered]
    close(group_advantages(t(R), baseline, normalize=True), pop)
    close(group_advantages(t(R), baseline, normalize=True, unbiased_std=True), unb)


@pytest.mark.numerics
def test_all_baselines_identical_after_normalization():
    """Normalized advantages of every baseline vs the mean baseline's (and the unbiased std's vs
    the population std's times sqrt(6/7)): float64, to FLOAT64_REL of the largest element; the
    groups' means and stds vs 0 and 1, to FLOAT64_REL absolutely (the values are of order 1)."""
    torch.manual_seed(0)
    returns = torch.randn(5, 7, dtype=torch.float64) * 3 + 1
    ref = group_advantages(returns, "mean", normalize=True)
    for b in ALL:
        assert_close_to_scale(group_advantages(returns, b, normalize=True), ref, FLOAT64_REL, b)
        assert_close_to_scale(group_advantages(returns, b, normalize=True, unbiased_std=True),
                              ref * math.sqrt(6 / 7), FLOAT64_REL, f"{b}, unbiased std")
    # ... and they do differ without normalization
    raw = {b: group_advantages(returns, b, normalize=False) for b in ALL}
    for a, b in itertools.combinations(ALL, 2):
        assert not torch.allclose(raw[a], raw[b]), (a, b)
    # per group: zero mean, unit population std
    close(ref.mean(-1), torch.zeros(5, dtype=torch.float64), FLOAT64_REL)
    close(ref.std(-1, unbiased=False), torch.ones(5, dtype=torch.float64), FLOAT64_REL)


@pytest.mark.numerics
def test_leading_dims_are_independent_groups_and_dtype_kept():
    """A [2, 3, 4] batch of groups vs each group alone: advantages, float64, to FLOAT64_REL of the
    largest element; a float32 batch gives float32 advantages (the dtype is kept)."""
    torch.manual_seed(1)
    returns = torch.randn(2, 3, 4, dtype=torch.float64)
    for b in ALL:
        assert group_advantages(returns.float(), b, normalize=False).dtype == torch.float32
        out = group_advantages(returns, b, normalize=False)
        assert out.shape == (2, 3, 4) and out.dtype == torch.float64
        for i, j in itertools.product(range(2), range(3)):
            assert_close_to_scale(out[i, j], group_advantages(returns[i, j], b, normalize=False), FLOAT64_REL, b)


def test_constant_group_normalizes_to_exact_zero():
    # float32 round-off in the group mean would otherwise be divided by eps (-> ~0.03, not 0)
    for value, G in [(0.1, 4), (0.3, 7), (0.7, 7), (-4.2, 5)]:
        returns = torch.full((3, G), value)
        for b in ALL:
            assert torch.equal(group_advantages(returns, b, normalize=True), torch.zeros(3, G)), (value, G, b)


def test_invalid_inputs():
    with pytest.raises(ValueError):
        group_advantages(t([1.0]), "rloo", normalize=False)  # rloo needs G >= 2
    with pytest.raises(ValueError):
        group_advantages(t(R), "nope", normalize=False)
    group_advantages(t([1.0]), "mean", normalize=False)  # G = 1 fine for mean


# ---------------------------------------------------------------- align

def test_align_every_agent_gets_the_joint_advantage():
    joint = t([1.0, 0.0, 0.0, 1.0])
    out = per_agent_advantages(joint, num_agents=2, mode="align", baseline="mean", normalize=False)
    close(out, [[0.5, -0.5, -0.5, 0.5]] * 2)
    out = per_agent_advantages(joint, 3, "align", "max", normalize=False)
    close(out, [[0.0, -1.0, -1.0, 0.0]] * 3)
    out = per_agent_advantages(joint, 2, "align", "rloo", normalize=True)
    close(out, [[1.0, -1.0, -1.0, 1.0]] * 2)  # centered ±0.5, population std 0.5


def test_align_batched():
    joint = t([[1.0, 0.0, 0.0, 1.0], [4.0, 2.0, 0.0, 2.0]])
    out = per_agent_advantages(joint, 2, "align", "mean", normalize=False)
    assert out.shape == (2, 2, 4)
    close(out[0], [[0.5, -0.5, -0.5, 0.5]] * 2)
    close(out[1], [[2.0, 0.0, -2.0, 0.0]] * 2)


# ---------------------------------------------------------------- cross

# R[a, b]: agent 0 picks row a, agent 1 column b.
# marginals: agent 0: [mean(1, 0), mean(3, 2)] = [0.5, 2.5]; agent 1: [mean(1, 3), mean(0, 2)] = [2, 1]
CROSS2 = [[1.0, 0.0], [3.0, 2.0]]


@pytest.mark.parametrize(
    "baseline, normalize, expected",
    [
        ("raw", False, [[0.5, 2.5], [2.0, 1.0]]),
        ("mean", False, [[-1.0, 1.0], [0.5, -0.5]]),
        ("rloo", False, [[-2.0, 2.0], [1.0, -1.0]]),
        ("max", False, [[-2.0, 0.0], [0.0, -1.0]]),
        ("mean", True, [[-1.0, 1.0], [1.0, -1.0]]),
        ("max", True, [[-1.0, 1.0], [1.0, -1.0]]),
    ],
)
def test_cross_two_agents_2x2(baseline, normalize, expected):
    out = per_agent_advantages(t(CROSS2), 2, "cross", baseline, normalize)
    close(out, expected)


def test_cross_three_agents_hand_computed():
    # R[a,b,c] = 4a + 2b + c + 8abc, G = 2. Marginals: agent0 6a + 1.5, agent1 4b + 2.5, agent2 3c + 3
    g = torch.arange(2, dtype=torch.float64)
    a, b, c = g[:, None, None], g[None, :, None], g[None, None, :]
    joint = 4 * a + 2 * b + c + 8 * a * b * c
    close(per_agent_returns(joint, 3, "cross"), [[1.5, 7.5], [2.5, 6.5], [3.0, 6.0]])
    close(per_agent_advantages(joint, 3, "cross", "mean", False), [[-3.0, 3.0], [-2.0, 2.0], [-1.5, 1.5]])


@pytest.mark.numerics
def test_cross_matches_brute_force_enumeration():
    """Cross-mode per-agent returns and advantages vs the marginals by brute-force enumeration
    (and a batch vs its members): float64, to FLOAT64_REL of the largest element."""
    torch.manual_seed(2)
    n_agents, G = 3, 3
    joint = torch.randn([G] * n_agents, dtype=torch.float64)
    expected = torch.zeros(n_agents, G, dtype=torch.float64)
    for i in range(n_agents):
        for k in range(G):
            vals = [joint[idx] for idx in itertools.product(range(G), repeat=n_agents) if idx[i] == k]
            assert len(vals) == G ** (n_agents - 1)
            expected[i, k] = sum(vals) / len(vals)
    assert_close_to_scale(per_agent_returns(joint, n_agents, "cross"), expected, FLOAT64_REL, "returns")
    for bl in ALL:
        assert_close_to_scale(per_agent_advantages(joint, n_agents, "cross", bl, False),
                              group_advantages(expected, bl, False), FLOAT64_REL, bl)
    # batched: [B, G, G, G] -> [B, N, G]
    batch = torch.stack([joint, 2 * joint + 1])
    out = per_agent_advantages(batch, n_agents, "cross", "mean", False)
    assert out.shape == (2, n_agents, G)
    assert_close_to_scale(out[0], group_advantages(expected, "mean", False), FLOAT64_REL, "batch row 0")
    assert_close_to_scale(out[1], 2 * group_advantages(expected, "mean", False), FLOAT64_REL, "batch row 1")


@pytest.mark.numerics
def test_cross_single_agent_equals_align_and_bad_shapes():
    """One agent: cross mode vs align mode, float64, to FLOAT64_REL of the largest element."""
    r = t([3.0, 1.0, 2.0])
    cross = per_agent_advantages(r, 1, "cross", "rloo", False)
    assert_close_to_scale(cross, per_agent_advantages(r, 1, "align", "rloo", False), FLOAT64_REL, "cross vs align")
    close(cross, [[3.0 - 1.5, 1.0 - 2.5, 0.0]])
    with pytest.raises(ValueError):
        per_agent_advantages(torch.zeros(2, 2), 3, "cross", "mean", False)  # ndim neither 3 nor 4
    with pytest.raises(ValueError):
        per_agent_advantages(torch.zeros(2, 3), 2, "cross", "mean", False)  # unequal G
    with pytest.raises(ValueError):
        per_agent_advantages(torch.zeros(2, 3, 4), 2, "align", "mean", False)
    with pytest.raises(ValueError):
        per_agent_advantages(torch.zeros(2), 2, "bogus", "mean", False)


# ---------------------------------------------------------------- trees

def test_tree_two_turns_with_early_termination():
    # one prompt, G = 2. Turn 0 rewards [1, 2]; node 0 expanded into 2 children with rewards [3, 5];
    # node 1 terminated early (no children).
    rewards = [t([1.0, 2.0]), t([3.0, 5.0])]
    parents = [torch.tensor([0, 0]), torch.tensor([0, 0])]
    R = tree_returns(rewards, parents, gamma=0.5)
    close(R[0], [1.0 + 0.5 * 4.0, 2.0])  # [3, 2]
    close(R[1], [3.0, 5.0])
    A = tree_advantages(rewards, parents, gamma=0.5, baseline="mean", normalize=False)
    close(A[0], [0.5, -0.5])
    close(A[1], [-1.0, 1.0])
    R1 = tree_returns(rewards, parents, gamma=1.0)
    close(R1[0], [5.0, 2.0])


THREE_TURN_REWARDS = [[0.0, 1.0, 2.0, 3.0], [1.0, 3.0, 4.0, 0.0, 2.0], [10.0, 2.0, 6.0]]
# turn 0: 2 prompts x 2 samples; turn 1: node0 -> {0, 1}, node1 -> none, node2 -> {2}, node3 -> {3, 4}
# turn 2: turn-1 node0 -> {0}, node4 -> {1, 2}
THREE_TURN_PARENTS = [[0, 0, 1, 1], [0, 0, 2, 3, 3], [0, 4, 4]]


@pytest.mark.parametrize(
    "gamma, expected",
    [
        (0.5, [[2.25, 1.0, 4.0, 4.0], [6.0, 3.0, 4.0, 0.0, 4.0], [10.0, 2.0, 6.0]]),
        (1.0, [[7.0, 1.0, 6.0, 6.0], [11.0, 3.0, 4.0, 0.0, 6.0], [10.0, 2.0, 6.0]]),
    ],
)
def test_tree_three_turns(gamma, expected):
    rewards = [t(r) for r in THREE_TURN_REWARDS]
    parents = [torch.tensor(p) for p in THREE_TURN_PARENTS]
    R = tree_returns(rewards, parents, gamma)
    for got, want in zip(R, expected):
        close(got, want)
    A = tree_advantages(rewards, parents, gamma, "mean", normalize=False)
    if gamma == 0.5:
        close(A[0], [0.625, -0.625, 0.0, 0.0])
        close(A[1], [1.5, -1.5, 0.0, -2.0, 2.0])  # singleton group {2} -> 0
        close(A[2], [0.0, -2.0, 2.0])


def test_tree_validation():
    with pytest.raises(ValueError):
        tree_returns([t([1.0])], [torch.tensor([0]), torch.tensor([0])], 1.0)
    with pytest.raises(ValueError):  # parent index out of range
        tree_returns([t([1.0, 2.0]), t([1.0])], [torch.tensor([0, 0]), torch.tensor([2])], 1.0)
    with pytest.raises(TypeError):
        tree_returns([t([1.0])], [t([0.0])], 1.0)


# ---------------------------------------------------------------- variable groups

VALUES = [1.0, 2.0, 3.0, 10.0, 4.0, 8.0]
IDS = [0, 0, 0, 2, 5, 5]  # sizes 3, 1, 2; ids non-contiguous


@pytest.mark.parametrize(
    "baseline, expected",
    [
        ("mean", [-1.0, 0.0, 1.0, 0.0, -2.0, 2.0]),
        ("rloo", [-1.5, 0.0, 1.5, 0.0, -4.0, 4.0]),  # size-1 group -> 0
        ("max", [-2.0, -1.0, 0.0, 0.0, -4.0, 0.0]),
        ("raw", VALUES),
    ],
)
def test_grouped_variable_sizes(baseline, expected):
    close(grouped_advantages(t(VALUES), torch.tensor(IDS), baseline, normalize=False), expected)
    s = 1 / math.sqrt(2 / 3)
    close(
        grouped_advantages(t(VALUES), torch.tensor(IDS), baseline, normalize=True),
        [-s, 0.0, s, 0.0, -1.0, 1.0],
    )


@pytest.mark.numerics
def test_grouped_matches_dense_under_permutation():
    """Variable-group advantages of a permuted flat batch vs the dense [groups, G] computation:
    float64, to FLOAT64_REL of the largest element."""
    torch.manual_seed(3)
    dense = torch.randn(4, 5, dtype=torch.float64)
    ids = torch.arange(4).repeat_interleave(5)
    perm = torch.randperm(20)
    for b in ALL:
        for norm in (False, True):
            want = group_advantages(dense, b, norm).reshape(-1)[perm]
            got = grouped_advantages(dense.reshape(-1)[perm], ids[perm], b, norm)
            assert_close_to_scale(got, want, FLOAT64_REL, f"{b}, normalize={norm}")


def test_grouped_validation():
    with pytest.raises(ValueError):
        grouped_advantages(t([1.0, 2.0]), torch.tensor([0]), "mean", False)
    with pytest.raises(ValueError):
        grouped_advantages(t([1.0, 2.0]), torch.tensor([0, -1]), "mean", False)


# ---------------------------------------------------------------- reward levels (GDPO)


def test_normalize_then_sum_hand_computed():
    """Two groups of three, two levels. Per level and group (population std):
    A level 1 [1,0,0] -> [sqrt2, -1/sqrt2, -1/sqrt2]; A level 2 [.5,.5,0] -> [1/sqrt2, 1/sqrt2, -sqrt2];
    B level 1 constant -> 0; B level 2 [1,0,1] -> [1/sqrt2, -sqrt2, 1/sqrt2]. Sums: A [3/sqrt2, 0,
    -3/sqrt2], B [1/sqrt2, -sqrt2, 1/sqrt2]; over the six: mean 0, std sqrt2 -> divided by sqrt2."""
    levels = t([[1, 0, 0, 0, 0, 0], [0.5, 0.5, 0, 1, 0, 1]])
    groups = GroupIndex.dense(2, 3)
    close(normalize_then_sum(levels, groups), [1.5, 0.0, -1.5, 0.5, -1.0, 0.5])
    # Every group-constant baseline gives the same (each level is normalized in its group).
    for baseline in ("rloo", "max", "raw"):
        close(normalize_then_sum(levels, groups, baseline), [1.5, 0.0, -1.5, 0.5, -1.0, 0.5])
    # The sum of the levels instead ([1.5, .5, 0], [1, 0, 1]) normalized per group ranks A's last two apart
    # by the total only; GDPO's level-wise advantages differ from it.
    summed = group_advantages(levels.sum(0).reshape(2, 3), "mean", normalize=True).reshape(-1)
    assert not torch.allclose(summed, normalize_then_sum(levels, groups))


def test_normalize_then_sum_keeps_distinct_level_combinations_apart():
    """GDPO's case: totals that tie in a group (1 = 1 + 0 = 0 + 1) get one advantage from the sum,
    but the levels say which level was met: a rare level (met once in the group) weighs more."""
    levels = t([[1, 0, 0, 0], [0, 1, 1, 0]])  # totals [1, 1, 1, 0]
    summed = group_advantages(levels.sum(0), "mean", normalize=True)
    assert summed[0] == summed[1] == summed[2]
    gdpo = normalize_then_sum(levels, GroupIndex.dense(1, 4))
    assert gdpo[0] > gdpo[1] == gdpo[2] > gdpo[3]


def test_level_matrix_rows_missing_levels_and_the_rest():
    R = SimpleNamespace
    rows = level_matrix([R(total=1.5, levels={"a": 1.0, "b": 0.5}), R(total=2.0, levels={"a": 0.0, "c": 1.0}),
                         R(total=0.5, levels={})])
    # a, b, c in order of appearance; the rest (total - levels) is a row: [0, 1, 0.5]
    close(rows, [[1.0, 0.0, 0.0], [0.5, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 1.0, 0.5]])
    close(level_matrix([R(total=1.0, levels={"a": 1.0}), R(total=0.0, levels={"a": 0.0})]), [[1.0, 0.0]])


@pytest.mark.numerics
def test_tree_level_advantages_hand_computed():
    """Turn 0: two joint actions (level x [1, 0], level y [0, 0]); turn 1: node 0's children
    x [1, 1], node 1's children x [0, 1], y [0, 2]. gamma 1: x returns turn 0 [2, 0.5], turn 1
    [1, 1, 0, 1]; y returns [0, 1], [0, 0, 0, 2]. Per group normalized: x [1, -1], [0, 0], [-1, 1];
    y [-1, 1], [0, 0], [-1, 1]. Sums [0, 0, 0, 0, -2, 2]: mean 0, std sqrt(8/6) -> / sqrt(4/3).
    One level vs the normalized tree advantages renormalized: float64, to FLOAT64_REL of the
    largest element."""
    levels = [t([[1, 0], [0, 0]]), t([[1, 1, 0, 1], [0, 0, 0, 2]])]
    parents = [torch.tensor([0, 0]), torch.tensor([0, 0, 1, 1])]
    adv = tree_level_advantages(levels, parents)
    s = math.sqrt(4 / 3)
    close(adv[0], [0.0, 0.0])
    close(adv[1], [0.0, 0.0, -2 / s, 2 / s])
    # One level: the normalized tree advantages, then normalized over the tree's nodes.
    one = tree_level_advantages([lv[:1] for lv in levels], parents)
    plain = torch.cat(tree_advantages([lv[0] for lv in levels], parents, normalize=True))
    assert_close_to_scale(torch.cat(one), plain / plain.std(unbiased=False), FLOAT64_REL, "one level")
    with pytest.raises(ValueError, match="same levels"):
        tree_level_advantages([t([[1, 0]]), t([[1, 1, 0, 1], [0, 0, 0, 2]])], parents)
