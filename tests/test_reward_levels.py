"""algo.reward_levels=normalize_then_sum (GDPO) in MAGRPO (align trees, cross) and AT-GRPO, against
hand computation; the default `sum` leaves every paper preset's advantages as they were."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO, compose_config
from marl_llm.algos.advantages import tree_advantages
from marl_llm.algos.at_grpo import ATGRPO, ATTree
from marl_llm.algos.magrpo import MAGRPO
from marl_llm.config import UserError
from marl_llm.configure import validate
from marl_llm.models.policies import Agent
from marl_llm.tasks.base import JointReward
from marl_llm.tasks.turn_based import CandidateGroup
from marl_llm.training.episodes import JointNode, JointTree


def magrpo(*overrides: str) -> MAGRPO:
    """A MAGRPO with just what `advantages` reads: its config and the task's agents and shift."""
    algo = MAGRPO.__new__(MAGRPO)
    algo.cfg = compose_config(["algo=magrpo", "run_dir=/tmp/x", *overrides]).algo
    algo.task = SimpleNamespace(num_agents=2, reward_shift=-4.0)
    algo.buffer = None
    return algo


def node(problem: int, turn: int, parent: int, levels: dict[str, float], choice=(0, 0), name: str = "") -> JointNode:
    reward = JointReward(sum(levels.values()), levels)
    return JointNode(problem, turn, parent, ["m", "m"], [f"{name}/aux", f"{name}/main"], choice, reward)


def test_magrpo_tree_hand_computed():
    """The tree of test_advantages' hand computation (levels x, y; G = 2 over two turns):
    advantages [0, 0] at turn 1 and [0, 0, -2, 2] / sqrt(4/3) at turn 2, for both agents."""
    t0 = [node(0, 0, 0, {"x": 1, "y": 0}, name="a"), node(0, 0, 0, {"x": 0, "y": 0}, name="b")]
    t1 = [node(0, 1, 0, {"x": 1, "y": 0}), node(0, 1, 0, {"x": 1, "y": 0}), node(0, 1, 1, {"x": 0, "y": 0}),
          node(0, 1, 1, {"x": 1, "y": 2})]
    tree = JointTree([None], [t0, t1])
    batches = magrpo("algo.num_generations=2", "algo.reward_levels=normalize_then_sum").advantages(tree)
    s = math.sqrt(4 / 3)
    for b in batches:
        assert b.advantages.tolist() == pytest.approx([0, 0, 0, 0, -2 / s, 2 / s], abs=1e-6)
        assert b.turns == [0, 0, 1, 1, 1, 1]
    # sum (the default): the advantage of the shifted total, baseline mean, unnormalized
    plain = magrpo("algo.num_generations=2").advantages(tree)
    totals = [torch.tensor([n.reward.total - 4.0 for n in turn], dtype=torch.float64) for turn in (t0, t1)]
    want = torch.cat(tree_advantages(totals, [torch.tensor([0, 0]), torch.tensor([0, 0, 1, 1])]))
    assert plain[0].advantages.tolist() == pytest.approx(want.tolist())


def test_magrpo_cross_hand_computed():
    """Cross, two agents, G = 2. Level p is met by agent 0's sample 0 (joint actions (0, 0), (0, 1)):
    marginal returns agent 0 [1, 0] -> [1, -1], agent 1 [.5, .5] -> [0, 0]. Level q only by (1, 1):
    agent 0 [0, .5] -> [-1, 1], agent 1 [0, .5] -> [-1, 1]. Summed: agent 0 [0, 0], agent 1 [-1, 1]
    (std 1 over its samples: as it is)."""
    joint = {(0, 0): {"p": 1, "q": 0}, (0, 1): {"p": 1, "q": 0}, (1, 0): {"p": 0, "q": 0}, (1, 1): {"p": 0, "q": 1}}
    nodes = [node(0, 0, 0, levels, choice=c, name=f"{c[0]}{c[1]}") for c, levels in joint.items()]
    batches = magrpo("algo.num_generations=2", "algo.num_turns=1", "algo.joint_mode=cross",
                     "algo.reward_levels=normalize_then_sum").advantages(JointTree([None], [nodes]))
    assert batches[0].completions == ["00/aux", "10/aux"] and batches[1].completions == ["00/main", "01/main"]
    assert batches[0].advantages.tolist() == pytest.approx([0.0, 0.0], abs=1e-6)
    assert batches[1].advantages.tolist() == pytest.approx([-1.0, 1.0], abs=1e-6)


def test_at_grpo_normalizes_team_levels_and_the_role_reward_apart():
    """One group of three candidates of agent 0: team levels (alpha = 2) t [1, 0, 0] and local
    [0, 0, 3] -> t*2: [2, 0, 0] normalized (population std) [sqrt2, -1/sqrt2, -1/sqrt2]; local [0, 0, 3]
    -> [-1/sqrt2, -1/sqrt2, sqrt2]; sums [1/sqrt2, -sqrt2, 1/sqrt2] (std 1) -> the same."""
    algo = ATGRPO.__new__(ATGRPO)
    algo.cfg = compose_config(["algo=at_grpo", "run_dir=/tmp/x", "algo.alpha=2", "algo.unbiased_std=false",
                               "algo.reward_levels=normalize_then_sum"]).algo
    algo.task = SimpleNamespace(num_agents=2)
    algo.policies = SimpleNamespace(agents=[Agent("a", 0, "shared"), Agent("b", 0, "shared")])
    levels = [{"t": 2.0, "local": 0.0}, {"t": 0.0, "local": 0.0}, {"t": 0.0, "local": 3.0}]
    group = CandidateGroup(("e0", 0, 0), ["c0", "c1", "c2"], [sum(v.values()) for v in levels], 2, levels)
    batches = algo.advantages(ATTree([], [], [group]))
    r = math.sqrt(2)
    assert batches[0].advantages.tolist() == pytest.approx([1 / r, -r, 1 / r], abs=1e-6)
    # sum (the default): (score - mean) / (unbiased std + eps) of the scores [2, 0, 3]
    algo.cfg.reward_levels = "sum"
    s = torch.tensor([2.0, 0.0, 3.0])
    want = ((s - s.mean()) / (s.std(unbiased=False) + 1e-6)).tolist()
    assert algo.advantages(ATTree([], [], [group]))[0].advantages.tolist() == pytest.approx(want, rel=1e-5)


def test_the_option_is_checked_and_the_paper_presets_keep_the_sum():
    with pytest.raises(UserError, match=r"algo.reward_levels: 'gdpo' is not one of sum, normalize_then_sum"):
        validate(compose_config(["run_dir=/tmp/x", "algo.reward_levels=gdpo"]))
    with pytest.raises(UserError, match=r"algo.reward_levels: normalize_then_sum .* set algo.kl_mode=loss"):
        validate(compose_config(["run_dir=/tmp/x", "algo.reward_levels=normalize_then_sum", "algo.kl_coef=0.1"]))
    for path in sorted((REPO / "conf" / "experiment").glob("*_paper.yaml")):
        cfg = compose_config([f"experiment={path.stem}", "run_dir=/tmp/x"])
        assert cfg.algo.get("reward_levels", "sum") == "sum", path.stem
