"""Extending marl-llm without touching src/: what a user does, as a user does it.

A package in a temp dir defines a task (with its own schema, reward and YAML); another defines an
advantage baseline; another an algorithm. They run through the installed console script (found
through `plugins=` and through a `marl_llm.plugins` entry point) and through the Python API.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import IMPORT_TIMES, TEST_DEVICE, VENV_BIN, compose_config, imported_modules, pythonpath

REPO = Path(__file__).resolve().parents[1]

TASK_MODULE = '''
"""A user's task: two agents each say a word; the team scores when both say the row's word."""
from dataclasses import dataclass, field
from pathlib import Path

from marl_llm.config import DataConfig, check_value
from marl_llm.tasks import JointReward, Task, register_task

CONFIG_SEARCHPATH = "file://" + str(Path(__file__).parent / "conf")


@dataclass
class EchoTaskConfig:
    name: str = "echo"
    data: DataConfig = field(default_factory=lambda: DataConfig(source="files", train_split="train",
                                                                eval_split="test"))
    bonus: float = 1.0

    @staticmethod
    def check(cfg):
        check_value(cfg.task.bonus > 0, "task.bonus", "must be > 0")


@register_task("echo", schema=EchoTaskConfig)
class EchoTask(Task):
    agent_names = ("left", "right")
    required_fields = ("word",)

    def initial_prompts(self, problem):
        return [f"Say {problem.data['word']}.", f"Repeat {problem.data['word']}."]

    def joint_rewards(self, problems, joint_actions):
        out = []
        for p, actions in zip(problems, joint_actions):
            hits = {f"agent{i}": float(p.data["word"] in a) for i, a in enumerate(actions)}
            out.append(JointReward(total=sum(hits.values()) * self.cfg.bonus, levels=hits))
        return out
'''

TASK_YAML = '''
defaults:
  - echo_schema
  - _self_

name: echo
bonus: 2.0
'''

BASELINE_MODULE = '''
"""A user's advantage baseline: the group's median; it notes each call in $BASELINE_CALLS."""
import os

from marl_llm.registry import register_baseline


@register_baseline("median")
def median_baseline(values, groups):
    with open(os.environ["BASELINE_CALLS"], "a") as f:
        f.write(f"{len(values)}\\n")
    out = values.clone()
    for g in range(int(groups.ids.max()) + 1):
        members = groups.ids == g
        out[members] = values[members] - values[members].median()
    return out
'''


def write_rows(path: Path, words: list[str]) -> Path:
    path.write_text("".join(json.dumps({"word": w}) + "\n" for w in words))
    return path


@pytest.fixture()
def user_dir(tmp_path: Path) -> Path:
    """What a user has: a directory (not installed) with a task package and its YAML, and data."""
    pkg = tmp_path / "user" / "echo_task"
    (pkg / "conf" / "task").mkdir(parents=True)
    (pkg / "__init__.py").write_text(TASK_MODULE)
    (pkg / "conf" / "task" / "echo.yaml").write_text(TASK_YAML)
    write_rows(tmp_path / "train.jsonl", ["apple", "pear", "plum", "fig"])
    write_rows(tmp_path / "test.jsonl", ["kiwi", "lime"])
    return tmp_path


def tiny(model_dir: Path, run_dir: Path) -> list[str]:
    """One tiny step and no held-out evaluation (these tests check what the plugins reach in
    training; marl-llm-eval on a plugin task's run is checked on its own)."""
    return ["model=local", f"model.path={model_dir}", f"model.device={TEST_DEVICE}", "logger=none",
            f"hydra.run.dir={run_dir}", "algo.num_generations=2", "algo.num_turns=1", "algo.sampling.max_new_tokens=4",
            "algo.lora.r=4", "algo.lora.target_modules=[q_proj,v_proj]", "trainer.max_steps=1",
            "trainer.eval_max_problems=1", "trainer.eval_before=false", "trainer.eval_after=false",
            "trainer.export_agents=false"]


def marl_llm(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "marl-llm"), *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env={**os.environ, **env, **({"PYTHONPATH": pythonpath(env["PYTHONPATH"])}
                                                                  if "PYTHONPATH" in env else {})})


def test_a_task_of_your_own_runs_through_the_console_script(user_dir, tiny_model_dir):
    """plugins=[module] loads the task; its YAML comes from the search path the module declares; its
    schema types the data-file override (a map key) and its check runs; the reward is its own."""
    run_dir = user_dir / "run"
    args = ["plugins=[echo_task]", "task=echo", f"task.data.files.train={user_dir / 'train.jsonl'}",
            f"task.data.files.test={user_dir / 'test.jsonl'}", *tiny(tiny_model_dir, run_dir)]
    env = {"PYTHONPATH": str(user_dir / "user")}
    out = marl_llm(args, env, user_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = (run_dir / "config.yaml").read_text()
    assert "name: echo" in cfg and "bonus: 2.0" in cfg and "plugins:\n- echo_task" in cfg
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = next(r for r in steps if "train/reward" in r)
    assert {"train/rewards/agent0/mean", "train/rewards/agent1/mean"} <= set(train)  # the task's own levels
    # marl-llm-eval reads the plugins from the run's config.yaml.
    evals = subprocess.run([str(VENV_BIN / "marl-llm-eval"), str(run_dir)], capture_output=True, text=True,
                           timeout=300, cwd=user_dir, env={**os.environ, **env})
    assert evals.returncode == 0, evals.stderr[-3000:]
    assert list((run_dir / "evals").iterdir())
    # The schema's check runs before anything loads, and names the key.
    bad = marl_llm(["plugins=[echo_task]", "task=echo", "task.bonus=0", *tiny(tiny_model_dir, user_dir / "bad")],
                   env, user_dir)
    assert bad.returncode == 2 and "task.bonus" in bad.stderr and "Traceback" not in bad.stderr
    # A misspelled key of the plugin's schema gets the valid keys, like a built-in task's.
    typo = marl_llm(["plugins=[echo_task]", "task=echo", "task.bonsu=3", "--cfg", "job"], env, user_dir)
    assert typo.returncode == 2 and "Did you mean task.bonus" in typo.stderr


ALGO_MODULE = '''
"""A user's algorithm: MAGRPO whose advantages are scaled by a factor of its own config."""
from dataclasses import dataclass
from pathlib import Path

from marl_llm.algos import register_algorithm
from marl_llm.algos.magrpo import MAGRPO, MAGRPOConfig
from marl_llm.config import check_value

CONFIG_SEARCHPATH = "file://" + str(Path(__file__).parent / "conf")


@dataclass
class ScaledConfig(MAGRPOConfig):
    name: str = "scaled_magrpo"
    scale: float = 0.5

    @staticmethod
    def check(cfg):
        MAGRPOConfig.check(cfg)
        check_value(cfg.algo.scale > 0, "algo.scale", "must be > 0")


@register_algorithm("scaled_magrpo", schema=ScaledConfig)
class ScaledMAGRPO(MAGRPO):
    def advantages(self, tree):
        batches = super().advantages(tree)
        for b in batches:
            b.advantages = b.advantages * self.cfg.scale
        Path(__file__).with_name("used").write_text(str(self.cfg.scale))
        return batches
'''


def test_an_algorithm_of_your_own_runs_through_the_console_script(tmp_path, tiny_model_dir):
    pkg = tmp_path / "user" / "scaled_algo"
    (pkg / "conf" / "algo").mkdir(parents=True)
    (pkg / "__init__.py").write_text(ALGO_MODULE)
    (pkg / "conf" / "algo" / "scaled_magrpo.yaml").write_text("defaults:\n  - scaled_magrpo_schema\n  - _self_\n\n"
                                                             "name: scaled_magrpo\nscale: 0.25\n")
    env = {"PYTHONPATH": str(tmp_path / "user")}
    out = marl_llm(["plugins=[scaled_algo]", "algo=scaled_magrpo", "task.data.train_split='test[33:35]'",
                    "trainer.eval_before=false", *tiny(tiny_model_dir, tmp_path / "run")], env, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (pkg / "used").read_text() == "0.25"  # the YAML's value reached the algorithm
    for setting, key in (("algo.scale=-1", "algo.scale"), ("algo.num_generations=1", "algo.num_generations")):
        bad = marl_llm(["plugins=[scaled_algo]", "algo=scaled_magrpo", setting, "logger=none",
                        f"hydra.run.dir={tmp_path / key}"], env, tmp_path)
        assert bad.returncode == 2 and f"invalid config value {key}" in bad.stderr  # its check, and MAGRPO's


def test_a_plugin_that_is_not_importable_gets_one_line(user_dir):
    out = marl_llm(["plugins=[no_such_module]", "task=echo", "--cfg", "job"], {}, user_dir)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "no module named 'no_such_module'" in out.stderr and "PYTHONPATH" in out.stderr


def pip_install(tmp_path: Path, name: str, files: dict[str, str], setuptools: str) -> Path:
    """A user's package (`files` by path, its pyproject's [tool.setuptools] section), declaring its
    module `name` in the marl_llm.plugins entry-point group, pip-installed into a dir of its own
    (not the venv): put it on PYTHONPATH to have it installed."""
    src = tmp_path / f"{name}_pkg"
    for path, text in files.items():
        (src / path).parent.mkdir(parents=True, exist_ok=True)
        (src / path).write_text(text)
    (src / "pyproject.toml").write_text(textwrap.dedent(f'''
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "{name.replace("_", "-")}"
        version = "0.1"
        [project.entry-points."marl_llm.plugins"]
        {name} = "{name}"
    ''') + textwrap.dedent(setuptools))
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(src)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr
    return site


@pytest.fixture(scope="module")
def median_site(tmp_path_factory) -> Path:
    """A user's package with a baseline, installed with pip."""
    return pip_install(tmp_path_factory.mktemp("median"), "median_baseline",
                       {"median_baseline/__init__.py": BASELINE_MODULE},
                       '''
                       [tool.setuptools]
                       packages = ["median_baseline"]
                       ''')


def test_an_installed_plugins_task_with_flags_after_the_overrides(tmp_path):
    """A plugin installed with pip whose YAML sits in a folder without __init__.py, named by
    pkg:// (Hydra warned on every command that it was not available): its task is listed by
    --help, and flags after the overrides work (the search path override added behind them had
    made argparse refuse it)."""
    module = TASK_MODULE.replace("echo", "headline").replace(
        'CONFIG_SEARCHPATH = "file://" + str(Path(__file__).parent / "conf")', 'CONFIG_SEARCHPATH = "pkg://headline.conf"')
    site = pip_install(tmp_path, "headline", {"headline/__init__.py": module,
                                              "headline/conf/task/headline.yaml": TASK_YAML.replace("echo", "headline")},
                       '''
                       [tool.setuptools]
                       packages = ["headline"]
                       [tool.setuptools.package-data]
                       headline = ["conf/task/*.yaml"]
                       ''')
    assert not (site / "headline" / "conf" / "__init__.py").exists()
    env = {"PYTHONPATH": str(site)}
    shown = marl_llm(["task=headline", "--help"], env, tmp_path)
    assert shown.returncode == 0, shown.stderr[-2000:]
    task_line = next(line for line in shown.stdout.splitlines() if line.startswith("task: "))
    assert "headline" in task_line.split(": ", 1)[1].split(", ") and "humaneval" in task_line
    for args in (["task=headline", "--cfg", "job"], ["algo=magrpo", "--cfg", "job"], ["--info", "searchpath"],
                 ["-cd", str(tmp_path), "task=headline", "--cfg", "job"]):
        out = marl_llm(args, env, tmp_path)
        assert out.returncode == 0 and "Traceback" not in out.stderr, (args, out.stderr[-2000:])
        assert "not available" not in out.stderr and "Warning" not in out.stderr, (args, out.stderr)
    assert "bonus: 2.0" in marl_llm(["task=headline", "--cfg", "job"], env, tmp_path).stdout


def test_a_baseline_of_your_own_from_an_installed_entry_point(median_site, tmp_path, tiny_model_dir):
    """A package installed with pip declares the module in the marl_llm.plugins entry-point group:
    algo.baseline=median then validates and trains with it, with no plugins= on the command line."""
    site = median_site
    calls = tmp_path / "calls.txt"
    run_dir = tmp_path / "run"
    out = marl_llm(["algo.baseline=median", "task.data.train_split='test[33:35]'", *tiny(tiny_model_dir, run_dir)],
                   {"PYTHONPATH": str(site), "BASELINE_CALLS": str(calls)}, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert calls.read_text().split() and "baseline: median" in (run_dir / "config.yaml").read_text()
    # Without the package, the name is refused with the registered ones listed.
    out = marl_llm(["algo.baseline=median", *tiny(tiny_model_dir, tmp_path / "run2")], {}, tmp_path)
    assert out.returncode == 2 and "'median' is not one of mean, rloo, max, raw" in out.stderr


def test_a_plugin_written_as_the_docs_baseline_and_loss_example_keeps_commands_light(tmp_path):
    """The docs' baseline and loss example (docs/extending.md, as it is written there) imports no
    torch: marl-llm imports every plugin to compose a config, so `--help`, a misspelled key and a
    bad value take what composing takes, not torch's seconds; its names are registered."""
    docs = (REPO / "docs" / "extending.md").read_text()
    section = docs[docs.index("## An advantage baseline or a policy loss"):]
    (tmp_path / "docs_baseline.py").write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    env = {"PYTHONPATH": str(tmp_path), **IMPORT_TIMES}
    for args, says in (
            (["--help"], "== Configuration groups =="),
            (["trainer.max_stepz=1"], "error: unknown config key trainer.max_stepz (TrainerConfig). Did you mean "
                                      "trainer.max_steps?"),
            (["algo.baseline=medain"], "error: invalid config value algo.baseline: 'medain' is not one of mean, rloo, "
                                       "max, raw, median"),
            (["algo.baseline=median", "algo.loss_type=bounded_reinfrce"],
             "error: invalid config value algo.loss_type: 'bounded_reinfrce' is not one of reinforce, ppo_clip, "
             "bounded_reinforce")):
        run = [] if "--help" in args else ["logger=none", f"hydra.run.dir={tmp_path / 'run'}"]
        imported, out = imported_modules(marl_llm(["plugins=[docs_baseline]", *args, *run], env, tmp_path))
        assert says in out.stdout + out.stderr, (args, out.stderr[-3000:])
        assert "hydra" in imported and "torch" not in imported and "transformers" not in imported, args


def test_registered_losses_are_selected_by_config_and_validation_reads_the_registries(tmp_path):
    import torch

    from marl_llm.algos.losses import POLICY_LOSSES, Surrogate, policy_loss, register_loss
    from marl_llm.algos.update import UpdateSettings
    from marl_llm.config import UserError
    from marl_llm.configure import validate

    with pytest.raises(UserError, match="algo.loss_type: 'bounded_reinforce' is not one of reinforce, ppo_clip"):
        validate(compose_config(["algo.loss_type=bounded_reinforce", f"run_dir={tmp_path}"]))
    calls = []
    try:
        @register_loss("bounded_reinforce")
        def bounded_reinforce(logp, old_logp, adv, eps_low, eps_high):
            calls.append(tuple(logp.shape))
            ratio = torch.exp(logp - old_logp)
            no = torch.zeros_like(ratio, dtype=torch.bool)
            return Surrogate(-adv.clamp(-1, 1)[:, None] * ratio, ratio, no, no)

        for algo in ("magrpo", "at_grpo", "collm_cc"):
            cfg = compose_config([f"algo={algo}", "algo.loss_type=bounded_reinforce", f"run_dir={tmp_path}"])
            validate(cfg)
            assert UpdateSettings.from_config(cfg.algo).loss_type == "bounded_reinforce"
        logp = torch.zeros(2, 3, requires_grad=True)
        loss, _ = policy_loss(logp, None, torch.tensor([5.0, -5.0]), torch.ones(2, 3), loss_type="bounded_reinforce")
        loss.backward()
        assert calls == [(2, 3)] and logp.grad.abs().max().item() <= 1.0  # the advantages were bounded
    finally:
        POLICY_LOSSES.pop("bounded_reinforce", None)


def test_the_python_api_trains_a_team_on_rows_with_a_reward_function(tmp_path, tiny_model_dir):
    """marl_llm.train_team: rows in memory, a prompt formatter and a joint reward (a closure: kept in the
    process); the run dir holds what the console script's does, and the rows it trained on."""
    import marl_llm

    seen = []

    def reward(row, completions):
        seen.append((row["topic"], len(completions)))
        return {"mentions": float(row["topic"] in completions[0]), "length": min(len(completions[1]), 10) / 10}

    rows = [{"topic": t} for t in ("tea", "rain", "salt")]
    run_dir = tmp_path / "team-run"
    result = marl_llm.train_team(
        rows, agents=["writer", "editor"], reward=reward,
        prompts=lambda row: {"writer": f"Write about {row['topic']}.", "editor": f"Edit a text on {row['topic']}."},
        eval_dataset=rows[:1],
        overrides=["model=local", f"model.path={tiny_model_dir}", f"model.device={TEST_DEVICE}", "logger=none",
                   f"run_dir={run_dir}", "algo.num_generations=2", "algo.sampling.max_new_tokens=4", "algo.lora.r=4",
                   "algo.lora.target_modules=[q_proj,v_proj]", "trainer.max_steps=1", "trainer.prompts_per_step=2"])
    assert result.run_dir == run_dir and (run_dir / "checkpoint.pt").is_file() and (run_dir / "agents").is_dir()
    assert {t for t, _ in seen} <= {"tea", "rain", "salt"} and {n for _, n in seen} == {2}
    train = next(r for r in result.metrics() if "train/reward" in r)
    assert {"train/rewards/mentions/mean", "train/rewards/length/mean"} <= set(train)
    assert [json.loads(line) for line in (run_dir / "data" / "train.jsonl").read_text().splitlines()] == rows
    assert "[marl-llm]" not in (run_dir / "cli.log").read_text() and "step 1/1" in (run_dir / "cli.log").read_text()
    assert result.score == pytest.approx(result.score) and "eval/reward" in result.metrics()[-1]


def test_the_python_api_runs_a_plugin_task_from_a_config(user_dir, tiny_model_dir, monkeypatch):
    """marl_llm.train(cfg) with a config composed like the console script's, plugin and all."""
    import marl_llm

    monkeypatch.syspath_prepend(str(user_dir / "user"))
    cfg = marl_llm.compose_config(["plugins=[echo_task]", "task=echo", f"task.data.files.train={user_dir / 'train.jsonl'}",
                                   f"task.data.files.test={user_dir / 'test.jsonl'}",
                                   *[o for o in tiny(tiny_model_dir, user_dir / "r") if not o.startswith("hydra.")],
                                   f"run_dir={user_dir / 'api-run'}"])
    result = marl_llm.train(cfg)
    assert result.run_dir == user_dir / "api-run" and (result.run_dir / "metrics.jsonl").is_file()
    assert any("train/rewards/agent0/mean" in r for r in result.metrics())


def test_the_python_api_trains_with_a_plugin_baseline(median_site, tmp_path, tiny_model_dir, monkeypatch):
    import marl_llm
    from marl_llm.algos.advantages import BASELINES, GROUP_BASELINES

    monkeypatch.syspath_prepend(str(median_site))
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("BASELINE_CALLS", str(calls))
    try:
        result = marl_llm.train(["plugins=[median_baseline]", "algo.baseline=median",
                                 "task.data.train_split='test[33:35]'", "trainer.eval_before=false",
                                 *[o for o in tiny(tiny_model_dir, tmp_path) if not o.startswith("hydra.")],
                                 f"run_dir={tmp_path / 'run'}"])
    finally:
        BASELINES.pop("median", None)
        GROUP_BASELINES.discard("median")
    assert calls.read_text().split() and any("train/reward" in r for r in result.metrics())


def test_a_team_task_from_the_command_line_names_its_functions(tmp_path, tiny_model_dir):
    """task=team with importable functions (module:function): the same run from the console script."""
    (tmp_path / "my_team.py").write_text(textwrap.dedent('''
        def prompts(row):
            return [f"Name a {row['kind']}.", f"Name another {row['kind']}."]

        def reward(row, texts):
            return float(len(set(texts)) == 2)
    '''))
    write_rows(tmp_path / "rows.jsonl", ["x"])
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"kind": k}) + "\n" for k in ("fruit", "tree")))
    run_dir = tmp_path / "run"
    out = marl_llm(["task=team", "task.agents=[a,b]", "task.prompts=my_team:prompts", "task.reward=my_team:reward",
                    f"task.data.files.train={tmp_path / 'rows.jsonl'}", "trainer.eval_before=false",
                    "trainer.eval_after=false", *tiny(tiny_model_dir, run_dir)], {"PYTHONPATH": str(tmp_path)}, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "reward: my_team:reward" in (run_dir / "config.yaml").read_text()
    bad = marl_llm(["task=team", "task.prompts=my_team:nope", "task.reward=my_team:reward",
                    f"task.data.files.train={tmp_path / 'rows.jsonl'}", *tiny(tiny_model_dir, tmp_path / "bad")],
                   {"PYTHONPATH": str(tmp_path)}, tmp_path)
    assert bad.returncode == 2 and "my_team has no 'nope'" in bad.stderr and "Traceback" not in bad.stderr
    unnamed = marl_llm(["task=team", f"task.data.files.train={tmp_path / 'rows.jsonl'}",
                        *tiny(tiny_model_dir, tmp_path / "unnamed")], {}, tmp_path)
    assert unnamed.returncode == 2 and "task.prompts=<module>:<function>" in unnamed.stderr


def test_the_python_api_names_a_run_dir_as_the_console_script_does():
    """Without run_dir, marl_llm.train picks Hydra's default pattern, filled in (not `${now:...}`)."""
    from datetime import datetime

    from marl_llm.api import new_run_dir

    path = new_run_dir()
    assert path.parts[:2] == ("outputs", datetime.now().strftime("%Y-%m-%d")) and "$" not in str(path)


@pytest.mark.parametrize("args, expected", [
    (["task=x", "--help"], ["S", "task=x", "--help"]),
    (["--cfg", "job"], ["S", "--cfg", "job"]),
    (["algo=a", "--cfg", "job", "--resolve"], ["S", "algo=a", "--cfg", "job", "--resolve"]),
    (["--info", "searchpath"], ["S", "--info", "searchpath"]),
    (["-m", "-cd", "/d", "seed=0,1"], ["-m", "-cd", "/d", "S", "seed=0,1"]),
    (["--config-name", "config", "~seed"], ["--config-name", "config", "S", "~seed"]),
])
def test_added_overrides_sit_with_the_given_ones(args, expected):
    """Hydra's argparse takes the overrides as one run of positionals: one added after a flag that
    follows them is refused, so the plugins' search path (and the ranks' run dir) goes in front."""
    from marl_llm.configure import add_overrides

    assert add_overrides(args, ["S"]) == expected


@pytest.mark.parametrize("entry, message", [("pkg://no_such_pkg.conf", "names no importable package folder"),
                                            ("file:///no/such/dir", "is not a folder")])
def test_a_plugins_search_path_that_names_no_folder_gets_one_line(tmp_path, monkeypatch, entry, message):
    from marl_llm.config import UserError
    from marl_llm.plugins import load_plugins

    name = f"bad_searchpath_{entry.split(':')[0]}"  # a module of its own per case (Python caches modules)
    (tmp_path / f"{name}.py").write_text(f"CONFIG_SEARCHPATH = {entry!r}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match=f"plugin {name}: CONFIG_SEARCHPATH '{entry}' {message}"):
        load_plugins([name])


@pytest.mark.parametrize("returned, says", [
    ('["Name a fruit.", "  "]', "returned an empty prompt for ['b']"),
    ('{"a": "Name a fruit."}', "returned no prompt for ['b']"),
    ('["Name a fruit."]', "must return 2 strings"),
    ('"Name a fruit."', "must return 2 strings"),
])
def test_a_team_prompt_function_that_returns_no_prompt_for_an_agent_is_named(tmp_path, monkeypatch, returned, says):
    """task.prompts' answer checked per problem: an agent left without a prompt (empty, missing,
    too few) is one line naming the function and the agent, before any sampling."""
    from marl_llm.config import UserError
    from marl_llm.tasks.base import Problem
    from marl_llm.tasks.team import TeamTask

    module = f"my_prompts_{abs(hash(returned))}"  # one module per case: Python caches imports by name
    (tmp_path / f"{module}.py").write_text(f"def prompts(row):\n    return {returned}\n\n"
                                            "def reward(row, texts):\n    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = compose_config(["task=team", "task.agents=[a,b]", f"task.prompts={module}:prompts",
                          f"task.reward={module}:reward", "run_dir=/tmp/p"])
    task = TeamTask(cfg.task)
    with pytest.raises(UserError, match=f"task.prompts={module}:prompts") as err:
        task.initial_prompts(Problem("row-0", {"kind": "fruit"}))
    assert says in str(err.value)
