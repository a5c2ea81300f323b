"""Sokoban / Plan-Path with a tool and a planning agent, without a model: hand-written answers."""

from __future__ import annotations

import json

import pytest

from conftest import compose_config
from marl_llm.tasks import build_task


def make(task: str, *overrides: str):
    return build_task(compose_config([f"task={task}", "run_dir=/tmp/x", "task.sandbox.timeout_s=3", *overrides]).task)


@pytest.mark.parametrize("name", ["sokoban", "plan_path"])
def test_tool_moves_are_tried_on_a_copy_and_plan_moves_are_played(name):
    task = make(name)
    problem = task.load_split("eval")[0]
    ep = task.new_episode(problem)
    solution = ep.env.solve() if name == "sokoban" else ep.env.shortest_path()
    assert solution
    tool_code = f"```python\nprint({json.dumps(solution)})\n```"
    [good, bad] = ep.evaluate(0, [tool_code, "```python\nwhile True: pass\n```"])
    assert good.team == 1.0 and good.local > 0 and good.info["actions"] == solution
    assert bad.team == 0.0 and bad.info["actions"] == [] and "did not finish" in bad.info["error"]
    real_before = ep.env.render()
    ep.commit(0, good)
    assert ep.env.render() == real_before  # the tool's moves never touch the real state
    plan_prompt = ep.observation(1)
    assert "The tool agent's program" in plan_prompt and json.dumps(solution) in plan_prompt and "solved" in plan_prompt
    [answer, junk] = ep.evaluate(1, [f"I follow the tool.\n#### {json.dumps(solution)}", "no idea"])
    assert answer.team == 1.0 and junk.info["actions"] == [] and junk.local == 0.0
    ep.commit(1, answer)
    assert ep.env is answer.state and ep.success  # the scored state is the state now
    ep.end_turn()
    assert ep.done and ep.levels()["solved"] == 1.0


def test_the_planning_agent_alone_sees_no_tool_section():
    task = make("sokoban", "task.roles=[plan]")
    assert task.agent_names == ("plan",)
    ep = task.new_episode(task.load_split("eval")[3])
    prompt = ep.observation(0)
    assert "tool" not in prompt and "####" in prompt and ep.env.render() in prompt


def test_turns_end_the_episode_unsolved():
    task = make("plan_path", "task.max_turns=2")
    ep = task.new_episode(task.load_split("train")[5])
    for _ in range(2):
        for agent in range(2):
            ep.commit(agent, ep.evaluate(agent, ["nothing useful"])[0])
        ep.end_turn()
    assert ep.done and not ep.success and len(ep.history) == 2


def test_validation_levels_are_fixed_and_training_levels_differ():
    task = make("sokoban")
    evals = task.load_split("eval")
    assert len(evals) == 100 and evals[0].data["seed"] == 100000 and evals[-1].data["seed"] == 100099
    renders = {task.new_episode(p).env.render() for p in evals[:20]}
    assert len(renders) >= 15
    assert task.new_episode(evals[0]).env.render() == task.new_episode(evals[0]).env.render()
    assert not {p.data["seed"] for p in task.load_split("train")[:1000]} & {p.data["seed"] for p in evals}


def test_tool_programs_of_several_episodes_are_scored_in_one_batch():
    task = make("plan_path")
    episodes = [task.new_episode(p) for p in task.load_split("eval")[:3]]
    texts = [[f"```python\nprint({json.dumps(ep.env.shortest_path())})\n```", "print('no moves')"] for ep in episodes]
    batched = task.evaluate_many(0, list(zip(episodes, texts)))
    one_by_one = [ep.evaluate(0, t) for ep, t in zip(episodes, texts)]
    assert [[(o.team, o.local, o.info["actions"]) for o in outs] for outs in batched] == \
        [[(o.team, o.local, o.info["actions"]) for o in outs] for outs in one_by_one]
    assert all(outs[0].team == 1.0 and outs[1].info["actions"] == [] for outs in batched)
