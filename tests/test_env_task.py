"""task=env: a user's multi-turn environment (reset/step, no subclassing) trains with every algorithm
family through the console script; broken environments stop with one line naming the method.

The environment is tests/guess_env.py (a number-guessing game with feedback, written for these tests).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import TEST_DEVICE, VENV_BIN, compose_config, pythonpath
from marl_llm.config import UserError
from marl_llm.rollout.base import Completion
from marl_llm.rollout.sampling import SamplingParams
from marl_llm.tasks.base import Turn, build_task
from marl_llm.training.episodes import collect_tree

TESTS = Path(__file__).resolve().parent


def env_task(*overrides: str):
    cfg = compose_config(["task=env", "task.env=guess_env:Guess", "run_dir=/tmp/x", *overrides])
    return build_task(cfg.task)


def scripted(texts_by_turn: dict[int, list[str]]):
    """A generate() that answers by turn (from the prompt's feedback) and sibling: the env's plumbing
    under test, not a model (the console-script runs below use the tiny model)."""
    calls = []

    def generate(requests):
        calls.append(len(requests))
        out = []
        for j, r in enumerate(requests):
            turn = 1 if "Last turn" not in r.message else 2
            text = texts_by_turn[turn][j % len(texts_by_turn[turn])]
            out.append(Completion(torch.tensor([1]), torch.tensor([2]), text, False))
        return out
    return generate, calls


def test_a_rollout_tree_forks_the_environment_and_carries_its_state(tmp_path, monkeypatch):
    """G = 2 over 2 turns: 2 joint actions at turn 1, 4 at turn 2; each turn-2 step continues its
    parent's episode (the env's own counter is at 2, its feedback names the parent's guesses)."""
    monkeypatch.setenv("GUESS_LOG", str(tmp_path / "log.jsonl"))
    task = env_task("task.env_kwargs.high=100")
    problem = task.load_split("train")[3]
    secret = __import__("random").Random(3).randint(1, 100)
    wrong = [str(g) for g in (1, 2, 3, 4, 5) if g != secret][:2]
    generate, _ = scripted({1: wrong, 2: ["no idea", "none"]})
    tree = collect_tree(task, generate, [problem], [2, 2], [SamplingParams()] * 2)
    assert [len(t) for t in tree.turns] == [2, 4]
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["turn"] for r in log] == [1, 1, 2, 2, 2, 2] and {r["seed"] for r in log} == {3}
    assert log[0]["agents"] == ["guesser", "helper"]
    for node in tree.turns[1]:
        parent = tree.turns[0][node.parent]
        assert f"guesser said {parent.texts[0]}" in node.messages[0]  # the parent's feedback is the prompt
        assert node.reward.levels["found"] == 0.0 and node.reward.local == [0.0, 0.0]
    assert tree.turns[0][0].reward.total == pytest.approx(1 - abs(int(wrong[0]) - secret) / 100)


def test_done_ends_the_episode_and_success_is_reported(tmp_path):
    task = env_task("task.env_kwargs.high=3")
    problem = task.load_split("eval")[0]
    secret = __import__("random").Random(problem.data["seed"]).randint(1, 3)
    generate, _ = scripted({1: [str(secret)], 2: ["1"]})
    tree = collect_tree(task, generate, [problem], [1, 1], [SamplingParams()] * 2)
    assert len(tree.turns) == 1 and tree.turns[0][0].terminated  # done: no second turn
    assert tree.turns[0][0].reward.passed is True and tree.turns[0][0].reward.levels["found"] == 1.0


@pytest.mark.parametrize("overrides,message", [
    (["task.env=guess_env:Nope"], r"task.env=guess_env:Nope: guess_env has no 'Nope'"),
    (["task.env=Guess"], r"name a class as module:class"),
    # reset returns one observation for two agents: one line naming reset, the count and the agents
    (["task.env_kwargs.mode=reset_one_observation"],
     r"reset\(seed=0\) returned 1 observations for 2 agents \(guesser, helper\)"),
    (["+task.env_kwargs.nope=1"], r"creating it with task.env_kwargs=\{'nope': 1\} raised TypeError"),
    (["task.env=collections:OrderedDict"], r"OrderedDict has no reset\(\) method: an environment needs reset\(seed\)"),
    (["task.env=guess_env:Unnamed"], r"name the agents, as task.agents=\[a,b\]"),
    # its observations are keyed by other names
    (["task.env=guess_env:Unnamed", "task.agents=[x,y]"], r"reset\(seed=0\) returned no observation for agent x "
                                                          r"\(agents: x, y\)"),
])
def test_the_class_is_named_as_module_class_and_checked_before_models_load(overrides, message):
    with pytest.raises(UserError, match=message):
        env_task(*overrides)


@pytest.mark.parametrize("mode,message", [
    ("step_text_reward", r"step\(\) \(turn 1, seed 0\) returned the reward 'high' for agent helper: a reward is a "
                         r"finite number"),
    ("step_raises", r"step\(\) at turn 1 of the episode of seed 0 raised ValueError: the referee is out to lunch at "
                    r".*guess_env.py:\d+: fix the environment"),
])
def test_a_broken_step_gets_one_line_naming_the_method_and_the_agent(mode, message):
    task = env_task(f"task.env_kwargs.mode={mode}")
    problem = task.load_split("train")[0]
    with pytest.raises(UserError, match=message):
        task.history_rewards([problem], [[[Turn("p", "4")], [Turn("p", "5")]]])


def test_malformed_steps_name_what_to_return():
    task = env_task()
    problem = task.load_split("train")[0]
    bad = {
        "a list": ([], r"returned list: return a tuple \(observations, rewards, team_reward, done\)"),
        "team": (({}, None, "lots", False), r"returned the team reward 'lots': give a finite number"),
        "obs": (({"guesser": "x", "helper": 3}, None, 1.0, False), r"returned a int observation for agent helper"),
        "missing": (({"guesser": "x"}, None, 1.0, False), r"returned no observation for agent helper"),
        "nan": (({"guesser": "x", "helper": "y"}, [float("nan"), 0], 1.0, False),
                r"returned the reward nan for agent guesser"),
        "done": (({"guesser": "x", "helper": "y"}, None, 1.0, "yes"), r"returned done='yes': give True or False"),
    }
    for name, (out, message) in bad.items():
        task.make = lambda out=out: type("E", (), {"reset": lambda self, s: ["a", "b"], "step": lambda self, a: out})()
        with pytest.raises(UserError, match=message):
            task.history_rewards([problem], [[[Turn("p", "4")], [Turn("p", "5")]]])


# ------------------------------------------------------------------------- through the console script
def tiny(model_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["task=env", "task.env=guess_env:Guess", "model=local", f"model.path={model_dir}",
            f"model.device={TEST_DEVICE}", "logger=none", f"hydra.run.dir={run_dir}", "algo.sampling.max_new_tokens=4",
            "algo.lora.r=4", "algo.lora.target_modules=[q_proj,v_proj]", "trainer.max_steps=1",
            "trainer.eval_max_problems=1", "trainer.export_agents=false", "algo.num_turns=2", *extra]


def marl_llm(args: list[str], log: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": pythonpath(TESTS)}
    if log is not None:
        env["GUESS_LOG"] = str(log)
    return subprocess.run([str(VENV_BIN / "marl-llm"), *args], capture_output=True, text=True, timeout=300, env=env)


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("algo,extra", [
    ("magrpo", ["algo.num_generations=2", "trainer.prompts_per_step=2"]),
    ("at_grpo", ["algo.num_branches=2", "trainer.prompts_per_step=2", "task.env_kwargs.role_bonus=10.0"]),
    ("collm_cc", ["trainer.prompts_per_step=2"]),
    ("collm_dc", ["trainer.prompts_per_step=2"]),
])
def test_an_environment_trains_with_every_algorithm_family(algo, extra, tiny_model_dir, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "steps.jsonl"
    out = marl_llm([f"algo={algo}", *tiny(tiny_model_dir, run_dir, *extra)], log)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metric_rows(run_dir)
    train = next(r for r in rows if "train/reward" in r)
    assert {"train/rewards/found/mean", "train/rewards/close/mean"} <= set(train)  # the env's reward levels
    assert "eval/success_rate" in rows[-1] and "eval/reward" in rows[-1]  # info["success"] on the eval seeds
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    train_steps = [s for s in steps if s["seed"] < 100000]  # evaluation plays the seeds from 100000
    assert any(s["seed"] >= 100000 for s in steps)
    assert {s["turn"] for s in train_steps} <= {1, 2} and all(s["agents"] == ["guesser", "helper"] for s in steps)
    first, second = (sum(s["turn"] == t for s in train_steps) for t in (1, 2))
    if algo == "magrpo":  # the tree: 2 problems x G=2 joint actions, then each forked again (G^2 per problem)
        assert first == 4 and second <= 8 and second % 2 == 0
    elif algo == "at_grpo":  # K=2 joint actions per turn, the best continued
        assert first == 4 and second <= 4
        # role rewards: each agent's candidates score alpha * team + its own reward (the guesser's +10,
        # each agent's closeness in [0, 1]; the team reward is the same for both)
        assert 9.0 <= train["train/guesser/reward_mixed"] - train["train/helper/reward_mixed"] <= 11.0
    else:  # one trajectory per environment
        assert first == 2 and second <= 2


def test_a_broken_environment_stops_the_console_script_with_one_line(tiny_model_dir, tmp_path):
    out = marl_llm(["algo=magrpo", "task.env_kwargs.mode=step_raises",
                    *tiny(tiny_model_dir, tmp_path / "run", "algo.num_generations=2", "trainer.eval_before=false")])
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    assert "task.env=guess_env:Guess: step() at turn 1 of the episode of seed" in line
    assert "raised ValueError: the referee is out to lunch" in line
    early = marl_llm(["algo=magrpo", "task.env_kwargs.mode=reset_one_observation",
                      *tiny(tiny_model_dir, tmp_path / "run2")])
    assert early.returncode == 2 and "Traceback" not in early.stderr
    assert "reset(seed=0) returned 1 observations for 2 agents (guesser, helper)" in early.stderr


def test_the_python_api_trains_in_an_environment_class(tiny_model_dir, tmp_path):
    """marl_llm.train_team(env=...): a class defined here (not importable: kept in the process)."""
    import marl_llm

    steps = []

    class Countdown:
        """One agent counts down; the team scores 1 per turn while it answers with any digit."""

        agents = ["counter"]

        def __init__(self, start=3):
            self.start = start

        def reset(self, seed):
            self.left = self.start + seed % 2
            return [f"Count down from {self.left}."]

        def step(self, actions):
            steps.append(actions)
            self.left -= 1
            said = actions["counter"]
            return ([f"Now from {self.left}."], None, float(any(ch.isdigit() for ch in said)), self.left <= 0)

    result = marl_llm.train_team(
        env=Countdown, env_kwargs={"start": 5},
        overrides=["model=local", f"model.path={tiny_model_dir}", f"model.device={TEST_DEVICE}", "logger=none",
                   f"run_dir={tmp_path / 'run'}", "algo.num_generations=2", "algo.num_turns=2",
                   "algo.sampling.max_new_tokens=4", "algo.lora.r=4", "algo.lora.target_modules=[q_proj,v_proj]",
                   "trainer.max_steps=1", "trainer.eval_max_problems=1", "trainer.export_agents=false"])
    cfg = (result.run_dir / "config.yaml").read_text()
    assert "env: '@env-" in cfg and "start: 5" in cfg
    assert steps and all(set(a) == {"counter"} for a in steps)
    assert "train/reward" in next(r for r in result.metrics() if "train/reward" in r)
    with pytest.raises(UserError, match="either env"):
        marl_llm.train_team([{"a": 1}], env=Countdown)
