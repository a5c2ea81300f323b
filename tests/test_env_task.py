"""task=env: a user's multi-turn environment (reset/step, no subclassing) trains with every algorithm
family through the console script; broken environments stop with one line naming the method.

The environment is tests/guess_env.py (a number-guessing game with feedback, written for these tests).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import IMPORT_TIMES, TEST_DEVICE, VENV_BIN, compose_config, imported_modules, pythonpath
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
    assert [(r["seed"], r["turn"]) for r in log if r["dry"]] == [(0, 1), (0, 2), (0, 2)]  # building the task
    log = [r for r in log if not r["dry"]]
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
     r"Guess.reset\(seed=0\) \(tests/guess_env.py:\d+\) in the dry run before training returned 1 observations for "
     r"2 agents \(guesser, helper\)"),
    # keyword arguments the class does not take: its own parameters and file:line, not marl-llm's
    (["+task.env_kwargs.nope=1"], r"task.env_kwargs=\{'nope': 1\} do not fit Guess\(high, role_bonus, mode\) at "
                                  r"tests/guess_env.py:\d+: got an unexpected keyword argument 'nope'"),
    # the dry run: a step that breaks stops the build, naming the class, the method, the agent, file:line
    (["task.env_kwargs.mode=step_text_reward"],
     r"Guess.step\(\) \(tests/guess_env.py:\d+\) at turn 1 of the episode of seed 0 in the dry run before training, "
     r"with placeholder actions, returned the reward 'high' for agent helper: a reward is a finite number"),
    (["task.env_kwargs.mode=step_raises"], r"Guess.step\(\) at turn 1 of the episode of seed 0 in the dry run before "
                                           r"training, with placeholder actions, raised ValueError: the referee is out "
                                           r"to lunch at tests/guess_env.py:\d+: fix the environment"),
    (["task.env=collections:OrderedDict"], r"OrderedDict has no reset\(\) method: an environment needs reset\(seed\)"),
    (["task.env=guess_env:Unnamed"], r"name the agents, as task.agents=\[a,b\]"),
    # its observations are keyed by other names
    (["task.env=guess_env:Unnamed", "task.agents=[x,y]"],
     r"Unnamed.reset\(seed=0\) \(.*\) in the dry run before training returned no observation for agent x "
     r"\(agents: x, y\)"),
])
def test_the_class_is_named_as_module_class_and_checked_before_models_load(overrides, message):
    with pytest.raises(UserError, match=message):
        env_task(*overrides)


@pytest.mark.parametrize("mode,message", [
    ("late_step_text_reward", r"Guess.step\(\) \(tests/guess_env.py:\d+\) at turn 1 of the episode of seed 0 returned "
                              r"the reward 'high' for agent helper: a reward is a finite number"),
    ("late_step_raises", r"Guess.step\(\) at turn 1 of the episode of seed 0 raised ValueError: the referee is out to "
                         r"lunch at .*guess_env.py:\d+: fix the environment"),
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


# --------------------------------------------------------------------------------- the dry run
class Recording:
    """Two agents; records every call, as (method, the object's id, argument), in `calls`."""

    agents = ["a", "b"]
    calls: list = []

    def __init__(self, break_at: str = ""):
        self.break_at = break_at

    def reset(self, seed):
        self.calls.append(("reset", id(self), seed))
        self.turn = 0
        return ["start", "start"]

    def step(self, actions):
        self.turn += 1
        self.calls.append(("step", id(self), dict(actions)))
        if self.break_at == f"turn {self.turn}":
            return ["only one"], None, 0.0, False
        return ["next", "next"], None, 0.0, False

    def __deepcopy__(self, memo):
        self.calls.append(("copy", id(self), None))
        if self.break_at == "copy":
            raise RuntimeError("holds a socket")
        if self.break_at == "copy_is_self":
            return self
        twin = Recording(self.break_at)
        twin.turn = self.turn
        return twin


def test_building_the_task_tries_the_environment_dry_reset_step_fork_step():
    """Before any model loads: reset(0), a step with placeholder actions for every agent, a deepcopy (the
    tree's fork), and a second step of the copy and of the original."""
    import test_env_task as here
    from marl_llm.tasks.env import DRY_RUN_ACTION

    Recording.calls = []
    env_task("task.env=test_env_task:Recording")
    calls = Recording.calls
    assert [c[0] for c in calls] == ["reset", "step", "copy", "step", "step"]
    original = calls[0][1]
    assert calls[0][2] == 0 and calls[1][1] == original and calls[2][1] == original
    assert {calls[3][1], calls[4][1]} == {original, calls[3][1]} and calls[3][1] != original  # the copy, then it
    assert calls[1][2] == {"a": DRY_RUN_ACTION, "b": DRY_RUN_ACTION}
    assert here.Recording is Recording


@pytest.mark.parametrize("break_at,message", [
    # only the second step breaks: one step would not have found it
    ("turn 2", r"Recording.step\(\) \(.*test_env_task.py:\d+\) at turn 2 of the episode of seed 0 in the dry run "
               r"before training, with placeholder actions, returned 1 observations for 2 agents"),
    ("copy", r"copy.deepcopy of Recording \(seed 0, in the dry run before training\) raised RuntimeError: holds a "
             r"socket at .*test_env_task.py:\d+: a rollout tree copies the environment"),
    ("copy_is_self", r"copy.deepcopy of Recording returned the same object \(.*test_env_task.py:\d+\): the copies of "
                     r"a rollout tree would share one episode"),
])
def test_the_dry_run_finds_what_a_first_step_alone_would_not(break_at, message):
    with pytest.raises(UserError, match=message):
        env_task("task.env=test_env_task:Recording", f"+task.env_kwargs.break_at='{break_at}'")


# ------------------------------------------------------------------------- PettingZoo's parallel API
class Parallel:
    """PettingZoo's parallel API without pettingzoo: dicts by agent, (observations, infos) from reset."""

    possible_agents = ["x", "y"]
    rewards = {"x": 1.0, "y": 0.0}

    def reset(self, seed=None, options=None):
        self.agents = list(self.possible_agents)
        return {a: f"seed {seed}" for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions):
        over = {a: "stop" in actions[a] for a in self.agents}
        return ({a: f"you said {actions[a]}" for a in self.agents}, dict(self.rewards), over,
                {a: False for a in self.agents}, {a: {"success": all(over.values())} for a in self.agents})


@pytest.mark.parametrize("team,total", [("mean", 0.5), ("sum", 1.0)])
def test_a_pettingzoo_parallel_environment_is_read_as_pettingzoo(team, total):
    task = env_task("task.env=test_env_task:Parallel", f"task.pettingzoo_team_reward={team}")
    problem = task.load_split("train")[2]
    assert task.initial_prompts(problem) == ["seed 2", "seed 2"]
    go, stop = task.history_rewards([problem] * 2, [[[Turn("p", "go")], [Turn("p", "go")]],
                                                    [[Turn("p", "stop")], [Turn("p", "go")]]])
    assert (go.total, go.local, go.done, go.passed, go.levels) == (total, [1.0, 0.0], False, False, {})
    assert go.info["observations"] == ["you said go", "you said go"]
    assert stop.done and stop.passed is False  # one agent's termination ends the episode for all


def test_pettingzoo_returns_are_checked_by_agent():
    task = env_task("task.env=test_env_task:Parallel")
    problem = task.load_split("train")[0]
    bad = {"terminations": (({"x": "a", "y": "b"}, {"x": 1, "y": 0}, {"x": "no", "y": False}, {"x": False, "y": False},
                              {"x": {}, "y": {}}), r"returned the termination 'no' for agent x: give True or False"),
           "missing": (({"x": "a", "y": "b"}, {"x": 1}, {"x": False, "y": False}, {"x": False, "y": False},
                        {"x": {}, "y": {}}), r"returned no reward for agent y"),
           "infos": (({"x": "a", "y": "b"}, {"x": 1, "y": 0}, {"x": False, "y": False}, {"x": False, "y": False},
                      {"x": 3}), r"returned infos that are not a dict of dicts by agent")}
    for name, (out, message) in bad.items():
        task.make = lambda out=out: type("E", (), {"reset": lambda self, s: ["a", "b"], "step": lambda self, a: out})()
        with pytest.raises(UserError, match=message):
            task.history_rewards([problem], [[[Turn("p", "4")], [Turn("p", "5")]]])


@pytest.fixture
def pettingzoo(monkeypatch):
    """A stand-in `pettingzoo` module (the package is no dependency): its two base classes."""
    import sys
    import types

    module = types.ModuleType("pettingzoo")
    module.ParallelEnv = type("ParallelEnv", (), {})
    module.AECEnv = type("AECEnv", (), {})
    monkeypatch.setitem(sys.modules, "pettingzoo", module)
    return module


def test_a_pettingzoo_env_that_returns_the_projects_shape_or_acts_in_turn_is_refused_by_name(pettingzoo, monkeypatch):
    import test_env_task as here

    own_shape = type("OwnShape", (pettingzoo.ParallelEnv,), {
        "possible_agents": ["x", "y"], "reset": lambda self, seed=None, options=None: ({"x": "a", "y": "b"}, {}),
        "step": lambda self, actions: ({"x": "a", "y": "b"}, None, 1.0, False)})
    in_turn = type("InTurn", (pettingzoo.AECEnv,), {"possible_agents": ["x"], "reset": lambda self, seed=None: None,
                                                     "step": lambda self, action: None})
    monkeypatch.setattr(here, "OwnShape", own_shape, raising=False)
    monkeypatch.setattr(here, "InTurn", in_turn, raising=False)
    with pytest.raises(UserError, match=r"OwnShape.step\(\) .* returned tuple of 4: .* or PettingZoo's \(observations, "
                                        r"rewards, terminations, truncations, infos\) with dicts by agent"):
        env_task("task.env=test_env_task:OwnShape")
    with pytest.raises(UserError, match=r"InTurn is a PettingZoo AEC environment \(agents act in turn\); task=env "
                                        r"plays the parallel API.*aec_to_parallel"):
        env_task("task.env=test_env_task:InTurn")


# ----------------------------------------------------------------------------- the observation cap
def test_a_long_observation_is_cut_to_the_token_cap_with_a_marker_and_counted(caplog):
    from transformers import AutoTokenizer

    from marl_llm.models.loading import embedded_checkpoint
    from marl_llm.tasks.env import TRUNCATION_MARKER

    tok = AutoTokenizer.from_pretrained(embedded_checkpoint())
    task = env_task("task.env_kwargs.mode=long_step", "task.max_observation_tokens=64")
    assert task.take_metrics() == {}  # the dry run is not counted
    task.use_tokenizers([tok, tok])
    problem = task.load_split("train")[0]
    first = task.initial_prompts(problem)
    with caplog.at_level("WARNING", logger="marl_llm"):
        reward, = task.history_rewards([problem], [[[Turn(first[0], "1")], [Turn(first[1], "2")]]])
    guesser, helper = reward.info["observations"]
    assert "observation cut here" not in guesser and helper.endswith(TRUNCATION_MARKER.format(cap=64))
    assert helper.startswith("word word") and len(tok(helper, add_special_tokens=False)["input_ids"]) <= 64 + 2
    assert task.take_metrics() == {"observations/clipped_ratio": 0.25, "guesser/observations/clipped_ratio": 0.0,
                                   "helper/observations/clipped_ratio": 0.5}
    assert task.take_metrics() == {}  # each call: what came since the last
    said = [r.getMessage() for r in caplog.records if "max_observation_tokens" in r.getMessage()]
    assert len(said) == 1 and "for agent helper: cut to task.max_observation_tokens=64" in said[0]


def test_the_memory_plan_budgets_env_prompts_by_the_cap():
    from marl_llm.distributed.memory_plan import CHAT_TEMPLATE_TOKENS, workload

    def planned(*overrides):
        cfg = compose_config(["task=env", "task.env=guess_env:Guess", "run_dir=/tmp/x", *overrides])
        return workload(cfg, ("guesser", "helper"), "cuda").prompt_tokens

    assert planned() == 1024 + CHAT_TEMPLATE_TOKENS
    assert planned("task.max_observation_tokens=8000", "plan.prompt_tokens=100") == 8000 + CHAT_TEMPLATE_TOKENS
    other = compose_config(["task=tldr", "plan.prompt_tokens=700", "run_dir=/tmp/x"])
    assert workload(other, ("a", "b"), "cuda").prompt_tokens == 700  # the other tasks: plan.prompt_tokens


# ------------------------------------------------------------------------------------ run names
def test_runs_of_different_environments_are_named_by_their_class():
    from marl_llm.runs.loggers import run_identity

    def identity(*overrides):
        return run_identity(compose_config(["task=env", "run_dir=/tmp/x", "logger=wandb", *overrides]))

    names = {spec: identity(f"task.env={spec}") for spec in ("guess_env:Guess", "guess_env:Unnamed",
                                                             "test_env_task:Parallel")}
    assert [n["name"].split("-")[1] for n in names.values()] == ["Guess", "Unnamed", "Parallel"]
    assert "task:Guess" in names["guess_env:Guess"]["tags"] and not any("task:env" in n["tags"] for n in names.values())
    assert len({n["group"].rsplit("-", 1)[0] for n in names.values()}) == 3
    mine = identity("task.env=guess_env:Guess", "task.label=guessing")
    assert mine["name"].startswith("magrpo-guessing-") and "task:guessing" in mine["tags"]


# ------------------------------------------------------------------------------ docs/extending.md
def doc_module(name: str, where: Path) -> Path:
    """The python block of docs/extending.md that starts `# <name>.py`, written to where/<name>.py."""
    text = (TESTS.parent / "docs" / "extending.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.startswith(f"# {name}.py"))
    (where / f"{name}.py").write_text(block)
    return where / f"{name}.py"


@pytest.mark.parametrize("spec,texts,team,feedback", [
    ("my_games:Guess", {1: ["0", "none"], 2: ["0", "0"]}, None, "Last turn guesser: "),
    # the joint actions (red, green) and (blue, red): no meeting, the episodes go on
    ("my_pz_games:Meet", {1: ["red", "blue", "green"], 2: ["red"]}, 0.0, "Last turn you said "),
])
def test_the_docs_environments_build_dry_and_play_a_forked_tree(spec, texts, team, feedback, tmp_path, monkeypatch):
    """Both complete examples of docs/extending.md, pasted as a reader would: the config composes and
    validates, the task's dry run passes, and a G=2 tree over 2 turns forks and steps them."""
    from marl_llm.configure import validate

    module = spec.split(":")[0]
    doc_module(module, tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, module, raising=False)
    cfg = compose_config(["task=env", f"task.env={spec}", "run_dir=/tmp/x", "algo.num_turns=2"])
    validate(cfg)
    task = build_task(cfg.task)
    generate, calls = scripted(texts)
    tree = collect_tree(task, generate, task.load_split("train")[:1], [2, 2], [SamplingParams()] * 2)
    assert [len(t) for t in tree.turns] == [2, 4] and calls == [4, 8]
    assert all(feedback in n.messages[0] and feedback in n.messages[1] for n in tree.turns[1])
    if team is not None:
        assert all(n.reward.total == team and n.reward.passed is False for n in tree.turns[0])


def test_the_docs_error_example_names_the_line_it_shows(tmp_path, monkeypatch):
    """docs/extending.md quotes the one line of its Guess with a text reward, and of a misspelt keyword."""
    path = doc_module("my_games", tmp_path)
    lines = path.read_text().splitlines()
    step = next(i for i, line in enumerate(lines, 1) if "def step" in line)
    init = next(i for i, line in enumerate(lines, 1) if "def __init__" in line)
    path.write_text(path.read_text().replace("return observations, close,", "close['helper'] = 'high'\n"
                                             "        return observations, close,"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "my_games", raising=False)
    monkeypatch.chdir(tmp_path)
    doc = (TESTS.parent / "docs" / "extending.md").read_text()
    with pytest.raises(UserError) as err:
        env_task("task.env=my_games:Guess")
    shown = re.search(r"\(`(Guess.step\(\)\s+\(my_games.py:\d+\).*?)`\)", doc, re.S).group(1)
    assert f"(my_games.py:{step})" in str(err.value) and " ".join(shown.split()) in str(err.value)
    with pytest.raises(UserError) as err:
        env_task("task.env=my_games:Guess", "+task.env_kwargs.hihg=50")
    shown = re.search(r"`(task.env_kwargs=\{'hihg': 50\} do not fit\s+Guess\(high\) at my_games.py:\d+)`", doc).group(1)
    assert f"my_games.py:{init}" in shown and " ".join(shown.split()) in str(err.value)


# ------------------------------------------------------------------------- through the console script
def tiny(model_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["task=env", "task.env=guess_env:Guess", "model=local", f"model.path={model_dir}",
            f"model.device={TEST_DEVICE}", "logger=none", f"hydra.run.dir={run_dir}", "algo.sampling.max_new_tokens=4",
            "algo.lora.r=4", "algo.lora.target_modules=[q_proj,v_proj]", "trainer.max_steps=1",
            "trainer.eval_max_problems=1", "trainer.export_agents=false", "algo.num_turns=2", *extra]


def marl_llm(args: list[str], log: Path | None = None,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": pythonpath(TESTS), **(env or {})}
    if log is not None:
        env["GUESS_LOG"] = str(log)
    return subprocess.run([str(VENV_BIN / "marl-llm"), *args], capture_output=True, text=True, timeout=300, env=env)


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("algo,extra", [
    ("magrpo", ["algo.num_generations=2", "trainer.prompts_per_step=2"]),
    ("at_grpo", ["algo.num_branches=2", "trainer.prompts_per_step=2", "task.env_kwargs.role_bonus=10.0"]),
    # the helper's observations are 3,000 words: cut to 64 tokens (the guesser's are not)
    ("collm_cc", ["trainer.prompts_per_step=2", "task.env_kwargs.mode=long_step", "task.max_observation_tokens=64"]),
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
    steps = [s for s in map(json.loads, log.read_text().splitlines()) if not s["dry"]]  # building the task's: 3
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
    assert train["train/guesser/observations/clipped_ratio"] == 0.0
    assert train["train/helper/observations/clipped_ratio"] > 0.0 if algo == "collm_cc" else \
        train["train/observations/clipped_ratio"] == 0.0


def test_a_broken_environment_stops_the_console_script_with_one_line(tiny_model_dir, tmp_path):
    """A step that raises on a model's text (the dry run's placeholders pass): one line during training."""
    out = marl_llm(["algo=magrpo", "task.env_kwargs.mode=late_step_raises",
                    *tiny(tiny_model_dir, tmp_path / "run", "algo.num_generations=2", "trainer.eval_before=false")])
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    assert "task.env=guess_env:Guess: Guess.step() at turn 1 of the episode of seed" in line
    assert "raised ValueError: the referee is out to lunch" in line and "dry run" not in line
    early = marl_llm(["algo=magrpo", "task.env_kwargs.mode=reset_one_observation",
                      *tiny(tiny_model_dir, tmp_path / "run2")])
    assert early.returncode == 2 and "Traceback" not in early.stderr
    assert "Guess.reset(seed=0) (" in early.stderr and "guess_env.py:" in early.stderr
    assert "in the dry run before training returned 1 observations for 2 agents (guesser, helper)" in early.stderr
    assert not (tmp_path / "run2").exists()  # refused before the run started (and any model loaded)


@pytest.mark.parametrize("overrides,line", [
    (["task.env=no_such_games:Guess"], "error: task.env=no_such_games:Guess: cannot import 'no_such_games' (No module "
                                       "named 'no_such_games'): install it or put its directory on PYTHONPATH"),
    (["task.env=collections:OrderedDict"],
     "error: task.env=collections:OrderedDict: OrderedDict has no reset() method: an environment needs reset(seed) and "
     "step(actions) (docs/extending.md)"),
    (["task.env_kwargs.mode=step_three_values"],
     "error: task.env=guess_env:Guess: Guess.step() ({file}:{step}) at turn 1 of the episode of seed 0 in the dry "
     "run before training, with placeholder actions, returned tuple of 3: return a tuple (observations, rewards, "
     "team_reward, done), the same with an info dict last, or PettingZoo's (observations, rewards, terminations, "
     "truncations, infos) with dicts by agent"),
    (["+task.env_kwargs.nope=1"], "error: task.env=guess_env:Guess: task.env_kwargs={{'nope': 1}} do not fit "
                                  "Guess(high, role_bonus, mode) at {file}:{init}: got an unexpected keyword "
                                  "argument 'nope'; change task.env_kwargs"),
])
def test_a_broken_environment_is_refused_before_torch_is_imported(overrides, line, tmp_path):
    """The environment is imported, built and tried dry before the console script imports the
    trainer (marl_llm/preflight.py): the same one line as the trainer's, in a second, not ~5 s."""
    import inspect

    import guess_env

    step, init = (inspect.getsourcelines(f)[1] for f in (guess_env.Guess.step, guess_env.Guess.__init__))
    file = os.path.relpath(guess_env.__file__)  # as the line shows it: relative to the working directory, inside it
    file = guess_env.__file__ if file.startswith("..") else file
    run_dir = tmp_path / "run"
    imported, out = imported_modules(marl_llm(["task=env", "task.env=guess_env:Guess", "logger=none",
                                               f"hydra.run.dir={run_dir}", *overrides], env=IMPORT_TIMES))
    expected = line.format(file=file, step=step, init=init)
    assert out.returncode == 2 and out.stderr.strip() == expected, out.stderr[-3000:]
    assert "omegaconf" in imported and "torch" not in imported and "transformers" not in imported
    assert not run_dir.exists()


def test_the_python_api_trains_in_an_environment_class(tiny_model_dir, tmp_path):
    """marl_llm.train_team(env=...): the PettingZoo-style example of docs/extending.md, as a class defined
    here (not importable: kept in the process), trains; the run is named by the class."""
    import marl_llm

    steps = []
    namespace = {"__name__": "pasted"}
    exec(doc_module("my_pz_games", tmp_path).read_text(), namespace)

    class Meeting(namespace["Meet"]):
        def step(self, actions):
            steps.append(actions)
            return super().step(actions)

    result = marl_llm.train_team(
        env=Meeting,
        overrides=["model=local", f"model.path={tiny_model_dir}", f"model.device={TEST_DEVICE}", "logger=none",
                   f"run_dir={tmp_path / 'run'}", "algo.num_generations=2", "algo.num_turns=2",
                   "algo.sampling.max_new_tokens=4", "algo.lora.r=4", "algo.lora.target_modules=[q_proj,v_proj]",
                   "trainer.max_steps=1", "trainer.eval_max_problems=1", "trainer.export_agents=false"])
    cfg = (result.run_dir / "config.yaml").read_text()
    assert "env: '@env-" in cfg and "label: Meeting" in cfg
    assert "magrpo on Meeting: agents left, right" in (result.run_dir / "cli.log").read_text()
    assert steps and all(set(a) == {"left", "right"} for a in steps)
    train = next(r for r in result.metrics() if "train/reward" in r)
    assert 0.0 <= train["train/reward"] <= 1.0 and train["train/observations/clipped_ratio"] == 0.0
    with pytest.raises(UserError, match="either env"):
        marl_llm.train_team([{"a": 1}], env=Meeting)
