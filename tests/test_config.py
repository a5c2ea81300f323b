"""The real config composes for every option of every group; bad keys and values fail clearly."""

from __future__ import annotations

import subprocess

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

from conftest import REPO, VENV_BIN, compose_config, required_settings
from marl_llm.cli.train import unknown_key_error
from marl_llm.config import UserError
from marl_llm.configure import validate

GROUPS = ["algo", "task", "model", "logger", "trainer", "experiment", "sweep"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (REPO / "conf" / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes_and_validates(group, option):
    overrides = [f"{group}={option}", "run_dir=/tmp/x"]
    overrides += required_settings(group, option)
    cfg = compose_config(overrides)
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    validate(cfg)
    if group not in ("experiment", "sweep"):  # presets of the root config, not groups of their own
        assert cfg[group].get("name", option) is not None


def test_defaults_are_the_documented_ones():
    cfg = compose_config(["run_dir=/tmp/x"])
    assert (cfg.algo.name, cfg.task.name, cfg.logger.name) == ("magrpo", "humaneval", "wandb")
    assert cfg.model.embedded and cfg.model.name == "smollm2-135m-instruct"
    assert (cfg.task.data.train_split, cfg.task.data.eval_split) == ("test[33:163]", "test[:32]")
    assert cfg.algo.num_turns == 2 and cfg.algo.loss_aggregation == "seq_sum" and cfg.algo.clip_eps is None


def test_paper_preset_sets_the_paper_values():
    cfg = compose_config(["experiment=magrpo_humaneval_paper", "run_dir=/tmp/x"])
    assert cfg.model.hub_id == "Qwen/Qwen2.5-Coder-3B"
    assert cfg.algo.early_termination == -0.2 and cfg.algo.sampling.max_new_tokens == 256


@pytest.mark.parametrize("override", ["algo.lerning_rate=1e-4", "trainer.max_step=3", "model.paht=/x",
                                      "task.sandbox.timeout=3"])
def test_misspelled_key_fails_at_compose_time(override):
    with pytest.raises((ConfigCompositionException, ConfigKeyError)):
        compose_config([override, "run_dir=/tmp/x"])


def test_cli_names_valid_keys_and_the_likely_fix():
    msg = unknown_key_error(["algo.lerning_rate=1e-4"])
    assert "algo.learning_rate" in msg and "num_generations" in msg
    assert "algo.lora.r" in unknown_key_error(["algo.lora.rank=4"])
    assert unknown_key_error(["algo.learning_rate=1e-4", "trainer.max_steps=2", "seed=3"]) is None


@pytest.mark.parametrize("override,key", [
    ("algo.num_generations=1", "algo.num_generations"),
    ("algo.num_turns=0", "algo.num_turns"),
    ("algo.learning_rate=-1e-5", "algo.learning_rate"),
    ("algo.baseline=median", "algo.baseline"),
    ("algo.joint_mode=cross", "algo.joint_mode"),  # cross with the default 2 turns
    ("algo.ppo_epochs=3", "algo.ppo_epochs"),  # without clipping
    ("algo.sampling.top_p=0", "algo.sampling.top_p"),
    ("task.data.train_split='test[50:10]'", "task.data.train_split"),
    ("task.data.source=web", "task.data.source"),
    ("task.feedback=verbose", "task.feedback"),
    ("trainer.eval_k=[1,5]", "trainer.eval_k"),
    ("model.dtype=fp8", "model.dtype"),
])
def test_invalid_values_name_the_key(override, key):
    cfg = compose_config([override, "run_dir=/tmp/x"])
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        validate(cfg)


def test_raw_baseline_allows_a_single_sample():
    validate(compose_config(["algo.num_generations=1", "algo.baseline=raw", "run_dir=/tmp/x"]))


def test_cli_unknown_option_lists_the_valid_ones(tmp_path):
    out = subprocess.run([str(VENV_BIN / "marl-llm"), "algo=nope"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "error: algo=nope is no algo option: the options are " in out.stderr and "magrpo" in out.stderr


def test_cli_invalid_value_exits_2_without_traceback(tmp_path):
    out = subprocess.run([str(VENV_BIN / "marl-llm"), "algo.num_generations=1", "logger=none"], cwd=tmp_path,
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "algo.num_generations" in out.stderr and "Traceback" not in out.stderr


def planned_joint_actions(cfg) -> int:
    """The CoLLM paper's budget: a MAGRPO tree has G + G^2 + ... + G^T nodes per problem, an
    actor-critic episode T turns (both upper bounds when episodes end early)."""
    a, t = cfg.algo, cfg.trainer
    per_problem = sum(a.num_generations ** k for k in range(1, a.num_turns + 1)) if a.name == "magrpo" else a.num_turns
    return t.max_steps * t.prompts_per_step * per_problem


@pytest.mark.parametrize("task", ["strbuild", "tldr", "coophumaneval"])
def test_matched_budget_presets_give_every_method_the_same_joint_actions(task):
    budgets = {algo: planned_joint_actions(compose_config([f"experiment=matched_{task}_{algo}", "run_dir=/tmp/x"]))
               for algo in ("magrpo", "collm_cc", "collm_dc")}
    assert len(set(budgets.values())) == 1, budgets
    if task == "coophumaneval":
        assert budgets["magrpo"] == 10_560  # the paper's example


def test_a_sweep_of_many_overrides_gets_dir_names_the_file_system_takes():
    """Hydra names a sweep's subdir after its overrides; past 255 bytes (NAME_MAX) the job could not
    make its dir. Long ones keep their first whole overrides and a hash of them all: the same
    command finds the same dir, another configuration gets another."""
    from marl_llm.configure import SWEEP_NAME_MAX, sweep_subdir

    many = ",".join([f"algo.key_{i}=[a,b]" for i in range(30)])
    name = sweep_subdir(many, 0)
    first = name.split("/")[0]
    assert len(first.encode()) <= SWEEP_NAME_MAX and name.endswith("/seed=0")
    assert first.startswith("algo.key_0=[a,b],algo.key_1=[a,b],") and "+" in first  # whole overrides, brackets kept
    assert sweep_subdir(many, 0) == name and sweep_subdir(many, 1) == f"{first}/seed=1"
    assert sweep_subdir(many.replace("key_29=[a,b]", "key_29=[a,c]"), 0) != name
    assert sweep_subdir("algo.baseline=rloo", 2) == "algo.baseline=rloo/seed=2" and sweep_subdir("", 2) == "seed=2"
