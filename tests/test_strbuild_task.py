"""task=strbuild: targets, history replay across turns, feedback prompts, and early success."""

from __future__ import annotations

import pytest
import torch

from conftest import compose_config
from marl_llm.config import UserError
from marl_llm.envs.strbuild import StrBuildEnv
from marl_llm.training.episodes import collect_tree
from marl_llm.rollout.base import Completion
from marl_llm.rollout.sampling import SamplingParams
from marl_llm.tasks import build_task
from marl_llm.tasks.base import Problem, Turn


def task(*extra):
    return build_task(compose_config(["task=strbuild", "run_dir=/tmp/x", *extra]).task)


def commands(target: str, block: str, cells=None) -> str:
    env = StrBuildEnv(target)
    cells = sorted(env.target_cells()) if cells is None else cells
    return "\n".join(f"/setblock {x} {y} {z} {block}" for x, y, z in cells)


def scripted(texts_by_agent):
    """A generate() that answers agent i with texts_by_agent[i][call] (one entry per turn)."""
    calls = {}

    def generate(requests):
        out = []
        for r in requests:
            k = calls.get(r.agent, 0)
            calls[r.agent] = k + 1
            text = texts_by_agent[r.agent][min(k, len(texts_by_agent[r.agent]) - 1)]
            out.append(Completion(torch.tensor([1]), torch.tensor([2]), text, False))
        return out
    return generate


def test_targets_are_held_out_deterministic_and_checked():
    t = task()
    ev, tr = t.load_split("eval"), t.load_split("train")
    targets = [p.data["target"] for p in ev]
    assert len(targets) == 16 == len(set(targets)) and all(1 <= len(x) <= 2 and x.isupper() for x in targets)
    assert not set(targets) & {p.data["target"] for p in tr[:2000]}
    assert [p.data["target"] for p in task().load_split("eval")] == targets
    assert [p.data["target"] for p in task("task.eval_targets=[hi,AB]").load_split("eval")] == ["HI", "AB"]
    with pytest.raises(UserError, match="uppercase letters"):
        task("task.eval_targets=[A1]").load_split("eval")
    with pytest.raises(UserError, match="disjoint"):
        task("task.palettes=[[red_wool],[red_wool]]")
    with pytest.raises(UserError, match="distinct targets"):
        task("task.max_letters=1", "task.num_eval=30").load_split("eval")


def test_blocks_stay_between_turns_and_the_reward_follows_the_formula():
    t = task()
    p = Problem("p", {"target": "L"})
    cells = sorted(StrBuildEnv("L").target_cells())  # 9 cells
    first, second = cells[:5], cells[5:]
    hist = [[Turn("", commands("L", "red_wool", first)), Turn("", "")],
            [Turn("", ""), Turn("", commands("L", "blue_wool", second))]]
    turn1, turn2 = t.history_rewards([p, p], [[h[:1] for h in hist], hist])
    assert turn1.levels["coverage"] == pytest.approx(5 / 9) and turn1.levels["absent_agents"] == 1
    assert turn2.levels["coverage"] == 1.0 and turn2.levels["absent_agents"] == 0  # turn 1's blocks stayed
    adj = turn2.levels["adjacency_ratio"]
    assert turn2.total == pytest.approx(2 * 1.0 - 1.5 * 0.0 - adj - 0.0)
    assert turn2.passed and turn2.done and turn2.levels["iou"] == 1.0
    assert not turn1.done and turn1.passed is False
    # joint_rewards is one turn from an empty wall
    [one] = t.joint_rewards([p], [[commands("L", "red_wool", first), ""]])
    assert one.total == pytest.approx(turn1.total)


def test_letter_gap_reaches_the_wall_and_a_perfect_build_scores_iou_one():
    t = task("task.letter_gap=2")
    p = Problem("p", {"target": "LI"})
    cells = sorted(StrBuildEnv("LI", letter_gap=2).target_cells())
    assert max(x for x, _, _ in cells) == 11  # I at x = 7..11
    hist = [[Turn("", "\n".join(f"/setblock {x} {y} {z} red_wool" for x, y, z in cells if (x + y) % 2 == 0))],
            [Turn("", "\n".join(f"/setblock {x} {y} {z} blue_wool" for x, y, z in cells if (x + y) % 2 == 1))]]
    [r] = t.history_rewards([p], [hist])
    assert r.levels["iou"] == 1.0 and r.levels["coverage"] == 1.0 and r.passed
    [narrow] = task().history_rewards([p], [hist])  # the default 1-column wall
    assert narrow.levels["iou"] < 1.0
    assert "x = column 0..11" in t.initial_prompts(p)[0]  # own prompts show the wider wall

def test_feedback_prompts_and_early_success_end_the_episode():
    t = task()
    p = Problem("p", {"target": "T"})
    prompts0 = t.initial_prompts(p)
    assert "builder1" in prompts0[0] and "red_wool" in prompts0[0] and "blue_wool" in prompts0[1]
    assert "/setblock x y z block" in prompts0[0] and "Turn 0/4" in prompts0[0]
    sampling = [SamplingParams(max_new_tokens=8)] * 2
    # turn 1: builder1 uses a block of the other palette (rejected), builder2 builds the top row only
    top = [(x, 4, 0) for x in range(5)]
    gen = scripted([["/setblock 2 3 0 blue_wool", commands("T", "red_wool")], [commands("T", "cyan_wool", top), ""]])
    tree = collect_tree(t, gen, [p], [1, 1, 1, 1], sampling)
    assert len(tree.turns) == 2  # success at turn 2 ends the episode before the horizon
    n1, n2 = tree.turns[0][0], tree.turns[1][0]
    assert not n1.terminated and n2.terminated and n2.reward.passed
    second = n2.messages[0]
    assert "Turn 1/4" in second and "not in your palette" in second and "Missing target positions (4)" in second
    assert "not in your palette" not in n2.messages[1]  # each builder sees its own rejections
